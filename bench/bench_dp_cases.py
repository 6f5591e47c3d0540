"""pytest-benchmark cases for data-parallel compression. A benchmark, not a test (named
``bench_*`` so no pytest run collects it unasked); run it with

    pytest bench/bench_dp_cases.py --benchmark-enable

Small shapes; the full Llama-3.2-1B tables are ``python -m bench.dp_bench``. Each case
checks its result once against an independent computation (the C++ ef_project against
torch's bmm; the reference case only times); correctness lives in tests/test_powersgd.py,
tests/test_sparseloco.py and tests/test_compress_dist.py.
"""
import datetime
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from meshkern import _backend
from meshkern.compress import PowerSGD, SparseLoCo
from meshkern.compress.powersgd_ops import powersgd_ef_project

HAS_CPP = _backend.extension("dp") is not None and hasattr(torch.ops.meshkern_C, "powersgd_ef_project")


@pytest.fixture(scope="module")
def world1():
    created = not dist.is_initialized()
    if created:
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    yield
    if created:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["reference"] + (["cpp"] if HAS_CPP else []))
def test_bench_ef_project(benchmark, backend):
    g = torch.Generator().manual_seed(0)
    grad, err, q = torch.randn(2, 512, 1024, generator=g), torch.zeros(2, 512, 1024), torch.randn(2, 1024, 8, generator=g)
    p = benchmark(powersgd_ef_project, grad, err, q, backend=backend)
    # the last call projected the accumulated err: p == err @ q (torch.bmm, not the
    # reference backend, which is that same bmm)
    assert float(err.abs().sum()) > 0
    if backend != "reference":
        torch.testing.assert_close(p, torch.bmm(err, q), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("rank", [8, 32])
def test_bench_powersgd_layer(benchmark, world1, rank):
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randn(s, generator=g) for s in [(256, 256), (64, 256), (64, 256), (256, 256), (1024, 256),
                                                     (1024, 256), (256, 1024), (256,)]]
    c = PowerSGD(rank)
    out = benchmark(c.all_reduce_mean, tensors, None)
    assert [o.shape for o in out] == [t.shape for t in tensors]
    assert torch.equal(out[-1], tensors[-1])  # 1-D tensor: exact


def test_bench_sparseloco(benchmark, world1):
    x = [torch.randn(64 * 4096, generator=torch.Generator().manual_seed(2))]
    c = SparseLoCo()
    out = benchmark(c.all_reduce_mean, x, None)
    assert int((out[0] != 0).sum()) <= 64 * 64  # at most k per chunk
