"""Exact bytes per link, direction and axis: what every rank sends.

Axes: "pp_fwd" (activations between stages), "pp_bwd" (activation gradients),
"dp" (replica sync: gradient all-reduce or DiLoCo fragments, as counted by the
compressor / StreamingDiLoCo), "anchor" (anchor <-> fast traffic), "tied" (the gradient
all-reduce of a tied embedding split over a pipeline's first and last stage, every step),
"export" (checkpoint files a stage on another disk sends to the leader: its model shard or
adapters, orchestration.components.checkpoint_hosts; 0 with a shared disk). Every rank counts
the bytes it SENDS, so summing over ranks counts each byte on the wire once.
"""
from __future__ import annotations

from collections import defaultdict

AXES = ("pp_fwd", "pp_bwd", "dp", "anchor", "tied", "export")


class LinkCounter:
    """Exact bytes sent by this rank, per (axis, src, dst) link; never reset (totals)."""

    def __init__(self):
        self.links: dict[tuple[str, int, int], int] = defaultdict(int)
        self.extra: dict[str, int] = defaultdict(int)  # axis totals reported without a link (e.g. DP)

    def add(self, axis: str, src: int, dst: int, nbytes: int) -> None:
        if axis not in AXES:
            raise ValueError(f"unknown axis {axis!r}; known: {AXES}")
        self.links[(axis, src, dst)] += int(nbytes)

    def set_total(self, axis: str, nbytes: int) -> None:
        """Records a running total kept elsewhere (e.g. a compressor's bytes_sent)."""
        if axis not in AXES:
            raise ValueError(f"unknown axis {axis!r}; known: {AXES}")
        self.extra[axis] = int(nbytes)

    def totals(self) -> dict[str, int]:
        out = {a: 0 for a in AXES}
        for (axis, _, _), n in self.links.items():
            out[axis] += n
        for axis, n in self.extra.items():
            out[axis] += n
        return out

    def by_link(self) -> dict[str, int]:
        return {f"{a}:{s}->{d}": n for (a, s, d), n in sorted(self.links.items())}

    def state_dict(self) -> dict:
        return {"links": [[a, s, d, n] for (a, s, d), n in self.links.items()], "extra": dict(self.extra)}

    def load_state_dict(self, sd: dict) -> None:
        self.links = defaultdict(int, {(a, int(s), int(d)): int(n) for a, s, d, n in sd["links"]})
        self.extra = defaultdict(int, {k: int(v) for k, v in sd["extra"].items()})
