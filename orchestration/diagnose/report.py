"""The written results of a run: the text table (printed and ``table.txt``), the markdown
table of the candidates, and the plots, all drawn from a report dict alone, so a saved
``report.json`` can be drawn again (``--replot``).
"""
from __future__ import annotations

import os
from typing import Sequence

from orchestration.diagnose.common import fmt, log
from orchestration.diagnose.plots import write_plots


def format_table(rep: dict) -> str:
    spec = rep.get("model_spec")
    lines = [f"model {spec + ' = ' if spec else ''}{rep['model']} ({rep['layers']} layers, hidden {rep['hidden']}); "
             f"data {rep.get('data', '?')}; "
             f"eval rows {rep['rows']['eval']}", f"base held-out loss {rep['base_loss']:.4f} "
             f"(unsplit model {rep['base_loss_unsplit_model']:.4f}); budget {rep['budget']} of dense = "
             f"{rep['budget_bytes_per_token']} bytes/token"]
    for L, b in rep["boundaries"].items():
        st = b["stats"]
        lines.append("")
        lines.append(f"boundary before layer {L} (depth {b['depth']:.2f}; splits {b['in_splits'] or '-'}): "
                     f"massive dims {st['massive_dims']}, top |h| {', '.join(f'{v:.0f}' for v in st['top_dims_mean_abs'][:4])}"
                     f" vs median {st['dim_mean_abs_median']:.2f}; outlier tokens {st['outlier_tokens']}; "
                     f"PR {st['spectrum']['participation_ratio']:.1f}, entropy rank {st['spectrum']['entropy_rank']:.1f}; "
                     "energy " + ", ".join(f"{f} {v:.4f}" for f, v in st["energy_held_out"].items()) + " (held out)")
        if "boundary_gradient_energy" in st:
            ge = st["boundary_gradient_energy"]
            lines.append("  held-out boundary gradient energy in the top-k directions: " + ", ".join(
                f"k={ge['k'][f]}: activation PCA {ge['activation_pca'][f]:.3f} / gradient PCA {ge['gradient_pca'][f]:.3f}"
                for f in ge["k"]))
        lines.append(f"  {'transform':26s} {'bytes':>6s} {'loss':>7s} {'delta':>7s} {'+-':>5s}  "
                     f"{'gcos pre':>8s} {'grelerr':>7s} {'gcos bnd':>8s} {'gcos post':>9s}")
        for r in b["transforms"]:
            g = r.get("grad") or {}
            lines.append(f"  {r['name']:26s} {r['fraction_of_dense_fwd']:6.3f} {r['loss']:7.3f} {r['delta']:+7.3f} "
                         f"{fmt(r['delta_se'], 2):>5s}  {fmt(g.get('prefix', {}).get('cos')):>8s} "
                         f"{fmt(g.get('prefix', {}).get('rel_err'), 2):>7s} {fmt(g.get('boundary', {}).get('cos')):>8s} "
                         f"{fmt(g.get('suffix', {}).get('cos')):>9s}")
    for y, a in rep["anchor"].items():
        t = a["per_tau"][f"{a['tau']:g}"]
        k = f"alpha={a['alpha']:g}"
        lines.append("")
        lines.append(f"anchor, {y}-stage split ({a['codec']} at every boundary; M_anc from {a['anchor_batches']} dense "
                     f"gradients, rank {a['rank']}; tau {a['tau']:g}, alpha {a['alpha']:g}): masked loss "
                     f"{a['loss_masked']:.3f} vs dense {a['loss_dense']:.3f}")
        lines.append(f"  cos(G_masked, G_dense) {fmt(a['masked_vs_dense']['cos'])} -> after filter "
                     f"{fmt(t[k]['filtered_masked_vs_dense']['cos'])} (pure filter {fmt(t['alpha=0']['filtered_masked_vs_dense']['cos'])}); "
                     f"cos(filter(G_dense), G_dense) {fmt(t[k]['filtered_dense_vs_dense']['cos'])}; "
                     f"cos(M_anc, G_dense) {fmt(a['momentum_vs_dense']['cos'])}")
        sv = a["singular_values_summary"]
        lines.append(f"  singular values of M_anc: max {sv['max']:.3g}, median top {sv['median_top']:.3g}, median "
                     f"{sv['median_all']:.3g}; share above tau {t['frac_singular_values_above_tau']:.2f}, mean gain "
                     f"{t['gain_mean']:.3f}; energy kept by the filter: masked {t['energy_kept_masked']:.3g}, dense "
                     f"{t['energy_kept_dense']:.3g}")
        lines.append("  tau sweep (cos after filter, alpha " + f"{a['alpha']:g}): " + ", ".join(
            f"{tt}: {fmt(r[k]['filtered_masked_vs_dense']['cos'])}" for tt, r in a["per_tau"].items()))
    if rep["layer_scan"]:
        names = list(next(iter(rep["layer_scan"].values()))["losses"])
        lines.append("")
        lines.append("layer scan: " + " | ".join(names))
        for L, r in rep["layer_scan"].items():
            lines.append(f"  {int(L):3d} PR {r['stats']['spectrum']['participation_ratio']:7.1f}  "
                         + "  ".join(fmt(r["losses"].get(nm)) for nm in names))
    return "\n".join(lines)


def candidate_table(reps: Sequence[dict]) -> str:
    """Markdown: loss of every candidate (and the mask baselines) per boundary, several reports."""
    out = []
    for rep in reps:
        bs = list(rep["boundaries"])
        names = []
        for b in rep["boundaries"].values():
            for r in b["transforms"]:
                if r["name"] not in names and (r["kind"] == "candidate" or r["name"] in ("dense",)
                                               or r["name"].startswith("mask")):
                    names.append(r["name"])
        out.append(f"{rep['model']} / {rep.get('data', '?')}: base {rep['base_loss']:.3f}")
        out.append("| transform | bytes | " + " | ".join(f"L={b}" for b in bs) + " |")
        out.append("|---|---|" + "---|" * len(bs))
        for nm in names:
            cells, frac = [], None
            for b in bs:
                hit = [r for r in rep["boundaries"][b]["transforms"] if r["name"] == nm]
                cells.append(f"{hit[0]['loss']:.3f}" if hit else "")
                frac = hit[0]["fraction_of_dense_fwd"] if hit else frac
            out.append(f"| {nm} | {frac:.3f} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def write_outputs(rep: dict, out: str, plots: bool = True) -> None:
    """Print the table; write table.txt (+ the candidate table) and the plots under ``out``."""
    table = format_table(rep)
    print(table)
    with open(os.path.join(out, "table.txt"), "w") as f:
        f.write(table + "\n\n" + candidate_table([rep]))
    files = write_plots(rep, out) if plots else []
    log(f"wrote {out}: report.json, table.txt, {len(files)} plots")
