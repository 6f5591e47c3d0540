"""Triton kernels for meshkern.subspace: fused encode c = (h - base) @ U and decode
h = base + c @ U^T, base = E[ids] (a gathered row of the token-embedding table), a
broadcast offset [H], or zero (BASE = 1, 2, 0; a compile-time constant); encode also
takes a projected table T = E U [V, k] (BASE = 3): c = h U - T[ids], the gathered k-wide
T rows subtracted from the accumulator after the H loop.

encode, grid (row blocks): each program owns BM rows and walks H in BH-wide tiles: loads
the h tile, subtracts the gathered E tile (or the offset) in registers and accumulates
tile @ U[tile, :] into a [BM, KP] fp32 accumulator; only c is stored. Nothing [N, H]
besides h itself is read or written.
decode, grid (row blocks, H blocks): acc = c[rows, :] @ U[cols, :]^T, plus the gathered
base tile, stored once.
fp32 accumulation for every dtype (fp64 inputs too: tl.dot on fp64 is not portable),
dots with input_precision="ieee"; k is padded to KP = max(16, next power of two) with
zero columns, so the padding adds nothing. ids are range-checked by the Python op.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 32
BLOCK_H = 64
# decode's slice of k per dot (the k loop), and encode's H tile at KP >= 256: from the
# ahead-of-time compile report (bench/compile_check.py --only subspace). Encode's
# [BM, BH] + [BH, KP] operands, double-buffered, asked for 144 KiB of shared memory at
# KP = 256 with BH = 64 (sm_86 / sm_89 allow 99 KiB); BH = 32 halves it. Decode with the
# whole [BM, KP] x [BH, KP] product in one dot spilled 10-47 kB per thread from KP = 64.
BLOCK_K = 32


def _encode_bh(KP: int) -> int:
    return BLOCK_H if KP < 256 else 32


@triton.jit
def _encode_kernel(h_ptr, ids_ptr, E_ptr, off_ptr, T_ptr, U_ptr, out_ptr, N, H, k,
                   BASE: tl.constexpr, BM: tl.constexpr, BH: tl.constexpr, KP: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    rmask = rows < N
    kk = tl.arange(0, KP)
    kmask = kk < k
    acc = tl.zeros([BM, KP], dtype=tl.float32)
    if BASE == 1 or BASE == 3:
        ids = tl.load(ids_ptr + rows, mask=rmask, other=0)
    for h0 in range(0, H, BH):
        cols = h0 + tl.arange(0, BH)
        cmask = cols < H
        m2 = rmask[:, None] & cmask[None, :]
        x = tl.load(h_ptr + rows[:, None] * H + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        if BASE == 1:
            x -= tl.load(E_ptr + ids[:, None] * H + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        elif BASE == 2:
            x -= tl.load(off_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        u = tl.load(U_ptr + cols[:, None] * k + kk[None, :], mask=cmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.dot(x, u, input_precision="ieee")
    if BASE == 3:
        acc -= tl.load(T_ptr + ids[:, None] * k + kk[None, :], mask=rmask[:, None] & kmask[None, :],
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * k + kk[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None] & kmask[None, :])


@triton.jit
def _decode_kernel(c_ptr, ids_ptr, E_ptr, off_ptr, U_ptr, out_ptr, N, H, k,
                   BASE: tl.constexpr, BM: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    cols = tl.program_id(1).to(tl.int64) * BH + tl.arange(0, BH)
    rmask = rows < N
    cmask = cols < H
    acc = tl.zeros([BM, BH], dtype=tl.float32)
    for k0 in range(0, k, BK):  # BK-wide slices of k: a [BM, KP] + [BH, KP] pair spilled and overflowed smem
        kk = k0 + tl.arange(0, BK)
        kmask = kk < k
        c = tl.load(c_ptr + rows[:, None] * k + kk[None, :], mask=rmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        u = tl.load(U_ptr + cols[:, None] * k + kk[None, :], mask=cmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.dot(c, tl.trans(u), input_precision="ieee")
    m2 = rmask[:, None] & cmask[None, :]
    if BASE == 1:
        ids = tl.load(ids_ptr + rows, mask=rmask, other=0)
        acc += tl.load(E_ptr + ids[:, None] * H + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    elif BASE == 2:
        acc += tl.load(off_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * H + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=m2)


def _base(x, ids, E, offset):
    """(BASE, ids, E, offset) with stand-ins for the absent pointers (never read)."""
    if E is not None:
        return 1, ids, E, x
    if offset is not None:
        return 2, x, x, offset
    return 0, x, x, x


def _kp(k: int) -> int:
    return max(16, triton.next_power_of_2(k))


def encode(h: torch.Tensor, ids, E, offset, table, U: torch.Tensor) -> torch.Tensor:
    """h [N, H] (contiguous, checked by meshkern.subspace) -> c [N, k] in h's dtype."""
    N, H = h.shape
    k = U.shape[1]
    out = torch.empty(N, k, dtype=h.dtype, device=h.device)
    if N == 0:
        return out
    if table is not None:
        base, E, offset = 3, h, h
    else:
        base, ids, E, offset = _base(h, ids, E, offset)
        table = h
    _encode_kernel[(triton.cdiv(N, BLOCK_M),)](h, ids, E, offset, table, U, out, N, H, k,
                                               BASE=base, BM=BLOCK_M, BH=_encode_bh(_kp(k)), KP=_kp(k))
    return out


def decode(c: torch.Tensor, ids, E, offset, U: torch.Tensor) -> torch.Tensor:
    """c [N, k] (contiguous) -> h [N, H] in c's dtype."""
    N, k = c.shape
    H = U.shape[0]
    out = torch.empty(N, H, dtype=c.dtype, device=c.device)
    if N == 0:
        return out
    base, ids, E, offset = _base(c, ids, E, offset)
    _decode_kernel[(triton.cdiv(N, BLOCK_M), triton.cdiv(H, BLOCK_H))](c, ids, E, offset, U, out, N, H, k,
                                                                        BASE=base, BM=BLOCK_M, BH=BLOCK_H,
                                                                        BK=BLOCK_K)
    return out
