"""The torchrun launch: torchrun (one per machine) started this process as one rank and set
the env:// variables; it checks the world's size against the mesh and runs the rank.

    torchrun --nnodes N --node-rank i --nproc-per-node P --master-addr HOST0 ... -m orchestration.train ...

A fixed mesh is one torchrun world of its fast ranks; its anchor row is a second torchrun
(--anchor.join, one process per stage); an elastic replica is a torchrun of its stages
(--mesh.elastic --mesh.join, orchestration.launch.elastic.torchrun_replica).
"""
from __future__ import annotations

import os
import sys

from orchestration.distributed.mesh import MeshLayout
from orchestration.launch.outcome import exit_code
from orchestration.launch.rank import run_rank


def launch_torchrun(cfg, plan, layout: MeshLayout) -> int:
    """This process's rank, run to the end; the exit code."""
    join = cfg.anchor.join
    world = int(os.environ["WORLD_SIZE"])
    rid = cfg.mesh.replica_id
    want = layout.stages if join else (layout.stages_of(rid if 0 <= rid < layout.fast_rows else 0) if cfg.mesh.elastic
                                       else layout.fast_world_size)
    if world != want:
        what = "anchor row (one process per stage)" if join else f"{layout.name} mesh"
        extra = " plus an anchor row started with --anchor.join" if cfg.anchor.enabled and not join else ""
        print(f"error: torchrun started {world} processes, the {what} needs {want}{extra}", file=sys.stderr)
        return 2
    rank = int(os.environ["RANK"])
    if cfg.mesh.elastic and not join:  # one torchrun per replica, joining a lighthouse (an anchor row: below)
        from orchestration.launch.elastic import torchrun_replica

        return _leave(torchrun_replica(cfg, plan, layout, rank, world))
    if rank == 0 and cfg.anchor.enabled and not join:
        addr = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        print(f"[anchor] the fast circuit's store is {addr}; start the anchor row (one process per stage) "
              f"with: python -m orchestration.torchrun --nproc-per-node {layout.stages} ... -m orchestration.train <this run's flags> "
              f"--anchor.join --anchor.store {addr}", file=sys.stderr, flush=True)
        if layout.anchor_scope():
            print(f"[anchor] {layout.anchor_scope()}", file=sys.stderr, flush=True)
    out = run_rank(layout.anchor_rank(rank) if join else rank, world, cfg, plan)
    # a clean stop exits 0 here: torchrun would restart workers that exit non-zero
    return _leave(exit_code([out], speak=rank == 0, clean_stop=0))


def _leave(code: int) -> int:
    """``code``, or the process ends here with it: a fast rank whose anchor link thread is
    still blocked in a gloo receive (nothing can wake it) must not end through the
    interpreter's shutdown. An update arriving then returns the receive, the thread asks for
    the GIL of a finalizing interpreter, which ends it with pthread_exit through C++ frames:
    std::terminate, SIGABRT, and torchrun reports the clean stop as a failure (seen across
    hosts, 2 runs in 11). Everything the run writes is closed by now; stdio is flushed."""
    if "orchestration.anchor.fastlink" in sys.modules:
        from orchestration.anchor.fastlink import link_threads_alive

        if link_threads_alive():
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return code
