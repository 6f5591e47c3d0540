"""pytest-benchmark cases for the mask ops at the issue's target shape (T=4096,
H=2048, p=0.95, fp32), each next to its baseline in one group: pack vs h.clone(),
unpack vs torch.zeros, indices vs the reference. The table with ratios is
``python -m bench.mask_bench``. Run for real with
``pytest bench/test_mask_bench.py --benchmark-enable``; with --benchmark-disable each
case runs once and checks its result against the reference."""
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
    assert torch.equal(benchmark(lambda: meshkern.pack(h, KEY, P, backend=backend)), h.gather(1, idx))


@pytest.mark.benchmark(group="unpack 4096x2048 p=0.95 fp32")
def test_bench_zeros(benchmark):
    assert benchmark(lambda: torch.zeros(T, H)).abs().sum() == 0


@pytest.mark.benchmark(group="unpack 4096x2048 p=0.95 fp32")
@pytest.mark.parametrize("backend", BACKENDS)
def test_bench_unpack(benchmark, data, backend):
    h, idx = data
    v = h.gather(1, idx)
    out = benchmark(lambda: meshkern.unpack(v, KEY, H, P, backend=backend))
    assert torch.equal(out, torch.zeros(T, H).scatter_(1, idx, v))


@pytest.mark.benchmark(group="indices 4096x2048 p=0.95")
@pytest.mark.parametrize("backend", BACKENDS)
def test_bench_indices(benchmark, data, backend):
    _, idx = data
    assert torch.equal(benchmark(lambda: meshkern.mask_indices(KEY, T, H, P, backend=backend)), idx)
