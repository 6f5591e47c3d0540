"""Paired M95+AP - M95 held-out loss at every evaluation step of the runs in
docs/results/long/s320/records (same seed = same held-out sequences and data order).

Writes paired_delta_by_step.csv next to this file and, if a figure directory is given,
paired_delta_by_step.png there. Usage (repo root):
    python docs/results/long/s320/paired_delta.py docs/figures/long/s320
"""
import csv
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def curve(row, seed):
    rec = json.loads((HERE / "records" / f"{row}-s{seed}.json").read_text())
    return {p["step"]: p["loss"] for p in rec["curve"]}


def main():
    seeds = sorted({int(p.stem.rsplit("-s", 1)[1]) for p in (HERE / "records").glob("m95-ap-s*.json")})
    seeds = [s for s in seeds if (HERE / "records" / f"m95-s{s}.json").exists()]
    per_seed = {s: (curve("m95", s), curve("m95-ap", s)) for s in seeds}
    steps = sorted(set.intersection(*(set(a) & set(b) for a, b in per_seed.values())))
    rows = []
    for st in steps:
        d = [per_seed[s][1][st] - per_seed[s][0][st] for s in seeds]
        sd = statistics.stdev(d) if len(d) > 1 else 0.0
        rows.append([st] + [f"{x:.4f}" for x in d] + [f"{statistics.mean(d):.4f}", f"{sd:.4f}"])
    with open(HERE / "paired_delta_by_step.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step"] + [f"delta_s{s}" for s in seeds] + ["mean", "sd"])
        w.writerows(rows)
    for r in rows:
        print(*r, sep="\t")
    if len(sys.argv) > 1:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for i, s in enumerate(seeds):
            ax.plot(steps, [float(r[1 + i]) for r in rows], "o-", alpha=0.5, label=f"seed {s}")
        ax.plot(steps, [float(r[-2]) for r in rows], "k-", lw=2, label="mean")
        ax.axhline(0, color="gray", lw=0.8)
        ax.set_xlabel("fast-circuit step")
        ax.set_ylabel("held-out loss, M95+AP - M95 (nats)")
        ax.set_title("Paired anchor effect vs training horizon")
        ax.legend(fontsize=8)
        fig.tight_layout()
        out = Path(sys.argv[1]) / "paired_delta_by_step.png"
        fig.savefig(out, dpi=110)
        print("wrote", out)


if __name__ == "__main__":
    main()
