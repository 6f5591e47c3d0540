"""The local launch: this machine's processes, started and supervised here.

``launch_local`` starts the fixed mesh (orchestration.launch.processes.run_local: one
process per rank, the anchor row restartable), or hands over to the elastic launch
(--mesh.elastic, --mesh.join), or starts just an anchor row that joins a running fast
circuit (--anchor.join).
"""
from __future__ import annotations

import os
import socket
import sys

from orchestration.components.resume import mesh_stopped
from orchestration.config import to_yaml
from orchestration.distributed import devices
from orchestration.distributed.mesh import MeshLayout
from orchestration.launch.outcome import exit_code, say_anchor_rows
from orchestration.launch.processes import MeshFailure, free_port, run_local
from orchestration.launch.rank import anchor_row_rank, run_rank


def launch_local(cfg, plan, layout: MeshLayout) -> int:
    """Runs the whole run (or this machine's part of it) from this process; the exit code."""
    os.makedirs(plan.run_dir, exist_ok=True)
    if cfg.anchor.join:
        return join_anchor_row(cfg, plan, layout)
    if cfg.mesh.join:
        from orchestration.launch.elastic import run_elastic

        return run_elastic(cfg, plan, layout, [cfg.mesh.replica_id], cfg.mesh.join)
    print(f"run folder: {plan.run_dir}/ (config.yaml, metrics.jsonl, checkpoints/"
          + (", tensorboard/" if cfg.run.tensorboard else "") + (", wandb/" if cfg.run.wandb else "")
          + "; a summary at the end)", flush=True)
    if plan.memory:
        print(plan.memory, flush=True)
    cfg.run.name = os.path.basename(plan.run_dir)  # so that --config RUN_DIR/config.yaml names this run
    with open(os.path.join(plan.run_dir, "config.yaml"), "w") as f:
        f.write(to_yaml(cfg))
    if cfg.mesh.elastic:
        from orchestration.launch.elastic import run_elastic

        return run_elastic(cfg, plan, layout, [int(r) for r in cfg.mesh.local_replicas] or list(range(layout.fast_rows)))
    try:
        port = free_port()
        anchors = {r for r in range(cfg.world_size) if layout.is_anchor(r)}
        if anchors:
            print(f"[anchor] the fast circuit's store is 127.0.0.1:{port}; a new anchor row joins it with: "
                  f"python -m orchestration.train --config {os.path.join(plan.run_dir, 'config.yaml')} "
                  f"--anchor.join --anchor.store 127.0.0.1:{port}", file=sys.stderr, flush=True)
            if layout.anchor_scope():
                print(f"[anchor] {layout.anchor_scope()}", file=sys.stderr, flush=True)
        res = run_local(run_rank, cfg.world_size, (cfg, plan),
                        start_method=devices.start_method(cfg.mesh.start_method, cfg.mesh.device),
                        threads=cfg.mesh.threads_per_rank, describe=layout.describe, optional=anchors,
                        restarts=cfg.anchor.restarts if anchors else 0, port=port)
    except MeshFailure as e:
        return mesh_stopped(e, plan)
    return exit_code(res)


def join_anchor_row(cfg, plan, layout: MeshLayout) -> int:
    """--anchor.join: the anchor row's processes, joining the running fast circuit."""
    from orchestration.anchor import store_address

    host, port = store_address(cfg)
    try:  # fail fast, not after the store client's minutes of retries, if nothing listens there
        socket.create_connection((host, port), timeout=10).close()
    except OSError as e:
        print(f"error: --anchor.store {host}:{port}: cannot connect ({e.strerror or e}); is the fast circuit "
              "running? (its launcher prints the address)", file=sys.stderr)
        return 2
    try:
        res = run_local(anchor_row_rank, layout.stages, (cfg, plan),
                        start_method=devices.start_method(cfg.mesh.start_method, cfg.mesh.device),
                        threads=cfg.mesh.threads_per_rank, optional=set(range(layout.stages)),
                        describe=lambda r: layout.describe(layout.anchor_rank(r)),
                        restarts=cfg.anchor.restarts)
    except MeshFailure as e:
        return mesh_stopped(e, plan)
    say_anchor_rows(layout, res)
    return 0 if all(r is not None for r in res) else 1
