"""Builds meshkern's C++ (OpenMP) and, when possible, CUDA extensions.

One extension per op group, each from ``csrc/<group>/*.cpp`` (+ ``*.cu`` when CUDA is
built), so groups compile and load independently:

    csrc/mask     -> meshkern._mask_C      Philox mask + fused pack/unpack
    csrc/spectral -> meshkern._spectral_C  batched small SVD, two-sided projection
    csrc/dp       -> meshkern._dp_C        PowerSGD / SparseLoCo helpers
    csrc/pca      -> meshkern._pca_C       the pca codec's projection + int4/int8 quantization

CUDA kernels are added only when the installed torch has CUDA *and* CUDA_HOME is set
(a CPU torch cannot build a CUDAExtension). Environment knobs:

    MESHKERN_EXT=mask,dp     build only these groups (development)
    MESHKERN_NO_CUDA=1       never build CUDA kernels
    MESHKERN_NO_EXT=1        build no extension at all (pure Python install)
"""
import glob
import json
import os

from setuptools import setup

GROUPS = {"mask": "_mask_C", "spectral": "_spectral_C", "dp": "_dp_C", "subspace": "_subspace_C", "pca": "_pca_C"}
# Runtime requirements (pyproject.toml: dynamic = ["dependencies"]). torch is added by
# _torch_requirement: the exact build torch when extensions are compiled.
# peft: LoRA adapters (--adapter lora) are built with its layers and saved in its format
RUNTIME_REQUIRES = ["transformers>=5.0", "tokenizers", "safetensors", "pyyaml", "tqdm", "numpy", "peft>=0.21"]
ROOT = os.path.dirname(os.path.abspath(__file__))


def _write_build_info(torch_version, groups, cuda_groups):
    """Record what was built: the loader (meshkern/_backend.py) refuses extensions built
    for another torch, and offers the cuda backend only for groups with CUDA kernels.
    A partial build (MESHKERN_EXT) keeps the other groups' entries of the same torch."""
    path = os.path.join(ROOT, "meshkern", "_build_info.json")
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError):
        old = {}
    keep = set(old.get("cuda_groups", [])) - set(groups) if old.get("torch") == torch_version else set()
    new = {"torch": torch_version, "cuda_groups": sorted(keep | set(cuda_groups))}
    if new == old:
        return  # unchanged: not rewritten (a build beside running tests, scripts/test.sh, must not touch it)
    with open(path + ".tmp", "w") as f:
        json.dump(new, f)
    os.replace(path + ".tmp", path)  # whole or not at all for a process reading it meanwhile


def _torch_requirement():
    """``torch==<the build torch's distribution version>`` when extensions are built, else
    ``torch>=2.4``. meshkern/_backend.py refuses an extension built for another torch, so a
    looser pin would let pip install a torch (e.g. the newest CUDA one) under which every op
    silently falls back to the pure-torch reference.

    The version pip knows (the dist-info's), not ``torch.__version__``: the local label is
    kept where the wheel has one (the CPU wheel: 2.13.0+cpu in both), but PyPI's CUDA wheel
    is 2.13.0 to pip and 2.13.0+cu130 to torch, and ``torch==2.13.0+cu130`` is not
    satisfied by the torch that built the extension (pip then looks for it and fails)."""
    if os.environ.get("MESHKERN_NO_EXT") == "1":
        return "torch>=2.4"
    from importlib.metadata import version

    return f"torch=={version('torch')}"


def _ext_modules():
    if os.environ.get("MESHKERN_NO_EXT") == "1":
        return [], {}
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    use_cuda = (
        torch.version.cuda is not None
        and CUDA_HOME is not None
        and os.environ.get("MESHKERN_NO_CUDA") != "1"
    )
    if use_cuda and not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        # No GPU to detect the arch from: build for the consumer/datacenter GPUs we target.
        os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;8.6;8.9;9.0"

    wanted = os.environ.get("MESHKERN_EXT")
    wanted = set(wanted.split(",")) if wanted else set(GROUPS)
    unknown = wanted - set(GROUPS)
    if unknown:
        raise SystemExit(f"MESHKERN_EXT names unknown groups {sorted(unknown)}; known: {sorted(GROUPS)}")
    _write_build_info(torch.__version__, wanted,
                      {g for g in wanted if use_cuda and glob.glob(f"csrc/{g}/*.cu")})

    # torch 2.13's headers use C++20 features (they warn under -std=c++17).
    cxx = ["-O3", "-fopenmp", "-std=c++20"]
    modules = []
    for group, modname in GROUPS.items():
        if group not in wanted:
            continue
        sources = sorted(glob.glob(f"csrc/{group}/*.cpp"))
        if not sources:
            continue
        cu = sorted(glob.glob(f"csrc/{group}/*.cu")) if use_cuda else []
        kwargs = dict(
            include_dirs=[os.path.join(ROOT, "csrc", "common")],
            extra_link_args=["-fopenmp"],
        )
        if cu:
            modules.append(CUDAExtension(
                f"meshkern.{modname}", sources + cu,
                extra_compile_args={"cxx": cxx + ["-DMESHKERN_WITH_CUDA"], "nvcc": ["-O3", "-DMESHKERN_WITH_CUDA"]},
                **kwargs))
        else:
            modules.append(CppExtension(f"meshkern.{modname}", sources,
                                        extra_compile_args={"cxx": cxx}, **kwargs))
    return modules, {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _ext_modules()
setup(ext_modules=ext_modules, cmdclass=cmdclass, install_requires=RUNTIME_REQUIRES + [_torch_requirement()])
