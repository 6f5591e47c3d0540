"""The calibrated PCA boundary codec (codecs.PCACodec) against a pure-torch reference."""
import math

import pytest
import torch

from meshkern.mask import MaskKey
from orchestration.codecs import (CODECS, NonFiniteWire, PCABasis, PCACodec, PCANFCodec, apply_codec, codec_class,
                                  make_codec, pca_width)


def _basis(H=24, k=6, seed=0, gsd=True):
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(H, k, generator=g, dtype=torch.float64))
    return PCABasis(torch.randn(H, generator=g) * 3, U.float(), torch.rand(k, generator=g) * 4 + 0.5,
                    (torch.rand(k, generator=g) + 0.1) if gsd else torch.ones(k))


def _q(x, bits):
    """Reference per-token symmetric absmax quantization (round to nearest), dequantized."""
    qmax = 7 if bits == 4 else 127
    s = x.abs().amax(-1, keepdim=True) / qmax
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round(x / s).clamp(-qmax, qmax) * s


def _ref_fwd(h, b, bits, sink):
    body = h[..., 1:, :] if sink else h
    c = (body - b.mean) @ b.U / b.sd
    out = b.mean + (_q(c, bits) * b.sd) @ b.U.T
    if sink:
        out = torch.cat([_q(h[..., :1, :], 8), out], dim=-2)
    return out


def _ref_bwd(g, b, bits, sink):
    body = g[..., 1:, :] if sink else g
    out = (_q(body @ b.U / b.gsd, bits) * b.gsd) @ b.U.T
    if sink:
        out = torch.cat([_q(g[..., :1, :], 8), out], dim=-2)
    return out


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("sink", [True, False])
@pytest.mark.parametrize("k", [5, 6])  # odd k: int4 pads a nibble
def test_round_trip_and_gradient_match_reference(bits, sink, k):
    H, B, T = 24, 3, 7
    b = _basis(H, k)
    codec = make_codec("pca:quant=absmax", bits=bits, k=k, sink=sink, bases={2: b})
    key = MaskKey(1, 2, 5, 0)
    h = torch.randn(B, T, H) * 2 + 1
    h[:, 0] *= 40  # a sink-like first token
    wire, ctx = codec.encode_fwd(h, key)
    shape = (B, T, H)
    specs = codec.wire_specs(shape, torch.float32, "fwd")
    assert [(tuple(t.shape), t.dtype) for t in wire] == [(tuple(s), d) for s, d in specs]
    nbytes = sum(t.numel() * t.element_size() for t in wire)
    assert nbytes == codec.wire_bytes(shape, torch.float32, "fwd")
    cw = (k + 1) // 2 if bits == 4 else k
    rows_body = T - 1 if sink else T
    assert nbytes == B * ((H + 4 if sink else 0) + rows_body * (cw + 4))
    out = codec.decode_fwd(wire, key, shape, torch.float32)
    torch.testing.assert_close(out, _ref_fwd(h, b, bits, sink), rtol=1e-5, atol=1e-4)
    g = torch.randn(B, T, H)
    wb = codec.encode_bwd(g, key, wire)
    assert sum(t.numel() * t.element_size() for t in wb) == codec.wire_bytes(shape, torch.float32, "bwd")
    gb = codec.decode_bwd(wb, key, ctx)
    torch.testing.assert_close(gb, _ref_bwd(g, b, bits, sink), rtol=1e-5, atol=1e-5)


def test_gradient_is_adjoint_of_projection():
    """Without quantization loss (codes exact), the gradient path is U U^T g: the autograd of
    h -> mean + U (U^T (h - mean) / sd) sd, i.e. the exact adjoint, straight through the quantizer."""
    H, k = 16, 4
    b = _basis(H, k, gsd=False)
    codec = PCACodec(quant="absmax", bits=8, k=k, sink=False, bases={0: b})
    # gradient whose coordinates U^T g are exactly representable on the int8 grid
    coords = torch.tensor([[[127.0, -64.0, 3.0, 0.0]]]) / 127
    g = coords @ b.U.T
    h = torch.randn(1, 1, H, requires_grad=True)
    out = apply_codec(codec, h, MaskKey(0, 0, 0, 0))
    out.backward(g)
    href = h.detach().clone().requires_grad_(True)
    ((b.mean + ((href - b.mean) @ b.U / b.sd) * b.sd @ b.U.T) * g).sum().backward()
    torch.testing.assert_close(h.grad, href.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad, g @ b.U @ b.U.T, rtol=1e-5, atol=1e-6)
    # and <codec-linear fwd(x), g> = <x, bwd(g)> for the unquantized maps (adjoint identity)
    x = torch.randn(5, H)
    assert math.isclose(float(((x @ b.U) @ b.U.T * g[0]).sum()), float((x * (g[0] @ b.U @ b.U.T)).sum()),
                        rel_tol=1e-5, abs_tol=1e-6)


def test_int4_nibble_order():
    """Coordinate 2i in the low nibble, 2i+1 in the high nibble, stored as q + 8."""
    H, k = 8, 3
    U = torch.eye(H)[:, :k]
    b = PCABasis(torch.zeros(H), U, torch.ones(k), torch.ones(k))
    codec = PCACodec(quant="absmax", bits=4, k=k, sink=False, bases={0: b})
    h = torch.zeros(1, 1, H)
    h[0, 0, :3] = torch.tensor([7.0, -7.0, 3.0])  # scale 1: q = 7, -7, 3
    codes, scale = codec.encode_fwd(h, MaskKey(0, 0, 0, 0))[0]
    assert scale.item() == 1.0
    assert codes.shape == (1, 1, 2)
    assert codes[0, 0, 0].item() == (7 + 8) | ((-7 + 8) << 4)
    assert codes[0, 0, 1].item() == (3 + 8) | (8 << 4)  # padding nibble = 0 (stored 8)


def test_width_from_budget_matches_diagnose_candidate():
    # diagnose sink+pca-int4 at H=576, budget 15, seq_len 128: B=153, pos0=5, ns4=2*(148-4)=288
    assert pca_width(576, 4, 15, True, 128) == 288
    assert pca_width(576, 8, 15, True, 128) == 144
    assert pca_width(576, 4, 15, False) == 298
    codec = make_codec("pca:quant=absmax", bits=4, budget=15)
    assert codec.width(576) == 288
    # bytes/token at [4, 128, 576] stay within 1/15 of dense fp32 (153 B)
    per_tok = codec.wire_bytes((4, 128, 576), torch.float32, "fwd") / (4 * 128)
    assert per_tok == (580 + 127 * (144 + 4)) / 128 <= 153
    with pytest.raises(ValueError):
        make_codec("pca:quant=absmax", k=4, budget=15)
    with pytest.raises(ValueError):
        pca_width(8, 4, 100)


def test_rejects_bad_wire_and_missing_basis():
    H, k = 12, 4
    b = _basis(H, k)
    codec = PCACodec(quant="absmax", bits=4, k=k, bases={0: b})
    key = MaskKey(0, 0, 0, 0)
    h = torch.randn(2, 5, H)
    wire, ctx = codec.encode_fwd(h, key)
    bad = [t.clone() for t in wire]
    bad[3][0, 0, 0] = float("nan")
    with pytest.raises(NonFiniteWire):
        codec.decode_fwd(bad, key, h.shape, h.dtype)
    bad = [t.clone() for t in wire]
    bad[1][0, 0] = float("inf")
    with pytest.raises(NonFiniteWire):
        codec.decode_fwd(bad, key, h.shape, h.dtype)
    with pytest.raises(ValueError):
        codec.decode_fwd(wire[:3], key, h.shape, h.dtype)  # truncated
    bad = [t.clone() for t in wire]
    bad[3][0, 0, 0] = -1.0
    with pytest.raises(ValueError):
        codec.decode_fwd(bad, key, h.shape, h.dtype)  # non-positive scale
    wb = codec.encode_bwd(torch.randn_like(h), key, wire)
    wb[3][1, 1, 0] = float("nan")
    with pytest.raises(NonFiniteWire):
        codec.decode_bwd(wb, key, ctx)
    with pytest.raises(ValueError, match="no basis for boundary 1"):
        codec.encode_fwd(h, MaskKey(0, 1, 0, 0))
    with pytest.raises(ValueError, match="needs"):
        PCACodec(quant="absmax", bits=4, k=k + 1, bases={0: b}).encode_fwd(h, key)
    with pytest.raises(ValueError):
        PCABasis(torch.zeros(H), b.U, -b.sd, b.gsd)


def test_bf16_activations_and_default_registry():
    from orchestration import codecs
    H, k = 16, 4
    b = _basis(H, k)
    codecs.PCA_BASES[7] = b
    try:
        codec = make_codec("pca:quant=absmax", k=k)  # bases default: the module registry
        h = torch.randn(2, 3, H, dtype=torch.bfloat16, requires_grad=True)
        out = apply_codec(codec, h, MaskKey(0, 7, 0, 0))
        assert out.dtype == torch.bfloat16 and out.shape == h.shape
        out.float().sum().backward()
        assert h.grad.dtype == torch.bfloat16 and torch.isfinite(h.grad).all()
    finally:
        codecs.PCA_BASES.pop(7, None)


def _ref_fwd_adapt(h, b, bits, sink):
    """adapt=True by hand: the micro-batch's mean and std per coordinate, then as _ref_fwd."""
    body = h[..., 1:, :] if sink else h
    c = (body - b.mean) @ b.U / b.sd
    flat = c.reshape(-1, c.shape[-1])
    mu, sd = flat.mean(0), flat.std(0, correction=0)
    out = b.mean + ((_q((c - mu) / sd, bits) * sd + mu) * b.sd) @ b.U.T
    if sink:
        out = torch.cat([_q(h[..., :1, :], 8), out], dim=-2)
    return out


@pytest.mark.parametrize("sink", [True, False])
def test_adapt_round_trip_matches_reference_and_sends_the_stats(sink):
    H, B, T, k = 24, 3, 7, 6
    b = _basis(H, k)
    codec = make_codec("pca:quant=absmax,adapt=true", bits=4, k=k, sink=sink, bases={2: b})
    key = MaskKey(1, 2, 5, 0)
    h = torch.randn(B, T, H) * 2 + 1
    wire, ctx = codec.encode_fwd(h, key)
    assert (tuple(wire[-1].shape), wire[-1].dtype) == ((2, k), torch.float32)
    plain = make_codec("pca:quant=absmax", bits=4, k=k, sink=sink, bases={2: b})
    shape = (B, T, H)
    assert codec.wire_bytes(shape, torch.float32, "fwd") == plain.wire_bytes(shape, torch.float32, "fwd") + 2 * k * 4
    assert codec.wire_bytes(shape, torch.float32, "bwd") == plain.wire_bytes(shape, torch.float32, "bwd")
    torch.testing.assert_close(codec.decode_fwd(wire, key, shape, torch.float32), _ref_fwd_adapt(h, b, 4, sink),
                               rtol=1e-5, atol=1e-4)
    g = torch.randn(B, T, H)  # the backward is the plain codec's
    torch.testing.assert_close(codec.decode_bwd(codec.encode_bwd(g, key, wire), key, ctx),
                               plain.decode_bwd(plain.encode_bwd(g, key, wire[:-1]), key, ctx))


def test_adapt_follows_a_model_whose_coordinates_moved_away_from_the_calibration():
    """The failure adapt fixes (orchestration.diagnose.drift): the activations' coordinates in
    the calibrated basis shifted by many sd and grew unevenly (as measured on the default
    model after 60 steps). With the stale mean and sd the per-token int4 scale is set by the
    coordinate that grew and the others drown; adapt's error stays what it was before the
    shift (the same codes up to rounding: it is invariant to a per-coordinate affine change)."""
    H, B, T, k = 48, 4, 33, 16
    b = _basis(H, k, gsd=False)
    g = torch.Generator().manual_seed(1)
    c = torch.randn(B, T, k, generator=g)
    h = b.mean + (c * b.sd) @ b.U.T
    growth = torch.full((k,), 2.4)  # measured: stds grew 2.4x (median), means moved by up to 28 sd
    growth[3] = 4.0
    shift = torch.zeros(k)
    shift[[0, 5, 9]] = torch.tensor([28.0, -24.0, 17.0])
    moved = b.mean + ((c * growth + shift) * b.sd) @ b.U.T

    def rel_err(codec, x):  # against the tokens' variation (the information), not their common offset
        out = apply_codec(codec, x, MaskKey(0, 0, 0, 0))
        body = x[:, 1:]
        return float((out - x)[:, 1:].pow(2).sum() / (body - body.reshape(-1, H).mean(0)).pow(2).sum())

    stale = make_codec("pca:quant=absmax", bits=4, k=k, bases={0: b})
    adapt = make_codec("pca:quant=absmax,adapt=true", bits=4, k=k, bases={0: b})
    before = rel_err(adapt, h)
    assert rel_err(stale, moved) > 10 * rel_err(stale, h)  # the stale normalization breaks down
    assert rel_err(adapt, moved) < 2 * before  # adapt does not


def test_adapt_rejects_garbage_stats():
    H, k = 24, 6
    codec = make_codec("pca:quant=absmax,adapt=true", bits=4, k=k, bases={0: _basis(H, k)})
    key, shape = MaskKey(0, 0, 0, 0), (2, 5, H)
    wire, _ = codec.encode_fwd(torch.randn(shape), key)
    bad = [t.clone() for t in wire]
    bad[-1][1, 2] = 0.0  # a std of zero
    with pytest.raises(NonFiniteWire, match="stds must be > 0"):
        codec.decode_fwd(bad, key, shape, torch.float32)
    bad[-1][1, 2] = float("nan")
    with pytest.raises(NonFiniteWire):
        codec.decode_fwd(bad, key, shape, torch.float32)
    with pytest.raises(ValueError, match="adapt must be true or false"):
        make_codec("pca:quant=absmax,adapt=yes")


@pytest.mark.parametrize("sink", [True, False])
def test_gradient_basis_backward_matches_reference_at_the_same_bytes(sink):
    """bwd=gbasis: the backward's coordinates are taken in the basis's Ug (the reference's
    _ref_bwd with Ug for U); the wire is as large as span's; the forward is unchanged."""
    H, k, B, T = 24, 6, 2, 5
    b = _basis(H, k)
    Ug, _ = torch.linalg.qr(torch.randn(H, k, generator=torch.Generator().manual_seed(9), dtype=torch.float64))
    bg = PCABasis(b.mean, b.U, b.sd, b.gsd, Ug.float())
    span = make_codec("pca:quant=absmax", bits=4, k=k, sink=sink, bases={0: b})
    gcod = make_codec("pca:quant=absmax", bits=4, k=k, sink=sink, bases={0: bg}, bwd="gbasis")
    key = MaskKey(1, 0, 0, 0)
    h, g = torch.randn(B, T, H), torch.randn(B, T, H)
    wf, ctx = gcod.encode_fwd(h, key)
    torch.testing.assert_close(gcod.decode_fwd(wf, key, (B, T, H), torch.float32), _ref_fwd(h, b, 4, sink))
    got = gcod.decode_bwd(gcod.encode_bwd(g, key, wf), key, ctx)
    ref = _ref_bwd(g, PCABasis(b.mean, bg.Ug, b.sd, b.gsd), 4, sink)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert gcod.wire_bytes((B, T, H), torch.float32, "bwd") == span.wire_bytes((B, T, H), torch.float32, "bwd")
    assert bg.nbytes() == b.nbytes() + 4 * H * k  # Ug travels once with the basis
    with pytest.raises(ValueError, match="has no gradient basis"):
        make_codec("pca:quant=absmax", bits=4, k=k, sink=sink, bases={0: b}, bwd="gbasis").encode_fwd(h, key)


def test_dense_backward_sends_the_gradient_as_it_is():
    H, k = 24, 6
    codec = make_codec("pca:quant=absmax", bits=4, k=k, bases={0: _basis(H, k)}, bwd="dense")
    key = MaskKey(1, 0, 0, 0)
    h, g = torch.randn(2, 5, H), torch.randn(2, 5, H)
    wf, ctx = codec.encode_fwd(h, key)
    assert torch.equal(codec.decode_bwd(codec.encode_bwd(g, key, wf), key, ctx), g)
    assert codec.wire_bytes((2, 5, H), torch.float32, "bwd") == 2 * 5 * H * 4
    with pytest.raises(ValueError, match="bwd must be one of span, gbasis, dense"):
        make_codec("pca:quant=absmax", k=k, bwd="full")


def test_calibrated_gradient_basis_is_the_gradients_top_eigenvectors():
    """fit_basis(gbasis=True): Ug spans the top-k eigenvectors of the calibration gradients'
    second moment (sink position left out), so it keeps at least as much of their energy as
    any k-dim basis, U included; gsd is the rms of the Ug coordinates."""
    from orchestration.components.calibration import fit_basis

    g = torch.Generator().manual_seed(0)
    H, k = 16, 4
    h = torch.randn(6, 9, H, generator=g)
    grads = torch.randn(6, 9, H, generator=g) * torch.linspace(3, 0.1, H)  # anisotropic
    b = fit_basis(h, k, sink=True, grads=grads, gbasis=True)
    flat = grads[:, 1:].reshape(-1, H).double()
    w, V = torch.linalg.eigh(flat.T @ flat)
    top = V[:, -k:]
    P = b.Ug.double() @ b.Ug.double().T
    torch.testing.assert_close(P, top @ top.T, rtol=0, atol=1e-6)
    kept = lambda Q: float((flat @ Q.double()).pow(2).sum())  # noqa: E731
    assert kept(b.Ug) >= kept(b.U) - 1e-9
    torch.testing.assert_close(b.gsd.double(), (flat @ b.Ug.double()).pow(2).mean(0).sqrt(), rtol=1e-5, atol=0)
    assert fit_basis(h, k, sink=True, grads=grads).Ug is None


@pytest.mark.parametrize("spec,options,cls", [
    ("pca", {}, PCANFCodec), ("pca:quant=nf", {}, PCANFCodec), ("pca:budget=12", {}, PCANFCodec),
    ("pca:quant=absmax", {}, PCACodec), ("pca:quant=absmax,adapt=true", {}, PCACodec),
    ("pca", {"quant": "absmax"}, PCACodec), ("pca:quant=absmax", {"quant": "nf"}, PCANFCodec),  # options win
])
def test_the_registry_picks_the_layout_class_by_quant(spec, options, cls):
    assert codec_class(spec, options) is cls
    codec = make_codec(spec, **options)
    assert type(codec) is cls and codec.quant == {PCANFCodec: "nf", PCACodec: "absmax"}[cls]


def test_every_cli_spelling_builds_its_layout_and_a_class_is_one_layout():
    from orchestration.config import parse_args
    from orchestration.codecs import codec_for

    def built(*argv):
        return type(codec_for(parse_args(list(argv))[0].boundary))

    assert built() is PCANFCodec  # the default
    assert built("--boundary.codec", "pca:quant=absmax,bits=8") is PCACodec
    assert built("--boundary.codec", "pca", "--boundary.options", '{"quant": "absmax"}') is PCACodec
    assert built("--preset", "pca4") is PCACodec
    with pytest.raises(ValueError, match="quant must be one of absmax, nf, got 'int4'"):
        make_codec("pca:quant=int4")
    with pytest.raises(ValueError, match="quant must be one of absmax, nf"):
        codec_class("pca", {"quant": "int4"})
    with pytest.raises(ValueError, match="PCACodec is the quant=absmax layout"):
        PCACodec(quant="nf")
    with pytest.raises(ValueError, match="PCANFCodec is the quant=nf layout"):
        PCANFCodec(quant="absmax")


def test_what_the_codec_says_to_calibration_and_byte_counts():
    """needs_calibration: the pca layouts only; one_off_bytes: the basis once (0 elsewhere);
    token_bytes: pca's sink row amortized over seq_len, one token's wire elsewhere."""
    assert [n for n in CODECS if codec_class(n).needs_calibration] == ["pca"]
    assert codec_class("pca:quant=absmax").needs_calibration
    H, k, T = 24, 6, 8
    codec = make_codec("pca:quant=absmax", k=k, seq_len=T, bases={3: _basis(H, k)})
    assert codec.one_off_bytes(3) == 4 * (H + H * k + 2 * k)
    # position 0: 24 int8 + an fp32 scale; 7 tokens of 3 bytes of int4 codes + an fp32 scale
    assert codec.token_bytes(H, torch.float32, "fwd") == -(-(28 + 7 * (3 + 4)) // 8) == 10
    nf = make_codec("pca", budget=4, seq_len=T)
    assert nf.token_bytes(H, torch.float32, "bwd") == -(-(28 + 7 * (nf.code_bytes(H) + 2)) // 8)
    int4 = make_codec("int4")
    assert int4.one_off_bytes(0) == 0 and not int4.needs_calibration
    assert int4.token_bytes(H, torch.float32, "fwd") == int4.wire_bytes((1, H), torch.float32, "fwd")
