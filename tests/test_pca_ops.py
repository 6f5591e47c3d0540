"""meshkern.pca: the reference is the pca codec's math (checked against PCACodec itself on
random data), every kernel backend against the reference (codes equal except at rounding
ties of the coordinates, which the test locates from the reference's own c / scale; the
quantizer alone bit for bit), the wire layout, opcheck, and the argument errors."""
import pytest
import torch

from backend_params import op_backends
from meshkern import pca

BACKENDS = [b for b in op_backends("pca") if b.values[0] != "reference"]


def _basis(H, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(H, k, generator=g, dtype=torch.float64))
    mean = torch.randn(H, generator=g) * 2
    sd = torch.rand(k, generator=g) + 0.5
    return U.float().contiguous(), mean, sd


def _h(shape, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*shape, generator=g) * 3
    h[..., 3] *= 40  # a massive dim, as in a pretrained residual stream
    return h.to(dtype)


# ----------------------------------------------------------------- the reference is the codec
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("sink", [True, False])
def test_reference_is_the_codec(bits, sink):
    from orchestration.codecs.pca import PCABasis, PCACodec
    from meshkern import MaskKey

    H, k, shape = 48, 13, (2, 5, 48)  # odd k: the int4 pad nibble
    U, mean, sd = _basis(H, k)
    gsd = torch.rand(k) + 0.5
    codec = PCACodec(quant="absmax", bits=bits, k=k, sink=sink, bases={0: PCABasis(mean, U, sd, gsd)})
    key = MaskKey(seed=0, boundary=0, step=0, microbatch=0)
    h = _h(shape)
    wire, meta = codec.encode_fwd(h, key)
    ours = pca.encode(h, U, sd, mean=mean, bits=bits, sink=sink, backend="reference")
    assert len(ours) == len(wire) and all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(ours, wire))
    out = pca.decode(wire, U, sd, shape=shape, dtype=torch.float32, mean=mean, bits=bits, sink=sink,
                     backend="reference")
    assert torch.equal(out, codec.decode_fwd(wire, key, shape, torch.float32))
    g = _h(shape, seed=2)
    gwire = codec.encode_bwd(g, key, meta)
    ours = pca.encode(g, U, gsd, bits=bits, sink=sink, backend="reference")  # backward: no mean, gsd
    assert all(torch.equal(a, b) for a, b in zip(ours, gwire))
    got = pca.decode(gwire, U, gsd, shape=shape, dtype=torch.float32, bits=bits, sink=sink, backend="reference")
    assert torch.equal(got, codec.decode_bwd(gwire, key, (shape, torch.float32, 0)))


def test_codec_widths_in_the_compile_check_are_the_codecs():
    from orchestration.codecs.pca import pca_width
    from meshkern.pca import CODEC_WIDTH

    assert {H: pca_width(H) for H in CODEC_WIDTH} == CODEC_WIDTH


# ------------------------------------------------------------------- kernels vs the reference
def _codes(q, bits, k):
    if bits == 8:
        return q.long()
    return torch.stack((q & 0xF, q >> 4), dim=-1).reshape(*q.shape[:-1], 2 * q.shape[-1])[..., :k].long() - 8


def _ties(c_over_scale, tol=1e-4):
    """Where the reference's c / scale lies within ``tol`` of a rounding tie (x.5)."""
    frac = c_over_scale.abs() - c_over_scale.abs().floor()
    return (frac - 0.5).abs() < tol


def _assert_codes_match(got, want, c_ref, bits):
    """Body codes: equal wherever the reference's coordinate is not within rounding of a
    tie, at most one level apart there; scales to fp32 rounding of the sum over H (the
    absmax coordinate carries the GEMM's rounding: up to 6.5e-7 relative, ~5 ulp, was
    measured for the Triton kernel at H=576 over 4096 rows; rtol 1e-5 leaves margin)."""
    (q, s), (qr, sr) = got, want
    k = c_ref.shape[-1]
    assert q.dtype == qr.dtype and q.shape == qr.shape and s.shape == sr.shape
    torch.testing.assert_close(s, sr, rtol=1e-5, atol=0)
    a, b = _codes(q, bits, k), _codes(qr, bits, k)
    near = _ties(c_ref / sr)
    assert torch.equal(a[~near], b[~near])
    assert bool(((a - b).abs() <= 1).all())
    if bits == 4 and k % 2:
        assert torch.equal(q[..., -1] >> 4, torch.full_like(q[..., -1] >> 4, 8))  # the pad nibble


def _c_ref(h, U, norm, mean, sink):
    x = h.float()[..., 1:, :] if sink else h.float()
    return ((x - mean) if mean is not None else x) @ U / norm


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("H,k,shape,dtype,bits,sink,center", [
    (48, 13, (2, 5, 48), torch.float32, 4, True, True),       # odd k, sink, 2 sequences
    (64, 32, (7, 64), torch.bfloat16, 4, False, True),        # bf16 input, no sink
    (40, 20, (3, 4, 40), torch.float32, 8, True, False),      # int8 body, backward (no mean)
    (300, 150, (1, 70, 300), torch.float32, 4, True, True),   # several row / k / H blocks
    (16, 16, (2, 1, 16), torch.float32, 4, True, True),       # T = 1: the body is empty
])
def test_encode_matches_reference(backend, H, k, shape, dtype, bits, sink, center):
    U, mean, sd = _basis(H, k)
    mean = mean if center else None
    h = _h(shape, dtype)
    got = pca.encode(h, U, sd, mean=mean, bits=bits, sink=sink, backend=backend)
    want = pca.encode(h, U, sd, mean=mean, bits=bits, sink=sink, backend="reference")
    assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in want]
    if sink:  # the head row: no projection, so bit for bit
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    _assert_codes_match(got[-2:], want[-2:], _c_ref(h, U, sd, mean, sink), bits)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bits", [4, 8])
def test_quantizer_is_bit_identical_given_the_coordinates(backend, bits):
    """The quantization step alone (c given), with exact ties planted: round half to even."""
    from meshkern.pca import _kernels, quantize_reference

    g = torch.Generator().manual_seed(3)
    c = torch.randn(37, 29, generator=g)
    qmax = 7 if bits == 4 else 127
    c[:, 0] = qmax  # scale = 1 exactly: the planted values are exact multiples of 0.5
    c[:, 1:9] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, -6.5])
    c[5] = 0.0  # an all-zero row: scale 1, codes 0
    _, quantize_rows, _ = _kernels(backend)
    q, s = quantize_rows(c, 37, 29, [37, 37, 0], bits)
    qr, sr = quantize_reference(c, bits)
    assert torch.equal(q, qr) and torch.equal(s, sr.reshape(-1))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("H,k,shape,dtype,bits,sink,center", [
    (48, 13, (2, 5, 48), torch.float32, 4, True, True),
    (64, 32, (7, 64), torch.bfloat16, 4, False, True),
    (40, 20, (3, 4, 40), torch.float32, 8, True, False),
    (300, 150, (1, 70, 300), torch.float32, 4, True, True),
])
def test_decode_matches_reference(backend, H, k, shape, dtype, bits, sink, center):
    U, mean, sd = _basis(H, k)
    mean = mean if center else None
    wire = pca.encode(_h(shape), U, sd, mean=mean, bits=bits, sink=sink, backend="reference")
    got = pca.decode(wire, U, sd, shape=shape, dtype=dtype, mean=mean, bits=bits, sink=sink, backend=backend)
    want = pca.decode(wire, U, sd, shape=shape, dtype=dtype, mean=mean, bits=bits, sink=sink, backend="reference")
    assert got.dtype == dtype and got.shape == want.shape
    if sink:
        assert torch.equal(got[..., 0, :], want[..., 0, :])  # the head: elementwise, same rounding
    # the sum over k in another order: fp32 rounding of |c| |U| summed; bf16 output: one bf16 ulp
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("backend", [b for b in op_backends("pca")])
def test_opcheck(backend):
    U, mean, sd = _basis(24, 8)
    h = _h((2, 3, 24))
    args = (h, mean, U, sd, 4, True, backend)
    torch.library.opcheck(torch.ops.meshkern.pca_encode, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
    wire = pca.encode(h, U, sd, mean=mean, backend="reference")
    torch.library.opcheck(torch.ops.meshkern.pca_decode, (wire, mean, U, sd, [2, 3, 24], torch.float32, 4, True,
                                                          backend),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


# ------------------------------------------------------------------------------ errors
def test_errors():
    U, mean, sd = _basis(24, 8)
    h = _h((2, 3, 24))
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        pca.encode(h, U, sd, bits=2)
    with pytest.raises(ValueError, match=r"U must be \[H=20, k\]"):
        pca.encode(h[..., :20], U, sd)
    with pytest.raises(TypeError, match="U must have dtype float32"):
        pca.encode(h, U.double(), sd)
    with pytest.raises(ValueError, match=r"norm must be \[k=8\]"):
        pca.encode(h, U, sd[:7])
    with pytest.raises(ValueError, match=r"mean must be \[H=24\]"):
        pca.encode(h, U, sd, mean=mean[:5])
    with pytest.raises(ValueError, match="at least 2 dim"):
        pca.encode(h[0, 0], U, sd)
    with pytest.raises(TypeError, match="h must have dtype"):
        pca.encode(h.long(), U, sd)
    wire = pca.encode(h, U, sd, mean=mean)
    with pytest.raises(ValueError, match="wire must be a list of 4"):
        pca.decode(wire[:2], U, sd, shape=h.shape, dtype=torch.float32, mean=mean)
    with pytest.raises(ValueError, match=r"wire\[2\] must be"):
        pca.decode(wire, U, sd, shape=(2, 4, 24), dtype=torch.float32, mean=mean)
    bad = list(wire)
    bad[3] = torch.zeros_like(bad[3])
    with pytest.raises(ValueError, match="non-positive scales"):
        pca.decode(bad, U, sd, shape=h.shape, dtype=torch.float32, mean=mean)
    with pytest.raises(TypeError, match="floating-point"):
        pca.decode(wire, U, sd, shape=h.shape, dtype=torch.int32, mean=mean)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.values[0] == "cpp"])
def test_cpp_result_does_not_depend_on_thread_count(backend):
    U, mean, sd = _basis(96, 40)
    h = _h((4, 300, 96))  # several row blocks
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = pca.encode(h, U, sd, mean=mean, backend=backend)
        d1 = pca.decode(one, U, sd, shape=h.shape, dtype=torch.float32, mean=mean, backend=backend)
        torch.set_num_threads(2)
        two = pca.encode(h, U, sd, mean=mean, backend=backend)
        d2 = pca.decode(two, U, sd, shape=h.shape, dtype=torch.float32, mean=mean, backend=backend)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, two)) and torch.equal(d1, d2)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("sink", [True, False])
def test_wire_shapes_are_the_codecs(bits, sink):
    from orchestration.codecs.pca import PCACodec

    shape = (2, 7, 48)
    codec = PCACodec(quant="absmax", bits=bits, k=13, sink=sink, bases={})
    assert pca.wire_shapes(shape, 13, bits, sink) == [(tuple(s), dt) for s, dt in
                                                      codec.wire_specs(shape, torch.float32, "fwd")]
