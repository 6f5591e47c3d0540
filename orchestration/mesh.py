"""The X x Y mesh on torch.distributed: rank layout and process groups.

Layout (row-major): rank = row * stages + stage. Rows are replicas, columns pipeline
stages. With the anchor on, the LAST row is the anchor replica; rows 0..rows-2 are the
fast circuit. Groups, created in the same order on every rank (torch.distributed
requires every rank to enter every new_group call):

    pp[row]      the Y stages of one replica (pipeline p2p partners; grad-norm clipping)
    dp[stage]    the fast replicas' ranks of one stage column (DP sync / DiLoCo)
    column[stage] dp[stage] plus the anchor's rank of that column (anchor <-> fast traffic)
    ends[row]    first and last stage of one replica (tied-embedding gradient sum)
    fast         every fast rank (per-step metrics and stop flag; the anchor never joins it,
                 so nothing on the fast critical path waits for the anchor)
    anchor       the anchor row (None without the anchor)

Point-to-point transfers use global ranks on the default group.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class MeshLayout:
    """Pure arithmetic of the mesh; no torch.distributed needed (used before spawning)."""

    rows: int
    stages: int
    anchor: bool = False

    def __post_init__(self):
        if self.rows < 1 or self.stages < 1:
            raise ValueError(f"mesh needs rows >= 1 and stages >= 1, got {self.rows}x{self.stages}")
        if self.anchor and self.rows < 2:
            raise ValueError("a mesh with the anchor needs rows >= 2 (the last row is the anchor)")

    @property
    def world_size(self) -> int:
        return self.rows * self.stages

    @property
    def fast_rows(self) -> int:
        return self.rows - (1 if self.anchor else 0)

    def coords(self, rank: int) -> tuple[int, int]:
        """(row, stage) of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a {self.rows}x{self.stages} mesh")
        return divmod(rank, self.stages)

    def rank_of(self, row: int, stage: int) -> int:
        if not (0 <= row < self.rows and 0 <= stage < self.stages):
            raise ValueError(f"(row {row}, stage {stage}) is outside a {self.rows}x{self.stages} mesh")
        return row * self.stages + stage

    def is_anchor(self, rank: int) -> bool:
        return self.anchor and self.coords(rank)[0] == self.rows - 1

    def pp_ranks(self, row: int) -> list[int]:
        return [self.rank_of(row, s) for s in range(self.stages)]

    def dp_ranks(self, stage: int) -> list[int]:
        return [self.rank_of(r, stage) for r in range(self.fast_rows)]

    def column_ranks(self, stage: int) -> list[int]:
        return [self.rank_of(r, stage) for r in range(self.rows)]

    def fast_ranks(self) -> list[int]:
        return list(range(self.fast_rows * self.stages))

    def describe(self, rank: int) -> str:
        """Human name of a rank, used in every error message about it."""
        row, stage = self.coords(rank)
        who = "anchor replica" if self.is_anchor(rank) else f"replica {row}"
        return f"rank {rank} ({who}, stage {stage})"


@dataclass
class Mesh:
    """This rank's view of the mesh: its coordinates, neighbours and process groups."""

    layout: MeshLayout
    rank: int
    row: int
    stage: int
    pp: object = None
    dp: object = None
    column: object = None
    fast: object = None
    anchor: object = None
    groups: dict = field(default_factory=dict)
    device: torch.device = torch.device("cpu")  # where this rank computes (cuda:LOCAL_RANK with NCCL)

    @property
    def is_anchor(self) -> bool:
        return self.layout.is_anchor(self.rank)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.layout.stages - 1

    @property
    def prev_rank(self) -> int | None:
        return None if self.is_first else self.rank - 1

    @property
    def next_rank(self) -> int | None:
        return None if self.is_last else self.rank + 1

    @property
    def pp_ranks(self) -> list[int]:
        return self.layout.pp_ranks(self.row)

    @property
    def dp_ranks(self) -> list[int]:
        return [] if self.is_anchor else self.layout.dp_ranks(self.stage)

    def describe(self, rank: int | None = None) -> str:
        return self.layout.describe(self.rank if rank is None else rank)


def resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def init_mesh(layout: MeshLayout, *, backend: str = "auto", timeout_s: float = 60.0) -> Mesh:
    """Joins the default process group (env:// rendezvous: RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT, as set by torchrun or orchestration.launch) and creates every group.

    Raises ValueError if WORLD_SIZE does not match the layout. ``timeout_s`` bounds every
    collective and p2p wait, so a dead or stalled peer becomes an error, never a hang.
    """
    if not dist.is_initialized():
        dist.init_process_group(resolve_backend(backend), init_method="env://",
                                timeout=timedelta(seconds=timeout_s))
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != layout.world_size:
        raise ValueError(f"WORLD_SIZE={world} but the mesh {layout.rows}x{layout.stages} needs {layout.world_size} ranks")
    row, stage = layout.coords(rank)
    m = Mesh(layout, rank, row, stage)
    if dist.get_backend() == "nccl":  # NCCL moves CUDA tensors only: one GPU per local rank
        m.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(m.device)
    tmo = timedelta(seconds=timeout_s)
    # Same order on every rank: rows, dp columns, full columns, fast, anchor.
    for r in range(layout.rows):
        g = dist.new_group(layout.pp_ranks(r), timeout=tmo)
        m.groups[f"pp{r}"] = g
        if r == row:
            m.pp = g
    for s in range(layout.stages):
        g = dist.new_group(layout.dp_ranks(s), timeout=tmo)
        m.groups[f"dp{s}"] = g
        if s == stage and not m.is_anchor:
            m.dp = g
    for s in range(layout.stages):
        g = dist.new_group(layout.column_ranks(s), timeout=tmo)
        m.groups[f"column{s}"] = g
        if s == stage:
            m.column = g
    for r in range(layout.rows):  # first + last stage of a row: tied-embedding gradient sum
        ends = sorted({layout.rank_of(r, 0), layout.rank_of(r, layout.stages - 1)})
        m.groups[f"ends{r}"] = dist.new_group(ends, timeout=tmo)
    g = dist.new_group(layout.fast_ranks(), timeout=tmo)
    m.groups["fast"] = g
    if not m.is_anchor:
        m.fast = g
    if layout.anchor:
        g = dist.new_group(layout.pp_ranks(layout.rows - 1), timeout=tmo)
        m.groups["anchor"] = g
        if m.is_anchor:
            m.anchor = g
    return m


def destroy_mesh() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
