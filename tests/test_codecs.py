"""Boundary codecs: exact wire bytes, the promised backward, the expected round-trip error."""
import math

import pytest
import torch

from meshkern import MaskKey, kept_dims, pack, unpack
from orchestration.codecs import CODECS, BoundaryCodec, apply_codec, make_codec

KEY = MaskKey(seed=7, boundary=1, step=3, microbatch=2)
B, T, H = 2, 6, 64


@pytest.fixture(autouse=True)
def _pca_basis():
    """The generic tests run every codec at boundary KEY.boundary, H: give "pca" a basis
    there (calibrated bases come from orchestration.calibration; tests/test_codecs_pca.py)."""
    from orchestration import codecs

    k = codecs.pca_width(H)
    g = torch.Generator().manual_seed(3)
    U, _ = torch.linalg.qr(torch.randn(H, k, generator=g, dtype=torch.float64))
    codecs.PCA_BASES[KEY.boundary] = codecs.PCABasis(torch.randn(H, generator=g), U.float(),
                                                     torch.rand(k, generator=g) + 0.5, torch.ones(k))
    yield
    codecs.PCA_BASES.pop(KEY.boundary, None)


def _h(dtype=torch.float32, seed=0, shape=(B, T, H)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def _roundtrip(codec: BoundaryCodec, h, grad, key=KEY):
    """The four steps as two processes would run them; returns (h_hat, grad_h, wires)."""
    wire, ctx = codec.encode_fwd(h, key)
    h_hat = codec.decode_fwd([w.clone() for w in wire], key, tuple(h.shape), h.dtype)
    wire_b = codec.encode_bwd(grad, key, wire)
    grad_h = codec.decode_bwd([w.clone() for w in wire_b], key, ctx)
    return h_hat, grad_h, wire, wire_b


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wire_matches_specs_and_bytes_are_exact(name, dtype):
    codec = make_codec(name, p=0.9)
    h, g = _h(dtype), _h(dtype, seed=1)
    h_hat, grad_h, wire, wire_b = _roundtrip(codec, h, g)
    assert h_hat.shape == h.shape and h_hat.dtype == dtype
    assert grad_h.shape == h.shape and grad_h.dtype == dtype
    for direction, w in (("fwd", wire), ("bwd", wire_b)):
        specs = codec.wire_specs(h.shape, dtype, direction)
        assert [(tuple(t.shape), t.dtype) for t in w] == [(tuple(s), d) for s, d in specs]
        assert codec.wire_bytes(h.shape, dtype, direction) == sum(t.numel() * t.element_size() for t in w)


@pytest.mark.parametrize("dtype,elem", [(torch.float32, 4), (torch.bfloat16, 2), (torch.float16, 2)])
@pytest.mark.parametrize("p", [0.95, 0.5])
def test_mask_wire_bytes_are_T_K_elem_per_direction(dtype, elem, p):
    codec = make_codec("mask", p=p)
    Hb = 2048
    K = kept_dims(Hb, p)
    for d in ("fwd", "bwd"):
        assert codec.wire_bytes((4, 128, Hb), dtype, d) == 4 * 128 * K * elem
    assert make_codec("dense").wire_bytes((4, 128, Hb), dtype, "fwd") == 4 * 128 * Hb * elem
    assert make_codec("dense").wire_bytes((4, 128, Hb), dtype, "fwd") // codec.wire_bytes((4, 128, Hb), dtype, "fwd") \
        == Hb // K


@pytest.mark.parametrize("rescale", [False, True])
def test_mask_roundtrip_and_backward_equal_autograd_through_pack_unpack(rescale):
    codec = make_codec("mask", p=0.75, rescale=rescale)
    h = _h().requires_grad_()
    g = _h(seed=1)
    want = unpack(pack(h, KEY, 0.75), KEY, H, 0.75, rescale=rescale)
    want.backward(g)
    h_hat, grad_h, wire, _ = _roundtrip(codec, h.detach(), g)
    assert torch.equal(h_hat, want.detach())
    assert torch.equal(grad_h, h.grad)
    assert torch.equal(wire[0], pack(h.detach(), KEY, 0.75))  # only the kept values travel
    # the in-process autograd wrapper gives the same
    h2 = h.detach().clone().requires_grad_()
    out = apply_codec(codec, h2, KEY)
    out.backward(g)
    assert torch.equal(out.detach(), want.detach()) and torch.equal(h2.grad, h.grad)
    # a different micro-batch uses a different mask
    other = MaskKey(seed=7, boundary=1, step=3, microbatch=3)
    assert not torch.equal(codec.decode_fwd(codec.encode_fwd(h.detach(), other)[0], other, h.shape, h.dtype),
                           h_hat)


def test_mask_rescale_is_unbiased_on_average():
    codec = make_codec("mask", p=0.75, rescale=True)
    h = torch.ones(1, 256, 64)
    est = torch.stack([apply_codec(codec, h, MaskKey(seed=s, boundary=0, step=0, microbatch=0)) for s in range(8)])
    assert abs(est.mean().item() - 1.0) < 0.02  # 131k Bernoulli(1/4)*4 draws: std ~0.005


def test_dense_is_identity():
    h, g = _h(), _h(seed=1)
    h_hat, grad_h, _, _ = _roundtrip(make_codec("dense"), h, g)
    assert torch.equal(h_hat, h) and torch.equal(grad_h, g)


def test_topk_keeps_largest_and_backward_is_autograd_with_fixed_indices():
    codec = make_codec("topk", p=0.75)
    K = kept_dims(H, 0.75)
    h, g = _h(), _h(seed=1)
    h_hat, grad_h, wire, wire_b = _roundtrip(codec, h, g)
    idx = h.abs().topk(K, dim=-1).indices
    keep = torch.zeros_like(h, dtype=torch.bool).scatter_(-1, idx, True)
    assert torch.equal(h_hat, torch.where(keep, h, torch.zeros_like(h)))
    assert torch.equal(grad_h, torch.where(keep, g, torch.zeros_like(g)))
    assert wire[1].dtype == torch.int16 and len(wire_b) == 1  # indices only travel forward
    # error: exactly the energy of the dropped (smallest) entries
    dropped = h.abs().sort(dim=-1).values[..., : H - K]
    torch.testing.assert_close((h - h_hat).square().sum(), dropped.square().sum())
    assert codec.wire_bytes(h.shape, h.dtype, "fwd") == B * T * K * (4 + 2)
    assert make_codec("topk", k=5).wire_bytes(h.shape, h.dtype, "bwd") == B * T * 5 * 4


@pytest.mark.parametrize("name,qmax", [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize("group_size", [None, 16])
@pytest.mark.parametrize("Hq", [64, 63])
def test_quantization_error_is_within_half_a_step(name, qmax, group_size, Hq):
    if group_size and Hq % group_size:
        with pytest.raises(ValueError, match="does not divide"):
            make_codec(name, group_size=group_size).wire_specs((T, Hq), torch.float32, "fwd")
        return
    codec = make_codec(name, group_size=group_size)
    h, g = _h(shape=(B, T, Hq)), _h(seed=1, shape=(B, T, Hq))
    h_hat, grad_h, _, _ = _roundtrip(codec, h, g)
    G = Hq // (group_size or Hq)
    for x, xh in ((h, h_hat), (g, grad_h)):  # straight-through, then the gradient quantized alike
        xg, eg = x.reshape(B, T, G, -1), (x - xh).reshape(B, T, G, -1)
        step = xg.abs().amax(-1, keepdim=True) / qmax
        assert (eg.abs() <= step / 2 + 1e-6).all()
        torch.testing.assert_close(xh.reshape(B, T, G, -1).abs().amax(-1), xg.abs().amax(-1))  # absmax kept
    bits = 8 if name == "int8" else 4
    assert codec.wire_bytes((B, T, Hq), torch.float32, "fwd") == B * T * math.ceil(Hq * bits / 8) + B * T * G * 4


def test_quantization_handles_zeros_and_rejects_garbage_scales():
    codec = make_codec("int4")
    h = torch.zeros(1, 3, 8)
    wire, ctx = codec.encode_fwd(h, None)
    assert torch.equal(codec.decode_fwd(wire, None, h.shape, h.dtype), h)
    wire[1][0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        codec.decode_fwd(wire, None, h.shape, h.dtype)


def test_bottleneck_is_a_fixed_orthogonal_projection():
    codec = make_codec("bottleneck", p=0.75)
    r = kept_dims(H, 0.75)
    h, g = _h(torch.float64), _h(torch.float64, seed=1)
    h_hat, grad_h, wire, _ = _roundtrip(codec, h, g)
    P = codec.basis(KEY, H, torch.float64, "cpu")
    torch.testing.assert_close(P.T @ P, torch.eye(r, dtype=torch.float64))
    torch.testing.assert_close(h_hat, h @ P @ P.T)
    torch.testing.assert_close(grad_h, g @ P @ P.T)  # autograd of h -> h P P^T
    # projection: idempotent, residual orthogonal to the kept part, energy fraction ~ r/H
    torch.testing.assert_close(apply_codec(codec, h_hat, KEY), h_hat)
    assert abs((h_hat * (h - h_hat)).sum().item()) < 1e-9
    frac = h_hat.square().sum() / h.square().sum()
    assert abs(frac.item() - r / H) < 0.1
    # same subspace at every step and micro-batch; another boundary gets another one
    same = MaskKey(seed=7, boundary=1, step=99, microbatch=0)
    assert torch.equal(codec.basis(same, H, torch.float64, "cpu"), P)
    assert not torch.equal(codec.basis(MaskKey(seed=7, boundary=2, step=3, microbatch=2), H, torch.float64, "cpu"), P)
    assert wire[0].shape == (B, T, r)


@pytest.mark.parametrize("name", CODECS)
def test_apply_codec_backward_matches_the_two_sided_steps(name):
    codec = make_codec(name, p=0.75)
    h = _h().requires_grad_()
    g = _h(seed=1)
    out = apply_codec(codec, h, KEY)
    out.backward(g)
    h_hat, grad_h, _, _ = _roundtrip(codec, h.detach(), g)
    assert torch.equal(out.detach(), h_hat) and torch.equal(h.grad, grad_h)


def test_bad_input_and_peer_garbage_raise():
    with pytest.raises(ValueError, match="unknown boundary codec"):
        make_codec("zip")
    with pytest.raises(TypeError, match="does not take"):
        make_codec("dense", group_size=4)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        make_codec("mask", p=1.0)
    with pytest.raises(ValueError, match="k must be >= 1"):
        make_codec("topk", k=0)
    with pytest.raises(ValueError, match="exceeds the hidden size"):
        make_codec("bottleneck", rank=H + 1).wire_specs((T, H), torch.float32, "fwd")
    codec = make_codec("mask", p=0.95)
    h = _h()
    wire, _ = codec.encode_fwd(h, KEY)
    with pytest.raises(ValueError, match="wire tensor 0"):
        codec.decode_fwd([wire[0][..., :-1]], KEY, h.shape, h.dtype)
    with pytest.raises(ValueError, match="wire tensors"):
        codec.decode_fwd([], KEY, h.shape, h.dtype)
    for name in CODECS:  # NaN from a peer stops at the boundary, both directions
        c = make_codec(name, p=0.5)
        wire, ctx = c.encode_fwd(h, KEY)
        bad = [w.clone() for w in wire]
        bad[0].view(-1)[0] = float("nan") if bad[0].dtype.is_floating_point else bad[0].view(-1)[0]
        if bad[0].dtype.is_floating_point:
            with pytest.raises(ValueError, match="non-finite"):
                c.decode_fwd(bad, KEY, h.shape, h.dtype)
        g = h.clone()
        g[0, 0, :] = float("inf")  # a whole token: whatever dims a codec keeps
        with pytest.raises(ValueError, match="non-finite"):
            c.decode_bwd(c.encode_bwd(g, KEY, wire), KEY, ctx)
    topk = make_codec("topk", p=0.5)
    wire, _ = topk.encode_fwd(h, KEY)
    wire[1][0, 0, 0] = H + 5
    with pytest.raises(ValueError, match="indices outside"):
        topk.decode_fwd(wire, KEY, h.shape, h.dtype)
    with pytest.raises(ValueError, match="direction"):
        codec.wire_bytes(h.shape, h.dtype, "up")
    with pytest.raises(TypeError, match="floating"):
        codec.wire_bytes(h.shape, torch.int64, "fwd")
