"""Shared helper of the op tests: which kernel backends of an extension group this machine
can run, as pytest params (no tests here)."""
import pytest
import torch

from meshkern import _backend


def op_backends(group: str, triton: bool = True) -> list:
    """reference always; cpp (skipped unless meshkern._<group>_C is built) and, with
    ``triton``, triton (skipped unless Triton can run CPU tensors here)."""
    out = [pytest.param("reference", id="reference")]
    out.append(pytest.param("cpp", id="cpp", marks=pytest.mark.skipif(
        _backend.extension(group) is None, reason=f"meshkern._{group}_C not built")))
    if triton:
        out.append(pytest.param("triton", id="triton", marks=pytest.mark.skipif(
            _backend.why_unavailable("triton", group, torch.device("cpu")) is not None,
            reason="Triton cannot run CPU tensors here")))
    return out
