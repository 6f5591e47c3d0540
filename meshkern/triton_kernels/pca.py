"""Triton kernels for meshkern.pca: the pca codec's encode ((x - mean) @ U / norm, per-token
absmax quantization, int4 codes two per byte) and decode (dequantize, @ U^T, + mean).

Rows: the op views its body rows through a row map, so the sink layout costs no copy: body
row i of the kernel is memory row (i // RB) * RS + i % RB + R0 of x (encode) or of the
output (decode). The sink codec's body is x[..., 1:, :] of [..., T, H]: RB = T - 1,
RS = T, R0 = 1; without a sink RB = RS = N, R0 = 0.

encode, two launches:
  _project_kernel, grid (row blocks, k blocks): c[BM, BK] fp32 accumulated over H in BH
    tiles (x tile widened to fp32, mean subtracted in registers), then divided by norm
    (IEEE division, as torch's); stored to a [N, k] fp32 scratch.
  _quantize_kernel, grid (row blocks): per row, absmax over the row (first pass), scale =
    absmax / qmax (IEEE division; 1 for an all-zero row), then q = round-half-even(c /
    scale) clamped to +-qmax (second pass): int8 codes, or two int4 nibbles per byte (low
    nibble = even coordinate, value + 8; an odd k pads the last high nibble with 8). The
    same kernel quantizes the sink rows (int8 over H, straight from x's dtype).
  Given the same c, codes and scales are bit-identical to the reference (same fp32
  divisions, the same round-half-even); c itself differs from torch's GEMM by fp32
  summation order, so a code can differ by one level where c / scale lies within
  rounding of a tie (tests/test_pca_ops.py bounds where).
decode, grid (row blocks, H blocks): acc[BM, BH] = sum over k slices of
  ((q * scale) * norm) @ U[cols, slice]^T (the dequantization in the reference's fp32
  order), + mean, cast to the output dtype.
fp32 everywhere, dots with input_precision="ieee".
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from meshkern.triton_kernels._target import gpu_shapes

# On a trainer's critical path (every stage boundary, both directions): the compile
# check fails if these spill registers.
HOT_KERNELS = ("_project_kernel", "_quantize_kernel", "_decode_kernel")


@triton.jit
def _body_rows(i, RB, RS, R0):
    return (i // RB) * RS + i % RB + R0


@triton.jit
def _project_kernel(x_ptr, mean_ptr, U_ptr, norm_ptr, c_ptr, N, H, k, RB, RS, R0,
                    CENTER: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BH: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BK + tl.arange(0, BK)
    rmask = i < N
    cmask = cols < k
    rows = _body_rows(i, RB, RS, R0)
    acc = tl.zeros([BM, BK], dtype=tl.float32)
    for h0 in range(0, H, BH):
        hh = h0 + tl.arange(0, BH)
        hmask = hh < H
        x = tl.load(x_ptr + rows[:, None] * H + hh[None, :], mask=rmask[:, None] & hmask[None, :],
                    other=0.0).to(tl.float32)
        if CENTER:
            x = tl.where(hmask[None, :], x - tl.load(mean_ptr + hh, mask=hmask, other=0.0)[None, :], 0.0)
        u = tl.load(U_ptr + hh[:, None] * k + cols[None, :], mask=hmask[:, None] & cmask[None, :], other=0.0)
        acc += tl.dot(x, u, input_precision="ieee")
    norm = tl.load(norm_ptr + cols, mask=cmask, other=1.0)
    c = tl.div_rn(acc, norm[None, :] + tl.zeros_like(acc))
    tl.store(c_ptr + i[:, None] * k + cols[None, :], c, mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _round_half_even(y):
    """torch.round: nearest integer, ties to even (y finite, |y| <= qmax + 0.5 here)."""
    r = tl.floor(y + 0.5)
    tie = (r - y) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def _quantize_kernel(src_ptr, q_ptr, scale_ptr, N, W, RB, RS, R0, QMAX: tl.constexpr, INT4: tl.constexpr,
                     BM: tl.constexpr, BW: tl.constexpr):
    """src rows [N, W] (through the row map) -> codes [N, W] int8 or [N, ceil(W/2)] uint8, scales [N]."""
    i = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    rmask = i < N
    rows = _body_rows(i, RB, RS, R0)
    amax = tl.zeros([BM], dtype=tl.float32)
    for w0 in range(0, W, BW):
        ww = w0 + tl.arange(0, BW)
        v = tl.load(src_ptr + rows[:, None] * W + ww[None, :], mask=rmask[:, None] & (ww < W)[None, :],
                    other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(v), axis=1))
    scale = tl.div_rn(amax, tl.zeros_like(amax) + QMAX)
    scale = tl.where(scale > 0.0, scale, 1.0)
    tl.store(scale_ptr + i, scale, mask=rmask)
    if INT4:
        CW = (W + 1) // 2
        for b0 in range(0, CW, BW):
            bb = b0 + tl.arange(0, BW)
            bmask = rmask[:, None] & (bb < CW)[None, :]
            ev = tl.load(src_ptr + rows[:, None] * W + 2 * bb[None, :], mask=bmask, other=0.0).to(tl.float32)
            od = tl.load(src_ptr + rows[:, None] * W + 2 * bb[None, :] + 1, mask=bmask & (2 * bb + 1 < W)[None, :],
                         other=0.0).to(tl.float32)
            s = scale[:, None] + tl.zeros_like(ev)
            qe = tl.minimum(tl.maximum(_round_half_even(tl.div_rn(ev, s)), -QMAX), QMAX)
            qo = tl.minimum(tl.maximum(_round_half_even(tl.div_rn(od, s)), -QMAX), QMAX)
            byte = (qe + 8.0).to(tl.int32) | ((qo + 8.0).to(tl.int32) << 4)  # padding: od = 0 -> nibble 8
            tl.store(q_ptr + i[:, None] * CW + bb[None, :], byte.to(tl.uint8), mask=bmask)
    else:
        for w0 in range(0, W, BW):
            ww = w0 + tl.arange(0, BW)
            wmask = rmask[:, None] & (ww < W)[None, :]
            v = tl.load(src_ptr + rows[:, None] * W + ww[None, :], mask=wmask, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(_round_half_even(tl.div_rn(v, scale[:, None] + tl.zeros_like(v))), -QMAX), QMAX)
            tl.store(q_ptr + i[:, None] * W + ww[None, :], q.to(tl.int8), mask=wmask)


@triton.jit
def _decode_kernel(q_ptr, scale_ptr, norm_ptr, U_ptr, mean_ptr, out_ptr, N, H, k, RB, RS, R0,
                   INT4: tl.constexpr, CENTER: tl.constexpr, BM: tl.constexpr, BH: tl.constexpr,
                   BK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    rmask = i < N
    hmask = cols < H
    scale = tl.load(scale_ptr + i, mask=rmask, other=0.0)
    acc = tl.zeros([BM, BH], dtype=tl.float32)
    for k0 in range(0, k, BK):
        kk = k0 + tl.arange(0, BK)
        kmask = kk < k
        m2 = rmask[:, None] & kmask[None, :]
        if INT4:
            byte = tl.load(q_ptr + i[:, None] * ((k + 1) // 2) + (kk >> 1)[None, :], mask=m2, other=0).to(tl.int32)
            q = ((byte >> ((kk & 1) * 4)[None, :]) & 0xF).to(tl.float32) - 8.0
        else:
            q = tl.load(q_ptr + i[:, None] * k + kk[None, :], mask=m2, other=0).to(tl.float32)
        norm = tl.load(norm_ptr + kk, mask=kmask, other=0.0)
        c = tl.where(m2, (q * scale[:, None]) * norm[None, :], 0.0)
        u = tl.load(U_ptr + cols[:, None] * k + kk[None, :], mask=hmask[:, None] & kmask[None, :], other=0.0)
        acc += tl.dot(c, tl.trans(u), input_precision="ieee")
    if CENTER:
        acc += tl.load(mean_ptr + cols, mask=hmask, other=0.0)[None, :]
    rows = _body_rows(i, RB, RS, R0)
    tl.store(out_ptr + rows[:, None] * H + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None] & hmask[None, :])


# GPU launch shapes, from the ahead-of-time compile report (python -m bench.compile_check
# --triton --only pca; not yet timed on a GPU): 0 spills on sm_80/86/89/90 in fp32 and
# bf16 at H = 576, 2048, 4096 with the codec's k (94-168 regs in _project_kernel, <= 96 in
# _quantize_kernel, 72-96 in _decode_kernel). Decode with 64x64 tiles hit 255 registers
# and spilled 28-88 B on sm_80/86/89 with 4 warps, 12-16 B with 8; 32x32 tiles do not
# spill and leave room for ~6 blocks per SM. The interpreter (CPU tests) takes 4x bigger
# blocks: its cost is per program instance.
PROJECT_BLOCKS = (64, 64, 32, 4)  # BM, BK, BH, num_warps
QUANT_BLOCKS = (8, 128, 4)  # BM, BW, num_warps
DECODE_BLOCKS = (32, 32, 32, 4)  # BM, BH, BK, num_warps


def _interp(blocks, device):
    return blocks if gpu_shapes(device) else tuple(min(4 * b, 256) for b in blocks[:-1]) + (blocks[-1],)


def quantize_rows(src: torch.Tensor, N: int, W: int, rowmap, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [N, W] int8 (bits 8) or [N, ceil(W/2)] uint8 (bits 4) and fp32 scales [N] of
    the N rows of ``src`` (contiguous, W wide) that ``rowmap`` = (RB, RS, R0) selects."""
    qmax, int4 = (7, True) if bits == 4 else (127, False)
    q = torch.empty(N, (W + 1) // 2 if int4 else W, dtype=torch.uint8 if int4 else torch.int8, device=src.device)
    scale = torch.empty(N, dtype=torch.float32, device=src.device)
    if N:
        BM, BW, warps = _interp(QUANT_BLOCKS, src.device)
        _quantize_kernel[(triton.cdiv(N, BM),)](src, q, scale, N, W, *rowmap, QMAX=qmax, INT4=int4, BM=BM, BW=BW,
                                                num_warps=warps)
    return q, scale


def project(x: torch.Tensor, N: int, rowmap, mean, U: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """c [N, k] fp32 = ((x_rows - mean) @ U) / norm (mean None: no centering)."""
    H, k = U.shape
    c = torch.empty(N, k, dtype=torch.float32, device=x.device)
    if N:
        BM, BK, BH, warps = _interp(PROJECT_BLOCKS, x.device)
        _project_kernel[(triton.cdiv(N, BM), triton.cdiv(k, BK))](
            x, U if mean is None else mean, U, norm, c, N, H, k, *rowmap, CENTER=mean is not None, BM=BM, BK=BK,
            BH=BH, num_warps=warps)
    return c


def encode(x: torch.Tensor, N: int, rowmap, mean, U, norm, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The body's (codes, scales [N]) of x's rows selected by ``rowmap``."""
    c = project(x, N, rowmap, mean, U, norm)
    return quantize_rows(c, N, U.shape[1], (max(N, 1), max(N, 1), 0), bits)


def decode(q: torch.Tensor, scale: torch.Tensor, norm, U, mean, out: torch.Tensor, N: int, rowmap, bits: int) -> None:
    """Writes the N decoded body rows into ``out`` [rows, H] (contiguous) through ``rowmap``."""
    H, k = U.shape
    if N:
        BM, BH, BK, warps = _interp(DECODE_BLOCKS, out.device)
        _decode_kernel[(triton.cdiv(N, BM), triton.cdiv(H, BH))](
            q, scale, norm, U, U if mean is None else mean, out, N, H, k, *rowmap, INT4=bits == 4,
            CENTER=mean is not None, BM=BM, BH=BH, BK=BK, num_warps=warps)
