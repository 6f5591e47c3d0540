"""SparseLoCo and Int8 pieces in one process: bit packing, 2-bit quantization and
top-k density vs loop references, error feedback, message bytes. The all_gather
average on 3 ranks is in tests/test_compress_dist.py."""
import math

import pytest
import torch

from meshkern.compress import Int8, SparseLoCo
from meshkern.compress.packing import index_bits, pack_bits, packed_nbytes, to_chunks, unpack_bits
from meshkern.compress.sparseloco import dequantize_2bit, quantize_2bit


@pytest.mark.parametrize("bits", [1, 2, 3, 7, 12, 16])
def test_pack_unpack_roundtrip(bits):
    v = torch.randint(0, 1 << bits, (101,), generator=torch.Generator().manual_seed(bits))
    packed = pack_bits(v, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(101 * bits / 8)
    assert torch.equal(unpack_bits(packed, bits, 101), v)


def test_pack_bit_order_known_answer():
    # little-endian: values 1, 2, 3 at 2 bits -> bits 10 01 11 -> byte 0b00111001
    assert pack_bits(torch.tensor([1, 2, 3]), 2).tolist() == [0b00111001]
    with pytest.raises(ValueError, match="out of range"):
        pack_bits(torch.tensor([4]), 2)


def _quantize_loop(vals):
    """Loop reference of the documented 2-bit scheme."""
    codes = torch.zeros(vals.shape, dtype=torch.int64)
    scales = torch.zeros(vals.shape[0], 2)
    for c in range(vals.shape[0]):
        mags = [abs(float(v)) for v in vals[c]]
        thr = sum(mags) / len(mags)
        big = [m > thr for m in mags]
        hi = [m for m, b in zip(mags, big) if b]
        lo = [m for m, b in zip(mags, big) if not b]
        scales[c, 0] = sum(lo) / len(lo) if lo else 0.0
        scales[c, 1] = sum(hi) / len(hi) if hi else 0.0
        for i, v in enumerate(vals[c]):
            codes[c, i] = 2 * int(float(v) < 0) + int(big[i])
    return codes, scales


def test_quantize_2bit_matches_loop_reference():
    vals = torch.randn(5, 16, generator=torch.Generator().manual_seed(0))
    vals[3] = 0.5  # all equal: every value on the low level, high level empty (scale 0)
    codes, scales = quantize_2bit(vals)
    rc, rs = _quantize_loop(vals)
    assert torch.equal(codes, rc)
    torch.testing.assert_close(scales, rs)
    deq = dequantize_2bit(codes, scales)
    assert torch.equal(torch.sign(deq), torch.sign(vals))
    # each level keeps its mean magnitude: sum |deq| == sum |vals| per chunk
    torch.testing.assert_close(deq.abs().sum(1), vals.abs().sum(1))


def test_topk_density_error_feedback_and_message_size():
    chunk, density, decay = 256, 1 / 32, 0.9
    c = SparseLoCo(density, chunk=chunk, decay=decay)
    k = 8
    assert c.k == k
    g = torch.Generator().manual_seed(1)
    e_prev = torch.zeros(6, chunk)
    for step in range(3):
        x = torch.randn(6, chunk, generator=g)
        acc = decay * e_prev + x
        msg, idx, v_hat, nc = c.encode(x, "k")
        # density: exactly k distinct kept entries per chunk, and they are the top-k of |acc|
        assert idx.shape == (6, k) and all(len(set(r.tolist())) == k for r in idx)
        kth = acc.abs().topk(k, dim=1).values[:, -1:]
        assert bool((torch.gather(acc.abs(), 1, idx) >= kth).all())
        # error feedback: what was not sent stays in the accumulator
        sent = torch.zeros_like(acc).scatter_(1, idx, v_hat)
        torch.testing.assert_close(c._state["k"], acc - sent)
        torch.testing.assert_close(v_hat, dequantize_2bit(*quantize_2bit(torch.gather(acc, 1, idx))))
        # message: 8-bit indices, 2-bit codes, two fp32 scales per chunk
        assert msg.numel() == packed_nbytes(6 * k, index_bits(chunk)) + packed_nbytes(6 * k, 2) + 6 * 8
        assert msg.numel() == c.payload_bytes_for([(6 * chunk,)])
        di, dv = c.decode(msg, nc)
        assert torch.equal(di, idx) and torch.equal(dv, v_hat)
        e_prev = c._state["k"].clone()


def test_compression_ratio_of_the_defaults():
    c = SparseLoCo()  # density 1/64, chunk 4096 -> k 64, 12-bit indices
    numel = 4096 * 1000
    assert c.payload_bytes_for([(numel,)]) == 1000 * (64 * 12 // 8 + 64 * 2 // 8 + 8)
    ratio = numel * 4 / c.payload_bytes_for([(numel,)])
    assert 100 < ratio < 150


def test_decode_rejects_out_of_chunk_indices():
    c = SparseLoCo(0.1, chunk=100)  # 7-bit indices can say 127 > 99
    x, _ = to_chunks([torch.randn(200)], 100)
    msg, _, _, nc = c.encode(x)
    bad = msg.clone()
    bad[0] = 0xFF
    with pytest.raises(ValueError, match="outside its chunk"):
        c.decode(bad, nc)


def test_bad_arguments():
    with pytest.raises(ValueError, match="density"):
        SparseLoCo(0.0)
    with pytest.raises(ValueError, match="chunk"):
        SparseLoCo(chunk=1)
    with pytest.raises(ValueError, match="decay"):
        SparseLoCo(decay=1.5)
    with pytest.raises(ValueError, match="chunk"):
        Int8(chunk=0)


def test_int8_quantize_known_answer():
    q, s = Int8.quantize(torch.tensor([[1.0, -0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    assert q.tolist() == [[127, -64, 32, 0], [0, 0, 0, 0]]  # round(-63.5) = -64 (half to even)
    torch.testing.assert_close(s, torch.tensor([1 / 127, 0.0]))
