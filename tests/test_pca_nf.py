"""meshkern.pca_nf and PCANFCodec (pca:quant=nf): Gaussian code books, per-coordinate bit
allocation, the bit stream, the codec's wire and its calibration, each against a known
answer or an independent reference."""
import heapq
import json
import os

import pytest
import torch

from meshkern import pca_nf
from meshkern.mask import MaskKey
from orchestration import codecs
from orchestration.codecs import NonFiniteWire, PCACodec, PCANFCodec
from orchestration.components import calibration


# Max (1960), "Quantizing for minimum distortion", Table I: the positive output levels and
# the mean squared error of the optimal quantizer of a unit Gaussian.
MAX_1960 = {1: ([0.7980], 0.3634), 2: ([0.4528, 1.510], 0.1175), 3: ([0.2451, 0.7560, 1.344, 2.152], 0.03454),
            4: ([0.1284, 0.3881, 0.6568, 0.9424, 1.256, 1.618, 2.069, 2.733], 0.009497)}


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_code_books_are_max_1960s_gaussian_quantizers(bits):
    levels, bounds = pca_nf.lloyd_max(bits)
    want, mse = MAX_1960[bits]
    torch.testing.assert_close(levels[2 ** bits // 2:], torch.tensor(want), atol=6e-4, rtol=0)
    torch.testing.assert_close(levels, -levels.flip(0))  # symmetric
    torch.testing.assert_close(bounds, (levels[1:] + levels[:-1]) / 2)
    assert abs(pca_nf.distortion(bits) - mse) / mse < 2e-3


def test_distortion_matches_a_monte_carlo_estimate():
    z = torch.randn(400_000, generator=torch.Generator().manual_seed(0))
    for b in range(1, pca_nf.MAX_BITS + 1):
        lv, bd = pca_nf.lloyd_max(b)
        mse = float((lv[torch.bucketize(z, bd)] - z).pow(2).mean())
        assert abs(mse - pca_nf.distortion(b)) / pca_nf.distortion(b) < 0.03, b
    assert pca_nf.distortion(0) == 1.0
    with pytest.raises(ValueError, match="code width"):
        pca_nf.lloyd_max(9)


def _greedy(var, total, max_bits):
    """One bit at a time by a heap: the allocation rule written the slow, obvious way."""
    bits = [0] * len(var)
    heap = [(-(v * (1 - pca_nf.distortion(1))), i) for i, v in enumerate(var)]
    heapq.heapify(heap)
    for _ in range(min(total, len(var) * max_bits)):
        _, i = heapq.heappop(heap)
        bits[i] += 1
        if bits[i] < max_bits:
            b = bits[i]
            heapq.heappush(heap, (-(var[i] * (pca_nf.distortion(b) - pca_nf.distortion(b + 1))), i))
    return bits


@pytest.mark.parametrize("seed,total,max_bits", [(0, 100, 8), (1, 7, 8), (2, 300, 4), (3, 10_000, 8)])
def test_allocation_equals_the_one_bit_at_a_time_greedy(seed, total, max_bits):
    g = torch.Generator().manual_seed(seed)
    var = (torch.rand(50, generator=g) * 6 - 4).exp().sort(descending=True).values.double()
    bits = pca_nf.allocate_bits(var, total, max_bits)
    assert bits.tolist() == _greedy(var.tolist(), total, max_bits)
    assert int(bits.sum()) == min(total, 50 * max_bits) and int(bits.max()) <= max_bits
    assert all(a >= b for a, b in zip(bits.tolist(), bits.tolist()[1:]))  # descending variance: widths too


def test_allocation_known_answers_and_errors():
    # equal variances: one bit each, ties to the lower index
    assert pca_nf.allocate_bits(torch.ones(4), 6).tolist() == [2, 2, 1, 1]
    # a coordinate 4^2 = 16x the variance of another is worth two more bits (each bit ~ /4 error)
    assert pca_nf.allocate_bits(torch.tensor([16.0, 1.0]), 4).tolist() == [3, 1]
    assert pca_nf.allocate_bits(torch.tensor([1.0, 0.0]), 3).tolist() == [3, 0]
    for bad in (torch.tensor([1.0, -1.0]), torch.tensor([float("nan")]), torch.ones(0)):
        with pytest.raises(ValueError, match="var"):
            pca_nf.allocate_bits(bad, 4)


def test_bit_stream_layout_and_round_trip():
    # widths 3 and 2, codes 5 and 2: bits 1,0,1 then 0,1 LSB first -> 0b01101 = 21
    packed = pca_nf.pack_codes(torch.tensor([[5, 2]]), torch.tensor([3, 2]), 1)
    assert packed.tolist() == [[21]] and packed.dtype == torch.uint8
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 9, (37,), generator=g)
    codes = (torch.rand(3, 5, 37, generator=g) * (2 ** bits).float()).long()
    nbytes = -(-int(bits.sum()) // 8) + 1
    packed = pca_nf.pack_codes(codes, bits, nbytes)
    assert packed.shape == (3, 5, nbytes)
    assert torch.equal(pca_nf.unpack_codes(packed, bits), codes)
    with pytest.raises(ValueError, match="do not fit"):
        pca_nf.pack_codes(codes, bits, nbytes - 2)


def _basis(H=24, k=20, seed=0, nf_bits=60):
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(H, k, generator=g, dtype=torch.float64))
    sd = torch.linspace(3.0, 0.2, k)
    gsd = torch.rand(k, generator=g) + 0.1
    return codecs.PCABasis(torch.randn(H, generator=g), U.float(), sd, gsd, bits=pca_nf.allocate_bits(sd ** 2, nf_bits),
                           gbits=pca_nf.allocate_bits(gsd ** 2, nf_bits))


def _nearest_level_reference(x, U, norm, bits, mean, sink):
    """Decoded values written independently: per token, each coordinate to the nearest level
    of its width's code book (what bucketizing at the midpoints means), times r."""
    x = x.double()
    head, body = (x[..., 0, :], x[..., 1:, :]) if sink else (None, x)
    c = ((body - mean.double()) if mean is not None else body) @ U.double() / norm.double()
    r = c.pow(2).mean(-1, keepdim=True).sqrt().float().half().double()
    z = c / r
    out = torch.zeros_like(z)
    for i, b in enumerate(bits.tolist()):
        if b:
            lv = pca_nf.lloyd_max(b)[0].double()
            out[..., i] = lv[(z[..., i:i + 1] - lv).abs().argmin(-1)]
    y = (out * r * norm.double()) @ U.double().T + (mean.double() if mean is not None else 0)
    if sink:
        s = head.abs().amax(-1, keepdim=True) / 127
        y = torch.cat([(torch.round(head / s).clamp(-127, 127) * s).unsqueeze(-2), y], dim=-2)
    return y.float()


@pytest.mark.parametrize("sink", [True, False])
def test_codec_round_trip_equals_the_nearest_level_reference(sink):
    H, T = 24, 9
    b = _basis(H)
    codec = PCANFCodec(budget=96 / 20, sink=sink, seq_len=T, bases={3: b})  # B = 20 bytes per token
    nb = codec.code_bytes(H)
    assert nb == 20 - (-(-(H + 4) // T) if sink else 0) - 2
    b = _basis(H, nf_bits=8 * nb)
    codec.bases = {3: b}
    g = torch.Generator().manual_seed(4)
    h = torch.randn(2, T, H, generator=g) * 2 + 1
    key = MaskKey(0, 3, 0, 0)
    wire, ctx = codec.encode_fwd(h, key)
    assert [(tuple(t.shape), t.dtype) for t in wire] == codec.wire_specs(h.shape, h.dtype, "fwd")
    assert codec.wire_bytes(h.shape, h.dtype, "fwd") == 2 * ((H + 4 if sink else 0) + (T - sink) * (nb + 2))
    out = codec.decode_fwd(wire, key, h.shape, h.dtype)
    torch.testing.assert_close(out, _nearest_level_reference(h, b.U, b.sd, b.bits, b.mean, sink), rtol=1e-4, atol=1e-4)
    gr = torch.randn(2, T, H, generator=g)
    gout = codec.decode_bwd(codec.encode_bwd(gr, key, wire), key, ctx)
    gref = _nearest_level_reference(gr, b.U, b.gsd, b.gbits, None, False)
    if sink:  # the backward's position 0 goes as int8 too
        gref = _nearest_level_reference(gr, b.U, b.gsd, b.gbits, None, True)
    torch.testing.assert_close(gout, gref, rtol=1e-4, atol=1e-4)


def test_bwd_budget_splits_the_bytes_between_the_directions():
    """pca:bwd_budget: the forward's codes fill 1/budget of dense fp32 and the backward's
    1/bwd_budget (sink row and fp16 scale each way as before); calibration allocates each
    direction's widths within its own bits, the wire is that many bytes each way, and the
    backward decodes to the nearest-level reference with its own widths."""
    H, T = 24, 9
    codec = PCANFCodec(budget=96 / 24, bwd_budget=96 / 12, seq_len=T)  # B = 24 forward, 12 back
    fb, bb = codec.code_bytes(H), codec.code_bytes(H, "bwd")
    assert (fb, bb) == (24 - 4 - 2, 12 - 4 - 2)  # the sink row: (24 + 4) / 9 -> 4 bytes per token
    assert PCANFCodec(budget=96 / 24, seq_len=T).code_bytes(H, "bwd") == fb  # default: the same each way
    g = torch.Generator().manual_seed(6)
    h = torch.randn(4, T, H, generator=g) * torch.linspace(3, 0.1, H)
    grads = torch.randn(4, T, H, generator=g)
    opts = codec.fit_options(H)
    assert (opts["nf_bits"], opts["gnf_bits"]) == (8 * fb, 8 * bb)
    b = calibration.fit_basis(h, codec.width(H), codec.sink, grads, **opts)
    assert int(b.bits.sum()) == 8 * fb and int(b.gbits.sum()) == 8 * bb
    assert b.gbits.tolist() == pca_nf.allocate_bits(b.gsd.double() ** 2, 8 * bb).tolist()
    codec.bases = {1: b}
    key = MaskKey(0, 1, 0, 0)
    x = torch.randn(2, T, H, generator=g)
    wire, ctx = codec.encode_fwd(x, key)
    assert codec.wire_bytes(x.shape, x.dtype, "fwd") == 2 * (H + 4 + (T - 1) * (fb + 2))
    assert codec.wire_bytes(x.shape, x.dtype, "bwd") == 2 * (H + 4 + (T - 1) * (bb + 2))
    gr = torch.randn(2, T, H, generator=g)
    wire_b = codec.encode_bwd(gr, key, wire)
    assert [(tuple(t.shape), t.dtype) for t in wire_b] == codec.wire_specs(x.shape, x.dtype, "bwd")
    torch.testing.assert_close(codec.decode_bwd(wire_b, key, ctx),
                               _nearest_level_reference(gr, b.U, b.gsd, b.gbits, None, True), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="not a quant=nf basis"):  # a basis whose backward overspends
        PCANFCodec(budget=96 / 24, bwd_budget=96 / 8, seq_len=T, bases={1: b}).encode_fwd(x, key)
    for bad in ("pca:bwd_budget=0", "pca:bwd_budget=30,bwd=dense"):
        with pytest.raises(ValueError, match="bwd_budget"):
            codecs.make_codec(bad)


def test_codec_rejects_bad_options_bases_and_wires():
    for bad in ({"k": 8}, {"bits": 8}, {"adapt": True}, {"bwd": "gbasis", "grad_rows": 4}):
        with pytest.raises(ValueError, match="quant=nf"):
            PCANFCodec(**bad)
    with pytest.raises(ValueError, match="quant must be"):
        PCANFCodec(quant="nf4")
    with pytest.raises(ValueError, match="basis_dtype"):
        PCANFCodec(basis_dtype="bfloat16")
    H, T = 24, 9
    b = _basis(H)
    plain = codecs.PCABasis(b.mean, b.U, b.sd, b.gsd)
    key = MaskKey(0, 0, 0, 0)
    h = torch.randn(1, T, H)
    with pytest.raises(ValueError, match="not a quant=nf basis"):
        PCANFCodec(budget=4, seq_len=T, bases={0: plain}).encode_fwd(h, key)
    with pytest.raises(ValueError, match=r"\[24, 20\] \(quant=nf\), this codec needs"):  # an nf basis in an int4 codec
        PCACodec(k=20, seq_len=T, bases={0: b}).encode_fwd(h, key)
    codec = PCANFCodec(budget=4, seq_len=T, bases={0: b})
    wire, _ = codec.encode_fwd(h, key)
    bad = list(wire)
    bad[-1] = -bad[-1]
    with pytest.raises(NonFiniteWire, match="non-positive"):
        codec.decode_fwd(bad, key, h.shape, h.dtype)
    bad[-1] = torch.full_like(wire[-1], float("nan"))
    with pytest.raises(NonFiniteWire):
        codec.decode_fwd(bad, key, h.shape, h.dtype)
    with pytest.raises(ValueError, match="bits"):
        codecs.PCABasis(b.mean, b.U, b.sd, b.gsd, bits=b.bits)  # without gbits
    with pytest.raises(ValueError, match="code widths"):
        codecs.PCABasis(b.mean, b.U, b.sd, b.gsd, bits=b.bits + 9, gbits=b.gbits)


@pytest.mark.parametrize("half", [False, True])
def test_fit_basis_allocates_the_budget_and_keeps_the_coordinates_with_bits(tmp_path, half):
    g = torch.Generator().manual_seed(5)
    H, nf_bits = 32, 70
    h = torch.randn(6, 17, H, generator=g) @ torch.diag(torch.linspace(4, 0.05, H)) @ torch.linalg.qr(
        torch.randn(H, H, generator=g))[0]
    grads = torch.randn(6, 17, H, generator=g)
    b = calibration.fit_basis(h, H, sink=True, grads=grads, nf_bits=nf_bits, half=half)
    full = calibration.fit_pca(calibration.inlier_tokens(h, True))
    want = pca_nf.allocate_bits(full.eigvals.clamp_min(0), nf_bits)
    k = int((want > 0).sum())
    assert b.k == k < H and b.bits.tolist() == want[:k].tolist() and int(b.bits.sum()) == nf_bits
    assert b.gbits.tolist() == pca_nf.allocate_bits(b.gsd.double() ** 2, nf_bits).tolist()
    if half:
        for t in (b.mean, b.U, b.sd, b.gsd):
            assert torch.equal(t, t.half().float())
    assert b.nbytes() == (2 if half else 4) * (H + H * k + 2 * k) + 2 * k
    calibration.save({0: b}, str(tmp_path))
    back = calibration.load(str(tmp_path))[0]
    assert torch.equal(back.bits, b.bits) and torch.equal(back.gbits, b.gbits) and back.elem == b.elem
    assert back.nbytes() == b.nbytes()


@pytest.mark.slow
def test_nf_codec_trains_through_the_mesh(tiny, tmp_path):
    """1x2 mesh, pca:quant=nf with bwd_budget: finite losses, the saved basis spends exactly
    each direction's code bits, and the PP bytes are the wire's per micro-batch each way (its
    own bytes back) plus the basis once."""
    from test_calibration import run_pca_mesh

    cfg, plan, res = run_pca_mesh(tiny, tmp_path, {"seq_len": 32, "calib_rows": 8, "quant": "nf", "budget": 4,
                                                   "bwd_budget": 8}, rows=1)
    assert all(l == l and l > 0 for l in res[1]["losses"])
    codec = calibration.codec_of(cfg)
    H = 40
    nb, gnb = codec.code_bytes(H), codec.code_bytes(H, "bwd")
    # B = 40 bytes per token forward, 20 back: 2 for position 0, 2 for the fp16 scale
    assert (nb, gnb) == (160 // 4 - 2 - 2, 160 // 8 - 2 - 2)
    saved = calibration.load(plan.run_dir)[1]  # (4 layers in 2 stages: the boundary after layer 1)
    assert int(saved.bits.sum()) == 8 * nb and int(saved.gbits.sum()) == 8 * gnb and saved.k <= H
    per_mb = codec.wire_bytes((2, 32, H), torch.float32, "fwd")
    assert per_mb == 2 * (44 + 31 * (nb + 2))
    links = json.load(open(os.path.join(plan.run_dir, "link_bytes.json")))["links"]
    assert links["pp_fwd:0->1"] == 3 * 2 * per_mb + saved.nbytes()
    assert links["pp_bwd:1->0"] == 3 * 2 * 2 * (44 + 31 * (gnb + 2))


KERNELS = [b for b in __import__("backend_params").op_backends("pca") if b.values[0] != "reference"]


def _kernel_ops(backend):
    """(pack(z, bounds, bits, nbytes), unpack(packed, levels, bits)) of a kernel backend."""
    if backend == "cpp":
        return torch.ops.meshkern_C.pca_nf_pack, torch.ops.meshkern_C.pca_nf_unpack
    from meshkern.triton_kernels import pca_nf as tk
    return tk.pack, tk.unpack


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("sink", [True, False])
def test_kernels_give_the_reference_wire_and_decode_bit_for_bit(backend, sink):
    """csrc/pca/pca_nf_cpu.cpp and meshkern/triton_kernels/pca_nf.py against the pure-torch
    path: widths 0-8 (random), values on and around the boundaries, +-inf and NaN
    coordinates (searchsorted's convention)."""
    g = torch.Generator().manual_seed(7)
    H, k, T = 48, 40, 11
    U, _ = torch.linalg.qr(torch.randn(H, k, generator=g, dtype=torch.float64))
    U = U.float()
    norm = torch.rand(k, generator=g) + 0.2
    bits = torch.randint(0, 9, (k,), generator=g)
    nbytes = -(-int(bits.sum()) // 8) + 2
    mean = torch.randn(H, generator=g)
    h = torch.randn(3, T, H, generator=g) * 2
    ref = pca_nf.encode(h, U, norm, bits, nbytes, mean=mean, sink=sink, backend="reference")
    got = pca_nf.encode(h, U, norm, bits, nbytes, mean=mean, sink=sink, backend=backend)
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype and torch.equal(a, b)
    out = pca_nf.decode(got, U, norm, bits, h.shape, torch.float32, mean=mean, sink=sink, backend=backend)
    assert torch.equal(out, pca_nf.decode(ref, U, norm, bits, h.shape, torch.float32, mean=mean, sink=sink,
                                          backend="reference"))
    # the search itself, on exact boundary values and non-finite ones
    pack, unpack = _kernel_ops(backend)
    lv, bd = pca_nf._tables(bits, "cpu")
    z = torch.randn(64, k, generator=g) * 2
    z[0] = bd[torch.arange(k), 0]  # exactly on a boundary: not counted (side left)
    z[1], z[2], z[3] = float("inf"), -float("inf"), float("nan")
    want = pca_nf.pack_codes(torch.minimum(torch.searchsorted(bd, z.T.contiguous()).T, (1 << bits) - 1), bits, nbytes)
    assert torch.equal(pack(z, bd, bits, nbytes), want)
    codes = pca_nf.unpack_codes(want, bits)
    assert torch.equal(unpack(want, lv, bits), lv.gather(1, codes.T.contiguous()).T)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("widths", ["ones", "sevens", "eights", "calibrated"])
def test_kernels_pack_every_layout_as_the_reference(backend, widths):
    """Layouts at the packer's edges: 8 one-bit codes per byte (the longest run the Triton
    packer visits), 7-bit codes that straddle every byte, byte-aligned 8-bit codes, and a
    layout from allocate_bits at the trainer's size (H = 576, 1/15 of dense fp32)."""
    g = torch.Generator().manual_seed(3)
    if widths == "calibrated":
        var = torch.linspace(0, -9, 576).exp()
        bits = pca_nf.allocate_bits(var, 8 * 145)
        bits = bits[bits > 0]
    else:
        bits = torch.full((61,), {"ones": 1, "sevens": 7, "eights": 8}[widths])
    k = bits.numel()
    nbytes = -(-int(bits.sum()) // 8)
    pack, unpack = _kernel_ops(backend)
    lv, bd = pca_nf._tables(bits, "cpu")
    z = torch.randn(37, k, generator=g) * 1.5
    want = pca_nf.pack_codes(torch.minimum(torch.searchsorted(bd, z.T.contiguous()).T, (1 << bits) - 1), bits, nbytes)
    got = pack(z, bd, bits, nbytes)
    assert got.shape == (37, nbytes) and torch.equal(got, want)
    codes = pca_nf.unpack_codes(want, bits)
    assert torch.equal(unpack(got, lv, bits), lv.gather(1, codes.T.contiguous()).T)


@pytest.mark.parametrize("backend", KERNELS)
def test_kernels_refuse_bad_tables(backend):
    from meshkern import _backend
    _backend.extension("pca")
    pack, unpack = _kernel_ops(backend)
    err = RuntimeError if backend == "cpp" else ValueError
    bits = torch.tensor([3, 2])
    lv, bd = pca_nf._tables(bits, "cpu")
    with pytest.raises(err, match="do not fit"):
        pack(torch.zeros(2, 2), bd, bits, 0)
    with pytest.raises(err, match="fit the table"):
        pack(torch.zeros(2, 2), bd[:, :2].contiguous(), bits, 1)
    with pytest.raises(err, match="need more than"):
        unpack(torch.zeros(2, 0, dtype=torch.uint8), lv, bits)
    if backend == "cpp":  # the C++ op takes int64 widths only; Triton's host code converts
        with pytest.raises(RuntimeError, match="int64"):
            unpack(torch.zeros(2, 1, dtype=torch.uint8), lv, bits.int())


def test_default_pca_is_nf_and_int4_is_asked_for_by_name():
    """`pca` means quant=nf on a 64-row basis; the int4 layout is pca:quant=absmax (16 rows),
    and its options without quant=absmax are refused with the fix in the message."""
    from orchestration.config import parse_args
    from orchestration.codecs import codec_for, make_codec

    default = codec_for(parse_args([])[0].boundary)
    assert (default.quant, default.calib_rows, default.budget) == ("nf", 64, 15.0)
    int4 = make_codec("pca:quant=absmax")
    assert (int4.quant, int4.bits, int4.calib_rows) == ("absmax", 4, 16)
    assert make_codec("pca:quant=absmax,calib_rows=64").calib_rows == 64
    for spec in ("pca:k=8", "pca:bits=8", "pca:adapt=true", "pca:bwd=gbasis"):
        with pytest.raises(ValueError, match="only with quant=absmax.*add quant=absmax"):
            make_codec(spec)
    preset = codec_for(parse_args(["--preset", "pca4"])[0].boundary)  # the published int4 rows keep int4
    assert (preset.quant, preset.bits, preset.calib_rows) == ("absmax", 4, 16)


def _op_args(sink, seed=11, H=24, k=20, T=5):
    """(h, mean, U, norm, bits, nbytes) with widths 0-8 (random) and two spare bytes."""
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(H, k, generator=g, dtype=torch.float64))
    bits = torch.randint(0, 9, (k,), generator=g)
    return (torch.randn(2, T, H, generator=g) * 2, torch.randn(H, generator=g), U.float().contiguous(),
            torch.rand(k, generator=g) + 0.2, bits, -(-int(bits.sum()) // 8) + 2)


@pytest.mark.parametrize("backend", __import__("backend_params").op_backends("pca"))
@pytest.mark.parametrize("sink", [True, False])
def test_opcheck(backend, sink):
    """meshkern::pca_nf_encode / pca_nf_decode: schema, fake kernels (shapes, dtypes) and
    AOT dispatch agree with the real op, forward (mean) and backward (no mean) direction."""
    h, mean, U, norm, bits, nbytes = _op_args(sink)
    checks = ("test_schema", "test_faketensor", "test_aot_dispatch_static")
    for m in (mean, None):
        torch.library.opcheck(torch.ops.meshkern.pca_nf_encode, (h, m, U, norm, bits, nbytes, sink, backend),
                              test_utils=checks)
        wire = pca_nf.encode(h, U, norm, bits, nbytes, mean=m, sink=sink, backend="reference")
        torch.library.opcheck(torch.ops.meshkern.pca_nf_decode,
                              (wire, m, U, norm, bits, list(h.shape), torch.bfloat16, sink, backend), test_utils=checks)


def test_op_errors():
    h, mean, U, norm, bits, nbytes = _op_args(True)
    with pytest.raises(TypeError, match="int64"):
        pca_nf.encode(h, U, norm, bits.int(), nbytes)
    with pytest.raises(ValueError, match=r"bits must be \[k=20\]"):
        pca_nf.encode(h, U, norm, bits[:-1], nbytes)
    with pytest.raises(ValueError, match=r"code widths in 0\.\.8"):
        pca_nf.encode(h, U, norm, torch.full_like(bits, 9), 200)
    with pytest.raises(ValueError, match="do not fit"):
        pca_nf.encode(h, U, norm, bits, nbytes - 3)
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        pca_nf.encode(h, U, norm, bits, -1)
    with pytest.raises(TypeError, match="U must have dtype float32"):
        pca_nf.encode(h, U.double(), norm, bits, nbytes)
    with pytest.raises(ValueError, match=r"mean must be \[H=24\]"):
        pca_nf.encode(h, U, norm, bits, nbytes, mean=mean[:-1])
    wire = pca_nf.encode(h, U, norm, bits, nbytes, mean=mean)
    with pytest.raises(ValueError, match=r"wire\[2\] must be"):
        pca_nf.decode(wire[:2] + [wire[2][..., 1:, :], wire[3]], U, norm, bits, h.shape, h.dtype, mean=mean)
    bad = list(wire)
    bad[3] = -bad[3]
    with pytest.raises(ValueError, match="non-positive scales"):
        pca_nf.decode(bad, U, norm, bits, h.shape, h.dtype, mean=mean)
    with pytest.raises(ValueError, match="do not fit"):  # the stream is too short for the widths
        pca_nf.decode(wire, U, norm, torch.full_like(bits, 8), h.shape, h.dtype, mean=mean)
    with pytest.raises(TypeError, match="dtype"):
        pca_nf.decode(wire, U, norm, bits, h.shape, torch.int32, mean=mean)
