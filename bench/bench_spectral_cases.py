"""pytest-benchmark cases for the spectral ops (small shapes; the full table is
``python -m bench.spectral_bench``). A benchmark, not a test (named ``bench_*`` so no
pytest run collects it unasked); run it with

    pytest bench/bench_spectral_cases.py --benchmark-enable

Each case also checks its result once (against a known spectrum or the other
implementation in its group); correctness lives in tests/test_spectral*.py and
tests/test_optim*.py. Compare the groups' rows: each group holds a meshkern op and its
torch baseline."""
import pytest
import torch

from bench.spectral_bench import known_spectrum_batch, harmonic, llama_layer_shapes, unfused_chain
from meshkern import _backend
from meshkern import spectral as sp
from meshkern.optim import SpectralAdamW

torch.set_num_threads(1)
HAVE_CPP = _backend.extension("spectral") is not None
B, M, RANK = 4, 256, 32


@pytest.fixture(scope="module")
def spectrum_batch():
    s = harmonic(M)
    return known_spectrum_batch(B, M, M, s), s


@pytest.mark.benchmark(group="svd 4x[256,256] r=32")
def test_bench_torch_svd(benchmark, spectrum_batch):
    Mx, s = spectrum_batch
    S = benchmark(lambda: torch.linalg.svd(Mx, full_matrices=False))[1]
    assert torch.allclose(S[:, :RANK].double(), s[:RANK].expand(B, RANK), rtol=1e-4)


@pytest.mark.benchmark(group="svd 4x[256,256] r=32")
@pytest.mark.parametrize("backend", [pytest.param("cpp", marks=pytest.mark.skipif(not HAVE_CPP, reason="not built")),
                                     "reference"])
def test_bench_randomized_svd(benchmark, spectrum_batch, backend):
    Mx, s = spectrum_batch
    _, S, _ = benchmark(lambda: sp.randomized_svd(Mx, RANK, backend=backend))
    assert ((S.double() - s[:RANK]) / s[:RANK]).abs().max() < 0.01


@pytest.fixture(scope="module")
def proj_inputs():
    g = torch.Generator().manual_seed(0)
    G = torch.randn(B, M, M, generator=g)
    U = torch.linalg.qr(torch.randn(B, M, RANK, generator=g)).Q
    V = torch.linalg.qr(torch.randn(B, M, RANK, generator=g)).Q
    S = torch.rand(B, RANK, generator=g) * 1e-2
    return G, U, S, V


@pytest.mark.benchmark(group="projection 4x[256,256] r=32 fp32")
def test_bench_unfused_chain(benchmark, proj_inputs):
    G, U, S, V = proj_inputs
    out = benchmark(lambda: unfused_chain(G, U, S, V, 1e-3, 0.3))
    assert torch.allclose(out, sp.project(G, U, S, V, 1e-3, 0.3, backend="reference"), atol=1e-5)


@pytest.mark.benchmark(group="projection 4x[256,256] r=32 fp32")
@pytest.mark.skipif(not HAVE_CPP, reason="meshkern._spectral_C not built")
def test_bench_fused_projection(benchmark, proj_inputs):
    G, U, S, V = proj_inputs
    out = benchmark(lambda: sp.project(G, U, S, V, 1e-3, 0.3, backend="cpp"))
    assert torch.allclose(out, unfused_chain(G, U, S, V, 1e-3, 0.3), atol=1e-5)


def _opt(cls, **kw):
    g = torch.Generator().manual_seed(0)
    shapes = llama_layer_shapes(hidden=256, ffn=1024, heads=4, kv_heads=2, layers=4)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in shapes]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return ps, cls(ps, lr=1e-4, foreach=False, **kw)


@pytest.mark.benchmark(group="optimizer step, 4 Llama-shaped layers (hidden 256)")
def test_bench_adamw_step(benchmark):
    ps, opt = _opt(torch.optim.AdamW)
    before = ps[0].detach().clone()
    benchmark(opt.step)
    assert not torch.equal(before, ps[0])


@pytest.mark.benchmark(group="optimizer step, 4 Llama-shaped layers (hidden 256)")
def test_bench_spectral_adamw_step_no_refresh(benchmark):
    ps, opt = _opt(SpectralAdamW, rank=RANK)
    g = torch.Generator().manual_seed(1)
    assert opt.observe_anchor([torch.randn(p.shape, generator=g) for p in ps], 20)
    opt.step()  # the one refresh
    benchmark(opt.step)
    assert opt.anchor_stats()["refreshes"] == 1 and 0 < opt.anchor_stats()["energy_kept"] < 1
