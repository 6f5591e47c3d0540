"""Local processes: runs ``fn(rank, world_size, *args)`` in one process per rank and
watches them, so that a rank that dies ends the whole run with an error naming it.

The same worker code runs under ``torchrun`` (multi-node): there, torchrun sets the
env:// variables and its agent tears the group down; here we set them ourselves
(MASTER_ADDR=127.0.0.1, a free MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK) and play
the agent's part:

- Results and errors come back over one pipe per rank (a shared queue could be left
  locked by a rank killed mid-write).
- The first rank to fail is named: a rank that died without reporting (killed by a
  signal, os._exit) is the cause; ranks that then failed on a broken connection to it
  are reported as consequences. After the first failure the others get ``grace_s`` to
  finish reporting, then are terminated: no hang, whatever they were blocked on.
- Ctrl-C / SIGTERM: ranks receive SIGINT (from the terminal and from the launcher, which
  relays a stop signal sent to it alone, e.g. a scheduler's SIGTERM) and stop cleanly at the
  next step boundary (saving a checkpoint); a second Ctrl-C terminates them.

``start_method="fork"`` (default on Linux) lets ranks inherit what the parent already
loaded (torch, transformers, the model, the token dataset) instead of importing and
loading it again per rank: ~6 s of import per rank on a 2-core machine.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from multiprocessing.connection import wait

from orchestration.distributed.failures import is_peer_error


STOP_REPEAT_S = 2.0  # a second stop signal within this many seconds of the first is the same request


class MeshFailure(RuntimeError):
    """A rank of the mesh failed; ``.rank`` is the first one, ``.message`` says how."""

    def __init__(self, message: str, rank: int, details: str = ""):
        super().__init__(message)
        self.rank = rank
        self.details = details


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_rank_env(rank: int, world_size: int, port: int, threads: int = 1) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(threads)


def _send(conn, msg) -> None:
    # Plain pickle, not multiprocessing's ForkingPickler: that one ships tensors as
    # shared-memory handles whose owner (this rank) may be gone by the time they are read.
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def _die_with_parent() -> None:
    """Linux: SIGTERM this rank if the launcher dies (no orphaned ranks after a kill -9)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
        except OSError:
            pass


def _child(fn, rank, world_size, port, threads, conn, args):
    _die_with_parent()
    set_rank_env(rank, world_size, port, threads)
    try:
        out = fn(rank, world_size, *args)
        _send(conn, ("ok", rank, out))
    except BaseException as e:  # report everything, including KeyboardInterrupt
        try:
            _send(conn, ("error", rank, {"type": type(e).__name__, "message": str(e),
                                       "traceback": traceback.format_exc(), "peer": is_peer_error(e)}))
        finally:
            conn.close()
            os._exit(1)
    conn.close()


def run_local(fn, world_size: int, args: tuple = (), *, start_method: str = "fork", threads: int = 1,
              timeout_s: float | None = None, grace_s: float = 3.0, describe=None,
              optional: frozenset | set = frozenset(), restarts: int = 0, port: int | None = None) -> list:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` local processes; returns the
    per-rank return values (rank order).

    ``optional`` ranks (the anchor row: nobody waits for it) may fail without stopping
    the others: their failure is printed as one warning line and their result is None.
    With ``restarts`` > 0, a failure of an optional rank while required ranks still run
    instead terminates every optional rank and starts them all again (they form one
    group, like the anchor row), at most ``restarts`` times; the result of an optional
    rank is then that of its last incarnation (one that reports a ConnectionError, i.e.
    what it joins is unreachable, is not restarted). ``port``: MASTER_PORT (default: a free one).

    Raises MeshFailure naming the first failed rank (``describe(rank)`` gives its name) if
    any rank raises or dies, or TimeoutError if ``timeout_s`` passes first. Never leaves a
    rank running behind it.
    """
    describe = describe or (lambda r: f"rank {r}")
    if start_method == "fork" and sys.platform != "linux":
        start_method = "spawn"
    ranks = LocalRanks(fn, world_size, args, mp.get_context(start_method), port or free_port(), threads,
                        describe, optional, restarts)
    ranks.start_all()
    old = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    in_main = True
    try:
        for sig in old:
            signal.signal(sig, ranks.on_stop)
    except ValueError:  # not the main thread (e.g. under some test runners)
        in_main = False
    try:
        ranks.supervise(None if timeout_s is None else time.monotonic() + timeout_s, grace_s)
    finally:
        silent = ranks.shutdown()
        if in_main:
            for sig, handler in old.items():
                signal.signal(sig, handler)
    return ranks.outcome(silent, timeout_s)


class LocalRanks:
    """The processes of one ``run_local`` call (or of one elastic replica,
    orchestration.launch.replicas) and what each reported: starts them, watches their
    pipes and exits, restarts the optional group, and ends them all."""

    def __init__(self, fn, world_size, args, ctx, port, threads, describe, optional, restarts):
        self.fn, self.world_size, self.args, self.ctx = fn, world_size, args, ctx
        self.port, self.threads, self.describe = port, threads, describe
        self.optional, self.restarts, self.restarts_left = set(optional), restarts, restarts
        self.required = set(range(world_size)) - self.optional  # empty: a group of optional ranks alone (--anchor.join)
        self.procs: list = [None] * world_size
        self.conns: list = [None] * world_size
        self.results: dict[int, object] = {}
        self.errors: dict[int, dict] = {}
        self.died: dict[int, int] = {}  # rank -> exit code of a rank that exited without reporting
        self.pending_conns: dict = {}  # pipe -> rank, until it reported or closed
        self.alive: dict = {}  # process sentinel -> rank, until it exited
        self.first_stop = None  # monotonic time of the first SIGINT/SIGTERM
        self.first_fail_at = None
        self.required_done_at = None

    def start(self, r: int) -> None:
        recv, send = self.ctx.Pipe(duplex=False)
        p = self.ctx.Process(target=_child, args=(self.fn, r, self.world_size, self.port, self.threads, send,
                                                  self.args), daemon=False)
        p.start()
        send.close()
        self.procs[r], self.conns[r] = p, recv

    def start_all(self) -> None:
        for r in range(self.world_size):
            self.start(r)
        self.pending_conns = {c: r for r, c in enumerate(self.conns)}
        self.alive = {p.sentinel: r for r, p in enumerate(self.procs)}

    def on_stop(self, signum, frame) -> None:
        """First SIGINT/SIGTERM: ask every rank to stop at its next step boundary and
        checkpoint (SIGINT to each: a terminal's Ctrl-C reaches them anyway, but a signal
        sent to the launcher alone, e.g. by a scheduler's SIGTERM, would not). Another one
        more than STOP_REPEAT_S later terminates them (one relayed by a wrapper just after
        the first is the same request, not a second Ctrl-C)."""
        now = time.monotonic()
        if self.first_stop is None:
            self.first_stop = now
            for p in self.procs:
                if p.is_alive():
                    try:
                        os.kill(p.pid, signal.SIGINT)
                    except ProcessLookupError:
                        pass
        elif now - self.first_stop > STOP_REPEAT_S:
            for p in self.procs:
                if p.is_alive():
                    p.terminate()

    def _only_optional_pending(self) -> bool:
        return all(q in self.optional for q in self.pending_conns.values())

    def restart_optional(self, r: int, how: str) -> bool:
        """Optional rank r failed: if allowed, start every optional rank afresh; True if so."""
        if self.restarts_left <= 0 or (self.required and self._only_optional_pending()):
            return False  # no restarts left, or the required ranks are done: nothing to rejoin
        self.restarts_left -= 1
        print(f"warning: {self.describe(r)} {how}; restarting ranks {sorted(self.optional)} "
              f"(restart {self.restarts - self.restarts_left} of {self.restarts})", file=sys.stderr, flush=True)
        procs, conns = self.procs, self.conns
        for q in self.optional:
            self.pending_conns.pop(conns[q], None)
            self.alive.pop(procs[q].sentinel, None)
            if procs[q].is_alive():
                procs[q].terminate()
        for q in self.optional:
            procs[q].join(5.0)
            if procs[q].is_alive():
                procs[q].kill()
                procs[q].join(2.0)
            conns[q].close()
            self.results.pop(q, None)
            self.start(q)
            self.pending_conns[conns[q]] = q
            self.alive[procs[q].sentinel] = q
        return True

    def supervise(self, deadline: float | None, grace_s: float) -> None:
        """Waits for every rank's report and exit; after the first failure the others get
        ``grace_s``, and so do optional ranks still running once every required rank reported."""
        while self.pending_conns or self.alive:
            now = time.monotonic()
            if self.first_fail_at is not None and now - self.first_fail_at > grace_s:
                break
            if deadline is not None and now > deadline:
                break
            if self.optional and self.required and self._only_optional_pending():
                # Every required rank reported: optional ones (e.g. a stalled anchor) get grace_s.
                self.required_done_at = self.required_done_at or now
                if now - self.required_done_at > grace_s:
                    for r in sorted(set(self.pending_conns.values()) - set(self.results)):
                        _lost(r, f"was still running {grace_s:g} s after the others finished: terminated",
                              self.describe, self.results)
                    break
            for obj in wait(list(self.pending_conns) + list(self.alive), timeout=0.2):
                if obj in self.pending_conns:
                    self._reported(obj)
                elif obj in self.alive:
                    self._exited(obj)

    def _reported(self, conn) -> None:
        r = self.pending_conns.pop(conn)
        try:
            kind, _, payload = pickle.loads(conn.recv_bytes())  # a local pipe from our own child
        except (EOFError, OSError):  # closed without a report: judged by its exit code
            return
        if kind == "ok":
            self.results[r] = payload
        elif r in self.optional:
            how = f"failed: {payload['type']}: {payload['message']}"
            # ConnectionError: what it joins is unreachable; a restart would wait in vain
            if payload["type"] == "ConnectionError" or not self.restart_optional(r, how):
                _lost(r, how, self.describe, self.results)
        else:
            self.errors[r] = payload
            self.first_fail_at = self.first_fail_at or time.monotonic()

    def _exited(self, sentinel) -> None:
        r = self.alive.pop(sentinel)
        self.procs[r].join(0.5)
        code = self.procs[r].exitcode
        if code != 0 and r in self.optional:
            self.pending_conns.pop(self.conns[r], None)
            if r not in self.results and not self.restart_optional(r, f"exited with code {code}"):
                _lost(r, f"exited with code {code}", self.describe, self.results)
        elif code != 0:
            # Collect its report, if it sent one, before deciding it died silently.
            c = self.conns[r]
            if c in self.pending_conns and c.poll(0.2):
                try:
                    kind, _, payload = pickle.loads(c.recv_bytes())
                    if kind == "error":
                        self.errors[r] = payload
                except (EOFError, OSError):
                    pass
                self.pending_conns.pop(c, None)
            if r not in self.errors:
                self.died[r] = code
            self.first_fail_at = self.first_fail_at or time.monotonic()

    def shutdown(self) -> list[int]:
        """Ends every rank still running; returns the required ranks that were still running
        without a word when the others failed (suspects of a stall)."""
        silent = [r for r in range(self.world_size) if r not in self.results and r not in self.errors
                  and r not in self.died and r not in self.optional and self.procs[r].is_alive()]
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        for c in self.conns:
            c.close()
        return silent

    def outcome(self, silent: list[int], timeout_s: float | None) -> list:
        """The per-rank results, or the MeshFailure / TimeoutError that ended the mesh."""
        if self.died or self.errors:
            raise _failure(self.died, self.errors, self.describe, silent)
        if len(self.results) < self.world_size:
            missing = [r for r in range(self.world_size) if r not in self.results]
            silent = [r for r in missing if self.procs[r].exitcode == 0]
            if silent:
                raise MeshFailure(f"{self.describe(silent[0])} exited without returning a result", silent[0])
            raise TimeoutError(f"mesh did not finish within {timeout_s} s; still running: "
                               + ", ".join(self.describe(r) for r in missing))
        return [self.results[r] for r in range(self.world_size)]


def _lost(r: int, how: str, describe, results: dict) -> None:
    print(f"warning: {describe(r)} {how}; the rest of the mesh continues without it", file=sys.stderr, flush=True)
    results[r] = None


def _failure(died: dict, errors: dict, describe, silent=()) -> MeshFailure:
    def how(code):
        if code is not None and code < 0:
            try:
                return f"killed by signal {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exited with code {code} without reporting an error"

    if died:  # a silent death is the cause; broken connections elsewhere are consequences
        r = min(died)
        msg = f"{describe(r)} died: {how(died[r])}"
        details = ""
    elif silent and all(e["peer"] for e in errors.values()):
        # Everyone who failed was waiting on a peer, and someone never failed nor finished.
        r = min(silent)
        w = min(errors)
        msg = (f"{describe(r)} stalled: it neither finished nor failed while {describe(w)} gave up waiting "
               f"({errors[w]['type']}: {errors[w]['message'][:200]})")
        details = errors[w]["traceback"]
    else:
        primary = [r for r, e in errors.items() if not e["peer"]] or sorted(errors)
        r = min(primary)
        e = errors[r]
        msg = f"{describe(r)} failed: {e['type']}: {e['message']}"
        details = e["traceback"]
    others = sorted((set(died) | set(errors)) - {r})
    if others:
        msg += "; then stopped: " + ", ".join(describe(o) for o in others)
    return MeshFailure(msg, r, details)
