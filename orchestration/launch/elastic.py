"""The elastic launch (--mesh.elastic, --mesh.join): the lighthouse (unless joining one)
and this machine's fast replicas, each a group of stage processes supervised by
orchestration.launch.replicas, each stage running ``run_rank`` with its ElasticRole.
Under torchrun, one torchrun per replica: ``torchrun_replica``.
"""
from __future__ import annotations

import json
import os
import sys

from orchestration.components.resume import mesh_stopped
from orchestration.distributed import devices
from orchestration.distributed.mesh import MeshLayout
from orchestration.elastic.events import events_dir, summarize_events, summary_line
from orchestration.launch.outcome import exit_code
from orchestration.launch.processes import MeshFailure
from orchestration.launch.rank import ElasticRole, run_rank


def torchft_missing() -> str | None:
    """The error of --mesh.elastic without torchft installed, or None."""
    import importlib.util

    if importlib.util.find_spec("torchft") is None:
        return "--mesh.elastic runs on torchft, which is not installed: pip install torchft==0.2.0 (or meshkern[elastic])"
    return None


def run_elastic(cfg, plan, layout: MeshLayout, replicas: list[int], lighthouse: str = "") -> int:
    """The lighthouse (unless ``lighthouse`` names one to join), then ``replicas``, each
    restarted by the supervisor while others run (--mesh.replica-restarts); the exit code."""
    from orchestration.elastic.lighthouse import start_lighthouse
    from orchestration.launch.replicas import ElasticLaunch

    m = cfg.mesh
    if (msg := torchft_missing()) is not None:
        print(f"error: {msg}", file=sys.stderr)
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
    launch = ElasticLaunch(_replica_rank, (cfg, plan), layout, replicas, lighthouse,
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
    return exit_code([r for rs in res.values() for r in rs])


def _replica_rank(stage: int, stages: int, cfg, plan, replica: int, lighthouse: str, incarnation: int,
                  first: tuple) -> dict:
    """One stage process of a replica the supervisor started."""
    return run_rank(stage, stages, cfg, plan, ElasticRole(replica, lighthouse, incarnation, first))


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
    out = run_rank(rank, world, cfg, plan, ElasticRole(cfg.mesh.replica_id, cfg.mesh.join))
    return exit_code([out], speak=rank == 0, clean_stop=0)
