"""The report of ``python -m orchestration.experiments``: the table (mean +- sd over
seeds), the CSV and the plots, rebuilt from the complete result records that match the
settings."""
from __future__ import annotations

import csv
import glob
import json
import math
import os
import statistics

from orchestration.codecs import pp_ratios
from orchestration.experiments.rows import GROUPS, RECORDS, ROW_BY_NAME, ROWS, Settings, load_result


def _mean_sd(xs: list[float]) -> tuple[float, float]:
    m = statistics.fmean(xs)
    return m, (statistics.stdev(xs) if len(xs) > 1 else float("nan"))


def _fmt(xs: list[float], digits: int = 3) -> str:
    if not xs:
        return "-"
    m, sd = _mean_sd(xs)
    if math.isnan(sd) or max(xs) == min(xs):  # one seed, or exact counts identical in every seed
        return f"{m:.{digits}f}"
    return f"{m:.{digits}f} ± {sd:.{digits}f}"


def gain_share(loss: float, base: float, dense_loss: float) -> float:
    """Share of dense's gain a row keeps: (base - loss) / (base - dense_loss), the
    headline quality figure of issue #43 (unlike the loss gap it does not grow with how far
    the domain is from the base model). NaN when dense gained nothing."""
    gain = base - dense_loss
    return (base - loss) / gain if gain > 0 else float("nan")


def _pct(xs: list[float]) -> str:
    """Shares as percentages, mean ± sd over seeds ("-" if none or any is NaN)."""
    if not xs or any(math.isnan(x) for x in xs):
        return "-"
    return _fmt([100 * x for x in xs], 1) + " %"


def collect(out: str, s: Settings) -> tuple[dict[str, list[dict]], int]:
    """Complete results in OUT/records matching these settings, by row (table order);
    also the count of complete results left out for other settings."""
    by_row: dict[str, list[dict]] = {}
    other = 0
    for p in sorted(glob.glob(os.path.join(out, RECORDS, "*.json"))):
        r = load_result(p)
        if not r or not r.get("complete"):
            continue
        if r.get("settings") != s.key():
            other += 1
            continue
        by_row.setdefault(r["row"], []).append(r)
    ordered = {row.name: sorted(by_row[row.name], key=lambda r: r["seed"]) for row in ROWS if row.name in by_row}
    return ordered, other


def make_table(by_row: dict[str, list[dict]], s: Settings) -> str:
    """The markdown table: mean ± sample sd over seeds."""
    dense = {r["seed"]: r["final_loss"] for r in by_row.get("dense", [])}
    dense_base = {r["seed"]: r["base_loss"] for r in by_row.get("dense", [])}
    prune_cols = [str(f) for f in s.prune]
    has_em = any("exact_match" in r for rs in by_row.values() for r in rs)
    has_codec = any(r.get("codec_on_loss") is not None for rs in by_row.values() for r in rs)
    head = ["row", "seeds", "held-out loss", "Δ vs base", "Δ vs Dense (paired)", "share of Dense's gain (paired)", "ppl",
            "B/tok PP fwd", "B/tok PP bwd", "PP x less than dense fp32 / bf16", "B/tok DP", "B/tok anchor", "B/tok tied", "B/tok total",
            "modeled tok/s @200Mbps", "network-only tok/s"]
    has_state = any("trainable_params" in r for rs in by_row.values() for r in rs)
    if has_state:
        head += ["trainable params", "optimizer MiB / stage"]
    if s.prune:
        head.append("prune " + "/".join(f"{float(f):.0%}" for f in s.prune) + " (loss +%)")
    if has_codec:
        head += ["codec-on loss", "codec-on − deployed", "codec-on share of Dense's gain"]
    if has_em:
        head.append("exact match")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, rs in by_row.items():
        bpt = lambda ax: [r["bytes_per_token"][ax] for r in rs]  # noqa: E731
        paired = [r["final_loss"] - dense[r["seed"]] for r in rs if r["seed"] in dense]
        share = [gain_share(r["final_loss"], dense_base[r["seed"]], dense[r["seed"]]) for r in rs if r["seed"] in dense]
        prune = "-"
        if all("pruning" in r for r in rs):
            prune = " / ".join(_fmt([r["pruning"][c]["loss_increase_pct"] for r in rs], 1) for c in prune_cols)
        cells = [f"{name}", ",".join(str(r["seed"]) for r in rs),
                 _fmt([r["final_loss"] for r in rs]), _fmt([r["final_loss"] - r["base_loss"] for r in rs]),
                 _fmt(paired) if name != "dense" else "0",
                 _pct(share) if name != "dense" else "100 %",
                 _fmt([r["final_perplexity"] for r in rs], 1),
                 _fmt(bpt("pp_fwd"), 1), _fmt(bpt("pp_bwd"), 1), _ratio_cell(rs, s), _fmt(bpt("dp"), 1), _fmt(bpt("anchor"), 1),
                 _tied_cell(rs), _fmt([r["bytes_per_token_total"] for r in rs], 1),
                 _fmt([r["modeled_tokens_per_s"] for r in rs], 0),
                 _fmt([r["network_bound_tokens_per_s"] for r in rs], 0)]
        if has_state:
            r0 = rs[0]
            cells += [f"{r0['trainable_params']:,} ({100 * r0['trainable_params'] / r0['params']:.1f} %)"
                      if "trainable_params" in r0 else "-",
                      " / ".join(f"{b / 2**20:.1f}" for b in r0["optimizer_bytes"]) if "optimizer_bytes" in r0 else "-"]
        if s.prune:
            cells.append(prune)
        if has_codec:
            co = [r for r in rs if r.get("codec_on_loss") is not None]
            cells += [_fmt([r["codec_on_loss"] for r in co]) if co else "= deployed (dense codec)",
                      _fmt([r["codec_on_loss"] - r["final_loss"] for r in co]) if co else "0",
                      _pct([gain_share(r["codec_on_loss"], dense_base[r["seed"]], dense[r["seed"]])
                            for r in co if r["seed"] in dense]) if co else "-"]
        if has_em:
            cells.append(", ".join(f"{t} {_fmt([r['exact_match'][t] for r in rs])}"
                                   for t in (rs[0].get("exact_match") or {})) or "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _ratio_cell(rs: list[dict], s: Settings) -> str:
    """How many times fewer PP bytes than a dense fp32 / bf16 pipeline (codecs.pp_ratios,
    from each record's own H and the settings' stages: records from before the ratio
    was recorded get it too)."""
    rat = [pp_ratios(r["bytes_per_token"]["pp_fwd"] + r["bytes_per_token"]["pp_bwd"], r["hidden_size"],
                     [s.stages] * s.fast_rows) for r in rs]
    if any(x["float32"] is None for x in rat):
        return "-"
    return f"{_fmt([x['float32'] for x in rat], 1)} / {_fmt([x['bfloat16'] for x in rat], 1)}"


def _tied_cell(rs: list[dict]) -> str:
    """The tied-embedding axis; records written before it was counted lack it ("not counted")."""
    tied = [r["bytes_per_token"].get("tied") for r in rs]
    return "not counted" if None in tied else _fmt(tied, 1)


def make_curve_table(by_row: dict[str, list[dict]]) -> str:
    """Held-out loss of the deployed (unmasked) model at every evaluated step, mean ± sd
    over seeds; Δ vs the base model (step 0) and vs Dense at the same step, paired by seed."""
    steps = sorted({p["step"] for rs in by_row.values() for r in rs for p in r["curve"]})

    def at(r, st):
        return next((p["loss"] for p in r["curve"] if p["step"] == st), None)

    dense = {r["seed"]: r for r in by_row.get("dense", [])}
    head = ["row", "seeds"] + [f"loss @ step {st}" for st in steps]
    head += [f"Δ vs base @ {st}" for st in steps if st] + [f"Δ vs Dense @ {st} (paired)" for st in steps if st]
    head += [f"share of Dense's gain @ {st} (paired)" for st in steps if st]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, rs in by_row.items():
        cells = [name, ",".join(str(r["seed"]) for r in rs)]
        cells += [_fmt([x for x in (at(r, st) for r in rs) if x is not None]) for st in steps]
        cells += [_fmt([at(r, st) - r["base_loss"] for r in rs if at(r, st) is not None]) for st in steps if st]
        for st in steps:
            if not st:
                continue
            d = [at(r, st) - at(dense[r["seed"]], st) for r in rs
                 if r["seed"] in dense and at(r, st) is not None and at(dense[r["seed"]], st) is not None]
            cells.append("0" if name == "dense" else _fmt(d))
        for st in steps:
            if not st:
                continue
            sh = [gain_share(at(r, st), dense[r["seed"]]["base_loss"], at(dense[r["seed"]], st)) for r in rs
                  if r["seed"] in dense and at(r, st) is not None and at(dense[r["seed"]], st) is not None]
            cells.append("100 %" if name == "dense" else _pct(sh))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_csv(by_row: dict[str, list[dict]], path: str) -> None:
    cols = ["row", "group", "seed", "base_loss", "final_loss", "final_perplexity", "bpt_pp_fwd", "bpt_pp_bwd",
            "bpt_dp", "bpt_anchor", "bpt_tied", "bpt_total", "modeled_tokens_per_s", "network_bound_tokens_per_s",
            "measured_tokens_per_s", "modeled_limit", "train_wall_s", "codec_on_loss", "curve_step_loss"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for rs in by_row.values():
            for r in rs:
                b = r["bytes_per_token"]
                w.writerow([r["row"], r["group"], r["seed"], r["base_loss"], r["final_loss"], r["final_perplexity"],
                            b["pp_fwd"], b["pp_bwd"], b["dp"], b["anchor"], b.get("tied"), r["bytes_per_token_total"],
                            r["modeled_tokens_per_s"], r["network_bound_tokens_per_s"],
                            r["measured_tokens_per_s"], r["modeled_limit"], r.get("train_wall_s"),
                            r.get("codec_on_loss"),
                            " ".join(f"{p['step']}:{p['loss']:.6f}" for p in r["curve"])])


def make_plots(by_row: dict[str, list[dict]], fig_dir: str) -> list[str]:
    """Per group: held-out loss vs tokens and vs modeled wall-clock (mean over seeds,
    band = min..max). Returns the written paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(fig_dir, exist_ok=True)
    written = []
    for group in GROUPS:
        names = [n for n in by_row if ROW_BY_NAME[n].group == group]
        if group != "main" and names:  # compare against the main rows they vary
            names = [n for n in ("dense", "m95", "m95-ap") if n in by_row] + names
        if not names:
            continue
        for xkey, xlabel, fname in (("tokens", "training tokens (fast circuit)", "loss_vs_tokens"),
                                    ("modeled_s", "modeled wall-clock at 200 Mbps [s]", "loss_vs_wallclock")):
            fig, ax = plt.subplots(figsize=(7, 4.5))
            colors = plt.get_cmap("tab10" if len(names) <= 10 else "tab20").colors  # distinct per row
            for i, n in enumerate(names):
                rs = by_row[n]
                steps = sorted(set.intersection(*[{p["step"] for p in r["curve"]} for r in rs]))
                xs, mean, lo, hi = [], [], [], []
                for st in steps:
                    pts = [next(p for p in r["curve"] if p["step"] == st) for r in rs]
                    xs.append(statistics.fmean(p[xkey] for p in pts))
                    ls = [p["loss"] for p in pts]
                    mean.append(statistics.fmean(ls))
                    lo.append(min(ls))
                    hi.append(max(ls))
                line, = ax.plot(xs, mean, marker="o", ms=3, color=colors[i % len(colors)], label=f"{n} (n={len(rs)})")
                if len(rs) > 1:
                    ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("held-out loss (adaptation domain)")
            ax.set_title(f"{group} rows: mean over seeds, band = min..max")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            fig.tight_layout()
            p = os.path.join(fig_dir, f"{group}_{fname}.png")
            fig.savefig(p, dpi=110)
            plt.close(fig)
            written.append(p)
        ref = {"baseline": "m95", "ablation": "m95-ap"}.get(group)
        if ref in by_row:  # the small differences between variants, paired by seed
            p = _paired_bars(plt, by_row, [n for n in names if ROW_BY_NAME[n].group == group], ref,
                             os.path.join(fig_dir, f"{group}_paired_delta.png"))
            if p:
                written.append(p)
    p = _codec_on_bars(plt, by_row, os.path.join(fig_dir, "codec_on_vs_deployed.png"))
    if p:
        written.append(p)
    p = _gap_vs_step(plt, by_row, os.path.join(fig_dir, "gap_vs_dense.png"))
    if p:
        written.append(p)
    return written


def paired_gaps(by_row: dict[str, list[dict]], ref: str = "dense") -> dict[str, list[tuple]]:
    """Per row (``ref`` excluded): [(step, mean, min, max, n)] of the row's held-out loss
    minus ``ref``'s at the same step and seed, over the seeds both have, at the steps every
    such pair evaluated. Rows with no seed in common with ``ref`` are left out."""
    refs = {r["seed"]: {p["step"]: p["loss"] for p in r["curve"]} for r in by_row.get(ref, [])}
    out = {}
    for n, rs in by_row.items():
        pairs = [({p["step"]: p["loss"] for p in r["curve"]}, refs[r["seed"]]) for r in rs
                 if n != ref and r["seed"] in refs]
        if not pairs:
            continue
        steps = sorted(set.intersection(*[set(a) & set(b) for a, b in pairs]))
        pts = []
        for st in steps:
            d = [a[st] - b[st] for a, b in pairs]
            pts.append((st, statistics.fmean(d), min(d), max(d), len(d)))
        out[n] = pts
    return out


def _gap_vs_step(plt, by_row, path):
    """Held-out loss minus dense's, same seed, at every evaluation (mean, band = min..max),
    beside 1% of dense's loss (issue #28's goal line). None without dense and a paired row."""
    gaps = paired_gaps(by_row)
    if not gaps:
        return None
    dense = {}
    for r in by_row["dense"]:
        for p in r["curve"]:
            dense.setdefault(p["step"], []).append(p["loss"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = plt.get_cmap("tab10" if len(gaps) <= 10 else "tab20").colors
    for i, (n, pts) in enumerate(gaps.items()):
        st, mean, lo, hi, k = zip(*pts)
        line, = ax.plot(st, mean, marker="o", ms=3, color=colors[i % len(colors)], label=f"{n} (n={max(k)})")
        if max(k) > 1:
            ax.fill_between(st, lo, hi, color=line.get_color(), alpha=0.15)
    st = sorted(dense)
    ax.plot(st, [0.01 * statistics.fmean(dense[x]) for x in st], ls="--", color="gray", label="1% of dense's loss")
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out loss minus dense (same seed)")
    ax.set_title("gap to dense, paired by seed (mean, band = min..max)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _codec_on_bars(plt, by_row, path):
    """Final held-out loss per row: base model, deployed (unmasked) model and, for rows
    trained through a lossy boundary codec, the same model scored with that codec on
    (mean over seeds, error bar = sd). None when no row has a codec-on loss."""
    names = list(by_row)
    if not any(r.get("codec_on_loss") is not None for n in names for r in by_row[n]):
        return None
    import numpy as np

    def ms(xs):
        return (statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0) if xs else (float("nan"), 0.0)

    base = [ms([r["base_loss"] for r in by_row[n]]) for n in names]
    dep = [ms([r["final_loss"] for r in by_row[n]]) for n in names]
    con = [ms([r["codec_on_loss"] for r in by_row[n] if r.get("codec_on_loss") is not None]) for n in names]
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for off, vals, lab, col in ((-0.27, base, "base model (step 0)", "tab:gray"),
                                (0.0, dep, "deployed (unmasked) after training", "tab:blue"),
                                (0.27, con, "same model, training-time codec on", "tab:red")):
        ax.bar(x + off, [m for m, _ in vals], 0.26, yerr=[sd for _, sd in vals], capsize=3, label=lab, color=col,
               alpha=0.8)
    ax.set_xticks(x, [f"{n} (n={len(by_row[n])})" for n in names])
    ax.set_ylabel("held-out loss")
    ax.set_title("final model: deployed vs codec-on (train/test mismatch)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _paired_bars(plt, by_row, names, ref, path):
    """Bar chart: final held-out loss minus the reference row's, same seed (mean ± sd)."""
    refs = {r["seed"]: r["final_loss"] for r in by_row[ref]}
    rows = []
    for n in names:
        d = [r["final_loss"] - refs[r["seed"]] for r in by_row[n] if r["seed"] in refs]
        if d:
            rows.append((n, statistics.fmean(d), statistics.stdev(d) if len(d) > 1 else 0.0, len(d)))
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.5))
    ax.barh([f"{n} (n={k})" for n, _, _, k in rows], [m for _, m, _, _ in rows],
            xerr=[sd for _, _, sd, _ in rows], color="tab:blue", alpha=0.7, capsize=3)
    ax.axvline(0, color="black", lw=0.8)
    ax.invert_yaxis()
    ax.set_xlabel(f"final held-out loss minus {ref} (same seed); error bar = sd over seeds")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(a, s: Settings) -> None:
    by_row, other = collect(a.out, s)
    if not by_row:
        print("no complete results for these settings yet; nothing to tabulate", flush=True)
        return
    table = make_table(by_row, s) + "\nHeld-out loss of the deployed model at every evaluation:\n\n" \
        + make_curve_table(by_row)
    header = (f"<!-- generated by python -m orchestration.experiments; settings: {json.dumps(s.key())} -->\n")
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(header + table)
    write_csv(by_row, os.path.join(a.out, "summary.csv"))
    figs = make_plots(by_row, a.figures)
    print("\n" + table, flush=True)
    print(f"wrote {os.path.join(a.out, 'table.md')}, {os.path.join(a.out, 'summary.csv')}, "
          + ", ".join(figs) + (f" ({other} complete results with other settings left out)" if other else ""),
          flush=True)
