"""The torchft Managers of one rank of an elastic replica, one per torchft group rank it hosts.

A replica is one torchft replica group. Its group ranks are what one DP group spans across
the replicas (torchft gives group rank g of every replica in the quorum one process group):

- replicas alike (--mesh.rows x --mesh.stages): group rank = stage, one Manager per rank;
- a heterogeneous mesh (--mesh.replicas 1,2,2): group rank = sync segment
  (``MeshLayout.sync_segments``: the model units held by the same rank in every replica,
  whatever its split), so group rank g's process group joins exactly the holders of
  segment g in the quorum. Every replica has one group rank per segment; a rank holding
  several segments (a full replica's only stage) hosts several Managers.

Group rank 0 is the segment with the embedding, always on stage 0: it hosts the replica's
ManagerServer, which asks the lighthouse once every group rank asked it. A rank with
several Managers therefore calls their ``start_quorum`` / ``should_commit`` at once (one
thread each): one after the other, the first would wait for the second forever.
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

# torchft's Rust side logs every quorum and commit at INFO to stderr (read at import);
# its Python side warns on every reconfigure that CPU has no NCCL flight recorder.
os.environ.setdefault("RUST_LOG", "warn")
logging.getLogger("torchft").setLevel(logging.ERROR)

import torch  # noqa: E402
import torchft.manager as _tfm  # noqa: E402
from torchft import Manager  # noqa: E402
from torchft._torchft import ManagerServer as _ManagerServer  # noqa: E402

_BIND = {"host": "127.0.0.1"}


def bind_managers_to(host: str) -> None:
    """The address every torchft ManagerServer of this process listens on (--mesh.bind)."""
    _BIND["host"] = host


def _bound_manager_server(**kw):
    # torchft's Manager builds ManagerServer(bind=f"[::]:{port}", ...) with keywords only:
    # keep its port, listen on the run's host instead of every interface.
    kw["bind"] = f"{_BIND['host']}:{kw['bind'].rsplit(':', 1)[1]}"
    return _ManagerServer(**kw)


_tfm.ManagerServer = _bound_manager_server


@dataclass
class Slot:
    """One group rank this process hosts: its DP group (reconfigured per quorum), its heal
    transport and, between a retire and the next try, no Manager."""

    index: int  # the torchft group rank: the stage, or the sync segment's index
    group: object  # torchft.ProcessGroupGloo
    transport: object  # orchestration.elastic.transport.SecretHTTPTransport
    manager: Manager | None = None


class ManagerSet:
    """This rank's Managers, made, asked and retired together. ``make_kw(slot)``: the
    keywords of a slot's Manager (its group, transport, group rank, callbacks)."""

    def __init__(self, slots: list[Slot], make_kw, device=None):
        if not slots:
            raise ValueError("an elastic rank hosts at least one torchft group rank")
        self.slots = sorted(slots, key=lambda s: s.index)
        self._make_kw = make_kw
        # torchft reads the calling thread's current device (its quorum thread takes it, and
        # should_commit synchronizes it): the pool's threads use this rank's GPU, not GPU 0
        on_gpu = device is not None and torch.device(device).type == "cuda"
        self._pool = ThreadPoolExecutor(max_workers=len(self.slots), thread_name_prefix="meshkern_quorum",
                                        initializer=(lambda: torch.cuda.set_device(device)) if on_gpu else None) \
            if len(self.slots) > 1 else None

    # ---- what every Manager of a replica shares (the quorum): read from the first ----
    @property
    def primary(self) -> Manager | None:
        return self.slots[0].manager

    @property
    def complete(self) -> bool:
        return all(s.manager is not None for s in self.slots)

    @property
    def hosts_server(self) -> bool:
        """Whether this rank hosts group rank 0 (the replica's ManagerServer)."""
        return self.slots[0].index == 0

    # ---- made and retired together ---------------------------------------------------------
    def make(self, first_only: bool = False) -> None:
        """Makes the Managers not yet made (``first_only``: group rank 0's alone, which the
        others' need: they read its ManagerServer's address from the replica's store)."""
        for s in self.slots:
            if s.manager is None and (not first_only or s.index == 0):
                s.manager = Manager(**self._make_kw(s))

    def retire(self) -> str | None:
        """Ends every Manager (why: ElasticReplica._retire); returns the replica id that
        group rank 0's had at the lighthouse, or None when this rank hosts none."""
        rid = None
        for s in self.slots:
            old, s.manager = s.manager, None
            if old is None:
                continue
            if old._manager is not None:  # the ManagerServer (group rank 0)
                # the id torchft gave it (with the uuid), the one the lighthouse knows it by
                # (a private attribute of torchft 0.2.0: without it, no wait for the lighthouse)
                rid = getattr(getattr(old, "_logger", None), "_replica_id", None)
                old._manager.shutdown()
            old._executor.shutdown(wait=False)
        return rid

    def shutdown(self) -> None:
        for s in self.slots:
            if s.manager is not None:
                s.manager.shutdown(wait=False)
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    # ---- asked together ----------------------------------------------------------------
    def _each(self, fn) -> list:
        """``fn(manager)`` for every Manager, at once when there are several; the first
        error is raised after all have returned."""
        if self._pool is None:
            return [fn(self.slots[0].manager)]
        futures = [self._pool.submit(fn, s.manager) for s in self.slots]
        out, err = [], None
        for f in futures:
            try:
                out.append(f.result())
            except BaseException as e:  # noqa: BLE001 (re-raised below, after every thread ended)
                err = err or e
        if err is not None:
            raise err
        return out

    def start_quorum(self) -> None:
        self._each(lambda m: m.start_quorum())

    def should_commit(self) -> bool:
        return all(self._each(lambda m: m.should_commit()))

    def errors(self) -> list:
        """Every Manager's error of this quorum (torchft's ExceptionWithTraceback), in slot order."""
        return [e for s in self.slots if (e := s.manager.errored()) is not None]

    def steps(self) -> list[int]:
        """Every Manager's step count (alike after a quorum, unless a heal went through for some only)."""
        return [s.manager.current_step() for s in self.slots]

    def report_error(self, err: Exception) -> None:
        for s in self.slots:
            s.manager.report_error(err)

    def counts(self) -> dict:
        """The step and commit counts a new Manager starts from (the same on every slot)."""
        return {k: getattr(self.primary, k) for k in ("_step", "_batches_committed", "_commit_failures")}

    def carry_into(self, counts: dict) -> None:
        for s in self.slots:
            for k, v in counts.items():
                setattr(s.manager, k, v)

    # ---- the heal transports ------------------------------------------------------------
    @property
    def recv_attempts(self) -> int:
        return sum(s.transport.recv_attempts for s in self.slots)

    def recv_counts(self) -> list[int]:
        return [len(s.transport.recv_log) for s in self.slots]

    def heals_since(self, counts: list[int]) -> list[dict]:
        return [h for s, n in zip(self.slots, counts) for h in s.transport.recv_log[n:]]

    def close_transports(self) -> None:
        for s in self.slots:
            s.transport.shutdown()
