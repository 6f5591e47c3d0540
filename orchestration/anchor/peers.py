"""The anchor end's fast peers: one anchor stage's pair links with the fast replicas of its
column, and which of them serves the next snapshot (docs/anchor.md, "Elastic replicas").

A fixed mesh links every fast replica once, before the first round (``link_all``), and a
link that breaks ends the anchor row, as it always did. Elastic replicas come and go: the
anchor takes whoever registered between two rounds (``accept``; a restarted replica, or one
relinking after a drop, registers again under a new slot), drops a link that fails
(``drop``) and never waits for a particular replica. Every link carries its own snapshot
stream (``Peer.coder``: the int8 stream's view is per sender), so a change of server starts
a fresh stream, never a delta against another replica's view.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from orchestration.anchor.auth import anchor_handshake
from orchestration.anchor.links import (ANCHOR, PREFIX, accept_slot, is_link_failure, link_to_fast, pair_link,
                                        slot_key)
from orchestration.anchor.snapshot import SnapshotCoder
from orchestration.anchor.wire import gloo_reason


@dataclass
class Peer:
    """One live pair link: fast replica ``row``'s link number ``slot`` with this generation."""

    row: int
    slot: int
    pg: object
    coder: SnapshotCoder


class FastPeers:
    """The pair links of anchor stage ``mesh.stage`` (generation ``mesh.generation``) with
    the ``rows`` fast replicas of its column; ``elastic``: links come and go (above)."""

    def __init__(self, mesh, rows: int, *, elastic: bool, timeout_s: float, numel: int, snapshot_codec: str):
        self.mesh, self.rows, self.elastic, self.timeout_s = mesh, rows, elastic, timeout_s
        self.numel, self.snapshot_codec = numel, snapshot_codec
        self.links: dict[int, Peer] = {}
        self.next_slot = [0] * rows
        self.dropped = 0

    def _peer(self, row: int, slot: int, pg) -> Peer:
        return Peer(row, slot, pg, SnapshotCoder(self.snapshot_codec, self.numel))

    def _say(self, msg: str) -> None:
        print(f"[anchor] generation {self.mesh.generation}, stage {self.mesh.stage}: {msg}", file=sys.stderr,
              flush=True)

    def link_all(self) -> None:
        """Fixed mesh: links the first slot of every replica of the anchor's split
        (``MeshLayout.anchor_rows``), in replica order (links.link_to_fast: its errors name
        the replica that did not link)."""
        rows = self.mesh.layout.anchor_rows()
        for r, pg in zip(rows, link_to_fast(self.mesh, rows, self.timeout_s)):
            self.links[r] = self._peer(r, 0, pg)
            self.next_slot[r] = 1

    def open(self) -> None:
        """Elastic: tells the fast replicas of this column that this generation takes links."""
        self.mesh.store.set(f"{PREFIX}g{self.mesh.generation}/open/{self.mesh.stage}", "1")

    def accept(self) -> list[int]:
        """Elastic: links every replica that registered a new slot since the last call (it
        waits for exactly this; a slot it gave up is skipped); returns the rows linked. A
        peer that fails the handshake or the rendezvous is left out with one line (an
        impostor cannot stop the anchor row)."""
        m, got = self.mesh, []
        for r in range(self.rows):
            while True:
                slot = self.next_slot[r]
                key = f"{PREFIX}g{m.generation}/here/{m.stage}/{slot_key(r, slot)}"
                if not m.store.check([key]):
                    break
                self.next_slot[r] = slot + 1
                if not accept_slot(m.store, m.generation, m.stage, r, slot):
                    continue  # given up by the fast end
                try:
                    pg = pair_link(m.store, m.generation, m.stage, r, ANCHOR, self.timeout_s, slot)
                    anchor_handshake(pg, m.secret, m.generation, m.stage, r, self.timeout_s)
                except Exception as e:
                    if not is_link_failure(e):
                        raise
                    self._say(f"fast replica {r} (link {slot}) did not link: {gloo_reason(e)}")
                    continue
                if r in self.links:
                    self.dropped += 1  # its previous link is stale: the replica restarted or relinked
                self.links[r] = self._peer(r, slot, pg)
                got.append(r)
        if got:
            self._say(f"linked with fast replica(s) {got}; linked now: {sorted(self.links)}")
        return got

    def drop(self, row: int, why: str) -> None:
        """Elastic: forgets ``row``'s link (it failed); the replica relinks under a new slot."""
        if self.links.pop(row, None) is not None:
            self.dropped += 1
            self._say(f"dropped fast replica {row}'s link ({why}); linked now: {sorted(self.links)}")

    def common_server(self) -> int | None:
        """The replica every anchor stage pulls the next snapshot from: the lowest one linked
        on all stages (agreed over the anchor row's world, so every stage of the anchor's
        pipeline works on one replica's model at one version); None if there is none."""
        mine = torch.zeros(self.rows, dtype=torch.int64, device=self.mesh.device)
        for r in self.links:
            mine[r] = 1
        if self.mesh.layout.stages > 1:
            dist.all_reduce(mine, op=dist.ReduceOp.MIN)
        rows = [r for r in range(self.rows) if int(mine[r])]
        return rows[0] if rows else None
