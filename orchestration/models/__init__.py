"""Models: loading local Hugging Face / GGUF checkpoints, the built-in and default base models, scoring.

Modules: loading (load_causal_lm, configs, the cache root), paths (resolve_model: what
--model names), gguf_convert (GGUF -> HF safetensors, the built-in models), pretrain
(the default base model, built once), scoring (held-out loss of a model or a chain
of stages) and boundary_transform (position 0's int8 round trip at the boundary layers, which
a model trained through a pca codec with a sink row is deployed with: meshkern_boundary.json).
"""
