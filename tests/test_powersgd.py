"""PowerSGD pieces in one process: orthogonalization and compress rule vs torch's hook
helpers, the fused ops (opcheck, cpp vs reference), and the compressor on a 1-rank
group (bytes, state, dtypes, bad input). Multi-rank math: tests/test_compress_dist.py."""

import math

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize, _should_compress

import dp_helpers as H
from meshkern import _backend
from meshkern.compress import PowerSGD, orthogonalize, should_compress
from meshkern.compress.powersgd_ops import (ef_project_reference, powersgd_ef_project, powersgd_reconstruct,
                                            reconstruct_reference)

HAS_CPP = _backend.extension("dp") is not None and hasattr(torch.ops.meshkern_C, "powersgd_ef_project")
BACKENDS = ["reference"] + (["cpp"] if HAS_CPP else [])


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    with H.world1_group(str(tmp_path_factory.mktemp("pg"))):
        yield


@pytest.mark.parametrize("r", [1, 2, 3, 8])
def test_auto_orthogonalization_matches_torch_hook(r):
    x = torch.randn(3, 40, r, generator=torch.Generator().manual_seed(r))
    ours, theirs = x.clone(), x.clone()
    orthogonalize(ours)
    _orthogonalize(theirs, 0)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["gram_schmidt", "qr", "cholesky_qr2"])
def test_orthogonalization_methods_span_the_same_space(method):
    x = torch.randn(2, 50, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    q = orthogonalize(x.clone(), method)
    eye = torch.eye(6, dtype=torch.float64).expand(2, 6, 6)
    torch.testing.assert_close(q.transpose(1, 2) @ q, eye, rtol=0, atol=1e-10)
    ref = orthogonalize(x.clone(), "qr")
    torch.testing.assert_close(q @ q.transpose(1, 2), ref @ ref.transpose(1, 2), rtol=0, atol=1e-10)


def _ill_conditioned(cond: float, dtype) -> torch.Tensor:
    """[1, 40, 6] with singular values 1 .. 1/cond (exact orthonormal factors, fp64)."""
    g = torch.Generator().manual_seed(5)
    u = torch.linalg.qr(torch.randn(40, 6, generator=g, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(6, 6, generator=g, dtype=torch.float64)).Q
    s = torch.logspace(0, -math.log10(cond), 6, dtype=torch.float64)
    return ((u * s) @ v.T).to(dtype)[None]


@pytest.mark.parametrize("case", ["duplicate_column", "cond1e6_fp32", "cond1e12_fp64", "zero_column"])
def test_cholesky_qr2_is_orthonormal_on_rank_deficient_and_ill_conditioned_input(case):
    """The duplicate-column input makes fp32 cholesky_ex "succeed" on a singular Gram matrix
    (info 0, pivots ~1e-3 and ~6e-8): CholeskyQR2 must detect that and still return
    orthonormal columns (QR's fallback), as for inputs too ill-conditioned for it. The
    spanned space still contains every column of the input."""
    if case == "duplicate_column":
        x = torch.zeros(1, 10, 3)
        x[0, :, 0] = 1.0
        x[0, :, 1] = 1.0  # duplicate column: Gram matrix singular
        x[0, 0, 2] = 1.0
    elif case == "zero_column":
        x = torch.randn(2, 12, 4, generator=torch.Generator().manual_seed(2))
        x[1, :, 2] = 0.0  # only the second batch entry is rank-deficient
    elif case == "cond1e6_fp32":
        x = _ill_conditioned(1e6, torch.float32)
    else:
        x = _ill_conditioned(1e12, torch.float64)
    q = orthogonalize(x.clone(), "cholesky_qr2")
    r = x.shape[2]
    eye = torch.eye(r, dtype=x.dtype).expand(x.shape[0], r, r)
    tol = 100 * r * torch.finfo(x.dtype).eps
    assert (q.transpose(1, 2) @ q - eye).abs().max() <= tol
    resid = x - q @ (q.transpose(1, 2) @ x)  # every input column lies in span(q)
    assert resid.abs().max() <= 1e3 * torch.finfo(x.dtype).eps * x.abs().max()


def test_cholesky_qr2_keeps_the_cholesky_result_on_well_conditioned_input():
    """Well-conditioned entries are exactly two Cholesky-QR rounds (no silent QR): the same
    bits as the rounds written out here."""
    x = torch.randn(3, 30, 5, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    want = x
    for _ in range(2):
        L = torch.linalg.cholesky(want.transpose(1, 2) @ want)
        want = torch.linalg.solve_triangular(L.transpose(1, 2), want, upper=True, left=False)
    assert torch.equal(orthogonalize(x.clone(), "cholesky_qr2"), want)


def test_compress_rule_matches_torch_hook():
    for n in (1, 4, 16, 64, 300):
        for m in (1, 4, 16, 64, 300):
            for r in (1, 4, 8):
                for rate in (0.5, 2.0):
                    rr = min(n, m, r)
                    assert should_compress(n, m, rr, rate) == _should_compress(n, m, rr, rate)[0]


def test_orthogonalize_rejects_bad_shapes():
    with pytest.raises(ValueError, match="r <= n"):
        orthogonalize(torch.zeros(1, 2, 3))
    with pytest.raises(ValueError, match="unknown orthogonalization"):
        orthogonalize(torch.zeros(1, 3, 2), "svd")


# ---- fused ops -----------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,r", [(torch.float32, 8), (torch.float32, 32), (torch.float32, 5),
                                     (torch.float64, 4), (torch.bfloat16, 4)])
def test_ef_project_matches_reference(backend, dtype, r):
    g = torch.Generator().manual_seed(r)
    B, n, m = 3, 37, 50  # odd sizes: row blocks straddle batch entries
    grad = torch.randn(B, n, m, generator=g).to(dtype)
    err = torch.randn(B, n, m, generator=g).to(dtype)
    q = torch.randn(B, m, r, generator=g).to(dtype)
    e1, e2 = err.clone(), err.clone()
    p = powersgd_ef_project(grad, e1, q, backend=backend)
    ref = ef_project_reference(grad.double(), e2.double(), q.double())
    assert torch.equal(e1, (err.double() + grad.double()).to(dtype))  # err += grad, exactly rounded
    tol = 1e-5 if dtype != torch.bfloat16 else 3e-2
    torch.testing.assert_close(p.double(), ref, rtol=tol, atol=tol * float(ref.abs().max()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_ops_pass_opcheck(backend):
    g = torch.Generator().manual_seed(0)
    grad, err, q = torch.randn(2, 12, 9, generator=g), torch.randn(2, 12, 9, generator=g), torch.randn(2, 9, 4, generator=g)
    torch.library.opcheck(powersgd_ef_project, (grad, err, q), {"backend": backend})
    p = torch.randn(2, 12, 4, generator=g)
    torch.library.opcheck(powersgd_reconstruct, (p, q, err), {"backend": backend})


def test_reconstruct_returns_product_and_updates_error():
    g = torch.Generator().manual_seed(3)
    p, q, err = torch.randn(2, 6, 3, generator=g), torch.randn(2, 5, 3, generator=g), torch.randn(2, 6, 5, generator=g)
    e = err.clone()
    out = powersgd_reconstruct(p, q, e)
    torch.testing.assert_close(out, p @ q.transpose(1, 2))
    torch.testing.assert_close(e, err - out)
    assert torch.equal(reconstruct_reference(p, q, err.clone()), out)


def test_ops_reject_bad_input():
    with pytest.raises(ValueError, match="3-D"):
        powersgd_ef_project(torch.zeros(3, 4), torch.zeros(3, 4), torch.zeros(4, 2))
    with pytest.raises(ValueError, match="do not fit"):
        powersgd_ef_project(torch.zeros(1, 3, 4), torch.zeros(1, 3, 4), torch.zeros(1, 5, 2))
    with pytest.raises(TypeError, match="dtypes differ"):
        powersgd_reconstruct(torch.zeros(1, 3, 2), torch.zeros(1, 4, 2, dtype=torch.float64), torch.zeros(1, 3, 4))
    with pytest.raises(RuntimeError, match="no cuda kernel|cannot run"):
        powersgd_ef_project(torch.zeros(1, 3, 4), torch.zeros(1, 3, 4), torch.zeros(1, 4, 2), backend="cuda")


# ---- the compressor on one rank -----------------------------------------------------------------
def test_single_rank_bytes_state_and_dtypes(world1):
    ts = [torch.randn(64, 48), torch.randn(64, 48), torch.randn(48), torch.randn(8, 3, 4, dtype=torch.bfloat16),
          torch.randn(96, 80, dtype=torch.bfloat16)]
    c = PowerSGD(4, seed=1)
    out = c.all_reduce_mean(ts, None, key="a")
    assert [o.dtype for o in out] == [t.dtype for t in ts] and [o.shape for o in out] == [t.shape for t in ts]
    assert torch.equal(out[2], ts[2])  # 1-D: sent uncompressed, exact mean of one rank
    # bf16 matrices are compressed in fp32; the small bf16 tensor travels as bf16
    assert c.payload_bytes == (2 * (64 + 48) * 4 + (96 + 80) * 4) * 4 + 48 * 4 + 96 * 2
    assert c.payload_bytes_for([t.shape for t in ts[:3]]) == 2 * (64 + 48) * 4 * 4 + 48 * 4
    assert c.bytes_sent == c.bytes_received == 0  # one rank: nothing crosses a link
    # state round-trips and reproduces the next call exactly
    sd = c.state_dict()
    c2 = PowerSGD(4, seed=1)
    c2.load_state_dict(sd)
    a, b = c.all_reduce_mean(ts, None, key="a"), c2.all_reduce_mean(ts, None, key="a")
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    with pytest.raises(ValueError, match="different key"):
        c.all_reduce_mean(ts[:1], None, key="a")


def test_initial_q_is_shared_by_seed_and_key():
    a, b = PowerSGD(4, seed=5), PowerSGD(4, seed=5)
    assert torch.equal(a.initial_q("k", 10, 8, 4, 2), b.initial_q("k", 10, 8, 4, 2))
    assert not torch.equal(a.initial_q("k", 10, 8, 4, 2), a.initial_q("j", 10, 8, 4, 2))
    assert not torch.equal(a.initial_q("k", 10, 8, 4, 2), PowerSGD(4, seed=6).initial_q("k", 10, 8, 4, 2))


def test_compressor_rejects_bad_arguments(world1):
    with pytest.raises(ValueError, match="rank"):
        PowerSGD(0)
    with pytest.raises(ValueError, match="orthogonalization"):
        PowerSGD(2, orthogonalization="svd")
    with pytest.raises(TypeError, match="floating-point"):
        PowerSGD(2).all_reduce_mean([torch.zeros(4, 4, dtype=torch.long)], None)
    with pytest.raises(TypeError, match="torch.Tensor"):
        PowerSGD(2).all_reduce_mean([[1.0, 2.0]], None)
    with pytest.raises(ValueError, match="unknown backend 'garbage'"):
        PowerSGD(2, backend="garbage")
    with pytest.raises(TypeError, match="compute_dtype"):
        PowerSGD(2, compute_dtype=torch.int32)
    with pytest.raises(TypeError, match="got one tensor"):
        PowerSGD(2).all_reduce_mean(torch.zeros(4, 4), None)
    with pytest.raises(ValueError, match="several devices"):
        PowerSGD(2).all_reduce_mean([torch.zeros(4, 4), torch.zeros(4, 4, device="meta")], None)


def test_garbage_from_a_peer_does_not_poison_error_feedback(world1, monkeypatch):
    g = torch.Generator().manual_seed(4)
    ts = [torch.randn(32, 24, generator=g)]
    c = PowerSGD(2, seed=1)
    c.all_reduce_mean(ts, None)
    err_before = c._state["default"]["32x24x2"]["err"].clone()

    real = PowerSGD._all_reduce

    def corrupt_p(self, flat, group, what):  # a peer's NaN arrives in the sum of P
        out = real(self, flat, group, what)
        if "of P" in what:
            out[0] = float("nan")
        return out

    monkeypatch.setattr(PowerSGD, "_all_reduce", corrupt_p)
    out = c.all_reduce_mean(ts, None)
    assert not torch.isfinite(out[0]).all()
    st = c._state["default"]["32x24x2"]
    assert "q" not in st and torch.equal(st["err"], err_before + ts[0])  # all of M carried over
    monkeypatch.setattr(PowerSGD, "_all_reduce", real)
    out = c.all_reduce_mean(ts, None)
    assert torch.isfinite(out[0]).all() and torch.isfinite(c._state["default"]["32x24x2"]["q"]).all()
