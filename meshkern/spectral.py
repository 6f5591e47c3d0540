"""Spectral-correction ops: batched truncated SVD and the two-sided Tikhonov projection.

The anchor prior (arXiv 2609.14339, sections 2-3) filters every fast-circuit gradient
G of a weight matrix through the dominant singular subspace of the delayed anchor
momentum M_anc = U S V^T:

    d = s / (s + tau)                                  (gains, always in [0, 1])
    G_proj = alpha * G + (1 - alpha) * U diag(d) (U^T G V) diag(d) V^T

Public ops (torch.library custom ops in the ``meshkern`` namespace, each with a
``backend`` argument: "auto" (or None) | "cpp" | "cuda" | "triton" | "reference"; the
MESHKERN_BACKEND environment variable sets the default, see meshkern._backend):

    sym_eig(A[B,k,k])                       -> (w[B,k] descending, W[B,k,k])   Jacobi
    randomized_svd(M[B,m,n], rank, ...)     -> (U[B,m,r], S[B,r], V[B,n,r])
    project(G[B,m,n], U, S, V, tau, alpha)  -> G_proj[B,m,n]   (differentiable in G)
    project(..., out=buf)                   writes G_proj into buf (not differentiable)

Truncated SVD, method="krylov" (the default): block Lanczos on M^T M with full
reorthogonalization, a seeded Gaussian start block V_1[n, b] (the result is a
deterministic function of the inputs and ``seed``), ``steps`` blocks; both products of
a step (Y = M V_j, Z = M^T Y) come from one pass over M in meshkern_C::gram_products on
CPU (csrc/spectral/krylov.cpp; two torch GEMMs elsewhere); the Ritz values are the
singular values of Y = M [V_1 .. V_k], from the eigen-decomposition of its fp64 Gram
matrix. Per column of products it needs about half of what power iteration needs for
the same top-r error (docs/benchmarks.md, "Spectral").
method="randomized" (Halko, Martinsson, Tropp 2011, algorithms 4.4 + 5.1): a Gaussian
test matrix Omega[n, r+o], Y = M Omega, ``power_iters`` rounds of re-orthonormalized
power iteration, then B = Q^T M [r+o, n], C = B B^T solved by the batched
symmetric-eigen op, s = sqrt(w), U = Q W, V = B^T W / s.
The small eigen problems go to the kernel ``backend`` names; "auto" takes LAPACK's eigh
on CPU (5-10x faster there than the Jacobi kernel) and the Jacobi kernels on GPUs.

Accuracy knobs (their measured effect: docs/benchmarks.md, "Spectral"):
    block, steps  krylov: b columns per block (default ceil(rank / 2)) and k blocks
                 (default 7): k products with M and k - 1 with M^T of b columns each
    oversample   randomized: extra columns o; error falls with o, cost grows ~ (r+o)
    power_iters  randomized: q; the error of the top-r values shrinks like
                 (s_{r+o}/s_r)^(2q+1)
    ortho        "qr" (Householder, always stable) or "cholqr2" (Cholesky-QR twice:
                 GEMM-only, falls back to QR for a batch entry whose Gram matrix is
                 not numerically positive definite)
    method       "krylov", "randomized" or "exact" (torch.linalg.svd, then truncation)
Both defaults (krylov b = 16, k = 7 at rank 32; randomized o = 16, q = 3) meet a 1%
relative-error target on the top-32 singular values of s_i = 1/(1+i) and exp(-i/50);
krylov's error is the lower of the two on every spectrum and shape bench/spectral_bench.py
measures, at 0.5-0.7x of randomized's time there.
"""
from __future__ import annotations

import math
import os

import torch
from torch import Tensor

from meshkern import _backend
from meshkern.linalg import cholesky_qr2
from meshkern._checks import as_float as _as_float, as_int as _as_int, backend_arg as _backend_arg
from meshkern._checks import float_tensor

GROUP = "spectral"

# Jacobi sweeps when the caller gives none. Cyclic Jacobi converges quadratically; with
# k <= 64 in fp32 the off-diagonal mass is below 1e-7 * ||A|| after 6-8 sweeps in our
# measurements (tests/test_spectral.py checks the residual), 10 leaves margin.
DEFAULT_SWEEPS = 10
# Triton and CUDA Jacobi kernels hold the whole [k, k] problem in one program / block.
MAX_JACOBI_K = 128


# --------------------------------------------------------------------------- checks
def _check_project_args(G, U, S, V, tau, alpha) -> tuple[float, float]:
    """Validates the shapes/dtypes/devices; returns (tau, alpha) as Python floats."""
    for name, t in (("G", G), ("U", U), ("S", S), ("V", V)):
        float_tensor(name, t)
    if G.dim() != 3:
        raise ValueError(f"G must be [B, m, n], got shape {tuple(G.shape)}")
    B, m, n = G.shape
    if U.dim() != 3 or U.shape[0] != B or U.shape[1] != m:
        raise ValueError(f"U must be [B={B}, m={m}, r], got shape {tuple(U.shape)}")
    r = U.shape[2]
    if tuple(S.shape) != (B, r):
        raise ValueError(f"S must be [B={B}, r={r}], got shape {tuple(S.shape)}")
    if tuple(V.shape) != (B, n, r):
        raise ValueError(f"V must be [B={B}, n={n}, r={r}], got shape {tuple(V.shape)}")
    if not (U.device == S.device == V.device == G.device):
        raise ValueError(f"G, U, S, V must be on one device, got {G.device}, {U.device}, {S.device}, {V.device}")
    tau_f, alpha_f = _check_tau(tau), _as_float(alpha)  # numpy scalars are plain numbers
    if alpha_f is None or not 0.0 <= alpha_f <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha!r}")
    return tau_f, alpha_f


# Seeds travel as one op-schema int (int64).
_SEED_RANGE = (-(2**63), 2**63)


METHODS = ("krylov", "randomized", "exact")


def _check_svd_options(rank, oversample, power_iters, seed, ortho, method) -> tuple[int, int, int, int]:
    """Validates randomized_svd's options (also used by meshkern.optim at construction);
    returns (rank, oversample, power_iters, seed) as Python ints. ValueError naming the
    argument; numpy integers count as ints, bools and floats do not."""
    out = []
    for name, val, lo in (("rank", rank, 1), ("oversample", oversample, 0), ("power_iters", power_iters, 0)):
        v = _as_int(val)
        if v is None or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {val!r}")
        out.append(v)
    sd = _as_int(seed)
    if sd is None or not _SEED_RANGE[0] <= sd < _SEED_RANGE[1]:
        raise ValueError(f"seed must be an int in [-2**63, 2**63) (one int64), got {seed!r}")
    if ortho not in ("qr", "cholqr2"):
        raise ValueError(f"ortho must be 'qr' or 'cholqr2', got {ortho!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return out[0], out[1], out[2], sd


def _check_krylov_options(block, steps) -> tuple[int, int]:
    """block, steps of method="krylov" as Python ints; None (or 0) stands for the default,
    returned as 0. ValueError naming the argument."""
    out = []
    for name, val in (("block", block), ("steps", steps)):
        v = 0 if val is None else _as_int(val)
        if v is None or v < 0:
            raise ValueError(f"{name} must be None or an int >= 1, got {val!r}")
        out.append(v)
    return out[0], out[1]


def _check_tau(tau) -> float:
    """tau as a float (numpy scalars are plain numbers); ValueError unless finite and >= 0."""
    v = _as_float(tau)
    if v is None or not (math.isfinite(v) and v >= 0):
        raise ValueError(f"tau must be a finite number >= 0, got {tau!r}")
    return v


def _check_backend(backend, devices=()) -> str:
    """Validates a ``backend=`` argument up front (meshkern.optim calls this at
    construction, so a typo fails there and not at the first SVD refresh): None or a
    name in meshkern._backend.BACKENDS / "auto" (any case). A forced backend must be
    able to run on each of ``devices``. ValueError / TypeError naming ``backend``."""
    backend = _backend_arg(backend)
    name = _backend.requested_name(backend)
    if name == "auto":
        return backend
    for dev in {torch.device(d) for d in devices}:
        why = _backend.why_unavailable(name, GROUP, dev)
        if why is not None:
            raise ValueError(f"backend={backend!r} cannot run here: {why}")
    return backend


def _all_finite(t: Tensor) -> bool:
    """True if ``t`` holds no NaN and no inf. One reduction (min and max: NaN propagates
    into both, +inf reaches the max, -inf the min) instead of torch.isfinite(t).all(),
    which materializes a bool tensor: on CPU, 1 thread, 16 x [1024, 1024] fp32, 3 ms
    against 72 ms, a quarter of a randomized SVD's time (docs/benchmarks.md)."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def _check_finite(t: Tensor, what: str) -> None:
    """ValueError if ``t`` holds NaN or inf. Reads the data: call it inside a custom op's
    implementation (it runs on real tensors there, also under torch.compile)."""
    if not _all_finite(t):
        raise ValueError(f"{what} contains non-finite values (NaN or inf)")


def gains(S: Tensor, tau: float) -> Tensor:
    """d = s / (s + tau) in fp32 (fp64 for fp64 S); 0 where s + tau == 0, so every d in [0, 1]."""
    s = S.to(torch.float64 if S.dtype == torch.float64 else torch.float32).clamp_min(0)
    den = s + tau
    return torch.where(den > 0, s / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(s))


# ------------------------------------------------------------------ references (spec)
def sym_eig_reference(A: Tensor) -> tuple[Tensor, Tensor]:
    """torch.linalg.eigh of (A + A^T) / 2, reordered to descending eigenvalues.

    The symmetric part is what the Jacobi kernels read too (eigh alone would read only
    the lower triangle); for a symmetric A it is A itself, bit for bit."""
    w, W = torch.linalg.eigh(0.5 * (A + A.mT))
    return w.flip(-1), W.flip(-1)


def project_reference(G: Tensor, U: Tensor, S: Tensor, V: Tensor, tau: float, alpha: float) -> tuple[Tensor, Tensor]:
    """The unfused formula in fp32 (fp64 for fp64 G): (G_proj in G.dtype, ||G_filt||_F^2 per batch).

    U, S and V are cast to that working dtype first (the gains too are computed in it)."""
    wd = torch.float64 if G.dtype == torch.float64 else torch.float32
    g, u, v = G.to(wd), U.to(wd), V.to(wd)
    d = gains(S.to(wd), tau)
    x = u.mT @ g @ v
    xf = d[:, :, None] * x * d[:, None, :]
    filt = u @ xf @ v.mT
    out = alpha * g + (1 - alpha) * filt
    # ||U Xf V^T||_F = ||Xf||_F for orthonormal U, V; measured on the product itself here
    # so the reference does not rely on that assumption.
    return out.to(G.dtype), filt.pow(2).sum(dim=(1, 2)).to(torch.float32)


# ------------------------------------------------------------------ backend dispatch
def _jacobi_k_limit(which: str, dtype: torch.dtype, device: torch.device) -> int:
    """Largest k the one-block / one-program kernels hold (CUDA: 2 k^2 values in 48 KiB of
    shared memory; Triton: 2 K^2 values in the GPU's shared memory per block, K the
    padded size, at most MAX_JACOBI_K)."""
    if which == "cuda":
        return 78 if dtype == torch.float32 else 55
    if which == "triton":
        from meshkern.triton_kernels import jacobi  # noqa: PLC0415 (triton is optional)

        return min(MAX_JACOBI_K, jacobi.max_k(device, dtype))
    return 1 << 62


# meshkern/triton_kernels/projection.py's MAX_R (kept here: importing it imports triton).
_TRITON_MAX_PROJECT_R = 64


def _sym_eig_backend(A: Tensor, sweeps: int, backend: str) -> tuple[Tensor, Tensor]:
    which = _backend.resolve(GROUP, A.device, backend)
    k = A.shape[-1]
    if k > _jacobi_k_limit(which, A.dtype, A.device):
        if backend != "auto":
            raise ValueError(f"the {which} Jacobi kernel holds k <= {_jacobi_k_limit(which, A.dtype, A.device)} "
                             f"({A.dtype}), got k={k}; use backend='reference' (torch.linalg.eigh)")
        which = "reference"  # auto: torch.linalg.eigh (cuSOLVER / LAPACK) for big problems
    if which == "reference":
        return sym_eig_reference(A)
    if which in ("cpp", "cuda"):
        _backend.extension(GROUP)
        w, W = torch.ops.meshkern_C.sym_eig_jacobi(A, sweeps)
    else:
        from meshkern.triton_kernels import jacobi

        w, W = jacobi.sym_eig_jacobi(A, sweeps)
    # Kernels return the eigenpairs in rotation order; sort here so every backend agrees.
    w, order = torch.sort(w, dim=-1, descending=True)
    return w, torch.gather(W, 2, order[:, None, :].expand_as(W))


def _project_backend(G, U, S, V, tau, alpha, out, backend) -> Tensor:
    """Writes G_proj into ``out`` (contiguous, G's shape/dtype/device, not overlapping the
    inputs) and returns ||G_filt||_F^2 [B] fp32. The one path both public ops take."""
    which = _backend.resolve(GROUP, G.device, backend)
    if which == "triton" and U.shape[2] > _TRITON_MAX_PROJECT_R:
        if backend != "auto":
            raise ValueError(f"the triton projection kernel holds rank r <= {_TRITON_MAX_PROJECT_R}, got "
                             f"r={U.shape[2]}; use backend='reference'")
        which = "reference"  # auto: torch matmuls (cuBLAS) for large ranks
    if which == "reference":
        ref, filt_sq = project_reference(G, U, S, V, tau, alpha)
        out.copy_(ref)
        return filt_sq
    if which in ("cpp", "cuda"):
        _backend.extension(GROUP)
        return torch.ops.meshkern_C.spectral_project_out(G, U, S, V, float(tau), float(alpha), out)
    from meshkern.triton_kernels import projection

    return projection.spectral_project(G, U, S, V, float(tau), float(alpha), out)


# ------------------------------------------------------- prepared projection (CPU)
def project_prepared_reference(G: Tensor, U: Tensor, Udt: Tensor, Vd: Tensor, Vt: Tensor, alpha: float,
                               out: Tensor) -> Tensor:
    """The torch chain of one matrix: Xf = Udt (G Vd); out = alpha G + (1 - alpha) U Xf Vt.

    The prior prepared once per arrival: Udt = (U diag(d))^T, Vd = V diag(d), Vt = V^T (d
    the gains). Writes ``out`` (G's shape) and returns Xf [r, r]; ||G_filt||_F^2 = ||Xf||_F^2
    for orthonormal U, V. The spec of meshkern_C::project_prepared."""
    Xf = torch.mm(Udt, torch.mm(G, Vd))
    torch.addmm(G, torch.mm(U, Xf), Vt, beta=alpha, alpha=1.0 - alpha, out=out)
    return Xf


def project_prepared(G: list[Tensor], U: list[Tensor], Udt: list[Tensor], Vd: list[Tensor], Vt: list[Tensor],
                     alpha: list[float], out: list[Tensor]) -> list[Tensor]:
    """``project_prepared_reference`` for every entry of the lists (fp32 CPU matrices,
    contiguous, ``out[e]`` not G[e]), in one call into meshkern_C::project_prepared
    (csrc/spectral/project_prepared.cpp) when the cpp backend is what "auto" resolves to,
    else entry by entry in torch. The two agree to fp32 rounding (the kernel adds alpha G
    last, in one rounding). No input checks beyond the kernel's own: the caller
    (SpectralAdamW's direct path) builds these lists itself, once per step."""
    if G and _backend.resolve(GROUP, G[0].device, "auto") == "cpp":
        _backend.extension(GROUP)
        return list(torch.ops.meshkern_C.project_prepared(G, U, Udt, Vd, Vt, [float(a) for a in alpha], out))
    return [project_prepared_reference(*args) for args in zip(G, U, Udt, Vd, Vt, alpha, out)]


# ------------------------------------------------------------------------- sym_eig
@torch.library.custom_op("meshkern::sym_eig", mutates_args=())
def _sym_eig_op(A: Tensor, sweeps: int, backend: str) -> tuple[Tensor, Tensor]:
    _check_finite(A, "A")  # here, not in sym_eig: a data check inside the op traces under torch.compile
    w, W = _sym_eig_backend(A.contiguous(), sweeps, backend)
    return w.contiguous(), W.contiguous()


@_sym_eig_op.register_fake
def _(A, sweeps, backend):
    return A.new_empty(A.shape[:2]), A.new_empty(A.shape)


def sym_eig(A: Tensor, *, sweeps: int = DEFAULT_SWEEPS, backend: str | None = "auto") -> tuple[Tensor, Tensor]:
    """Eigen-decomposition of a batch of small symmetric matrices A[B, k, k] (fp32/fp64).

    Returns (w[B, k], W[B, k, k]) in A's dtype, contiguous, with w descending and
    A_sym ~= W diag(w) W^T, W orthogonal, where A_sym = (A + A^T) / 2 is the symmetric part
    of A: every backend reads that (for a symmetric A, A_sym is A), so a non-symmetric A
    gives the same answer on all of them.

    Errors: TypeError for a non-tensor or a dtype other than fp32/fp64; ValueError for a
    shape other than [B, k, k], ``sweeps`` < 1, or an A holding NaN/inf (checked for
    every backend: never NaN or a plausible-looking (inf, I) result); ValueError for a
    forced backend's k limit (Triton k <= 128, CUDA k <= 78 fp32 / 55 fp64; "auto" then
    uses torch.linalg.eigh); RuntimeError for a forced backend that cannot run here.
    Deterministic for a given backend and input; backends agree up to the fp rounding of
    ``sweeps`` Jacobi sweeps (the reference is torch.linalg.eigh). A non-contiguous A is
    copied to a contiguous one first. ``backend``: "auto" (or None), "cpp", "cuda",
    "triton", "reference"; the MESHKERN_BACKEND environment variable sets the default.
    Traceable by torch.compile(fullgraph=True).
    """
    float_tensor("A", A, (torch.float32, torch.float64))
    if A.dim() != 3 or A.shape[1] != A.shape[2]:
        raise ValueError(f"A must be a batch of square matrices [B, k, k], got shape {tuple(A.shape)}")
    sw = _as_int(sweeps)
    if sw is None or sw < 1:
        raise ValueError(f"sweeps must be an int >= 1, got {sweeps!r}")
    return _sym_eig_op(A, sw, _check_backend(backend))


# -------------------------------------------------------------------------- project
def _check_out(out, G: Tensor, inputs: dict) -> None:
    """``out`` must be a contiguous tensor of G's shape, dtype and device that shares no
    memory with any input (a custom op's mutated argument may not alias another one)."""
    if not isinstance(out, Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.dtype != G.dtype:
        raise TypeError(f"out must have G's dtype {G.dtype}, got {out.dtype}")
    if out.shape != G.shape:
        raise ValueError(f"out must have G's shape {tuple(G.shape)}, got {tuple(out.shape)}")
    if out.device != G.device:
        raise ValueError(f"out must be on G's device {G.device}, got {out.device}")
    if not out.is_contiguous():
        raise ValueError(f"out must be contiguous, got strides {out.stride()}")
    if out.numel() == 0 or torch.compiler.is_compiling():
        # Storage identity cannot be traced; the op's own implementation checks it again
        # on the real tensors (and under torch.compile functionalization copies anyway).
        return
    for name, t in inputs.items():
        if t.numel() and out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
            raise ValueError(f"out must not share memory with {name} (the projection is not done in place)")


def _run_project(G, U, S, V, tau, alpha, out, backend) -> Tensor:
    # The factors go to the working dtype (fp64 for fp64 G, else fp32) before any kernel:
    # fp64 G with fp32 factors is then computed in fp64 on every backend, as the reference
    # does (a no-op when the dtypes already match).
    wd = torch.float64 if G.dtype == torch.float64 else torch.float32
    U, S, V = (t.to(wd).contiguous() for t in (U, S, V))
    return _project_backend(G.contiguous(), U, S, V, tau, alpha, out, backend).contiguous()


@torch.library.custom_op("meshkern::spectral_project", mutates_args=())
def _project_op(G: Tensor, U: Tensor, S: Tensor, V: Tensor, tau: float, alpha: float,
                backend: str) -> tuple[Tensor, Tensor]:
    out = torch.empty_like(G, memory_format=torch.contiguous_format)
    return out, _run_project(G, U, S, V, tau, alpha, out, backend)


@_project_op.register_fake
def _(G, U, S, V, tau, alpha, backend):
    return torch.empty_like(G, memory_format=torch.contiguous_format), G.new_empty(G.shape[0], dtype=torch.float32)


def _project_setup(ctx, inputs, output):
    _, U, S, V, tau, alpha, backend = inputs
    ctx.save_for_backward(U, S, V)
    ctx.tau, ctx.alpha, ctx.backend = tau, alpha, backend


def _project_backward(ctx, grad_out, grad_filt_sq):
    # The map G -> G_proj is linear and self-adjoint (U D U^T and V D V^T are symmetric),
    # so dL/dG = project(dL/dG_proj). U, S, V are treated as constants (the prior).
    U, S, V = ctx.saved_tensors
    grad_g, _ = _project_op(grad_out.contiguous(), U, S, V, ctx.tau, ctx.alpha, ctx.backend)
    return grad_g, None, None, None, None, None, None


_project_op.register_autograd(_project_backward, setup_context=_project_setup)


@torch.library.custom_op("meshkern::spectral_project_out", mutates_args=("out",))
def _project_out_op(G: Tensor, U: Tensor, S: Tensor, V: Tensor, tau: float, alpha: float, out: Tensor,
                    backend: str) -> Tensor:
    # A custom op may not return an alias of an input, so only the statistic comes back.
    _check_out(out, G, {"G": G, "U": U, "S": S, "V": V})
    return _run_project(G, U, S, V, tau, alpha, out, backend)


@_project_out_op.register_fake
def _(G, U, S, V, tau, alpha, out, backend):
    return G.new_empty(G.shape[0], dtype=torch.float32)


def project(G: Tensor, U: Tensor, S: Tensor, V: Tensor, tau: float = 1e-3, alpha: float = 0.3, *,
            backend: str | None = "auto", return_stats: bool = False, out: Tensor | None = None):
    """alpha*G + (1-alpha) * U diag(d) (U^T G V) diag(d) V^T with d = S/(S+tau).

    Shapes: G[B,m,n] (or [m,n]), U[B,m,r], S[B,r], V[B,n,r] (unbatched likewise). G may be
    fp32, fp64, bf16 or fp16; U, S, V any of those. U, S, V are first cast to the working
    dtype, fp64 for fp64 G and fp32 otherwise, so accumulation is fp32 (fp64 for fp64 G,
    whatever the factors' dtype; the Triton kernel accumulates in fp32 for every dtype)
    and the result has G's dtype. U and V are assumed to have orthonormal columns (as
    randomized_svd gives; not checked). Negative or NaN S count as 0 (d in [0, 1]).
    With ``return_stats=True`` also returns ||G_filt||_F^2 per batch entry (fp32).
    Differentiable w.r.t. G (U, S, V are constants). alpha=1 returns G exactly.
    tau, alpha: Python or numpy real numbers.

    Errors: TypeError for non-tensors or non-float dtypes; ValueError for mismatched
    shapes or devices, tau not finite or < 0, alpha outside [0, 1]; RuntimeError for a
    forced backend that cannot run here. NaN/inf: not checked (hot path: one more read of
    G per step); a non-finite value in G, U or V of batch entry b (or an inf in its S)
    makes entry b of the result non-finite and leaves the other entries untouched.
    Determinism: deterministic for a given backend, device and input (bit-equal across
    CPU thread counts in our checks); backends agree to fp rounding. Non-contiguous
    inputs are copied to contiguous ones first. Traceable by torch.compile(fullgraph=True),
    with and without ``out``.

    ``out``: a contiguous tensor of G's shape, dtype and device, sharing no memory with
    G, U, S or V (else ValueError / TypeError). The result is written into it and ``out``
    itself is returned, bit-identical to the allocating call with the same backend (both
    run the same kernel). Not differentiable: with grad mode on, G or out requiring grad
    is a ValueError. Why: on CPU a fresh G-sized result costs first-touch page faults
    (more than the GEMMs for a ~64 MB gradient); a caller that keeps ``out`` between
    calls (SpectralAdamW) avoids them.
    """
    squeeze = isinstance(G, Tensor) and G.dim() == 2
    if squeeze:
        G, U, S, V = G[None], U[None], S[None], V[None]
    tau, alpha = _check_project_args(G, U, S, V, tau, alpha)
    backend = _check_backend(backend)
    if out is None:
        res, filt_sq = _project_op(G, U, S, V, tau, alpha, backend)
    else:
        _check_out(out, G[0] if squeeze else G, {"G": G, "U": U, "S": S, "V": V})
        if torch.is_grad_enabled() and (G.requires_grad or out.requires_grad):
            raise ValueError("project(out=...) is not differentiable; call it under torch.no_grad() or without out")
        res = out
        filt_sq = _project_out_op(G, U, S, V, tau, alpha, out[None] if squeeze else out, backend)
    if squeeze:
        filt_sq = filt_sq[0]
        if out is None:
            res = res[0]
    return (res, filt_sq) if return_stats else res


# ------------------------------------------------------------------- randomized SVD
# method="krylov" defaults: KRYLOV_STEPS blocks of ceil(rank / 2) columns (block Lanczos;
# docs/benchmarks.md, "Spectral").
KRYLOV_STEPS = 7
# A new Krylov block must be orthogonal to the earlier ones to this many ulps (max |P^T Q|);
# well-conditioned steps give a few ulps, a block that the Gram-Schmidt passes could not
# separate (the Krylov space is exhausted: rank-deficient M) is rebuilt by Householder QR.
_KRYLOV_ORTHO_ULPS = 64.0


def _orthonormalize(Y: Tensor, ortho: str) -> Tensor:
    """Orthonormal basis Q[B, m, l] of the columns of Y[B, m, l] (l <= m): Householder QR,
    or Cholesky-QR2 (meshkern.linalg.cholesky_qr2: GEMM-only, falls back to QR on entries
    it cannot make orthonormal)."""
    if ortho == "qr":
        return torch.linalg.qr(Y).Q
    return cholesky_qr2(Y)


def _auto_small_eig(C: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    """(w desc, W) of the small symmetric C[B, k, k] inside the SVDs. The kernel ``backend``
    names runs it, except where "auto" lands on the cpp Jacobi kernel: on CPU LAPACK's eigh
    is 5-20x faster for every k we use (k = 48: 1.8 vs 10 ms; k = 96: 9 vs 83 ms for a batch
    of 16; docs/benchmarks.md), so auto takes it there."""
    auto = (_backend.requested_name(backend) == "auto"
            and _backend.requested_name(os.environ.get(_backend.ENV_VAR), _backend.ENV_VAR) == "auto")
    if auto and C.device.type == "cpu":
        return sym_eig_reference(C)
    return _sym_eig_backend(C, DEFAULT_SWEEPS, backend)


def _next_block(W: Tensor, P: Tensor, ortho: str) -> Tensor:
    """Rows Q[B, b, d]: an orthonormal basis of the rows of W[B, b, d] after removing their
    component in the row space of P[B, p, d] (orthonormal rows, p may be 0), orthogonal to P.

    One classical Gram-Schmidt pass and QR of the block, then the check max |Q P^T| <= tol
    (64 ulps, ~2e-6 in fp32: the relative error it can leave in the Ritz values; 1000 ulps
    raised the best errors from 5e-7 to 3e-5). Entries that fail it get a second pass on Q
    (the classical "twice is enough"; in the bench runs 50-65% of the blocks passed with
    one, and the check costs half a pass); an entry that still fails (W lay, numerically,
    inside P's span: the Krylov space is exhausted) takes the last b columns of the
    Householder QR of [P^T, Q^T] instead: orthonormal and orthogonal to P whatever W was."""
    p = P.shape[1]
    if p:
        W = W - (W @ P.mT) @ P
    Q = _orthonormalize(W.mT, ortho).mT
    if not p:
        return Q.contiguous()
    tol = _KRYLOV_ORTHO_ULPS * torch.finfo(W.dtype).eps
    E = Q @ P.mT
    bad = ~(E.abs().flatten(1).amax(dim=1) <= tol)  # NaN counts as bad
    if bool(bad.any()):
        idx = bad.nonzero().flatten()
        Pi = P[idx]
        Qi = _orthonormalize((Q[idx] - E[idx] @ Pi).mT, ortho).mT
        still = ~((Qi @ Pi.mT).abs().flatten(1).amax(dim=1) <= tol)
        if bool(still.any()):
            full = torch.linalg.qr(torch.cat([Pi, Qi], dim=1).mT).Q
            Qi = torch.where(still[:, None, None], full[:, :, p:].mT, Qi)
        Q = Q.clone()
        Q[idx] = Qi
    return Q.contiguous()


def _krylov_sizes(r: int, block: int, steps: int) -> tuple[int, int]:
    """(b, k): columns per Krylov block and number of blocks (block / steps, or the defaults)."""
    return block or max(1, -(-r // 2)), steps or KRYLOV_STEPS


def _use_gram_kernel(A: Tensor, b: int, backend: str) -> bool:
    """Whether the products run in meshkern_C::gram_products (csrc/spectral/krylov.cpp): fp32
    CPU tensors, the cpp backend (what "auto" picks on CPU), a block size this CPU has a
    kernel for. Otherwise two torch GEMMs per step, the same arithmetic up to rounding."""
    if A.device.type != "cpu" or A.dtype != torch.float32:
        return False
    if _backend.resolve(GROUP, A.device, backend) != "cpp":
        return False
    _backend.extension(GROUP)
    return bool(torch.ops.meshkern_C.gram_products_supported(b))


def _gram_products(A: Tensor, Vt: Tensor, Yt: Tensor, with_z: bool, kernel: bool) -> Tensor | None:
    """Writes Yt = (A V)^T [B, b, m] (a slice of the fp64 Y buffer) and returns, with
    ``with_z``, Zt = (A^T A V)^T [B, b, n], for rows Vt[B, b, n]. Rows layout: the torch
    products are then X @ A^T and X @ A with a contiguous X, MKL's fast layouts (A @ X and
    A^T @ X ran 1.0-1.4x slower; docs/benchmarks.md)."""
    if kernel:
        Zt = torch.ops.meshkern_C.gram_products(A, Vt, with_z, Yt)
        return Zt if with_z else None
    Y = Vt @ A.mT
    Yt.copy_(Y)
    return Y @ A if with_z else None


def _krylov_svd_impl(A: Tensor, r: int, b: int, k: int, seed: int, ortho: str, wd: torch.dtype,
                     backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """Block Lanczos on A^T A with full reorthogonalization (the block Krylov method of
    Musco & Musco 2015, without its final pass over A).

    V_1 = orth(Omega[n, b]); for j < k: Y_j = A V_j, Z_j = A^T Y_j, V_{j+1} = the part of Z_j
    orthogonal to V_1..V_j, orthonormalized (_next_block); Y_k = A V_k. That is k products
    with A and k - 1 with A^T, each b columns wide; on CPU both products of a step come from
    one pass over A (meshkern_C::gram_products). V = [V_1 .. V_k] spans the block Krylov
    space K_k(A^T A, V_1) and Y = A V; the Ritz values are the singular values of Y, from
    the eigen-decomposition of its Gram matrix Y^T Y = X diag(s^2) X^T in fp64 (Y is fp32;
    an fp32 Gram would square its rounding into the small values). Then V_r = V X (exactly
    orthonormal), U_r = Y X / s (orthonormal to fp64 rounding: X diagonalizes the Gram of
    the very Y used). Directions with s below 4 sqrt(eps(wd)) s_1 get V = 0, S = 0, and a
    U column from a Householder QR that completes the others to an orthonormal set."""
    Bn, m, n = A.shape
    kernel = _use_gram_kernel(A, b, backend)
    gen = torch.Generator(device=A.device)
    gen.manual_seed(seed)
    omega = torch.randn(Bn, n, b, generator=gen, device=A.device, dtype=wd)
    Vb = A.new_empty(Bn, k * b, n)
    Y = A.new_empty(Bn, k * b, m, dtype=torch.float64)    # the products, exact in fp64
    Vb[:, :b] = _orthonormalize(omega, ortho).mT
    for j in range(k):
        Zt = _gram_products(A, Vb[:, j * b:(j + 1) * b], Y[:, j * b:(j + 1) * b], j < k - 1, kernel)
        if Zt is not None:
            Vb[:, (j + 1) * b:(j + 2) * b] = _next_block(Zt, Vb[:, :(j + 1) * b], ortho)
    if not _all_finite(Y):  # an fp32 product that overflowed is inf here too
        raise ValueError(f"the products M V overflow {wd} (singular values near the dtype's max): "
                         f"scale M down or pass fp64")
    C = Y @ Y.mT                                          # [B, k b, k b]
    w, X = _auto_small_eig(0.5 * (C + C.mT), backend)
    w, X = w[:, :r], X[:, :, :r]
    S = w.clamp_min(0).sqrt()
    floor = S[:, :1] * (torch.finfo(wd).eps ** 0.5) * 4
    keep = S > floor
    U = (X.mT @ Y).mT / torch.where(keep, S, torch.ones_like(S))[:, None, :]   # [B, m, r] fp64
    if not bool(keep.all()):
        # Complete the kept columns (orthonormal already) to an orthonormal U; QR keeps
        # them up to sign, which the diagonal of R restores.
        QR = torch.linalg.qr(U)
        sign = torch.where(QR.R.diagonal(dim1=-2, dim2=-1) < 0, -1.0, 1.0).to(U.dtype)
        U = torch.where(keep.all(dim=1)[:, None, None], U, QR.Q * sign[:, None, :])
    V = (X.to(wd).mT @ Vb).mT
    V = torch.where(keep[:, None, :], V, torch.zeros_like(V))
    S = torch.where(keep, S, torch.zeros_like(S))
    return U.to(wd).contiguous(), S.to(wd).contiguous(), V.contiguous()


def _randomized_svd_impl(M: Tensor, rank: int, oversample: int, power_iters: int, seed: int,
                         ortho: str, method: str, backend: str, block: int = 0,
                         steps: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    Bn, m, n = M.shape
    wd = torch.float64 if M.dtype == torch.float64 else torch.float32
    A = M.to(wd)
    r = min(rank, m, n)
    if method == "krylov":
        b, k = _krylov_sizes(r, block, steps)
        if k * b > min(m, n):
            method = "exact"  # the Krylov space would not fit: a small matrix, its full SVD is cheap
        else:
            return _krylov_svd_impl(A, r, b, k, seed, ortho, wd, backend)
    if method == "exact":
        U, S, Vh = torch.linalg.svd(A, full_matrices=False)
        U, S, V = U[:, :, :r], S[:, :r], Vh[:, :r, :].mT
        # s at or below LAPACK's rank tolerance max(m, n) eps s_1 is numerically zero: S = 0
        # and V = 0 there, as the iterative methods give (else V would hold arbitrary
        # directions of the null space, e.g. for M = 0).
        keep = S > S[:, :1] * (torch.finfo(wd).eps * max(m, n))
        V = torch.where(keep[:, None, :], V, torch.zeros_like(V))
        S = torch.where(keep, S, torch.zeros_like(S))
        return U.contiguous(), S.contiguous(), V.contiguous()
    l = min(r + oversample, m, n)
    gen = torch.Generator(device=M.device)
    gen.manual_seed(seed)
    omega = torch.randn(Bn, n, l, generator=gen, device=M.device, dtype=wd)
    Q = _orthonormalize(A @ omega, ortho)
    for _ in range(power_iters):
        Z = _orthonormalize((Q.mT @ A).mT, ortho)  # A^T Q in the faster layout (see _krylov_svd_impl)
        Q = _orthonormalize(A @ Z, ortho)
    Bs = Q.mT @ A                      # [B, l, n]
    C = Bs @ Bs.mT                     # [B, l, l], eigenvalues = s^2
    C = 0.5 * (C + C.mT)
    if not _all_finite(C):
        raise ValueError(f"M's Gram matrix overflows {wd} (singular values near sqrt of the dtype's max): "
                         f"scale M down or pass fp64")
    w, W = _auto_small_eig(C, backend)
    w, W = w[:, :r], W[:, :, :r]
    S = w.clamp_min(0).sqrt()
    U = Q @ W
    # V = B^T W / s. Directions with s below the fp noise floor of the Gram matrix get
    # V = 0 (and gain 0 in the filter) instead of an unbounded quotient.
    floor = S[:, :1] * (torch.finfo(wd).eps ** 0.5) * 4
    keep = S > floor
    V = (Bs.mT @ W) / torch.where(keep, S, torch.ones_like(S))[:, None, :]
    # The Gram matrix squares the condition number: for s within ~10x of the floor its
    # eigenvectors mix (their error ~ eps s_1^2 / gap), and B^T w / s is then neither unit
    # nor orthogonal to its neighbours (|V^T V - I| up to 0.15 measured on the rank-deficient
    # anchor momentum of a subspace-constrained model). Householder QR of V (kept columns
    # first, S descending) makes V orthonormal; for well separated s it changes V by its
    # rounding error only (R ~ I). Signs follow diag(R) >= 0, i.e. V's own.
    if V.shape[-1] > 0:
        QR = torch.linalg.qr(V)
        sign = torch.where(torch.diagonal(QR.R, dim1=-2, dim2=-1) < 0, -1.0, 1.0).to(V.dtype)
        V = QR.Q * sign[:, None, :]
    V = torch.where(keep[:, None, :], V, torch.zeros_like(V))
    S = torch.where(keep, S, torch.zeros_like(S))
    return U.contiguous(), S.contiguous(), V.contiguous()


@torch.library.custom_op("meshkern::randomized_svd", mutates_args=())
def _randomized_svd_op(M: Tensor, rank: int, oversample: int, power_iters: int, seed: int,
                       ortho: str, method: str, backend: str, block: int = 0,
                       steps: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    _check_finite(M, "M")  # here, not in randomized_svd: a data check inside the op traces under torch.compile
    return _randomized_svd_impl(M.contiguous(), rank, oversample, power_iters, seed, ortho, method, backend,
                                block, steps)


@_randomized_svd_op.register_fake
def _(M, rank, oversample, power_iters, seed, ortho, method, backend, block=0, steps=0):
    Bn, m, n = M.shape
    r = min(rank, m, n)
    wd = torch.float64 if M.dtype == torch.float64 else torch.float32
    return M.new_empty(Bn, m, r, dtype=wd), M.new_empty(Bn, r, dtype=wd), M.new_empty(Bn, n, r, dtype=wd)


def randomized_svd(M: Tensor, rank: int, *, oversample: int = 16, power_iters: int = 3, seed: int = 0,
                   ortho: str = "qr", method: str = "krylov", block: int | None = None,
                   steps: int | None = None, backend: str | None = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """Top-``rank`` singular triplets of each matrix in M[B, m, n] (or one [m, n]).

    Returns U[B,m,r], S[B,r] (descending, >= 0), V[B,n,r] with r = min(rank, m, n), in
    fp32 (fp64 for fp64 input), M ~= U diag(S) V^T on the top-r subspace. U and V have
    orthonormal columns (V's columns for s ~ 0 are zero). Deterministic for a given
    ``seed``, method, backend and device (the start block comes from a torch.Generator
    seeded with ``seed``).

    ``method``:
      "krylov" (default)  block Lanczos on M^T M with full reorthogonalization:
          ``steps`` blocks (default 7) of ``block`` columns (default ceil(rank / 2)), i.e.
          ``steps`` products with M and ``steps - 1`` with M^T; Ritz values from an fp64
          Gram matrix. Per column of products it gains far more accuracy than power
          iteration: at rank 32 its defaults (208 product columns) beat the randomized
          defaults' (384) error on both bench spectra at [1024, 1024] and [2048, 2048].
          On CPU both products of a step run in one pass over M
          (meshkern_C::gram_products) when the block size has a kernel (multiples of 16
          up to 64 with AVX-512, 8 or 16 with AVX2; else two torch GEMMs). Timings:
          docs/benchmarks.md, "Spectral". A matrix with steps * block > min(m, n) takes
          the "exact" path (its full SVD is cheap). ``oversample`` and ``power_iters``
          are not used. Directions with s below 4 sqrt(eps) s_1 get S = 0 and V = 0
          (U stays orthonormal).
      "randomized"  Halko-Martinsson-Tropp subspace iteration: ``oversample`` extra
          columns, ``power_iters`` re-orthonormalized power iterations (the method before
          "krylov"; SpectralAdamW's default). Defaults (16, 3) meet the 1% top-r target on
          s_i = 1/(1+i) and exp(-i/50) (0.1% / 0.25% at r=32 on [1024,1024]); for a very
          slow decay such as (1+i)^-0.5 they give ~1.7-2.4%.
      "exact"  torch.linalg.svd, then truncation; s <= max(m, n) eps s_1 (LAPACK's rank
          tolerance) gets S = 0 and V = 0.
    ``ortho``: "qr" (Householder) or "cholqr2" (meshkern.linalg.cholesky_qr2) for the
    orthonormalizations of both iterative methods. ``backend`` ("auto" or None, "cpp",
    "cuda", "triton", "reference") picks the small symmetric-eigen kernel; "auto" takes
    LAPACK's eigh on CPU (faster there than the Jacobi kernel); on CPU "cpp" (what auto
    picks there) also runs krylov's products in meshkern_C::gram_products. A forced
    backend's Jacobi limit applies to the small problem: krylov's is fp64 and steps *
    block wide (112 at rank 32), beyond the forced cuda kernel's 55 (ValueError; auto uses
    the library eigh there). rank, oversample,
    power_iters, seed, block, steps: ints (numpy ints too). A non-contiguous M is copied
    to a contiguous one first (M is never modified). Traceable by
    torch.compile(fullgraph=True).

    Errors: TypeError for a non-tensor or non-float M; ValueError for a shape other than
    [m, n] / [B, m, n] with m, n >= 1, rank < 1, oversample or power_iters < 0, block or
    steps < 0 (0 / None: the default), a seed outside [-2**63, 2**63), an unknown ortho /
    method, an M holding NaN or inf (never a NaN result), or an M whose products (krylov)
    / Gram matrix (randomized) overflow the working dtype; RuntimeError for a forced
    backend that cannot run here.
    """
    squeeze = isinstance(M, Tensor) and M.dim() == 2
    if squeeze:
        M = M[None]
    float_tensor("M", M)
    if M.dim() != 3 or M.shape[1] < 1 or M.shape[2] < 1:
        raise ValueError(f"M must be a batch of matrices [B, m, n], got shape {tuple(M.shape)}")
    rank, oversample, power_iters, seed = _check_svd_options(rank, oversample, power_iters, seed, ortho, method)
    block, steps = _check_krylov_options(block, steps)
    U, S, V = _randomized_svd_op(M, rank, oversample, power_iters, seed, ortho, method, _check_backend(backend),
                                 block, steps)
    return (U[0], S[0], V[0]) if squeeze else (U, S, V)


__all__ = ["sym_eig", "randomized_svd", "project", "gains", "sym_eig_reference", "project_reference",
           "project_prepared", "project_prepared_reference",
           "DEFAULT_SWEEPS", "KRYLOV_STEPS", "METHODS"]
