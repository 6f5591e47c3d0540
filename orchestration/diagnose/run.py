"""One diagnostics run: every measurement of the package at every boundary asked for, in
one JSON-able report, resumable from a saved partial report of the same model, rows and
settings.

Boundaries: those of each ``--stages`` Y-split (``stages.balanced_layers``) plus
``--boundaries``, and with ``--every-layer`` a lighter scan of every layer boundary
(activation statistics + the ``--scan`` transforms' losses). Rows are a seeded choice
(``pick_rows``): held-out rows for the losses (the first ``grad_rows`` of them are the
gradient batch), training rows for calibration and the anchor's dense gradients.
"""
from __future__ import annotations

import json
import math
import time
from typing import Callable

import torch

from orchestration.components.calibration import fit_pca
from orchestration.diagnose.anchor import anchor_diagnostics
from orchestration.diagnose.candidates import (CANDIDATES, SCALE_BYTES, calibrate, candidate_transforms,
                                               pca_sweep_transforms)
from orchestration.diagnose.common import UsageError, fmt, log
from orchestration.diagnose.gradients import GradProbe, boundary_gradients
from orchestration.diagnose.model import LayerSplit, forward_loss, pick_rows, row_losses
from orchestration.diagnose.settings import Settings
from orchestration.diagnose.stats import activation_stats, k_fractions
from orchestration.diagnose.transforms import (Transform, build_codec, codec_transform, default_codec_specs,
                                               dense_bytes)
from orchestration.distributed.stages import balanced_layers, causal_lm_loss

# What a saved partial report must share with this run to be continued (--resume).
_RESUME_KEYS = ("model", "layers", "hidden", "settings", "rows", "base_loss")


def _row(t: Transform, loss: float, rows: torch.Tensor, base: float, base_rows: torch.Tensor, dense: int) -> dict:
    diff = rows - base_rows
    se = float(diff.std() / math.sqrt(diff.numel())) if diff.numel() > 1 else None
    return {"name": t.name, "kind": t.kind, "spec": t.spec, "note": t.note, "bytes_fwd": t.bytes_fwd,
            "bytes_bwd": t.bytes_bwd, "fraction_of_dense_fwd": t.bytes_fwd / dense,
            "fraction_of_dense_bwd": t.bytes_bwd / dense, "loss": loss, "delta": loss - base, "delta_se": se}


def run_diagnostics(model, model_path: str, train_rows: torch.Tensor, eval_rows: torch.Tensor, s: Settings,
                    progress: Callable[[str], None] = log, partial: dict | None = None,
                    save: Callable[[dict], None] | None = None) -> dict:
    """Everything the package docstring lists; returns the report (a JSON-able dict).

    ``save(report)`` is called after every boundary, scan step and anchor split (the report
    so far); ``partial``, such a saved report of the same model, rows and settings, is
    continued: what it holds is not measured again (UsageError if it does not match)."""
    t0 = time.time()
    model.eval()
    cfg = model.config
    n, H = cfg.num_hidden_layers, cfg.hidden_size
    dtype = next(model.parameters()).dtype
    dense = dense_bytes(H, dtype)
    splits = {}
    for y in s.stages:
        if y > n:
            raise UsageError(f"--stages {y}: the model has only {n} decoder layers")
        sizes = balanced_layers(n, y)
        splits[y] = {"layers_per_stage": sizes, "boundaries": [sum(sizes[:i + 1]) for i in range(y - 1)]}
    split = LayerSplit(model)
    main_bs = sorted({b for sp in splits.values() for b in sp["boundaries"]} | {split.check_boundary(b) for b in s.boundaries})
    ev = pick_rows(eval_rows, s.eval_rows, s.seed)
    cal = pick_rows(train_rows, s.calib_rows, s.seed)
    anchor_b = [pick_rows(train_rows, s.grad_rows, s.seed, skip=s.calib_rows + j * s.grad_rows)
                for j in range(s.anchor_batches)] if s.anchor and s.stages else []
    gids = ev[:s.grad_rows]
    codec_specs = s.codecs if s.codecs is not None else default_codec_specs(H, s.budget, seq_len=s.seq_len)
    for spec in codec_specs:
        build_codec(spec, H)
    scan_bs = list(range(1, n)) if s.every_layer else []
    need = sorted(set(main_bs) | set(scan_bs))
    progress(f"model {model_path}: {n} layers, hidden {H}; eval {tuple(ev.shape)}, calibration {tuple(cal.shape)}; "
             f"boundaries {main_bs}" + (" + every layer" if s.every_layer else ""))

    with torch.no_grad():
        base_logits = split.suffix(split.prefix(ev, n), n)
        base, base_rows = float(causal_lm_loss(base_logits, ev)), row_losses(base_logits, ev)
        unsplit = float(model(input_ids=ev, labels=ev, use_cache=False).loss)
        del base_logits
        hs_ev = dict(zip(range(1, n), split.all_hidden(ev)))
        hs_cal = dict(zip(range(1, n), split.all_hidden(cal)))
        hs_ev = {L: hs_ev[L] for L in need}
        hs_cal = {L: hs_cal[L] for L in need}
        e_cal = split.embed(cal)
    progress(f"base held-out loss {base:.4f} (unsplit model {unsplit:.4f}) in {time.time() - t0:.0f} s")

    report = {"model": model_path, "architecture": type(model).__name__, "layers": n, "hidden": H,
              "vocab": cfg.vocab_size, "tied_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
              "dtype": str(dtype).replace("torch.", ""), "dense_bytes_per_token": dense,
              "budget": f"1/{s.budget}", "budget_bytes_per_token": dense // s.budget,
              "settings": {k: v for k, v in vars(s).items()}, "splits": {str(k): v for k, v in splits.items()},
              "rows": {"eval": list(ev.shape), "calibration": list(cal.shape), "grad": list(gids.shape),
                       "held_out_available": int(eval_rows.shape[0]), "train_available": int(train_rows.shape[0])},
              "base_loss": base, "base_loss_unsplit_model": unsplit, "boundaries": {}, "layer_scan": {},
              "anchor": {}}
    if partial is not None:
        mine = json.loads(json.dumps({k: report[k] for k in _RESUME_KEYS}, default=str))
        theirs = {k: partial.get(k) for k in _RESUME_KEYS}
        if mine != theirs:
            diff = [k for k in _RESUME_KEYS if mine[k] != theirs[k]]
            raise UsageError(f"cannot resume: the saved partial report differs in {', '.join(diff)}")
        for k in ("boundaries", "layer_scan", "anchor"):
            report[k] = dict(partial.get(k, {}))
        progress(f"resuming: {len(report['boundaries'])} boundaries, {len(report['layer_scan'])} scan steps, "
                 f"{len(report['anchor'])} anchor splits already measured")

    def checkpoint():
        if save is not None:
            save(report)

    def stage_groups(L):
        out = {}
        for y, sp in splits.items():
            if L in sp["boundaries"]:
                lo = 0
                for i, k in enumerate(sp["layers_per_stage"]):
                    if lo + k > L:
                        break
                    out[f"{y}-stage split, stage {i}"] = [str(j) for j in range(lo, lo + k)] + (["embed"] if i == 0 else [])
                    lo += k
        return out

    for bi, L in enumerate(main_bs):
        if str(L) in report["boundaries"]:
            continue
        tb = time.time()
        stats, pca = activation_stats(hs_cal[L], hs_ev[L])
        gpca = g_cal = None
        if s.grads:
            nb = min(s.calib_rows, 2 * s.grad_rows)
            progress(f"boundary {L}: dense boundary gradients of {nb} calibration rows (gradient PCA)")
            g_cal = boundary_gradients(split, hs_cal[L][:nb], L, cal[:nb], s.grad_rows)
            gpca = fit_pca(g_cal)
        calib = calibrate(hs_cal[L], e_cal, pca, gpca)
        ts = [codec_transform(sp, H, L, s.seed, dtype, hs_cal[L], g_cal) for sp in codec_specs]
        if s.pca_sweep:
            ts += pca_sweep_transforms(pca, H)
        if s.candidates != []:
            ts += candidate_transforms(calib, split.embed, H, L, s.seed, s.budget, s.candidates, s.massive_m, dtype,
                                       s.seq_len)
        rows = []
        for j, t in enumerate(ts):
            loss, lr = forward_loss(split, hs_ev[L], L, ev, t.fn)
            rows.append(_row(t, loss, lr, base, base_rows, dense))
            progress(f"boundary {L} ({bi + 1}/{len(main_bs)}) forward {j + 1}/{len(ts)}: {t.name:24s} "
                     f"bytes {t.bytes_fwd / dense:6.3f} of dense  loss {loss:.3f}")
        if s.grads:
            probe = GradProbe(split, gids, L)
            groups = stage_groups(L)
            g = probe.ref[1].reshape(-1, H).double()
            gg = float(g.pow(2).sum())
            ks = {**k_fractions(H), "int8 (B-4)": min(H, dense // s.budget - SCALE_BYTES)}
            stats["boundary_gradient_energy"] = {  # share of the held-out dense boundary gradient kept
                "activation_pca": {f: float((g @ pca.basis(k).double()).pow(2).sum()) / gg for f, k in ks.items()},
                "gradient_pca": {f: float((g @ gpca.basis(k).double()).pow(2).sum()) / gg for f, k in ks.items()},
                "k": ks}
            for j, (t, r) in enumerate(zip(ts, rows)):
                if t.kind == "pca":
                    continue
                r["grad"] = probe.compare(t.fn, groups)
                progress(f"boundary {L} gradient {j + 1}/{len(ts)}: {t.name:24s} prefix cos "
                         f"{fmt(r['grad']['prefix']['cos'])}  boundary cos {fmt(r['grad']['boundary']['cos'])}")
            del probe
        report["boundaries"][str(L)] = {"layer": L, "depth": L / n, "in_splits": [y for y, sp in splits.items()
                                                                                   if L in sp["boundaries"]],
                                        "stats": stats, "transforms": rows, "seconds": time.time() - tb}
        checkpoint()

    if scan_bs:
        for L in scan_bs:
            if str(L) in report["layer_scan"]:
                continue
            st, pca = activation_stats(hs_cal[L], hs_ev[L])
            calib = calibrate(hs_cal[L], e_cal, pca)
            losses = {}
            for name in s.scan:
                prev = report["boundaries"].get(str(L))
                t = (candidate_transforms(calib, split.embed, H, L, s.seed, s.budget, [name], s.massive_m, dtype,
                                          s.seq_len)
                     if name in CANDIDATES else [codec_transform(name, H, L, s.seed, dtype, hs_cal[L])])
                if not t:
                    continue
                t = t[0]
                hit = [r for r in prev["transforms"] if r["name"] == t.name] if prev else []
                losses[t.name] = hit[0]["loss"] if hit else forward_loss(split, hs_ev[L], L, ev, t.fn)[0]
            compact = {k: v for k, v in st.items() if k not in ("eigvals", "dim_mean_abs_sorted")}
            report["layer_scan"][str(L)] = {"stats": compact, "losses": losses}
            progress(f"layer scan {L}/{n - 1}: " + "  ".join(f"{k} {v:.3f}" for k, v in losses.items()))
            checkpoint()

    if s.anchor:
        for y in s.stages:
            if str(y) in report["anchor"]:
                continue
            report["anchor"][str(y)] = anchor_diagnostics(
                model, y, gids, anchor_b, codec_spec=s.anchor_codec, seed=s.seed, tau=s.tau, alpha=s.alpha,
                beta_anc=s.beta_anc, rank=s.rank, progress=progress)
            checkpoint()
    report["seconds"] = time.time() - t0
    return report
