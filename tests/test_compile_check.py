"""bench/compile_check.py: the ptxas log parser, the verdict rules, the launch capture, and
one real ahead-of-time compile (a small kernel for sm_86, in a fresh process: this one runs
Triton interpreted). The full check is ``python -m bench.compile_check --triton``."""
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from bench import compile_check as cc  # noqa: E402
from meshkern.triton_kernels import _target  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LOG = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_move_kernel' for 'sm_80'
ptxas info    : Function properties for _move_kernel
    240 bytes stack frame, 236 bytes spill stores, 232 bytes spill loads
ptxas info    : Used 255 registers, used 0 barriers, 240 bytes cumulative stack size, 424 bytes cmem[0]
"""


def test_parse_ptxas():
    assert cc.parse_ptxas(LOG) == {"regs": 255, "spill_stores": 236, "spill_loads": 232, "stack": 240}
    clean = "ptxas info    : Used 40 registers, used 1 barriers, 424 bytes cmem[0]\n"
    assert cc.parse_ptxas(clean) == {"regs": 40, "spill_stores": 0, "spill_loads": 0, "stack": 0}
    with pytest.raises(ValueError, match="registers"):
        cc.parse_ptxas("nothing here")


def _res(smem=0, spill=0):
    return {"regs": 64, "spill_stores": spill, "spill_loads": spill, "stack": spill, "smem": smem}


def test_verdict_rules():
    assert cc.verdict(_res(smem=101376), 86, True, None) == []  # exactly the limit fits
    assert "per block" in cc.verdict(_res(smem=101377), 86, False, None)[0]
    assert cc.verdict(_res(smem=101377), 90, False, None) == []  # sm_90 allows 227 KiB
    assert cc.verdict(_res(spill=8), 90, False, None) == []  # spills only fail hot kernels
    assert cc.verdict(_res(spill=8), 90, True, None) == ["spills in a hot kernel"]
    assert "estimate" in cc.verdict(_res(smem=4096), 90, False, 2048)[0]
    assert cc.verdict({"error": "CompilationError: boom"}, 80, False, None) == ["CompilationError: boom"]


def test_shared_memory_table_and_aot_arch():
    # cudaDevAttrMaxSharedMemoryPerBlockOptin of each arch the check compiles for
    assert {a: _target.SHARED_PER_BLOCK[a] for a in cc.ARCHS} == {80: 166912, 86: 101376, 89: 101376, 90: 232448}
    cpu = torch.device("cpu")
    assert _target.shared_memory_limit(cpu) is None
    with _target.aot_arch(86):
        assert _target.shared_memory_limit(cpu) == 101376
        with _target.aot_arch(90):
            assert _target.shared_memory_limit(torch.device("meta")) == 232448
        assert _target.shared_memory_limit(cpu) == 101376
    assert _target.shared_memory_limit(cpu) is None
    with pytest.raises(ValueError, match="unknown compute capability"):
        with _target.aot_arch(75):
            pass


def test_jacobi_launcher_refuses_what_an_arch_cannot_hold():
    from meshkern.triton_kernels import jacobi

    meta = torch.device("meta")
    with _target.aot_arch(86):  # 99 KiB: K = 128 needs 128 KiB in fp32
        assert jacobi.max_k(meta, torch.float32) == 64 and jacobi.max_k(meta, torch.float64) == 64
        with pytest.raises(ValueError, match="k <= 64 on this device"):
            jacobi.sym_eig_jacobi(torch.empty(2, 112, 112, device=meta), 10)
    with _target.aot_arch(90):
        assert jacobi.max_k(meta, torch.float32) == 128 and jacobi.max_k(meta, torch.float64) == 64
    assert jacobi.max_k(torch.device("cpu"), torch.float64) == 128  # the interpreter has no limit


def test_every_case_is_named_once_and_covers_the_hot_kernels():
    names = [n for n, _ in cc.cases()]
    assert len(names) == len(set(names))
    for group in ("mask.pack", "mask.unpack", "projection", "jacobi", "subspace", "pca.encode", "pca.decode"):
        assert any(n.startswith(group) for n in names), group
    for H in cc.HIDDEN:
        assert any(f"H={H}" in n for n in names if n.startswith("pca"))


def _check(*args, cache, timeout=240):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=ROOT, OMP_WAIT_POLICY="PASSIVE", MESHKERN_COMPILE_CACHE=str(cache))
    return subprocess.run([sys.executable, "-m", "bench.compile_check", "--triton", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_one_real_compile_for_sm86(tmp_path):
    """A real compile (Triton -> PTX -> ptxas) of the smallest configuration, uncached;
    the line reports registers, spills and shared memory, and the exit status is 0; the
    result lands in the cache and a rerun reads it."""
    r = _check("--only", "philox ours", "--arch", "86", "--jobs", "1", cache=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("OK")]
    assert len(lines) == 1 and "[_philox_kernel w4] sm_86:" in lines[0], r.stdout
    assert " regs, 0 B spill, " in lines[0] and lines[0].endswith(" B smem")
    assert len(list(tmp_path.glob("*.json"))) == 1
    again = _check("--only", "philox ours", "--arch", "86", "--jobs", "1", cache=tmp_path)
    assert again.returncode == 0 and [ln for ln in again.stdout.splitlines() if ln.startswith("OK")] == lines


def test_capture_records_launches_without_running(monkeypatch):
    """Under capture() a launcher's kernel[grid](...) is recorded, not run (meta tensors
    have no data; a real launch would fail)."""
    code = ("import torch; from bench import compile_check as cc; from meshkern.triton_kernels import mask\n"
            "from meshkern.triton_kernels import _target\n"
            "with _target.aot_arch(90), cc.capture() as seen:\n"
            "    mask.pack(torch.empty(64, 2048, device='meta'), (1, 2, 3, 4), 102, None)\n"
            "(l,) = seen\n"
            "print(l.fn.fn.__name__, l.kwargs['BLOCK_T'], l.kwargs['NW'], l.kwargs['num_warps'])\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["_move_kernel", "1", "64", "4"]  # GPU tile: 2048 elements, 4 warps


def test_parse_nvcc_ptxas_log():
    from bench import compile_check_cuda as cuda

    log = ("ptxas info    : Compiling entry function '_Z6kernelPf' for 'sm_90'\n"
           "ptxas info    : Function properties for _Z6kernelPf\n"
           "    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 40 registers, used 1 barriers, 1024 bytes smem, 360 bytes cmem[0]\n"
           "ptxas info    : Compiling entry function '_Z1gv' for 'sm_90'\n"
           "ptxas info    : Used 8 registers, used 0 barriers, 352 bytes cmem[0]\n")
    assert cuda.parse_ptxas(log) == [
        {"name": "_Z6kernelPf", "arch": "sm_90", "regs": 40, "spills": 12, "smem": 1024},
        {"name": "_Z1gv", "arch": "sm_90", "regs": 8, "spills": 0, "smem": 0}]
    assert cuda.short_name("void meshkern::mask::(anonymous namespace)::move_kernel<float, true>(float const*, "
                           "float*, long)") == "meshkern::mask::move_kernel<float, true>"
