"""The README's results figure and table, computed from the tracked run records.

    python scripts/results_figure.py                 # writes docs/figures/loss_vs_bytes.png, prints the table

Reads results/<set>/records/<row>-s<seed>.json (written by ``python -m orchestration.experiments``;
each record holds the exact trainer command, the held-out loss curve and the byte counters) and
nothing else: every figure of the README's table and plot comes from these files. Gaps are paired
by seed (same held-out rows, same data order) against the dense row of the same set.

Left panel: SmolLM2-135M, corpus:python, 1 fast replica x 2 stages, 200 steps, held-out loss of
the deployed model at step 200 against the pipeline-boundary bytes per token (forward +
backward, the pca basis's one-off bytes included). Right panel: the data-parallel axis, two
fast replicas (2 x 2 mesh, 20 steps): a dense gradient all-reduce every step against Streaming
DiLoCo + PowerSGD.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# (label, results set, row, note): the README table, in this order
TABLE = [
    ("dense (fp32 boundaries)", "real-long", "dense", ""),
    ("`pca`, the default", "real-long", "pcanf", ""),
    ("`pca` + anchor", "real-long", "pcanf-ap", "+76 kB/token on the anchor axis, off the critical path"),
    ("`pca:budget=12` + anchor", "real-long", "pcanf-b12-ap", "+76-81 kB/token anchor axis"),
    ("`m95`, the paper's mask", "real-long", "m95", ""),
    ("`m95` + anchor (the paper's M95+AP)", "real-long", "m95-ap", "+76 kB/token anchor axis"),
    ("`pca`, corpus:prose", "real-prose-long", "pcanf", ""),
    ("`pca` + anchor, corpus:prose", "real-prose-long", "pcanf-ap", "+76 kB/token anchor axis"),
    ("+DP: DiLoCo + PowerSGD vs all-reduce", "real-dp", "dp", "2 x 2 mesh, dense boundaries"),
]


def load(results: str, name: str) -> dict:
    """{row: {seed: record}} of one results set."""
    out: dict = {}
    folder = os.path.join(results, name, "records")
    for f in sorted(os.listdir(folder)):
        if f.endswith(".json"):
            with open(os.path.join(folder, f)) as fh:
                r = json.load(fh)
            if r.get("complete"):
                out.setdefault(r["row"], {})[r["seed"]] = r
    return out


def pp_bytes(r: dict) -> float:
    b = r["bytes_per_token"]
    return b["pp_fwd"] + b["pp_bwd"]


def bf16_ratio(r: dict) -> float:
    from orchestration.codecs.base import pp_ratios
    return pp_ratios(pp_bytes(r), r["hidden_size"], [r["settings"]["stages"]])["bfloat16"]


def summary(sets: dict, name: str, row: str) -> dict:
    """Paired gap to the set's dense row at the last evaluation, over the seeds both have."""
    recs, dense = sets[name][row], sets[name]["dense"]
    seeds = sorted(s for s in recs if s in dense)
    gaps = [(recs[s]["final_loss"] - dense[s]["final_loss"]) / dense[s]["final_loss"] for s in seeds]
    shares = [(recs[s]["base_loss"] - recs[s]["final_loss"]) / (dense[s]["base_loss"] - dense[s]["final_loss"])
              for s in seeds]
    r0 = recs[seeds[0]]
    return {"seeds": seeds, "gap": statistics.mean(gaps), "shares": shares, "rec": r0,
            "loss": statistics.mean(recs[s]["final_loss"] for s in seeds),
            "steps": r0["curve"][-1]["step"], "base": r0["base_loss"]}


def table(sets: dict) -> str:
    lines = ["| row | boundary bytes vs dense bf16 | held-out loss gap to dense | share of dense's gain | "
             "steps, seeds | records |",
             "|---|---|---|---|---|---|"]
    for label, name, row, note in TABLE:
        s = summary(sets, name, row)
        r = s["rec"]
        if row == "dp":
            dense = sets[name]["dense"][s["seeds"][0]]
            ratio = (f"DP axis {r['bytes_per_token']['dp']:,.0f} B/token vs "
                     f"{dense['bytes_per_token']['dp'] / 1e6:.2f} MB/token")
        else:
            x = bf16_ratio(r)
            ratio = f"{x:.1f}x less" if x >= 1 else f"fp32: {1 / x:.0f}x the bf16 bytes"
        share = "worse than the base model" if max(s["shares"]) < 0 else \
            " / ".join(f"{100 * v:.0f}%" for v in s["shares"])
        gap = "0" if row == "dense" else f"{100 * s['gap']:+.2f}%"
        seeds = ",".join(str(x) for x in s["seeds"])
        lines.append(f"| {label} | {ratio}{'; ' + note if note else ''} | {gap} | {share} | "
                     f"{s['steps']}, seeds {seeds} | [{name}](results/{name}/records/) `{row}` |")
    return "\n".join(lines)


def plot(sets: dict, out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [2.2, 1]})
    long = sets["real-long"]
    points = [("dense (fp32)", "dense", "k", "o"), ("pca (default)", "pcanf", "tab:blue", "o"),
              ("pca + anchor", "pcanf-ap", "tab:blue", "*"), ("pca:budget=12 + anchor", "pcanf-b12-ap", "tab:cyan", "*"),
              ("m95 (paper's mask)", "m95", "tab:red", "o"), ("m95 + anchor", "m95-ap", "tab:red", "*")]
    for label, row, color, marker in points:
        s = summary(sets, "real-long", row)
        x = pp_bytes(s["rec"])
        losses = [long[row][k]["final_loss"] for k in s["seeds"]]
        ax.scatter([x] * len(losses), losses, color=color, marker=marker, s=90 if marker == "*" else 45,
                   label=f"{label} ({len(losses)} seed{'s' if len(losses) > 1 else ''})", zorder=3)
    base = summary(sets, "real-long", "dense")["base"]
    ax.axhline(base, color="grey", ls="--", lw=1)
    ax.text(65, base + 0.005, "base model (before training)", color="grey", fontsize=8)
    ax.axvline(2 * 576 * 2, color="k", ls=":", lw=1)
    ax.text(2 * 576 * 2 * 0.97, 2.55, "dense bf16 would send", rotation=90, ha="right", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlim(60, 8000)
    ax.set_xlabel("pipeline-boundary bytes per token (forward + backward)")
    ax.set_ylabel("held-out loss at step 200 (lower is better)")
    ax.set_title("SmolLM2-135M, corpus:python, 1 x 2 mesh, 200 steps", fontsize=10)
    ax.legend(fontsize=8, loc="center left")
    ax.grid(alpha=0.3)

    dp = sets["real-dp"]
    for label, row, color in (("all-reduce every step", "dense", "k"), ("DiLoCo + PowerSGD", "dp", "tab:green")):
        seeds = sorted(dp[row])
        bx.scatter([dp[row][k]["bytes_per_token"]["dp"] for k in seeds], [dp[row][k]["final_loss"] for k in seeds],
                   color=color, label=f"{label} ({len(seeds)} seeds)", zorder=3)
    bx.axhline(dp["dense"][0]["base_loss"], color="grey", ls="--", lw=1)
    bx.text(400, dp["dense"][0]["base_loss"] - 0.008, "base model", color="grey", fontsize=8)
    bx.set_xscale("log")
    bx.set_xlim(300, 5e6)
    bx.set_xlabel("data-parallel bytes per token")
    bx.set_ylabel("held-out loss at step 20")
    bx.set_title("+DP: 2 replicas x 2 stages, 20 steps", fontsize=10)
    bx.legend(fontsize=8, loc="center left")
    bx.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(out), exist_ok=True)
    fig.savefig(out, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=os.path.join(ROOT, "results"), help="the records' root folder")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "figures", "loss_vs_bytes.png"))
    a = ap.parse_args(argv)
    sets = {name: load(a.results, name) for name in {t[1] for t in TABLE}}
    print(table(sets))
    plot(sets, a.out)
    print(f"figure: {os.path.relpath(a.out, ROOT)}")


if __name__ == "__main__":
    main()
