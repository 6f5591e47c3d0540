"""Shared helpers for the mask tests: which mask backends this machine can run (no tests here)."""
import pytest
import torch

from meshkern import _backend


def cpp_ready() -> bool:
    ext = _backend.extension("mask")
    return ext is not None and hasattr(torch.ops.meshkern_C, "mask_pack")


def triton_ready() -> bool:
    if _backend.why_unavailable("triton", "mask", torch.device("cpu")) is not None:
        return False
    try:
        import meshkern.triton_kernels.mask  # noqa: F401
        import meshkern.triton_kernels.philox  # noqa: F401
        return True
    except ImportError:
        return False


def cpu_backends() -> list:
    """reference always; cpp / triton as pytest params skipped when unavailable."""
    return [
        "reference",
        pytest.param("cpp", marks=pytest.mark.skipif(not cpp_ready(), reason="meshkern._mask_C not built")),
        pytest.param("triton", marks=pytest.mark.skipif(not triton_ready(), reason="triton unavailable on CPU")),
    ]


def fastest_cpu_backend() -> str:
    return "cpp" if cpp_ready() else "reference"
