"""The anchor row's own torch.distributed world: its stages only, one generation at a time,
met on the fast circuit's store (orchestration.anchor.links.join_anchor_row)."""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from orchestration.distributed.devices import rank_device, resolve_dist_backend
from orchestration.distributed.mesh import Mesh, MeshLayout


def init_anchor_row(layout: MeshLayout, stage: int, store, generation: int, *, dist_backend: str = "auto",
                    timeout_s: float = 60.0, device: str = "cpu") -> Mesh:
    """Joins anchor row ``generation``'s own world: the anchor ranks of every stage, rank =
    stage, rendezvous on ``store`` (a client of the fast circuit's store) under a prefix
    of the generation, so a new anchor row never meets a dead one's keys. Every anchor
    stage of one generation must call this; raises DistStoreError after ``timeout_s`` if
    one does not come (the row's collectives then wait ``timeout_s`` too, until
    ``set_collective_timeout``). The returned Mesh has ``rank`` = the anchor rank's number
    in the whole mesh (for names and fault injection) and neighbours in the anchor world."""
    if not layout.anchor:
        raise ValueError("init_anchor_row needs a mesh layout with the anchor")
    if not dist.is_initialized():
        dist.init_process_group(resolve_dist_backend(dist_backend, device, local_ranks=layout.stages),
                                store=dist.PrefixStore(f"meshkern/anchor/g{generation}/row", store),
                                rank=stage, world_size=layout.stages, timeout=timedelta(seconds=timeout_s))
    m = Mesh(layout, layout.anchor_rank(stage), layout.rows - 1, stage, store=store, generation=generation)
    m.device = rank_device(device)
    return m


def set_collective_timeout(seconds: float, group=None) -> None:
    """How long the collectives of ``group`` (default: this process's world), formed with a
    shorter timeout, wait from now on. torch has no public call for it: its
    ``_set_pg_timeout`` (torch >= 2.4; this package pins its torch) sets the backend's."""
    fn = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if fn is None:
        raise RuntimeError(f"torch {torch.__version__} has no torch.distributed.distributed_c10d._set_pg_timeout")
    fn(timedelta(seconds=seconds), group)
