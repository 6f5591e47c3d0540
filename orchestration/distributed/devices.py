"""Where a fast rank computes (--mesh.device) and which torch.distributed backend carries its
tensors (--mesh.dist-backend), and the one rule for tensors that backend cannot move.

NCCL moves CUDA tensors only, one GPU per rank: two ranks on one GPU are refused. Gloo moves
CPU tensors, and of CUDA tensors only all_reduce and broadcast (torch.distributed's backend
table): so ranks that share a GPU (two stages of a pipeline on one card, the usual case on a
single-GPU machine) compute on CUDA and talk over gloo, and whatever gloo cannot move
(point-to-point wire tensors, all-gathers) travels through a CPU copy (``needs_cpu_staging``,
meshkern.compress.base's rule, which its all-gather applies too).
"""
from __future__ import annotations

import os

import torch

from meshkern.compress.base import needs_cpu_staging  # noqa: F401  (the rule, re-exported for the pipeline)

DEVICES = ("auto", "cpu", "cuda")


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_world_size() -> int:
    """Ranks on this machine (LOCAL_WORLD_SIZE, as torchrun and our launcher set it)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or 1)


def resolve_device(device: str, gpus: int | None = None) -> str:
    """"cpu" or "cuda" for --mesh.device (auto: cuda when torch sees a GPU). ValueError for
    cuda without a GPU or an unknown name."""
    gpus = gpu_count() if gpus is None else gpus
    if device not in DEVICES:
        raise ValueError(f"--mesh.device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cuda" and gpus < 1:
        raise ValueError("--mesh.device cuda needs a CUDA GPU, and torch sees none (torch.cuda.is_available() is False)")
    return "cuda" if device == "cuda" or (device == "auto" and gpus > 0) else "cpu"


def resolve_dist_backend(dist_backend: str, device: str = "auto", gpus: int | None = None,
                         local_ranks: int | None = None) -> str:
    """gloo or nccl for --mesh.dist-backend: auto is nccl when the ranks compute on CUDA and
    every local rank has a GPU of its own, else gloo. ValueError for nccl on CPU or with
    more local ranks than GPUs (NCCL refuses two ranks on one device)."""
    gpus = gpu_count() if gpus is None else gpus
    local_ranks = local_world_size() if local_ranks is None else local_ranks
    kind = resolve_device(device, gpus)
    if dist_backend == "auto":
        return "nccl" if kind == "cuda" and local_ranks <= gpus else "gloo"
    if dist_backend == "nccl" and (kind != "cuda" or local_ranks > gpus):
        raise ValueError(f"--mesh.dist-backend nccl needs CUDA GPUs, one per local rank: {local_ranks} local ranks, "
                         f"{gpus} GPUs, --mesh.device {device} ({kind}); use gloo (ranks then share GPUs)")
    return dist_backend


def rank_device(device: str) -> torch.device:
    """This rank's device: cuda:(LOCAL_RANK mod GPUs), made current, or cpu."""
    if resolve_device(device) == "cpu":
        return torch.device("cpu")
    d = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % gpu_count())
    torch.cuda.set_device(d)
    return d


def start_method(start: str, device: str) -> str:
    """fork or spawn for --mesh.start-method: auto is fork on CPU (ranks inherit the loaded
    model and data) and spawn on CUDA. ValueError for fork on CUDA: CUDA cannot be used in a
    process forked from one that may have touched it."""
    kind = resolve_device(device)
    if start == "auto":
        return "spawn" if kind == "cuda" else "fork"
    if start == "fork" and kind == "cuda":
        raise ValueError("--mesh.start-method fork with ranks on CUDA (--mesh.device resolves to cuda): forked ranks "
                         "cannot initialize CUDA; use --mesh.start-method spawn (or auto)")
    return start
