"""Small dense linear-algebra helpers shared by the compressors and the spectral ops.

One Cholesky-QR2 for the whole package: PowerSGD's ``orthogonalize(..., "cholesky_qr2")``
and ``spectral.randomized_svd(..., ortho="cholqr2")`` both call :func:`cholesky_qr2`.
"""
from __future__ import annotations

import torch
from torch import Tensor

# Cholesky-QR2 is accurate for cond(Y) up to about u^-1/2 (Yamamoto et al. 2015). The
# Cholesky factor's diagonal bounds cond(Y) from below (max d / min d); an entry whose
# ratio is beyond u^-1/2 / 8 is not trusted and goes to Householder QR. 8 leaves margin
# for the gap between that bound and the true condition number.
_COND_MARGIN = 8.0
# Accepted loss of orthogonality, max |Q^T Q - I|, per column of Q: well-conditioned
# inputs give a few u here, Householder QR about the same.
_ORTHO_TOL_ULPS = 100.0


def cholesky_qr2(Y: Tensor) -> Tensor:
    """Q[B, m, l] with orthonormal columns spanning the columns of Y[B, m, l] (l <= m).

    Two rounds of Cholesky-QR (Q = Y R^-1 with R = chol(Y^T Y)^T, twice: GEMM-only, fast on
    GPUs). Guarantees max |Q^T Q - I| <= 100 * l * eps(dtype) for every batch entry,
    whatever Y is: an entry where Cholesky fails (``info``), where the Cholesky factor says
    Y is too ill-conditioned (rank-deficient inputs included: fp32 ``cholesky_ex`` can
    "succeed" on a singular Gram matrix), or whose result is not orthonormal, is
    recomputed with Householder QR. For well-conditioned entries the result is exactly
    the two Cholesky-QR rounds. Does not modify Y. Float32/float64 only (torch has no
    half-precision Cholesky)."""
    if Y.dim() != 3 or Y.shape[2] > Y.shape[1]:
        raise ValueError(f"cholesky_qr2 expects Y[B, m, l] with l <= m, got {tuple(Y.shape)}")
    l = Y.shape[-1]
    eps = torch.finfo(Y.dtype).eps
    min_ratio = _COND_MARGIN * eps ** 0.5
    eye = torch.eye(l, dtype=Y.dtype, device=Y.device)
    Q, bad = Y, torch.zeros(Y.shape[0], dtype=torch.bool, device=Y.device)
    for _ in range(2):
        L, info = torch.linalg.cholesky_ex(Q.mT @ Q)
        d = L.diagonal(dim1=-2, dim2=-1)
        ok = (info == 0) & torch.isfinite(L).flatten(1).all(dim=1) & (d.amin(-1) > min_ratio * d.amax(-1))
        bad |= ~ok
        L = torch.where(ok[:, None, None], L, eye)  # keep the batch finite; those entries are redone
        Q = torch.linalg.solve_triangular(L.mT, Q, upper=True, left=False)
    err = (Q.mT @ Q - eye).abs().flatten(1).amax(dim=1)
    bad |= ~(err <= _ORTHO_TOL_ULPS * l * eps)  # NaN counts as bad
    if bool(bad.any()):
        idx = bad.nonzero().flatten()
        Q = Q.clone()
        Q[idx] = torch.linalg.qr(Y[idx]).Q
    return Q


def orthonormality_error(Q: Tensor) -> Tensor:
    """max |Q^T Q - D| of each matrix in Q [..., m, k], in float64 (a 0-d tensor for one
    matrix). D is the identity except where a column's squared norm is below 1/2: there it
    is 0, so an all-zero column (randomized_svd returns them for singular values ~0) is
    fine, while every other column must be a unit vector orthogonal to the rest. The one
    check of "orthonormal factors" for SpectralAdamW and for what the anchor sends."""
    q = Q.detach().to(torch.float64)
    gram = q.mT @ q
    if gram.shape[-1] == 0:
        return gram.new_zeros(gram.shape[:-2])
    want = torch.diag_embed((gram.diagonal(dim1=-2, dim2=-1) > 0.5).to(torch.float64))
    return (gram - want).abs().amax(dim=(-2, -1))
