"""Promises of meshkern.spectral's docstrings that no other test checked (issue #18):
project leaves the other batch entries untouched when one holds NaN/inf; randomized_svd
never modifies M and returns zero V columns (and S = 0) for s = 0, on every method."""
import pytest
import torch

from meshkern import _backend
from meshkern import spectral as sp
from test_spectral import BACKENDS  # reference, cpp and triton, each skipped when it cannot run here


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _project_inputs(B=3, m=24, n=20, r=4):
    G = _rand(B, m, n, seed=1)
    U = torch.linalg.qr(_rand(B, m, r, seed=2)).Q
    V = torch.linalg.qr(_rand(B, n, r, seed=3)).Q
    S = _rand(B, r, seed=4).abs() * 4e-3
    return G, U, S, V


# ---------------------------------------------------------------- project, non-finite
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["G", "U", "S", "V"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("use_out", [False, True])
def test_project_non_finite_entry_leaves_the_other_entries_untouched(backend, where, bad, use_out):
    """project's docstring: a non-finite value in G, U or V of batch entry b (or an inf in
    its S) makes entry b of the result non-finite and leaves the other entries untouched
    (bit for bit what the call without the bad value gives), the statistic included; a
    NaN in S counts as 0."""
    clean = _project_inputs()
    ref, ref_sq = sp.project(*clean, 1e-3, 0.3, backend=backend, return_stats=True)
    args = [t.clone(memory_format=torch.contiguous_format) for t in clean]
    i = "GUSV".index(where)
    args[i][1].view(-1)[1] = bad  # one value of batch entry 1
    out = torch.full_like(ref, 7.0) if use_out else None
    got, got_sq = sp.project(*args, 1e-3, 0.3, backend=backend, return_stats=True, out=out)
    for b in (0, 2):
        assert torch.equal(got[b], ref[b]), f"entry {b} changed by a non-finite {where} in entry 1"
        assert torch.equal(got_sq[b], ref_sq[b])
    if where == "S" and bad != bad:
        # a NaN singular value counts as 0 (docstring: negative or NaN S give d = 0)
        args[2][1].view(-1)[1] = 0.0
        zero, zero_sq = sp.project(*args, 1e-3, 0.3, backend=backend, return_stats=True)
        assert torch.equal(got, zero) and torch.equal(got_sq, zero_sq)
    else:
        assert not torch.isfinite(got[1]).all() and not torch.isfinite(got_sq[1])


# ---------------------------------------------------------------- randomized_svd
SVD_CASES = [("krylov", "qr"), ("krylov", "cholqr2"), ("randomized", "qr"), ("randomized", "cholqr2"),
             ("exact", "qr")]


@pytest.mark.parametrize("backend", ["reference", pytest.param("cpp", marks=pytest.mark.skipif(
    _backend.extension("spectral") is None, reason="meshkern._spectral_C not built"))])
@pytest.mark.parametrize("method,ortho", SVD_CASES)
@pytest.mark.parametrize("layout", ["fp32", "fp64", "transposed", "bf16"])
def test_randomized_svd_never_modifies_M(backend, method, ortho, layout):
    M = _rand(2, 72, 64, seed=5)
    if layout == "fp64":
        M = M.double()
    elif layout == "transposed":  # a non-contiguous view: copied by randomized_svd, never written
        M = _rand(2, 64, 72, seed=5).mT
    elif layout == "bf16":
        M = M.bfloat16()
    before, version = M.clone(), M._version
    sp.randomized_svd(M, 8, method=method, ortho=ortho, backend=backend, steps=4)
    assert torch.equal(M, before) and M._version == version


@pytest.mark.parametrize("backend", ["reference", pytest.param("cpp", marks=pytest.mark.skipif(
    _backend.extension("spectral") is None, reason="meshkern._spectral_C not built"))])
@pytest.mark.parametrize("method,ortho", SVD_CASES)
@pytest.mark.parametrize("shape", [(60, 48), (20, 30)], ids=["krylov-sized", "small"])
def test_randomized_svd_zero_singular_values_give_zero_V_columns(backend, method, ortho, shape):
    """randomized_svd's docstring: S >= 0, U and V have orthonormal columns, V's columns
    for s ~ 0 are zero. Rank-3 M with rank 8 asked, and M = 0 (every s = 0): S and the V
    columns beyond the rank are exactly 0, U stays orthonormal, U S V^T reconstructs M.
    (20 x 30: krylov's Krylov space would not fit, it takes the exact path.)"""
    m, n = shape
    g = torch.Generator().manual_seed(1)
    M = torch.zeros(2, m, n)
    M[0] = torch.randn(m, 3, generator=g) @ torch.randn(3, n, generator=g)
    U, S, V = sp.randomized_svd(M, 8, method=method, ortho=ortho, backend=backend)
    assert torch.equal(S[0, 3:], torch.zeros(5)) and torch.equal(S[1], torch.zeros(8))
    assert torch.equal(V[0, :, 3:], torch.zeros(n, 5)) and torch.equal(V[1], torch.zeros(n, 8))
    assert (V[0, :, :3].mT @ V[0, :, :3] - torch.eye(3)).abs().max() <= 1e-5
    assert (U.mT @ U - torch.eye(8)).abs().max() <= 1e-4
    assert torch.allclose(S[0, :3], torch.linalg.svdvals(M[0].double())[:3].float(), rtol=1e-4)
    assert torch.allclose((U[0] * S[0]) @ V[0].mT, M[0], atol=1e-5 * M[0].abs().max())
