"""meshkern.subspace: fused encode (h - E[ids]) @ U and decode E[ids] + c @ U^T on every
backend that can run here, against an fp64 evaluation of the same formula.

Tolerances: the kernels accumulate in fp32 in an order of their own (BLAS blocking, Triton
tiles), so they are held to the standard forward error bound of an fp32 dot product,
|fl(x . u) - x . u| <= n eps sum_j |x_j u_j| (n terms, eps = 2**-24 unit roundoff), plus
one rounding of the subtraction / addition of the base: per output element
(n + 2) eps (|h| + |E[ids]|) @ |U| for encode (n = H) and (n + 2) eps (|c| @ |U|^T + |E[ids]|)
for decode (n = k). fp16/bf16 outputs add one rounding to their own precision."""
import pytest
import torch

from meshkern import subspace as S

from backend_params import op_backends


BACKENDS = op_backends("subspace")
EPS = {torch.float32: 2.0**-24, torch.float64: 2.0**-53, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _problem(N=37, H=48, k=5, V=29, dtype=torch.float32, seed=0, lead=None):
    g = torch.Generator().manual_seed(seed)
    shape = (N,) if lead is None else lead
    h = torch.randn(*shape, H, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, shape, generator=g)
    E = torch.randn(V, H, generator=g, dtype=torch.float64)
    U = torch.linalg.qr(torch.randn(H, k, generator=g, dtype=torch.float64))[0]
    off = torch.randn(H, generator=g, dtype=torch.float64)
    return h.to(dtype), ids, E.to(dtype), U.to(dtype), off.to(dtype)


def _acc_eps(backend, dtype):
    # The Triton kernel accumulates in fp32 for every dtype (fp64 included).
    if dtype == torch.float64 and backend != "triton":
        return EPS[torch.float64]
    return EPS[torch.float32]


def _base64(kind, ids, E, off, shape):
    if kind == "ids":
        return E.double()[ids]
    if kind == "offset":
        return off.double().expand(*shape)
    return torch.zeros(*shape, dtype=torch.float64)


def _args(kind, ids, E, off):
    if kind == "ids":
        return dict(ids=ids, E=E, offset=None)
    if kind == "offset":
        return dict(ids=None, E=None, offset=off)
    return dict(ids=None, E=None, offset=None)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["ids", "offset", "none"])
@pytest.mark.parametrize("H,k", [(48, 5), (200, 24), (576, 36)])
def test_encode_decode_match_fp64_formula(backend, kind, H, k):
    h, ids, E, U, off = _problem(N=70, H=H, k=k)
    a = _args(kind, ids, E, off)
    base = _base64(kind, ids, E, off, h.shape)
    eps = _acc_eps(backend, h.dtype)

    c = S.encode(h, a["ids"], a["E"], U, offset=a["offset"], backend=backend)
    x = h.double() - base
    want = x @ U.double()
    bound = (H + 2) * eps * ((h.double().abs() + base.abs()) @ U.double().abs()) + 1e-30
    assert c.dtype == h.dtype and c.shape == (70, k)
    assert ((c.double() - want).abs() <= bound).all()

    out = S.decode(c, a["ids"], a["E"], U, offset=a["offset"], backend=backend)
    want_h = base + c.double() @ U.double().T
    bound_h = (k + 2) * eps * (c.double().abs() @ U.double().abs().T + base.abs()) + 1e-30
    assert out.dtype == c.dtype and out.shape == h.shape
    assert ((out.double() - want_h).abs() <= bound_h).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("H,k", [(48, 5), (576, 36)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_encode_with_projected_table(backend, H, k, dtype):
    # c = h U - (E U)[ids]: the same value as (h - E[ids]) U; h U and each table entry
    # carry an H-term dot product's rounding each, the table one rounding to dtype.
    h, ids, E, U, _ = _problem(N=70, H=H, k=k, dtype=dtype)
    table = S.projected_table(E, U)
    assert table.shape == (E.shape[0], k) and table.dtype == dtype
    c = S.encode(h, ids, None, U, table=table, backend=backend)
    base = E.double()[ids]
    want = (h.double() - base) @ U.double()
    eps_acc = _acc_eps(backend, dtype)
    eps_out = EPS[dtype] * (2 if backend == "triton" and dtype == torch.bfloat16 else 1)
    mag = (h.double().abs() + base.abs()) @ U.double().abs()
    # h U and the table entry each carry an H-term fp32 dot product's error; the table was
    # rounded to dtype once; the result once more
    bound = 2 * (H + 2) * eps_acc * mag + eps_out * (mag + want.abs()) + 1e-30
    assert c.dtype == dtype and ((c.double() - want).abs() <= bound).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_other_dtypes(backend, dtype):
    h, ids, E, U, off = _problem(N=33, H=64, k=8, dtype=dtype)
    base = E.double()[ids]
    eps_acc, eps_out = _acc_eps(backend, dtype), EPS[dtype]
    if backend == "triton" and dtype in (torch.bfloat16, torch.float16):
        eps_out *= 2  # the interpreter (CPU tests) casts fp32 -> 16 bits by truncation: one ulp, not half
    c = S.encode(h, ids, E, U, backend=backend)
    mag = (h.double().abs() + base.abs()) @ U.double().abs()
    want = (h.double() - base) @ U.double()
    assert c.dtype == dtype
    # one rounding of the fp32 (fp64) result to the output dtype, plus the accumulation bound
    assert ((c.double() - want).abs() <= eps_out * want.abs() + 66 * eps_acc * mag + 1e-30).all()
    out = S.decode(c, ids, E, U, backend=backend)
    want_h = base + c.double() @ U.double().T
    mag_h = c.double().abs() @ U.double().abs().T + base.abs()
    assert ((out.double() - want_h).abs() <= eps_out * want_h.abs() + 10 * eps_acc * mag_h + 1e-30).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_leading_dims_and_constrained_round_trip(backend):
    # h = E[ids] + z U^T (the residual stream of a constrained model): decode(encode(h)) = h.
    B, T, H, k, V = 3, 11, 96, 12, 50
    _, ids, E, U, _ = _problem(H=H, k=k, V=V, lead=(B, T))
    z = torch.randn(B, T, k, generator=torch.Generator().manual_seed(1))
    h = E[ids] + z @ U.T
    c = S.encode(h, ids, E, U, backend=backend)
    assert c.shape == (B, T, k)
    torch.testing.assert_close(c, z, atol=1e-5, rtol=0)
    torch.testing.assert_close(S.decode(c, ids, E, U, backend=backend), h, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_input(backend):
    h, ids, E, U, _ = _problem(N=4)
    c = S.encode(h[:0], ids[:0], E, U, backend=backend)
    assert c.shape == (0, U.shape[1])
    assert S.decode(c, ids[:0], E, U, backend=backend).shape == (0, h.shape[1])


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.id != "triton"])  # Triton accumulates in fp32
def test_gradients(backend):
    h, ids, E, U, off = _problem(N=6, H=10, k=3, V=5, dtype=torch.float64)
    for t in (h, E, U, off):
        t.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda h, E, U: S.encode(h, ids, E, U, backend=backend), (h, E, U))
    assert torch.autograd.gradcheck(lambda h, o, U: S.encode(h, None, None, U, offset=o, backend=backend),
                                    (h, off, U))
    table = S.projected_table(E.detach(), U.detach()).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda h, t, U: S.encode(h, ids, None, U, table=t, backend=backend),
                                    (h, table, U))
    c = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda c, E, U: S.decode(c, ids, E, U, backend=backend), (c, E, U))
    assert torch.autograd.gradcheck(lambda c, o, U: S.decode(c, None, None, U, offset=o, backend=backend),
                                    (c, off, U))


def test_backward_of_h_is_the_plain_matmul():
    # The boundary's backward: grad_h = grad_c U^T (lift), grad_c = grad_h U (project).
    h, ids, E, U, _ = _problem(N=9, H=32, k=4)
    h.requires_grad_(True)
    gc = torch.randn(9, 4)
    S.encode(h, ids, E, U).backward(gc)
    torch.testing.assert_close(h.grad, S.lift(gc, U))
    c = torch.randn(9, 4, requires_grad=True)
    gh = torch.randn(9, 32)
    S.decode(c, ids, E, U).backward(gh)
    torch.testing.assert_close(c.grad, S.project(gh, U))


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    h, ids, E, U, off = _problem(N=20, H=32, k=4)
    c = torch.randn(20, 4)
    for op, x in ((torch.ops.meshkern.subspace_encode.default, h), (torch.ops.meshkern.subspace_decode.default, c)):
        enc = op is torch.ops.meshkern.subspace_encode.default
        pad = (None,) if enc else ()  # encode's table argument
        torch.library.opcheck(op, (x, ids, E, None, *pad, U, backend))
        torch.library.opcheck(op, (x, None, None, off, *pad, U, backend))
        torch.library.opcheck(op, (x.requires_grad_(), ids, E.requires_grad_(), None, *pad, U, backend))
        E = E.detach()
        if enc:
            table = S.projected_table(E, U)
            torch.library.opcheck(op, (x, ids, None, None, table, U, backend))
            torch.library.opcheck(op, (x, ids, None, None, table.requires_grad_(), U, backend))


def test_bad_inputs():
    h, ids, E, U, off = _problem(N=8, H=16, k=4, V=10)
    with pytest.raises(TypeError, match="ids must be an int64"):
        S.encode(h, ids.int(), E, U)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, V=10\)"):
        S.encode(h, torch.full((8,), 10), E, U)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, V=10\) \(rows of E / the table\), got id -1"):
        S.decode(torch.zeros(8, 4), torch.full((8,), -1), E, U)
    with pytest.raises(ValueError, match="h must be"):
        S.encode(h[:, :15], ids, E, U)
    with pytest.raises(ValueError, match="c must be"):
        S.decode(torch.zeros(8, 5), ids, E, U)
    with pytest.raises(ValueError, match="ids must be h's leading shape"):
        S.encode(h, ids[:7], E, U)
    with pytest.raises(ValueError, match="E must be"):
        S.encode(h, ids, E[:, :15], U)
    with pytest.raises(TypeError, match="U must have h's dtype"):
        S.encode(h, ids, E, U.double())
    with pytest.raises(TypeError, match="E must have"):
        S.encode(h, ids, E.double(), U)
    with pytest.raises(ValueError, match="give ids and E together"):
        S.encode(h, ids, None, U)
    with pytest.raises(ValueError, match="not both"):
        S.encode(h, ids, E, U, offset=off)
    with pytest.raises(ValueError, match="offset must be"):
        S.encode(h, None, None, U, offset=off[:3])
    with pytest.raises(ValueError, match="U must be"):
        S.encode(h, ids, E, U[:, 0])
    with pytest.raises(TypeError, match="h must have dtype"):
        S.encode(h.long(), ids, E, U)
    with pytest.raises(RuntimeError, match="cannot run"):
        S.encode(h, ids, E, U, backend="cuda")
    table = S.projected_table(E, U)
    with pytest.raises(ValueError, match="table= replaces E"):
        S.encode(h, ids, E, U, table=table)
    with pytest.raises(ValueError, match="table must be"):
        S.encode(h, ids, None, U, table=table[:, :3])
    with pytest.raises(ValueError, match=r"\[0, V=10\) \(rows of E / the table\)"):
        S.encode(h, torch.full((8,), 10), None, U, table=table)
    with pytest.raises(ValueError, match="ids must be h's leading shape"):
        S.encode(h, ids[:7], None, U, table=table)
    with pytest.raises(ValueError, match="unknown backend"):
        S.encode(h, ids, E, U, backend="nope")
