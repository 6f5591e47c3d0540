"""Bounds on what an anchor sends, checked by a fast rank before any of it is used
(docs/anchor.md "Wire protocol", docs/security.md).

``Layout.decode`` has already checked the payload's size, dtype, finiteness and the sign
of S; ``check_entries`` adds, per entry, the magnitude bound SpectralAdamW documents
(meshkern.optim: norm <= max_anchor_ratio x max(1, ||p||_F, ||p.grad||_F); the optimizer
also admits ||M_anc||_F in the scale, which the fast rank leaves out, so this bound is
never looser than the optimizer's and cannot grow round after round with a momentum an
attacker inflated) and, for factored entries, orthonormal columns of U and V (max
|Q^T Q - I| <= FACTOR_ORTHO_TOL over the non-zero columns; randomized_svd returns
all-zero columns for s ~ 0). Norms and Gram matrices are computed in float64: a payload
of finite 3e38s has an infinite float32 norm, and must be rejected as too large, not
raise out of a step.
"""
from __future__ import annotations

import math

import torch

from meshkern.linalg import orthonormality_error
from meshkern.optim import FACTOR_ORTHO_TOL
from orchestration.anchor.wire import Rejected


def _norm(t: torch.Tensor) -> float:
    """||t||_F as a Python float, never an overflow: in t's own dtype first (no copy of a
    parameter-sized tensor at every arrival), again in float64 if that is not finite."""
    t = t.detach()
    if t.dtype in (torch.float32, torch.float64):
        got = float(torch.linalg.vector_norm(t))
        if math.isfinite(got):
            return got
    return float(torch.linalg.vector_norm(t.to(torch.float64)))


def scale_of(p: torch.Tensor) -> float:
    """The receiver's own scale of parameter ``p``: max(1, ||p||_F, ||p.grad||_F)."""
    s = max(1.0, _norm(p))
    if p.grad is not None and not p.grad.is_sparse:
        s = max(s, _norm(p.grad))
    return s


def _all_within(layout, entries, params, max_ratio: float, ortho_tol: float) -> bool:
    """True if every entry passes check_entries, decided with a few batched ops and one
    or two host syncs (per entry the checks are ~20 small tensor ops, at every arrival on every
    fast rank); False means "maybe not": check_entries then runs the per-entry checks,
    which raise with the message. Norms in the tensors' own dtype: an overflow gives inf,
    which is not "within", so the float64 per-entry path decides."""
    if not params or any(p.grad is None or p.grad.is_sparse for p in params):
        return False
    with torch.no_grad():
        if layout.transport == "factored":
            got = torch.stack(torch._foreach_norm([e[1].detach() for e in entries])).double()
            bad = []
            for k in (0, 2):  # U, V: batched over entries of one shape
                by_shape: dict[tuple, list] = {}
                for e in entries:
                    by_shape.setdefault(tuple(e[k].shape), []).append(e[k].detach())
                for qs in by_shape.values():
                    bad.append(~(orthonormality_error(torch.stack(qs)).amax() <= ortho_tol))
        else:
            got = torch.stack(torch._foreach_norm([e.detach() for e in entries])).double()
            bad = []
        # The scale is at least 1: entries whose norm is <= max_ratio pass without reading
        # the parameters and their gradients (real entries always do; those norms were two
        # passes over every parameter at every arrival, ~2/3 of the fast rank's cost of one).
        bad.append(~(torch.isfinite(got).all()))
        if bool(torch.stack(bad).any()):
            return False
        if bool((got <= max_ratio).all()):
            return True
        scale = torch.stack([torch.stack(torch._foreach_norm([p.detach() for p in params])).double(),
                             torch.stack(torch._foreach_norm([p.grad.detach() for p in params])).double()])
        scale = scale.amax(dim=0).clamp_min(1.0)
        return bool((torch.isfinite(scale).all() & (got <= max_ratio * scale).all()))


def check_entries(layout, entries, params, max_ratio: float, ortho_tol: float = FACTOR_ORTHO_TOL) -> None:
    """Raises Rejected("magnitude") for an entry over the bound, Rejected("ortho") for a
    factored entry whose U or V is not orthonormal. ``entries``: Layout.decode's output;
    ``params``: the parameters they belong to, in the same order."""
    if len(entries) != len(params):
        raise Rejected("shape", f"{len(entries)} entries for {len(params)} parameters")
    if _all_within(layout, entries, params, max_ratio, ortho_tol):
        return
    for i, (e, p) in enumerate(zip(entries, params)):
        if layout.transport == "factored":
            U, S, V = e
            for name, Q in (("U", U), ("V", V)):
                err = float(orthonormality_error(Q))
                if not err <= ortho_tol:
                    raise Rejected("ortho", f"entry {i} ({layout.names[i]}): {name} is not orthonormal "
                                            f"(max |{name}^T {name} - I| = {err:.3g} > {ortho_tol})")
            got = _norm(S)
        else:
            got = _norm(e)
        bound = max_ratio * scale_of(p)
        if not (math.isfinite(got) and got <= bound):
            raise Rejected("magnitude", f"entry {i} ({layout.names[i]}): norm {got:.3g} > max_anchor_ratio "
                                        f"{max_ratio:g} x this parameter's scale ({bound:.3g})")
