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


def orthonormality_error(Q: torch.Tensor) -> float:
    """max |Q^T Q - I| over Q's columns, an all-zero column counting as fine."""
    q = Q.detach().to(torch.float64)
    gram = q.T @ q
    nonzero = (q.abs().amax(dim=0) > 0).to(torch.float64)
    want = torch.diag(nonzero)
    return float((gram - want).abs().max()) if gram.numel() else 0.0


def check_entries(layout, entries, params, max_ratio: float, ortho_tol: float = FACTOR_ORTHO_TOL) -> None:
    """Raises Rejected("magnitude") for an entry over the bound, Rejected("ortho") for a
    factored entry whose U or V is not orthonormal. ``entries``: Layout.decode's output;
    ``params``: the parameters they belong to, in the same order."""
    if len(entries) != len(params):
        raise Rejected("shape", f"{len(entries)} entries for {len(params)} parameters")
    for i, (e, p) in enumerate(zip(entries, params)):
        if layout.transport == "factored":
            U, S, V = e
            for name, Q in (("U", U), ("V", V)):
                err = orthonormality_error(Q)
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
