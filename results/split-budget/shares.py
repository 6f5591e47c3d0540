"""Issue #43 item 3, the gap at the default's bytes: pcanf's code bytes per token split
unevenly between the directions (rows ``pcanf-fwd``: ``pca:budget=10,bwd_budget=30``, 230 B
forward and 76 B back at H = 576; ``pcanf-bwd``: budget=30,bwd_budget=10, the other way;
``pcanf-60``: budget=12.5,bwd_budget=18.8, 184 B forward and 122 back)
against pcanf (153 + 153, the default) and dense of the
tracked long runs, on each domain and seed run (200 steps). Share of dense's gain at each
evaluation = (base - loss) / (base - dense), for the model as deployed (plain), with the
checkpoint's boundary transform (position 0's int8 round trip: the default deployment; step
200) and with the codec on (step 200); and the pipeline bytes per token.

    python results/split-budget/shares.py      # from the repository root; a markdown table per run
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from share_records import curve, pp_bytes, sink_loss  # noqa: E402 (results/share_records.py)

R = "results/"
RUNS = {  # (domain, seed): dense record, pcanf record, pcanf's step-200 losses with the sink round trip
    ("python", 0): (R + "real-long/records/dense-s0.json", R + "real-long/records/pcanf-s0.json",
                    R + "sink-check/mismatch-pcanf-s0-python-step200.jsonl"),
    ("python", 1): (R + "real-long/records/dense-s1.json", R + "real-long/records/pcanf-s1.json",
                    R + "sink-check/mismatch-pcanf-s1-python-step200.jsonl"),
    ("prose", 0): (R + "real-prose-long/records/dense-s0.json", R + "real-prose-long/records/pcanf-s0.json",
                   R + "sink-check/mismatch-pcanf-s0-prose-step200.jsonl"),
    ("prose", 1): (R + "real-prose-long-s1/records/dense-s1.json", R + "real-prose-long-s1/records/pcanf-s1.json",
                   R + "sink-check/mismatch-pcanf-s1-prose-step200.jsonl"),
    ("locales", 0): (R + "far-locales-long/records/dense-s0.json", R + "far-locales-long/records/pcanf-s0.json",
                     R + "far-locales-long/mismatch-pcanf-s0-step200.jsonl"),
    ("locales", 1): (R + "far-locales-long/records/dense-s1.json", R + "far-locales-long/records/pcanf-s1.json",
                     R + "far-locales-long/mismatch-pcanf-s1-step200.jsonl"),
}


NEW_ROWS = {  # row: its record, by domain and seed; (forward, backward) code bytes per token at H = 576
    "pcanf-fwd": (R + "split-budget/{domain}/records/pcanf-fwd-s{seed}.json", "230 + 76 B"),
    "pcanf-bwd": (R + "split-budget/{domain}-bwd/records/pcanf-bwd-s{seed}.json", "76 + 230 B"),
    "pcanf-60": (R + "split-budget/{domain}-60-s{seed}/records/pcanf-60-s{seed}.json", "184 + 122 B"),
}


def table(domain, seed):
    """The markdown table of one run: pcanf and every split row recorded there (none: nothing)."""
    dense_path, pcanf_path, sink_path = RUNS[(domain, seed)]
    paths = {name: path.format(domain=domain, seed=seed) for name, (path, _) in NEW_ROWS.items()}
    rows = {name: json.load(open(p)) for name, p in paths.items() if os.path.isfile(p)}
    if not rows:
        return
    dense, pcanf = json.load(open(dense_path)), json.load(open(pcanf_path))
    base, d = dense["base_loss"], curve(dense)
    share = lambda x, s=200: 100 * (base - x) / (base - d[s])  # noqa: E731
    cols = [("pcanf (153 + 153 B)", pcanf, sink_loss(sink_path))] + \
        [(f"{n} ({NEW_ROWS[n][1]})", r, r["final_loss_boundary"]) for n, r in rows.items()]
    print(f"{domain}, seed {seed}: base {base:.4f}; share of dense's gain (deployed, plain) at each evaluation\n")
    print("| step | dense | " + " | ".join(f"{name} | share" for name, _, _ in cols) + " |")
    print("|---|---|" + "---|---|" * len(cols))
    curves = [curve(r) for _, r, _ in cols]
    for s in sorted(x for x in d if x > 0 and all(x in c for c in curves)):
        print(f"| {s} | {d[s]:.4f} | " + " | ".join(f"{c[s]:.4f} | {share(c[s], s):.1f}%" for c in curves) + " |")
    print("\nstep 200:")
    for name, r, sink in cols:
        print(f"- {name}: with the sink round trip (the default deployment) {sink:.4f} ({share(sink):.1f}%); "
              f"codec on {r['codec_on_loss']:.4f} ({share(r['codec_on_loss']):.1f}%); pp bytes/token {pp_bytes(r):.1f}")
    print()


def main():
    for domain, seed in RUNS:
        table(domain, seed)


if __name__ == "__main__":
    main()
