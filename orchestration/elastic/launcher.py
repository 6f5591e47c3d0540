"""The local launcher of an elastic run (--mesh.elastic): the lighthouse, one process group
per fast replica, and a supervisor that lets a replica die without stopping the others.

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

import json
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading

from orchestration.distributed.launch import MeshFailure, _LocalRanks, free_port

NO_RESTART = ("QuorumLost", "HealRefused")  # a restart would fail the same way


def events_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "elastic")


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
        self.live: dict[int, _LocalRanks] = {}
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
        ranks = _LocalRanks(self.fn, self.layout.stages_of(replica),
                            self.args + (replica, self.lighthouse, incarnation, first), self.ctx,
                            free_port(), self.threads, self._describe(replica), set(), 0)
        ranks.start_all()
        self.live[replica] = ranks
        threading.Thread(target=self._watch, args=(replica, ranks), daemon=True,
                         name=f"meshkern-replica{replica}").start()

    def _watch(self, replica: int, ranks: _LocalRanks) -> None:
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


def announce_up(run_dir: str, replica: int, lighthouse: str) -> None:
    """This replica's manager is up (heartbeating): a marker for ``wait_for_launch``."""
    path = os.path.join(events_dir(run_dir), f"up-replica{replica}")
    with open(path + ".part", "w") as f:
        f.write(lighthouse)
    os.replace(path + ".part", path)


def wait_for_launch(run_dir: str, replicas: tuple, lighthouse: str, timeout_s: float) -> None:
    """Waits until every replica of the launch announced itself to this lighthouse (or
    ``timeout_s``): the lighthouse forms a first quorum from the replicas it has heard of,
    so without this the ones whose processes started first would train alone for a step or
    two and the rest would heal into the run."""
    import time

    deadline = time.monotonic() + timeout_s
    for r in replicas:
        path = os.path.join(events_dir(run_dir), f"up-replica{r}")
        while time.monotonic() < deadline:
            try:
                with open(path) as f:
                    if f.read() == lighthouse:
                        break
            except OSError:
                pass
            time.sleep(0.05)


def read_events(run_dir: str) -> dict[tuple[int, int], list[dict]]:
    """The event records of an elastic run, {(replica, stage): records in file order}
    (RUN_DIR/elastic/replica{R}_stage{S}.jsonl; a line torn by a kill is left out)."""
    out: dict[tuple[int, int], list[dict]] = {}
    d = events_dir(run_dir)
    for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        if not (name.startswith("replica") and name.endswith(".jsonl") and "_stage" in name):
            continue
        r, s = name[len("replica"):-len(".jsonl")].split("_stage")
        recs = []
        with open(os.path.join(d, name)) as f:
            for line in f:
                try:
                    recs.append(json.loads(line))
                except ValueError:
                    pass
        out[(int(r), int(s))] = recs
    return out


def summarize_events(run_dir: str, restarts: list[int] | None = None) -> dict:
    """The elastic part of the run summary, from the replicas' event files: replicas per
    step, drops (a quorum smaller than the one before), heals (count, bytes, seconds)."""
    recs = [r for rs in read_events(run_dir).values() for r in rs]
    quorums = sorted((r for r in recs if r.get("quorum")), key=lambda r: r["wall"])
    per_step: dict[int, int] = {}
    for r in quorums:
        per_step[r["step"]] = max(per_step.get(r["step"], 0), r["participants"])
    drops, prev = 0, None
    for step in sorted(per_step):
        if prev is not None and per_step[step] < prev:
            drops += 1
        prev = per_step[step]
    healed = [r for r in quorums if r.get("healed_to") is not None]
    first = [r for r in healed if r.get("stage", 0) == 0]  # one record per heal; stages heal at once
    out = {"replicas_per_step": per_step, "min_replicas_seen": min(per_step.values(), default=0),
           "max_replicas_seen": max(per_step.values(), default=0), "drops": drops, "heals": len(first),
           "heal_bytes": sum(r["heal_bytes"] for r in healed), "heal_s": sum(r["heal_s"] for r in first),
           "failed_commits": sum(1 for r in recs if not r.get("committed", True) and r.get("stage", 0) == 0),
           "restarts": list(restarts or [])}
    return out


def summary_line(s: dict) -> str:
    heal = (f"{s['heals']} heal(s) ({s['heal_bytes'] / 1e6:.2f} MB, {s['heal_s']:.2f} s)" if s["heals"] else "no heals")
    return (f"elastic: {s['min_replicas_seen']}-{s['max_replicas_seen']} replicas per step, {s['drops']} drop(s), "
            f"{heal}, {len(s['restarts'])} restart(s), {s['failed_commits']} uncommitted step(s)")
