"""The elastic launch (--mesh.elastic, --mesh.join): what ``python -m orchestration.train``
runs instead of the fixed mesh. ``run_elastic`` starts the lighthouse (unless joining one)
and the replicas (orchestration.elastic.launcher), ``run_elastic_rank`` is one stage of one
replica: its own world, a Trainer whose DP sync goes through the replica's torchft manager.
"""
from __future__ import annotations

import json
import os
import sys

import torch

from orchestration.components.builders import build_stage
from orchestration.distributed import devices
from orchestration.distributed.launch import MeshFailure
from orchestration.distributed.mesh import MeshLayout, destroy_mesh
from orchestration.trainer import Trainer


def run_elastic_rank(stage: int, stages: int, cfg, plan, replica_id: int, lighthouse: str,
                     incarnation: int = 0, first: tuple = ()) -> dict:
    """--mesh.elastic: stage ``stage`` of fast replica ``replica_id``, in the replica's own
    world, its DP sync through the replica's torchft manager (orchestration.elastic).
    ``incarnation``: how many times the launcher restarted this replica before; ``first``:
    the replicas of the launch, waited for before the first quorum."""
    from orchestration.anchor.auth import load_secret
    from orchestration.distributed.mesh import init_replica_world
    from orchestration.elastic.launcher import announce_up, events_dir, wait_for_launch
    from orchestration.elastic.replica import ElasticReplica, hard_exit_on_error

    hard_exit_on_error()
    torch.set_num_threads(cfg.mesh.threads_per_rank)
    layout = MeshLayout.of(cfg)
    mesh = init_replica_world(layout, replica_id, timeout_s=cfg.mesh.timeout_s, device=cfg.mesh.device)
    replica = None
    try:
        secret = load_secret(cfg, plan, create=False)
        os.makedirs(events_dir(plan.run_dir), exist_ok=True)
        replica = ElasticReplica(cfg, mesh, replica_id, lighthouse, secret,
                                 events=os.path.join(events_dir(plan.run_dir), f"replica{replica_id}_stage{stage}.jsonl"))
        replica.incarnation = incarnation
        if first:
            if stage == 0:
                announce_up(plan.run_dir, replica_id, lighthouse)
            wait_for_launch(plan.run_dir, first, lighthouse, cfg.mesh.timeout_s)
        return Trainer(mesh.rank, cfg, plan, mesh, build_stage(cfg, plan, mesh), elastic=replica).run()
    finally:
        if replica is not None:
            replica.close()
        destroy_mesh()


def run_elastic(cfg, plan, layout: MeshLayout, replicas: list[int], lighthouse: str = "") -> int:
    """--mesh.elastic: the lighthouse (unless joining one), then the replicas, supervised
    by orchestration.elastic.launcher; the exit code."""
    from orchestration.anchor.auth import load_secret
    from orchestration.elastic.launcher import ElasticLaunch, events_dir, summarize_events, summary_line
    from orchestration.elastic.lighthouse import start_lighthouse
    from orchestration.components.divergence import DIVERGED
    from orchestration.components.resume import mesh_stopped

    m = cfg.mesh
    if (msg := torchft_missing()) is not None:
        print(f"error: {msg}", file=sys.stderr)
        return 2
    try:
        load_secret(cfg, plan, create=not lighthouse)  # a joiner must hold the run's secret; the launcher makes it
    except (FileNotFoundError, ValueError) as e:
        print(f"error: --mesh.join: {e}", file=sys.stderr)
        return 2
    os.makedirs(events_dir(plan.run_dir), exist_ok=True)
    proc = None
    if not lighthouse:
        try:
            proc, lighthouse = start_lighthouse(f"{m.bind}:0", m.min_replicas, m.heartbeat_s, 2 * m.heartbeat_s)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        with open(os.path.join(events_dir(plan.run_dir), "lighthouse"), "w") as f:
            f.write(lighthouse + "\n")
        print(f"[elastic] lighthouse {lighthouse}; another replica joins with: python -m orchestration.train --config "
              f"{os.path.join(plan.run_dir, 'config.yaml')} --mesh.join {lighthouse} --mesh.replica-id K",
              file=sys.stderr, flush=True)
    launch = ElasticLaunch(run_elastic_rank, (cfg, plan), layout, replicas, lighthouse,
                           start_method=devices.start_method(m.start_method, m.device), threads=m.threads_per_rank,
                           restarts=m.replica_restarts if not m.join else 0)
    try:
        res = launch.run()
    except MeshFailure as e:
        return mesh_stopped(e, plan)
    finally:
        if proc is not None:
            proc.stdin.close()
            try:
                proc.wait(10)
            except Exception:
                proc.kill()
        summary = summarize_events(plan.run_dir, launch.restarted)
        with open(os.path.join(events_dir(plan.run_dir), "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        print(summary_line(summary), flush=True)
    outs = [r for rs in res.values() for r in rs if r]
    if any(o.get("diverged") for o in outs):
        print(f"error: {next(o['diverged'] for o in outs if o.get('diverged'))}", file=sys.stderr, flush=True)
        return DIVERGED
    return 130 if any(o.get("interrupted") for o in outs) else 0


def torchft_missing() -> str | None:
    """The error of --mesh.elastic without torchft installed, or None."""
    import importlib.util

    if importlib.util.find_spec("torchft") is None:
        return "--mesh.elastic runs on torchft, which is not installed: pip install torchft==0.2.0 (or meshkern[elastic])"
    return None


def torchrun_replica(cfg, plan, layout: MeshLayout, rank: int, world: int) -> int:
    """Under torchrun: this process is stage ``rank`` of replica --mesh.replica-id, joining
    the lighthouse --mesh.join (one torchrun per replica, --nproc-per-node = its stages;
    torchrun's --max-restarts restarts it). The exit code."""
    if (msg := torchft_missing()) is not None:
        print(f"error: {msg}", file=sys.stderr)
        return 2
    if not cfg.mesh.join:
        print("error: --mesh.elastic under torchrun: start the lighthouse (python -m orchestration.elastic.lighthouse), "
              "then one torchrun per replica (--nproc-per-node = its stages) with --mesh.join URL --mesh.replica-id K",
              file=sys.stderr)
        return 2
    if world != layout.stages:
        print(f"error: torchrun started {world} processes, one elastic replica needs {layout.stages} (its stages)",
              file=sys.stderr)
        return 2
    from orchestration.anchor.auth import load_secret

    try:  # every replica must hold the same secret: nobody creates it under torchrun
        load_secret(cfg, plan, create=False)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}; under torchrun give every replica the same secret, e.g. "
              "python -c 'import secrets; print(secrets.token_hex(32))' > run.secret; chmod 600 run.secret; "
              "then --anchor.secret-file run.secret", file=sys.stderr)
        return 2
    run_elastic_rank(rank, world, cfg, plan, cfg.mesh.replica_id, cfg.mesh.join)
    return 0
