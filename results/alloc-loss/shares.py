"""Issue #43 item 3, the gap at the default's bytes: pcanf with the forward's code widths
allocated by loss sensitivity (``pca:alloc=loss``, row ``pcanf-loss``) against pcanf
(``alloc=var``, the default) and dense of the tracked long runs on python (the same seed,
200 steps). Share of dense's gain at each evaluation = (base - loss) / (base - dense), for
the model as deployed (plain), with the checkpoint's boundary transform (position 0's int8
round trip: the default deployment; step 200 only) and with the codec on (step 200); and
the pipeline bytes per token.

    python results/alloc-loss/shares.py      # from the repository root; a markdown table per seed
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from share_records import curve, pp_bytes, sink_loss  # noqa: E402 (results/share_records.py)

R = "results/"
SEEDS = {  # seed: dense record, pcanf record, pcanf's step-200 loss with the sink round trip, the pcanf-loss record
    0: (R + "real-long/records/dense-s0.json", R + "real-long/records/pcanf-s0.json",
        R + "sink-check/mismatch-pcanf-s0-python-step200.jsonl", R + "alloc-loss/python/records/pcanf-loss-s0.json"),
    1: (R + "real-long/records/dense-s1.json", R + "real-long/records/pcanf-s1.json",
        R + "sink-check/mismatch-pcanf-s1-python-step200.jsonl", R + "alloc-loss/python-s1/records/pcanf-loss-s1.json"),
}



def table(seed):
    dense_path, pcanf_path, sink_path, loss_path = SEEDS[seed]
    if not os.path.isfile(loss_path):
        return
    dense, pcanf, new = (json.load(open(p)) for p in (dense_path, pcanf_path, loss_path))
    base, d, a, b = dense["base_loss"], curve(dense), curve(pcanf), curve(new)
    share = lambda x, s: None if x is None else 100 * (base - x) / (base - d[s])  # noqa: E731
    steps = [s for s in sorted(d) if s in a and s in b and s > 0]
    print(f"seed {seed}: base {base:.4f}; share of dense's gain (deployed, plain) at each evaluation\n")
    print("| step | dense | pcanf (alloc=var) | share | pcanf-loss (alloc=loss) | share |")
    print("|---|---|---|---|---|---|")
    for s in steps:
        print(f"| {s} | {d[s]:.4f} | {a[s]:.4f} | {share(a[s], s):.1f}% | {b[s]:.4f} | {share(b[s], s):.1f}% |")
    print(f"\nstep 200: with the sink round trip (the default deployment) pcanf {sink_loss(sink_path):.4f} "
          f"({share(sink_loss(sink_path), 200):.1f}%), pcanf-loss {new['final_loss_boundary']:.4f} "
          f"({share(new['final_loss_boundary'], 200):.1f}%); codec on pcanf {pcanf['codec_on_loss']:.4f} "
          f"({share(pcanf['codec_on_loss'], 200):.1f}%), pcanf-loss {new['codec_on_loss']:.4f} "
          f"({share(new['codec_on_loss'], 200):.1f}%); pp bytes/token {pp_bytes(pcanf):.1f} / {pp_bytes(new):.1f}\n")


def main():
    for seed in SEEDS:
        table(seed)


if __name__ == "__main__":
    main()
