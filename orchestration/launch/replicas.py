"""The supervisor of an elastic run's local replicas (--mesh.elastic): one process group
per fast replica, watched so that a replica can die without stopping the others.

Each fast replica is a ``run_local``-style group of its stages (its own MASTER_PORT: a
torch.distributed world of its own), watched in a thread of its own. When any stage of a
replica fails or dies, every stage of that replica is ended (a replica is one torchft
replica group: half of one would keep heartbeating) and, while other replicas still run
and ``--mesh.replica-restarts`` allows, it is started again: it joins the next quorum and
heals from a live peer. A replica that stops because the quorum was lost
(``QuorumLost``) or the secret refused it is not restarted.

The run succeeds when at least one replica trained to the end; it fails (MeshFailure)
when every replica is gone.
"""
from __future__ import annotations

import multiprocessing as mp
import queue
import signal
import sys
import threading

from orchestration.launch.processes import LocalRanks, MeshFailure, free_port

NO_RESTART = ("QuorumLost", "HealRefused", "CodecMismatch")  # a restart would fail the same way


class ElasticLaunch:
    """Runs ``fn(stage, stages, *args, replica_id, lighthouse, incarnation, first)`` for every stage of every
    replica in ``replicas``; ``run()`` returns {replica: [per-stage results]} of the
    replicas that finished."""

    def __init__(self, fn, args: tuple, layout, replicas: list[int], lighthouse: str, *, start_method: str,
                 threads: int, restarts: int, grace_s: float = 3.0):
        self.fn, self.args, self.layout, self.lighthouse = fn, args, layout, lighthouse
        self.ctx = mp.get_context(start_method)
        self.threads, self.restarts_left, self.grace_s = threads, restarts, grace_s
        self.replicas = list(replicas)
        self.live: dict[int, LocalRanks] = {}
        self.results: dict[int, list] = {}
        self.failures: dict[int, MeshFailure] = {}
        self.restarted: list[int] = []
        self._done: queue.Queue = queue.Queue()
        self._stopping = False

    def _describe(self, replica: int):
        return lambda stage: self.layout.describe(self.layout.rank_of(replica, stage))

    def _start(self, replica: int, first: tuple = ()) -> None:
        """Starts ``replica``'s stages; ``first``: the replicas of the launch, which wait for
        each other before their first quorum (a restart waits for nobody)."""
        incarnation = self.restarted.count(replica)
        ranks = LocalRanks(self.fn, self.layout.stages_of(replica),
                            self.args + (replica, self.lighthouse, incarnation, first), self.ctx,
                            free_port(), self.threads, self._describe(replica), set(), 0)
        ranks.start_all()
        self.live[replica] = ranks
        threading.Thread(target=self._watch, args=(replica, ranks), daemon=True,
                         name=f"meshkern-replica{replica}").start()

    def _watch(self, replica: int, ranks: LocalRanks) -> None:
        ranks.supervise(None, self.grace_s)
        silent = ranks.shutdown()  # every stage of the replica ends together
        try:
            self._done.put((replica, ranks, ranks.outcome(silent, None), None))
        except MeshFailure as e:
            self._done.put((replica, ranks, None, e))

    def on_stop(self, signum, frame) -> None:
        """Ctrl-C / SIGTERM: every replica stops at its next step boundary (as run_local)."""
        self._stopping = True
        for ranks in list(self.live.values()):
            ranks.on_stop(signum, frame)

    def run(self) -> dict[int, list]:
        for r in self.replicas:
            self._start(r, tuple(self.replicas))
        old = {}
        if threading.current_thread() is threading.main_thread():
            old = {sig: signal.signal(sig, self.on_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            while self.live:
                try:
                    replica, ranks, out, err = self._done.get(timeout=0.5)
                except queue.Empty:
                    continue
                if self.live.get(replica) is not ranks:
                    continue
                del self.live[replica]
                if err is None:
                    self.results[replica] = out
                    self.failures.pop(replica, None)
                    continue
                self.failures[replica] = err
                final = any(k in str(err) for k in NO_RESTART) or self._stopping
                if not final and self.restarts_left > 0 and self.live:
                    self.restarts_left -= 1
                    self.restarted.append(replica)
                    print(f"warning: fast replica {replica} stopped ({err}); restarting it, it heals from a live "
                          f"replica ({len(self.restarted)} restart(s) so far)", file=sys.stderr, flush=True)
                    self._start(replica)
                else:
                    left = ", ".join(map(str, sorted(self.live))) or "none"
                    print(f"warning: fast replica {replica} stopped for good ({err}); replicas still running: {left}",
                          file=sys.stderr, flush=True)
        finally:
            for ranks in list(self.live.values()):
                ranks.shutdown()
            for sig, h in old.items():
                signal.signal(sig, h)
        if not self.results:
            worst = self.failures[max(self.failures)] if self.failures else MeshFailure("no replica ran", 0)
            raise MeshFailure(f"every fast replica is gone; the last one: {worst}", worst.rank, worst.details)
        return self.results
