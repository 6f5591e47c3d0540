"""The PNG figures of a report (``write_plots``): loss vs bytes per boundary, the
candidates against the mask, activation magnitudes and PCA energy, PCA loss vs k, gradient
error, the anchor filter and the layer scan; each drawn only when the report holds its
data. Uses matplotlib's Agg backend (no display needed), imported only when drawing.
"""
from __future__ import annotations

import os

import torch

from orchestration.diagnose.anchor import TAU_SWEEP
from orchestration.diagnose.stats import k_fractions


def write_plots(rep: dict, out: str) -> list[str]:
    """PNG figures under ``out``; returns their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    spec = rep.get("model_spec", "")
    name = spec if spec and not spec.startswith("(") and os.sep not in spec else os.path.basename(rep["model"].rstrip("/"))
    title = f"{name} / {rep.get('data', '')}"
    bs = list(rep["boundaries"])
    H = rep["hidden"]

    def save(fig, name):
        p = os.path.join(out, name)
        fig.savefig(p, dpi=110, bbox_inches="tight")
        plt.close(fig)
        files.append(p)

    if bs:
        # 1. loss vs bytes, every transform, one panel per boundary
        fig, axs = plt.subplots(1, len(bs), figsize=(5.5 * len(bs), 4.6), squeeze=False)
        marks = {"codec": ("o", "tab:blue"), "pca": ("s", "tab:green"), "candidate": ("^", "tab:red")}
        for ax, L in zip(axs[0], bs):
            for r in rep["boundaries"][L]["transforms"]:
                mk, c = marks[r["kind"]]
                x = max(r["fraction_of_dense_fwd"], 1e-4)
                ax.scatter(x, r["loss"], marker=mk, color=c, s=22)
                ax.annotate(r["name"], (x, r["loss"]), fontsize=6, xytext=(3, 2), textcoords="offset points")
            ax.axhline(rep["base_loss"], color="k", lw=0.8, ls="--", label="base")
            ax.axvline(1 / int(rep["budget"].split("/")[1]), color="gray", lw=0.8, ls=":", label=f"budget {rep['budget']}")
            ax.set_xscale("log")
            ax.set_xlabel("bytes per token, fraction of dense (fwd)")
            ax.set_ylabel("held-out loss")
            ax.set_title(f"boundary before layer {L}")
            for kind, (mk, c) in marks.items():
                ax.scatter([], [], marker=mk, color=c, label=kind)
            ax.legend(fontsize=7)
        fig.suptitle(f"{title}: loss with one transform at one boundary")
        save(fig, "loss_vs_bytes.png")

        # 2. candidates at the budget vs the mask baselines
        names = []
        for L in bs:
            for r in rep["boundaries"][L]["transforms"]:
                if (r["kind"] == "candidate" or r["spec"].startswith("mask:p=0.95") or r["kind"] == "codec"
                        and r["name"].startswith("mask") and r["fraction_of_dense_fwd"] <= 1 / 14.5) and r["name"] not in names:
                    names.append(r["name"])
        if names:
            fig, ax = plt.subplots(figsize=(max(8, 0.75 * len(names) * len(bs) / 2), 4.6))
            w = 0.8 / len(bs)
            for i, L in enumerate(bs):
                lk = {r["name"]: r["loss"] for r in rep["boundaries"][L]["transforms"]}
                ax.bar([j + i * w for j in range(len(names))], [lk.get(nm, float("nan")) for nm in names], w,
                       label=f"layer {L}")
            ax.axhline(rep["base_loss"], color="k", lw=0.8, ls="--", label="base (dense)")
            ax.set_ylim(bottom=rep["base_loss"] - 0.05 * max(0.5, ax.get_ylim()[1] - rep["base_loss"]))
            ax.set_xticks([j + w * (len(bs) - 1) / 2 for j in range(len(names))])
            ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
            ax.set_ylabel("held-out loss")
            ax.set_title(f"{title}: candidates at <= {rep['budget']} of dense bytes (and the mask)")
            ax.legend(fontsize=8)
            save(fig, "candidates.png")

        # 3. activations: per-dim magnitude and PCA energy
        fig, axs = plt.subplots(1, 2, figsize=(11, 4.2))
        for L in bs:
            st = rep["boundaries"][L]["stats"]
            axs[0].plot(range(1, H + 1), st["dim_mean_abs_sorted"], label=f"layer {L} (median {st['dim_mean_abs_median']:.2f})")
            ev = torch.tensor(st["eigvals"]).clamp_min(0)
            line, = axs[1].plot(range(1, H + 1), (ev.cumsum(0) / ev.sum()).tolist(), label=f"layer {L}")
            if "energy_in_sample_without_outlier_tokens" in st:
                e2 = st["energy_in_sample_without_outlier_tokens"]
                axs[1].plot([st["k"][f] for f in e2], list(e2.values()), "x--", color=line.get_color(),
                            label=f"layer {L} without its {st['outlier_tokens']} outlier tokens")
        axs[0].set_xscale("log"), axs[0].set_yscale("log")
        axs[0].set_xlabel("dim (sorted by mean |h|)"), axs[0].set_ylabel("mean |h| over tokens")
        axs[0].legend(fontsize=7)
        for f, k in k_fractions(H).items():
            axs[1].axvline(k, color="gray", lw=0.6, ls=":")
            axs[1].text(k, 0.02, f"H{f[1:]}", fontsize=7, color="gray", rotation=90,
                        transform=axs[1].get_xaxis_transform())
        axs[1].set_xscale("log")
        axs[1].set_xlabel("top-k PCA directions (calibration rows)"), axs[1].set_ylabel("share of variance")
        axs[1].legend(fontsize=7)
        fig.suptitle(f"{title}: residual stream at the boundaries")
        save(fig, "activations.png")

        # 4. PCA loss vs k
        fig, ax = plt.subplots(figsize=(6, 4.2))
        for L in bs:
            pts = sorted((int(r["spec"].split("=")[1]), r["loss"]) for r in rep["boundaries"][L]["transforms"]
                         if r["kind"] == "pca")
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"PCA, layer {L}")
            m95 = [r["loss"] for r in rep["boundaries"][L]["transforms"] if r["spec"] == "mask:p=0.95"]
            if m95:
                ax.scatter([round(0.05 * H)], m95, marker="x", label=f"mask p=0.95, layer {L}")
        ax.axhline(rep["base_loss"], color="k", lw=0.8, ls="--", label="base")
        ax.set_xscale("log"), ax.set_xlabel("values per token (k)"), ax.set_ylabel("held-out loss")
        ax.set_title(f"{title}: mean + top-k PCA (fitted on calibration rows)")
        ax.legend(fontsize=7)
        save(fig, "pca_loss.png")

        # 5. gradient error
        if any("grad" in r for L in bs for r in rep["boundaries"][L]["transforms"]):
            fig, axs = plt.subplots(2, 1, figsize=(12, 7), sharex=True)
            names = [r["name"] for r in rep["boundaries"][bs[0]]["transforms"] if "grad" in r]
            w = 0.8 / len(bs)
            for i, L in enumerate(bs):
                g = {r["name"]: r["grad"] for r in rep["boundaries"][L]["transforms"] if "grad" in r}
                xs = [j + i * w for j in range(len(names))]
                axs[0].bar(xs, [(g[nm]["prefix_layers"]["cos"] or 0) if nm in g else 0 for nm in names], w, label=f"layer {L}")
                axs[1].bar(xs, [(g[nm]["boundary"]["cos"] or 0) if nm in g else 0 for nm in names], w, label=f"layer {L}")
            axs[0].set_ylabel("cos, grads of layers before")
            axs[1].set_ylabel("cos, boundary activation grad")
            axs[1].set_xticks([j + w * (len(bs) - 1) / 2 for j in range(len(names))])
            axs[1].set_xticklabels(names, rotation=40, ha="right", fontsize=7)
            axs[0].legend(fontsize=7)
            axs[0].set_title(f"{title}: gradient vs dense (one held-out batch)")
            save(fig, "grad_error.png")

    # 6. anchor
    if rep["anchor"]:
        fig, axs = plt.subplots(1, 2, figsize=(12, 4.2))
        first = next(iter(rep["anchor"].values()))  # M_anc is built from dense gradients: the same for every split
        for n_, s_ in first["singular_values"].items():
            axs[0].plot(range(1, len(s_) + 1), s_, color="tab:blue", lw=0.4, alpha=0.5)
        for t in TAU_SWEEP:
            tau = next(iter(rep["anchor"].values()))["tau"]
            axs[0].axhline(t, color="gray", lw=0.5, ls="--")
        axs[0].axhline(tau, color="red", lw=0.9, ls="--")
        axs[0].set_yscale("log"), axs[0].set_xlabel("index"), axs[0].set_ylabel("singular value of M_anc")
        axs[0].set_title("singular values of M_anc, one line per matrix\n(dashed: tau sweep; red: tau used)", fontsize=9)
        labels, vals = [], []
        for y, a in rep["anchor"].items():
            k = f"alpha={a['alpha']:g}"
            labels += [f"{y}st masked", f"{y}st masked+filter", f"{y}st masked+pure filter", f"{y}st dense+filter"]
            t = a["per_tau"][f"{a['tau']:g}"]
            vals += [a["masked_vs_dense"]["cos"], t[k]["filtered_masked_vs_dense"]["cos"],
                     t["alpha=0"]["filtered_masked_vs_dense"]["cos"], t[k]["filtered_dense_vs_dense"]["cos"]]
        labels.append("M_anc itself")
        vals.append(first["momentum_vs_dense"]["cos"])
        axs[1].bar(range(len(vals)), [v or 0 for v in vals],
                   color=["tab:gray", "tab:blue", "tab:cyan", "tab:green"] * len(rep["anchor"]) + ["tab:orange"])
        axs[1].set_xticks(range(len(vals)))
        axs[1].set_xticklabels(labels, rotation=35, ha="right", fontsize=7)
        axs[1].set_ylabel("cosine with the dense gradient")
        axs[1].set_title(f"{title}: cos with the dense gradient of the same batch (2-D weights),\n"
                         "masked circuit before / after the filter; the dense gradient filtered", fontsize=9)
        save(fig, "anchor.png")

    # 7. layer scan
    if rep["layer_scan"]:
        Ls = [int(L) for L in rep["layer_scan"]]
        names = list(next(iter(rep["layer_scan"].values()))["losses"])
        fig, axs = plt.subplots(1, 2, figsize=(12, 4.2))
        for nm in names:
            axs[0].plot(Ls, [rep["layer_scan"][str(L)]["losses"].get(nm, float("nan")) for L in Ls], "o-", ms=3, label=nm)
        axs[0].axhline(rep["base_loss"], color="k", lw=0.8, ls="--", label="base")
        axs[0].set_xlabel("boundary before layer L"), axs[0].set_ylabel("held-out loss"), axs[0].legend(fontsize=7)
        axs[1].plot(Ls, [rep["layer_scan"][str(L)]["stats"]["spectrum"]["participation_ratio"] for L in Ls], "o-", ms=3,
                    label="participation ratio")
        axs[1].plot(Ls, [rep["layer_scan"][str(L)]["stats"]["spectrum"]["entropy_rank"] for L in Ls], "s-", ms=3,
                    label="entropy rank")
        if "spectrum_without_outlier_tokens" in rep["layer_scan"][str(Ls[-1])]["stats"]:
            axs[1].plot(Ls, [rep["layer_scan"][str(L)]["stats"].get("spectrum_without_outlier_tokens", {})
                             .get("participation_ratio", float("nan")) for L in Ls], "^-", ms=3,
                        label="participation ratio, outlier tokens removed")
        axs[1].set_yscale("log"), axs[1].set_xlabel("boundary before layer L"), axs[1].legend(fontsize=7)
        fig.suptitle(f"{title}: every layer boundary")
        save(fig, "layer_scan.png")
    return files
