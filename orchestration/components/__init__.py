"""The trainer's parts that are not distributed machinery: what it builds, guards, saves and reports.

Modules: builders (stage, optimizer, compressor and sampler from a config), divergence
(the loss/gradient guard), checkpoint (atomic, hashed checkpoints and exact resume),
metrics (per-step records, link byte totals), run_summary (the end-of-run summary) and
calibration (the pca codec's basis, fitted once on the model as loaded).
"""
