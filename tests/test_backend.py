"""Backend selection: names, forcing, and the reasons a forced backend cannot run."""
import pytest
import torch

from meshkern import _backend


def test_reference_always_available():
    assert _backend.resolve("mask", torch.device("cpu"), "reference") == "reference"


def test_unknown_backend_name_is_rejected():
    with pytest.raises(ValueError, match="unknown backend 'fortran'"):
        _backend.resolve("mask", torch.device("cpu"), "fortran")


def test_env_var_forces_backend(monkeypatch):
    monkeypatch.setenv(_backend.ENV_VAR, "reference")
    assert _backend.resolve("mask", torch.device("cpu")) == "reference"
    monkeypatch.setenv(_backend.ENV_VAR, "bogus")
    with pytest.raises(ValueError, match=_backend.ENV_VAR):
        _backend.resolve("mask", torch.device("cpu"))


def test_cuda_backend_on_cpu_tensor_says_why():
    with pytest.raises(RuntimeError, match="runs CUDA tensors"):
        _backend.resolve("mask", torch.device("cpu"), "cuda")


def test_triton_on_cpu_needs_interpreter(monkeypatch):
    if not _backend.triton_importable():
        pytest.skip("triton not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        _backend.resolve("mask", torch.device("cpu"), "triton")


def test_auto_on_cpu_is_cpp_or_reference():
    assert _backend.resolve("mask", torch.device("cpu"), "auto") in ("cpp", "reference")


def test_unknown_group_is_rejected():
    with pytest.raises(ValueError, match="unknown extension group"):
        _backend.extension("nope")


def test_auto_argument_defers_to_env_var(monkeypatch):
    monkeypatch.setenv(_backend.ENV_VAR, "reference")
    assert _backend.resolve("mask", torch.device("cpu"), "auto") == "reference"
    monkeypatch.setenv(_backend.ENV_VAR, "bogus")
    with pytest.raises(ValueError, match=_backend.ENV_VAR):
        _backend.resolve("mask", torch.device("cpu"), "auto")
