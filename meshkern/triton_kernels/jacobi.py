"""Batched small symmetric eigen-solver in Triton: parallel (round-robin) Jacobi.

One program per matrix holds the whole [K, K] problem (K = next power of two >= max(k,
16), zero padding: a padded index has no coupling, so it is never rotated with a real
one and its eigenvalue is 0). Each round applies K/2 disjoint rotations at once as an
orthogonal matrix J (tournament pairing, "circle method": every pair meets once per
sweep of K-1 rounds), so a round is two tl.dot: A <- J^T A J, W <- W J. Computation in
fp32 (fp64 for fp64 input), dots with input_precision="ieee" (TF32 would cap accuracy
at ~1e-3). Fixed sweep count, no data-dependent exit: deterministic cost and results.
Eigenpairs come back unsorted; meshkern.spectral.sym_eig sorts them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from meshkern.triton_kernels import _target


@triton.jit
def _jacobi_kernel(A_ptr, w_ptr, W_ptr, k, SWEEPS: tl.constexpr, K: tl.constexpr, F64: tl.constexpr):
    b = tl.program_id(0)
    idx = tl.arange(0, K)
    rows = idx[:, None]
    cols = idx[None, :]
    inside = (rows < k) & (cols < k)
    base = b.to(tl.int64) * k * k
    a = tl.load(A_ptr + base + rows * k + cols, mask=inside, other=0.0)
    a = a.to(tl.float64) if F64 else a.to(tl.float32)
    a = 0.5 * (a + tl.trans(a))
    zero = a * 0.0
    eye = tl.where(rows == cols, zero + 1.0, zero)
    v = eye
    n1: tl.constexpr = K - 1
    for _sweep in range(SWEEPS):
        for rnd in range(n1):
            # partner of i in this round: players 0..K-2 on a circle, K-1 in the centre
            partner = (2 * rnd - idx + n1) % n1
            partner = tl.where(partner == idx, n1, partner)
            partner = tl.where(idx == n1, rnd, partner)
            is_partner = cols == partner[:, None]
            diag = tl.sum(tl.where(rows == cols, a, zero), axis=1)
            apq = tl.sum(tl.where(is_partner, a, zero), axis=1)              # a[i, partner(i)]
            dpart = tl.sum(tl.where(is_partner, diag[None, :] + zero, zero), axis=1)  # a[partner, partner]
            lower = idx < partner
            app = tl.where(lower, diag, dpart)
            aqq = tl.where(lower, dpart, diag)
            # rotate only where |a_pq| > 1e-12 (|a_pp| + |a_qq|): below that the rotation is
            # below rounding anyway, and the bound keeps theta finite (no overflow)
            nz = tl.abs(apq) > 1e-12 * (tl.abs(app) + tl.abs(aqq))
            # Golub & Van Loan sym.schur2; both members of a pair compute the same (c, s).
            theta = tl.where(nz, (aqq - app) / (2.0 * tl.where(nz, apq, apq * 0.0 + 1.0)), apq * 0.0)
            at = tl.abs(theta)
            # t = 1 / (|theta| + sqrt(1 + theta^2)), written without overflow for large |theta|
            # (-> 0: no rotation) in either branch of the where
            inv = 1.0 / tl.maximum(at, 1.0)
            small = tl.minimum(at, 1.0)
            t = tl.where(at >= 1.0, inv / (1.0 + tl.sqrt(1.0 + inv * inv)), 1.0 / (small + tl.sqrt(1.0 + small * small)))
            t = tl.where(theta < 0.0, -t, t)
            t = tl.where(nz, t, apq * 0.0)
            c = 1.0 / tl.sqrt(1.0 + t * t)
            s = t * c
            J = tl.where(rows == cols, c[:, None] + zero, zero)
            J = tl.where(is_partner & (rows < cols), s[:, None] + zero, J)
            J = tl.where(is_partner & (rows > cols), -s[:, None] + zero, J)
            a = tl.dot(tl.trans(J), tl.dot(a, J, input_precision="ieee"), input_precision="ieee")
            a = 0.5 * (a + tl.trans(a))  # keep exact symmetry so pair members agree on (c, s)
            v = tl.dot(v, J, input_precision="ieee")
    w = tl.sum(tl.where(rows == cols, a, zero), axis=1)
    tl.store(w_ptr + b.to(tl.int64) * k + idx, w.to(w_ptr.dtype.element_ty), mask=idx < k)
    tl.store(W_ptr + base + rows * k + cols, v.to(W_ptr.dtype.element_ty), mask=inside)


def shared_bytes(K: int, itemsize: int) -> int:
    """Shared memory one program asks for at padded size K: the two [K, K] operands of a
    round's tl.dot are staged there (2 K^2 elements; what the ahead-of-time compile
    reports on sm_80/86/89/90, e.g. 128 KiB at K = 128 in fp32, 256 KiB in fp64)."""
    return 2 * K * K * itemsize


def shared_estimate(kernel: str, kwargs: dict) -> int | None:
    """The launcher's estimate for a captured launch (bench/compile_check.py checks that the
    compiled kernel stays within it)."""
    return shared_bytes(kwargs["K"], 8 if kwargs["F64"] else 4)


def max_k(device: torch.device, dtype: torch.dtype) -> int:
    """Largest k this kernel runs on ``device``: 128, or less where the GPU's shared memory
    per block cannot hold 2 K^2 elements (sm_86 / sm_89, 99 KiB: k <= 64 in fp32 and fp64)."""
    limit = _target.shared_memory_limit(device)
    K = 128
    while limit is not None and K > 16 and shared_bytes(K, dtype.itemsize) > limit:
        K //= 2
    return K


def sym_eig_jacobi(A: torch.Tensor, sweeps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w[B,k], W[B,k,k]) unsorted, A = W diag(w) W^T, for A[B,k,k] fp32/fp64, k <= max_k
    (128 where the GPU's shared memory allows; ValueError beyond)."""
    if A.dim() != 3 or A.shape[1] != A.shape[2]:
        raise ValueError(f"A must be [B, k, k], got shape {tuple(A.shape)}")
    B, k, _ = A.shape
    limit = max_k(A.device, A.dtype)
    if k > limit:
        raise ValueError(f"the Triton Jacobi kernel holds k x k in one program: k <= {limit} on this device "
                         f"({A.dtype}; {shared_bytes(triton.next_power_of_2(k), A.dtype.itemsize)} B of shared "
                         f"memory at k={k}, the GPU allows {_target.shared_memory_limit(A.device)} B per block)"
                         if limit < 128 else f"the Triton Jacobi kernel holds k x k in one program: k <= 128, got {k}")
    A = A.contiguous()
    K = max(16, triton.next_power_of_2(k))  # tl.dot needs >= 16
    w = torch.empty(B, k, dtype=A.dtype, device=A.device)
    W = torch.empty(B, k, k, dtype=A.dtype, device=A.device)
    if B:
        _jacobi_kernel[(B,)](A, w, W, k, SWEEPS=sweeps, K=K, F64=A.dtype == torch.float64,
                             num_warps=8 if K >= 64 else 4)
    return w, W
