"""The elastic launch (--mesh.elastic, --mesh.join): the lighthouse (unless joining one)
and this machine's fast replicas, each a group of stage processes supervised by
orchestration.launch.replicas, each stage running ``run_rank`` with its ElasticRole; with
--anchor.enabled also the anchor row (restartable, optional: orchestration.launch.local's
anchor group), meeting the replicas in the store the lighthouse hosts.
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
from orchestration.launch.outcome import exit_code, say_anchor_rows
from orchestration.launch.processes import MeshFailure
from orchestration.launch.rank import ElasticRole, anchor_row_rank, run_rank


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
    proc, anchor = None, cfg.anchor.enabled
    if not lighthouse:
        try:
            proc, lighthouse, store = start_lighthouse(f"{m.bind}:0", m.min_replicas, m.heartbeat_s,
                                                       2 * m.heartbeat_s, anchor_store=anchor)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        with open(os.path.join(events_dir(plan.run_dir), "lighthouse"), "w") as f:
            f.write(lighthouse + "\n")
        store_flag = ""
        if anchor:  # the replicas (forked below) and the anchor row take it from the config
            cfg.anchor.store = store
            store_flag = f" --anchor.store {store}"
            print(f"[anchor] the anchor circuit's store is {store} (hosted by the lighthouse); a new anchor row "
                  f"joins with: python -m orchestration.train --config {os.path.join(plan.run_dir, 'config.yaml')} "
                  f"--anchor.join{store_flag}", file=sys.stderr, flush=True)
        print(f"[elastic] lighthouse {lighthouse}; another replica joins with: python -m orchestration.train --config "
              f"{os.path.join(plan.run_dir, 'config.yaml')} --mesh.join {lighthouse} --mesh.replica-id K{store_flag}",
              file=sys.stderr, flush=True)
    launch = ElasticLaunch(_replica_rank, (cfg, plan), layout, replicas, lighthouse,
                           start_method=devices.start_method(m.start_method, m.device), threads=m.threads_per_rank,
                           restarts=m.replica_restarts if not m.join else 0)
    anchor_row = AnchorRow(cfg, plan, layout) if anchor and not m.join else None
    try:
        res = launch.run()
    except MeshFailure as e:
        return mesh_stopped(e, plan)
    finally:
        if proc is not None:
            proc.stdin.close()  # the lighthouse and the anchor store go: an anchor row still waiting ends
            try:
                proc.wait(10)
            except Exception:
                proc.kill()
        if anchor_row is not None:
            anchor_row.finish(m.timeout_s)
        summary = summarize_events(plan.run_dir, launch.restarted)
        with open(os.path.join(events_dir(plan.run_dir), "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        print(summary_line(summary), flush=True)
    return exit_code([r for rs in res.values() for r in rs])


class AnchorRow:
    """The anchor row of a local elastic run: its stages as one optional, restartable group
    of processes (--anchor.restarts), as orchestration.launch.local.join_anchor_row starts
    one, supervised in a thread while the replicas run; each stage's record is printed at
    the end."""

    def __init__(self, cfg, plan, layout: MeshLayout):
        import multiprocessing as mp
        import threading

        from orchestration.launch.processes import LocalRanks, free_port

        m = cfg.mesh
        self.layout = layout
        self.ranks = LocalRanks(anchor_row_rank, layout.stages, (cfg, plan),
                                mp.get_context(devices.start_method(m.start_method, m.device)), free_port(),
                                m.threads_per_rank, lambda r: layout.describe(layout.anchor_rank(r)),
                                set(range(layout.stages)), cfg.anchor.restarts)
        self.ranks.start_all()
        self.thread = threading.Thread(target=self.ranks.supervise, args=(None, 3.0), daemon=True,
                                       name="meshkern-anchor-row")
        self.thread.start()

    def finish(self, timeout_s: float) -> None:
        """After the replicas: the anchor row ends by itself once its store or its peers are
        gone (STOP, a closed link); after ``timeout_s`` it is ended."""
        self.thread.join(timeout_s)
        self.ranks.restarts_left = 0
        self.ranks.shutdown()
        self.thread.join(5.0)
        say_anchor_rows(self.layout, [out for _, out in sorted(self.ranks.results.items())])


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
    want = layout.stages_of(cfg.mesh.replica_id)
    if world != want:
        print(f"error: torchrun started {world} processes, elastic replica {cfg.mesh.replica_id} needs {want} "
              "(its stages)", file=sys.stderr)
        return 2
    out = run_rank(rank, world, cfg, plan, ElasticRole(cfg.mesh.replica_id, cfg.mesh.join))
    return exit_code([out], speak=rank == 0, clean_stop=0)
