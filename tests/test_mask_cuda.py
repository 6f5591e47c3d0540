"""GPU backends (CUDA kernels, compiled Triton) against the reference, bit for bit.

Marked ``cuda``: skipped without a GPU (run by bench/gpu_check.sh on a GPU machine).
The reference runs on CPU tensors here, so these tests also check that a CPU sender
and a GPU receiver agree.
"""
import pytest
import torch
from torch.library import opcheck

from meshkern import MaskKey, kept_dims, mask_indices, pack, unpack
from meshkern import _backend

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

KEY = MaskKey(seed=2**64 - 1, boundary=65535, step=2**32 - 1, microbatch=12)
CUDA = torch.device("cuda")


def gpu_backends():
    return [
        pytest.param("cuda", marks=pytest.mark.skipif(
            not torch.cuda.is_available() or not _backend.has_cuda_kernels("mask"),
            reason="needs a GPU and meshkern built with CUDA kernels")),
        pytest.param("triton", marks=pytest.mark.skipif(
            not torch.cuda.is_available() or not _backend.triton_importable(), reason="needs a GPU and triton")),
    ]


@pytest.mark.parametrize("backend", gpu_backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("rescale", [False, True])
@pytest.mark.parametrize("H,p,shape", [
    (2048, 0.95, (4, 256)), (4096, 0.9, (300,)), (2050, 0.99, (3, 5)), (320, 0.0, (33,)), (5, 0.8, (7,)),
    (64, 0.5, (1000,)), (16384, 0.95, (9,)),
])
def test_bit_identical_to_reference(backend, dtype, rescale, H, p, shape):
    N = int(torch.tensor(shape).prod())
    K = kept_dims(H, p)
    assert torch.equal(mask_indices(KEY, N, H, p, device=CUDA, backend=backend).cpu(),
                       mask_indices(KEY, N, H, p, backend="reference"))
    g = torch.Generator().manual_seed(N + H)
    h = (torch.randn(*shape, H, generator=g) * 3).to(dtype)
    v = (torch.randn(*shape, K, generator=g) * 3).to(dtype)
    assert torch.equal(pack(h.to(CUDA), KEY, p, rescale=rescale, backend=backend).cpu(),
                       pack(h, KEY, p, rescale=rescale, backend="reference"))
    assert torch.equal(unpack(v.to(CUDA), KEY, H, p, rescale=rescale, backend=backend).cpu(),
                       unpack(v, KEY, H, p, rescale=rescale, backend="reference"))


@pytest.mark.parametrize("K", [1, 2, 3, 31, 32, 33, 63, 64, 65, 127, 128])
def test_every_warp_boundary_of_k(K):
    """K around multiples of 32 blocks / 64 draws (the CUDA kernel's shuffle rounds)."""
    H = 256
    p = 1 - K / H
    for backend in ("cuda", "triton"):
        if backend == "cuda" and not _backend.has_cuda_kernels("mask"):
            continue
        got = mask_indices(KEY, 40, H, p, device=CUDA, backend=backend).cpu()
        assert torch.equal(got, mask_indices(KEY, 40, H, p, backend="reference")), backend


@pytest.mark.parametrize("backend", gpu_backends())
def test_opcheck_and_gradcheck(backend):
    w = KEY.words()
    h = torch.randn(2, 3, 40, device=CUDA, requires_grad=True)
    v = torch.randn(2, 3, 10, device=CUDA, requires_grad=True)
    opcheck(torch.ops.meshkern.mask_pack.default, (h, *w, 0.75, True, backend))
    opcheck(torch.ops.meshkern.mask_unpack.default, (v, *w, 40, 0.75, False, backend))
    opcheck(torch.ops.meshkern.mask_indices.default, (*w, 6, 40, 0.75, CUDA, backend))
    hd = torch.randn(2, 20, dtype=torch.float64, device=CUDA, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: pack(x, KEY, 0.5, rescale=True, backend=backend), (hd,))


@pytest.mark.parametrize("backend", gpu_backends())
def test_non_contiguous_and_empty(backend):
    h = torch.randn(40, 6, 5, device=CUDA).permute(1, 2, 0)
    assert torch.equal(pack(h, KEY, 0.75, backend=backend).cpu(), pack(h.cpu().contiguous(), KEY, 0.75, backend="reference"))
    assert pack(torch.empty(0, 40, device=CUDA), KEY, 0.75, backend=backend).shape == (0, 10)
    assert unpack(torch.empty(0, 10, device=CUDA), KEY, 40, 0.75, backend=backend).shape == (0, 40)


def test_triton_philox_known_answers_on_gpu():
    from meshkern.triton_kernels.philox import builtin_philox4x32, philox4x32
    c = torch.tensor([[0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344]], dtype=torch.int64, device=CUDA)
    assert philox4x32(c, 0xA4093822, 0x299F31D0).cpu().tolist() == [[0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]]
    seed = (0x299F31D0 << 32) | 0xA4093822
    assert builtin_philox4x32(c, seed).cpu().tolist() == [[0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]]
