"""The ``pca:quant=nf`` wire math: PCA coordinates quantized with a bit width of their
own, chosen from the calibrated variance of each coordinate, on Gaussian (normal-float)
code books, packed into one bit stream per token.

    bits = allocate_bits(sd ** 2, total_bits)                 # once, at calibration
    wire = encode_reference(h, U, sd, bits, nbytes, mean=mean)
    h_hat = decode_reference(wire, U, sd, bits, shape, dtype, mean=mean)

Why: in the default codec (int4 on the top k = H/2 coordinates, the rest dropped) the
dropped coordinates cost more than the int4 rounding of the kept ones (results/NOTEBOOK.md,
"What pca loses"). Classic transform coding spends a fixed bit budget the other way:
every coordinate gets bits in proportion to its log-variance (reverse water-filling), so
the few high-variance coordinates get 4-6 bits and the long tail 1-2 bits instead of 0.

The spec (pure torch, all fp32 unless said):
    code books   ``lloyd_max(b)``: the 2^b-level Lloyd-Max quantizer of a unit Gaussian
                 (Max 1960), computed by Lloyd's iteration on the exact Gaussian integrals
                 in float64 on the CPU, so both ends of a link derive the same levels.
    allocation   ``allocate_bits(var, total_bits)``: greedy, one bit at a time, to the
                 coordinate whose expected squared error var_i * D(b_i) falls most
                 (D(b): the code book's distortion on a unit Gaussian; D is convex in b,
                 so the greedy is optimal and equals the top ``total_bits`` marginal
                 gains); ties go to the lower index; at most ``max_bits`` per coordinate.
    coordinates  c = ((h - mean) @ U) / norm (norm = sd forward, gsd backward), per token
                 r = rms(c) over the coordinates, rounded to fp16 (sent as fp16; an
                 all-zero token gets r = 1; r is clamped into fp16's normal range),
                 z = c / r, code_i = bucketize(z_i, boundaries of lloyd_max(b_i)) for
                 b_i > 0 (coordinates with b_i = 0 are not sent and decode to 0); NaN
                 gets the top code, as +inf (the trainer rejects non-finite steps anyway).
    packing      codes in coordinate order, each b_i bits, least significant bit first,
                 into ``nbytes`` bytes per token (``pack_codes``); unused trailing bits 0.
    decode       c_hat_i = levels(b_i)[code_i] * r * norm_i, h_hat = c_hat @ U^T + mean.
    sink         as the int4 codec: position 0 of each sequence travels as int8 over H
                 with an fp32 scale (meshkern.pca.quantize_reference).
Wire: sink=True: [head [..., H] int8, head scale [..., 1] fp32, codes [..., T-1, nbytes]
uint8, r [..., T-1, 1] fp16]; sink=False: [codes [..., T, nbytes], r [..., T, 1]].

Backends: ``encode`` / ``decode`` take ``backend`` ("auto" | "cpp" | "triton" | "cuda" |
"reference"): on CPU, meshkern._pca_C's pca_nf_pack / pca_nf_unpack (csrc/pca/pca_nf_cpu.cpp)
do the code search and the bit stream in one pass per row; on CUDA, Triton's
(meshkern/triton_kernels/pca_nf.py; "cuda" means the same kernels, there is no CUDA C++
one). Comparisons and shifts: the reference's codes and wire bit for bit. The GEMMs are
torch's on every backend.

Ops: ``encode`` / ``decode`` are the custom ops meshkern::pca_nf_encode / pca_nf_decode
(fake kernels for torch.compile; not differentiable: the codes are integers, and the
codec's backward encodes the incoming gradient itself, as meshkern.pca's). bits: int64
[k] on any device (the widths are read on the CPU). Raises TypeError / ValueError for bad
dtypes, shapes, devices, widths, and for widths that do not fit ``nbytes`` or (decode)
non-finite or non-positive scales, on every backend.
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import Tensor

from meshkern import _backend
from meshkern._checks import as_int, float_tensor
from meshkern._checks import backend_arg as _backend_arg
from meshkern.pca import (GROUP, _check_basis, _check_scales, _check_shape, _match_wire, dequantize_reference,
                          quantize_reference)

__all__ = ["lloyd_max", "distortion", "allocate_bits", "pack_codes", "unpack_codes", "encode", "decode",
           "encode_reference", "decode_reference", "wire_shapes", "MAX_BITS"]

MAX_BITS = 8
_FP16_TINY, _FP16_MAX = 2.0 ** -14, 65504.0


# ---------------------------------------------------------------- code books
def _phi(x: Tensor) -> Tensor:
    return torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _Phi(x: Tensor) -> Tensor:
    return 0.5 * (1 + torch.erf(x / math.sqrt(2)))


def _cells(lv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(lower bounds, upper bounds, Gaussian mass) of the cells of the midpoint quantizer."""
    b = (lv[1:] + lv[:-1]) / 2
    inf = torch.tensor([math.inf], dtype=torch.float64)
    lo, hi = torch.cat([-inf, b]), torch.cat([b, inf])
    return lo, hi, _Phi(hi) - _Phi(lo)


@lru_cache(maxsize=None)
def _lloyd_max64(bits: int) -> tuple[Tensor, Tensor, float]:
    """(levels [2^b], boundaries [2^b - 1], distortion) in float64 for a unit Gaussian."""
    L = 2 ** bits
    # start at the high-rate optimum (point density ~ pdf^(1/3): quantiles of N(0, 3)), then
    # Lloyd's iteration: boundaries at midpoints, levels at the cells' conditional means
    # (exact Gaussian integrals) until no level moves by 1e-10 (fp32 levels need no more)
    p = (torch.arange(L, dtype=torch.float64) + 0.5) / L
    lv = math.sqrt(3) * math.sqrt(2) * torch.erfinv(2 * p - 1)
    for _ in range(20000):
        lo, hi, mass = _cells(lv)
        new = (_phi(lo) - _phi(hi)) / mass.clamp_min(1e-300)
        done = bool((new - lv).abs().max() < 1e-10)
        lv = new
        if done:
            break
    lo, hi, mass = _cells(lv)
    # E[(x - l)^2 ; lo < x < hi] = E[x^2 ; cell] - 2 l E[x ; cell] + l^2 P(cell), with
    # E[x^2 ; cell] = P + lo phi(lo) - hi phi(hi) and E[x ; cell] = phi(lo) - phi(hi)
    xphi = lambda t: torch.where(torch.isfinite(t), t * _phi(t), torch.zeros_like(t))  # noqa: E731
    ex2 = mass + xphi(lo) - xphi(hi)
    dist = float((ex2 - 2 * lv * (_phi(lo) - _phi(hi)) + lv * lv * mass).sum())
    return lv, (lv[1:] + lv[:-1]) / 2, dist


def lloyd_max(bits: int) -> tuple[Tensor, Tensor]:
    """(levels [2^bits], boundaries [2^bits - 1]) fp32 of the Lloyd-Max quantizer of a unit
    Gaussian; the same values on every machine (float64 CPU math, then rounded)."""
    _check_width(bits)
    lv, b, _ = _lloyd_max64(int(bits))
    return lv.float(), b.float()


def distortion(bits: int) -> float:
    """Mean squared error of ``lloyd_max(bits)`` on a unit Gaussian (1.0 for 0 bits)."""
    if bits == 0:
        return 1.0
    _check_width(bits)
    return _lloyd_max64(int(bits))[2]


def _check_width(bits) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
        raise ValueError(f"a code width must be an int in 1..{MAX_BITS}, got {bits!r}")


def allocate_bits(var: Tensor, total_bits: int, max_bits: int = MAX_BITS) -> Tensor:
    """Bits per coordinate [k] int64 (sum = min(total_bits, k * max_bits)) for coordinates of
    variance ``var`` [k] (>= 0): the greedy of the module doc."""
    var = torch.as_tensor(var).detach().double().cpu()
    if var.dim() != 1 or var.numel() < 1 or not bool(torch.isfinite(var).all()) or bool((var < 0).any()):
        raise ValueError(f"allocate_bits: var must be a non-empty [k] of finite values >= 0, got {tuple(var.shape)}")
    if not 1 <= int(max_bits) <= MAX_BITS or int(total_bits) < 0:
        raise ValueError(f"allocate_bits: max_bits in 1..{MAX_BITS} and total_bits >= 0, got {max_bits}, {total_bits}")
    D = torch.tensor([distortion(b) for b in range(int(max_bits) + 1)], dtype=torch.float64)
    gain = var[:, None] * (D[:-1] - D[1:])[None, :]  # [k, max_bits]: what bit b+1 of coordinate i saves
    n = min(int(total_bits), gain.numel())
    order = torch.argsort(-gain.reshape(-1), stable=True)[:n]  # row-major: ties to the lower index
    return torch.bincount(order // int(max_bits), minlength=var.numel()).long()


# ------------------------------------------------------------------- packing
# The stream is built in 32-bit words held in int64: a code at bit offset o lands in word
# o // 32 shifted by o % 32, and its bits above the word's 32 in the next word. Codes do
# not overlap, so adding them is OR-ing them. One pass over [..., k] codes instead of one
# over [..., sum(bits)] single bits (3x faster at H = 576).
def _offsets(bits: Tensor, device) -> tuple[Tensor, Tensor, Tensor]:
    """(word, shift, mask) of every coordinate's code in the stream (int64)."""
    bits = bits.long().cpu()
    off = torch.cumsum(bits, 0) - bits
    return off.div(32, rounding_mode="floor").to(device), (off % 32).to(device), ((1 << bits) - 1).to(device)


def pack_codes(codes: Tensor, bits: Tensor, nbytes: int) -> Tensor:
    """codes [..., k] (0 <= code_i < 2^bits_i) -> [..., nbytes] uint8, LSB first (module doc)."""
    total = int(bits.sum())
    if total > 8 * int(nbytes):
        raise ValueError(f"pack_codes: {total} bits do not fit {nbytes} bytes")
    word, shift, _ = _offsets(bits, codes.device)
    nwords = -(-int(nbytes) // 4) + 1
    v = codes.long() << shift
    words = torch.zeros(*codes.shape[:-1], nwords, dtype=torch.int64, device=codes.device)
    words.index_add_(-1, word, v & 0xFFFFFFFF).index_add_(-1, word + 1, v >> 32)
    out = (words[..., None] >> torch.arange(0, 32, 8, device=codes.device)) & 0xFF
    return out.reshape(*codes.shape[:-1], 4 * nwords)[..., :int(nbytes)].to(torch.uint8)


def unpack_codes(packed: Tensor, bits: Tensor) -> Tensor:
    """The inverse of ``pack_codes``: [..., nbytes] uint8 -> codes [..., k] int64."""
    word, shift, mask = _offsets(bits, packed.device)
    nb = packed.shape[-1]
    nwords = -(-nb // 4) + 1
    b = torch.nn.functional.pad(packed.long(), (0, 4 * nwords - nb)).reshape(*packed.shape[:-1], nwords, 4)
    words = (b << torch.arange(0, 32, 8, device=packed.device)).sum(-1)
    lo, hi = words.index_select(-1, word), words.index_select(-1, (word + 1).clamp_max(nwords - 1))
    return ((lo | (hi << 32)) >> shift) & mask


# ---------------------------------------------------------------- the codec
def wire_shapes(shape, nbytes: int, sink: bool = True) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of each wire tensor for a boundary tensor [..., T, H]."""
    shape = tuple(int(s) for s in shape)
    lead, T, H = shape[:-2], shape[-2], shape[-1]
    Tb = T - 1 if sink else T
    body = [(lead + (Tb, int(nbytes)), torch.uint8), (lead + (Tb, 1), torch.float16)]
    return ([(lead + (H,), torch.int8), (lead + (1,), torch.float32)] if sink else []) + body


def _tables(bits: Tensor, device) -> tuple[Tensor, Tensor]:
    """(levels [k, 2^max], boundaries [k, 2^max - 1]) of every coordinate's code book, padded
    with +inf boundaries (never passed) and zero levels; a 0-bit coordinate decodes to 0."""
    return _tables_cached(tuple(int(v) for v in bits.tolist()), str(device))


@lru_cache(maxsize=64)
def _tables_cached(bits: tuple, device: str) -> tuple[Tensor, Tensor]:
    top = max(1, max(bits))
    lv = torch.zeros(len(bits), 2 ** top)
    bd = torch.full((len(bits), 2 ** top - 1), float("inf"))
    for b in sorted(set(bits) - {0}):
        cols = torch.tensor([i for i, v in enumerate(bits) if v == b])
        lvb, bdb = lloyd_max(b)
        lv[cols, :2 ** b], bd[cols, :2 ** b - 1] = lvb, bdb
    return lv.to(device), bd.to(device)


def _which(device: torch.device, backend: str) -> str:
    """cpp (meshkern._pca_C's pack/unpack) on CPU when built; triton on CUDA (there is no
    CUDA C++ kernel for nf: "cuda" runs Triton's); else the reference."""
    which = _backend.resolve(GROUP, device, None if backend == "auto" else backend)
    if which == "cuda":
        which = "triton" if _backend.why_unavailable("triton", GROUP, device) is None else "reference"
    if which == "cpp":
        _backend.extension(GROUP)
        if not hasattr(torch.ops.meshkern_C, "pca_nf_pack"):
            raise RuntimeError("meshkern._pca_C has no pca_nf kernels (stale build): rebuild the extension")
    return which


# ----------------------------------------------------------------------- checks
def _check_widths(bits, k: int) -> None:
    """bits: an int64 tensor [k] (any device: the widths are read on the CPU)."""
    if not isinstance(bits, Tensor) or bits.dtype != torch.int64:
        got = bits.dtype if isinstance(bits, Tensor) else type(bits).__name__
        raise TypeError(f"bits must be an int64 tensor of code widths, got {got}")
    if tuple(bits.shape) != (k,):
        raise ValueError(f"bits must be [k={k}] code widths, got shape {tuple(bits.shape)}")


def _check_budget(bits: Tensor, nbytes: int) -> None:
    """Widths in 0..MAX_BITS whose sum fits ``nbytes`` bytes (data-dependent: eager only)."""
    if bits.numel() and (int(bits.min()) < 0 or int(bits.max()) > MAX_BITS):
        raise ValueError(f"bits must be code widths in 0..{MAX_BITS}, got {int(bits.min())}..{int(bits.max())}")
    if int(bits.sum()) > 8 * nbytes:
        raise ValueError(f"pca_nf: {int(bits.sum())} bits do not fit {nbytes} bytes per token")


def _check_encode(h, mean, U, norm, bits, nbytes) -> int:
    float_tensor("h", h, min_dim=2)
    _check_shape(h.shape)
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    k = _check_basis(h.shape[-1], U, norm, mean, h.device)
    _check_widths(bits, k)
    return k


def _check_decode(wire, mean, U, norm, bits, shape, dtype, sink) -> None:
    shape = _check_shape(shape)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    float_tensor("U", U, (torch.float32,))
    _check_widths(bits, _check_basis(shape[-1], U, norm, mean, U.device))
    codes = wire[-2] if isinstance(wire, (list, tuple)) and len(wire) >= 2 else None
    nbytes = codes.shape[-1] if isinstance(codes, Tensor) and codes.dim() else 0  # the codes' width: any
    _match_wire(wire, wire_shapes(shape, nbytes, sink))
    for i, t in enumerate(wire):
        if t.device != U.device:
            raise ValueError(f"wire[{i}] must be on U's device {U.device}, got {t.device}")


# ------------------------------------------------------------------ the math
def _encode_impl(h, mean, U, norm, bits, nbytes, sink, which) -> list[Tensor]:
    """The wire (module doc). The projection, the scale and the division are torch's on
    every backend; ``cpp`` and ``triton`` replace the code search and the bit packing (the
    same codes: comparisons only)."""
    x = h.detach().float()
    if sink:
        head, x = x[..., 0, :], x[..., 1:, :]
    c = ((x - mean) if mean is not None else x) @ U / norm
    r = c.pow(2).mean(-1, keepdim=True).sqrt()
    r = torch.where(r > 0, r, torch.ones_like(r)).clamp(_FP16_TINY, _FP16_MAX).half()
    z = c / r.float()
    _, bd = _tables(bits, z.device)
    if which in ("cpp", "triton"):
        flat = z.reshape(-1, z.shape[-1]).contiguous()
        if which == "cpp":
            flat = torch.ops.meshkern_C.pca_nf_pack(flat, bd, bits.long().cpu(), int(nbytes))
        else:
            from meshkern.triton_kernels import pca_nf as tk  # noqa: PLC0415 (triton is optional)
            flat = tk.pack(flat, bd, bits, int(nbytes))
        packed = flat.reshape(*z.shape[:-1], int(nbytes))
    else:
        zt = z.reshape(-1, z.shape[-1]).T.contiguous()  # [k, N]: one sorted table per coordinate
        codes = torch.searchsorted(bd, zt).T.reshape(z.shape)  # = bucketize(z_i, boundaries_i)
        # NaN counts past the padding: clamp it to the top code of its width, as +inf
        codes = torch.minimum(codes, ((1 << bits.long()) - 1).to(codes.device))
        packed = pack_codes(codes, bits, nbytes)
    wire = [packed.contiguous(), r.contiguous()]
    if sink:
        wire = quantize_reference(head, 8) + wire
    return wire


def _decode_impl(wire, mean, U, norm, bits, shape, dtype, sink, which) -> Tensor:
    H = U.shape[0]
    packed, r = wire[2:] if sink else wire
    lv, _ = _tables(bits, packed.device)
    if which in ("cpp", "triton"):
        flat = packed.reshape(-1, packed.shape[-1]).contiguous()
        if which == "cpp":
            flat = torch.ops.meshkern_C.pca_nf_unpack(flat, lv, bits.long().cpu())
        else:
            from meshkern.triton_kernels import pca_nf as tk  # noqa: PLC0415 (triton is optional)
            flat = tk.unpack(flat, lv, bits)
        z = flat.reshape(*packed.shape[:-1], bits.numel())
    else:
        codes = unpack_codes(packed, bits)
        z = lv.gather(1, codes.reshape(-1, codes.shape[-1]).T.contiguous()).T.reshape(codes.shape)
    x = (z * r.float() * norm) @ U.T
    if mean is not None:
        x = x + mean
    if sink:
        x = torch.cat([dequantize_reference(wire[0], wire[1], H, 8).unsqueeze(-2), x], dim=-2)
    return x.reshape(shape).to(dtype)


# -------------------------------------------------------------------------- ops
@torch.library.custom_op("meshkern::pca_nf_encode", mutates_args=())
def _encode_op(h: Tensor, mean: Tensor | None, U: Tensor, norm: Tensor, bits: Tensor, nbytes: int, sink: bool,
               backend: str) -> list[Tensor]:
    _check_encode(h, mean, U, norm, bits, nbytes)
    _check_budget(bits, nbytes)
    return _encode_impl(h, mean, U, norm, bits, nbytes, sink, _which(h.device, backend))


@_encode_op.register_fake
def _(h, mean, U, norm, bits, nbytes, sink, backend):
    _check_encode(h, mean, U, norm, bits, nbytes)
    return [h.new_empty(s, dtype=dt) for s, dt in wire_shapes(h.shape, nbytes, sink)]


@torch.library.custom_op("meshkern::pca_nf_decode", mutates_args=())
def _decode_op(wire: list[Tensor], mean: Tensor | None, U: Tensor, norm: Tensor, bits: Tensor, shape: list[int],
               dtype: torch.dtype, sink: bool, backend: str) -> Tensor:
    _check_decode(wire, mean, U, norm, bits, shape, dtype, sink)
    _check_scales(wire)
    _check_budget(bits, wire[-2].shape[-1])
    return _decode_impl(wire, mean, U, norm, bits, tuple(shape), dtype, sink, _which(U.device, backend))


@_decode_op.register_fake
def _(wire, mean, U, norm, bits, shape, dtype, sink, backend):
    _check_decode(wire, mean, U, norm, bits, shape, dtype, sink)
    return U.new_empty(tuple(shape), dtype=dtype)


# -------------------------------------------------------------------- public API
def encode(h: Tensor, U: Tensor, norm: Tensor, bits: Tensor, nbytes: int, *, mean: Tensor | None = None,
           sink: bool = True, backend: str | None = "auto") -> list[Tensor]:
    """The wire of boundary tensor h [..., T, H] (module doc): [codes, scales], or with
    ``sink`` [head codes, head scale, codes, scales]."""
    return _encode_op(h, mean, U, norm, bits, _nbytes(nbytes), bool(sink), _backend_arg(backend))


def decode(wire, U: Tensor, norm: Tensor, bits: Tensor, shape, dtype: torch.dtype, *,
           mean: Tensor | None = None, sink: bool = True, backend: str | None = "auto") -> Tensor:
    """h_hat [shape] of ``dtype`` from ``encode``'s wire (same U, norm, bits, mean, sink)."""
    return _decode_op(list(wire), mean, U, norm, bits, list(_check_shape(shape)), dtype, bool(sink),
                      _backend_arg(backend))


def _nbytes(nbytes) -> int:
    n = as_int(nbytes)
    if n is None:
        raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
    return n


def encode_reference(h: Tensor, U: Tensor, norm: Tensor, bits: Tensor, nbytes: int, *,
                     mean: Tensor | None = None, sink: bool = True) -> list[Tensor]:
    """The spec of ``encode``: the pure-torch path."""
    return encode(h, U, norm, bits, nbytes, mean=mean, sink=sink, backend="reference")


def decode_reference(wire, U: Tensor, norm: Tensor, bits: Tensor, shape, dtype: torch.dtype, *,
                     mean: Tensor | None = None, sink: bool = True) -> Tensor:
    """The spec of ``decode``: the pure-torch path."""
    return decode(wire, U, norm, bits, shape, dtype, mean=mean, sink=sink, backend="reference")
