"""Why a model trained through the pca codec scores worse without it (issue #43 item 2).

    python -m orchestration.diagnose.mismatch RUN_DIR [--rows 32] [--steps 0,100,200] [--top 1,4,16]
        [--variants codec,span] [--basis FILE] [--out FILE]

The deployed model sees the boundary's hidden state ``h``; the run trained on the codec's
``h_hat``. For the base model (step 0) and the run's checkpoints, per stage boundary
(the others exact), on the run's own held-out rows, it scores the rest of the model fed

    deployed   h (the deployed model's loss)
    codec      h_hat, the codec's forward round trip (the codec-on loss at that boundary)
    span       mean + U U^T (h - mean) on positions >= 1 (position 0 exact): what the codec
               keeps, without its quantization
    quant      h + (h_hat - span): the quantization error only (position 0's int8 included),
               the part of h outside the span kept
    sink       h with position 0 as the codec sends it (int8 over all H dims)
    span+sink  both: the codec without its quantization of positions >= 1 (a transform a
               deployed model could keep at no wire bytes)
    outside-j  h less the top-j principal directions of its part outside the span (fitted
               on these rows): does the mismatch live in a few directions?
    bits-w     h + U_w (c_hat_w - c_w): the quantization error of the coordinates that got
               w bits only (quant=nf bases): which code widths matter

Each as the mean next-token loss over the rows, with its difference to ``deployed``. A
variant below ``deployed`` is something the trained model learned to expect; one that
scores like ``codec`` names where the codec-on / deployed gap comes from. The run's basis
is RUN_DIR/pca_basis.pt (the one it trained with). Writes one JSON object per (step,
boundary) to ``--out`` (default RUN_DIR/mismatch.jsonl) and prints a table.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

from meshkern.mask import MaskKey
from orchestration import codecs
from orchestration.components import calibration
from orchestration.components import checkpoint as ckpt
from orchestration.diagnose.common import write_jsonl


@torch.no_grad()
def _stage_inputs(stages, rows: torch.Tensor, chunk: int) -> list[list[torch.Tensor]]:
    """Per chunk of rows: the input of every stage (stage 0's is the token ids)."""
    out = []
    for i in range(0, rows.shape[0], chunk):
        x, ins = rows[i:i + chunk], []
        for st in stages:
            ins.append(x)
            x = st(x)
        out.append(ins)
    return out


@torch.no_grad()
def _loss_from(stages, b: int, h: torch.Tensor, ids: torch.Tensor) -> tuple[float, int]:
    """Summed next-token loss and count when stage b+1 gets ``h`` (later boundaries exact)."""
    x = h
    for st in stages[b + 1:]:
        x = st(x)
    logits = x[:, :-1].float()
    target = ids[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum").item(), \
        target.numel()


def variants(codec, basis, h: torch.Tensor, key, top: tuple[int, ...], outside_dirs: torch.Tensor | None
             ) -> dict[str, torch.Tensor]:
    """The module doc's boundary inputs for one chunk ``h`` [N, T, H] (fp32)."""
    codec.bases = {key.boundary: basis}
    wire, _ = codec.encode_fwd(h, key)
    h_hat = codec.decode_fwd(wire, key, tuple(h.shape), h.dtype)
    start = 1 if codec.sink else 0
    U, mean = basis.U, basis.mean
    c = (h[:, start:] - mean) @ U
    span = h.clone()
    span[:, start:] = mean + c @ U.T
    out = {"deployed": h, "codec": h_hat, "span": span, "quant": h + (h_hat - span)}
    if codec.sink:
        sink = h.clone()
        sink[:, 0] = h_hat[:, 0]
        out["sink"] = sink
        span_sink = span.clone()
        span_sink[:, 0] = h_hat[:, 0]
        out["span+sink"] = span_sink
    if outside_dirs is not None:
        r = (h[:, start:] - mean) - c @ U.T
        for j in top:
            V = outside_dirs[:, :j]
            v = h.clone()
            v[:, start:] = h[:, start:] - (r @ V) @ V.T
            out[f"outside-{j}"] = v
    if basis.bits is not None:
        c_hat = (h_hat[:, start:] - mean) @ U
        for w in sorted(set(int(x) for x in basis.bits.tolist())):
            sel = (basis.bits == w).to(h.dtype)
            v = h.clone()
            v[:, start:] = h[:, start:] + ((c_hat - c) * sel) @ U.T
            out[f"bits-{w}"] = v
    return out


def measure(model, rows: torch.Tensor, codec, bases: dict, num_stages: int, layers_per_stage=None,
            top: tuple[int, ...] = (1, 4, 16), chunk: int = 4, only: tuple[str, ...] = ()) -> list[dict]:
    """Per boundary: {variant: loss} (and the energy shares) for ``model`` on ``rows``;
    ``only``: these variants (and ``deployed``), not all."""
    from orchestration.distributed.stages import split_model

    stages = split_model(model, num_stages, layers_per_stage or None)
    model.eval()
    inputs = _stage_inputs(stages, rows, chunk)
    start = 1 if codec.sink else 0
    recs = []
    for b in range(num_stages - 1):
        basis = bases[b]
        # the part of h outside the span, its principal directions over all these rows
        r = torch.cat([((ins[b + 1][:, start:] - basis.mean) - ((ins[b + 1][:, start:] - basis.mean) @ basis.U)
                        @ basis.U.T).reshape(-1, basis.mean.shape[0]) for ins in inputs]).double()
        xc = torch.cat([(ins[b + 1][:, start:] - basis.mean).reshape(-1, basis.mean.shape[0]) for ins in inputs])
        outside_dirs = None
        if top and r.pow(2).sum() > 0:
            _, s, Vh = torch.linalg.svd(r, full_matrices=False)
            outside_dirs = Vh.T.float()
            top_share = {f"outside_top{j}_energy": float(s[:j].pow(2).sum() / s.pow(2).sum()) for j in top}
        else:
            top_share = {}
        sums: dict[str, list[float]] = {}
        for i, ins in enumerate(inputs):
            ids = rows[i * chunk:(i + 1) * chunk]
            key = MaskKey(0, b, 0, 0)
            for name, h in variants(codec, basis, ins[b + 1].float(), key, top, outside_dirs).items():
                if only and name != "deployed" and name not in only:
                    continue
                tot, n = _loss_from(stages, b, h.to(ins[b + 1].dtype), ids)
                acc = sums.setdefault(name, [0.0, 0])
                acc[0] += tot
                acc[1] += n
        loss = {k: v[0] / v[1] for k, v in sums.items()}
        rec = {"boundary": b, "k": int(basis.U.shape[1]), "loss": loss,
               "outside_energy": float(r.pow(2).sum() / xc.double().pow(2).sum()), **top_share}
        if basis.bits is not None:
            rec["bits_count"] = {str(w): int((basis.bits == w).sum()) for w in sorted(set(basis.bits.tolist()))}
        recs.append(rec)
    return recs


def measure_run(run_dir: str, rows: int = 32, steps: list[int] | None = None, top=(1, 4, 16),
                progress=print, only: tuple[str, ...] = (), basis_file: str | None = None) -> list[dict]:
    from orchestration.config import parse_args
    from orchestration.launch.prepare import prepare
    from orchestration.models.loading import load_causal_lm

    cfg, _ = parse_args(["--config", os.path.join(run_dir, "config.yaml"), "--checkpoint.resume", ""])
    codec = codecs.codec_for(cfg.boundary)
    if not codec.needs_calibration:
        if not basis_file:
            raise ValueError(f"{run_dir}: not a pca run ({cfg.boundary.codec}): pass --basis (a pca run's pca_basis.pt)")
        codec = codecs.make_codec("pca")
    plan = prepare(cfg, load_model=False)
    held = plan.eval_rows[:rows]
    if basis_file:
        layers = calibration.boundary_layers(plan.num_layers, cfg.mesh.stages, cfg.mesh.layers_per_stage)
        bases = calibration.for_split(calibration.read(basis_file, layers), layers)
    else:
        bases = calibration.load_split(run_dir, plan.num_layers, cfg.mesh.stages, cfg.mesh.layers_per_stage)
    dtype = getattr(torch, cfg.model.dtype)
    out = []
    for step, path in [(0, plan.model_path)] + ckpt.complete_checkpoints(os.path.join(run_dir, "checkpoints")):
        if steps is not None and step not in steps:
            continue
        model, _ = load_causal_lm(path, dtype=dtype, boundary=False)  # the deployed model as trained: no transform
        for rec in measure(model, held, codec, bases, cfg.mesh.stages, cfg.mesh.layers_per_stage, top, only=only):
            rec = {"step": step, "checkpoint": path if step else "(the base model)", **rec}  # (no machine path)
            out.append(rec)
            progress(format_row(rec))
        del model
    return out


def format_row(rec: dict) -> str:
    d = rec["loss"]["deployed"]
    cells = ", ".join(f"{k} {v:.4f} ({v - d:+.4f})" for k, v in rec["loss"].items() if k != "deployed")
    return f"step {rec['step']} boundary {rec['boundary']}: deployed {d:.4f}; {cells}; " \
           f"outside energy {rec['outside_energy']:.4f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m orchestration.diagnose.mismatch",
                                 description="Where the gap between a pca run's codec-on and deployed loss comes "
                                             "from: per checkpoint and boundary, the loss with parts of the codec's "
                                             "error put back into the deployed model's boundary.")
    ap.add_argument("run_dir", help="a pca trainer run directory (config.yaml, pca_basis.pt, checkpoints/)")
    ap.add_argument("--rows", type=int, default=32, help="held-out rows scored (default 32, as the experiments)")
    ap.add_argument("--steps", default="", help="comma list of steps (default: 0 and every checkpoint)")
    ap.add_argument("--top", default="1,4,16", help="outside-j variants: comma list of j ('' for none)")
    ap.add_argument("--variants", default="", help="comma list: score only these (and deployed), e.g. codec,span "
                    "(default: all)")
    ap.add_argument("--basis", default=None, help="a pca_basis.pt to measure with instead of the run's own (a run of "
                    "another codec, e.g. dense, needs one; it is measured with the default pca codec)")
    ap.add_argument("--out", default=None, help="JSONL output (default RUN_DIR/mismatch.jsonl)")
    a = ap.parse_args(argv)
    if not os.path.isfile(os.path.join(a.run_dir, "config.yaml")):
        print(f"error: {a.run_dir} has no config.yaml: not a trainer run directory", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    steps = [int(s) for s in a.steps.split(",") if s] or None
    top = tuple(int(s) for s in a.top.split(",") if s)
    try:
        recs = measure_run(a.run_dir, a.rows, steps, top, progress=lambda s: print(s, flush=True),
                           only=tuple(v for v in a.variants.split(",") if v), basis_file=a.basis)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_jsonl(a.out or os.path.join(a.run_dir, "mismatch.jsonl"), recs)
    return 0 if all(math.isfinite(v) for r in recs for v in r["loss"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
