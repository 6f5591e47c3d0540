"""orchestration.distributed.tensor_broadcast: named tensors travel as safetensors bytes,
arrive bit for bit, and bytes that are not a safetensors payload are refused (never
unpickled)."""
from __future__ import annotations

import pytest
import torch

from orchestration.launch.processes import run_local

pytestmark = pytest.mark.slow  # spawns gloo ranks


def _rank(rank, world, tmp):
    import torch.distributed as dist

    from orchestration.distributed.mesh import join_world
    from orchestration.distributed.tensor_broadcast import broadcast_tensors

    join_world("gloo", rank, world, 60)
    try:
        g = torch.Generator().manual_seed(7)
        sent = {"0.U": torch.randn(6, 3, generator=g), "0.bits": torch.arange(3), "1.mean": torch.randn(6, generator=g)}
        got = broadcast_tensors(sent if rank == 0 else None, src=0)
        same = sorted(got) == sorted(sent) and all(torch.equal(got[k], sent[k]) and got[k].dtype == sent[k].dtype
                                                   for k in sent)
        # a peer that sends garbage in the same two collectives (a pickle, which would run)
        refused = False
        if rank == 0:
            junk = bytearray(b"\x80\x04K\x01." + b"\x00" * 11)
            dist.broadcast(torch.tensor([len(junk)], dtype=torch.int64), src=0)
            dist.broadcast(torch.frombuffer(junk, dtype=torch.uint8), src=0)
        else:
            try:
                broadcast_tensors(None, src=0)
            except Exception:  # safetensors' parse error
                refused = True
        return {"same": same, "refused": refused}
    finally:
        dist.destroy_process_group()


def test_named_tensors_arrive_bit_for_bit_and_garbage_is_refused(tmp_path):
    res = run_local(_rank, 2, (str(tmp_path),), timeout_s=120)
    assert res[0]["same"] and res[1]["same"]
    assert res[1]["refused"]
