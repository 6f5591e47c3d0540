"""The pca boundary codec's wire math as fused ops: project a boundary tensor onto a fixed
PCA basis and quantize the coordinates per token (encode), and back (decode).

    wire = encode(h, U, norm, mean=mean, bits=4, sink=True)
    h_hat = decode(wire, U, norm, shape=h.shape, dtype=h.dtype, mean=mean, bits=4, sink=True)

h [..., T, H] (any float dtype; read as fp32); U [H, k] fp32 (orthonormal columns),
norm [k] fp32 (> 0: the calibration std of each coordinate, ``sd`` forward / ``gsd``
backward), mean [H] fp32 or None (None: no centering, the backward direction).
Body coordinates c = ((h - mean) @ U) / norm, quantized per token: scale = absmax(c) /
qmax (qmax 7 for bits=4, 127 for bits=8; an all-zero row gets scale 1), q =
round-half-even(c / scale) clamped to +-qmax. int4 codes travel two per byte (low nibble
= even coordinate, stored as q + 8; an odd k pads with 8). With ``sink`` the position-0
row of every sequence is not projected: it travels as int8 codes over H with its own
scale. Wire (what ``encode`` returns, fp32 scales):

    sink=False: [codes [..., T, ceil(k/2)] uint8 (bits 4) or [..., T, k] int8, scales [..., T, 1]]
    sink=True:  [head [..., H] int8, head scale [..., 1], codes [..., T-1, .], scales [..., T-1, 1]]

decode: c = (q * scale) * norm, h_hat = c @ U^T (+ mean), the sink row q8 * scale, in
fp32, cast to ``dtype``. This is exactly orchestration/codecs/pca.py's PCACodec
(``_encode`` / ``_decode``) with its QuantCodec: the reference below is that code's math,
and tests/test_pca_ops.py checks it against the codec on random data.

Backends ("auto" | "cpp" | "triton" | "reference", ``MESHKERN_BACKEND``): the reference
(pure torch) is the spec. The kernels fuse the mean subtraction into the projection and
the quantization and nibble packing into one pass over the coordinates, and read the body
rows in place (no slice copy of h, no concatenation on decode). Their quantization is
bit-identical to the reference's given the same coordinates; the coordinates come from
a different fp32 summation order than torch's GEMM, so a code may differ by one level
where c / scale lies within rounding of a tie (x.5), and decoded values agree to fp32
rounding of the sum over k.

Not differentiable: the codes are integers. The codec's backward (a straight-through
quantizer) encodes the incoming gradient with ``mean=None`` and the gradient norm.
Raises TypeError / ValueError for bad dtypes, shapes, devices, bits, and (decode) for
non-finite or non-positive scales, on every backend.
"""
from __future__ import annotations

import torch
from torch import Tensor

from meshkern import _backend
from meshkern._checks import backend_arg as _backend_arg
from meshkern._checks import float_tensor

__all__ = ["encode", "decode", "encode_reference", "decode_reference", "wire_shapes"]

GROUP = "pca"
# orchestration.codecs.pca.pca_width(H) at its defaults (int4, 1/15 of dense fp32, the sink
# row amortized over 128 tokens) for the benchmarked models' hidden sizes (SmolLM2-135M,
# Llama-3.2-1B, Llama-3-8B): the k the compile check and bench/pca_bench.py use.
# tests/test_pca_ops.py checks them against the codec.
CODEC_WIDTH = {576: 288, 2048: 1050, 4096: 2110}
_QMAX = {4: 7, 8: 127}


# ------------------------------------------------------------------------- checks
def _check_basis(H: int, U, norm, mean, device) -> int:
    """Validates U [H, k], norm [k], mean [H] or None (all fp32, on ``device``); returns k."""
    for name, t in (("U", U), ("norm", norm)) + ((("mean", mean),) if mean is not None else ()):
        float_tensor(name, t, (torch.float32,))
        if t.device != device:
            raise ValueError(f"{name} must be on the boundary tensor's device {device}, got {t.device}")
    if U.dim() != 2 or U.shape[0] != H or U.shape[1] < 1:
        raise ValueError(f"U must be [H={H}, k] with k >= 1, got shape {tuple(U.shape)}")
    k = U.shape[1]
    if tuple(norm.shape) != (k,):
        raise ValueError(f"norm must be [k={k}], got shape {tuple(norm.shape)}")
    if mean is not None and tuple(mean.shape) != (H,):
        raise ValueError(f"mean must be [H={H}], got shape {tuple(mean.shape)}")
    return k


def _check_bits(bits) -> int:
    if bits not in _QMAX or isinstance(bits, bool):
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    return int(bits)


def _check_shape(shape) -> tuple[int, ...]:
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2 or min(shape) < 1:
        raise ValueError(f"boundary tensors are [..., T, H] with every dim >= 1, got shape {shape}")
    return shape


def wire_shapes(shape, k: int, bits: int = 4, sink: bool = True) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of each wire tensor for a boundary tensor of ``shape`` [..., T, H]."""
    shape, bits = _check_shape(shape), _check_bits(bits)
    lead, T, H = shape[:-2], shape[-2], shape[-1]
    cw, cdt = ((k + 1) // 2, torch.uint8) if bits == 4 else (k, torch.int8)
    body = [(lead + (T - 1 if sink else T, cw), cdt), (lead + (T - 1 if sink else T, 1), torch.float32)]
    return ([(lead + (H,), torch.int8), (lead + (1,), torch.float32)] if sink else []) + body


def _check_wire(wire, shape, k, bits, sink) -> None:
    _match_wire(wire, wire_shapes(shape, k, bits, sink))


def _match_wire(wire, want) -> None:
    """ValueError unless ``wire`` is a list of tensors of the (shape, dtype) pairs ``want``."""
    if not isinstance(wire, (list, tuple)) or len(wire) != len(want):
        raise ValueError(f"wire must be a list of {len(want)} tensors, got {type(wire).__name__} "
                         f"of {len(wire) if isinstance(wire, (list, tuple)) else '?'}")
    for i, (t, (s, dt)) in enumerate(zip(wire, want)):
        if not isinstance(t, Tensor) or tuple(t.shape) != s or t.dtype != dt:
            got = (tuple(t.shape), t.dtype) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"wire[{i}] must be {s} {dt}, got {got}")


def _check_scales(wire) -> None:
    """ValueError for non-finite or non-positive scales (data-dependent: eager only)."""
    for s in wire[1::2]:
        if s.numel() and (not bool(torch.isfinite(s).all()) or bool((s <= 0).any())):
            raise ValueError("pca decode: received non-finite or non-positive scales")


# ---------------------------------------------------------------------- reference
def quantize_reference(x: Tensor, bits: int) -> list[Tensor]:
    """Per-row symmetric absmax quantization of x [..., W] (as fp32): [codes, scales [..., 1]]."""
    qmax = _QMAX[bits]
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero row: q = 0
    q = torch.round(x / scale).clamp_(-qmax, qmax)
    if bits == 8:
        return [q.to(torch.int8).contiguous(), scale.contiguous()]
    u = (q + 8).to(torch.uint8)  # nibbles 1..15
    if x.shape[-1] % 2:
        u = torch.nn.functional.pad(u, (0, 1), value=8)
    return [(u[..., 0::2] | (u[..., 1::2] << 4)).contiguous(), scale.contiguous()]


def dequantize_reference(q: Tensor, scale: Tensor, W: int, bits: int) -> Tensor:
    """fp32 [..., W] from ``quantize_reference``'s codes and scales."""
    if bits == 8:
        qf = q.float()
    else:
        qf = torch.stack((q & 0xF, q >> 4), dim=-1).reshape(*q.shape[:-1], 2 * q.shape[-1])[..., :W].float() - 8
    return qf * scale


def encode_reference(h: Tensor, U: Tensor, norm: Tensor, *, mean: Tensor | None = None, bits: int = 4,
                     sink: bool = True) -> list[Tensor]:
    """The spec of ``encode`` (PCACodec._encode's math)."""
    x = h.detach().float()
    if sink:
        head, x = x[..., 0, :], x[..., 1:, :]
    c = ((x - mean) if mean is not None else x) @ U / norm
    wire = quantize_reference(c, bits)
    if sink:
        wire = quantize_reference(head, 8) + wire
    return [t.contiguous() for t in wire]


def decode_reference(wire, U: Tensor, norm: Tensor, shape, dtype: torch.dtype, *, mean: Tensor | None = None,
                     bits: int = 4, sink: bool = True) -> Tensor:
    """The spec of ``decode`` (PCACodec._decode's math)."""
    shape = tuple(shape)
    H, k = U.shape
    body = wire[2:] if sink else wire
    c = dequantize_reference(body[0], body[1], k, bits) * norm
    x = c @ U.T
    if mean is not None:
        x = x + mean
    if sink:
        head = dequantize_reference(wire[0], wire[1], H, 8)
        x = torch.cat([head.unsqueeze(-2), x], dim=-2)
    return x.reshape(shape).to(dtype)


# ----------------------------------------------------------------------- dispatch
def _which(device: torch.device, backend: str) -> str:
    return _backend.resolve(GROUP, device, None if backend == "auto" else backend)


def _rowmaps(shape, sink: bool):
    """(body rows, body row map, sequences, head row map) of a contiguous [..., T, H] view."""
    T = shape[-2]
    B = 1
    for s in shape[:-2]:
        B *= s
    if sink:
        return B * (T - 1), (max(T - 1, 1), T, 1), B, (1, T, 0)
    return B * T, (max(B * T, 1), max(B * T, 1), 0), B, None


def _kernels(which: str):
    if which in ("cpp", "cuda"):
        _backend.extension(GROUP)
        ops = torch.ops.meshkern_C
        if not hasattr(ops, "pca_project"):
            raise RuntimeError("meshkern._pca_C has no pca kernels (stale build): rebuild the extension")
        return ops.pca_project, ops.pca_quantize_rows, ops.pca_decode
    from meshkern.triton_kernels import pca as tk  # noqa: PLC0415 (triton is optional)

    return tk.project, tk.quantize_rows, tk.decode


def _encode_impl(h, mean, U, norm, bits, sink, which) -> list[Tensor]:
    shape = tuple(h.shape)
    lead, T, H = shape[:-2], shape[-2], shape[-1]
    k = U.shape[1]
    x = h.detach().contiguous().view(-1, H)
    N, body_map, B, head_map = _rowmaps(shape, sink)
    project, quantize_rows, _ = _kernels(which)
    c = project(x, N, list(body_map), mean, U, norm)
    q, s = quantize_rows(c, N, k, [max(N, 1), max(N, 1), 0], bits)
    Tb = T - 1 if sink else T
    wire = [q.reshape(*lead, Tb, q.shape[-1]), s.reshape(*lead, Tb, 1)]
    if sink:
        hq, hs = quantize_rows(x, B, H, list(head_map), 8)
        wire = [hq.reshape(*lead, H), hs.reshape(*lead, 1)] + wire
    return wire


def _decode_impl(wire, mean, U, norm, shape, dtype, bits, sink, which) -> Tensor:
    H, k = U.shape
    N, body_map, B, _ = _rowmaps(shape, sink)
    out = torch.empty(shape, dtype=dtype, device=U.device)
    q, s = (t.contiguous() for t in (wire[2:] if sink else wire))
    _, _, decode_kernel = _kernels(which)
    decode_kernel(q.reshape(N, q.shape[-1]), s.reshape(N), norm, U, mean, out.view(-1, H), N, list(body_map), bits)
    if sink:  # the head rows: H int8 codes times one scale each (1/T of the rows; elementwise)
        out.select(-2, 0).copy_(dequantize_reference(wire[0], wire[1], H, 8))
    return out


# -------------------------------------------------------------------------- ops
@torch.library.custom_op("meshkern::pca_encode", mutates_args=())
def _encode_op(h: Tensor, mean: Tensor | None, U: Tensor, norm: Tensor, bits: int, sink: bool,
               backend: str) -> list[Tensor]:
    _check_encode(h, mean, U, norm, bits)
    U, norm = U.contiguous(), norm.contiguous()
    mean = None if mean is None else mean.contiguous()
    which = _which(h.device, backend)
    if which == "reference":
        return encode_reference(h, U, norm, mean=mean, bits=bits, sink=sink)
    return _encode_impl(h, mean, U, norm, bits, sink, which)


def _check_encode(h, mean, U, norm, bits) -> int:
    float_tensor("h", h, min_dim=2)
    _check_shape(h.shape)
    _check_bits(bits)
    return _check_basis(h.shape[-1], U, norm, mean, h.device)


@_encode_op.register_fake
def _(h, mean, U, norm, bits, sink, backend):
    k = _check_encode(h, mean, U, norm, bits)
    return [h.new_empty(s, dtype=dt) for s, dt in wire_shapes(h.shape, k, bits, sink)]


@torch.library.custom_op("meshkern::pca_decode", mutates_args=())
def _decode_op(wire: list[Tensor], mean: Tensor | None, U: Tensor, norm: Tensor, shape: list[int],
               dtype: torch.dtype, bits: int, sink: bool, backend: str) -> Tensor:
    _check_decode(wire, mean, U, norm, shape, dtype, bits, sink)
    _check_scales(wire)
    U, norm = U.contiguous(), norm.contiguous()
    mean = None if mean is None else mean.contiguous()
    which = _which(U.device, backend)
    if which == "reference":
        return decode_reference(wire, U, norm, shape, dtype, mean=mean, bits=bits, sink=sink)
    return _decode_impl(wire, mean, U, norm, tuple(shape), dtype, bits, sink, which)


def _check_decode(wire, mean, U, norm, shape, dtype, bits, sink) -> None:
    shape = _check_shape(shape)
    _check_bits(bits)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    float_tensor("U", U, (torch.float32,))
    k = _check_basis(shape[-1], U, norm, mean, U.device)
    _check_wire(wire, shape, k, bits, sink)
    for i, t in enumerate(wire):
        if t.device != U.device:
            raise ValueError(f"wire[{i}] must be on U's device {U.device}, got {t.device}")


@_decode_op.register_fake
def _(wire, mean, U, norm, shape, dtype, bits, sink, backend):
    _check_decode(wire, mean, U, norm, shape, dtype, bits, sink)
    return U.new_empty(tuple(shape), dtype=dtype)


# -------------------------------------------------------------------- public API
def encode(h: Tensor, U: Tensor, norm: Tensor, *, mean: Tensor | None = None, bits: int = 4, sink: bool = True,
           backend: str | None = "auto") -> list[Tensor]:
    """The wire tensors of boundary tensor h [..., T, H] (see the module docstring):
    [codes, scales], or with ``sink`` [head codes, head scales, codes, scales]."""
    return _encode_op(h, mean, U, norm, _check_bits(bits), bool(sink), _backend_arg(backend))


def decode(wire, U: Tensor, norm: Tensor, *, shape, dtype: torch.dtype, mean: Tensor | None = None, bits: int = 4,
           sink: bool = True, backend: str | None = "auto") -> Tensor:
    """h_hat [shape] of ``dtype`` from ``encode``'s wire (same U, norm, mean, bits, sink)."""
    return _decode_op(list(wire), mean, U, norm, list(_check_shape(shape)), dtype, _check_bits(bits), bool(sink),
                      _backend_arg(backend))
