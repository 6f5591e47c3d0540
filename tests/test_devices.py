"""orchestration.distributed.devices: which device and torch.distributed backend a fast rank
gets, for every combination of GPUs and local ranks (the GPU side is decided here, so it is
tested without a GPU), and the CPU staging path of the pipeline's p2p."""
import pytest
import torch

from orchestration.distributed import devices


@pytest.mark.parametrize("device,gpus,want", [("auto", 0, "cpu"), ("auto", 1, "cuda"), ("cpu", 4, "cpu"),
                                              ("cuda", 1, "cuda")])
def test_resolve_device(device, gpus, want):
    assert devices.resolve_device(device, gpus) == want


def test_cuda_without_a_gpu_and_unknown_devices_are_refused():
    with pytest.raises(ValueError, match="--mesh.device cuda needs a CUDA GPU"):
        devices.resolve_device("cuda", 0)
    with pytest.raises(ValueError, match="must be one of"):
        devices.resolve_device("tpu", 1)


@pytest.mark.parametrize("backend,device,gpus,local,want", [
    ("auto", "auto", 0, 2, "gloo"),    # CPU
    ("auto", "auto", 2, 2, "nccl"),    # a GPU per rank
    ("auto", "auto", 1, 2, "gloo"),    # two stages on one GPU: NCCL would refuse
    ("auto", "cpu", 8, 2, "gloo"),     # GPUs present, CPU asked for
    ("gloo", "cuda", 4, 2, "gloo"),
    ("nccl", "auto", 4, 4, "nccl"),
])
def test_resolve_dist_backend(backend, device, gpus, local, want):
    assert devices.resolve_dist_backend(backend, device, gpus=gpus, local_ranks=local) == want


@pytest.mark.parametrize("device,gpus,local", [("auto", 0, 1), ("cpu", 2, 2), ("cuda", 1, 2)])
def test_nccl_needs_a_gpu_per_local_rank(device, gpus, local):
    with pytest.raises(ValueError, match="nccl needs CUDA GPUs, one per local rank"):
        devices.resolve_dist_backend("nccl", device, gpus=gpus, local_ranks=local)


def test_start_method_and_staging_rule(monkeypatch):
    monkeypatch.setattr(devices, "gpu_count", lambda: 1)
    assert devices.start_method("auto", "auto") == "spawn"
    assert devices.start_method("auto", "cpu") == "fork"
    with pytest.raises(ValueError, match="forked ranks cannot initialize CUDA"):
        devices.start_method("fork", "cuda")
    monkeypatch.setattr(devices, "gpu_count", lambda: 0)
    assert devices.start_method("auto", "auto") == "fork"
    assert devices.needs_cpu_staging(torch.device("cuda", 0), "gloo")
    assert not devices.needs_cpu_staging(torch.device("cuda", 0), "nccl")
    assert not devices.needs_cpu_staging(torch.device("cpu"), "gloo")
