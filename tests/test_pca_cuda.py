"""The compiled Triton pca kernels on a GPU against the reference (on CPU tensors: a CPU
sender and a GPU receiver must agree), at the codec's real widths and launch shapes.

Marked ``cuda``: skipped without a GPU (bench/gpu_check.sh runs it on a GPU machine).
Same rules as tests/test_pca_ops.py: quantizer bit for bit, codes equal off rounding ties,
decoded values to fp32 rounding of the sum over k.
"""
import pytest
import torch

from meshkern import pca
from test_pca_ops import _assert_codes_match, _basis, _c_ref, _h

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]
CUDA = torch.device("cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H", [576, 2048])
def test_encode_decode_match_reference(H, dtype):
    k = pca.CODEC_WIDTH[H]
    U, mean, sd = _basis(H, k)
    h = _h((4, 128, H), dtype)
    want = pca.encode(h, U, sd, mean=mean, backend="reference")
    got = pca.encode(h.to(CUDA), U.to(CUDA), sd.to(CUDA), mean=mean.to(CUDA), backend="triton")
    got = [t.cpu() for t in got]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])  # the sink rows
    _assert_codes_match(got[2:], want[2:], _c_ref(h, U, sd, mean, True), 4)
    kw = dict(shape=h.shape, dtype=dtype)
    dec = pca.decode([t.to(CUDA) for t in want], U.to(CUDA), sd.to(CUDA), mean=mean.to(CUDA), backend="triton", **kw)
    ref = pca.decode(want, U, sd, mean=mean, backend="reference", **kw)
    tol = dict(rtol=1e-5, atol=1e-3) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-2)
    torch.testing.assert_close(dec.cpu().float(), ref.float(), **tol)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantizer_bit_identical(bits):
    from meshkern.pca import quantize_reference
    from meshkern.triton_kernels import pca as tk

    c = torch.randn(300, 1050, generator=torch.Generator().manual_seed(0))
    q, s = tk.quantize_rows(c.to(CUDA), 300, 1050, [300, 300, 0], bits)
    qr, sr = quantize_reference(c, bits)
    assert torch.equal(q.cpu(), qr) and torch.equal(s.cpu(), sr.reshape(-1))


@pytest.mark.parametrize("H,budget", [(576, 15), (576, 30), (2048, 15)])
def test_nf_pack_unpack_bit_identical(H, budget):
    """pca:quant=nf's compiled Triton pack / unpack against the reference's codes and
    stream, at calibrated layouts (widths from allocate_bits at 1/budget of dense fp32)."""
    from meshkern import pca_nf
    from meshkern.triton_kernels import pca_nf as tk
    from orchestration.codecs.pca_nf import nf_code_bytes

    nb = nf_code_bytes(H, budget, True, 128)
    bits = pca_nf.allocate_bits(torch.arange(1, H + 1, dtype=torch.float64) ** -1.5, 8 * nb)
    bits = bits[bits > 0]
    lv, bd = pca_nf._tables(bits, "cpu")
    z = torch.randn(4 * 127, bits.numel(), generator=torch.Generator().manual_seed(1)) * 1.3
    z[0], z[1] = float("nan"), float("inf")
    want = pca_nf.pack_codes(torch.minimum(torch.searchsorted(bd, z.T.contiguous()).T, (1 << bits) - 1), bits, nb)
    got = tk.pack(z.to(CUDA), bd.to(CUDA), bits, nb)
    assert torch.equal(got.cpu(), want)
    codes = pca_nf.unpack_codes(want, bits)
    assert torch.equal(tk.unpack(want.to(CUDA), lv.to(CUDA), bits).cpu(), lv.gather(1, codes.T.contiguous()).T)
    # the codec path on CUDA picks these kernels ("auto": no CUDA C++ nf kernel)
    assert pca_nf._which(CUDA, "auto") == "triton"
