"""Every CPU-runnable backend gives bit-identical indices, packed and unpacked values
(the pure-torch reference is the spec), over a grid of shapes, K, dtypes, p, rescale.

The C++ backend is swept widely (it is fast); the interpreted Triton backend, whose
cost is per launch, gets a smaller grid that still covers: K = 1, K = H, H not a
power of two / not a multiple of 32, several programs per launch with a partial last
one, leading dims, every dtype and both rescale settings.
"""
import pytest
import torch

from meshkern import MaskKey, kept_dims, mask_indices, pack, unpack
from test_mask_common import cpp_ready, triton_ready

KEY = MaskKey(seed=2**64 - 1, boundary=65535, step=2**32 - 1, microbatch=12)
KEY2 = MaskKey(seed=42, boundary=0, step=0, microbatch=0)
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _same_everything(backend, key, shape, H, p, dtype, rescale):
    """indices, pack, unpack of ``backend`` equal the reference's, bit for bit."""
    N = int(torch.tensor(shape).prod())
    K = kept_dims(H, p)
    assert torch.equal(mask_indices(key, N, H, p, backend=backend), mask_indices(key, N, H, p, backend="reference"))
    g = torch.Generator().manual_seed(N * H)
    h = (torch.randn(*shape, H, generator=g) * 3).to(dtype)
    v = (torch.randn(*shape, K, generator=g) * 3).to(dtype)
    got, want = pack(h, key, p, rescale=rescale, backend=backend), pack(h, key, p, rescale=rescale, backend="reference")
    assert got.dtype == dtype and torch.equal(got, want)
    got, want = unpack(v, key, H, p, rescale=rescale, backend=backend), unpack(v, key, H, p, rescale=rescale,
                                                                               backend="reference")
    assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.skipif(not cpp_ready(), reason="meshkern._mask_C not built")
@pytest.mark.parametrize("K", range(1, 65))
def test_cpp_every_k_of_64(K):
    p = 1 - K / 64
    assert kept_dims(64, p) == K
    _same_everything("cpp", KEY, (9,), 64, p, DTYPES[K % 4], rescale=K % 2 == 0)


@pytest.mark.skipif(not cpp_ready(), reason="meshkern._mask_C not built")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rescale", [False, True])
@pytest.mark.parametrize("H,p", [(320, 0.95), (320, 0.0), (2050, 0.9), (2050, 0.99), (4096, 0.95), (1, 0.0), (33, 0.5)])
def test_cpp_grid(dtype, rescale, H, p):
    _same_everything("cpp", KEY, (3, 7), H, p, dtype, rescale)
    _same_everything("cpp", KEY2, (5,), H, p, dtype, rescale)


def _cpu_isas():
    """The CPU selection variants this machine has (csrc/mask/select_cpu.h), best last."""
    if not cpp_ready():
        return []
    import os
    old = os.environ.pop("MESHKERN_MASK_ISA", None)
    try:
        best = torch.ops.meshkern_C.mask_cpu_isa()
    finally:
        if old is not None:
            os.environ["MESHKERN_MASK_ISA"] = old
    order = ["generic", "avx2", "avx512"]
    return order[:order.index(best) + 1]


@pytest.mark.skipif(not cpp_ready(), reason="meshkern._mask_C not built")
@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512"])
def test_cpp_every_cpu_variant_is_the_spec(isa, monkeypatch):
    """Each selection variant this CPU has (forced with MESHKERN_MASK_ISA) against the
    reference: K across the vector code's pass boundaries (64 blocks = K 128 / 129 for
    AVX-512, 32 blocks = K 64 / 65 for AVX2, one vector's worth = K 16 / 17 / 32 / 33),
    K < 4 (the scalar path), odd K, H not a multiple of 64, keys with every word set."""
    if isa not in _cpu_isas():
        pytest.skip(f"this CPU has no {isa} variant")
    monkeypatch.setenv("MESHKERN_MASK_ISA", isa)
    assert torch.ops.meshkern_C.mask_cpu_isa() == isa
    for H, K in [(7, 1), (100, 3), (100, 4), (200, 16), (200, 17), (200, 32), (200, 33), (300, 64), (300, 65),
                 (1000, 128), (1000, 129), (1000, 257), (2050, 205), (130, 130)]:
        p = 1 - K / H
        assert kept_dims(H, p) == K
        for key in (KEY, KEY2):
            assert torch.equal(mask_indices(key, 37, H, p, backend="cpp"), mask_indices(key, 37, H, p,
                                                                                        backend="reference")), (H, K)
    _same_everything("cpp", KEY, (3, 5), 2048, 0.95, torch.float32, rescale=True)
    _same_everything("cpp", KEY2, (4,), 1000, 0.9, torch.bfloat16, rescale=False)


@pytest.mark.skipif(not cpp_ready(), reason="meshkern._mask_C not built")
def test_cpp_result_does_not_depend_on_thread_count():
    h = torch.randn(512, 320)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = pack(h, KEY, 0.9, backend="cpp")
        torch.set_num_threads(2)
        two = pack(h, KEY, 0.9, backend="cpp")
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.skipif(not triton_ready(), reason="triton unavailable on CPU")
@pytest.mark.parametrize("H,p,shape,dtype,rescale", [
    (64, 0.0, (5,), torch.float32, False),        # K = H
    (5, 0.8, (4,), torch.bfloat16, True),         # K = 1, H < 32
    (64, 0.5, (2, 3), torch.float16, True),       # leading dims
    (320, 0.95, (7,), torch.bfloat16, False),     # H not a power of two
    (2050, 0.99, (37,), torch.float32, True),     # 2 programs, partial last one
    (33, 0.3, (3,), torch.float64, True),         # H = 32 + 1
])
def test_triton_grid(H, p, shape, dtype, rescale):
    _same_everything("triton", KEY, shape, H, p, dtype, rescale)
