"""pytest-benchmark cases for the mask ops at the issue's target shape (T=4096,
H=2048, p=0.95, fp32), each next to its baseline in one group: pack vs h.clone(),
unpack vs torch.zeros, indices vs the reference. A benchmark, not a test (named
``bench_*`` so no pytest run collects it unasked); run it with

    pytest bench/bench_mask_cases.py --benchmark-enable

The table with ratios is ``python -m bench.mask_bench``. Each compiled backend's result
is compared with the reference's; the reference cases only time (comparing the
reference with the formula it is written as proves nothing). Correctness lives in
tests/: test_mask_golden.py (known-answer indices), test_mask_backends.py and
test_mask.py (every backend against the reference, autograd, dtypes)."""
import pytest
import torch

import meshkern
from meshkern import MaskKey, kept_dims
from meshkern import _backend

torch.set_num_threads(1)
T, H, P = 4096, 2048, 0.95
K = kept_dims(H, P)
KEY = MaskKey(seed=0x5EED, boundary=1, step=100, microbatch=3)
HAVE_CPP = _backend.extension("mask") is not None and hasattr(torch.ops.meshkern_C, "mask_pack")
BACKENDS = [pytest.param("cpp", marks=pytest.mark.skipif(not HAVE_CPP, reason="not built")), "reference"]


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(T, H, generator=g)
    idx = meshkern.mask_indices(KEY, T, H, P, backend="reference")
    return h, idx


@pytest.mark.benchmark(group="pack 4096x2048 p=0.95 fp32")
def test_bench_clone(benchmark, data):
    h, _ = data
    assert torch.equal(benchmark(h.clone), h)


@pytest.mark.benchmark(group="pack 4096x2048 p=0.95 fp32")
@pytest.mark.parametrize("backend", BACKENDS)
def test_bench_pack(benchmark, data, backend):
    h, idx = data
    out = benchmark(lambda: meshkern.pack(h, KEY, P, backend=backend))
    if backend != "reference":
        assert torch.equal(out, h.gather(1, idx))


@pytest.mark.benchmark(group="unpack 4096x2048 p=0.95 fp32")
def test_bench_zeros(benchmark):
    assert benchmark(lambda: torch.zeros(T, H)).abs().sum() == 0


@pytest.mark.benchmark(group="unpack 4096x2048 p=0.95 fp32")
@pytest.mark.parametrize("backend", BACKENDS)
def test_bench_unpack(benchmark, data, backend):
    h, idx = data
    v = h.gather(1, idx)
    out = benchmark(lambda: meshkern.unpack(v, KEY, H, P, backend=backend))
    if backend != "reference":
        assert torch.equal(out, torch.zeros(T, H).scatter_(1, idx, v))


@pytest.mark.benchmark(group="indices 4096x2048 p=0.95")
@pytest.mark.parametrize("backend", BACKENDS)
def test_bench_indices(benchmark, data, backend):
    _, idx = data
    out = benchmark(lambda: meshkern.mask_indices(KEY, T, H, P, backend=backend))
    if backend != "reference":
        assert torch.equal(out, idx)
