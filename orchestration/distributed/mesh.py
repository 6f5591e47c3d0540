"""The X x Y mesh on torch.distributed: rank layout and process groups.

Layout (row-major): rank = row * stages + stage. Rows are replicas, columns pipeline
stages. With the anchor on, the LAST row is the anchor replica; rows 0..rows-2 are the
fast circuit. A heterogeneous mesh (``MeshLayout.shapes``, e.g. one full replica and two
2-stage pipeline replicas) numbers its ranks replica by replica and syncs parameters by
name: ``sync_segments`` groups the model's units (embedding, each decoder layer, final
norm + head) by the ranks that hold them, one rank per replica, whatever the splits.

Two torch.distributed worlds. The fast circuit's world holds the fast ranks only
(ranks 0 .. fast_world_size-1, env:// rendezvous as set by torchrun or
orchestration.launch.processes). The anchor row is a world of its own (``anchor_world.init_anchor_row``),
formed through the fast world's rendezvous store under a generation prefix, so that an
anchor row can die and a new one can join the running fast circuit later: a
torch.distributed world is fixed at init, and a process outside it can never enter its
groups. Anchor <-> fast traffic runs on store-built side links (orchestration.anchor).

Groups of the fast world, created in the same order on every fast rank
(torch.distributed requires every rank to enter every new_group call):

    pp[row]      the Y stages of one replica (pipeline p2p partners; grad-norm clipping)
    dp[stage]    the fast replicas' ranks of one stage column (DP sync / DiLoCo)
    seg[i]       heterogeneous meshes, instead of dp: the ranks of sync segment i
    ends[row]    first and last stage of one replica (tied-embedding gradient sum)
    fast         every fast rank (per-step metrics and stop flag)

Point-to-point transfers use global ranks on the default group (in the anchor world a
rank is its stage index).
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from orchestration.distributed.devices import rank_device, resolve_dist_backend


@dataclass(frozen=True)
class SyncSegment:
    """One DP sync group of a heterogeneous mesh: the parameters held by the same ranks in
    every replica. ``ranks`` (one per replica, in replica order) hold the model ``units``
    (``"embed"``, ``"layer<i>"``, ``"final"`` = final norm + LM head), and only those,
    among the units of their own stage that this segment lists."""

    ranks: tuple
    units: tuple


def stage_units(num_layers: int, layers: list[int]) -> list[list[str]]:
    """The model units of each stage of a split with ``layers`` decoder layers per stage."""
    out, lo = [], 0
    for s, n in enumerate(layers):
        units = (["embed"] if s == 0 else []) + [f"layer{i}" for i in range(lo, lo + n)]
        out.append(units + (["final"] if s == len(layers) - 1 else []))
        lo += n
    if lo != num_layers:
        raise ValueError(f"a split of {layers} layers per stage covers {lo} layers, the model has {num_layers}")
    return out


def param_unit(hf_name: str) -> str:
    """The model unit of a parameter named as in the unsplit HF model."""
    if hf_name.startswith("model.embed_tokens."):
        return "embed"
    if hf_name.startswith("model.layers."):
        return "layer" + hf_name.split(".")[2]
    if hf_name.startswith(("model.norm.", "lm_head.")):
        return "final"
    raise ValueError(f"parameter {hf_name!r} belongs to no model unit (embed, layers, final norm, LM head)")


def mesh_name(replica_stages: list[int]) -> str:
    """A mesh in words, from the stage count of each replica: '2x2' when alike,
    'replicas 1,2,2' otherwise."""
    if len(set(replica_stages)) == 1:
        return f"{len(replica_stages)}x{replica_stages[0]}"
    return "replicas " + ",".join(map(str, replica_stages))


@dataclass(frozen=True)
class MeshLayout:
    """Pure arithmetic of the mesh; no torch.distributed needed (used before spawning).

    Homogeneous (``shapes`` empty): ``rows`` replicas of ``stages`` stages each.
    Heterogeneous (``shapes`` = stage count per replica, e.g. (1, 2, 2): one full replica
    and two 2-stage pipeline replicas): replica ``row`` has ``shapes[row]`` stages, ranks
    are numbered replica by replica, and ``stages`` is the deepest replica's count. DP sync
    then runs per ``sync_segments`` (by parameter name), not per column. With the anchor,
    ``shapes`` ends with the anchor row's: the deepest replicas' split (``of``), and the
    anchor serves the replicas of that split (``anchor_rows``)."""

    rows: int
    stages: int
    anchor: bool = False
    shapes: tuple = ()

    def __post_init__(self):
        if self.shapes:
            object.__setattr__(self, "shapes", tuple(int(y) for y in self.shapes))
            if any(y < 1 for y in self.shapes):
                raise ValueError(f"every replica needs >= 1 stage, got replicas {list(self.shapes)}")
            if self.anchor and self.shapes[-1] != max(self.shapes):
                raise ValueError(f"the anchor row (the last of replicas {list(self.shapes)}) takes the deepest "
                                 f"replicas' split, {max(self.shapes)} stages, not {self.shapes[-1]}")
            if (self.rows, self.stages) != (len(self.shapes), max(self.shapes)):
                raise ValueError(f"replicas {list(self.shapes)} make a mesh of {len(self.shapes)} rows and at most "
                                 f"{max(self.shapes)} stages, not {self.rows}x{self.stages}")
        if self.rows < 1 or self.stages < 1:
            raise ValueError(f"mesh needs rows >= 1 and stages >= 1, got {self.rows}x{self.stages}")
        if self.anchor and self.rows < 2:
            raise ValueError("a mesh with the anchor needs rows >= 2 (the last row is the anchor)")

    @classmethod
    def of(cls, cfg, anchor: bool | None = None) -> "MeshLayout":
        """The layout of a run's config (``anchor``: override cfg.anchor.enabled)."""
        a = cfg.anchor.enabled if anchor is None else anchor
        shapes = tuple(cfg.mesh.replicas)
        if shapes and a:
            shapes += (max(shapes),)
        return cls(len(shapes) if shapes else cfg.mesh.rows, cfg.mesh.stages, a, shapes)

    @property
    def heterogeneous(self) -> bool:
        return bool(self.shapes) and len(set(self.shapes)) > 1

    def stages_of(self, row: int) -> int:
        """Pipeline stages of replica ``row``."""
        return self.shapes[row] if self.shapes else self.stages

    def _offset(self, row: int) -> int:
        return sum(self.shapes[:row]) if self.shapes else row * self.stages

    @property
    def world_size(self) -> int:
        """Every process of the mesh (fast ranks + the anchor row): what a local launch starts."""
        return sum(self.shapes) if self.shapes else self.rows * self.stages

    @property
    def fast_world_size(self) -> int:
        """The fast circuit's torch.distributed world (the anchor row is a world of its own)."""
        return sum(self.shapes[:self.fast_rows]) if self.shapes else self.fast_rows * self.stages

    @property
    def fast_rows(self) -> int:
        return self.rows - (1 if self.anchor else 0)

    def coords(self, rank: int) -> tuple[int, int]:
        """(row, stage) of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a {self.name} mesh")
        if not self.shapes:
            return divmod(rank, self.stages)
        row = 0
        while rank >= self._offset(row + 1):
            row += 1
        return row, rank - self._offset(row)

    def rank_of(self, row: int, stage: int) -> int:
        if not (0 <= row < self.rows and 0 <= stage < self.stages_of(row)):
            raise ValueError(f"(row {row}, stage {stage}) is outside a {self.name} mesh")
        return self._offset(row) + stage

    @property
    def name(self) -> str:
        """'3x2' (homogeneous) or 'replicas 1,2,2' (``mesh_name``)."""
        if not self.shapes:
            return mesh_name([self.stages] * self.rows)
        return mesh_name(list(self.shapes[:self.fast_rows])) + (" + the anchor row" if self.anchor else "")

    def anchor_rank(self, stage: int) -> int:
        """The anchor row's rank of ``stage`` (numbering of the whole mesh, as the launcher's)."""
        if not self.anchor:
            raise ValueError("this mesh layout has no anchor row")
        return self.rank_of(self.rows - 1, stage)

    def is_anchor(self, rank: int) -> bool:
        return self.anchor and self.coords(rank)[0] == self.rows - 1

    def anchor_rows(self) -> list[int]:
        """The fast replicas the anchor row serves: those of its split (every one on a
        homogeneous mesh). A replica of another depth trains without the anchor's prior: a
        full replica has no stage boundary, so nothing masked to correct."""
        if not self.anchor:
            return []
        return [r for r in range(self.fast_rows) if self.stages_of(r) == self.stages_of(self.rows - 1)]

    def anchor_scope(self) -> str:
        """Which replicas the anchor serves, in words, when not all of them ('' otherwise)."""
        served = self.anchor_rows()
        others = [r for r in range(self.fast_rows) if r not in served]
        if not self.anchor or not others:
            return ""
        full = [r for r in others if self.stages_of(r) == 1]
        why = ("full replicas: no stage boundary, nothing masked to correct" if len(full) == len(others) else
               "their masked boundaries go uncorrected")
        return (f"the anchor row ({self.stages_of(self.rows - 1)} stages) serves replicas {served} (its split); "
                f"replicas {others} train without its prior ({why})")

    def pp_ranks(self, row: int) -> list[int]:
        return [self.rank_of(row, s) for s in range(self.stages_of(row))]

    def dp_ranks(self, stage: int) -> list[int]:
        """The fast replicas' ranks of stage column ``stage`` (homogeneous meshes)."""
        if self.heterogeneous:
            raise ValueError(f"a heterogeneous mesh ({self.name}) has no stage columns: DP sync runs per sync_segments")
        return [self.rank_of(r, stage) for r in range(self.fast_rows)]

    def fast_ranks(self) -> list[int]:
        return list(range(self.fast_world_size))

    def sync_segments(self, num_layers: int, layers_per_stage: list[int] | None = None) -> list[SyncSegment]:
        """DP sync groups by parameter name: model units grouped by the tuple of ranks (one
        per fast replica) that hold them, in a fixed order (every rank builds the same list).
        Each replica is split like the trainer splits it (``stages.replica_split``)."""
        from orchestration.distributed.stages import replica_split

        holders: dict[str, list[int]] = {}
        for r in range(self.fast_rows):
            y = self.stages_of(r)
            for s, units in enumerate(stage_units(num_layers, replica_split(num_layers, y, layers_per_stage))):
                for u in units:
                    holders.setdefault(u, []).append(self.rank_of(r, s))
        by_ranks: dict[tuple, list[str]] = {}
        for u, ranks in holders.items():  # units in model order: embed, layer0.., final
            by_ranks.setdefault(tuple(ranks), []).append(u)
        return [SyncSegment(ranks, tuple(units)) for ranks, units in sorted(by_ranks.items())]

    def describe(self, rank: int) -> str:
        """Human name of a rank, used in every error message about it."""
        row, stage = self.coords(rank)
        if self.is_anchor(rank):
            who = "anchor replica"
        elif self.shapes and self.stages_of(row) == 1:
            who = f"replica {row}, full"
        else:
            who = f"replica {row}"
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
    fast: object = None
    groups: dict = field(default_factory=dict)
    segments: list = field(default_factory=list)  # heterogeneous: [(SyncSegment, group)] this rank is in
    device: torch.device = torch.device("cpu")  # where this rank computes (--mesh.device; devices.rank_device)
    store: object = None  # anchor row: its client of the fast circuit's store
    generation: int = 0   # anchor row: its generation (orchestration.anchor.claim_generation)
    secret: bytes = b""   # anchor row: the run's anchor secret (orchestration.anchor.auth)
    elastic: bool = False  # --mesh.elastic: this replica is a world of its own (init_replica_world)

    @property
    def is_anchor(self) -> bool:
        return self.layout.is_anchor(self.rank)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.layout.stages_of(self.row) - 1

    @property
    def prev_rank(self) -> int | None:
        """The previous stage's rank in this rank's torch.distributed world."""
        if self.is_first:
            return None
        return self.stage - 1 if self.is_anchor or self.elastic else self.rank - 1

    @property
    def next_rank(self) -> int | None:
        if self.is_last:
            return None
        return self.stage + 1 if self.is_anchor or self.elastic else self.rank + 1

    @property
    def pp_ranks(self) -> list[int]:
        return self.layout.pp_ranks(self.row)

    @property
    def dp_ranks(self) -> list[int]:
        return [] if self.is_anchor else self.layout.dp_ranks(self.stage)

    @property
    def fast_replicas(self) -> int:
        """The replicas whose ranks the ``fast`` group spans (per-step metrics are their mean):
        every fast replica, or this one alone in an elastic run."""
        return 1 if self.elastic else self.layout.fast_rows

    def describe(self, rank: int | None = None) -> str:
        return self.layout.describe(self.rank if rank is None else rank)




STORE_BIND_ENV = "MESHKERN_STORE_BIND"
_KEEP: list = []  # the store rank 0 holds: anchor rows and side links use it after destroy_mesh


def store_bind_address() -> str:
    """The address the fast circuit's store listens on: MESHKERN_STORE_BIND if set (e.g.
    0.0.0.0 behind a NAT whose MASTER_ADDR is not a local address), else MASTER_ADDR:
    loopback only when MASTER_ADDR is 127.0.0.1 / localhost, as orchestration.launch.processes sets."""
    return os.environ.get(STORE_BIND_ENV) or os.environ["MASTER_ADDR"]


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on (``host``, ``port``) only. torch's TCPStore master binds
    every interface when it opens its own socket; given this one's descriptor
    (``master_listen_fd``) it serves on exactly this address."""
    err = None
    for family, kind, proto, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(4096)
            return sock
        except OSError as e:
            sock.close()
            err = e
    raise OSError(f"the fast circuit's store cannot listen on {host}:{port}: {err}")


def bound_tcp_store(host, port, world_size=None, is_master=False, timeout=None, *args, **kwargs):
    """torch.distributed.TCPStore as torchrun's static rendezvous calls it, the master's on a
    socket listening on (host, port) only (``listen_socket``): orchestration.torchrun."""
    timeout = timedelta(seconds=300) if timeout is None else timeout
    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout, *args, **kwargs)
    kwargs.pop("use_libuv", None)
    fd = listen_socket(host, port).detach()  # the store owns (and closes) the descriptor
    return dist.TCPStore(host, port, world_size, True, timeout, *args, master_listen_fd=fd, use_libuv=True, **kwargs)


def rendezvous_store(rank: int, world_size: int, timeout_s: float):
    """The fast circuit's TCPStore, like torch's env:// rendezvous (MASTER_ADDR,
    MASTER_PORT; rank 0 holds it, waiting for ``world_size`` ranks), except that rank 0's
    listens on ``store_bind_address()`` only instead of on every interface."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    tmo = timedelta(seconds=timeout_s)
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, tmo)
    fd = listen_socket(store_bind_address(), port).detach()  # the store owns (and closes) the descriptor
    store = dist.TCPStore(host, port, world_size, True, tmo, master_listen_fd=fd, use_libuv=True)
    _KEEP.append(store)  # serves until the process ends, as env://'s (multi-tenant, cached) store does
    return store


def join_world(backend: str, rank: int, world_size: int, timeout_s: float, *,
               collective_timeout_s: float | None = None) -> None:
    """Joins the env:// world (MASTER_ADDR, MASTER_PORT) as ``rank`` of ``world_size``, unless
    this process already is in one: under torchrun its agent's store, else ``rendezvous_store``
    (env:// as torch does it, but the store listens on MASTER_ADDR only: docs/security.md).
    ``timeout_s`` bounds the rendezvous, ``collective_timeout_s`` (default: the same) the
    default group's collectives."""
    if dist.is_initialized():
        return
    tmo = timedelta(seconds=timeout_s if collective_timeout_s is None else collective_timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":  # torchrun's agent holds the store
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size, timeout=tmo)
    else:
        store = rendezvous_store(rank, world_size, timeout_s)
        dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank,
                                world_size=world_size, timeout=tmo)


def init_mesh(layout: MeshLayout, *, dist_backend: str = "auto", timeout_s: float = 60.0,
              num_layers: int = 0, layers_per_stage: list[int] | None = None, device: str = "cpu") -> Mesh:
    """Joins the fast circuit's world (env:// rendezvous: RANK, MASTER_ADDR, MASTER_PORT,
    as set by torchrun or orchestration.launch.processes; its size is ``layout.fast_world_size``) and
    creates every group. Fast ranks only: the anchor row joins with ``anchor_world.init_anchor_row``.
    A heterogeneous layout needs ``num_layers`` (and the run's ``layers_per_stage``): its DP
    groups are the ``layout.sync_segments`` (``Mesh.segments``), not stage columns.

    Raises ValueError if RANK is an anchor rank or WORLD_SIZE (under torchrun) does not
    match. ``timeout_s`` bounds every collective and p2p wait, so a dead or stalled peer
    becomes an error, never a hang. ``device``: --mesh.device (orchestration.distributed.devices).
    """
    rank = int(os.environ.get("RANK", "0"))
    dist_backend = resolve_dist_backend(dist_backend, device)
    if layout.is_anchor(rank):
        raise ValueError(f"{layout.describe(rank)} is in the anchor row: it joins with init_anchor_row, not init_mesh")
    join_world(dist_backend, rank, layout.fast_world_size, timeout_s)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != layout.fast_world_size:
        raise ValueError(f"WORLD_SIZE={world} but the fast circuit of the mesh {layout.name} "
                         f"needs {layout.fast_world_size} ranks")
    row, stage = layout.coords(rank)
    m = Mesh(layout, rank, row, stage)
    m.device = rank_device(device)
    tmo = timedelta(seconds=timeout_s)
    # Same order on every rank: rows, dp columns, ends, fast.
    for r in range(layout.fast_rows):
        g = dist.new_group(layout.pp_ranks(r), timeout=tmo)
        m.groups[f"pp{r}"] = g
        if r == row:
            m.pp = g
    if layout.heterogeneous:  # DP groups by parameter name (the same list on every rank)
        if num_layers < 1:
            raise ValueError(f"init_mesh: a heterogeneous mesh ({layout.name}) needs the model's num_layers")
        for i, seg in enumerate(layout.sync_segments(num_layers, layers_per_stage)):
            g = dist.new_group(list(seg.ranks), timeout=tmo)
            m.groups[f"seg{i}"] = g
            if rank in seg.ranks:
                m.segments.append((seg, g))
    else:
        for s in range(layout.stages):
            g = dist.new_group(layout.dp_ranks(s), timeout=tmo)
            m.groups[f"dp{s}"] = g
            if s == stage:
                m.dp = g
    for r in range(layout.fast_rows):  # first + last stage of a row: tied-embedding gradient sum
        ends = sorted({layout.rank_of(r, 0), layout.rank_of(r, layout.stages_of(r) - 1)})
        m.groups[f"ends{r}"] = dist.new_group(ends, timeout=tmo)
    m.fast = m.groups["fast"] = dist.new_group(layout.fast_ranks(), timeout=tmo)
    return m


def destroy_mesh() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
