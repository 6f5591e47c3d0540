"""The mask specification, as a pure-torch reference (slow, obviously right).

Every backend (C++, CUDA, Triton) must return exactly what this module returns: the
same kept dims, in the same order, and bit-identical packed values.

Specification
-------------
Inputs: a key (seed < 2**64, boundary < 2**16, step < 2**32, microbatch < 2**16), a
token row ``r`` (< 2**32), the hidden size H (< 2**31) and K = round((1 - p) * H)
with 1 <= K <= H.

1. Random words. Philox4x32-10 (Random123) with key words
   ``(k0, k1) = (seed & 0xffffffff, seed >> 32)`` and counter
   ``(c0, c1, c2, c3) = (b, r, step, (boundary << 16) | microbatch)`` gives four 32-bit
   words ``w0..w3`` for draw block ``b``. Draw ``d`` (0 <= d < K) uses block ``d // 2``:
   words ``(w0, w1)`` when d is even, ``(w2, w3)`` when d is odd, as ``(hi, lo)`` of a
   64-bit uniform ``x = hi * 2**32 + lo``.

2. Selection: Robert Floyd's sampling. For d = 0..K-1 let ``j = H - K + d`` and
   ``t = floor(x_d * (j + 1) / 2**64)``, uniform on [0, j] (multiply-shift range
   reduction: every value has probability within 2**-64 of 1/(j+1), so the bias is far
   below anything measurable). If dim t is already kept, keep dim j instead (it cannot
   be kept yet, since only dims < j have been considered), else keep t. With exactly
   uniform draws Floyd's algorithm yields every K-subset of [0, H) with equal
   probability, hence each dim is kept with probability exactly K/H, and different
   rows/steps/boundaries/micro-batches use disjoint Philox counters (independent).

3. Output: the K kept dims of row r in ascending order. Nothing depends on a launch
   parameter (block size, thread count, device): only on (key, r, H, K).

Why Floyd: it costs K Philox half-blocks per token instead of one word per dim (H), i.e.
~20x fewer random words at p = 0.95, which is what makes the CPU kernel memory-bound; a
bitmap of H bits resolves collisions, and scanning the bitmap yields ascending dims
that drive the gather/scatter directly (no index tensor is written by the fused ops).

Token rows: an input ``[..., T, H]`` is viewed as ``[N, H]`` (N = product of the leading
dims); the token position used in the counter is the row index in that flattened view.

pack / unpack with ``rescale=True`` multiply the moved values by ``H / K`` (computed in
float64, rounded once to the compute dtype: float32 for fp16/bf16/fp32, float64 for
fp64; the product is rounded once to the output dtype). H/K = 1/(1-p) whenever
(1-p)*H is an integer, and it is the factor that makes ``unpack(pack(h))`` an unbiased
estimate of h (E[mask] = K/H exactly).
"""
from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57  # round multipliers (Random123)
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments (Random123)


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of a * b for a constant a < 2**32 and int64 b in [0, 2**32).

    Split a into 16-bit halves so every product stays below 2**48 (no int64 overflow).
    """
    x = b * (a >> 16)
    y = b * (a & 0xFFFF)
    hi = (x + (y >> 16)) >> 16
    lo = (((x & 0xFFFF) << 16) + y) & MASK32
    return hi, lo


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 of counter words c0..c3 under key (k0, k1).

    Arguments are int64 tensors (broadcastable) or ints holding uint32 values; returns
    four int64 tensors holding the uint32 output words.
    """
    c = [torch.as_tensor(x, dtype=torch.int64) for x in (c0, c1, c2, c3)]
    c0, c1, c2, c3 = torch.broadcast_tensors(*c)
    k0, k1 = int(k0), int(k1)
    for _ in range(10):
        hi0, lo0 = _mulhilo(PHILOX_M0, c0)
        hi1, lo1 = _mulhilo(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + PHILOX_W0) & MASK32
        k1 = (k1 + PHILOX_W1) & MASK32
    return c0, c1, c2, c3


def draw_below(hi: torch.Tensor, lo: torch.Tensor, n) -> torch.Tensor:
    """floor((hi * 2**32 + lo) * n / 2**64) for uint32 words hi, lo and 1 <= n <= 2**31.

    Exact in int64: hi * n < 2**63 and the carry term (lo * n) >> 32 < 2**31.
    """
    return (hi * n + ((lo * n) >> 32)) >> 32


def kept_bitmap(key_words: tuple[int, int, int, int], N: int, H: int, K: int) -> torch.Tensor:
    """Bool [N, H]: row r is True at exactly the K dims the spec keeps for token row r.

    ``key_words`` = (k0, k1, step, (boundary << 16) | microbatch).
    """
    k0, k1, step, tag = key_words
    rows = torch.arange(N, dtype=torch.int64)[:, None]
    blocks = torch.arange((K + 1) // 2, dtype=torch.int64)[None, :]
    w0, w1, w2, w3 = philox4x32_10(blocks, rows, step, tag, k0, k1)
    hi = torch.stack((w0, w2), dim=2).reshape(N, 2 * blocks.shape[1])[:, :K]  # draw d -> block d//2, pair d%2
    lo = torch.stack((w1, w3), dim=2).reshape(N, 2 * blocks.shape[1])[:, :K]
    j = torch.arange(H - K, H, dtype=torch.int64)
    t = draw_below(hi, lo, j + 1)  # [N, K], t[:, d] uniform on [0, j[d]]
    kept = torch.zeros(N, H, dtype=torch.bool)
    ar = torch.arange(N)
    for d in range(K):  # Floyd: sequential over draws, vectorized over rows
        td = t[:, d]
        choice = torch.where(kept[ar, td], j[d], td)
        kept[ar, choice] = True
    return kept


def indices(key_words, N: int, H: int, K: int) -> torch.Tensor:
    """int64 [N, K]: the kept dims of each token row, ascending."""
    kept = kept_bitmap(key_words, N, H, K)
    return kept.nonzero()[:, 1].reshape(N, K).clone()  # nonzero is row-major: ascending per row


def _scaled(x: torch.Tensor, scale: float | None) -> torch.Tensor:
    if scale is None:
        return x
    opmath = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (x.to(opmath) * torch.tensor(scale, dtype=opmath)).to(x.dtype)


def pack(h: torch.Tensor, key_words, K: int, scale: float | None) -> torch.Tensor:
    """[..., H] -> [..., K]: the kept values of every row (times ``scale`` if given)."""
    H = h.shape[-1]
    flat = h.reshape(h.shape[:-1].numel(), H)
    idx = indices(key_words, flat.shape[0], H, K).to(h.device)
    return _scaled(flat.gather(1, idx), scale).reshape(*h.shape[:-1], K)


def unpack(v: torch.Tensor, key_words, H: int, scale: float | None) -> torch.Tensor:
    """[..., K] -> [..., H]: values placed at the kept dims (times ``scale``), zeros elsewhere."""
    K = v.shape[-1]
    flat = v.reshape(v.shape[:-1].numel(), K)
    idx = indices(key_words, flat.shape[0], H, K).to(v.device)
    out = torch.zeros(flat.shape[0], H, dtype=v.dtype, device=v.device)
    out.scatter_(1, idx, _scaled(flat, scale))
    return out.reshape(*v.shape[:-1], H)
