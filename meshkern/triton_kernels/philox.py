"""Philox4x32-10 in Triton (the same generator as csrc/common/philox.h and the
pure-torch reference in meshkern/reference_mask.py).

``philox4x32_10`` is a @triton.jit helper for kernels (uint32 tensors in, four uint32
tensors out); ``philox4x32`` runs it on a [N, 4] int64 counter tensor for the
known-answer tests, and ``builtin_philox4x32`` runs Triton's own ``tl.philox`` so the
tests can check that both agree. We keep our own copy (10 rounds, explicit key words)
rather than calling tl.philox because its key is one 64-bit seed argument whose
specialization (int32/int64/uint64 by value) we do not want the mask to depend on.
"""
import torch
import triton
import triton.language as tl

# Random123 constants (round multipliers, Weyl key increments).
PHILOX_M0: tl.constexpr = tl.constexpr(0xD2511F53)
PHILOX_M1: tl.constexpr = tl.constexpr(0xCD9E8D57)
PHILOX_W0: tl.constexpr = tl.constexpr(0x9E3779B9)
PHILOX_W1: tl.constexpr = tl.constexpr(0xBB67AE85)


@triton.jit
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 of uint32 counter words c0..c3 under uint32 key words (k0, k1)."""
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(c0, PHILOX_M0)
        lo0 = tl.mul(c0, PHILOX_M0, sanitize_overflow=False)
        hi1 = tl.umulhi(c2, PHILOX_M1)
        lo1 = tl.mul(c2, PHILOX_M1, sanitize_overflow=False)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = tl.add(k0, PHILOX_W0, sanitize_overflow=False)
        k1 = tl.add(k1, PHILOX_W1, sanitize_overflow=False)
    return c0, c1, c2, c3


@triton.jit(do_not_specialize=["k0", "k1", "seed"])
def _philox_kernel(ctr_ptr, out_ptr, n, k0, k1, seed, BUILTIN: tl.constexpr, BLOCK: tl.constexpr):
    """Philox of [n, 4] counters: ours with key (k0, k1), or tl.philox with ``seed``."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    c0 = tl.load(ctr_ptr + 4 * i, mask=m, other=0).to(tl.uint32)
    c1 = tl.load(ctr_ptr + 4 * i + 1, mask=m, other=0).to(tl.uint32)
    c2 = tl.load(ctr_ptr + 4 * i + 2, mask=m, other=0).to(tl.uint32)
    c3 = tl.load(ctr_ptr + 4 * i + 3, mask=m, other=0).to(tl.uint32)
    if BUILTIN:
        w0, w1, w2, w3 = tl.philox(seed, c0, c1, c2, c3)
    else:
        w0, w1, w2, w3 = philox4x32_10(c0, c1, c2, c3, k0.to(tl.uint32), k1.to(tl.uint32))
    tl.store(out_ptr + 4 * i, w0.to(tl.int64), mask=m)
    tl.store(out_ptr + 4 * i + 1, w1.to(tl.int64), mask=m)
    tl.store(out_ptr + 4 * i + 2, w2.to(tl.int64), mask=m)
    tl.store(out_ptr + 4 * i + 3, w3.to(tl.int64), mask=m)


def _launch(counters: torch.Tensor, k0: int, k1: int, seed: int, builtin: bool) -> torch.Tensor:
    if counters.dim() != 2 or counters.shape[1] != 4 or counters.dtype != torch.int64:
        raise ValueError("counters must be int64 [N, 4]")
    c = counters.contiguous()
    out = torch.empty_like(c)
    n = c.shape[0]
    block = 1024
    _philox_kernel[(triton.cdiv(n, block),)](c, out, n, k0, k1, seed, BUILTIN=builtin, BLOCK=block)
    return out


def philox4x32(counters: torch.Tensor, k0: int, k1: int) -> torch.Tensor:
    """int64 [N, 4] counters -> int64 [N, 4] Philox4x32-10 output words, key (k0, k1)."""
    return _launch(counters, int(k0), int(k1), 0, builtin=False)


def builtin_philox4x32(counters: torch.Tensor, seed: int) -> torch.Tensor:
    """The same through Triton's tl.philox (key = (seed & 0xffffffff, seed >> 32))."""
    return _launch(counters, 0, 0, int(seed), builtin=True)
