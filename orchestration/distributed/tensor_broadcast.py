"""Named tensors from one rank to the others, as safetensors bytes, and a small JSON
record from one rank to another: never a pickle over the network (a peer that sends
garbage gets a parse error, not code execution).

Two messages each: the payload's length (int64), then the payload (uint8).
"""
from __future__ import annotations

import json

import torch
import torch.distributed as dist
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save


def broadcast_tensors(named: dict[str, torch.Tensor] | None, src: int, group=None,
                      device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """``named`` on rank ``src`` (ignored elsewhere), on every rank of ``group``; CPU tensors.
    ``device``: where the collectives' buffers live (a NCCL group needs the rank's GPU)."""
    if dist.get_rank() == src:
        payload = st_save({k: v.detach().cpu().contiguous() for k, v in named.items()})
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        n = torch.tensor([buf.numel()], dtype=torch.int64)
    else:
        n = torch.zeros(1, dtype=torch.int64)
    n = n.to(device)
    dist.broadcast(n, src=src, group=group)
    if dist.get_rank() != src:
        buf = torch.empty(int(n.item()), dtype=torch.uint8)
    data = buf.to(device)
    dist.broadcast(data, src=src, group=group)
    if dist.get_rank() == src:
        return {k: v.detach().cpu() for k, v in named.items()}
    return st_load(data.cpu().numpy().tobytes())


def send_json(obj, dst: int, device: torch.device | str = "cpu") -> None:
    """Sends ``obj`` (JSON-ready) to rank ``dst``, which takes it with ``recv_json``."""
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64, device=device), dst)
    dist.send(data.to(device), dst)


def recv_json(src: int, device: torch.device | str = "cpu"):
    """What rank ``src`` sent with ``send_json``."""
    n = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(n, src)
    data = torch.empty(int(n.item()), dtype=torch.uint8, device=device)
    dist.recv(data, src)
    return json.loads(data.cpu().numpy().tobytes().decode())
