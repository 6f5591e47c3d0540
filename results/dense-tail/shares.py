"""Issue #43, the codec-free tail on python (seeds 0 and 1, 200 steps): pcanf whose last 10 / 25
steps send dense boundaries (--boundary.dense-tail), against pcanf and dense of the tracked
long runs (the same seed; the tail rows reproduce pcanf's training losses bit for bit up to
their tail). Share of dense's gain at step 200 = (base - loss) / (base - dense), for the
model as deployed (plain), with the checkpoint's boundary transform (position 0's int8 round
trip: the default deployment) and with the codec on; and the pipeline bytes per token.

    python results/dense-tail/shares.py      # from the repository root; a markdown table per seed
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from share_records import curve, pp_bytes, sink_loss  # noqa: E402 (results/share_records.py)

R = "results/"
SEEDS = {  # seed: tracked dense record, tracked pcanf record, pcanf's step 200 with the sink round trip, tail rows
    0: (R + "real-long/records/dense-s0.json", R + "real-long/records/pcanf-s0.json",
        R + "sink-check/mismatch-pcanf-s0-python-step200.jsonl",
        {n: R + f"dense-tail/python/records/pcanf-tail{n}-s0.json" for n in (10, 25)}),
    1: (R + "real-long/records/dense-s1.json", R + "real-long/records/pcanf-s1.json",
        R + "sink-check/mismatch-pcanf-s1-python-step200.jsonl",
        {25: R + "dense-tail/python-s1/records/pcanf-tail25-s1.json"}),
}


def at(rec, step):
    return curve(rec)[step]


def table(seed):
    dense_path, pcanf_path, sink_path, tails = SEEDS[seed]
    dense, pcanf = json.load(open(dense_path)), json.load(open(pcanf_path))
    base, top = dense["base_loss"], at(dense, 200)
    share = lambda x: None if x is None else 100 * (base - x) / (base - top)  # noqa: E731
    rows = [("pcanf (tracked)", at(pcanf, 200), sink_loss(sink_path), pcanf["codec_on_loss"], pp_bytes(pcanf))]
    for n, path in tails.items():
        if os.path.isfile(path):
            r = json.load(open(path))
            rows.append((f"pcanf, last {n} steps dense", at(r, 200), r.get("final_loss_boundary"), r["codec_on_loss"],
                         pp_bytes(r)))
    rows.append(("dense (tracked)", top, None, None, pp_bytes(dense)))
    ref = pp_bytes(pcanf)
    print(f"seed {seed}: base {base:.4f}, dense at step 200 {top:.4f} (gain {base - top:.4f})\n")
    print("| row | deployed (plain) | share | + sink round trip (default deployment) | share | codec on | share "
          "| pp bytes/token | x pcanf's |")
    print("|---|---|---|---|---|---|---|---|---|")
    f = lambda x, s=".4f": "-" if x is None else format(x, s)  # noqa: E731
    p = lambda x: "-" if x is None else f"{x:.1f}%"  # noqa: E731
    for name, plain, sink, on, b in rows:
        print(f"| {name} | {f(plain)} | {p(share(plain))} | {f(sink)} | {p(share(sink))} | {f(on)} | {p(share(on))} "
              f"| {b:.0f} | {b / ref:.2f} |")
    print()


def main():
    for seed in SEEDS:
        table(seed)


if __name__ == "__main__":
    main()
