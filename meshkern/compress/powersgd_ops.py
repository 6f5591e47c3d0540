"""PowerSGD's two fused steps as torch ops (``torch.ops.meshkern.*``).

    powersgd_ef_project(grad[B,n,m], err[B,n,m], q[B,m,r]) -> p[B,n,r]
        err += grad (error feedback: err now holds M = grad + old error);  p = err @ q
    powersgd_reconstruct(p[B,n,r], q[B,m,r], err[B,n,m]) -> out[B,n,m]
        out = p @ q^T (the decompressed average);  err -= out (the new error, M - M_hat)

Each fuses a memory-bound elementwise pass into the thin matmul next to it, so the big
[B,n,m] buffers are read/written once instead of twice. Both mutate ``err`` in place
(declared in ``mutates_args``), return a fresh tensor, and are not differentiable
(compression is not part of any autograd graph; no autograd is registered).

Backends (``backend=``, see meshkern._backend): "reference" is the pure-torch
definition below. ``powersgd_ef_project`` has a C++ kernel (csrc/dp/powersgd.cpp,
``torch.ops.meshkern_C.powersgd_ef_project``, rows over OpenMP, AVX2 clone picked at
run time). "auto" uses it where it beat torch's add_ + bmm (measurements:
docs/benchmarks.md, "PowerSGD fused ops"): fp32, r <= 8 (specialized 1/2/4/8) and
n <= 4096 rows; backend="cpp" still forces the kernel. ``powersgd_reconstruct`` runs
the reference on every backend (its C++ kernel was slower than torch and was removed).
CUDA tensors use the reference (cuBLAS); no CUDA/Triton kernels yet. Results
are deterministic for a given backend and thread count; backends agree to fp32
rounding (different summation order).
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

from meshkern import _backend


def _check(grad_or_p: Tensor, err: Tensor, q: Tensor, name: str) -> None:
    for t, what in ((grad_or_p, "first"), (err, "err"), (q, "q")):
        if t.dim() != 3:
            raise ValueError(f"{name}: {what} must be 3-D [B, rows, cols], got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name}: {what} must be floating point, got {t.dtype}")
    if not (grad_or_p.dtype == err.dtype == q.dtype):
        raise TypeError(f"{name}: dtypes differ ({grad_or_p.dtype}, {err.dtype}, {q.dtype})")
    if not (grad_or_p.device == err.device == q.device):
        raise ValueError(f"{name}: tensors are on different devices")


#: where "auto" sends powersgd_ef_project to C++ (measured wins: docs/benchmarks.md)
AUTO_CPP_RANKS = (1, 2, 4, 8)
AUTO_CPP_MAX_ROWS = 4096


def _kernel_backend(device: torch.device, backend: str, fast: bool = True) -> str:
    """The backend that runs these ops: cpp on CPU when built and ``fast`` (measured to
    beat torch), else the reference; a forced backend is honoured or refused."""
    forced = backend != "auto"
    name = _backend.resolve("dp", device, backend if forced else None)
    if name in ("cuda", "triton"):  # no CUDA/Triton kernel for these ops: cuBLAS reference
        if forced:
            raise RuntimeError(f"meshkern.powersgd ops have no {name} kernel; use 'reference', 'cpp' or 'auto'")
        return "reference"
    if name == "cpp" and not fast and not forced and os.environ.get(_backend.ENV_VAR, "auto") == "auto":
        return "reference"
    return name


# ---- powersgd_ef_project ------------------------------------------------------------------
def ef_project_reference(grad: Tensor, err: Tensor, q: Tensor) -> Tensor:
    err.add_(grad)
    return torch.bmm(err, q)


@torch.library.custom_op("meshkern::powersgd_ef_project", mutates_args=("err",))
def powersgd_ef_project(grad: Tensor, err: Tensor, q: Tensor, backend: str = "auto") -> Tensor:
    """err += grad; return err @ q.  grad, err: [B,n,m]; q: [B,m,r] -> [B,n,r], err's dtype."""
    _check(grad, err, q, "powersgd_ef_project")
    if grad.shape != err.shape or q.shape[:2] != (err.shape[0], err.shape[2]):
        raise ValueError(f"powersgd_ef_project: shapes grad {tuple(grad.shape)}, err {tuple(err.shape)}, "
                         f"q {tuple(q.shape)} do not fit [B,n,m], [B,n,m], [B,m,r]")
    fast = err.dtype == torch.float32 and q.shape[2] in AUTO_CPP_RANKS and err.shape[1] <= AUTO_CPP_MAX_ROWS
    if _kernel_backend(err.device, backend, fast) == "cpp" and err.is_contiguous():
        return torch.ops.meshkern_C.powersgd_ef_project(grad.contiguous(), err, q.contiguous())
    return ef_project_reference(grad, err, q)


@powersgd_ef_project.register_fake
def _(grad, err, q, backend="auto"):
    return err.new_empty((err.shape[0], err.shape[1], q.shape[2]))


# ---- powersgd_reconstruct -----------------------------------------------------------------
def reconstruct_reference(p: Tensor, q: Tensor, err: Tensor) -> Tensor:
    out = torch.bmm(p, q.transpose(1, 2))
    err.sub_(out)
    return out


@torch.library.custom_op("meshkern::powersgd_reconstruct", mutates_args=("err",))
def powersgd_reconstruct(p: Tensor, q: Tensor, err: Tensor, backend: str = "auto") -> Tensor:
    """out = p @ q^T; err -= out; return out.  p: [B,n,r]; q: [B,m,r]; err: [B,n,m]."""
    _check(p, err, q, "powersgd_reconstruct")
    if p.shape[0] != err.shape[0] or q.shape[0] != err.shape[0] or p.shape[1] != err.shape[1] \
            or q.shape[1] != err.shape[2] or p.shape[2] != q.shape[2]:
        raise ValueError(f"powersgd_reconstruct: shapes p {tuple(p.shape)}, q {tuple(q.shape)}, "
                         f"err {tuple(err.shape)} do not fit [B,n,r], [B,m,r], [B,n,m]")
    _kernel_backend(err.device, backend)  # validates a forced backend; all run the reference
    return reconstruct_reference(p, q, err)


@powersgd_reconstruct.register_fake
def _(p, q, err, backend="auto"):
    return torch.empty_like(err)
