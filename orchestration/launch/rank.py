"""The one rank entry: every process of a run, whatever started it (the local launcher,
torchrun, an elastic replica's supervisor, an anchor row joining), runs ``run_rank``:

    join its world   a fast rank of the fixed mesh (init_mesh), an anchor rank (a world of
                     its own per anchor-row generation), or a stage of an elastic replica
                     (the replica's own world, its DP sync through torchft)
    build its stage  orchestration.components.builders.build_stage
    run it           a fast rank: orchestration.trainer.Trainer, with the step gate of its
                     mode; an anchor rank: orchestration.anchor.run_anchor_rank
    leave            the gate closed, the world destroyed, whatever happened
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from orchestration.components.builders import RankContext, build_stage
from orchestration.distributed.mesh import MeshLayout, destroy_mesh, init_mesh
from orchestration.trainer import Trainer


@dataclass(frozen=True)
class ElasticRole:
    """This process is a stage of elastic fast replica ``replica`` (--mesh.elastic), whose
    rank in ``run_rank`` is its stage. ``lighthouse``: the lighthouse URL; ``incarnation``:
    how many times the replica was restarted before; ``first``: the replicas of the launch,
    waited for before the first quorum (empty for a restart or a joiner)."""

    replica: int
    lighthouse: str
    incarnation: int = 0
    first: tuple = ()


def run_rank(rank: int, world_size: int, cfg, plan, role: ElasticRole | None = None) -> dict:
    """Runs one rank to the end of training; returns its record (rank 0: the summary).
    ``rank``: the rank in the whole mesh (MeshLayout numbering), or the stage of an elastic
    replica (``role``)."""
    torch.set_num_threads(cfg.mesh.threads_per_rank)
    layout = MeshLayout.of(cfg)
    gate = None
    try:
        if role is not None:
            mesh, gate = _join_replica(layout, rank, cfg, plan, role)
        elif layout.is_anchor(rank):
            from orchestration import anchor

            mesh = anchor.join_anchor_row(layout, rank, cfg, plan.secret)
        else:
            mesh = init_mesh(layout, dist_backend=cfg.mesh.dist_backend, timeout_s=cfg.mesh.timeout_s,
                             num_layers=plan.num_layers, layers_per_stage=cfg.mesh.layers_per_stage,
                             device=cfg.mesh.device)
        stage = build_stage(cfg, plan, mesh)
        if mesh.is_anchor:
            from orchestration import anchor

            params = [p for p in stage.parameters() if p.requires_grad]
            return anchor.run_anchor_rank(RankContext(cfg, plan, mesh, stage, params))
        return Trainer(mesh.rank, cfg, plan, mesh, stage, gate=gate).run()
    finally:
        if gate is not None:
            gate.close()
        destroy_mesh()


def anchor_row_rank(index: int, world_size: int, cfg, plan) -> dict:
    """Process ``index`` of an anchor row started on its own (--anchor.join, or beside an
    elastic run's replicas) is the anchor rank of stage ``index``."""
    return run_rank(MeshLayout.of(cfg, anchor=True).anchor_rank(index), world_size, cfg, plan)


def _join_replica(layout: MeshLayout, stage: int, cfg, plan, role: ElasticRole):
    """Stage ``stage`` of elastic replica ``role.replica``: the replica's own world and its
    torchft manager; returns (mesh, gate)."""
    from orchestration.distributed.replica_world import init_replica_world
    from orchestration.elastic.events import announce_up, events_dir, wait_for_launch
    from orchestration.elastic.gate import ElasticGate
    from orchestration.elastic.errors import hard_exit_on_error
    from orchestration.elastic.replica import ElasticReplica

    hard_exit_on_error()
    from orchestration.distributed.addresses import local_problem

    if (problem := local_problem(cfg.mesh.bind)) is not None:
        raise ValueError(problem)
    mesh = init_replica_world(layout, role.replica, timeout_s=cfg.mesh.timeout_s, device=cfg.mesh.device)
    os.makedirs(events_dir(plan.run_dir), exist_ok=True)
    # a heterogeneous mesh's replicas sync by parameter name: one torchft group rank per sync segment
    segments = layout.sync_segments(plan.num_layers, cfg.mesh.layers_per_stage) if layout.heterogeneous else None
    replica = ElasticReplica(cfg, mesh, role.replica, role.lighthouse, plan.secret, segments=segments,
                             events=os.path.join(events_dir(plan.run_dir), f"replica{role.replica}_stage{stage}.jsonl"))
    replica.incarnation = role.incarnation
    gate = ElasticGate(replica, mesh, plan.run_dir)
    if role.first:
        if stage == 0:
            announce_up(plan.run_dir, role.replica, role.lighthouse)
        try:
            wait_for_launch(plan.run_dir, role.first, role.lighthouse, cfg.mesh.timeout_s)
        except BaseException:
            gate.close()
            raise
    return mesh, gate
