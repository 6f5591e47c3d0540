"""The C++ CPU ops give bit-identical results with 1 and 2 intra-op threads (issue #18).

meshkern.mask's and meshkern.spectral.project's docstrings promise it (rows / batch
entries are split across threads, each computed by one thread in a fixed order); the
other C++ ops (sym_eig's Jacobi kernel, krylov's gram_products, SpectralAdamW's
project_prepared, powersgd_ef_project) are
checked alike, since SpectralAdamW and the DP compressors run them on every rank and the
ranks must agree. (Not the whole randomized_svd: its torch GEMMs and QRs are MKL's, whose
bits may depend on the thread count; its docstring promises determinism per device only.) One process: the thread count is switched with torch.set_num_threads
(conftest sets 1; restored after each case). Sizes are chosen so that every op's
parallel loop has more than one chunk: rows of the mask ops (grain 32K / H rows),
batch entries of the spectral ops, rows of the [B*n, m] view of ef_project."""
import pytest
import torch

import meshkern
from meshkern import MaskKey, _backend
from meshkern import spectral as sp
from meshkern.compress.powersgd_ops import powersgd_ef_project

HAVE_MASK = _backend.extension("mask") is not None
HAVE_SPECTRAL = _backend.extension("spectral") is not None
HAVE_DP = _backend.extension("dp") is not None and hasattr(torch.ops.meshkern_C, "powersgd_ef_project")
KEY = MaskKey(seed=0x5EED, boundary=2, step=17, microbatch=1)


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _mask_ops():
    h = _rand(300, 1024, seed=1)
    v = _rand(300, meshkern.kept_dims(1024, 0.9), seed=2, dtype=torch.bfloat16)
    return (meshkern.mask_indices(KEY, 300, 1024, 0.9, backend="cpp"),
            meshkern.pack(h, KEY, 0.9, backend="cpp"),
            meshkern.pack(h.double(), KEY, 0.5, rescale=True, backend="cpp"),
            meshkern.unpack(v, KEY, 1024, 0.9, backend="cpp"),
            meshkern.unpack(v.float(), KEY, 1024, 0.9, rescale=True, backend="cpp"))


def _project():
    B, m, n, r = 6, 96, 80, 8
    G = _rand(B, m, n, seed=3)
    U = torch.linalg.qr(_rand(B, m, r, seed=4)).Q
    V = torch.linalg.qr(_rand(B, n, r, seed=5)).Q
    S = _rand(B, r, seed=6).abs() * 1e-2
    out, fsq = sp.project(G, U, S, V, 1e-3, 0.3, backend="cpp", return_stats=True)
    o64, f64 = sp.project(G.double(), U, S, V, 1e-3, 0.3, backend="cpp", return_stats=True)
    return out, fsq, o64, f64, sp.project(G.bfloat16(), U, S, V, 1e-3, 0.3, backend="cpp")


def _sym_eig():
    A = _rand(6, 40, 40, seed=7)
    return sp.sym_eig(A + A.mT, backend="cpp")


def _gram_products():
    """krylov's one pass over A (randomized_svd(method="krylov") on CPU): Y = (A V)^T into
    an fp64 slice and Z = (A^T A V)^T, at block sizes this CPU has a kernel for."""
    A = _rand(4, 301, 200, seed=8)
    outs = []
    for b in (8, 16, 32):
        if not torch.ops.meshkern_C.gram_products_supported(b):
            continue
        Vt = _rand(4, b, 200, seed=b)
        Y = torch.zeros(4, b, 301, dtype=torch.float64)
        outs += [torch.ops.meshkern_C.gram_products(A, Vt, True, Y), Y]
    if not outs:
        pytest.skip("no gram_products kernel on this CPU")
    return outs


def _project_prepared():
    """SpectralAdamW's direct projection: rows of out split over threads in blocks of 64
    (300 rows: 5 blocks). r = 16 runs its small products in row panels on AVX2 / AVX-512
    CPUs; without them they are MKL's GEMMs, whose bits may depend on the thread count."""
    if not torch.ops.meshkern_C.gram_products_supported(16):
        pytest.skip("no row-panel kernel for r = 16 on this CPU")
    m, n, r = 300, 200, 16
    G = [_rand(m, n, seed=12), _rand(n, m, seed=13)]
    U = [torch.linalg.qr(_rand(g.shape[0], r, seed=14)).Q.contiguous() for g in G]
    V = [torch.linalg.qr(_rand(g.shape[1], r, seed=15)).Q.contiguous() for g in G]
    outs = [torch.empty_like(g) for g in G]
    xfs = sp.project_prepared(G, U, [(u * 0.5).mT.contiguous() for u in U], [v * 0.25 for v in V],
                              [v.mT.contiguous() for v in V], [0.3, 0.7], outs)
    return outs + xfs


def _ef_project():
    """The specialized fp32 kernel (r = 8) and the generic one (r = 6; fp64)."""
    outs = []
    for r, dtype in ((8, torch.float32), (6, torch.float32), (8, torch.float64)):
        grad, err = _rand(2, 512, 256, seed=9, dtype=dtype), _rand(2, 512, 256, seed=10, dtype=dtype)
        outs += [powersgd_ef_project(grad, err, _rand(2, 256, r, seed=11, dtype=dtype), backend="cpp"), err]
    return outs


CASES = [
    pytest.param(_mask_ops, id="mask", marks=pytest.mark.skipif(not HAVE_MASK, reason="meshkern._mask_C not built")),
    pytest.param(_project, id="project", marks=pytest.mark.skipif(not HAVE_SPECTRAL, reason="not built")),
    pytest.param(_sym_eig, id="sym_eig", marks=pytest.mark.skipif(not HAVE_SPECTRAL, reason="not built")),
    pytest.param(_gram_products, id="gram_products", marks=pytest.mark.skipif(not HAVE_SPECTRAL, reason="not built")),
    pytest.param(_project_prepared, id="project_prepared",
                 marks=pytest.mark.skipif(not HAVE_SPECTRAL, reason="not built")),
    pytest.param(_ef_project, id="ef_project", marks=pytest.mark.skipif(not HAVE_DP, reason="not built")),
]


@pytest.mark.parametrize("run", CASES)
def test_cpp_ops_are_bit_identical_with_1_and_2_threads(run):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        assert torch.get_num_threads() == 2
        two = run()
    finally:
        torch.set_num_threads(before)
    assert len(one) == len(two)
    for i, (a, b) in enumerate(zip(one, two)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        assert torch.equal(a, b), f"output {i} differs with 2 threads: max |diff| {(a.double() - b.double()).abs().max():.3e}"
