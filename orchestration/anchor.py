"""The slow anchor circuit (method.md sections 2-3): anchor ranks and the fast ranks' hook.

With ``--anchor.enabled`` the last row of the mesh is the anchor replica. Its rank in
stage column s ("anchor s") loops over rounds:

    1. pull a parameter snapshot of stage s from fast replica 0 of column s
       (replica 0 holds one; see "Snapshots" below), agreeing on its version with the
       other anchor stages so the anchor's pipeline sees one consistent model;
    2. run one unmasked forward/backward over ``anchor.microbatches`` micro-batches of
       its own batches (the anchor row's data shard, its own sampler), through its own
       pipeline across the anchor row: orchestration.pipeline.PipelineExecutor with the
       "dense" codec and the trainer's schedule, i.e. the very executor of the fast
       circuit with dense boundaries;
    3. ship the result to every fast replica of column s: ``transport=dense`` sends the
       mean-loss gradient of every parameter that has a spectral prior (2-D, not
       embedding / lm_head: the params SpectralAdamW filters; the others' anchor
       gradients would be discarded); ``transport=factored`` folds the gradient into the
       anchor's own meshkern.optim.AnchorMomentum and sends its top-r SVD factors
       (U, S, V), r*(m+n+1) numbers per matrix instead of m*n, which the fast ranks use
       as is (SpectralAdamW.observe_factored_prior).

Why replica 0 and not the DiLoCo global state: Streaming DiLoCo syncs fragments on a
staggered schedule, so its global copy is never one consistent model at one step;
replica 0's stage parameters after fast step v are ("version v").

Worlds and links. The anchor row is not in the fast circuit's torch.distributed world
(a world is fixed at init: a process outside it can never enter its groups, so an anchor
inside it could never be replaced). It forms a world of its own (its pipeline and version
agreement; orchestration.mesh.init_anchor_row), and each anchor s talks to each fast
replica r of its column over a two-process gloo group built from the fast circuit's
rendezvous store (``_pair``; CPU tensors; keys under PREFIX, see "side links" below).
Each anchor row is a generation G: its stage 0 opens G (a store counter), every other
stage takes the newest G whose slot for it is free (``claim_generation``); all keys of
one generation carry its prefix, so a new anchor row never meets a dead one's keys.

Fast ranks never wait for the anchor. Each fast rank runs one daemon thread ("link")
that does all anchor traffic of the rank with blocking point-to-point on its pair link
(transfers wait up to LINK_TIMEOUT, a week: a slow anchor is not a dead one; the fast
circuit's own groups never carry anchor traffic). It serves one anchor generation until
that link breaks, then waits for the next one: a restarted anchor row (the local
launcher's ``--anchor.restarts``, or ``--anchor.join --anchor.store HOST:PORT``) joins
the running fast circuit, and the log says so once per column. What the link receives goes to
a queue; ``poll(step)``, called once per fast step by the trainer, only drains that
queue (``Work.is_completed()`` cannot be polled instead: gloo's receive works report
completion only inside ``wait()``). Consequences:

    * an anchor that stalls: nothing arrives; the fast ranks keep stepping; once no
      update was applied for more than ``anchor.max_staleness`` fast steps the prior is
      switched off (plain masked AdamW: every SpectralAdamW group gets alpha = 1) and the
      log says so once; a later fresh update switches it back on;
    * an anchor that dies: the link sees the broken connection, the log says so once;
      updates received completely before the break are still applied, then the fast
      circuit continues as plain masked AdamW until a new anchor row joins. The
      launcher treats anchor ranks as optional (orchestration.launch ``optional``), so
      their death stops nobody, and restarts them (``--anchor.restarts``);
    * a bad update (non-finite values, a wrong layout / shape / size, staleness over
      ``anchor.max_staleness``) is rejected and counted, never applied.

Wire protocol (per column; tensors only, nothing pickled). Every message is a fixed
int64 header of HEADER_LEN words, then for SNAP/GRAD a flat payload of
``header[NUMEL]`` elements of dtype ``header[DTYPE]``:

    anchor -> replica 0   REQ(want)       "send me the snapshot with version >= want"
    replica 0 -> anchor   SNAP(version, code) + the stage's parameters, flat: in param
                                          dtype (code SNAP_FULL) or as an int8 delta
                                          against the anchor's view (SNAP_DELTA, uint8
                                          bytes; see SnapshotCoder)
                          STOP            the fast circuit has finished
    anchor -> every fast  GRAD(round, version, transport, layout hash) + payload

The receiver checks magic, kind, transport, dtype, size and a hash of the payload's
tensor shapes against what it expects before it uses a byte; a wrong-size payload is
drained (up to 4x the expected size) and counted as rejected ("shape").

Snapshots: replica 0 copies its stage parameters at every version that is a multiple
of ``anchor.snapshot_every`` (and at its first step). Asynchronous mode keeps the
newest and the anchor asks for ``want = last version + snapshot_every`` (so it never
works twice on one snapshot and runs at most one round per snapshot_every fast
steps); the anchor stages compare versions (all_gather over the anchor row) and the
ones behind ask again until all agree.

Deterministic delay mode (``anchor.delay`` = Delta > 0, the paper's delay ablation):
replica 0 keeps every snapshot with version v = k * snapshot_every (v + Delta < steps),
the anchor processes all of them in order, and every fast rank applies the update of
snapshot v exactly at step v + Delta (staleness == Delta). To make that exact, fast
ranks BLOCK in ``poll`` at step v + Delta until that update has arrived (experiments
only; bounded by ``mesh.timeout_s``, after which the hook logs and falls back to the
asynchronous rule for the rest of the run).

Accounting (axis "anchor" of orchestration.metrics = anchor <-> fast traffic). The
anchor ranks are not part of the fast circuit's per-step metrics all-reduce, so a fast
rank's ``bytes_sent`` counts both directions of its own anchor link: what it sent
(snapshots, STOP; replica 0 only) plus what the anchor delivered to it (REQ, GRAD
headers and payloads). Summed over the fast ranks that is every anchor byte on a fast
node's link, once. The anchor row's own pipeline traffic (dense activations between
anchor stages) never touches a fast node; it is in the anchor ranks' returned records.

Staleness: ``poll(step)`` runs after step ``step``'s backward and before its optimizer
step, when the parameters are at version ``step``; an update computed on version v has
staleness ``step - v``.

Fault injection (tests, demos): ``MESHKERN_ANCHOR_FAULT="nan:1,shape:2,stall:3=30,die:4"``
makes every anchor rank corrupt round 1's payload with a NaN, send round 2 with a wrong
size and layout, sleep 30 s ("inf": forever) before sending round 3, and SIGKILL itself
at the start of round 4. ``--run.fail_rank`` naming an anchor rank kills it at the first
round whose snapshot version is >= ``--run.fail_step``.

Restarts and saved state: anchor s writes its state after every ``anchor.state_every``
rounds to CHECKPOINT_DIR/anchor/stage_SS.pt (the next round number, i.e. its data
position, and with factored transport its AnchorMomentum; tensors and plain values,
read back with weights_only=True), tagged with the fast circuit's run id (a store key).
A rejoining anchor (generation > 1) takes the state only if it carries the same run id;
an anchor of a fast circuit resumed from a checkpoint takes it whatever the run id. The
first anchor row of a fresh run starts from scratch. Fault injection
(MESHKERN_ANCHOR_FAULT, --run.fail_rank) acts on generation 1 only, so a restarted row
runs clean. Delay mode is exact only without restarts: a new row computes from the
newest snapshot on, so updates due meanwhile never arrive (the fast ranks fall back to
the asynchronous rule after ``mesh.timeout_s``).
"""
from __future__ import annotations

import math
import os
import queue
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# ---------------------------------------------------------------------------- the wire
MAGIC = 0x4D4B414E  # "MKAN"
HEADER_LEN = 16
F_MAGIC, F_KIND, F_ROUND, F_VERSION, F_TRANSPORT, F_NUMEL, F_LAYOUT, F_DTYPE, F_MS = range(9)
REQ, SNAP, GRAD, STOP = 1, 2, 3, 4
TRANSPORTS = {"dense": 0, "factored": 1}
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.uint8: 3}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
TAG = 61  # one tag on a dedicated group: messages between two ranks arrive in send order
HEADER_BYTES = HEADER_LEN * 8
LINK_TIMEOUT = timedelta(days=7)  # see the module docstring: never time out an anchor wait
DRAIN_FACTOR = 4  # a wrong-size payload up to this many times the expected size is drained


def header(kind: int, *, round: int = 0, version: int = 0, transport: int = 0, numel: int = 0,
           layout: int = 0, dtype: int = 0, ms: int = 0) -> torch.Tensor:
    """The fixed int64[HEADER_LEN] header of one message."""
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h[F_MAGIC], h[F_KIND], h[F_ROUND], h[F_VERSION] = MAGIC, kind, round, version
    h[F_TRANSPORT], h[F_NUMEL], h[F_LAYOUT], h[F_DTYPE], h[F_MS] = transport, numel, layout, dtype, ms
    return h


def layout_hash(shapes) -> int:
    """FNV-1a (63 bits) over the tensor shapes of a payload: equal on both ends iff
    they agree on every tensor's shape and order (Python's hash() is salted per process)."""
    h = 0xCBF29CE484222325
    for shape in shapes:
        for d in (*shape, -1):
            h ^= (int(d) & 0xFFFFFFFF)
            h = (h * 0x100000001B3) & ((1 << 63) - 1)
    return h


class Rejected(ValueError):
    """An anchor message that must not be applied; ``reason`` is the counter it goes to."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def eligible_params(stage, groups) -> list[tuple[str, torch.nn.Parameter]]:
    """(HF name, param) of the parameters with a spectral prior, in stage order:
    2-D params of the groups whose ``spectral`` flag is true (SpectralAdamW's rule).
    ``groups``: SpectralAdamW.param_groups or meshkern.optim.spectral_param_groups(stage)."""
    ok = {id(p) for g in groups if g.get("spectral", True) for p in g["params"] if p.dim() == 2}
    return [(stage.hf_name(n), p) for n, p in stage.named_parameters() if p.requires_grad and id(p) in ok]


@dataclass(frozen=True)
class Layout:
    """What one GRAD payload holds: per eligible parameter [m, n], its gradient (dense)
    or U[m, r], S[r], V[n, r] with r = min(rank, m, n) (factored), flat and in order."""

    names: tuple
    shapes: tuple
    transport: str
    rank: int
    dtype: torch.dtype  # payload dtype: the parameters' dtype (dense) or float32 (factored)

    @classmethod
    def build(cls, named, transport: str, rank: int, param_dtype: torch.dtype) -> "Layout":
        if transport not in TRANSPORTS:
            raise ValueError(f"--anchor.transport must be dense or factored, got {transport!r}")
        if param_dtype not in DTYPE_CODES or not param_dtype.is_floating_point:
            raise TypeError(f"anchor payloads support {list(DTYPE_CODES)}, not {param_dtype}")
        dtype = torch.float32 if transport == "factored" else param_dtype
        return cls(tuple(n for n, _ in named), tuple(tuple(p.shape) for _, p in named), transport, int(rank), dtype)

    def pieces(self) -> list[list[tuple[int, ...]]]:
        """Per entry, the shapes of its tensors on the wire."""
        if self.transport == "dense":
            return [[s] for s in self.shapes]
        out = []
        for m, n in self.shapes:
            r = min(self.rank, m, n)
            out.append([(m, r), (r,), (n, r)])
        return out

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for piece in self.pieces() for s in piece)

    @property
    def hash(self) -> int:
        return layout_hash([s for piece in self.pieces() for s in piece])

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def grad_header(self, round: int, version: int, ms: int = 0) -> torch.Tensor:
        return header(GRAD, round=round, version=version, transport=TRANSPORTS[self.transport],
                      numel=self.numel, layout=self.hash, dtype=DTYPE_CODES[self.dtype], ms=ms)

    def check_header(self, h: torch.Tensor) -> None:
        """Raises Rejected("protocol") for a message that is not a GRAD of this transport,
        Rejected("shape") for a GRAD whose size, dtype or shapes differ from this layout."""
        if h.numel() != HEADER_LEN or int(h[F_MAGIC]) != MAGIC or int(h[F_KIND]) != GRAD:
            raise Rejected("protocol", f"not an anchor update header: {h.tolist()}")
        if int(h[F_TRANSPORT]) != TRANSPORTS[self.transport]:
            raise Rejected("shape", f"transport code {int(h[F_TRANSPORT])}, expected {self.transport}")
        if int(h[F_DTYPE]) != DTYPE_CODES[self.dtype]:
            raise Rejected("shape", f"payload dtype code {int(h[F_DTYPE])}, expected {self.dtype}")
        if int(h[F_NUMEL]) != self.numel or int(h[F_LAYOUT]) != self.hash:
            raise Rejected("shape", f"payload of {int(h[F_NUMEL])} elements / layout {int(h[F_LAYOUT]):x}, "
                                    f"expected {self.numel} / {self.hash:x} ({len(self.shapes)} tensors)")

    def encode(self, grads, momentum=None) -> torch.Tensor:
        """The flat CPU payload: gradients in this layout's order (None: zeros), or the
        factors of ``momentum`` (a meshkern.optim.AnchorMomentum over ``shapes``) after
        folding them in. A non-finite gradient goes out non-finite (all NaN when factored,
        the momentum unchanged), so every fast rank rejects and counts it; in delay mode
        that also ends their wait for it."""
        grads = [torch.zeros(s, dtype=self.dtype) if g is None else g.detach() for g, s in zip(grads, self.shapes)]
        if self.transport == "dense":
            return torch.cat([g.reshape(-1).to("cpu", self.dtype) for g in grads])
        if not momentum.update(grads):  # non-finite: momentum kept; receivers reject and count it
            return torch.full((self.numel,), float("nan"), dtype=torch.float32)
        flat = []
        for U, S, V in momentum.factors():
            flat += [U.reshape(-1), S.reshape(-1), V.reshape(-1)]
        return torch.cat(flat).to("cpu", torch.float32)

    def decode(self, payload: torch.Tensor) -> list:
        """Per entry a tensor (dense) or a (U, S, V) triple (factored), views of ``payload``.
        Raises Rejected("shape") for a wrong size/dtype, Rejected("nonfinite") for NaN/Inf,
        Rejected("negative") for negative singular values."""
        if payload.dim() != 1 or payload.numel() != self.numel or payload.dtype != self.dtype:
            raise Rejected("shape", f"payload {tuple(payload.shape)} {payload.dtype}, expected "
                                    f"({self.numel},) {self.dtype}")
        if not bool(torch.isfinite(payload).all()):
            raise Rejected("nonfinite", "anchor update contains NaN/Inf")
        out, o = [], 0
        for piece in self.pieces():
            ts = []
            for s in piece:
                k = math.prod(s)
                ts.append(payload[o:o + k].view(s))
                o += k
            if self.transport == "factored" and bool((ts[1] < 0).any()):
                raise Rejected("negative", "anchor factors have negative singular values")
            out.append(ts[0] if self.transport == "dense" else tuple(ts))
        return out


def _gloo_reason(e: BaseException) -> str:
    """A one-line reason for a broken link: gloo's message without its source location
    ("[.../pair.cc:553] ") and the advice it appends."""
    why = str(e).splitlines()[0] if str(e) else ""
    why = re.sub(r"^\[[^\]]*\]\s*", "", why).split(" This is typically")[0]
    return f"{type(e).__name__}: {why[:200]}"


def _send(tensors, peer: int, pg) -> int:
    """Sends ``tensors`` in order to ``peer`` (0 or 1) of a pair link; returns the bytes."""
    works = [pg.send([t], peer, TAG) for t in tensors]
    for w in works:
        w.wait(LINK_TIMEOUT)
    return sum(t.numel() * t.element_size() for t in tensors)


def _recv(numel: int, dtype, peer: int, pg) -> torch.Tensor:
    t = torch.empty(numel, dtype=dtype)
    pg.recv([t], peer, TAG).wait(LINK_TIMEOUT)
    return t


# ------------------------------------------------------------------- side links (store)
# Keys under PREFIX in the fast circuit's rendezvous store, per stage column s:
#   rowgen            counter: the newest anchor-row generation (its stage 0 opens it)
#   g<G>/claim/s      counter: taken by the one stage-s process of generation G
#   g<G>/open/s       anchor s of generation G is up and links to the fast ranks
#   g<G>/here/s/r     fast replica r of stage s waits to link with generation G
#   g<G>/link/s/r/    the pair link's gloo rendezvous (fast end 0, anchor end 1)
#   g<G>/row/         generation G's anchor-row world (orchestration.mesh.init_anchor_row)
#   run_id            a token of this fast circuit, kept with the anchor's saved state
PREFIX = "meshkern/anchor/"
FAST, ANCHOR = 0, 1  # the two ends of a pair link


def store_address(cfg=None) -> tuple[str, int]:
    """(host, port) of the fast circuit's rendezvous store: ``--anchor.store host:port``
    if given, else MASTER_ADDR / MASTER_PORT (what orchestration.launch or torchrun set)."""
    spec = cfg.anchor.store if cfg is not None else ""
    if spec:  # checked by orchestration.config.validate
        host, _, port = spec.rpartition(":")
        return host, int(port)
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise ValueError("the anchor needs the fast circuit's store: set --anchor.store host:port "
                         "(or MASTER_ADDR / MASTER_PORT)")
    return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])


def side_store(address: tuple[str, int], timeout_s: float):
    """A client of the fast circuit's store (never its master, never counted among its
    workers); ``timeout_s`` bounds connecting and each blocking get/wait.
    ConnectionError names the address when it cannot be reached."""
    host, port = address
    try:
        return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=timeout_s))
    except Exception as e:
        raise ConnectionError(f"cannot reach the fast circuit's store at {host}:{port} within {timeout_s:g} s "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:160]})") from None


def is_store_error(e: BaseException) -> bool:
    """A store wait that timed out or a store that went away."""
    return type(e).__name__ in ("DistStoreError", "DistNetworkError") or "timeout" in str(e).lower()


class FastCircuitGone(RuntimeError):
    """The fast circuit's store closed its connection: the fast circuit finished (or
    failed) before this anchor process got where it was going. Not a timeout: the store
    went away, nothing was waited out."""


def _store_failure(e: BaseException, timed_out: str, gone: str) -> Exception:
    """The error to raise for store error ``e``: FastCircuitGone(``gone``) if the store
    closed (DistNetworkError), else TimeoutError(``timed_out``). Raises ``e`` itself if it
    is no store error (a programming error must surface)."""
    if type(e).__name__ == "DistNetworkError":
        return FastCircuitGone(gone)
    if not is_store_error(e):
        raise e
    return TimeoutError(timed_out)


def _pair(store, generation: int, stage: int, row: int, end: int, timeout_s: float):
    """The gloo pair link (fast replica ``row`` of ``stage`` <-> anchor ``stage``) of one
    generation. Its rendezvous waits at most ``timeout_s``; transfers wait LINK_TIMEOUT
    (passed to every ``wait``): a slow anchor is not a dead one."""
    pre = dist.PrefixStore(f"{PREFIX}g{generation}/link/{stage}/{row}", store)
    return dist.ProcessGroupGloo(pre, end, 2, timedelta(seconds=timeout_s))


def claim_generation(store, stage: int, timeout_s: float) -> int:
    """The anchor-row generation this new anchor process of ``stage`` joins. Stage 0 opens
    a new one (1 for the first anchor row of this fast circuit, 2 for the first restart,
    ...); a stage s > 0 takes the newest generation whose stage-s slot is still free,
    waiting up to ``timeout_s`` for a stage 0 to open one. So whatever order the stages of
    a row are (re)started in, and however often one of them failed before, every stage
    of one row lands in one generation. TimeoutError if no stage 0 opened one in time."""
    if stage == 0:
        gen = int(store.add(f"{PREFIX}rowgen", 1))
        store.add(f"{PREFIX}g{gen}/claim/0", 1)
        return gen
    end = time.monotonic() + timeout_s
    while True:
        gen = int(store.add(f"{PREFIX}rowgen", 0))
        if gen > 0 and int(store.add(f"{PREFIX}g{gen}/claim/{stage}", 1)) == 1:
            return gen
        if time.monotonic() > end:
            raise TimeoutError(f"anchor stage {stage}: no anchor stage 0 opened a new anchor-row generation within "
                               f"{timeout_s:g} s (start every stage of the anchor row)")
        time.sleep(0.2)  # polling, not a timed-out store.wait: c10d logs every timeout


def join_anchor_row(layout, rank: int, cfg):
    """Anchor rank ``rank``: connects to the fast circuit's store, takes the next
    generation of its stage and joins that generation's anchor-row world; returns the
    orchestration.mesh.Mesh (``store`` and ``generation`` set)."""
    from orchestration.mesh import init_anchor_row

    _, stage = layout.coords(rank)
    store = side_store(store_address(cfg), cfg.mesh.timeout_s)
    generation = claim_generation(store, stage, cfg.mesh.timeout_s)
    try:
        mesh = init_anchor_row(layout, stage, store, generation, backend=cfg.mesh.backend,
                               timeout_s=cfg.mesh.timeout_s)
    except Exception as e:
        raise _store_failure(
            e, f"{layout.describe(rank)}: the other anchor stages of generation {generation} did not join within "
               f"{cfg.mesh.timeout_s:g} s (restart every stage of the anchor row together)",
            f"{layout.describe(rank)}: the fast circuit's store closed before anchor-row generation {generation} "
            "formed (the fast circuit finished or failed)") from None
    return mesh


def link_to_fast(mesh, fast_rows: int, timeout_s: float) -> list:
    """Anchor side: one pair link per fast replica of this stage (replica order), each
    made once that replica said it waits for this generation; TimeoutError names a
    replica that did not within ``timeout_s``; FastCircuitGone if the fast circuit's
    store closed first (a short run can finish before its anchor row links)."""
    store, g, s = mesh.store, mesh.generation, mesh.stage
    store.set(f"{PREFIX}g{g}/open/{s}", "1")
    pgs = []
    for r in range(fast_rows):
        try:
            store.wait([f"{PREFIX}g{g}/here/{s}/{r}"], timedelta(seconds=timeout_s))
            pgs.append(_pair(store, g, s, r, ANCHOR, timeout_s))
        except Exception as e:
            who = mesh.layout.describe(mesh.layout.rank_of(r, s))
            raise _store_failure(
                e, f"anchor generation {g}, stage {s}: {who} did not link within {timeout_s:g} s",
                f"anchor generation {g}, stage {s}: the fast circuit's store closed before {who} linked (the "
                "fast circuit finished or failed)") from None
    return pgs


# -------------------------------------------------------------- snapshot transfer
SNAPSHOT_CODECS = ("full", "int8")
SNAP_FULL, SNAP_DELTA = 0, 1  # a SNAP message's F_TRANSPORT: parameters as they are / an int8 delta
SNAPSHOT_CHUNK = 1024  # one fp32 absmax scale per 1024 elements: 0.4% on top of 1 byte per value


class SnapshotCoder:
    """One end of one link's snapshot stream (replica 0 encodes, the anchor decodes).

    ``codec="full"``: every snapshot travels as the parameters are (param dtype).
    ``codec="int8"``: the first snapshot of a link travels in full; each later one as
    int8 q with fp32 scale per SNAPSHOT_CHUNK elements (meshkern.compress.Int8.quantize)
    of delta = snapshot - view, where ``view`` (fp32) is what the anchor holds; both ends
    then set view += q * scale, the same fp32 ops on the same bytes, so the two views are
    bit-identical. The anchor computes on ``view``; its distance to the true snapshot is
    at most half a quantization step of the last delta per element, and nothing
    accumulates (the next delta is taken against the view, error feedback in effect).
    Bytes per delta snapshot: numel + 4 * ceil(numel / 1024) (+ padding of the last chunk),
    ~4x fewer than fp32, ~2x fewer than bf16.
    """

    def __init__(self, codec: str, numel: int):
        if codec not in SNAPSHOT_CODECS:
            raise ValueError(f"--anchor.snapshot_codec must be one of {', '.join(SNAPSHOT_CODECS)}, got {codec!r}")
        self.codec, self.numel, self.view = codec, int(numel), None

    @staticmethod
    def delta_numel(numel: int) -> int:
        """uint8 elements of one delta message for ``numel`` parameters."""
        nc = -(-int(numel) // SNAPSHOT_CHUNK)
        return nc * SNAPSHOT_CHUNK + 4 * nc

    def encode(self, flat: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(SNAP_FULL | SNAP_DELTA, 1-D CPU payload) for the flat stage parameters ``flat``."""
        if flat.numel() != self.numel:
            raise ValueError(f"snapshot of {flat.numel()} elements, this link carries {self.numel}")
        if self.codec == "full" or self.view is None:
            if self.codec != "full":
                self.view = flat.to(torch.float32).clone()
            return SNAP_FULL, flat
        from meshkern.compress.int8 import Int8
        from meshkern.compress.packing import to_chunks

        x, _ = to_chunks([flat.to(torch.float32) - self.view], SNAPSHOT_CHUNK)
        q, scale = Int8.quantize(x)
        self._add(q, scale)
        return SNAP_DELTA, torch.cat([q.reshape(-1).view(torch.uint8), scale.view(torch.uint8)])

    def decode(self, code: int, payload: torch.Tensor) -> torch.Tensor:
        """The anchor's flat parameters after message (``code``, ``payload``); RuntimeError
        for a message this end cannot take (wrong size, a delta before any full snapshot)."""
        if code == SNAP_FULL:
            if payload.numel() != self.numel:
                raise RuntimeError(f"anchor protocol: full snapshot of {payload.numel()} elements, expected {self.numel}")
            if self.codec != "full":
                self.view = payload.to(torch.float32).clone()
            return payload
        if code != SNAP_DELTA or self.codec == "full" or self.view is None:
            raise RuntimeError(f"anchor protocol: snapshot code {code} on a {self.codec!r} link "
                               f"({'after' if self.view is not None else 'before'} its first full snapshot)")
        if payload.dtype != torch.uint8 or payload.numel() != self.delta_numel(self.numel):
            raise RuntimeError(f"anchor protocol: delta snapshot of {payload.numel()} {payload.dtype}, expected "
                               f"{self.delta_numel(self.numel)} uint8")
        nc = -(-self.numel // SNAPSHOT_CHUNK)
        q = payload[:nc * SNAPSHOT_CHUNK].view(torch.int8).view(nc, SNAPSHOT_CHUNK)
        self._add(q, payload[nc * SNAPSHOT_CHUNK:].view(torch.float32))
        return self.view

    def _add(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        self.view += (q.to(torch.float32) * scale[:, None]).reshape(-1)[:self.numel]


def check_config(cfg) -> None:
    """Checks the anchor settings that need no process; ValueError names the flag."""
    a = cfg.anchor
    if not a.enabled:
        return
    if cfg.train.optimizer != "spectral":
        raise ValueError("--anchor.enabled needs --train.optimizer spectral (SpectralAdamW consumes the anchor "
                         f"updates), got {cfg.train.optimizer!r}")
    if a.snapshot_every < 1 or a.microbatches < 1:
        raise ValueError("--anchor.snapshot_every and --anchor.microbatches must be >= 1")
    if a.max_staleness < 0 or a.delay < 0:
        raise ValueError("--anchor.max_staleness and --anchor.delay must be >= 0")
    if a.delay > a.max_staleness:
        raise ValueError(f"--anchor.delay {a.delay} exceeds --anchor.max_staleness {a.max_staleness}: "
                         "every update would be rejected")
    if a.transport not in TRANSPORTS:
        raise ValueError(f"--anchor.transport must be dense or factored, got {a.transport!r}")


def parse_faults(spec: str) -> dict[str, dict[int, float]]:
    """``"nan:1,stall:3=30"`` -> {"nan": {1: 0.0}, "stall": {3: 30.0}} (see module doc)."""
    out: dict[str, dict[int, float]] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        try:
            kind, rest = item.split(":", 1)
            rnd, _, arg = rest.partition("=")
            if kind not in ("nan", "shape", "stall", "die"):
                raise ValueError
            out.setdefault(kind, {})[int(rnd)] = float(arg) if arg else 0.0
        except ValueError:
            raise ValueError(f"MESHKERN_ANCHOR_FAULT: bad item {item!r}; use kind:round[=seconds] with kind "
                             "nan, shape, stall or die") from None
    return out


def round_batch(cfg, plan, index: int) -> torch.Tensor:
    """The anchor's batch of round ``index``: ``anchor.microbatches`` micro-batches of the
    fast circuit's micro-batch size, drawn from the whole training set by the anchor's own
    seeded sampler (it takes no fast replica's shard, so adding the anchor row changes no
    fast replica's data); the same on every anchor stage."""
    from orchestration.train import BatchSampler

    mb = cfg.train.batch_size // cfg.train.microbatches
    n = mb * cfg.anchor.microbatches
    rows = plan.train_rows
    if len(rows) < n:
        raise ValueError(f"the anchor needs {n} sequences per round, the training set has {len(rows)}")
    return BatchSampler(rows, n, cfg.train.seed + 104_729)(index)


# ============================================================================ anchor ranks
def state_path(plan, stage: int) -> str:
    """Where anchor ``stage`` keeps its state: the checkpoint directory of the run."""
    return os.path.join(plan.ckpt_dir, "anchor", f"stage_{stage:02d}.pt")


def save_state(path: str, run_id: str, next_round: int, layout: Layout, momentum) -> None:
    """Atomically writes the anchor's state (tensors and plain values only): the next round
    (its data position), the payload layout and, with factored transport, its AnchorMomentum."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    st = {"run_id": run_id, "round": next_round, "layout": layout.hash,
          "momentum": None if momentum is None else momentum.state_dict()}
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(st, tmp)
    os.replace(tmp, path)


def load_state(path: str, run_id: str, layout: Layout, momentum, resuming: bool):
    """The saved state if it belongs here, else None: same payload layout, and saved by an
    anchor of this very fast circuit (``run_id``: a rejoin) or any run when the fast
    circuit was resumed from a checkpoint. Loads the momentum into ``momentum``; returns
    (next round, why it was (not) used)."""
    if not os.path.isfile(path):
        return None, "no saved anchor state"
    st = torch.load(path, weights_only=True)  # never unpickle: tensors and plain values only
    if not resuming and st.get("run_id") != run_id:
        return None, f"{path} is from another run: starting fresh"
    if st.get("layout") != layout.hash or (momentum is None) != (st.get("momentum") is None):
        return None, f"{path} does not match this stage's anchor layout/transport: starting fresh"
    if momentum is not None:
        momentum.load_state_dict(st["momentum"])
    return int(st["round"]), f"restored round {int(st['round'])} from {path}"


def run_anchor_rank(ctx) -> dict:
    """Runs anchor rank (anchor row, stage ``ctx.mesh.stage``, generation
    ``ctx.mesh.generation``, joined with ``join_anchor_row``) until the fast circuit
    finishes or a link breaks; returns its record (rounds, losses, bytes, why it stopped).

    A restarted anchor (generation > 1) picks up the saved state of its stage (round
    counter and, with factored transport, the anchor momentum; written after every
    ``anchor.state_every`` rounds) and asks for the newest snapshot."""
    from meshkern.optim import AnchorMomentum, spectral_param_groups
    from orchestration.codecs import make_codec
    from orchestration.launch import is_peer_error
    from orchestration.pipeline import PipelineExecutor
    from orchestration.schedule import make_schedule

    try:  # Ctrl-C is for the fast circuit (it checkpoints); the anchor ends with it
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:
        pass
    cfg, mesh, stage, plan = ctx.cfg, ctx.mesh, ctx.stage, ctx.plan
    check_config(cfg)
    a, t = cfg.anchor, cfg.train
    params = ctx.params
    pdtype = params[0].dtype
    named = eligible_params(stage, spectral_param_groups(stage))
    layout = Layout.build(named, a.transport, t.spectral_rank, pdtype)
    momentum = (AnchorMomentum([p for _, p in named], t.beta_anc, t.spectral_rank, seed=t.seed)
                if a.transport == "factored" else None)
    pipe = PipelineExecutor(stage, make_schedule(t.schedule, cfg.mesh.stages, a.microbatches)[mesh.stage],
                            codec=make_codec("dense"), prev_rank=mesh.prev_rank, next_rank=mesh.next_rank,
                            rank=mesh.stage, seed=t.seed, counter=ctx.counter, group=None)
    first = mesh.generation == 1  # fault injection acts on the first anchor row only
    faults = parse_faults(os.environ.get("MESHKERN_ANCHOR_FAULT", "")) if first else {}
    rec = {"rank": mesh.rank, "anchor": True, "generation": mesh.generation, "rounds": 0, "versions": [],
           "losses": [], "round_s": [], "bytes_to_fast": 0, "bytes_from_fast": 0, "stopped": "", "restored": ""}
    want, k = 0, 0
    coder = SnapshotCoder(a.snapshot_codec, sum(p.numel() for p in params))
    try:
        links = link_to_fast(mesh, cfg.fast_rows, cfg.mesh.timeout_s)
        run_id = mesh.store.get(f"{PREFIX}run_id").decode()
        path = state_path(plan, mesh.stage)
        if mesh.generation > 1 or plan.resume_from:
            got, rec["restored"] = load_state(path, run_id, layout, momentum, bool(plan.resume_from))
            k = got or 0
        while True:
            got = _pull_snapshot(mesh, links[0], want, params, coder, rec)
            if got is None:
                rec["stopped"] = "the fast circuit finished"
                break
            version = got
            if rec["rounds"] == 0 and mesh.stage == 0:
                print(f"[anchor] row generation {mesh.generation} linked with {len(links)} fast replicas; first "
                      f"snapshot: version {version}", file=sys.stderr, flush=True)
            if first and mesh.rank == cfg.run.fail_rank and version >= cfg.run.fail_step >= 0:
                os.kill(os.getpid(), signal.SIGKILL)  # fault injection: die like a crashed node
            if k in faults.get("die", {}):
                os.kill(os.getpid(), signal.SIGKILL)
            t0 = time.perf_counter()
            for p in params:
                p.grad = None
            stats = pipe.step(version, round_batch(cfg, plan, k), num_microbatches=a.microbatches)
            payload = layout.encode([p.grad for _, p in named], momentum)
            ms = int(1000 * (time.perf_counter() - t0))
            hdr = layout.grad_header(k, version, ms)
            if k in faults.get("nan", {}):
                payload = payload.clone()
                payload[payload.numel() // 2] = float("nan")
            if k in faults.get("shape", {}):
                payload = torch.cat([payload, torch.zeros(3, dtype=payload.dtype)])
                hdr[F_NUMEL], hdr[F_LAYOUT] = payload.numel(), layout.hash ^ 1
            if k in faults.get("stall", {}):
                secs = faults["stall"][k]
                end = time.monotonic() + secs
                while math.isinf(secs) or time.monotonic() < end:
                    time.sleep(0.5)
            for pg in links:
                rec["bytes_to_fast"] += _send([hdr, payload], FAST, pg)
            rec["rounds"] += 1
            rec["versions"].append(version)
            rec["round_s"].append(ms / 1000)
            if mesh.is_last:
                rec["losses"].append(stats.loss)
            want = version + a.snapshot_every
            k += 1
            if a.state_every and k % a.state_every == 0:
                save_state(path, run_id, k, layout, momentum)
    except FastCircuitGone:  # e.g. a short run that finished before this row linked
        rec["stopped"] = "the fast circuit ended before this anchor row linked"
    except Exception as e:  # a fast rank or anchor peer is gone: the run ended or broke
        if not (is_peer_error(e) or is_store_error(e)):
            raise
        rec["stopped"] = f"link closed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    rec["bytes"] = ctx.counter.totals()
    return rec


def _pull_snapshot(mesh, link, want: int, params, coder: SnapshotCoder, rec) -> int | None:
    """Loads the stage parameters of snapshot version >= ``want`` from fast replica 0
    (``link``, decoded by ``coder``), the same version on every anchor stage (agreed over
    the anchor row's world); None when the fast circuit ended."""
    target, version, flat, stop = want, None, None, False
    while True:
        if not stop and (version is None or version < target):
            rec["bytes_to_fast"] += _send([header(REQ, version=target)], FAST, link)
            h = _recv(HEADER_LEN, torch.int64, FAST, link)
            rec["bytes_from_fast"] += HEADER_BYTES
            if int(h[F_MAGIC]) != MAGIC or int(h[F_KIND]) not in (SNAP, STOP):
                raise RuntimeError(f"anchor protocol: expected SNAP/STOP from replica 0, got header {h.tolist()}")
            if int(h[F_KIND]) == STOP:
                stop = True
            else:
                n, code = int(h[F_NUMEL]), int(h[F_DTYPE])
                if code not in CODE_DTYPES or not 0 < n <= 4 * coder.numel + 4096:
                    raise RuntimeError(f"anchor protocol: snapshot of {n} elements, dtype code {code}, from "
                                       f"replica 0; this stage has {coder.numel} parameters")
                payload = _recv(n, CODE_DTYPES[code], FAST, link)
                rec["bytes_from_fast"] += payload.numel() * payload.element_size()
                flat = coder.decode(int(h[F_TRANSPORT]), payload)
                version = int(h[F_VERSION])
        mine = torch.tensor([1 if stop else 0, -1 if version is None else version], dtype=torch.int64,
                            device=mesh.device)
        if mesh.layout.stages > 1:
            everyone = [torch.zeros_like(mine) for _ in range(mesh.layout.stages)]
            dist.all_gather(everyone, mine)
        else:
            everyone = [mine]
        if any(int(e[0]) for e in everyone):
            return None
        versions = [int(e[1]) for e in everyone]
        if min(versions) == max(versions):
            break
        target = max(versions)
    o = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[o:o + p.numel()].view_as(p))
            o += p.numel()
    return version


# ============================================================================ fast ranks
@dataclass
class Arrival:
    """One anchor update as received by a fast rank's link thread."""

    round: int
    version: int
    payload: torch.Tensor
    round_ms: int
    nbytes: int


class FastHook:
    """The fast rank's side of the anchor circuit (see the module docstring).

    Trainer interface: ``poll(step)`` once per step after the backward, before the
    optimizer step: returns ``(grads aligned with the optimizer's parameters, staleness)``
    for ``optimizer.observe_anchor`` (dense transport) or None (nothing to apply; with
    factored transport the hook hands the factors to ``observe_factored_prior`` itself);
    ``after_step(step)`` after the optimizer step; ``bytes_sent`` (axis "anchor");
    ``stats()`` (JSON-ready); ``close()``.
    """

    def __init__(self, ctx):
        cfg, mesh = ctx.cfg, ctx.mesh
        check_config(cfg)
        opt = ctx.optimizer
        if not (hasattr(opt, "observe_anchor") and hasattr(opt, "observe_factored_prior")):
            raise ValueError("--anchor.enabled needs --train.optimizer spectral (an optimizer with observe_anchor)")
        self.cfg, self.ctx, self.opt = cfg, ctx, opt
        a = cfg.anchor
        self.every, self.delay, self.max_stale = a.snapshot_every, a.delay, a.max_staleness
        self.steps, self.timeout_s = cfg.train.steps, cfg.mesh.timeout_s
        self.stage_index, self.row = mesh.stage, mesh.row
        self.params = ctx.params
        named = eligible_params(ctx.stage, opt.param_groups)
        self.layout = Layout.build(named, a.transport, cfg.train.spectral_rank, self.params[0].dtype)
        flat = [p for g in opt.param_groups for p in g["params"]]
        where = {id(p): i for i, p in enumerate(flat)}
        self.slots = [where[id(p)] for _, p in named]  # wire entry -> optimizer flat index
        self.n_opt = len(flat)
        self.alpha = cfg.train.alpha
        self.serves = mesh.row == 0
        self.pg = None  # the current generation's pair link (the link thread's)
        self.generation = 0  # of the anchor row linked now (0: none yet)
        self.events: queue.Queue = queue.Queue()
        self.cv = threading.Condition()
        self.snapshots: dict[int, torch.Tensor] = {}
        self.closing = False
        self.pending: list[Arrival] = []
        self.refused: set[int] = set()  # versions whose update the link thread refused
        # counters (the link thread only adds to the *_bytes ones)
        self.wire_bytes = 0
        self.snapshot_bytes = 0
        self.update_bytes = 0
        self.base_bytes = None
        self.c = {"arrivals": 0, "applied": 0, "rejected": 0, "rejected_stale": 0, "rejected_nonfinite": 0,
                  "rejected_shape": 0, "rejected_optimizer": 0, "snapshots_sent": 0, "joins": 0}
        self.hist: dict[int, int] = {}
        self.last_staleness = None
        self.last_round_ms = None
        self.start = None
        self.steps_seen = 0
        self.last_applied_step = None
        self.joined_step = None
        self.link = "up"          # up | lost | finished
        self.prior_on = True
        self.stalled = False
        self.degraded = False     # delay mode fell back to the asynchronous rule
        self.blocked_s = 0.0
        self.thread = threading.Thread(target=self._link, name=f"anchor-link-{mesh.stage}", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ link thread
    def _link(self) -> None:
        """Links with each anchor generation of this stage in turn, for the whole run: waits
        until one opens, links, serves it until it breaks ("lost"), then waits for the next
        (a restarted anchor row). Ends at close or when the fast circuit's store is gone."""
        store, gen, s = None, 0, self.stage_index
        while not self.closing:
            try:
                if store is None:
                    store = side_store(store_address(), self.timeout_s)
                    store.compare_set(f"{PREFIX}run_id", "", os.urandom(8).hex())  # the first fast rank's wins
                latest = int(store.add(f"{PREFIX}rowgen", 0))
                if latest <= gen:  # no new anchor of this stage: look again soon
                    time.sleep(0.2)  # (polling, not a timed-out store.wait: c10d logs every timeout)
                    continue
                gen = latest  # the newest; older ones that never opened are skipped
                store.wait([f"{PREFIX}g{gen}/open/{s}"], timedelta(seconds=self.timeout_s))
                store.set(f"{PREFIX}g{gen}/here/{s}/{self.row}", "1")
                pg = _pair(store, gen, s, self.row, FAST, self.timeout_s)
            except Exception as e:
                if self.closing or type(e).__name__ == "DistNetworkError" or isinstance(e, ConnectionError):
                    return  # the store (fast rank 0) is gone: the run is over
                continue  # that generation never opened / never linked: wait for the next one
            self.pg = pg
            self.coder = SnapshotCoder(self.cfg.anchor.snapshot_codec, sum(p.numel() for p in self.params))
            self.events.put(("joined", gen))
            try:
                if self._serve_link():
                    return  # the fast circuit finished: STOP sent
            except Exception as e:
                if self.closing:
                    return
                self.events.put(("lost", _gloo_reason(e)))

    def _serve_link(self) -> bool:
        """Serves the current anchor generation until its link breaks (raises) or the fast
        circuit finishes (returns True after sending STOP)."""
        while True:
            h = _recv(HEADER_LEN, torch.int64, ANCHOR, self.pg)
            self.wire_bytes += HEADER_BYTES
            kind = int(h[F_KIND]) if int(h[F_MAGIC]) == MAGIC else -1
            if kind == REQ and self.serves:
                if not self._serve(int(h[F_VERSION])):
                    return True
            elif kind == GRAD:
                self._receive_update(h)
            else:
                raise RuntimeError(f"anchor protocol: unexpected header {h.tolist()}")

    def _receive_update(self, h: torch.Tensor) -> None:
        try:
            self.layout.check_header(h)
        except Rejected as r:
            n, code = int(h[F_NUMEL]), int(h[F_DTYPE])
            if r.reason != "shape" or code not in CODE_DTYPES or not 0 <= n <= DRAIN_FACTOR * self.layout.numel + 4096:
                raise RuntimeError(f"anchor protocol: {r}") from None
            junk = _recv(n, CODE_DTYPES[code], ANCHOR, self.pg)  # drain: keep the stream aligned
            self.wire_bytes += junk.numel() * junk.element_size()
            self.events.put(("rejected", r.reason, int(h[F_VERSION])))
            return
        payload = _recv(self.layout.numel, self.layout.dtype, ANCHOR, self.pg)
        nbytes = payload.numel() * payload.element_size()
        self.wire_bytes += nbytes
        self.update_bytes += nbytes + HEADER_BYTES
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
                version = min(pick) if self.delay else max(pick)
                snap = self.snapshots[version]
                for v in [v for v in self.snapshots if v < version]:
                    del self.snapshots[v]
        if snap is None:
            self.wire_bytes += _send([header(STOP)], ANCHOR, self.pg)
            return False
        code, payload = self.coder.encode(snap)
        h = header(SNAP, version=version, transport=code, numel=payload.numel(), dtype=DTYPE_CODES[payload.dtype])
        n = _send([h, payload], ANCHOR, self.pg)
        self.wire_bytes += n
        self.snapshot_bytes += n
        self.c["snapshots_sent"] += 1
        return True

    # ------------------------------------------------------------------ main thread
    def _store_snapshot(self, version: int) -> None:
        if version + self.delay >= self.steps:
            return  # its update would come after the last step
        flat = torch.cat([p.detach().reshape(-1) for p in self.params]).cpu()  # fresh, never mutated
        with self.cv:
            if not self.delay:
                self.snapshots.clear()
            self.snapshots[version] = flat
            self.cv.notify_all()

    def _log(self, msg: str) -> None:
        if self.row == 0:  # one line per stage column, not one per replica
            print(f"[anchor] stage {self.stage_index}: {msg}", file=sys.stderr, flush=True)

    def _set_prior(self, on: bool, step: int, why: str) -> None:
        if on == self.prior_on:
            return
        self.prior_on = on
        for g in self.opt.param_groups:
            g["alpha"] = self.alpha if on else 1.0
        self._log(f"step {step}: {why}")

    def _drain(self, step: int, block_s: float = 0.0) -> None:
        """Moves what the link delivered into ``pending`` / the counters; waits up to
        ``block_s`` for the first event if there is none."""
        first = True
        while True:
            try:
                ev = self.events.get(timeout=block_s) if (first and block_s > 0) else self.events.get_nowait()
            except queue.Empty:
                return
            first = False
            if ev[0] == "update":
                self.c["arrivals"] += 1
                self.pending.append(ev[1])
            elif ev[0] == "rejected":  # refused by the link thread (wrong size / layout)
                self.c["arrivals"] += 1
                self.refused.add(ev[2])
                self._reject(ev[1])
            elif ev[0] == "joined":
                self.generation = ev[1]
                self.c["joins"] += 1
                if self.link != "up" or ev[1] > 1:  # a rejoin (the first join counts from the start)
                    self.joined_step = step
                    self.link = "up"
                    self._log(f"step {step}: anchor row generation {ev[1]} joined; its updates are applied "
                              "as they arrive")
            elif ev[0] == "lost" and self.link == "up":
                self.link = "lost"
                self._log(f"step {step}: lost the anchor ({ev[1]}); the fast circuit continues as plain masked "
                          "AdamW (after the updates already received)")

    def _reject(self, reason: str) -> None:
        self.c["rejected"] += 1
        self.c[f"rejected_{reason}"] = self.c.get(f"rejected_{reason}", 0) + 1

    def _due(self, step: int) -> int | None:
        """Delay mode: the snapshot version whose update is due at ``step``, if any."""
        v = step - self.delay
        return v if v >= self.start and v % self.every == 0 else None

    def poll(self, step: int):
        if self.start is None:
            self.start = step
            self.base_bytes = self.ctx.counter.extra.get("anchor", 0)  # restored on resume
            if self.serves and (not self.delay or step % self.every == 0):
                self._store_snapshot(step)
        self.steps_seen += 1
        self._drain(step)
        pick = None
        if self.delay and not self.degraded:
            due = self._due(step)
            if due is not None:
                t0 = time.perf_counter()
                while (self.link == "up" and due not in self.refused
                       and not any(x.version == due for x in self.pending)):
                    if time.perf_counter() - t0 > self.timeout_s:
                        self.degraded = True
                        self._log(f"step {step}: the update of snapshot {due} did not arrive within "
                                  f"{self.timeout_s:.0f} s; delay mode off, updates are applied when they arrive")
                        break
                    self._drain(step, block_s=0.5)
                self.blocked_s += time.perf_counter() - t0
            for x in list(self.pending):
                if x.version + self.delay < step:  # late: can no longer apply exactly delay steps on
                    self.pending.remove(x)
                    self._reject("stale")
                elif x.version == due:
                    self.pending.remove(x)
                    pick = x
        if pick is None and (not self.delay or self.degraded):
            while self.pending:
                x = self.pending.pop(0)
                if not 0 <= step - x.version <= self.max_stale:
                    self._reject("stale")
                    continue
                pick = x
                break
        out = self._apply(pick, step) if pick is not None else None
        if self.link != "up" and not self.pending:
            self._set_prior(False, step, "anchor prior off (anchor lost)")
        self._watch(step)
        return out

    def _apply(self, x: Arrival, step: int):
        staleness = step - x.version
        try:
            entries = self.layout.decode(x.payload)
        except Rejected as r:
            self._reject(r.reason)
            return None
        aligned = [None] * self.n_opt
        for slot, e in zip(self.slots, entries):
            aligned[slot] = e
        self._applied(x, entries, staleness)
        self.last_applied_step = step
        if self.stalled:
            self.stalled = False
            self._log(f"step {step}: anchor updates resumed (staleness {staleness})")
        if self.link == "up":
            self._set_prior(True, step, "fresh anchor update: anchor prior back on")
        if self.layout.transport == "dense":
            return aligned, staleness
        if not self.opt.observe_factored_prior(aligned, staleness):
            self._reject("optimizer")
        return None

    def _applied(self, x: Arrival, entries, staleness: int) -> None:
        """Bookkeeping of one update handed to the optimizer (tests wrap this to inspect it)."""
        self.c["applied"] += 1
        self.hist[staleness] = self.hist.get(staleness, 0) + 1
        self.last_staleness = staleness
        self.last_round_ms = x.round_ms

    def _watch(self, step: int) -> None:
        """Stall detection: no update applied for more than max_staleness fast steps."""
        ref = [v for v in (self.last_applied_step, self.start, self.joined_step) if v is not None]
        since = step - max(ref)  # a newly joined anchor row gets max_staleness steps of its own
        if self.link == "up" and not self.stalled and since > self.max_stale:
            self.stalled = True
            self._log(f"step {step}: no anchor update for {since} fast steps (anchor stalled or too slow); "
                      "continuing as plain masked AdamW until one arrives")
            self._set_prior(False, step, "anchor prior off (stale)")

    def after_step(self, step: int) -> None:
        v = step + 1  # the parameters now hold version step + 1
        if self.serves and v % self.every == 0:
            self._store_snapshot(v)

    @property
    def bytes_sent(self) -> int:
        return (self.base_bytes or 0) + self.wire_bytes

    def stats(self) -> dict:
        n = sum(self.hist.values())
        return {**self.c, "link": self.link, "generation": self.generation, "stalled": self.stalled, "prior_on": self.prior_on,
                "last_staleness": self.last_staleness,
                "mean_staleness": (sum(s * c for s, c in self.hist.items()) / n) if n else None,
                "staleness_hist": {str(s): c for s, c in sorted(self.hist.items())},
                "arrival_rate": self.c["arrivals"] / max(1, self.steps_seen),
                "snapshot_bytes": self.snapshot_bytes, "update_bytes": self.update_bytes,
                "update_payload_bytes": self.layout.nbytes, "last_round_ms": self.last_round_ms,
                "blocked_s": round(self.blocked_s, 4), "delay_mode": bool(self.delay) and not self.degraded}

    def close(self) -> None:
        """Stops serving snapshots (an anchor waiting for one gets STOP); the link thread
        is a daemon and ends with the process or the broken connection."""
        with self.cv:
            self.closing = True
            self.cv.notify_all()
        self.thread.join(timeout=1.0)


def make_fast_hook(ctx) -> FastHook:
    """The trainer's per-step anchor hook of a fast rank (``ctx.optimizer`` must be SpectralAdamW)."""
    return FastHook(ctx)
