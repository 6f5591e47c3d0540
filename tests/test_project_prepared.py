"""meshkern_C::project_prepared (csrc/spectral/project_prepared.cpp), SpectralAdamW's direct
projection on CPU: against its torch chain (meshkern.spectral.project_prepared_reference),
against the projection's spec (meshkern.spectral.project_reference) and against a float64
computation, with row / column / rank tails; its list semantics; its input checks."""
import pytest
import torch

from meshkern import _backend
from meshkern import spectral as sp

HAVE_CPP = _backend.extension("spectral") is not None and hasattr(torch.ops.meshkern_C, "project_prepared")
pytestmark = pytest.mark.skipif(not HAVE_CPP, reason="meshkern._spectral_C (project_prepared) not built")


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _prior(m, n, r, seed, tau=1e-3):
    """(G, U, S, V) with orthonormal U, V and gains spread over (0, 1), and the prepared
    form (U, (U d)^T, V d, V^T)."""
    G = _rand(m, n, seed=seed)
    U = torch.linalg.qr(_rand(m, r, seed=seed + 1)).Q.float().contiguous()
    V = torch.linalg.qr(_rand(n, r, seed=seed + 2)).Q.float().contiguous()
    S = torch.logspace(-1, -4, r)
    d = sp.gains(S, tau)
    return (G, U, S, V), (U, (U * d).mT.contiguous(), (V * d).contiguous(), V.mT.contiguous())


def _exact(G, U, Udt, Vd, Vt, alpha):
    g, u, udt, vd, vt = (t.double() for t in (G, U, Udt, Vd, Vt))
    xf = udt @ g @ vd
    return alpha * g + (1 - alpha) * u @ xf @ vt, xf


# r = 16 / 32: row panels on AVX-512 and AVX2 (16); r = 8: panels on AVX2 only; r = 5: BLAS.
# m, n off every tile: panel rows 8 / 4 / 6, out tiles of 4 rows x 64 columns, vectors of 16.
@pytest.mark.parametrize("m,n,r", [(37, 53, 16), (192, 192, 16), (70, 130, 8), (33, 65, 5), (64, 81, 32),
                                   (16, 16, 16), (3, 200, 2)])
@pytest.mark.parametrize("alpha", [0.3, 0.0, 1.0])
def test_matches_torch_chain_within_its_own_error(m, n, r, alpha):
    (G, U, S, V), prep = _prior(m, n, r, seed=m + n + r)
    out = torch.full((m, n), float("nan"))
    (xf,) = sp.project_prepared([G], *([t] for t in prep), [alpha], [out])
    ref = torch.empty(m, n)
    xf_ref = sp.project_prepared_reference(G, *prep, alpha, ref)
    exact, xf_exact = _exact(G, *prep, alpha)
    err = (out.double() - exact).abs().max().item()
    err_ref = (ref.double() - exact).abs().max().item()
    scale = exact.abs().max().item()
    # flash-attention's rule: at most ~2x the torch chain's own error against float64
    assert err <= 2 * err_ref + 1e-7 * scale, (err, err_ref)
    assert xf.shape == (r, r) and torch.allclose(xf.double(), xf_exact, rtol=1e-5, atol=1e-6 * xf_exact.abs().max())
    assert torch.allclose(xf, xf_ref, rtol=1e-5, atol=1e-6 * xf_ref.abs().max().item() + 1e-12)
    # the projection's spec, from the unprepared factors
    spec, fsq = sp.project_reference(G[None], U[None], S[None], V[None], 1e-3, alpha)
    assert torch.allclose(out, spec[0], rtol=1e-5, atol=1e-5 * scale)
    assert torch.allclose(xf.double().square().sum(), fsq[0].double(), rtol=1e-4)


def test_alpha_one_is_g_and_alpha_zero_is_the_filtered_part():
    (G, *_), prep = _prior(40, 72, 16, seed=3)
    one, zero = torch.empty(40, 72), torch.empty(40, 72)
    sp.project_prepared([G, G], *([t, t] for t in prep), [1.0, 0.0], [one, zero])
    assert torch.equal(one, G)  # fma(1, g, 0 + exact zeros) = g: the low-rank part is scaled by 0
    exact, _ = _exact(G, *prep, 0.0)
    assert torch.allclose(zero.double(), exact, atol=1e-6 * exact.abs().max())


def test_one_call_for_many_matrices_equals_one_call_each():
    """Every entry of the lists is its own matrix: shapes, ranks and alphas mixed in one
    call give the same bits as separate calls."""
    specs = [(48, 40, 16, 0.3), (40, 48, 16, 0.5), (33, 65, 5, 0.1), (48, 40, 16, 0.9)]
    entries = [(_prior(m, n, r, seed=10 * i)[0][0], _prior(m, n, r, seed=10 * i)[1], a)
               for i, (m, n, r, a) in enumerate(specs)]
    outs = [torch.empty_like(G) for G, _, _ in entries]
    xfs = sp.project_prepared([G for G, _, _ in entries], *([e[1][k] for e in entries] for k in range(4)),
                              [a for _, _, a in entries], outs)
    for (G, prep, a), out, xf in zip(entries, outs, xfs):
        single = torch.empty_like(G)
        (xf1,) = sp.project_prepared([G], *([t] for t in prep), [a], [single])
        assert torch.equal(out, single) and torch.equal(xf, xf1)


def test_reference_backend_takes_the_torch_chain(monkeypatch):
    (G, *_), prep = _prior(30, 20, 16, seed=5)
    monkeypatch.setenv("MESHKERN_BACKEND", "reference")
    out, ref = torch.empty(30, 20), torch.empty(30, 20)
    (xf,) = sp.project_prepared([G], *([t] for t in prep), [0.3], [out])
    xf_ref = sp.project_prepared_reference(G, *prep, 0.3, ref)
    assert torch.equal(out, ref) and torch.equal(xf, xf_ref)


def test_bad_input_is_named():
    (G, *_), (U, Udt, Vd, Vt) = _prior(20, 12, 4, seed=7)
    out = torch.empty(20, 12)
    op = torch.ops.meshkern_C.project_prepared

    def call(**kw):
        args = dict(G=[G], U=[U], Udt=[Udt], Vd=[Vd], Vt=[Vt], alpha=[0.3], out=[out])
        args.update(kw)
        return op(args["G"], args["U"], args["Udt"], args["Vd"], args["Vt"], args["alpha"], args["out"])

    with pytest.raises(RuntimeError, match="one entry per matrix"):
        call(alpha=[0.3, 0.3])
    with pytest.raises(RuntimeError, match=r"G\[0\] must be a contiguous fp32"):
        call(G=[G.double()])
    with pytest.raises(RuntimeError, match=r"G\[0\] must be a contiguous fp32"):
        call(G=[G.t().contiguous().t()])
    with pytest.raises(RuntimeError, match=r"U\[0\]"):
        call(U=[U[:-1]])
    with pytest.raises(RuntimeError, match=r"Udt\[0\]"):
        call(Udt=[Udt.t().contiguous()])
    with pytest.raises(RuntimeError, match=r"Vd\[0\]"):
        call(Vd=[Vd[:, :3].contiguous()])
    with pytest.raises(RuntimeError, match=r"Vt\[0\]"):
        call(Vt=[Vd])
    with pytest.raises(RuntimeError, match=r"out\[0\] must be contiguous fp32 with G's shape"):
        call(out=[torch.empty(12, 20)])
    with pytest.raises(RuntimeError, match=r"out\[0\] must not be G\[0\]"):
        call(out=[G])
    with pytest.raises(RuntimeError, match=r"alpha\[0\] must lie in \[0, 1\]"):
        call(alpha=[1.5])
    assert sp.project_prepared([], [], [], [], [], [], []) == []  # (the op itself has no device to dispatch on)
