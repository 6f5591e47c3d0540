"""Subspace-projected stage boundaries: fused encode / decode of a residual stream whose
part above a known base lives in a shared k-dim subspace.

After "Protocol Models" (arXiv 2506.01260), as used by "Heterogeneous Low-Bandwidth
Pre-Training of LLMs" (arXiv 2601.02360): when every block's output projection keeps its
columns in span(U) (U [H, k], orthonormal columns), a stage's output is
h = E[ids] + (something in span(U)), so only the k coordinates travel:

    subspace_encode(h, ids, E, U)   c = (h - E[ids]) @ U               [..., H] -> [..., k]
    subspace_decode(c, ids, E, U)   h = E[ids] + c @ U^T               [..., k] -> [..., H]

``E`` [V, H] is the (frozen) token-embedding table both sides hold and ``ids`` [...] the
token ids of the rows (int64, in [0, V)). Instead of ``ids, E`` a broadcast
``offset=`` [H] can be the base (e.g. a PCA mean); with neither the base is zero. The
gather, the subtraction and the projection are one pass: the kernels never write
E[ids] or h - E[ids] to memory (CPU: one L2-sized block of rows at a time, then a BLAS
GEMM on it; Triton: a [rows, H-block] tile in registers).

Encode with a projected table: E is frozen in this mode, so (h - E[ids]) U =
h U - (E U)[ids], and a caller that keeps ``table = projected_table(E, U)`` [V, k] passes
``encode(h, ids, None, U, table=table)``: the GEMM h U with the gathered k-wide table
rows subtracted in its epilogue, k values gathered per token instead of H (the fastest
encode: bench/subspace_bench.py). Same rounding bound as the E form (both are
eps (|h| + |E[ids]|) |U| per element in fp32).

The backward direction of a boundary (the sender needs U U^T g, i.e. the receiver sends
U^T g and the sender rebuilds U (U^T g)) is two plain matmuls, ``g @ U`` and
``c_g @ U.T``: nothing to fuse there, so no kernel is written for it (``project`` and
``lift`` below are those matmuls, for symmetry).

Autograd: both ops are differentiable in every tensor input (h / c, E or offset, U);
the gradient of h is ``grad_c @ U^T`` and of c ``grad_h @ U``.

Accumulation in fp32 for fp16 / bf16 / fp32 inputs (fp64 for fp64); the result has the
dtype of h (encode) or c (decode). Every float input must have the same dtype. ids must
be int64. Backends ("auto" | "cpp" | "triton" | "reference", ``MESHKERN_BACKEND``) agree
to fp32 rounding (the sum over H runs in a different order); the reference (pure torch)
is the spec.
"""
from __future__ import annotations

import torch
from torch import Tensor

from meshkern import _backend
from meshkern._checks import backend_arg as _backend_arg
from meshkern._checks import float_tensor

__all__ = ["encode", "decode", "project", "lift", "projected_table", "encode_reference", "decode_reference"]

GROUP = "subspace"


# ------------------------------------------------------------------------- checks
def _check(x: Tensor, xname: str, ids, E, offset, U, width_of_x: str, table=None) -> tuple[int, int]:
    """Validates shapes/dtypes; returns (H, k). ``width_of_x`` is "H" (encode) or "k"."""
    float_tensor(xname, x, min_dim=1)
    float_tensor("U", U)
    if U.dim() != 2:
        raise ValueError(f"U must be [H, k], got shape {tuple(U.shape)}")
    H, k = U.shape
    if H < 1 or k < 1:
        raise ValueError(f"U must be [H, k] with H, k >= 1, got {tuple(U.shape)}")
    want = H if width_of_x == "H" else k
    if x.shape[-1] != want:
        raise ValueError(f"{xname} must be [..., {width_of_x}={want}] for U of shape {tuple(U.shape)}, "
                         f"got {tuple(x.shape)}")
    if U.dtype != x.dtype:
        raise TypeError(f"U must have {xname}'s dtype {x.dtype}, got {U.dtype}")
    if table is not None:
        if width_of_x != "H":
            raise ValueError("table= is for encode only: decode needs the H-wide rows of E")
        if E is not None or offset is not None or ids is None:
            raise ValueError("table= replaces E: give ids and table, without E or offset")
        float_tensor("table", table)
        if table.dim() != 2 or table.shape[1] != k:
            raise ValueError(f"table must be [V, k={k}] (= E @ U), got shape {tuple(table.shape)}")
        if table.dtype != x.dtype:
            raise TypeError(f"table must have {xname}'s dtype {x.dtype}, got {table.dtype}")
        E = table  # ids checks below: same rules against the table's rows
    elif (ids is None) != (E is None):
        raise ValueError("give ids and E together (the token-embedding base), or neither")
    if E is not None and offset is not None:
        raise ValueError("give ids/E or offset as the base, not both")
    if E is not None:
        if not isinstance(ids, Tensor) or ids.dtype != torch.int64:
            got = ids.dtype if isinstance(ids, Tensor) else type(ids).__name__
            raise TypeError(f"ids must be an int64 tensor, got {got}")
        float_tensor("E", E)
        if table is None and (E.dim() != 2 or E.shape[1] != H):
            raise ValueError(f"E must be [V, H={H}], got shape {tuple(E.shape)}")
        if table is None and E.dtype != x.dtype:
            raise TypeError(f"E must have {xname}'s dtype {x.dtype}, got {E.dtype}")
        if tuple(ids.shape) != tuple(x.shape[:-1]):
            raise ValueError(f"ids must be {xname}'s leading shape {tuple(x.shape[:-1])}, got {tuple(ids.shape)}")
        if ids.device != x.device or E.device != x.device:
            raise ValueError(f"ids, E (table) and {xname} must be on one device, got {ids.device}, {E.device}, "
                             f"{x.device}")
    if offset is not None:
        float_tensor("offset", offset)
        if tuple(offset.shape) != (H,):
            raise ValueError(f"offset must be [H={H}], got shape {tuple(offset.shape)}")
        if offset.dtype != x.dtype:
            raise TypeError(f"offset must have {xname}'s dtype {x.dtype}, got {offset.dtype}")
        if offset.device != x.device:
            raise ValueError(f"offset and {xname} must be on one device, got {offset.device}, {x.device}")
    if U.device != x.device:
        raise ValueError(f"U and {xname} must be on one device, got {U.device}, {x.device}")
    return H, k


def _check_ids_range(ids, E) -> None:
    """ValueError for an id outside [0, V). Data-dependent (one host sync on GPUs), so it
    runs in the eager op, not in the fake kernel."""
    if ids is None or ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    V = E.shape[0]
    if lo < 0 or hi >= V:
        bad = lo if lo < 0 else hi
        raise ValueError(f"ids must lie in [0, V={V}) (rows of E / the table), got id {bad}")


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------- reference
def encode_reference(h: Tensor, ids: Tensor | None, E: Tensor | None, U: Tensor, *,
                     offset: Tensor | None = None, table: Tensor | None = None) -> Tensor:
    """The spec of ``encode``: (h - base) @ U in fp32 (fp64 for fp64), cast to h's dtype;
    with ``table``: h @ U - table[ids]."""
    acc = _acc(h.dtype)
    if table is not None:
        return (h.to(acc) @ U.to(acc) - table.to(acc)[ids]).to(h.dtype)
    x = h.to(acc)
    if E is not None:
        x = x - E.to(acc)[ids]
    elif offset is not None:
        x = x - offset.to(acc)
    return (x @ U.to(acc)).to(h.dtype)


def decode_reference(c: Tensor, ids: Tensor | None, E: Tensor | None, U: Tensor, *,
                     offset: Tensor | None = None) -> Tensor:
    """The spec of ``decode``: base + c @ U^T in fp32 (fp64 for fp64), cast to c's dtype."""
    acc = _acc(c.dtype)
    x = c.to(acc) @ U.to(acc).T
    if E is not None:
        x = x + E.to(acc)[ids]
    elif offset is not None:
        x = x + offset.to(acc)
    return x.to(c.dtype)


def projected_table(E: Tensor, U: Tensor) -> Tensor:
    """E @ U [V, k] in fp32 (fp64 for fp64), E's dtype: the ``table=`` of ``encode``.
    Recompute it whenever E or U changes (E is frozen in the subspace mode)."""
    acc = _acc(E.dtype)
    return (E.to(acc) @ U.to(acc)).to(E.dtype).contiguous()


# ----------------------------------------------------------------------- dispatch
def _run(op: str, x: Tensor, ids, E, offset, U, backend: str, table=None) -> Tensor:
    """x is [..., H] (encode) or [..., k] (decode); flattened to 2-D for the kernels."""
    which = _backend.resolve(GROUP, x.device, None if backend == "auto" else backend)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    ids2 = None if ids is None else ids.reshape(-1).contiguous()
    E, offset, U, table = (None if t is None else t.contiguous() for t in (E, offset, U, table))
    extra = (table,) if op == "encode" else ()
    if which == "reference":
        if op == "encode":
            out = encode_reference(x2, ids2, E, U, offset=offset, table=table)
        else:
            out = decode_reference(x2, ids2, E, U, offset=offset)
    elif which in ("cpp", "cuda"):
        _backend.extension(GROUP)
        fn = getattr(torch.ops.meshkern_C, f"subspace_{op}", None)
        if fn is None:
            raise RuntimeError("meshkern._subspace_C has no subspace kernels (stale build): rebuild the extension")
        out = fn(x2, ids2, E, offset, *extra, U)
    else:
        from meshkern.triton_kernels import subspace as tk  # noqa: PLC0415 (triton is optional)
        out = getattr(tk, op)(x2, ids2, E, offset, *extra, U)
    return out.reshape(*lead, out.shape[-1])


# -------------------------------------------------------------------------- ops
@torch.library.custom_op("meshkern::subspace_encode", mutates_args=())
def _encode_op(h: Tensor, ids: Tensor | None, E: Tensor | None, offset: Tensor | None, table: Tensor | None,
               U: Tensor, backend: str) -> Tensor:
    _check(h, "h", ids, E, offset, U, "H", table)
    _check_ids_range(ids, E if table is None else table)
    return _run("encode", h, ids, E, offset, U, backend, table)


@_encode_op.register_fake
def _(h, ids, E, offset, table, U, backend):
    _, k = _check(h, "h", ids, E, offset, U, "H", table)
    return h.new_empty(*h.shape[:-1], k)


@torch.library.custom_op("meshkern::subspace_decode", mutates_args=())
def _decode_op(c: Tensor, ids: Tensor | None, E: Tensor | None, offset: Tensor | None, U: Tensor,
               backend: str) -> Tensor:
    _check(c, "c", ids, E, offset, U, "k")
    _check_ids_range(ids, E)
    return _run("decode", c, ids, E, offset, U, backend)


@_decode_op.register_fake
def _(c, ids, E, offset, U, backend):
    H, _ = _check(c, "c", ids, E, offset, U, "k")
    return c.new_empty(*c.shape[:-1], H)


def _rows_grad(table: Tensor, ids: Tensor, g: Tensor) -> Tensor:
    """d/d table of sum(g * table[ids]): g's rows added into the ids' rows."""
    return torch.zeros_like(table).index_add_(0, ids.reshape(-1), g.reshape(-1, table.shape[1]).to(table.dtype))


def _base_grads(ctx, g_h: Tensor, ids, E, offset, sign: float):
    """Gradients of the base (E rows or offset) from the gradient w.r.t. the H-dim side."""
    gE = goff = None
    if E is not None and ctx.needs_input_grad[2]:
        gE = _rows_grad(E, ids, sign * g_h)
    if offset is not None and ctx.needs_input_grad[3]:
        goff = (sign * g_h).reshape(-1, offset.shape[0]).sum(0).to(offset.dtype)
    return gE, goff


def _encode_setup(ctx, inputs, output):
    h, ids, E, offset, table, U, backend = inputs
    ctx.save_for_backward(h, ids, E, offset, table, U)


def _encode_backward(ctx, grad_c):
    # c = (h - base) U: dh = grad_c U^T, dbase = -dh, dU = (h - base)^T grad_c.
    # c = h U - table[ids]: dtable = -grad_c gathered back, dU = h^T grad_c.
    h, ids, E, offset, table, U = ctx.saved_tensors
    acc = _acc(grad_c.dtype)
    g = grad_c.to(acc)
    g_h = g @ U.to(acc).T
    gh = g_h.to(h.dtype) if ctx.needs_input_grad[0] else None
    gE, goff = _base_grads(ctx, g_h, ids, E, offset, -1.0)
    gT = _rows_grad(table, ids, -g) if table is not None and ctx.needs_input_grad[4] else None
    gU = None
    if ctx.needs_input_grad[5]:
        x = h.to(acc)
        if E is not None:
            x = x - E.to(acc)[ids]
        elif offset is not None:
            x = x - offset.to(acc)
        gU = (x.reshape(-1, U.shape[0]).T @ g.reshape(-1, U.shape[1])).to(U.dtype)
    return gh, None, gE, goff, gT, gU, None


def _decode_setup(ctx, inputs, output):
    c, ids, E, offset, U, backend = inputs
    ctx.save_for_backward(c, ids, E, offset, U)


def _decode_backward(ctx, grad_h):
    # h = base + c U^T: dc = grad_h U, dbase = grad_h, dU = grad_h^T c.
    c, ids, E, offset, U = ctx.saved_tensors
    acc = _acc(grad_h.dtype)
    g = grad_h.to(acc)
    gc = (g @ U.to(acc)).to(c.dtype) if ctx.needs_input_grad[0] else None
    gE, goff = _base_grads(ctx, g, ids, E, offset, 1.0)
    gU = None
    if ctx.needs_input_grad[4]:
        gU = (g.reshape(-1, U.shape[0]).T @ c.to(acc).reshape(-1, U.shape[1])).to(U.dtype)
    return gc, None, gE, goff, gU, None


_encode_op.register_autograd(_encode_backward, setup_context=_encode_setup)
_decode_op.register_autograd(_decode_backward, setup_context=_decode_setup)


# --------------------------------------------------------------------- public API
def _plain_eager(*ts) -> bool:
    """True when a call needs none of the custom op's machinery: plain tensors, nothing
    requiring grad, no compile / dispatch mode active. Then the public functions run the
    kernel directly: the custom op's dispatch costs ~40 us a call (0.1-0.3 ms on a loaded
    machine), up to a third of a 4096-token encode at H = 192 (bench/subspace_bench.py)."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return False
    return all(t is None or (type(t) is Tensor and not t.requires_grad) for t in ts)


def encode(h: Tensor, ids: Tensor | None, E: Tensor | None, U: Tensor, *, offset: Tensor | None = None,
           table: Tensor | None = None, backend: str | None = "auto") -> Tensor:
    """c = (h - E[ids]) @ U  (or (h - offset) @ U, or h @ U): [..., H] -> [..., k].

    h [..., H] float; ids [...] int64 in [0, V); E [V, H]; U [H, k]; offset [H]; all
    float tensors of one dtype and device. ``table`` [V, k] = projected_table(E, U), given
    instead of E: c = h @ U - table[ids] (same value, k values gathered per token instead
    of H). TypeError / ValueError for a bad dtype or shape, an id outside [0, V), or two
    bases given."""
    _check(h, "h", ids, E, offset, U, "H", table)
    backend = _backend_arg(backend)
    if _plain_eager(h, ids, E, offset, table, U):
        _check_ids_range(ids, E if table is None else table)
        return _run("encode", h, ids, E, offset, U, backend, table)
    return _encode_op(h, ids, E, offset, table, U, backend)


def decode(c: Tensor, ids: Tensor | None, E: Tensor | None, U: Tensor, *, offset: Tensor | None = None,
           backend: str | None = "auto") -> Tensor:
    """h = E[ids] + c @ U^T  (or offset + c @ U^T, or c @ U^T): [..., k] -> [..., H].
    Arguments and errors as in ``encode``."""
    _check(c, "c", ids, E, offset, U, "k")
    backend = _backend_arg(backend)
    if _plain_eager(c, ids, E, offset, U):
        _check_ids_range(ids, E)
        return _run("decode", c, ids, E, offset, U, backend)
    return _decode_op(c, ids, E, offset, U, backend)


def project(g: Tensor, U: Tensor) -> Tensor:
    """g @ U: the gradient's coordinates (backward wire). A plain matmul; no kernel pays."""
    return g @ U


def lift(c: Tensor, U: Tensor) -> Tensor:
    """c @ U^T: back to H dims (the sender's U (U^T g)). A plain matmul; no kernel pays."""
    return c @ U.T
