"""Helpers for the data-parallel tests: spawn gloo ranks on 127.0.0.1 with a hard
timeout, and the rank-side bodies of the compressor tests.

Ranks report results through safetensors files in a temporary directory (read back
with safetensors, never pickled). Each spawned process uses one thread and
OMP_WAIT_POLICY=PASSIVE (inherited from tests/conftest.py's environment).
"""
from __future__ import annotations

import datetime
import os
import socket
import time

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, world: int, *args, timeout: float = 150.0) -> list[int]:
    """Run ``fn(rank, world, port, *args)`` in ``world`` spawned processes; return
    their exit codes. Processes still running after ``timeout`` seconds are killed and
    a TimeoutError is raised, so a hung collective cannot hang the test suite."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=fn, args=(rank, world, port, *args), daemon=True) for rank in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join(5)
    if hung:
        raise TimeoutError(f"{len(hung)} of {world} ranks still running after {timeout} s")
    return [p.exitcode for p in procs]


def init(rank: int, world: int, port: int, timeout_s: float = 60.0) -> None:
    """One thread, gloo process group over TCP on 127.0.0.1."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def save(path: str, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, path)


def load(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


# ---- deterministic inputs shared by the rank side and the reference side -------------------
SHAPES = [(48, 40), (48, 40), (32, 24), (16,), (3, 5, 6)]


def inputs(rank: int, step: int, shapes=SHAPES) -> list[torch.Tensor]:
    """Rank ``rank``'s tensors at ``step``: a low-rank signal shared by all ranks and
    steps (fine-tuning's slowly drifting gradient subspace) plus per-rank, per-step
    full-rank noise, so compression has structure to find."""
    g = torch.Generator().manual_seed(17)
    gr = torch.Generator().manual_seed(1000 * step + rank)
    out = []
    for s in shapes:
        if len(s) >= 2:
            n, m = s[0], int(torch.Size(s[1:]).numel())
            signal = torch.randn(n, 2, generator=g) @ torch.randn(2, m, generator=g)
            out.append((signal + 0.3 * torch.randn(n, m, generator=gr)).view(s))
        else:
            out.append(torch.randn(s, generator=gr))
    return out


# ---- rank side of tests/test_compress*.py ---------------------------------------------------
def compressor_worker(rank: int, world: int, port: int, outdir: str, steps: int) -> None:
    """Runs every compressor scenario; writes {outdir}/rank{rank}.safetensors."""
    import torch.distributed as dist

    from meshkern.compress import Int8, NoCompression, PowerSGD, SparseLoCo

    init(rank, world, port)
    res: dict[str, torch.Tensor] = {}

    def counters(name, c):
        res[f"{name}.counters"] = torch.tensor([c.bytes_sent, c.bytes_received, c.payload_bytes], dtype=torch.int64)

    for name, comp in [("psgd", PowerSGD(4, seed=7)), ("psgd_gs", PowerSGD(2, seed=7)),
                       ("sparse", SparseLoCo(1 / 16, chunk=64)), ("int8", Int8(chunk=64))]:
        for t in range(steps):
            for i, o in enumerate(comp.all_reduce_mean(inputs(rank, t), None, key="k")):
                res[f"{name}.out{t}.{i}"] = o
        for gk, st in (comp._state.get("k", {}).items() if name.startswith("psgd") else []):
            res[f"{name}.err.{gk}"] = st["err"]
        counters(name, comp)

    one = [inputs(rank, 0, [(64, 48)])[0]]
    for name, comp in [("bytes_none", NoCompression()), ("bytes_psgd", PowerSGD(4))]:
        comp.all_reduce_mean(one, None)
        counters(name, comp)
    save(os.path.join(outdir, f"rank{rank}.safetensors"), res)
    dist.destroy_process_group()
