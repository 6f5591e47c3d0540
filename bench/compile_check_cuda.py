"""``python -m bench.compile_check --cuda``: compile every csrc/**/*.cu with nvcc for each
arch, on a machine without a GPU, and report each kernel's registers, spills and static
shared memory from ``-Xptxas -v``. A pre-release step (minutes: on 2 cores
csrc/mask/mask_cuda.cu took ~1.5 min and csrc/spectral/jacobi_cuda.cu ~2.3 min for sm_90
alone), not part of CI.

Headers: a CPU torch wheel lacks the CUDA headers (c10/cuda/...). The first run fetches
the CUDA build of torch ``TORCH_FOR_HEADERS`` once, with pip's own client:

    pip download --no-deps torch==2.14.1 -d DIR        # ~555 MB wheel, seconds
    unzip the wheel's torch/include/ into $MESHKERN_CUDA_HEADERS (default
    ~/.cache/meshkern/torch-2.14.1-include), then the wheel is deleted

or pass ``--torch-include DIR`` (a CUDA torch's include/ folder). With torch 2.14's
headers nvcc needs -std=c++20. nvcc: $CUDA_HOME/bin/nvcc, else the one on PATH.

Exit status 1 on a compile error, static shared memory over the arch's per-block limit,
or spills in a file listed in HOT_CU (the mask kernels, on every boundary). Dynamic
shared memory (the <<<..., bytes>>> of a launch) is not visible to the compiler: the
launchers check it against the device at run time.
"""
from __future__ import annotations

import concurrent.futures as futures
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile

TORCH_FOR_HEADERS = "2.14.1"
HOT_CU = ("csrc/mask/mask_cuda.cu",)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# torch.utils.cpp_extension.COMMON_NVCC_FLAGS (what the real build passes), plus ours.
NVCC_FLAGS = ["-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
              "-D__CUDA_NO_HALF2_OPERATORS__", "--expt-relaxed-constexpr", "-O3", "-DMESHKERN_WITH_CUDA",
              "-std=c++20", "-Xptxas", "-v", "-DTORCH_EXTENSION_NAME=compile_check", "-D_GLIBCXX_USE_CXX11_ABI=1"]


def headers(torch_include: str | None) -> str:
    """A CUDA torch's include/ folder: ``torch_include``, or the cache (fetched once)."""
    if torch_include:
        return torch_include
    cache = os.environ.get("MESHKERN_CUDA_HEADERS") or os.path.expanduser(
        f"~/.cache/meshkern/torch-{TORCH_FOR_HEADERS}-include")
    inc = os.path.join(cache, "torch", "include")
    if os.path.exists(os.path.join(inc, "c10", "cuda", "CUDAStream.h")):
        return inc
    print(f"compile_check --cuda: fetching torch=={TORCH_FOR_HEADERS}'s CUDA headers once into {cache} "
          f"(pip download, ~555 MB)", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", f"torch=={TORCH_FOR_HEADERS}",
                        "-d", tmp, "-q"], check=True)
        (wheel,) = glob.glob(os.path.join(tmp, "torch-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            z.extractall(cache, [n for n in z.namelist() if n.startswith("torch/include/")])
    return inc


def nvcc() -> str:
    home = os.environ.get("CUDA_HOME")
    path = os.path.join(home, "bin", "nvcc") if home else shutil.which("nvcc")
    if not path or not os.path.exists(path):
        raise SystemExit("compile_check --cuda: no nvcc (set CUDA_HOME or put nvcc on PATH)")
    return path


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+a?)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas(log: str) -> list[dict]:
    """One dict per entry function in an nvcc -Xptxas -v log: name, arch, regs, spills
    (stores + loads, bytes), smem (static bytes)."""
    out, cur = [], None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            cur = {"name": m.group(1), "arch": m.group(2), "regs": 0, "spills": 0, "smem": 0}
            out.append(cur)
        elif cur is not None and (m := _FRAME.search(line)):
            cur["spills"] = int(m.group(2)) + int(m.group(3))
        elif cur is not None and (m := _USED.search(line)):
            cur["regs"] = int(m.group(1))
            cur["smem"] = int(m.group(2) or 0)
    return out


def _demangle(names: list[str]) -> list[str]:
    tool = shutil.which("c++filt")
    if not tool or not names:
        return names
    r = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True)
    return r.stdout.splitlines() if r.returncode == 0 else names


def short_name(demangled: str) -> str:
    """``void ns::(anonymous namespace)::kern<float, true>(float const*, ...)`` -> ``ns::kern<float, true>``."""
    name = demangled.replace("(anonymous namespace)::", "").removeprefix("void ")
    return name.split("(")[0]


def compile_one(cu: str, arch: int, inc: str) -> tuple[int, str]:
    """(nvcc's exit status, its output) for ``cu`` at sm_``arch``."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [nvcc(), "-c", os.path.join(ROOT, cu), "-o", os.path.join(tmp, "x.o"),
               f"-gencode=arch=compute_{arch},code=sm_{arch}", "-I", inc,
               "-I", os.path.join(inc, "torch", "csrc", "api", "include"), "-I", os.path.join(ROOT, "csrc", "common"),
               "-I", sysconfig.get_paths()["include"], *NVCC_FLAGS]
        r = subprocess.run(cmd, capture_output=True, text=True)
        return r.returncode, r.stdout + r.stderr


def run(archs, torch_include, jobs) -> int:
    from meshkern.triton_kernels._target import SHARED_PER_BLOCK

    inc = headers(torch_include)
    files = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "csrc", "**", "*.cu"),
                                                             recursive=True))
    work = [(cu, a) for cu in files for a in archs]
    with futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        results = list(pool.map(lambda w: compile_one(w[0], w[1], inc), work))
    failures = 0
    for (cu, arch), (rc, log) in zip(work, results):
        if rc != 0:
            failures += 1
            err = next((line for line in log.splitlines() if "error" in line), log.strip()[-300:])
            print(f"ERROR   {cu} sm_{arch}: {err}")
            continue
        kernels = parse_ptxas(log)
        for k, name in zip(kernels, _demangle([k["name"] for k in kernels])):
            problems = []
            if k["smem"] > SHARED_PER_BLOCK[arch]:
                problems.append(f"static smem over sm_{arch}'s {SHARED_PER_BLOCK[arch]} B")
            if k["spills"] and cu in HOT_CU:
                problems.append("spills in a hot kernel")
            failures += bool(problems)
            print(f"{'FAIL' if problems else 'OK':<8}{cu} {short_name(name)} sm_{arch}: {k['regs']} regs, "
                  f"{k['spills']} B spill, {k['smem']} B static smem" + (f"  <- {'; '.join(problems)}" if problems
                                                                        else ""))
    print(f"== {len(work)} nvcc compiles, {failures} failing")
    return 1 if failures else 0
