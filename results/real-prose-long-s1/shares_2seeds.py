"""Prose, step 200: share of dense's gain ((base - loss) / (base - dense@200), base and dense from the
same seed's dense record) of the deployed pcanf model, codec on, +sink and +span+sink, for seeds 0 and
1, and their 2-seed means (mean of the per-seed shares, and the share of the mean losses).

    python results/real-prose-long-s1/shares_2seeds.py     # from the repository root
"""
import json

R = "results/"
SEEDS = {  # seed: dense record, pcanf record, pcanf step-200 mismatch (codec,sink,span,span+sink)
    0: (R + "real-prose-long/records/dense-s0.json", R + "real-prose-long/records/pcanf-s0.json",
        R + "sink-check/mismatch-pcanf-s0-prose-step200.jsonl"),
    1: (R + "real-prose-long-s1/records/dense-s1.json", R + "real-prose-long-s1/records/pcanf-s1.json",
        R + "sink-check/mismatch-pcanf-s1-prose-step200.jsonl"),
}
COLS = ("deployed", "codec", "sink", "span+sink")


def at(rec, step):
    return next(c["loss"] for c in rec["curve"] if c["step"] == step)


def main():
    rows = {}
    print("| seed | base | dense @200 | deployed | codec on | +sink | +span+sink | share: deployed / codec on / +sink / +span+sink |")
    print("|---|---|---|---|---|---|---|---|")
    for seed, (df, pf, mf) in SEEDS.items():
        dense, pcanf = json.load(open(df)), json.load(open(pf))
        L = next(r for r in (json.loads(x) for x in open(mf) if x.strip()) if r["step"] == 200)["loss"]
        base, d = dense["base_loss"], at(dense, 200)
        assert abs(L["deployed"] - at(pcanf, 200)) < 1e-6, (seed, L["deployed"], at(pcanf, 200))
        assert abs(pcanf["base_loss"] - base) < 1e-9
        vals = [L[c] for c in COLS]
        sh = [100 * (base - x) / (base - d) for x in vals]
        rows[seed] = (base, d, vals, sh)
        print(f"| {seed} | {base:.4f} | {d:.4f} | " + " | ".join(f"{x:.4f}" for x in vals) + " | "
              + " / ".join(f"{x:.1f}%" for x in sh) + " |")
    n = len(rows)
    base = sum(r[0] for r in rows.values()) / n
    d = sum(r[1] for r in rows.values()) / n
    vals = [sum(r[2][i] for r in rows.values()) / n for i in range(len(COLS))]
    sh = [sum(r[3][i] for r in rows.values()) / n for i in range(len(COLS))]
    print(f"| mean | {base:.4f} | {d:.4f} | " + " | ".join(f"{x:.4f}" for x in vals) + " | "
          + " / ".join(f"{x:.1f}%" for x in sh) + " (mean of shares; share of the mean losses: "
          + " / ".join(f"{100 * (base - x) / (base - d):.1f}%" for x in vals) + ") |")


if __name__ == "__main__":
    main()
