"""Spectral-correction ops: batched truncated SVD and the two-sided Tikhonov projection.

The anchor prior (../shared/method.md, sections 2-3) filters every fast-circuit gradient
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

Randomized SVD (Halko, Martinsson, Tropp 2011, algorithms 4.4 + 5.1): a Gaussian test
matrix Omega[n, r+o] (seeded: the result is a deterministic function of the inputs and
``seed``), Y = M Omega, ``power_iters`` rounds of re-orthonormalized power iteration,
then the small problem: B = Q^T M [r+o, n], C = B B^T [(r+o), (r+o)] solved by the
batched symmetric-eigen op (cyclic Jacobi in the C++/CUDA/Triton kernels), s = sqrt(w),
U = Q W, V = B^T W / s. The big GEMMs stay in torch (BLAS/cuBLAS are already optimal);
the kernels do the many small eigen problems and the fused projection.

Accuracy knobs (their measured effect: docs/benchmarks.md, "Spectral"):
    oversample   extra columns o; error falls with o, cost grows ~ (r+o)
    power_iters  q; the error of the top-r values shrinks like (s_{r+o}/s_r)^(2q+1)
    ortho        "qr" (Householder, always stable) or "cholqr2" (Cholesky-QR twice:
                 GEMM-only, falls back to QR for a batch entry whose Gram matrix is
                 not numerically positive definite)
    method       "randomized" or "exact" (torch.linalg.svd, then truncation)
The defaults (o = 16, q = 3) meet a 1% relative-error target on the top-32 singular
values of the spectra bench/spectral_bench.py measures.
"""
from __future__ import annotations

import math

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
    if method not in ("randomized", "exact"):
        raise ValueError(f"method must be 'randomized' or 'exact', got {method!r}")
    return out[0], out[1], out[2], sd


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


def _check_finite(t: Tensor, what: str) -> None:
    """ValueError if ``t`` holds NaN or inf. Reads the data: call it inside a custom op's
    implementation (it runs on real tensors there, also under torch.compile)."""
    if not bool(torch.isfinite(t).all()):
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
def _jacobi_k_limit(which: str, dtype: torch.dtype) -> int:
    """Largest k the one-block / one-program kernels hold (CUDA: 2 k^2 values in 48 KiB of
    shared memory; Triton: a [128, 128] register tile)."""
    if which == "cuda":
        return 78 if dtype == torch.float32 else 55
    return MAX_JACOBI_K if which == "triton" else 1 << 62


def _sym_eig_backend(A: Tensor, sweeps: int, backend: str) -> tuple[Tensor, Tensor]:
    which = _backend.resolve(GROUP, A.device, backend)
    k = A.shape[-1]
    if k > _jacobi_k_limit(which, A.dtype):
        if backend != "auto":
            raise ValueError(f"the {which} Jacobi kernel holds k <= {_jacobi_k_limit(which, A.dtype)} "
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
    if which == "reference":
        ref, filt_sq = project_reference(G, U, S, V, tau, alpha)
        out.copy_(ref)
        return filt_sq
    if which in ("cpp", "cuda"):
        _backend.extension(GROUP)
        return torch.ops.meshkern_C.spectral_project_out(G, U, S, V, float(tau), float(alpha), out)
    from meshkern.triton_kernels import projection

    return projection.spectral_project(G, U, S, V, float(tau), float(alpha), out)


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
    randomized_svd gives; not checked). Negative S count as 0 (d in [0, 1]).
    With ``return_stats=True`` also returns ||G_filt||_F^2 per batch entry (fp32).
    Differentiable w.r.t. G (U, S, V are constants). alpha=1 returns G exactly.
    tau, alpha: Python or numpy real numbers.

    Errors: TypeError for non-tensors or non-float dtypes; ValueError for mismatched
    shapes or devices, tau not finite or < 0, alpha outside [0, 1]; RuntimeError for a
    forced backend that cannot run here. NaN/inf: not checked (hot path: one more read of
    G per step); a non-finite value in G or the factors of batch entry b makes entry b of
    the result non-finite and leaves the other entries untouched.
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
def _orthonormalize(Y: Tensor, ortho: str) -> Tensor:
    """Orthonormal basis Q[B, m, l] of the columns of Y[B, m, l] (l <= m): Householder QR,
    or Cholesky-QR2 (meshkern.linalg.cholesky_qr2: GEMM-only, falls back to QR on entries
    it cannot make orthonormal)."""
    if ortho == "qr":
        return torch.linalg.qr(Y).Q
    return cholesky_qr2(Y)


def _randomized_svd_impl(M: Tensor, rank: int, oversample: int, power_iters: int, seed: int,
                         ortho: str, method: str, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    Bn, m, n = M.shape
    wd = torch.float64 if M.dtype == torch.float64 else torch.float32
    A = M.to(wd)
    r = min(rank, m, n)
    if method == "exact":
        U, S, Vh = torch.linalg.svd(A, full_matrices=False)
        return U[:, :, :r].contiguous(), S[:, :r].contiguous(), Vh[:, :r, :].mT.contiguous()
    l = min(r + oversample, m, n)
    gen = torch.Generator(device=M.device)
    gen.manual_seed(seed)
    omega = torch.randn(Bn, n, l, generator=gen, device=M.device, dtype=wd)
    Q = _orthonormalize(A @ omega, ortho)
    for _ in range(power_iters):
        Z = _orthonormalize(A.mT @ Q, ortho)
        Q = _orthonormalize(A @ Z, ortho)
    Bs = Q.mT @ A                      # [B, l, n]
    C = Bs @ Bs.mT                     # [B, l, l], eigenvalues = s^2
    C = 0.5 * (C + C.mT)
    if not bool(torch.isfinite(C).all()):
        raise ValueError(f"M's Gram matrix overflows {wd} (singular values near sqrt of the dtype's max): "
                         f"scale M down or pass fp64")
    w, W = _sym_eig_op(C, DEFAULT_SWEEPS, backend)
    w, W = w[:, :r], W[:, :, :r]
    S = w.clamp_min(0).sqrt()
    U = Q @ W
    # V = B^T W / s. Directions with s below the fp noise floor of the Gram matrix get
    # V = 0 (and gain 0 in the filter) instead of an unbounded quotient.
    floor = S[:, :1] * (torch.finfo(wd).eps ** 0.5) * 4
    keep = S > floor
    V = (Bs.mT @ W) / torch.where(keep, S, torch.ones_like(S))[:, None, :]
    V = torch.where(keep[:, None, :], V, torch.zeros_like(V))
    S = torch.where(keep, S, torch.zeros_like(S))
    return U.contiguous(), S.contiguous(), V.contiguous()


@torch.library.custom_op("meshkern::randomized_svd", mutates_args=())
def _randomized_svd_op(M: Tensor, rank: int, oversample: int, power_iters: int, seed: int,
                       ortho: str, method: str, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    _check_finite(M, "M")  # here, not in randomized_svd: a data check inside the op traces under torch.compile
    return _randomized_svd_impl(M.contiguous(), rank, oversample, power_iters, seed, ortho, method, backend)


@_randomized_svd_op.register_fake
def _(M, rank, oversample, power_iters, seed, ortho, method, backend):
    Bn, m, n = M.shape
    r = min(rank, m, n)
    wd = torch.float64 if M.dtype == torch.float64 else torch.float32
    return M.new_empty(Bn, m, r, dtype=wd), M.new_empty(Bn, r, dtype=wd), M.new_empty(Bn, n, r, dtype=wd)


def randomized_svd(M: Tensor, rank: int, *, oversample: int = 16, power_iters: int = 3, seed: int = 0,
                   ortho: str = "qr", method: str = "randomized",
                   backend: str | None = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """Top-``rank`` singular triplets of each matrix in M[B, m, n] (or one [m, n]).

    Returns U[B,m,r], S[B,r] (descending, >= 0), V[B,n,r] with r = min(rank, m, n), in
    fp32 (fp64 for fp64 input), M ~= U diag(S) V^T on the top-r subspace. U and V have
    orthonormal columns (V's columns for s ~ 0 are zero). Deterministic for a given
    ``seed``, backend and device (the test matrix comes from a torch.Generator seeded with
    ``seed``). ``method="exact"`` uses torch.linalg.svd. ``backend`` ("auto" or None,
    "cpp", "cuda", "triton", "reference") picks the small symmetric-eigen kernel.
    rank, oversample, power_iters, seed: ints (numpy ints too). A non-contiguous M is
    copied to a contiguous one first (M is never modified). Traceable by
    torch.compile(fullgraph=True).

    Errors: TypeError for a non-tensor or non-float M; ValueError for a shape other than
    [m, n] / [B, m, n] with m, n >= 1, rank < 1, oversample or power_iters < 0, a seed
    outside [-2**63, 2**63), an unknown ortho / method, an M holding NaN or inf (never a
    NaN result), or an M whose Gram matrix overflows its working dtype; RuntimeError for
    a forced backend that cannot run here. Defaults (oversample 16, power_iters 3, QR) meet the 1%
    top-r singular-value target on slowly decaying spectra (s_i = 1/(1+i), exp(-i/50):
    max error 0.1% / 0.25% at r=32 on [1024,1024]); for a very slow decay such as
    (1+i)^-0.5 they give ~1.7%, and oversample=32 brings it to 0.3% (bench --knobs).
    """
    squeeze = isinstance(M, Tensor) and M.dim() == 2
    if squeeze:
        M = M[None]
    float_tensor("M", M)
    if M.dim() != 3 or M.shape[1] < 1 or M.shape[2] < 1:
        raise ValueError(f"M must be a batch of matrices [B, m, n], got shape {tuple(M.shape)}")
    rank, oversample, power_iters, seed = _check_svd_options(rank, oversample, power_iters, seed, ortho, method)
    U, S, V = _randomized_svd_op(M, rank, oversample, power_iters, seed, ortho, method, _check_backend(backend))
    return (U[0], S[0], V[0]) if squeeze else (U, S, V)


__all__ = ["sym_eig", "randomized_svd", "project", "gains", "sym_eig_reference", "project_reference",
           "DEFAULT_SWEEPS"]
