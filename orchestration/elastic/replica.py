"""One rank's side of torchft: the Manager of its fast replica, the quorum per step, the heal.

Every stage of a fast replica holds one ``ElasticReplica``; together they are ONE torchft
replica group (the stage-0 rank hosts its ManagerServer), so the replica joins, leaves and
commits as a whole. Replicas alike: group rank = stage (``Manager(rank=stage,
world_size=stages)``), and each stage gets its own reconfigurable Gloo group across the
replicas of that stage (``group``: the stage's data-parallel group, what the compressors
and Streaming DiLoCo sync over). A heterogeneous mesh: group rank = sync segment, one
Manager and group per segment a rank holds (``segment_groups``; orchestration.elastic.managers).

The step protocol the trainer follows (orchestration.trainer):

    if replica.quorum_due(sync):     allreduce: every step; diloco: no fragment sync in flight
        replica.begin(step)          quorum of the live replicas; a replica behind heals here
    ... the step; a DP collective that fails -> replica.failed(err) ...
    replica.commit()                 False: a peer died inside the step (allreduce: the step is
                                     retried without its update; diloco: the failed sync is dropped)

Quorums are taken only where no DP collective is in flight, so a membership change never
aborts a sync of the replicas that stay. A replica that heals (a new one, a restarted
one, or one whose last commit failed where the others' succeeded) receives from a live
peer, through ``SecretHTTPTransport`` (the run's secret), what ``state_fn`` returns
there: the step, the trainable parameters, the inner optimizer and the DP sync state;
``load_fn`` applies it before the step runs, so its first contribution is computed on
the current weights (never stale) and carries only its own work (error feedback is
zeroed, DiLoCo restarts from the global copy: nothing of the peer is sent twice).

Bindings: torchft's ManagerServer binds every interface by default; here it binds
``--mesh.bind``, as do the heal server and the lighthouse."""
from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from datetime import timedelta

# first: it quiets torchft's logs before torchft is imported, and binds its ManagerServer
from orchestration.elastic.managers import ManagerSet, Slot, bind_managers_to  # noqa: I001

import torch
import torch.distributed as dist
from torchft import Manager, ProcessGroupGloo

from orchestration.distributed.replica_world import replica_store
from orchestration.elastic.errors import HealRefused, QuorumLost
from orchestration.elastic.lighthouse import heartbeat_ages
from orchestration.elastic.transport import SecretHTTPTransport

DIGESTS_ENV = "MESHKERN_ELASTIC_DIGESTS"  # "1": every step record carries a hash of the synced state


class ElasticReplica:
    """This rank's torchft Manager and its record of quorums and heals.

    ``replica_id``: the fast replica's number (its data shard and seed follow from it, not
    from its rank in the quorum, which changes with membership). ``lighthouse``: the
    lighthouse URL. ``secret``: the run's secret (orchestration.anchor.auth).
    ``segments``: a heterogeneous mesh's ``MeshLayout.sync_segments`` (the torchft group
    ranks), None for replicas alike. ``state_fn(group_rank) -> dict`` /
    ``load_fn(group_rank, dict)``: this rank's heal state of one group rank (tensors and
    plain values); set with ``attach`` before the first ``begin``. ``events``: a path this
    rank appends one JSON line per step to (quorum, participants, heal)."""

    def __init__(self, cfg, mesh, replica_id: int, lighthouse: str, secret: bytes, events: str | None = None,
                 segments: list | None = None):
        self.cfg, self.mesh, self.replica_id = cfg, mesh, replica_id
        m = cfg.mesh
        bind_managers_to(m.bind)
        tmo = timedelta(seconds=m.timeout_s)
        self.lighthouse = lighthouse
        self.segments = segments
        if segments:  # one group rank per sync segment, hosted by the rank of this replica that holds it
            mine, world = [i for i, seg in enumerate(segments) if mesh.rank in seg.ranks], len(segments)
        else:
            mine, world = [mesh.stage], mesh.layout.stages_of(mesh.row)
        slots = [Slot(i, ProcessGroupGloo(timeout=tmo), SecretHTTPTransport(
            secret, m.bind, tmo, rate_bps=cfg.run.bandwidth_bps, describe=mesh.describe(), device=mesh.device))
            for i in mine]
        # the store torchft advertises for the replicas' DP groups: on --mesh.bind, not the
        # replica's own (loopback) rendezvous store at MASTER_ADDR
        store_addr, store_port = replica_store(m.bind, m.timeout_s)
        self._state_fn = self._load_fn = self._digest_fn = self._save_fn = self._codec_digest_fn = self._facts_fn = None
        self._began = False  # a quorum was had: a step was committed or healed to
        self.leader = mesh.row == 0  # the replica with the lowest number in the last quorum: it writes checkpoints
        common = dict(
            min_replica_size=m.min_replicas,
            use_async_quorum=False,  # the heal is applied inside start_quorum: the step then runs on healed weights
            timeout=tmo, quorum_timeout=timedelta(seconds=m.quorum_timeout_s), connect_timeout=tmo,
            world_size=world, store_addr=store_addr, store_port=store_port,
            lighthouse_addr=lighthouse, replica_id=f"replica{replica_id}", hostname=m.bind,
            init_sync=False)  # replicas start alike; a late one heals

        def make_kw(slot: Slot) -> dict:
            return dict(common, pg=slot.group, rank=slot.index, checkpoint_transport=slot.transport,
                        state_dict=lambda: self._state(slot.index),
                        load_state_dict=lambda sd: self._load(slot.index, sd))

        self.managers = ManagerSet(slots, make_kw, device=mesh.device)
        self.managers.make(first_only=True)  # group rank 0 first: the others read its ManagerServer's address
        self.managers.make()
        for s in slots:
            # The compressors' ring byte counts need this rank's place in the group, which
            # dist.get_rank cannot tell for a torchft group (meshkern.compress.base).
            s.group.meshkern_rank = lambda: (self.manager.participating_rank() if self.manager else 0) or 0
        self._heal_lock = threading.Lock()  # several group ranks' heals land at once (their quorum threads)
        self.incarnation = 0  # restarts of this replica before this process (the launcher's count)
        self.step = 0  # the step about to run (what a healing peer receives)
        self.healed_to: int | None = None
        self._error: BaseException | None = None  # a DP failure since the last commit
        self._quorum: dict = {}
        self.stats = {"quorums": 0, "heals": 0, "heal_bytes": 0, "heal_s": 0.0, "failed_commits": 0,
                      "new_managers": 0}
        self._events = open(events, "a") if events else None
        self._carry: dict = {}  # the step and commit counts a new Manager starts from (_quorum_or_wait)
        self._attempts_at_try = 0  # the heal transport's receive attempts when this quorum try began
        self._stop_fn = lambda: False  # whether a stop was requested (attach)
        self._retired_id: str | None = None  # stage 0: the Manager retired last, until the lighthouse counts it dead

    def attach(self, state_fn, load_fn, digest_fn=None, save_fn=None, codec_digest_fn=None, facts_fn=None,
               stop_fn=None) -> None:
        """``digest_fn() -> str``: a hash of what replicas hold alike after a commit (for
        MESHKERN_ELASTIC_DIGESTS=1 records: the tests check a healed replica against its peers).
        ``save_fn(step)``: checkpoints this replica at a step boundary (the leader calls it
        when the quorum is lost, so the run stops with its last committed state saved).
        ``facts_fn() -> dict``: more of the step's record (the anchor hook's counters).
        ``stop_fn() -> bool``: whether Ctrl-C / SIGTERM asked this rank to stop (checked while
        it waits for a quorum)."""
        self._state_fn, self._load_fn, self._save_fn, self._facts_fn = state_fn, load_fn, save_fn, facts_fn
        self._stop_fn = stop_fn or (lambda: False)
        self._digest_fn = digest_fn if os.environ.get(DIGESTS_ENV) == "1" else None
        self._codec_digest_fn = codec_digest_fn if self._digest_fn is not None else None

    @property
    def manager(self) -> Manager | None:
        """This rank's first Manager (what all share, the quorum, is read from it); None after a retire."""
        return self.managers.primary

    @property
    def group(self):
        """The DP group of replicas alike (this stage's), reconfigured per quorum."""
        return self.managers.slots[0].group

    def segment_groups(self) -> list:
        """A heterogeneous mesh: [(SyncSegment, its DP group)] for the segments this rank holds."""
        return [(self.segments[s.index], s.group) for s in self.managers.slots]

    def count_steps_from(self, count: int) -> None:
        """Before the first quorum: torchft's commit count starts at ``count`` (ahead of a replica at 0)."""
        self.managers.carry_into({"_step": count})

    def requorum(self, step: int) -> int | None:
        """Asks again with the same Managers after --mesh.heartbeat-s: ``begin(step)``'s
        answer; every stage together. Not retired: they keep heartbeating, so a replica that
        asks meanwhile waits for this one (the lighthouse's join timeout, 2x the pause) and
        joins its quorum; retired ones went unseen, and a replica then trained alone (CI)."""
        self._backoff(self.cfg.mesh.heartbeat_s)
        return self.begin(step)

    # ---- torchft callbacks -----------------------------------------------------------------
    def _state(self, index: int) -> dict:
        return {"step": self.step, **self._state_fn(index)}

    def _load(self, index: int, sd: dict) -> None:
        with self._heal_lock:
            self._load_fn(index, sd)
            self.healed_to = int(sd["step"])

    # ---- the step protocol -----------------------------------------------------------------
    def quorum_due(self, sync) -> bool:
        """Whether the step about to run starts with a quorum: when no DP sync is in flight on
        any stage of this replica (DiLoCo's overlap carries a sync across a step boundary; a
        quorum there could reconfigure the group under it). The stages agree on it: their
        fragment counts, so their schedules, may differ (a heterogeneous mesh's segments)."""
        return not self.replica_max(any(d.in_flight for d in sync.diloco))

    def begin(self, step: int) -> int | None:
        """Quorum for ``step``; returns the step to run (another one after a heal), or None
        when a stop request came while it waited for one. Raises HealRefused (the run's
        secret is not ours), QuorumLost (too few live replicas for --mesh.quorum-timeout-s)
        or the heal's own error."""
        self.step, self.healed_to = step, None
        n0 = self.managers.recv_counts()
        t0 = time.perf_counter()
        if not self._quorum_or_wait(step):
            return None
        errors = self.managers.errors()
        refused = next((e.original_exception for e in errors if isinstance(e.original_exception, HealRefused)), None)
        if refused is not None:  # whichever Manager met it
            raise refused
        err = errors[0] if errors else None
        if err is not None:
            cause = err.original_exception
            if self.managers.recv_attempts > self._attempts_at_try:  # the heal itself failed: this replica's state is behind
                raise RuntimeError(f"{self.mesh.describe()}: healing from a peer failed: {cause}") from cause
            self._error = cause  # the group's reconfigure failed: this step will not commit
        steps, healed = self.managers.steps(), -1 if self.healed_to is None else self.healed_to
        if len(set(steps)) > 1 or self.replica_max(healed) != -self.replica_max(-healed):
            # one segment (or stage) healed and another not: that one would stay behind for good
            raise RuntimeError(f"{self.mesh.describe()}: a heal went through for some of this replica's segments "
                               f"or stages only (torchft steps {steps}, healed to {healed})")
        rank = self.manager.participating_rank()
        self.leader, self._began = rank == 0, True
        self.stats["quorums"] += 1
        self._quorum = {"quorum_s": time.perf_counter() - t0, "quorum_wall": time.time(),  # when the quorum (and heal) ended
                        "participants": self.manager.num_participants(),
                        "quorum_id": self.manager._quorum_id, "replica_rank": rank}
        heals = self.managers.heals_since(n0)
        if heals:
            heal = {"heal_bytes": sum(h["heal_bytes"] for h in heals), "heal_s": sum(h["heal_s"] for h in heals)}
            self.stats["heals"] += 1
            for k, v in heal.items():
                self.stats[k] += v
            self._quorum.update(healed_to=self.healed_to, **heal)
        return step if self.healed_to is None else self.healed_to

    def _quorum_or_wait(self, step: int) -> bool:
        """torchft's quorum, taken by every stage of this replica together. A try that fails
        on any stage (no quorum of --mesh.min-replicas within --mesh.quorum-timeout-s, the
        lighthouse unreachable: a link that is down) fails on all of them (they agree over
        the replica's own world, on loopback), every stage's torchft Manager is replaced
        (``_retire`` / ``_new_manager``: why, there) and the quorum asked for again with
        backoff, each wait said on stderr, for --mesh.rejoin-timeout-s in all; then
        QuorumLost (the leader saves its last committed step first). True once in a quorum;
        False when Ctrl-C / SIGTERM reached any stage while it waited: it is seen after the
        try under way (a quorum request: --mesh.quorum-timeout-s at most; reaching a
        lighthouse that is down: --mesh.timeout-s at most) or during the backoff, and every
        stage returns False together."""
        m = self.cfg.mesh
        t0, tries, delay = time.monotonic(), 0, 1.0
        # what a new Manager starts from: the counts before this quorum, alike on every stage
        # (a stage may have healed in a try that failed on another: the replica stays at the
        # step it had, behind, so the try that succeeds heals every stage again)
        if self.managers.complete:  # (a Manager missing: the counts kept when it was made or retired)
            self._carry = self.managers.counts()
        while True:
            if tries and self._stopping(step):  # after the backoff: before a new try
                return False
            t_try = time.monotonic()
            self._attempts_at_try = self.managers.recv_attempts
            err = self._new_manager() if not self.managers.complete else None
            if err is None:
                try:
                    self.managers.start_quorum()
                except Exception as e:  # the quorum RPC failed: torchft handles heal and reconfigure errors itself
                    err = e
            # every stage of the replica ran this try's quorum, or none did: one that got a
            # quorum while another's request timed out would otherwise run a step alone
            failed = self.replica_max(err is not None)
            if not failed:
                if tries:
                    print(f"[elastic] {self.mesh.describe()}: back in a quorum after {time.monotonic() - t0:.1f} s "
                          f"without one ({tries} failed tries; {self.manager.num_participants()} replica(s))",
                          file=sys.stderr, flush=True)
                return True
            tries += 1
            why = _short(err) if err is not None else "another stage of this replica got no quorum"
            self._retire()
            self.healed_to = None
            if self._stopping(step):
                return False
            # the same decision on every stage: stage 0's clock
            left = self.replica_max((m.rejoin_timeout_s - (time.monotonic() - t0)) if self.mesh.stage == 0 else -1e30)
            if left <= 0:
                if self.leader and self._began and self._save_fn is not None:
                    self._save_fn(step)  # where it stopped, valid: every step before it was committed
                raise QuorumLost(f"{self.mesh.describe()}: no quorum of >= {m.min_replicas} live replicas "
                                 f"(--mesh.min-replicas) from the lighthouse {self.lighthouse} in {tries} tries "
                                 f"over {time.monotonic() - t0:.0f} s (--mesh.quorum-timeout-s "
                                 f"{m.quorum_timeout_s:g} each, --mesh.rejoin-timeout-s {m.rejoin_timeout_s:g} in "
                                 f"all): {why}") from err
            # Backoff between tries that fail fast (the lighthouse unreachable); at least the
            # lighthouse's heartbeat timeout, the time it usually takes to count the retired
            # Manager dead (_new_manager then makes sure it does before the new one asks).
            wait = min(max(m.heartbeat_s + 0.5, delay - (time.monotonic() - t_try)), left)
            print(f"[elastic] {self.mesh.describe()}: no quorum at step {step} ({why}); waiting for the "
                  f"lighthouse {self.lighthouse} to answer with >= {m.min_replicas} live replica(s): asking again "
                  f"in {wait:.0f} s, for up to {left:.0f} s more (--mesh.rejoin-timeout-s)",
                  file=sys.stderr, flush=True)
            self._backoff(wait)
            delay = min(2 * delay, 8.0)

    def _stopping(self, step: int) -> bool:
        """Whether Ctrl-C / SIGTERM reached any stage of this replica (every stage gets the
        same answer: they stop waiting together)."""
        if not self.replica_max(self._stop_fn()):
            return False
        print(f"[elastic] {self.mesh.describe()}: stopped while waiting for a quorum at step {step}",
              file=sys.stderr, flush=True)
        return True

    def _backoff(self, wait: float) -> None:
        """Sleeps ``wait`` seconds between quorum requests (not a synchronisation), ending
        early on a stop request (the next check agrees on it with the other stages)."""
        end = time.monotonic() + wait
        while not self._stop_fn() and (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 0.25))

    def replica_max(self, x: float) -> float:
        """The largest ``x`` over this replica's stages (its own world, on loopback, with a
        bound longer than any stage's wait: replica_world.SIBLING_TIMEOUT_S); ``x`` itself on
        a replica of one stage."""
        if self.mesh.layout.stages_of(self.mesh.row) == 1:
            return float(x)
        t = torch.tensor([float(x)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.mesh.fast)
        return float(t[0])

    def _retire(self) -> None:
        """Ends this stage's torchft Manager after a failed quorum. Not asked again: torchft
        0.2.0's ``start_quorum`` first re-raises the last quorum's error, so a Manager whose
        quorum failed never asks the lighthouse again (measured: a replica back from an
        outage waited forever); and its ManagerServer may still hold a request that the
        lighthouse answers later, to whoever asks next. The heal server (``transport``) and
        the DP group stay; the new Manager has a new replica id (torchft adds a uuid), which
        the lighthouse sees as a replica that restarted."""
        self._retired_id = self.managers.retire() or self._retired_id  # (ends group rank 0's ManagerServer)

    def _new_manager(self) -> BaseException | None:
        """A new torchft Manager on every stage of this replica, or on none (the error, the
        same on every stage). Stage 0's hosts the ManagerServer and must reach the lighthouse
        (a link still down fails here, after --mesh.timeout-s at most); the others are made
        after it, so they read its new address from the replica's torchft store. Stage 0
        first waits until the lighthouse counts the Manager it retired dead
        (``_retired_forgotten``); when it does not, no stage makes one."""
        err: BaseException | None = None
        if self.managers.hosts_server:
            try:
                err = self._retired_forgotten()
                if err is None:
                    self.managers.make(first_only=True)
            except Exception as e:
                err = e
        if self.replica_max(err is not None):  # stage 0 could not: none tries
            return err or RuntimeError("stage 0 of this replica could not reach the lighthouse")
        try:
            self.managers.make()
        except Exception as e:
            err = e
        if self.replica_max(err is not None):
            self._retire()
            return err or RuntimeError("a stage of this replica could not start its torchft Manager")
        self.managers.carry_into(self._carry)
        self.stats["new_managers"] += 1
        return None

    def _retired_forgotten(self) -> BaseException | None:
        """Stage 0, before its new Manager asks for a quorum: waits until the lighthouse no
        longer counts the Manager last retired (``_retire``) as live, i.e. has not heard
        from it for --mesh.heartbeat-s on its own clock, for --mesh.timeout-s at most.
        None once two reads half --mesh.heartbeat-s apart say so (or it is unknown there, or
        the status cannot be read: the new Manager's connect then says why); otherwise the
        error (this try fails, and the next one waits again), also on a stop request.

        Why: the lighthouse keeps a quorum request that timed out as a participant until a
        quorum forms, and counts its replica live while its heartbeats are recent, stamped
        when the lighthouse reads them. A lighthouse that was starved of CPU (a loaded
        machine) reads a heartbeat the retired Manager sent before its shutdown only later,
        so the wait on this side's clock (the backoff) is not enough: the new Manager's
        request would then complete a quorum with the retired one, a ghost whose store key
        the group's configure waits for (--mesh.timeout-s) in vain."""
        rid = self._retired_id
        if rid is None:
            return None
        m = self.cfg.mesh
        end = time.monotonic() + m.timeout_s
        dead_since = None  # this side's clock at the first read that found it dead, since none found it live
        while True:
            try:
                age = heartbeat_ages(self.lighthouse, min(5.0, m.timeout_s)).get(rid)
            except (OSError, ValueError):
                return None
            if age is None or age >= m.heartbeat_s:
                # two reads: a lighthouse just resumed may serve the first before the retired
                # Manager's queued heartbeats, and one stamped between makes the second live
                dead_since = time.monotonic() if dead_since is None else dead_since
                if time.monotonic() - dead_since >= m.heartbeat_s / 2:
                    self._retired_id = None
                    return None
            else:
                dead_since = None
            if self._stop_fn():
                return RuntimeError("stopped while the lighthouse still counted the retired torchft Manager live")
            if dead_since is None and time.monotonic() >= end:
                return RuntimeError(f"the lighthouse {self.lighthouse} still counts this replica's retired torchft "
                                    f"Manager {rid} live (heard from {age:.1f} s ago, after {m.timeout_s:g} s: "
                                    f"--mesh.timeout-s); a quorum with it would wait for it")
            time.sleep(0.1)

    def failed(self, err: BaseException) -> None:
        """A DP collective of this step failed (a peer died inside it): no commit, and this
        rank's group is torn down at once. A live peer whose part of the same collective
        still waits on this rank then fails now: gloo has no abort, only closing the sockets
        (dropping the last reference to the group) ends its wait; otherwise it would wait
        until this rank next reconfigures, fall out of that quorum and heal back. The failed
        commit makes the next quorum a new one (the lighthouse bumps it), which rebuilds the
        group on every member; until then a collective on it fails at once (SyncError)."""
        self._error = RuntimeError(str(err))  # the message: the exception's frames hold the failed work (the group)
        e: BaseException | None = err
        while e is not None:
            if e.__traceback__ is not None:
                traceback.clear_frames(e.__traceback__)
            e = e.__cause__ or e.__context__
        for s in self.managers.slots:
            s.group.abort()  # drops torchft's reference to the gloo group

    def commit(self) -> bool:
        """torchft's should_commit (every stage of the replica must agree): False when any
        stage saw a failure or the quorum is below --mesh.min-replicas."""
        if self._error is not None:
            self.managers.report_error(self._error if isinstance(self._error, Exception)
                                       else RuntimeError(str(self._error)))
            self._error = None
        ok = self.managers.should_commit()
        if not ok:
            self.stats["failed_commits"] += 1
        return ok

    def record(self, step: int, committed: bool, quorum: bool) -> dict:
        """This step's quorum facts (also appended to the events file by stage 0)."""
        rec = {"step": step + 1, "replica": self.replica_id, "stage": self.mesh.stage, "committed": committed,
               "quorum": quorum, "wall": time.time(), "pid": os.getpid(), "incarnation": self.incarnation}
        if self._digest_fn is not None:
            rec["digest"] = self._digest_fn()
        if self._codec_digest_fn is not None:
            rec["codec"] = self._codec_digest_fn()  # the calibrated codec state (pca bases), or None
        if quorum:
            rec.update(self._quorum)
        if self._facts_fn is not None:
            rec.update(self._facts_fn())
        if self._events is not None:
            self._events.write(json.dumps(rec) + "\n")
            self._events.flush()
        return rec

    def close(self) -> None:
        if self._events is not None:
            self._events.close()
        try:
            self.managers.shutdown()  # (none left after QuorumLost retired the last ones)
        finally:
            self.managers.close_transports()


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text[:300]}"
