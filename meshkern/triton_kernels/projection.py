"""Fused two-sided Tikhonov projection in Triton.

    out = alpha * G + (1 - alpha) * U diag(d) (U^T G V) diag(d) V^T,   d = s / (s + tau)

Two launches, each streaming G once:
  1. _x_kernel, grid (B, n-blocks): acc[r, BN] = sum over m-blocks of U^T G, then the
     block's partial X = acc @ V[BN, r] -> Xpart[B, n-blocks, R, R]. Partials are summed
     on the host (fixed order, deterministic; no atomics).
  2. host: Xf = (1 - alpha) diag(d) X diag(d)  (r x r, negligible)
  3. _out_kernel, grid (B, m-blocks, n-blocks): out = alpha * G + (U_blk @ Xf) @ V_blk^T,
     the mix fused in the epilogue; nothing m x n is materialised besides out.
fp32 accumulation (inputs widened on load, so bf16/fp16 G is read once at 2 bytes/elem),
dots with input_precision="ieee". r is padded to R = max(16, next power of two) <= MAX_R.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from meshkern.triton_kernels._target import gpu_shapes

# On a trainer's critical path: bench/compile_check.py fails if these spill registers.
HOT_KERNELS = ("_x_kernel", "_out_kernel")
# Largest padded rank R the kernels hold: U, V tiles [BLOCK, R] and X [R, R] live in
# registers, and at R = 128 every block shape tried spilled 2-50 kB per thread.
MAX_R = 64


def _blocks(R: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps). GPU, chosen from the ahead-of-time compile report
    (python -m bench.compile_check --triton --only projection; not yet timed on a GPU):
    32x32 tiles with 4 warps at R <= 32 and 8 warps at R = 64 compile with 0 spills on
    sm_80/86/89/90 (fp32 and bf16 G). The former 64x64 tiles with 4 warps spilled from
    R = 32 (12-35 kB per thread in _out_kernel). The interpreter (CPU tests) keeps 64x64:
    its cost is per program instance and it has no registers to spill."""
    if not gpu_shapes(device):
        return 64, 64, 4
    return 32, 32, 4 if R <= 32 else 8


@triton.jit
def _x_kernel(G_ptr, U_ptr, V_ptr, X_ptr, m, n, r, NB_N, BM: tl.constexpr, BN: tl.constexpr, R: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    pn = tl.program_id(1)
    offs_n = pn * BN + tl.arange(0, BN)
    offs_r = tl.arange(0, R)
    acc = tl.zeros([R, BN], dtype=tl.float32)
    for m0 in range(0, m, BM):
        offs_m = m0 + tl.arange(0, BM)
        u = tl.load(U_ptr + b * m * r + offs_m[:, None] * r + offs_r[None, :],
                    mask=(offs_m[:, None] < m) & (offs_r[None, :] < r), other=0.0).to(tl.float32)
        g = tl.load(G_ptr + b * m * n + offs_m[:, None] * n + offs_n[None, :],
                    mask=(offs_m[:, None] < m) & (offs_n[None, :] < n), other=0.0).to(tl.float32)
        acc += tl.dot(tl.trans(u), g, input_precision="ieee")
    v = tl.load(V_ptr + b * n * r + offs_n[:, None] * r + offs_r[None, :],
                mask=(offs_n[:, None] < n) & (offs_r[None, :] < r), other=0.0).to(tl.float32)
    x = tl.dot(acc, v, input_precision="ieee")
    tl.store(X_ptr + (b * NB_N + pn) * R * R + offs_r[:, None] * R + offs_r[None, :], x)


@triton.jit
def _out_kernel(G_ptr, U_ptr, V_ptr, Xf_ptr, O_ptr, m, n, r, alpha, BM: tl.constexpr, BN: tl.constexpr,
                R: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs_m = tl.program_id(1) * BM + tl.arange(0, BM)
    offs_n = tl.program_id(2) * BN + tl.arange(0, BN)
    offs_r = tl.arange(0, R)
    u = tl.load(U_ptr + b * m * r + offs_m[:, None] * r + offs_r[None, :],
                mask=(offs_m[:, None] < m) & (offs_r[None, :] < r), other=0.0).to(tl.float32)
    xf = tl.load(Xf_ptr + b * R * R + offs_r[:, None] * R + offs_r[None, :])
    w = tl.dot(u, xf, input_precision="ieee")                                     # [BM, R]
    v = tl.load(V_ptr + b * n * r + offs_n[:, None] * r + offs_r[None, :],
                mask=(offs_n[:, None] < n) & (offs_r[None, :] < r), other=0.0).to(tl.float32)
    acc = tl.dot(w, tl.trans(v), input_precision="ieee")                          # [BM, BN]
    inside = (offs_m[:, None] < m) & (offs_n[None, :] < n)
    g = tl.load(G_ptr + b * m * n + offs_m[:, None] * n + offs_n[None, :], mask=inside, other=0.0)
    out = alpha * g.to(tl.float32) + acc
    tl.store(O_ptr + b * m * n + offs_m[:, None] * n + offs_n[None, :], out.to(O_ptr.dtype.element_ty), mask=inside)


def spectral_project(G, U, S, V, tau: float, alpha: float, out: torch.Tensor) -> torch.Tensor:
    """Writes G_proj[B,m,n] into ``out`` and returns ||diag(d) U^T G V diag(d)||_F^2 [B]
    fp32. Shapes as in meshkern.spectral.project; ``out`` contiguous, G's shape and dtype,
    not overlapping the inputs (all checked there). In place would be safe too: the
    first launch reads all of G before the second writes, and each _out_kernel program
    loads its G tile before storing the same tile of out."""
    G, U, S, V = G.contiguous(), U.contiguous(), S.contiguous(), V.contiguous()
    B, m, n = G.shape
    r = U.shape[2]
    R = max(16, triton.next_power_of_2(r))
    if R > MAX_R:
        raise ValueError(f"the Triton projection holds rank r <= {MAX_R}, got r={r}")
    BLOCK_M, BLOCK_N, warps = _blocks(R, G.device)
    nb_m, nb_n = triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N)
    xpart = torch.empty(B, nb_n, R, R, dtype=torch.float32, device=G.device)
    _x_kernel[(B, nb_n)](G, U, V, xpart, m, n, r, nb_n, BM=BLOCK_M, BN=BLOCK_N, R=R, num_warps=warps)
    X = xpart.sum(dim=1)
    s = S.float().clamp_min(0)
    den = s + tau
    d = torch.where(den > 0, s / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(s))
    dp = torch.zeros(B, R, dtype=torch.float32, device=G.device)
    dp[:, :r] = d
    Xf = dp[:, :, None] * X * dp[:, None, :]
    filt_sq = Xf.square().sum(dim=(1, 2))
    if alpha == 1.0:
        out.copy_(G)
        return filt_sq
    Xf = (Xf * (1.0 - alpha)).contiguous()
    _out_kernel[(B, nb_m, nb_n)](G, U, V, Xf, out, m, n, r, float(alpha), BM=BLOCK_M, BN=BLOCK_N, R=R,
                                 num_warps=warps)
    return filt_sq
