"""What the receiver sees instead of the boundary hidden state h: the ``Transform`` record,
and the real codecs of ``orchestration.codecs`` as transforms.

A codec transform is built with ``make_codec`` and run with ``apply_codec``, so it has
exactly the trainer's forward and backward semantics. Its mask key is
``MaskKey(seed, boundary=L, step=0, microbatch=0)`` for the boundary before decoder layer
L (token rows = the flattened [B*T] positions), as the pipeline does at step 0.

Bytes are per token per direction. "Dense" is H values of the activation dtype; a codec
row counts the codec's exact ``wire_bytes``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from orchestration.codecs import CODECS, BoundaryCodec, apply_codec, make_codec, parse_spec
from orchestration.diagnose.common import UsageError

Fn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (h [B,T,H], ids [B,T]) -> h_hat


@dataclass
class Transform:
    """What the receiver sees instead of h, differentiable (its backward = what comes back).

    ``bytes_fwd`` / ``bytes_bwd``: per token per direction. ``kind``: codec | pca | candidate."""
    name: str
    fn: Fn
    bytes_fwd: int
    bytes_bwd: int
    kind: str
    spec: str = ""
    note: str = ""


def dense_bytes(H: int, dtype: torch.dtype = torch.float32) -> int:
    return H * torch.empty((), dtype=dtype).element_size()


def parse_codec_spec(spec: str) -> tuple[str, dict]:
    """``name`` or ``name:key=value,...`` -> (name, kwargs for make_codec), by the codecs'
    own spec syntax (``codecs.parse_spec``). UsageError for an unknown codec or option."""
    name = spec.partition(":")[0].strip()
    if name not in CODECS:  # said in the command line's words: which flag, what to choose from
        raise UsageError(f"--codecs: unknown codec {name!r} in {spec!r}; choose from {', '.join(CODECS)}")
    if name == "subspace":  # lossless only on a model trained under its constraint
        raise UsageError("--codecs subspace: the subspace codec is exact on a model whose output projections are "
                         "constrained to its basis, which only the trainer does (--boundary.codec subspace); what "
                         "the constraint costs an unconstrained model: docs/heterogeneous.md, section "
                         "'What the constraint costs a pretrained model'")
    try:
        return parse_spec(spec)
    except ValueError as e:
        raise UsageError(f"--codecs: {e}") from None


def spec_codec(spec: str) -> BoundaryCodec:
    """``make_codec`` for a spec (UsageError for a bad option); no hidden size needed yet."""
    name, kw = parse_codec_spec(spec)
    try:
        return make_codec(name, **kw)
    except (ValueError, TypeError) as e:
        raise UsageError(f"--codecs {spec!r}: {e}") from None


def build_codec(spec: str, H: int) -> BoundaryCodec:
    """``make_codec`` for a spec, checked against hidden size H (UsageError on any problem)."""
    codec = spec_codec(spec)
    try:
        codec.wire_bytes((1, H), torch.float32, "fwd")
        codec.wire_bytes((1, H), torch.float32, "bwd")
    except (ValueError, TypeError) as e:
        raise UsageError(f"--codecs {spec!r}: {e}") from None
    return codec


def codec_label(spec: str) -> str:
    name, kw = parse_codec_spec(spec)
    return name + ("" if not kw else " " + " ".join(f"{k}={v}" for k, v in kw.items()))


def codec_transform(spec: str, H: int, L: int, seed: int, dtype=torch.float32,
                    h_cal: torch.Tensor | None = None, g_cal: torch.Tensor | None = None) -> Transform:
    """The codec of ``spec`` round-tripped at boundary L; a ``pca`` codec gets its basis
    from the calibration hidden states ``h_cal`` [B, T, H] (calibration.fit_basis, as the
    trainer fits it; gsd from the dense boundary gradients ``g_cal`` of the first rows of
    h_cal when given, else gsd = 1)."""
    from meshkern.mask import MaskKey

    codec = build_codec(spec, H)
    if codec.needs_calibration:
        if h_cal is None:
            raise UsageError(f"--codecs {spec!r}: the {codec.name} codec needs calibration rows")
        from orchestration.components.calibration import fit_for

        codec.bases = {L: fit_for(codec, h_cal, g_cal)}
    key = MaskKey(seed, L, 0, 0)
    nb = [codec.token_bytes(H, dtype, d) for d in ("fwd", "bwd")]
    return Transform(codec_label(spec), lambda h, ids: apply_codec(codec, h, key), nb[0], nb[1], "codec", spec)


def default_codec_specs(H: int, budget: int, elem: int = 4, seq_len: int = 128) -> list[str]:
    """Every codec at a few ratios; topk / bottleneck also at the bytes of mask p=0.95 and of
    the 1/budget target (mask at the budget: K = the fp32 values that fit); pca (int4 and
    int8, sink) at the budget."""
    from meshkern.mask import kept_dims

    k95 = kept_dims(H, 0.95)
    k_budget = max(1, dense_bytes(H) // budget // elem)
    idx = 2 if H <= 2 ** 15 else 4
    specs = ["dense", "mask:p=0.5", "mask:p=0.9", "mask:p=0.95", "mask:p=0.95,rescale=true"]
    if k_budget != k95:
        specs.append(f"mask:p={1 - k_budget / H:.6f}")
    specs += [f"topk:k={max(1, k95 * elem // (elem + idx))}", f"topk:k={max(1, k_budget * elem // (elem + idx))}",
              "bottleneck:p=0.95", f"bottleneck:rank={k_budget}", "int8", "int4"]
    sl = "" if seq_len == 128 else f",seq_len={seq_len}"
    specs += [f"pca:budget={budget}{sl}", f"pca:quant=absmax,budget={budget}{sl}",
              f"pca:quant=absmax,bits=8,budget={budget}{sl}"]
    return list(dict.fromkeys(specs))
