"""How far a trained model has moved away from the pca codec's calibrated basis (issue #28).

    python -m orchestration.diagnose.drift RUN_DIR [--rows 16] [--basis FILE] [--codec SPEC] [--out FILE]

For the base model (step 0) and every complete checkpoint of a trainer run, per stage
boundary, on held-out rows the run never trained on (its own split):

    act_kept      share of the centered activation energy, ||h - mean||^2 over positions
                  >= 1 (position 0 travels as int8 with ``sink``), that the basis's span keeps
    grad_outside  share of the boundary gradient's energy outside that span: what the
                  projected backward pass drops
    fwd_err       ||h_hat - h||^2 / ||h - mean||^2 of the codec's forward round trip over
                  the same positions; fwd_err = (1 - act_kept) + quantization error, as the
                  two errors are orthogonal (in the span vs. outside it), so ``fwd_quant``
                  is their difference
    bwd_err       ||g_hat - g||^2 / ||g||^2 of the backward round trip, same positions
    sink_err      the forward error of position 0 (int8 over all H dims), relative to its
                  own energy (0 without ``sink``)

each for two bases: ``run`` (the one the run trained with, RUN_DIR/pca_basis.pt, or for a
run of another codec the basis fitted on its base model by the run's own calibration rule:
the same rows, so the same basis a pca run of the same seed starts from) and ``refit``
(the same rule applied to the checkpoint itself: what a refreshed basis would give). The
difference between the two columns is what a basis that follows the model can win back.
Writes one JSON object per (step, boundary) to ``--out`` (default RUN_DIR/drift.jsonl)
and prints the table.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from meshkern.mask import MaskKey
from orchestration import codecs
from orchestration.components import calibration
from orchestration.components import checkpoint as ckpt
from orchestration.components.calibration import boundary_states
from orchestration.diagnose.common import write_jsonl


def _share(num: torch.Tensor, den: torch.Tensor) -> float:
    d = float(den)
    return float(num) / d if d > 0 else 0.0


def boundary_drift(codec, basis, h: torch.Tensor, g: torch.Tensor, boundary: int) -> dict[str, float]:
    """The four measures of the module doc for one boundary: ``h`` [N, T, H] hidden
    states, ``g`` their dense gradients, ``basis`` a PCABasis, ``codec`` a pca codec (PCABaseCodec)."""
    body = h[:, 1:] if codec.sink else h
    gbody = g[:, 1:] if codec.sink else g
    U = basis.U.double()
    xc = body.double() - basis.mean.double()
    inside = (xc @ U) @ U.T
    gd = gbody.double()
    gin = (gd @ U) @ U.T
    codec.bases = {boundary: basis}
    key = MaskKey(0, boundary, 0, 0)
    wire, ctx = codec.encode_fwd(h, key)
    h_hat = codec.decode_fwd(wire, key, tuple(h.shape), h.dtype)
    g_hat = codec.decode_bwd(codec.encode_bwd(g, key, wire), key, ctx)
    # Position 0 with sink is an attention sink of huge norm, sent as int8: measured apart,
    # or its energy would hide every error of the other positions.
    start = 1 if codec.sink else 0
    fwd = (h_hat[:, start:].double() - body.double()).pow(2).sum()
    bwd = (g_hat[:, start:].double() - gd).pow(2).sum()
    sink = _share((h_hat[:, 0].double() - h[:, 0].double()).pow(2).sum(), h[:, 0].double().pow(2).sum())
    out = {"act_kept": _share(inside.pow(2).sum(), xc.pow(2).sum()),
           "grad_outside": _share((gd - gin).pow(2).sum(), gd.pow(2).sum()),
           "fwd_err": _share(fwd, xc.pow(2).sum()), "bwd_err": _share(bwd, gd.pow(2).sum()),
           "sink_err": sink if codec.sink else 0.0}
    out["fwd_quant"] = max(0.0, out["fwd_err"] - (1.0 - out["act_kept"]))
    return out


def measure_run(run_dir: str, rows: int = 16, basis_file: str | None = None, codec_spec: str | None = None,
                progress=print) -> list[dict]:
    """The module doc's measures for the base model and every checkpoint of ``run_dir``."""
    from orchestration.launch.prepare import prepare
    from orchestration.config import parse_args
    from orchestration.models.loading import load_causal_lm

    cfg, _ = parse_args(["--config", os.path.join(run_dir, "config.yaml"), "--checkpoint.resume", ""])
    plan = prepare(cfg, load_model=False)  # the run's own held-out split
    if codec_spec:
        codec = codecs.make_codec(codec_spec)
    elif codecs.codec_class(cfg.boundary.codec, cfg.boundary.options).needs_calibration:
        codec = codecs.codec_for(cfg.boundary)
    else:
        codec = codecs.make_codec("pca")
    if not codec.needs_calibration:  # (what drift measures: how a calibrated basis goes stale)
        raise ValueError(f"--codec {codec_spec!r}: drift is measured for a pca codec")
    held = plan.eval_rows[:rows]
    calib = calibration.calibration_rows(plan.train_rows, codec.calib_rows, cfg.train.seed)
    split = (cfg.mesh.stages, cfg.mesh.layers_per_stage)

    def fitted(model):
        return calibration.fit_model_bases(model, calib, codec, *split, grad_rows=codec.grad_rows)

    dtype = getattr(torch, cfg.model.dtype)
    base, _ = load_causal_lm(plan.model_path, dtype=dtype, boundary=False)
    layers = calibration.boundary_layers(plan.num_layers, *split)  # (a basis file is keyed by them)
    if basis_file:
        run_bases = calibration.for_split(calibration.read(basis_file, layers), layers)
    elif os.path.isfile(os.path.join(run_dir, calibration.BASIS_FILE)):
        run_bases = calibration.load_split(run_dir, plan.num_layers, *split)
    else:
        run_bases = fitted(base)
    records = []
    for step, path in [(0, plan.model_path)] + ckpt.complete_checkpoints(os.path.join(run_dir, "checkpoints")):
        model = base if step == 0 else load_causal_lm(path, dtype=dtype, boundary=False)[0]
        hs, gs = boundary_states(model, held, *split, grad_rows=held.shape[0])
        refit = fitted(model)
        for b, (h, g) in enumerate(zip(hs, gs)):
            rec = {"step": step, "boundary": b, "checkpoint": path}
            for name, bases in (("run", run_bases), ("refit", refit)):
                rec.update({f"{name}_{k}": v for k, v in boundary_drift(codec, bases[b], h, g, b).items()})
            records.append(rec)
            progress(format_row(rec))
        del model
    return records


COLUMNS = ("act_kept", "grad_outside", "fwd_err", "fwd_quant", "bwd_err", "sink_err")


def format_row(rec: dict) -> str:
    cells = " | ".join(f"{rec[f'run_{c}']:.4f} / {rec[f'refit_{c}']:.4f}" for c in COLUMNS)
    return f"| {rec['step']} | {rec['boundary']} | {cells} |"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m orchestration.diagnose.drift",
                                 description="How far a trained run's model moved from the pca basis it started "
                                             "with: per checkpoint and boundary, run basis vs a refitted one.")
    ap.add_argument("run_dir", help="a trainer run directory (config.yaml, checkpoints/)")
    ap.add_argument("--rows", type=int, default=16, help="held-out rows measured (default 16)")
    ap.add_argument("--basis", default=None, help="a pca_basis.pt to measure instead of the run's own")
    ap.add_argument("--codec", default=None, help="pca codec spec (default: the run's, or pca for another codec)")
    ap.add_argument("--out", default=None, help="JSONL output (default RUN_DIR/drift.jsonl)")
    a = ap.parse_args(argv)
    if not os.path.isfile(os.path.join(a.run_dir, "config.yaml")):
        print(f"error: {a.run_dir} has no config.yaml: not a trainer run directory", file=sys.stderr)
        return 2
    if a.rows < 1:
        print(f"error: --rows must be >= 1, got {a.rows}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    print("| step | boundary | " + " | ".join(f"{c} run / refit" for c in COLUMNS) + " |", flush=True)
    print("|---|---|" + "---|" * len(COLUMNS), flush=True)
    try:
        records = measure_run(a.run_dir, a.rows, a.basis, a.codec, progress=lambda s: print(s, flush=True))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_jsonl(a.out or os.path.join(a.run_dir, "drift.jsonl"), records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
