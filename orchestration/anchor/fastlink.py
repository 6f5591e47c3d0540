"""The fast rank's link thread (docs/anchor.md, "Fast ranks never wait for the anchor").

One daemon thread per fast rank does all of the rank's anchor traffic, with blocking
point-to-point on a gloo pair link of its own: it links with each anchor-row generation
of its stage in turn, serves snapshot requests (replica 0) and receives updates. It shares
exactly three things with the trainer's thread:

    events      a queue it fills: ("joined", G), ("lost", why), ("update", Arrival),
                ("rejected", reason, version), ("refused", why) (a peer that did not
                prove the run's secret), ("error", exception)
    snapshots   the versions replica 0 may serve, under ``cv`` (``offer`` fills it)
    *_bytes     counters it only adds to (read by the trainer's thread)

Only link failures (``links.is_link_failure``: a broken connection, a timeout, a store
that went away, a peer that broke the protocol) mean "anchor lost"; anything else is a
programming error, handed to the trainer's thread as an "error" event and raised there.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch

from orchestration.anchor.auth import AuthError, fast_handshake
from orchestration.anchor.links import (ANCHOR, FAST, PREFIX, Warner, announced_generation, is_link_failure, pair_link,
                                        register_fast, side_store, store_address, wait_accepted)
from orchestration.anchor.snapshot import SnapshotCoder
from orchestration.anchor.wire import (CODE_DTYPES, DRAIN_FACTOR, DTYPE_CODES, payload_timeout, F_DTYPE, F_KIND, F_MAGIC, F_MS,
                                       F_NUMEL, F_ROUND, F_VERSION, GRAD, HEADER_BYTES, HEADER_LEN, MAGIC, REQ,
                                       SNAP, STOP, ProtocolError, Rejected, gloo_reason, header, recv, send)


_THREADS: list[threading.Thread] = []  # every link thread of this process (link_threads_alive)


def link_threads_alive() -> bool:
    """Whether a link thread of this process still runs (blocked in a gloo receive, say):
    such a process must not end through the interpreter's shutdown (see launch.torchrun)."""
    return any(t.is_alive() for t in _THREADS)


@dataclass
class Arrival:
    """One anchor update as received by a fast rank's link thread."""

    round: int
    version: int
    payload: torch.Tensor
    round_ms: int
    nbytes: int


class FastLink:
    """The link thread of fast replica ``row`` of ``stage`` (see the module docstring).

    ``layout``: the expected GRAD payload (wire.Layout); ``numel``: the stage's parameter
    count (snapshots); ``serves``: this rank answers snapshot requests (replica 0; every
    elastic replica); ``newest_first``: serve the newest snapshot >= the request
    (asynchronous mode) rather than the oldest (delay mode); ``store``: (host, port) of the
    store the anchor rows announce themselves in (default: the fast circuit's,
    MASTER_ADDR / MASTER_PORT); ``relink``: after a link breaks, link again with the same
    generation too, not only with a newer one (elastic replicas: the anchor end drops a
    replica it cannot reach and takes it back when it registers again)."""

    def __init__(self, *, stage: int, row: int, layout, numel: int, snapshot_codec: str, serves: bool,
                 newest_first: bool, timeout_s: float, secret: bytes, store: tuple | None = None,
                 relink: bool = False, max_bps: float = 0.0):
        self.stage, self.row, self.layout, self.numel, self.secret = stage, row, layout, numel, secret
        self.store_addr, self.relink = store, relink
        self.snapshot_codec, self.serves, self.newest_first, self.timeout_s = snapshot_codec, serves, newest_first, timeout_s
        self.events: queue.Queue = queue.Queue()
        self.cv = threading.Condition()
        self.snapshots: dict[int, torch.Tensor] = {}
        self.closing = False
        self.in_flight = 0  # bytes of the snapshot being sent (close waits for it)
        self.max_bps = max_bps  # --anchor.max-rate-bps: the snapshots' pace (0: unpaced)
        self._flown_s, self._since = 0.0, None  # in_flight_s: finished snapshots' seconds, the current one's start
        self.pg = None  # the current generation's pair link
        self.coder = None
        self.wire_bytes = 0      # both directions of this rank's anchor link (axis "anchor")
        self.snapshot_bytes = 0
        self.update_bytes = 0
        self.snapshots_sent = 0
        # under ``cv``: the newest snapshot version served, the newest update's version
        # received (-1: none yet) and that update's round time (close waits for an owed one)
        self.served_version, self.update_version, self.round_s = -1, -1, 0.0
        # Delay mode, replica 0 (exact resume, FastHook.state_dict): the snapshot coder's
        # view after each version served (int8 codec), under ``cv``; and the view a resumed
        # run continues from (SnapshotCoder.resume), used by the first snapshot served.
        self.keep_views = serves and not newest_first and snapshot_codec != "full"
        self.views: dict[int, torch.Tensor] = {}
        self.resume_view: torch.Tensor | None = None
        self.warn = Warner(f"stage {stage} replica {row}")
        self.thread = threading.Thread(target=self._run, name=f"anchor-link-{stage}", daemon=True)
        self.thread.start()
        _THREADS.append(self.thread)

    # ------------------------------------------------------------ trainer's thread
    def offer(self, version: int, flat: torch.Tensor, keep_older: bool) -> None:
        """Makes snapshot ``version`` (flat CPU parameters, never mutated) servable."""
        with self.cv:
            if not keep_older:
                self.snapshots.clear()
            self.snapshots[version] = flat
            self.cv.notify_all()

    def view_after(self, version: int) -> torch.Tensor | None:
        """The coder's view after serving ``version`` (delay mode, int8 codec), if kept."""
        with self.cv:
            return self.views.get(version)

    def drop_views_before(self, version: int) -> None:
        with self.cv:
            for v in [v for v in self.views if v < version]:
                del self.views[v]

    def close(self) -> None:
        """Stops serving snapshots (an anchor waiting for one gets STOP); the thread is a
        daemon and ends with the process or the broken connection. A snapshot being sent is
        finished first (within ``payload_timeout`` of its bytes): a process that ended
        mid-payload left the anchor rank waiting for the rest (measured across hosts at
        500 kbit/s: a 2.4 MiB snapshot cut off at the run's end held the anchor row for good)."""
        with self.cv:
            self.closing = True
            self.cv.notify_all()
            busy = self.in_flight
        if busy:
            print(f"[anchor] stage {self.stage}: the run ends; finishing the snapshot on its way to the anchor row "
                  f"({busy / 2**20:.2f} MiB)", flush=True)
        wait = 1.0 + (payload_timeout(busy, self.timeout_s).total_seconds() if busy else 0.0)
        with self.cv:
            owed = self.served_version > self.update_version and self.update_version >= 0
            round_s = self.round_s
        if self.serves and not self.relink and owed:
            # A fixed mesh's server whose anchor row is in a round on a snapshot it served:
            # the round's update still comes here, then its next request gets STOP and the
            # row ends as finished. A process gone before that left the update with nobody to
            # take it (a closed link: the row ended as broken; seen on a loaded machine). The
            # row's rounds so far say how long: 3 of them, at least 5 s, at most --mesh.timeout-s
            # (an anchor that never sent an update is not waited for).
            wait += min(self.timeout_s, max(5.0, 3 * round_s))
        self.thread.join(timeout=wait)

    # ------------------------------------------------------------ the link thread
    def _run(self) -> None:
        try:
            self._link()
        except BaseException as e:  # a programming error: the trainer's thread raises it
            self.events.put(("error", e))

    def _link(self) -> None:
        """Links with each anchor generation of this stage in turn, for the whole run: waits
        until one opens, links, serves it until it breaks ("lost"), then waits for the next
        (a restarted anchor row), or with ``relink`` links again with the same one. Ends at
        close or when the store is gone."""
        store, gen, s, again = None, 0, self.stage, False
        while not self.closing:
            try:
                if store is None:
                    store = side_store(self.store_addr or store_address(), self.timeout_s)
                    store.compare_set(f"{PREFIX}run_id", "", os.urandom(8).hex())  # the first fast rank's wins
                latest = announced_generation(store, self.secret, self.warn, after=gen)  # MAC'd announces only
                if latest <= gen and not again:  # no new anchor of this stage: look again soon
                    time.sleep(0.2)  # (polling, not a timed-out store.wait: c10d logs every timeout)
                    continue
                gen, again = max(gen, latest), False  # the newest; older ones that never opened are skipped
                store.wait([f"{PREFIX}g{gen}/open/{s}"], timedelta(seconds=self.timeout_s))
                slot, token = register_fast(store, gen, s, self.row)
                if not wait_accepted(store, gen, s, self.row, slot, token, lambda: self._gone_past(store, gen)):
                    continue  # a newer generation (or the run's end) came first
                pg = pair_link(store, gen, s, self.row, FAST, self.timeout_s, slot)
                try:  # nothing is sent or used before the anchor end proved the run's secret
                    fast_handshake(pg, self.secret, gen, s, self.row, self.timeout_s)
                except Exception as e:
                    if not is_link_failure(e):
                        raise
                    self.events.put(("refused", f"generation {gen}: {e}" if isinstance(e, AuthError)
                                     else f"generation {gen}: no valid handshake ({gloo_reason(e)})"))
                    del pg
                    continue  # wait for the next generation
            except Exception as e:
                if not (self.closing or is_link_failure(e)):
                    raise
                if self.closing or type(e).__name__ == "DistNetworkError" or isinstance(e, ConnectionError):
                    return  # the store is gone: the run is over
                continue  # that generation never opened / never linked: wait for the next one
            self.pg = pg
            self.coder = SnapshotCoder(self.snapshot_codec, self.numel)
            self.events.put(("joined", gen))
            try:
                if self._serve_link():
                    return  # the fast circuit finished: STOP sent
            except Exception as e:
                if self.closing:
                    return
                if not is_link_failure(e):
                    raise
                self.events.put(("lost", gloo_reason(e)))
                if self.relink:
                    again = True
                    time.sleep(1.0)  # the anchor end takes new links between its rounds

    @property
    def in_flight_s(self) -> float:
        """Seconds a snapshot has been on its way to the anchor so far, the one going now
        included (the link model's share of this rank's uplink: linkmodel.anchor_stream_share)."""
        with self.cv:
            return self._flown_s + (time.monotonic() - self._since if self._since is not None else 0.0)

    def _gone_past(self, store, gen: int) -> bool:
        """Whether to give up linking with generation ``gen``: closing, or a newer one announced."""
        return self.closing or announced_generation(store, self.secret, self.warn, after=gen) > gen

    def _serve_link(self) -> bool:
        """Serves the current anchor generation until its link breaks (raises) or the fast
        circuit finishes (returns True after sending STOP)."""
        while True:
            h = recv(HEADER_LEN, torch.int64, ANCHOR, self.pg)
            self.wire_bytes += HEADER_BYTES
            kind = int(h[F_KIND]) if int(h[F_MAGIC]) == MAGIC else -1
            if kind == REQ and self.serves:
                if not self._serve(int(h[F_VERSION])):
                    return True
            elif kind == GRAD:
                self._receive_update(h)
            else:
                raise ProtocolError(f"anchor protocol: unexpected header {h.tolist()}")

    def _receive_update(self, h: torch.Tensor) -> None:
        try:
            self.layout.check_header(h)
        except Rejected as r:
            n, code = int(h[F_NUMEL]), int(h[F_DTYPE])
            if r.reason != "shape" or code not in CODE_DTYPES or not 0 <= n <= DRAIN_FACTOR * self.layout.numel + 4096:
                raise ProtocolError(f"anchor protocol: {r}") from None
            junk = recv(n, CODE_DTYPES[code], ANCHOR, self.pg)  # drain: keep the stream aligned
            self.wire_bytes += junk.numel() * junk.element_size()
            self.events.put(("rejected", r.reason, int(h[F_VERSION])))
            return
        payload = recv(self.layout.numel, self.layout.dtype, ANCHOR, self.pg)
        nbytes = payload.numel() * payload.element_size()
        self.wire_bytes += nbytes
        self.update_bytes += nbytes + HEADER_BYTES
        with self.cv:
            self.update_version = max(self.update_version, int(h[F_VERSION]))
            self.round_s = int(h[F_MS]) / 1000
        self.events.put(("update", Arrival(int(h[F_ROUND]), int(h[F_VERSION]), payload, int(h[F_MS]), nbytes)))

    def _serve(self, want: int) -> bool:
        """Answers a REQ: the snapshot with version >= want (the newest in asynchronous
        mode, the oldest in delay mode), waiting until there is one; STOP when closing."""
        with self.cv:
            while not self.closing and not any(v >= want for v in self.snapshots):
                self.cv.wait()
            if self.closing:
                snap = None
            else:
                pick = [v for v in self.snapshots if v >= want]
                version = max(pick) if self.newest_first else min(pick)
                snap = self.snapshots[version]
                for v in [v for v in self.snapshots if v < version]:
                    del self.snapshots[v]
                if self.resume_view is not None and self.coder.view is None:
                    self.coder.resume(self.resume_view)  # the first snapshot of a resumed run
                self.resume_view = None
        if snap is None:
            self.wire_bytes += send([header(STOP)], ANCHOR, self.pg)
            return False
        code, payload = self.coder.encode(snap)
        if self.keep_views:
            with self.cv:
                self.views[version] = self.coder.view.clone()
        h = header(SNAP, version=version, transport=code, numel=payload.numel(), dtype=DTYPE_CODES[payload.dtype])
        with self.cv:
            self.in_flight = payload.numel() * payload.element_size()
        with self.cv:
            self._since = time.monotonic()
        try:
            n = send([h, payload], ANCHOR, self.pg, max_bps=lambda: 0.0 if self.closing else self.max_bps)
        finally:
            with self.cv:
                self.in_flight = 0
                self._flown_s += time.monotonic() - self._since
                self._since = None
        self.wire_bytes += n
        self.snapshot_bytes += n
        self.snapshots_sent += 1
        with self.cv:
            self.served_version = max(self.served_version, version)
        return not self.closing  # closing: the run is over once this snapshot is through (close waits for it)
