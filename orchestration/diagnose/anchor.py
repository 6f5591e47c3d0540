"""The anchor measurement per Y-split: does SpectralAdamW's spectral filter, built from
dense gradients of other batches, bring the masked circuit's gradient closer to the dense
one?

The filter is the trainer's own (``meshkern.optim.AnchorMomentum`` +
``meshkern.spectral.project``, the filtered parameters as SpectralAdamW's default groups);
the masked circuit applies the codec at every stage boundary i with
``MaskKey(seed, i, 0, 0)``, as the pipeline does at step 0.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from orchestration.codecs import apply_codec
from orchestration.diagnose.common import ALPHA, BETA_ANC, RANK, TAU, log
from orchestration.diagnose.gradients import pairs_metrics
from orchestration.diagnose.transforms import build_codec
from orchestration.distributed.stages import causal_lm_loss, run_stages, split_model

TAU_SWEEP = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1)


def anchor_diagnostics(model, num_stages: int, ids: torch.Tensor, anchor_batches: Sequence[torch.Tensor], *,
                       codec_spec: str = "mask:p=0.95", seed: int = 0, tau: float = TAU, alpha: float = ALPHA,
                       beta_anc: float = BETA_ANC, rank: int = RANK, taus: Sequence[float] = TAU_SWEEP,
                       progress: Callable[[str], None] = log) -> dict:
    """The anchor prior on one batch ``ids`` of a ``num_stages``-stage split.

    M_anc = AnchorMomentum over the dense gradients of ``anchor_batches`` (filtered
    parameters as SpectralAdamW's default groups: 2-D, no embedding / lm_head); G_m = the
    masked circuit's gradient (``codec_spec`` at every stage boundary, MaskKey(seed, i, 0, 0)),
    G_d = the dense gradient, both on ``ids``. Reports cos(G_m, G_d), cos(G_proj(G_m), G_d),
    cos(G_proj(G_d), G_d), the pure filter's (alpha=0) cosines, the energy
    ||G_filt||^2/||G||^2 the filter keeps, and the singular values of M_anc, for each tau.
    """
    from meshkern import spectral
    from meshkern.mask import MaskKey
    from meshkern.optim import AnchorMomentum, spectral_param_groups

    stages = split_model(model, num_stages)
    codec = build_codec(codec_spec, model.config.hidden_size)
    named = []
    for st in stages:
        for name, p in spectral_param_groups(st, named=True)[0]["params"]:
            if p.dim() == 2:
                named.append((st.hf_name(name), p))
    params = [p for _, p in named]

    def grads(x, masked):
        bnd = (lambda i, h: apply_codec(codec, h, MaskKey(seed, i, 0, 0))) if masked else None
        with torch.enable_grad():
            loss = causal_lm_loss(run_stages(stages, x, boundary=bnd), x)
            return float(loss.detach()), list(torch.autograd.grad(loss, params))

    am = AnchorMomentum(params, beta_anc, rank, seed=seed)
    for j, b in enumerate(anchor_batches):
        progress(f"anchor {num_stages} stages: dense gradient {j + 1}/{len(anchor_batches)}")
        am.update(grads(b, False)[1])
    facs = am.factors()
    progress(f"anchor {num_stages} stages: masked and dense gradients of the probe batch")
    loss_m, Gm = grads(ids, True)
    loss_d, Gd = grads(ids, False)

    rep = {"stages": num_stages, "codec": codec_spec, "params_filtered": len(params), "rank": rank,
           "beta_anc": beta_anc, "alpha": alpha, "tau": tau, "anchor_batches": len(anchor_batches),
           "loss_masked": loss_m, "loss_dense": loss_d,
           "masked_vs_dense": pairs_metrics(zip(Gm, Gd)),
           "momentum_vs_dense": pairs_metrics((m, g) for m, g in zip(am.m, Gd)),
           "per_tau": {}}
    S = [f[1] for f in facs]
    rep["singular_values"] = {n: [float(v) for v in s] for (n, _), s in zip(named, S)}
    allS = torch.cat(S)
    rep["singular_values_summary"] = {"max": float(allS.max()), "median_top": float(torch.stack([s[0] for s in S]).median()),
                                      "median_all": float(allS.median()), "min": float(allS.min())}
    for t in sorted(set(list(taus) + [tau])):
        row = {}
        for a_ in (alpha, 0.0):
            pm, pd, fm, fd = [], [], 0.0, 0.0
            for (U, s, V), gm, gd in zip(facs, Gm, Gd):
                x, fsq = spectral.project(gm, U, s, V, t, a_, return_stats=True)
                y, fsq_d = spectral.project(gd, U, s, V, t, a_, return_stats=True)
                pm.append((x, gd))
                pd.append((y, gd))
                fm += float(fsq)
                fd += float(fsq_d)
            key = f"alpha={a_:g}"
            row[key] = {"filtered_masked_vs_dense": pairs_metrics(pm), "filtered_dense_vs_dense": pairs_metrics(pd)}
            if a_ == 0.0:
                row["energy_kept_masked"] = fm / sum(float(g.double().pow(2).sum()) for g in Gm)
                row["energy_kept_dense"] = fd / sum(float(g.double().pow(2).sum()) for g in Gd)
        d = torch.cat([spectral.gains(s, t) for s in S])
        row["gain_mean"] = float(d.mean())
        row["frac_singular_values_above_tau"] = float((allS > t).double().mean())
        rep["per_tau"][f"{t:g}"] = row
    return rep
