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
    there (calibrated bases come from orchestration.components.calibration; tests/test_codecs_pca.py)."""
    from meshkern import pca_nf
    from orchestration import codecs

    # "pca" is quant=nf: a width per coordinate, allocated within the default budget's bytes
    nf_bits = 8 * codecs.PCANFCodec().code_bytes(H)
    k = H - 8
    g = torch.Generator().manual_seed(3)
    U, _ = torch.linalg.qr(torch.randn(H, k, generator=g, dtype=torch.float64))
    sd = (torch.rand(k, generator=g) + 0.5).sort(descending=True).values
    codecs.PCA_BASES[KEY.boundary] = codecs.PCABasis(torch.randn(H, generator=g), U.float(), sd, torch.ones(k),
                                                     bits=pca_nf.allocate_bits(sd ** 2, nf_bits),
                                                     gbits=pca_nf.allocate_bits(torch.ones(k), nf_bits))
    yield
    codecs.PCA_BASES.pop(KEY.boundary, None)


def _codec(name, **kw):
    """make_codec; "subspace" also needs what the trainer gives it (the token embedding
    table and basis: attach; the step's input ids: bind_inputs): random ones here, the
    ids bound for every micro-batch up to KEY's (tests/test_codecs_subspace.py has the rest)."""
    codec = make_codec(name, **kw)
    if name == "subspace":
        g = torch.Generator().manual_seed(5)
        U, _ = torch.linalg.qr(torch.randn(H, codec.width(H), generator=g))
        codec.attach(torch.randn(50, H, generator=g), U)
        codec.bind_inputs([torch.randint(0, 50, (B, T), generator=g)] * (KEY.microbatch + 1))
    return codec


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
    codec = _codec(name, p=0.9)
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


@pytest.mark.parametrize("wire,elem", [("bfloat16", 2), ("float16", 2), ("float32", 4)])
def test_dense_in_a_wire_dtype_sends_that_dtype_and_casts_back(wire, elem):
    """dense:dtype=bfloat16 is what a bf16 GPU pipeline sends: each way, the values cast to
    the wire dtype (torch's cast is the reference), 2 bytes each, back in the activation dtype."""
    codec = make_codec(f"dense:dtype={wire}")
    h, g = _h(), _h(seed=1)
    h_hat, grad_h, w, wb = _roundtrip(codec, h, g)
    wd = getattr(torch, wire)
    assert w[0].dtype == wb[0].dtype == wd and h_hat.dtype == grad_h.dtype == torch.float32
    assert torch.equal(h_hat, h.to(wd).float()) and torch.equal(grad_h, g.to(wd).float())
    assert codec.wire_bytes((B, T, H), torch.float32, "fwd") == B * T * H * elem
    hl = h.clone().requires_grad_(True)
    out = apply_codec(codec, hl, KEY)
    out.backward(g)
    assert torch.equal(out.detach(), h.to(wd).float()) and torch.equal(hl.grad, g.to(wd).float())
    with pytest.raises(ValueError, match="dense: dtype must be one of float32, bfloat16, float16"):
        make_codec("dense:dtype=int8")


def test_pp_ratios_count_against_dense_fp32_and_bf16():
    from orchestration.codecs import dense_pp_bytes_per_token, pp_ratios

    # 2 stages, H=576: one boundary, 576 values each way: 4608 B in fp32, 2304 in bf16
    assert dense_pp_bytes_per_token(576, [2], "float32") == 4608
    assert dense_pp_bytes_per_token(576, [2, 2], "bfloat16") == 2304
    # replicas 1,2,2: 2/3 of a boundary per replica on average; 3 stages: two boundaries
    assert dense_pp_bytes_per_token(192, [1, 2, 2], "float32") == pytest.approx(8 * 192 * 2 / 3)
    assert dense_pp_bytes_per_token(192, [3], "bfloat16") == 2 * 2 * 192 * 2
    r = pp_ratios(4608 / 15, 576, [2])
    assert r["float32"] == pytest.approx(15) and r["bfloat16"] == pytest.approx(7.5)
    assert pp_ratios(0.0, 576, [1]) == {"float32": None, "bfloat16": None}


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
    codec = _codec(name, p=0.75)
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
        c = _codec(name, p=0.5)
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


# ---------------------------------------------------------------- known answers (issue #18)
# The round-trip tests above run the same encode/decode calls as apply_codec, so a change
# of the wire format applied to both sides (a nibble order, a scale convention, an index
# width) passes them. These pin the bytes themselves, derived by hand.

def test_int8_known_answer_bytes_and_values():
    """Per token: scale = absmax / 127, q = round(x / scale). Row 0: absmax 127 -> scale 1,
    q = [127, -63, 2, 0] (-63.4 -> -63, 1.6 -> 2, -0.3 -> 0). Row 1 all zero: scale 1
    (an all-zero group), q = 0. group_size=2 on row 0: groups [127, -63.4] (scale 1) and
    [1.6, -0.3] (scale 1.6/127, q = [127, round(-23.8125)] = [127, -24])."""
    x = torch.tensor([[[127.0, -63.4, 1.6, -0.3], [0.0, 0.0, 0.0, 0.0]]])
    wire, _ = make_codec("int8").encode_fwd(x, None)
    assert wire[0].dtype == torch.int8 and wire[0].tolist() == [[[127, -63, 2, 0], [0, 0, 0, 0]]]
    assert wire[1].dtype == torch.float32 and wire[1].tolist() == [[[1.0], [1.0]]]
    out = make_codec("int8").decode_fwd(wire, None, x.shape, x.dtype)
    assert out.tolist() == [[[127.0, -63.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0]]]

    codec = make_codec("int8", group_size=2)
    wire, _ = codec.encode_fwd(x[:, :1], None)
    s1 = torch.tensor(1.6) / 127  # fp32, as the codec computes it
    assert wire[0].tolist() == [[[127, -63, 127, -24]]]
    assert torch.equal(wire[1], torch.stack([torch.tensor(1.0), s1]).reshape(1, 1, 2))
    out = codec.decode_fwd(wire, None, (1, 1, 4), torch.float32)
    assert torch.equal(out, torch.stack([torch.tensor(127.0), torch.tensor(-63.0), 127 * s1, -24 * s1]).reshape(1, 1, 4))


def test_int4_known_answer_nibble_order():
    """int4: q in -7..7 travels as the nibble q + 8 (1..15), two per byte, the LOW nibble
    holding the even dim; an odd H is padded with the nibble 8 (q = 0).
    Row [1, -2, 0.4, 7]: absmax 7 -> scale 1, q = [1, -2, 0, 7], nibbles [9, 6, 8, 15],
    bytes [9 | 6 << 4, 8 | 15 << 4] = [0x69, 0xF8] = [105, 248].
    Odd H, row [7, -7, 3.4]: q = [7, -7, 3], nibbles [15, 1, 11, pad 8],
    bytes [15 | 1 << 4, 11 | 8 << 4] = [0x1F, 0x8B] = [31, 139]."""
    codec = make_codec("int4")
    x = torch.tensor([[[1.0, -2.0, 0.4, 7.0]]])
    wire, _ = codec.encode_fwd(x, None)
    assert wire[0].dtype == torch.uint8 and wire[0].tolist() == [[[0x69, 0xF8]]]
    assert wire[1].tolist() == [[[1.0]]]
    assert codec.decode_fwd(wire, None, x.shape, x.dtype).tolist() == [[[1.0, -2.0, 0.0, 7.0]]]
    # a peer's bytes decode by the same rule: 0x69 -> low 9 (dim 0, q=1), high 6 (dim 1, q=-2)
    peer = [torch.tensor([[[0x69, 0xF8]]], dtype=torch.uint8), torch.tensor([[[0.5]]])]
    assert codec.decode_fwd(peer, None, (1, 1, 4), torch.float32).tolist() == [[[0.5, -1.0, 0.0, 3.5]]]

    x3 = torch.tensor([[[7.0, -7.0, 3.4]]])
    wire, _ = codec.encode_fwd(x3, None)
    assert wire[0].tolist() == [[[0x1F, 0x8B]]] and wire[1].tolist() == [[[1.0]]]
    assert codec.decode_fwd(wire, None, x3.shape, x3.dtype).tolist() == [[[7.0, -7.0, 3.0]]]
    # backward: the gradient is quantized the same way
    wire_b = codec.encode_bwd(x, None, None)
    assert wire_b[0].tolist() == [[[0x69, 0xF8]]]


def _scale_tensors(wire):
    """Indices of the wire tensors that are quantization scales (float32 in these codecs)."""
    return [i for i, w in enumerate(wire) if w.dtype == torch.float32]


@pytest.mark.parametrize("name,kw", [("int8", {}), ("int4", {}), ("int8", {"group_size": 16}),
                                     ("int4", {"group_size": 16}), ("pca", {})])
@pytest.mark.parametrize("bad", [0.0, -1.0, -0.0])
def test_quantized_codecs_reject_non_positive_scales_both_directions(name, kw, bad):
    """A scale <= 0 from a peer (garbage or an attack) is a ValueError at the boundary,
    forward and backward, never a silently negated or zeroed activation."""
    codec = make_codec(name, **kw)
    h, g = _h(), _h(seed=1)
    wire, ctx = codec.encode_fwd(h, KEY)
    wire_b = codec.encode_bwd(g, KEY, wire)
    scales = _scale_tensors(wire)
    assert scales  # every one of these codecs sends scales
    for i in scales:
        bad_f = [w.clone() for w in wire]
        bad_f[i].view(-1)[-1] = bad
        with pytest.raises(ValueError, match="non-positive"):
            codec.decode_fwd(bad_f, KEY, h.shape, h.dtype)
        bad_b = [w.clone() for w in wire_b]
        bad_b[i].view(-1)[0] = bad
        with pytest.raises(ValueError, match="non-positive"):
            codec.decode_bwd(bad_b, KEY, ctx)


@pytest.mark.parametrize("Hk,dtype", [(2 ** 15, torch.int16), (2 ** 15 + 1, torch.int32), (40000, torch.int32)])
def test_topk_index_width_and_indices_above_int16(Hk, dtype):
    """topk indices travel as int16 up to H = 32768 (largest index 32767), int32 above:
    the largest entries placed at the highest dims come back at those dims, not wrapped
    to negative int16 values."""
    codec = make_codec("topk", k=3)
    h = torch.zeros(1, 2, Hk)
    h[0, 0, [0, Hk // 2, Hk - 1]] = torch.tensor([3.0, -4.0, 5.0])
    h[0, 1, [Hk - 3, Hk - 2, Hk - 1]] = torch.tensor([1.0, 2.0, -3.0])
    g = torch.arange(2 * Hk, dtype=torch.float32).reshape(1, 2, Hk)
    wire, ctx = codec.encode_fwd(h, KEY)
    assert wire[1].dtype == dtype
    assert wire[1].tolist() == [[[0, Hk // 2, Hk - 1], [Hk - 3, Hk - 2, Hk - 1]]]
    assert [(tuple(t.shape), t.dtype) for t in wire] == [(tuple(s), d) for s, d in codec.wire_specs(h.shape, h.dtype, "fwd")]
    assert codec.wire_bytes(h.shape, h.dtype, "fwd") == 2 * 3 * (4 + dtype.itemsize)
    assert torch.equal(codec.decode_fwd(wire, KEY, h.shape, h.dtype), h)
    grad_h = codec.decode_bwd(codec.encode_bwd(g, KEY, wire), KEY, ctx)
    assert torch.equal(grad_h, torch.where(h != 0, g, torch.zeros_like(g)))
