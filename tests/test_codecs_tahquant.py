"""The tahquant boundary codec (TAH-Quant: entropy-guided token bits, pivot swap + Hadamard
on outlier tiles, asymmetric per-tile quantization) against a per-tile loop reference."""
import math

import numpy as np
import pytest
import torch

from meshkern.mask import MaskKey
from orchestration.codecs import TAHQuantCodec, apply_codec, make_codec
from orchestration.codecs.lowbit import unpack_bits
from orchestration.codecs.tahquant import hadamard_matrix

torch.set_num_threads(1)
KEY = MaskKey(seed=1, boundary=0, step=0, microbatch=0)


def _ref_hadamard(n):
    """Sylvester by Kronecker products, normalized (float64)."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.kron(np.array([[1, 1], [1, -1]]), h)
    return h / math.sqrt(n)


def _f16_down(v):
    z = np.float16(v)
    return np.nextafter(z, np.float16(-np.inf)) if float(z) > v else z


def _f16_up(v):
    s = np.float16(v)
    return np.nextafter(s, np.float16(np.inf)) if float(s) < v else s


def reference(x, bits=4, low_bits=3, high_fraction=0.8, tile=64):
    """TAH-Quant's forward round trip, one token and one tile at a time, float64 apart from
    the fp16 zero/scale. Returns (x_hat, low-bit token mask, flags, per-tile scales)."""
    x = x.double().numpy()
    R, T, H = x.shape
    n_lo = math.floor(T * (1 - high_fraction) + 1e-9)
    Hm = _ref_hadamard(tile)
    out = np.zeros_like(x)
    low = np.zeros((R, T), dtype=bool)
    flags = np.zeros((R, T, H // tile), dtype=bool)
    scales = np.zeros((R, T, H // tile))
    for r in range(R):
        ent = []
        for t in range(T):
            p = np.abs(x[r, t]) / np.abs(x[r, t]).sum()
            ent.append(-sum(v * math.log(v) for v in p if v > 0))
        for t in sorted(range(T), key=lambda t: (ent[t], t))[:n_lo]:
            low[r, t] = True
        for t in range(T):
            levels = 2 ** (low_bits if low[r, t] else bits) - 1
            for g in range(H // tile):
                v = x[r, t, g * tile:(g + 1) * tile].copy()
                a = np.sort(np.abs(v))[::-1]
                flag = a[0] >= 2 * a[1] and a[0] > 0
                piv = int(np.argmax(np.abs(v)))
                if flag:
                    v[0], v[piv] = v[piv], v[0]
                    v = Hm @ v
                zero = _f16_down(v.min())
                scale = _f16_up((v.max() - float(zero)) / levels)
                scale = scale if float(scale) > 0 else np.float16(1)
                codes = np.clip(np.round((v - float(zero)) / float(scale)), 0, levels)
                y = float(zero) + codes * float(scale)
                if flag:
                    y = Hm @ y
                    y[0], y[piv] = y[piv], y[0]
                out[r, t, g * tile:(g + 1) * tile] = y
                flags[r, t, g], scales[r, t, g] = flag, float(scale)
    return torch.from_numpy(out), torch.from_numpy(low), torch.from_numpy(flags), torch.from_numpy(scales)


def _acts(R=2, T=10, H=64, seed=0):
    """Residual-stream-like activations: normal values plus a few large outliers in fixed
    dims (the massive dims of a pretrained model)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, T, H, generator=g)
    x[..., 5] += 60
    x[:, ::3, 40] -= 25
    return x


def test_hadamard_matrix_is_the_normalized_sylvester_matrix():
    for n in (2, 8, 64):
        Hm = hadamard_matrix(n)
        torch.testing.assert_close(Hm.double(), torch.from_numpy(_ref_hadamard(n)), rtol=0, atol=1e-7)
        torch.testing.assert_close(Hm @ Hm, torch.eye(n), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="power of 2"):
        hadamard_matrix(12)


@pytest.mark.parametrize("bits,low_bits,hf,tile", [(4, 3, 0.8, 64), (4, 3, 0.8, 16), (3, 2, 0.5, 8), (8, 8, 1.0, 32),
                                                   (2, 1, 0.5, 16)])
def test_round_trip_matches_the_loop_reference(bits, low_bits, hf, tile):
    x = _acts()
    c = TAHQuantCodec(bits=bits, low_bits=low_bits, high_fraction=hf, tile=tile)
    wire, _ = c.encode_fwd(x, KEY)
    out = c.decode_fwd([w.clone() for w in wire], KEY, x.shape, x.dtype)
    want, low, flags, scales = reference(x, bits, low_bits, hf, tile)
    # float32 (codec) vs float64 (reference) can move a tile's min across an fp16 grid
    # point or a value across a rounding boundary: a tile may then differ by up to one
    # quantization step per element; nearly all elements agree to float32 precision.
    diff = (out.double() - want).reshape(2, 10, 64 // tile, tile)
    assert bool((diff.norm(dim=-1) <= math.sqrt(tile) * scales + 1e-4).all())
    assert float((diff.abs() <= 1e-4 + 1e-5 * want.abs().reshape(diff.shape)).double().mean()) > 0.95
    n_lo = c.n_low(10)
    tmap = wire[2 if n_lo else 1]
    assert torch.equal(unpack_bits(tmap, 1, 10).bool(), low)
    assert int(low.sum()) == 2 * n_lo
    assert bool(flags.any())  # the outlier dims make some tiles take the Hadamard path
    # Error bound per tile: L2 <= sqrt(tile) * scale / 2 (orthonormal rotation); per
    # element <= scale / 2 on tiles that were not rotated.
    err = (out - x).reshape(2, 10, 64 // tile, tile).double()
    assert bool((err.norm(dim=-1) <= math.sqrt(tile) * scales / 2 + 1e-4).all())
    plain = ~flags
    assert bool((err.abs().amax(-1)[plain] <= scales[plain] / 2 + 1e-4).all())


def test_pivot_swap_and_hadamard_tame_an_outlier_tile():
    """One outlier in a tile of normal values: rotated, it becomes an offset the zero point
    absorbs, so the tile's error is far below plain per-tile min/max quantization's."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 4, 64, generator=g)
    x[0, :, 17] = 100.0
    c = TAHQuantCodec(bits=4, high_fraction=1.0)
    out = apply_codec(c, x, KEY)
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    s = (hi - lo) / 15
    plain = lo + torch.round((x - lo) / s) * s
    assert (out - x).norm() < 0.25 * (plain - x).norm()


def test_wire_bytes_are_exact():
    c = TAHQuantCodec(bits=4, low_bits=3, high_fraction=0.8, tile=16)
    x = _acts()
    wire, _ = c.encode_fwd(x, KEY)
    # per row of T=10, H=64: n_lo = 2; codes 8*64*4/8 + 2*64*3/8; token map 2; 40 tile
    # flags 5; 40 pivots of 4 bits 20; fp16 zero and scale 10*4*2 each.
    per_row = 256 + 48 + 2 + 5 + 20 + 80 + 80
    assert c.wire_bytes(x.shape, x.dtype, "fwd") == 2 * per_row == sum(t.numel() * t.element_size() for t in wire)
    assert c.wire_bytes(x.shape, x.dtype, "bwd") == 2 * 10 * 64 * 2  # bf16 gradients
    # SmolLM2-135M (H=576) at seq 128, defaults: 3.8 bits on average + metadata.
    smol = make_codec("tahquant")
    assert smol.wire_bytes((1, 128, 576), torch.float32, "fwd") == 29664 + 5400 + 16 + 144 + 864 + 2 * 2304
    assert make_codec("tahquant", meta="float32").wire_bytes((1, 128, 576), torch.float32, "fwd") == \
        29664 + 5400 + 16 + 144 + 864 + 2 * 4608


@pytest.mark.parametrize("gbits", [16, 4])
def test_gradient_is_straight_through_then_sent_as_configured(gbits):
    x = _acts().requires_grad_(True)
    g = torch.randn(2, 10, 64)
    apply_codec(TAHQuantCodec(gbits=gbits), x, KEY).backward(g)
    if gbits == 16:
        want = g.to(torch.bfloat16).float()
    else:
        scale = g.abs().amax(-1, keepdim=True) / 7
        want = torch.round(g / scale).clamp(-7, 7) * scale
    torch.testing.assert_close(x.grad, want, rtol=0, atol=1e-6)


def test_bad_input_errors_name_the_problem():
    for bad, match in (({"tile": 12}, "power of 2"), ({"low_bits": 5}, "exceeds"), ({"high_fraction": 1.5}, r"\[0, 1\]"),
                       ({"meta": "int8"}, "meta"), ({"bits": 9}, "bits"), ({"gbits": 1}, "gbits")):
        with pytest.raises(ValueError, match=match):
            TAHQuantCodec(**bad)
    c = TAHQuantCodec(tile=16)
    with pytest.raises(ValueError, match="does not divide"):
        c.wire_specs((2, 10, 40), torch.float32, "fwd")
    x = _acts()
    wire, _ = c.encode_fwd(x, KEY)
    bad = [w.clone() for w in wire]
    bad[2][:] = 0  # token map: no low-bit token although 2 per row must be
    with pytest.raises(ValueError, match="exactly 2 low-bit tokens"):
        c.decode_fwd(bad, KEY, x.shape, x.dtype)
    bad = [w.clone() for w in wire]
    bad[-1][0, 0, 0] = 0
    with pytest.raises(ValueError, match="non-positive scales"):
        c.decode_fwd(bad, KEY, x.shape, x.dtype)
    huge = x * 1e4  # ranges past float16: the codec says so instead of sending inf
    with pytest.raises(ValueError, match="meta=float32"):
        c.encode_fwd(huge, KEY)
    c32 = TAHQuantCodec(tile=16, meta="float32")
    out = apply_codec(c32, huge, KEY)
    assert torch.isfinite(out).all() and (out - huge).norm() < 0.1 * huge.norm()


@pytest.mark.slow
def test_tahquant_trains_through_the_mesh(tiny, tmp_path):
    """The tiny model (H=40, tiles of 8) on a 1x2 mesh: finite, decreasing loss; pp bytes
    = the codec's wire bytes per micro-batch, exactly."""
    import json
    import os

    from tests.test_codecs_aqsgd import mesh_run

    cfg, plan, last = mesh_run(tiny, tmp_path, "tahquant", '{"tile": 8}', steps=8)
    losses = last["losses"]
    assert all(math.isfinite(x) for x in losses) and len(losses) == 8
    assert sum(losses[-3:]) < sum(losses[:3])
    c = make_codec("tahquant", tile=8)
    links = json.load(open(os.path.join(plan.run_dir, "link_bytes.json")))["links"]
    assert links["pp_fwd:0->1"] == 8 * 2 * c.wire_bytes((2, 32, 40), torch.float32, "fwd")
    assert links["pp_bwd:1->0"] == 8 * 2 * c.wire_bytes((2, 32, 40), torch.float32, "bwd")
