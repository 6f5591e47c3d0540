"""Triton kernels for meshkern's mask ops: indices, fused pack, fused unpack.

The mask is specified in meshkern/reference_mask.py (Philox4x32-10 counters + Floyd's
sampling); these kernels compute the same function, bit for bit.

Layout: one program handles BLOCK_T token rows. Philox runs CHUNK blocks (2 * CHUNK
draws) at a time as one [BLOCK_T, CHUNK] tensor op; Floyd's selection, sequential in
the draws but independent across rows, then loops over those draws vectorized across
the program's rows, on a per-row bitmap of NW 32-bit words held in registers
([BLOCK_T, NW]; a word is read/updated with a one-hot compare along NW, since Triton
has no dynamic register indexing). The bitmap is then
expanded to [BLOCK_T, HP] bits; an inclusive cumsum gives every kept dim its output
slot, which drives the gather (pack), the scatter (unpack) or the index store
(indices) directly: no index tensor is written by pack/unpack.

Block sizes do not change results (the mask depends only on key, row, H, K).
GPU: BLOCK_T * HP ~ 2048 elements per program over 4 warps keeps the [BLOCK_T, HP]
tiles in registers without spilling (GPU_TILE below). Interpreter (TRITON_INTERPRET=1, tests): cost is per program and per op,
so BLOCK_T * HP ~ 2**17 (a few programs for test shapes).
"""
import torch
import triton
import triton.language as tl

from meshkern.triton_kernels._target import gpu_shapes
from meshkern.triton_kernels.philox import philox4x32_10

# On a trainer's critical path: bench/compile_check.py fails if these spill registers.
HOT_KERNELS = ("_move_kernel",)


@triton.jit
def _draw_below(hi, lo, n):
    """floor((hi * 2**32 + lo) * n / 2**64) for uint32 hi, lo, n (32-bit mulhi form)."""
    a_hi = tl.umulhi(hi, n)
    a_lo = tl.mul(hi, n, sanitize_overflow=False)
    s = tl.add(a_lo, tl.umulhi(lo, n), sanitize_overflow=False)
    return a_hi + (s < a_lo).to(tl.uint32)  # carry out of the low word


@triton.jit
def _rescaled(x, scale_ptr, OUT: tl.constexpr):
    """x * scale computed in float32 (float64 for fp64 data), rounded once to OUT.

    float32 -> bfloat16 is rounded to nearest-even with integer ops, as c10 does: the
    interpreter's own cast truncates, which would break bit-identity with the other
    backends (GPUs round to nearest-even either way).
    """
    s = tl.load(scale_ptr)
    y = x.to(s.dtype) * s
    if OUT == tl.bfloat16:
        b = y.to(tl.uint32, bitcast=True)
        b = tl.add(b, 0x7FFF + ((b >> 16) & 1), sanitize_overflow=False)
        b = tl.where(y != y, 0x7FC00000, b)  # NaN stays a (quiet) NaN
        return (b >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return y.to(OUT)


@triton.jit
def _kept_bits(rows, k0, k1, step, tag, H, K, BLOCK_T: tl.constexpr, NW: tl.constexpr,
               CHUNK: tl.constexpr):
    """[BLOCK_T, NW * 32] int32 0/1: the dims kept for each row (Floyd's sampling).

    Philox runs CHUNK blocks (2 * CHUNK draws) at a time, vectorized over
    [BLOCK_T, CHUNK]; the sequential Floyd steps then read their candidates from it.
    """
    cols = tl.arange(0, NW)
    cidx = tl.arange(0, CHUNK)
    bits = tl.zeros([BLOCK_T, NW], dtype=tl.int32)
    zero = tl.zeros([BLOCK_T, CHUNK], dtype=tl.uint32)
    r = zero + rows.to(tl.uint32)[:, None]
    c2 = zero + step.to(tl.uint32)
    c3 = zero + tag.to(tl.uint32)
    k0 = k0.to(tl.uint32)
    k1 = k1.to(tl.uint32)
    for b0 in range(0, (K + 1) // 2, CHUNK):
        blk = b0 + cidx  # [CHUNK] Philox block numbers of this chunk
        w0, w1, w2, w3 = philox4x32_10(zero + blk.to(tl.uint32)[None, :], r, c2, c3, k0, k1)
        j = H - K + 2 * blk  # Floyd's j of the even draw of each block
        t_even = _draw_below(w0, w1, zero + (j + 1).to(tl.uint32)[None, :]).to(tl.int32)
        t_odd = _draw_below(w2, w3, zero + (j + 2).to(tl.uint32)[None, :]).to(tl.int32)
        # Floyd's steps, written inline: in the interpreter every nested @jit call
        # costs ~3 ms of patching, which dominated this loop.
        for i in range(0, CHUNK):
            for half in tl.static_range(2):  # draw d = 2 * (b0 + i) + half
                d = 2 * (b0 + i) + half
                if d < K:
                    # candidate t of draw d: column i of t_even / t_odd (one-hot reduce:
                    # Triton has no dynamic register indexing)
                    src = t_even if half == 0 else t_odd
                    t = tl.sum(tl.where(cidx[None, :] == i, src, 0), axis=1)
                    # keep t, or j = H - K + d if t is already kept
                    word = tl.sum(tl.where(cols[None, :] == (t >> 5)[:, None], bits, 0), axis=1)
                    c = tl.where(((word >> (t & 31)) & 1) != 0, H - K + d, t)
                    bits = bits | tl.where(cols[None, :] == (c >> 5)[:, None], (1 << (c & 31))[:, None], 0)
    e = (bits[:, :, None] >> tl.arange(0, 32)[None, None, :]) & 1
    return tl.reshape(e, [BLOCK_T, NW * 32])


@triton.jit(do_not_specialize=["k0", "k1", "step", "tag"])
def _indices_kernel(out_ptr, N, H, K, k0, k1, step, tag, BLOCK_T: tl.constexpr, NW: tl.constexpr, CHUNK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    kept = _kept_bits(rows, k0, k1, step, tag, H, K, BLOCK_T, NW, CHUNK)
    slot = tl.cumsum(kept, axis=1) - 1
    d = tl.arange(0, NW * 32)
    m = (kept != 0) & (rows < N)[:, None]
    tl.store(out_ptr + rows[:, None] * K + slot, (d[None, :] + tl.zeros_like(slot)).to(tl.int64), mask=m)


@triton.jit(do_not_specialize=["k0", "k1", "step", "tag"])
def _move_kernel(src_ptr, out_ptr, scale_ptr, N, H, K, k0, k1, step, tag, PACK: tl.constexpr,
                 RESCALE: tl.constexpr, BLOCK_T: tl.constexpr, NW: tl.constexpr, CHUNK: tl.constexpr):
    """PACK: gather h [N, H] -> out [N, K]; else scatter v [N, K] -> out [N, H], zeros elsewhere."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    kept = _kept_bits(rows, k0, k1, step, tag, H, K, BLOCK_T, NW, CHUNK)
    slot = tl.cumsum(kept, axis=1) - 1
    d = tl.arange(0, NW * 32)
    row_ok = (rows < N)[:, None]
    m = (kept != 0) & row_ok
    full = rows[:, None] * H + d[None, :]  # offsets in the [N, H] tensor
    packed = rows[:, None] * K + slot  # offsets in the [N, K] tensor (where kept)
    if PACK:
        x = tl.load(src_ptr + full, mask=m)
    else:
        x = tl.load(src_ptr + packed, mask=m, other=0.0)
    if RESCALE:
        x = _rescaled(x, scale_ptr, out_ptr.dtype.element_ty)
    if PACK:
        tl.store(out_ptr + packed, x, mask=m)
    else:
        tl.store(out_ptr + full, x, mask=(d < H)[None, :] & row_ok)


# Philox blocks per vectorized chunk (32 draws): amortizes the per-op cost of Floyd's
# sequential loop in the interpreter (~3x fewer ops than one block per step).
CHUNK = 16


# GPU launch shape, chosen from the ahead-of-time compile report (python -m
# bench.compile_check --triton --only mask; no GPU timing yet: bench/gpu_check.sh): a
# [BLOCK_T, HP] tile of ~2048 elements over 4 warps compiles with 0 spills on sm_80/86/
# 89/90 at H = 576, 2048, 4096 (<= 64 registers at H <= 2048, ~110 at H = 4096 where one
# row is the tile). The former shape, 4096 elements in one warp, hit the 255-register cap
# and spilled 100-1,900 bytes per thread on every arch.
GPU_TILE = 2048
GPU_WARPS = 4


def _grid(N: int, H: int, device: torch.device):
    """(grid, BLOCK_T, NW, num_warps): BLOCK_T rows of HP = next_pow2(H) dims per program,
    BLOCK_T * HP ~ GPU_TILE on a GPU (see above), ~2**17 in the interpreter (its cost is
    per program instance)."""
    hp = max(32, triton.next_power_of_2(H))
    budget = GPU_TILE if gpu_shapes(device) else 2**17
    block_t = max(1, min(triton.next_power_of_2(max(N, 1)), budget // hp))
    return (triton.cdiv(N, block_t),), block_t, hp // 32, GPU_WARPS


def _scale_tensor(dtype: torch.dtype, scale: float | None, device) -> torch.Tensor:
    opmath = torch.float64 if dtype == torch.float64 else torch.float32
    return torch.tensor(1.0 if scale is None else scale, dtype=opmath, device=device)


def indices(out: torch.Tensor, words, H: int) -> None:
    """Fill int64 [N, K] ``out`` with each row's kept dims (ascending)."""
    N, K = out.shape
    if N == 0:
        return
    grid, block_t, nw, warps = _grid(N, H, out.device)
    _indices_kernel[grid](out, N, H, K, *words, BLOCK_T=block_t, NW=nw, CHUNK=CHUNK, num_warps=warps)


def _move(src: torch.Tensor, out: torch.Tensor, words, H: int, K: int, scale: float | None, pack: bool):
    N = src.shape[:-1].numel()
    if N:
        grid, block_t, nw, warps = _grid(N, H, src.device)
        _move_kernel[grid](src, out, _scale_tensor(src.dtype, scale, src.device), N, H, K, *words, PACK=pack,
                           RESCALE=scale is not None, BLOCK_T=block_t, NW=nw, CHUNK=CHUNK, num_warps=warps)
    return out


def pack(h: torch.Tensor, words, K: int, scale: float | None) -> torch.Tensor:
    """Contiguous [..., H] -> [..., K] kept values (times ``scale`` if given)."""
    out = torch.empty(*h.shape[:-1], K, dtype=h.dtype, device=h.device)
    return _move(h, out, words, h.shape[-1], K, scale, pack=True)


def unpack(v: torch.Tensor, words, H: int, scale: float | None) -> torch.Tensor:
    """Contiguous [..., K] -> [..., H]: values at the kept dims (times ``scale``), zeros elsewhere."""
    out = torch.empty(*v.shape[:-1], H, dtype=v.dtype, device=v.device)
    return _move(v, out, words, H, v.shape[-1], scale, pack=False)
