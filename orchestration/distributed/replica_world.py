"""An elastic replica's own world (--mesh.elastic): its stages only, on the loopback
interface, and the torchft store it advertises to the other replicas on --mesh.bind.

A replica's stages are on one host: their rendezvous and pipeline traffic never leave it,
so a replica whose outside link is down keeps its world (and a restarted one can form it
again). Only what other replicas reach (the torchft store, manager, heal server) is on the
address the run names.
"""
from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from orchestration.distributed.devices import rank_device
from orchestration.distributed.mesh import _KEEP, Mesh, MeshLayout, join_world, listen_socket


# How long a stage waits for a sibling stage of its replica (the replica's own groups). A
# stage's part of a step can wait on the network for long: its DP sync on a peer that went
# silent (--mesh.timeout-s), a quorum (--mesh.quorum-timeout-s per try), a new torchft
# Manager reaching a lighthouse that is unreachable, a heal sized by bytes and rate; its
# siblings meanwhile wait for it in the pipeline, the per-step metrics or the quorum's
# agreement (elastic.replica); at the start, stage 0 alone fits the pca bases the others
# wait for (minutes for a real model on a CPU). With --mesh.timeout-s here the sibling timed out first
# (measured: a survivor of an outage died in its metrics all-reduce while its other stage
# waited out the lost peer). The stages are processes of one torchrun or one local launcher
# on one host, which end every stage of a replica when one dies, so this bound never keeps
# a stage waiting on a dead one.
SIBLING_TIMEOUT_S = 6 * 3600


def init_replica_world(layout: MeshLayout, row: int, *, timeout_s: float = 60.0, device: str = "cpu") -> Mesh:
    """--mesh.elastic: joins fast replica ``row``'s own world, its stages only (env://
    rendezvous as set by orchestration.launch.replicas or torchrun: RANK = the stage,
    WORLD_SIZE = the replica's stages, MASTER_ADDR/PORT = the replica's own store), so the
    replica can die and be restarted while the others go on. Groups: ``pp`` = ``fast`` =
    the replica's world, ``ends`` (tied embedding); ``dp`` is set by the replica's torchft
    manager (orchestration.elastic.replica). ``rank`` keeps the whole mesh's numbering (for
    names and checkpoints), neighbours are the world's ranks (= stages).

    A replica's stages are on one host, so its own world's gloo pairs are made on the
    loopback interface (``loopback_gloo``), whatever GLOO_SOCKET_IFNAME names for the
    replicas' DP groups: the replica keeps working, and restarts, while its host's outside
    link is down. Its groups wait for a sibling stage up to SIBLING_TIMEOUT_S (why, there)."""
    stages = layout.stages_of(row)
    stage = int(os.environ.get("RANK", "0"))
    if not 0 <= stage < stages:
        raise ValueError(f"RANK={stage}: replica {row} of the mesh {layout.name} has stages 0..{stages - 1}")
    tmo = timedelta(seconds=SIBLING_TIMEOUT_S)
    with loopback_gloo():
        join_world("gloo", stage, stages, timeout_s, collective_timeout_s=SIBLING_TIMEOUT_S)
        if dist.get_world_size() != stages:
            raise ValueError(f"WORLD_SIZE={dist.get_world_size()} but replica {row} has {stages} stages")
        m = Mesh(layout, layout.rank_of(row, stage), row, stage, elastic=True)
        m.device = rank_device(device)
        m.pp = m.fast = m.groups[f"pp{row}"] = m.groups["fast"] = dist.new_group(list(range(stages)), timeout=tmo)
        m.groups[f"ends{row}"] = dist.new_group(sorted({0, stages - 1}), timeout=tmo)
    return m


GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"


@contextmanager
def loopback_gloo():
    """Gloo groups made inside this block use the loopback interface: gloo reads
    GLOO_SOCKET_IFNAME when a group is made (torchft's groups, made per quorum, read the
    user's again)."""
    lo = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
    old = os.environ.get(GLOO_IFNAME_ENV)
    if lo is not None:
        os.environ[GLOO_IFNAME_ENV] = lo
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(GLOO_IFNAME_ENV, None)
        else:
            os.environ[GLOO_IFNAME_ENV] = old


def replica_store(bind: str, timeout_s: float) -> tuple[str, int]:
    """An elastic replica's torchft store: (host, port) of a TCPStore that stage 0 serves on
    ``bind`` (--mesh.bind, the address other replicas reach: torchft advertises it for the
    replicas' DP groups), its port sent to the other stages over the replica's own world.
    Not the replica's MASTER_ADDR store, which stays inside the host."""
    port = torch.zeros(1, dtype=torch.int64)
    if dist.get_rank() == 0:
        sock = listen_socket(bind, 0)
        port[0] = sock.getsockname()[1]
        store = dist.TCPStore(bind, int(port[0]), None, True, timedelta(seconds=timeout_s),
                              master_listen_fd=sock.detach(), use_libuv=True, wait_for_workers=False)
        _KEEP.append(store)  # serves the replica's managers until the process ends
    dist.broadcast(port, src=0)
    return bind, int(port[0])
