"""Activation statistics of the residual stream at a boundary: per-dim magnitudes (massive
dims), per-token norms (outlier tokens such as the attention sink), the PCA spectrum and
the variance the top H/20, H/15, H/10 directions keep, in-sample and on held-out rows.

An outlier token is one whose norm is >= ``calibration.OUTLIER_TOKEN_RATIO`` times the
median token norm: the same rule the ``pca`` codec's basis fit leaves such tokens out by.
"""
from __future__ import annotations

import torch

from orchestration.components.calibration import OUTLIER_TOKEN_RATIO, PCA, fit_pca

MASSIVE_RATIOS = (10.0, 100.0)


def spectrum_stats(eigvals: torch.Tensor) -> dict:
    """Participation ratio (sum l)^2 / sum l^2 and entropy rank exp(H(l / sum l))."""
    lam = eigvals.double().clamp_min(0)
    tot = float(lam.sum())
    if tot <= 0:
        return {"participation_ratio": 0.0, "entropy_rank": 0.0}
    p = lam / tot
    p = p[p > 0]
    return {"participation_ratio": tot ** 2 / float(lam.pow(2).sum()),
            "entropy_rank": float(torch.exp(-(p * p.log()).sum()))}


def k_fractions(H: int) -> dict[str, int]:
    return {f"1/{d}": max(1, round(H / d)) for d in (20, 15, 10)}


def activation_stats(h_cal: torch.Tensor, h_eval: torch.Tensor | None = None, top: int = 12) -> tuple[dict, PCA]:
    """Statistics of the residual stream at a boundary from calibration tokens [..., H]
    (and held-out tokens for the out-of-sample energy); returns (stats, PCA fit)."""
    H = h_cal.shape[-1]
    x = h_cal.reshape(-1, H).float()
    mag = x.abs().mean(0)
    med = float(mag.median())
    order = torch.argsort(mag, descending=True)
    tn = x.norm(dim=1)
    tmed = float(tn.median())
    outliers = tn >= OUTLIER_TOKEN_RATIO * tmed
    pca = fit_pca(x)
    st = {"tokens": x.shape[0], "hidden": H,
          "dim_mean_abs_median": med,
          "massive_dims": {f">={int(r)}x_median": int((mag >= r * med).sum()) for r in MASSIVE_RATIOS},
          "top_dims": [int(i) for i in order[:top]],
          "top_dims_mean_abs": [float(mag[i]) for i in order[:top]],
          "top_dims_ratio_to_median": [float(mag[i]) / med if med > 0 else None for i in order[:top]],
          "token_norm_median": tmed, "token_norm_max": float(tn.max()),
          "outlier_tokens": int(outliers.sum()),
          "spectrum": spectrum_stats(pca.eigvals),
          "energy_in_sample": {f: pca.energy(k) for f, k in k_fractions(H).items()},
          "k": k_fractions(H)}
    if h_cal.dim() == 3:  # which positions the outlier tokens sit at
        pos = outliers.reshape(h_cal.shape[0], h_cal.shape[1]).nonzero()[:, 1]
        st["outlier_token_positions"] = sorted(set(int(p) for p in pos))[:16]
    if outliers.any() and (~outliers).sum() > 1:
        p2 = fit_pca(x[~outliers])
        st["spectrum_without_outlier_tokens"] = spectrum_stats(p2.eigvals)
        st["energy_in_sample_without_outlier_tokens"] = {f: p2.energy(k) for f, k in k_fractions(H).items()}
    if h_eval is not None:
        st["energy_held_out"] = {f: pca.energy_on(h_eval, k) for f, k in k_fractions(H).items()}
    st["eigvals"] = [float(v) for v in pca.eigvals]
    st["dim_mean_abs_sorted"] = [float(mag[i]) for i in order]
    return st, pca
