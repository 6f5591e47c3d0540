"""Triton kernels for meshkern.pca_nf: the code search and the bit stream of the
``pca:quant=nf`` codec (what csrc/pca/pca_nf_cpu.cpp does on CPU). The spec is
meshkern/pca_nf.py's reference; the projection, the per-token scale and both GEMMs stay
torch's (cuBLAS on a GPU), as on the cpp backend.

    packed = pack(z, bounds, bits, nbytes)    # z [N, k] fp32 -> [N, nbytes] uint8
    z_hat = unpack(packed, levels, bits)      # -> [N, k] fp32

Every token row uses the same layout: coordinate i's b_i-bit code sits at bit offset
o_i = b_0 + ... + b_{i-1} of the row's stream, least significant bit first. The host
derives the layout once per width vector (cached) and hands it to the kernels as small
int32 tables.

pack, grid (row blocks, byte blocks): each program owns a [BM, BB] tile of OUTPUT bytes,
so no two programs write the same byte (no atomics, the same bytes on every run). The
coordinates that overlap byte B are a contiguous run of the coded (b_i > 0) coordinates,
starting at ``first[B]``, at most 8 long (each covers >= 1 of the byte's 8 bits): the
kernel visits maxc = the longest run of this layout, computes each one's code and ORs
its bits at their place in the byte. A code straddling two bytes is searched by both
(at most 2x the searches of a scratch-buffer design, which would write and re-read
[N, k] codes instead).
  code search: the count of boundaries below z_i, by a branchless binary search of TOP =
  max(b) steps over the coordinate's padded row of ``bounds`` (+inf padding is never
  below a value, so it counts what torch.searchsorted(side="left") counts); NaN gets the
  top code 2^b_i - 1, as the reference's searchsorted-then-clamp gives it. Comparisons
  only: the codes, and so the wire, are the reference's bit for bit.
unpack, grid (row blocks, coordinate blocks): coordinate i's code lies in bytes o_i // 8
and o_i // 8 + 1 (b_i <= 8, so at most 15 bits from the byte start): two byte loads, a
shift, a mask, and z_hat_i = levels[i, code] (0 for b_i = 0). Exact (a gather).
"""
from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from meshkern.triton_kernels._target import gpu_shapes

# Both run on the trainer's critical path (every boundary, both directions): the compile
# check fails if they spill registers.
HOT_KERNELS = ("_nf_pack_kernel", "_nf_unpack_kernel")


@triton.jit
def _nf_pack_kernel(z_ptr, bd_ptr, nzi_ptr, off_ptr, wid_ptr, first_ptr, out_ptr, N, k, S, nbytes, nnz, maxc,
                    TOP: tl.constexpr, BM: tl.constexpr, BB: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    byte = tl.program_id(1) * BB + tl.arange(0, BB)
    rmask = rows < N
    bmask = byte < nbytes
    first = tl.load(first_ptr + byte, mask=bmask, other=0)
    acc = tl.zeros([BM, BB], dtype=tl.int32)
    for j in range(maxc):  # a loop: unrolled (static_range) it took 168-210 registers and spilled on sm_90
        t = first + j
        tmask = bmask & (t < nnz)
        i = tl.load(nzi_ptr + t, mask=tmask, other=0)
        o = tl.load(off_ptr + t, mask=tmask, other=0)
        w = tl.load(wid_ptr + t, mask=tmask, other=1)
        d = o - 8 * byte  # where the code starts relative to the byte's bit 0: -7..7
        hit = tmask & (d < 8)  # t >= first[B] already ends past the byte's start
        m2 = rmask[:, None] & hit[None, :]
        z = tl.load(z_ptr + rows[:, None] * k + i[None, :], mask=m2, other=0.0)
        pos = tl.zeros([BM, BB], dtype=tl.int32)
        base = bd_ptr + i.to(tl.int64)[None, :] * S
        for s in tl.static_range(TOP - 1, -1, -1):  # step 2^s: probe pos + 2^s - 1 <= 2^TOP - 2 < S
            b = tl.load(base + pos + ((1 << s) - 1), mask=m2, other=float("inf"))
            pos = tl.where(b < z, pos + (1 << s), pos)
        code = tl.where(z != z, (1 << w[None, :]) - 1, pos)  # NaN: the top code
        piece = tl.where(d[None, :] >= 0, code << tl.maximum(d, 0)[None, :], code >> tl.maximum(-d, 0)[None, :])
        acc = acc | tl.where(m2, piece & 0xFF, 0)
    tl.store(out_ptr + rows[:, None] * nbytes + byte[None, :], acc.to(tl.uint8),
             mask=rmask[:, None] & bmask[None, :])


@triton.jit
def _nf_unpack_kernel(p_ptr, lv_ptr, wid_ptr, off_ptr, out_ptr, N, k, S, nbytes,
                      BM: tl.constexpr, BK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BK + tl.arange(0, BK)
    rmask = rows < N
    cmask = cols < k
    w = tl.load(wid_ptr + cols, mask=cmask, other=0)
    o = tl.load(off_ptr + cols, mask=cmask, other=0)
    coded = cmask & (w > 0)
    m2 = rmask[:, None] & coded[None, :]
    src = p_ptr + rows[:, None] * nbytes + (o >> 3)[None, :]
    lo = tl.load(src, mask=m2, other=0).to(tl.int32)
    hi = tl.load(src + 1, mask=m2 & ((o >> 3) + 1 < nbytes)[None, :], other=0).to(tl.int32)
    code = ((lo | (hi << 8)) >> (o & 7)[None, :]) & ((1 << w) - 1)[None, :]
    z = tl.load(lv_ptr + cols.to(tl.int64)[None, :] * S + code, mask=m2, other=0.0)
    tl.store(out_ptr + rows[:, None] * k + cols[None, :], z, mask=rmask[:, None] & cmask[None, :])


# GPU launch shapes, from the ahead-of-time compile report (python -m bench.compile_check
# --triton --only pca_nf; not yet timed on a GPU): 0 spills on sm_80/86/89/90 at H = 576,
# 2048, 4096 for calibrated layouts at 1/15 and 1/30 and the unrolling limits (one-bit
# codes, widths up to 8): pack 40-48 registers, unpack 62-74. Pack at 32 x 32 with 4 warps
# spilled 16 B on sm_90 (1/30 at H = 576), 16 x 64 too; 8 warps (8 bytes per thread) do not.
# The interpreter (CPU tests) takes 8x bigger blocks: its cost is per program instance.
PACK_BLOCKS = (32, 32, 8)  # BM, BB, num_warps
UNPACK_BLOCKS = (32, 64, 4)  # BM, BK, num_warps


def _blocks(blocks, device):
    return blocks if gpu_shapes(device) else tuple(min(8 * b, 256) for b in blocks[:-1]) + (blocks[-1],)


@lru_cache(maxsize=64)
def _layout_cached(bits: tuple, nbytes: int, device: str):
    """Host tables of a width vector (module doc): for every coordinate its bit offset;
    for the coded ones (b > 0) their index, offset and width; per byte the first coded
    coordinate that ends past the byte's start; the longest run of coded coordinates that
    overlap one byte (maxc)."""
    b = torch.tensor(bits, dtype=torch.int64)
    off = torch.cumsum(b, 0) - b
    nz = torch.nonzero(b > 0).flatten()
    o_nz, w_nz = off[nz], b[nz]
    starts = 8 * torch.arange(int(nbytes), dtype=torch.int64)
    # first coded t with o_t + w_t > 8B (ends are increasing: every coded width is >= 1)
    first = torch.searchsorted(o_nz + w_nz, starts, right=True)
    # coded coordinates overlapping byte B: those with t >= first[B] and o_t < 8B + 8
    last = torch.searchsorted(o_nz, starts + 8, right=False)
    maxc = max(1, int((last - first).max())) if nbytes else 1
    i32 = dict(dtype=torch.int32, device=device)
    return (off.to(**i32), nz.to(**i32), o_nz.to(**i32), w_nz.to(**i32), first.to(**i32), b.to(**i32),
            int(nz.numel()), maxc)


def _layout(bits: torch.Tensor, nbytes: int, device):
    return _layout_cached(tuple(int(v) for v in bits.tolist()), int(nbytes), str(device))


def _check(op: str, table: torch.Tensor, bits: torch.Tensor, k: int, extra: int) -> int:
    """The same contract as the cpp kernels: the error names what is wrong."""
    if bits.dim() != 1 or bits.numel() != k:
        raise ValueError(f"{op}: bits must be [k] = [{k}], got {tuple(bits.shape)}")
    if table.dim() != 2 or table.shape[0] != k or table.dtype != torch.float32:
        raise ValueError(f"{op}: the code book table must be fp32 [k, 2^max_bits{' - 1' if extra else ''}], "
                         f"got {table.dtype} {tuple(table.shape)}")
    top = int(bits.max()) if k else 0
    if k and (int(bits.min()) < 0 or top > 8 or (1 << top) - extra > table.shape[1]):
        raise ValueError(f"{op}: code widths must lie in 0..8 and fit the table's {table.shape[1]} columns")
    return max(top, 1)


def pack(z: torch.Tensor, bounds: torch.Tensor, bits: torch.Tensor, nbytes: int) -> torch.Tensor:
    """[N, nbytes] uint8 bit stream of the codes of z [N, k] fp32 (module doc; the
    reference's ``pack_codes(searchsorted(...))`` bit for bit)."""
    N, k = z.shape
    top = _check("pca_nf pack", bounds, bits, k, 1)
    if int(bits.sum()) > 8 * int(nbytes):
        raise ValueError(f"pca_nf pack: {int(bits.sum())} bits do not fit {nbytes} bytes")
    z, bounds = z.contiguous(), bounds.contiguous()
    out = torch.empty(N, int(nbytes), dtype=torch.uint8, device=z.device)
    if N and nbytes:
        _, nzi, o_nz, w_nz, first, _, nnz, maxc = _layout(bits, nbytes, z.device)
        BM, BB, warps = _blocks(PACK_BLOCKS, z.device)
        _nf_pack_kernel[(triton.cdiv(N, BM), triton.cdiv(int(nbytes), BB))](
            z, bounds, nzi, o_nz, w_nz, first, out, N, k, bounds.shape[1], int(nbytes), nnz, maxc,
            TOP=top, BM=BM, BB=BB, num_warps=warps)
    return out


def unpack(packed: torch.Tensor, levels: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """z_hat [N, k] fp32 = levels[i, code_i] of the stream ``packed`` [N, nbytes] uint8."""
    N, nbytes = packed.shape
    k = bits.numel()
    _check("pca_nf unpack", levels, bits, k, 0)
    if int(bits.sum()) > 8 * nbytes:
        raise ValueError(f"pca_nf unpack: {int(bits.sum())} bits need more than {nbytes} bytes")
    packed, levels = packed.contiguous(), levels.contiguous()
    out = torch.empty(N, k, dtype=torch.float32, device=packed.device)
    if N and k:
        off, _, _, _, _, wid, _, _ = _layout(bits, nbytes, packed.device)
        BM, BK, warps = _blocks(UNPACK_BLOCKS, packed.device)
        _nf_unpack_kernel[(triton.cdiv(N, BM), triton.cdiv(k, BK))](
            packed, levels, wid, off, out, N, k, levels.shape[1], nbytes, BM=BM, BK=BK, num_warps=warps)
    return out
