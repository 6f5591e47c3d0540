"""Link model: turn per-stage compute times and counted bytes into modeled step time.

Two layers:

1. ``simulate`` / ``replay``: a discrete-event replay of one pipeline replica running a
   schedule (orchestration/distributed/schedule.py, the very lists the runtime executes). Each stage
   is one processor running its list in order; an action starts when the stage is free
   and its input has arrived. A finished F (B) sends one message to the next (previous)
   stage; messages queue FIFO (by the time they are ready) on the link resources they
   need, take ``bytes * 8 / bandwidth`` seconds on the wire, then ``latency_s`` more to
   arrive. Sending does not block compute (isend). Two topologies:
       "node" (default): every node has an access link (uplink and downlink, each
           ``links[i]``), as consumer GPUs on the internet do. A message a -> b holds
           a's uplink and b's downlink together for its whole transfer (cut-through), at
           the smaller of their bandwidths; its latency is the sum of both one-way
           latencies. A middle stage's uplink carries its F messages and its B messages.
       "pair": every boundary is its own full-duplex link ``links[b]`` (forward and
           backward directions independent).
   ``replay(...)`` returns the modeled seconds of one step (the makespan);
   ``simulate(...)`` returns the whole ``Timeline``.

2. ``model_step``: a whole X x Y mesh step. The X fast replicas run the same pipeline
   on disjoint nodes, so one replica's timeline is every replica's. The data-parallel
   (DP) sync and the anchor traffic are added as link occupancy, per node:
       blocking DP (plain gradient all-reduce at the end of each step): the step is the
           pipeline time plus a ring all-reduce among the X nodes of each stage column
           (all columns in parallel): per node 2(X-1)/X * payload bytes each way,
           2(X-1) latencies.
       background traffic (Streaming DiLoCo syncs that overlap compute, anchor snapshot
           pulls and anchor-gradient pushes): assumed to use a link only when the
           pipeline does not (lower priority, fills idle time), so it never delays the
           pipeline but a step can be no shorter than any link's pipeline busy time plus
           its background seconds: step = max(pipeline, max over links (busy + bg)).
   Tokens per second counts the fast replicas' tokens only (the anchor replica's are
   not training steps of the fast circuit); bytes per token counts every byte sent on
   any link (each byte once, at its sender) over those tokens.

3. ``model_run``: ``model_step`` fed with a finished trainer run (its config, measured
   compute times and counted bytes): the run's modeled tokens/s on slow links.

Everything here is arithmetic on the inputs: no hidden constants. Times in seconds,
sizes in bytes, bandwidth in bit/s.
"""
from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from orchestration.distributed.schedule import Action, check_schedule


@dataclass(frozen=True)
class LinkSpec:
    """One link: ``bandwidth_bps`` bit/s (default 200 Mbps) and one-way ``latency_s``.

    Default latency 0: a shaped LAN link as in scripts/netns_check.py; pass the path's
    one-way delay (e.g. 0.02) to model a WAN.
    """

    bandwidth_bps: float = 200e6
    latency_s: float = 0.0

    def __post_init__(self):
        if not (self.bandwidth_bps > 0 and math.isfinite(self.bandwidth_bps)):
            raise ValueError(f"bandwidth_bps must be positive and finite, got {self.bandwidth_bps}")
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"latency_s must be >= 0 and finite, got {self.latency_s}")

    def wire_s(self, nbytes: float) -> float:
        """Serialization time of ``nbytes`` (no latency)."""
        return nbytes * 8.0 / self.bandwidth_bps


@dataclass
class Timeline:
    """Result of ``simulate``: makespan and what happened when.

    actions: (stage, Action, start_s, end_s) in start order.
    messages: (kind, src stage, dst stage, microbatch, bytes, ready_s, start_s, arrive_s).
    busy_s / bytes: per link resource (("up"|"down", node) or ("fwd"|"bwd", boundary)).
    """

    step_s: float
    actions: list = field(default_factory=list)
    messages: list = field(default_factory=list)
    busy_s: dict = field(default_factory=dict)
    bytes: dict = field(default_factory=dict)

    @property
    def compute_s(self) -> list[float]:
        """Seconds each stage spent computing."""
        n = 1 + max(s for s, *_ in self.actions)
        out = [0.0] * n
        for s, _a, t0, t1 in self.actions:
            out[s] += t1 - t0
        return out

    def bytes_by_kind(self) -> dict[str, int]:
        """Bytes sent by forward ("F") and backward ("B") messages."""
        out = {"F": 0, "B": 0}
        for kind, *_r, nbytes, _a, _b, _c in self.messages:
            out[kind] += nbytes
        return out


def _per(value, n: int, what: str) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * n
    value = [float(v) for v in value]
    if len(value) != n:
        raise ValueError(f"{what}: expected a number or {n} numbers, got {len(value)}")
    return value


def _compute_fn(compute_times, S: int) -> Callable[[int, Action], float]:
    if callable(compute_times):
        return compute_times
    if isinstance(compute_times, Mapping) and set(compute_times) >= {"F", "B"}:
        table = {k: _per(compute_times[k], S, f"compute_times[{k!r}]") for k in ("F", "B")}
        return lambda s, a: table[a.kind][s]
    raise TypeError("compute_times must be {'F': x, 'B': y} (x, y a number or one per stage) "
                    "or a callable (stage, Action) -> seconds")


def _bytes_fn(message_bytes, S: int) -> Callable[[int, Action], float]:
    """(boundary, Action) -> bytes of the message that action sends across ``boundary``."""
    if callable(message_bytes):
        return message_bytes
    if isinstance(message_bytes, Mapping) and set(message_bytes) >= {"F", "B"}:
        table = {k: _per(message_bytes[k], max(S - 1, 1), f"message_bytes[{k!r}]") for k in ("F", "B")}
        return lambda b, a: table[a.kind][b]
    raise TypeError("message_bytes must be {'F': x, 'B': y} (x, y a number or one per boundary) "
                    "or a callable (boundary, Action) -> bytes")


def simulate(schedule: Sequence[Sequence[Action]], compute_times, message_bytes,
             links: LinkSpec | Sequence[LinkSpec] = LinkSpec(), *, topology: str = "node",
             uplink_taken: float | Sequence[float] = 0.0) -> Timeline:
    """Discrete-event replay of one replica's pipeline step (see module doc).

    compute_times: {"F": x, "B": y} with x, y seconds (one number, or one per stage), or
        a callable (stage, Action) -> seconds: measured times plug in here.
    message_bytes: {"F": x, "B": y} bytes per message (one number, or one per boundary),
        or a callable (boundary, Action) -> bytes; e.g. ``codec.wire_bytes(...)``.
    links: one LinkSpec for all, or one per node ("node") / per boundary ("pair").
    uplink_taken: ("node") the share of each node's uplink (one number, or one per node) that
        a stream beside the pipeline holds on average, e.g. the anchor's snapshots: the
        pipeline's messages leave that node at (1 - share) of its rate.
    """
    check_schedule([list(a) for a in schedule])  # valid and deadlock-free, else ValueError
    S = len(schedule)
    if topology not in ("node", "pair"):
        raise ValueError(f"topology must be 'node' or 'pair', got {topology!r}")
    n_links = S if topology == "node" else max(S - 1, 1)
    links = [links] * n_links if isinstance(links, LinkSpec) else list(links)
    if len(links) != n_links:
        raise ValueError(f"links: expected one LinkSpec or {n_links} (topology {topology!r}), got {len(links)}")
    ctime, mbytes = _compute_fn(compute_times, S), _bytes_fn(message_bytes, S)
    taken = _per(uplink_taken, S, "uplink_taken")
    if any(not 0.0 <= x < 1.0 for x in taken):
        raise ValueError(f"uplink_taken must be in [0, 1), got {taken}")

    def resources(src: int, dst: int):
        if topology == "node":
            a, b = links[src], links[dst]
            up = a.bandwidth_bps * (1.0 - taken[src])
            return (("up", src), ("down", dst)), min(up, b.bandwidth_bps), a.latency_s + b.latency_s
        bnd, d = (src, "fwd") if dst == src + 1 else (dst, "bwd")
        return ((d, bnd),), links[bnd].bandwidth_bps, links[bnd].latency_s

    free_at: dict = {}
    busy: dict = {}
    nbytes_on: dict = {}
    waiting: list = []  # messages ready, not started: FIFO by (ready time, sequence)
    events: list = []  # (time, seq, kind, payload)
    seq = itertools.count()
    pos, stage_busy = [0] * S, [False] * S
    arrived: dict = {}  # (stage, kind, microbatch) -> time its input is there
    tl = Timeline(step_s=0.0)

    def push(t, kind, payload):
        heapq.heappush(events, (t, next(seq), kind, payload))

    def try_start_stage(s: int, now: float):
        if stage_busy[s] or pos[s] == len(schedule[s]):
            return
        a = schedule[s][pos[s]]
        need = (s, a.kind, a.microbatch)
        if a.kind == "F" and s == 0:
            ready = True
        elif a.kind == "B" and s == S - 1:
            ready = True  # its own F ran earlier in this stage's list (checked)
        else:
            ready = need in arrived
        if ready:
            stage_busy[s] = True
            dt = float(ctime(s, a))
            if dt < 0 or not math.isfinite(dt):
                raise ValueError(f"compute time of stage {s} {a} must be finite and >= 0, got {dt}")
            tl.actions.append((s, a, now, now + dt))
            push(now + dt, "done", (s, a))

    def try_start_messages(now: float):
        still = []
        for item in sorted(waiting):
            _ready, _q, msg = item
            res, bw, lat = msg["res"], msg["bw"], msg["lat"]
            if all(free_at.get(r, 0.0) <= now for r in res):
                dur = msg["bytes"] * 8.0 / bw
                for r in res:
                    free_at[r] = now + dur
                    busy[r] = busy.get(r, 0.0) + dur
                    nbytes_on[r] = nbytes_on.get(r, 0) + msg["bytes"]
                push(now + dur, "link_free", None)
                push(now + dur + lat, "arrive", msg)
                msg["start"] = now
            else:
                still.append(item)
        waiting[:] = still

    for s in range(S):
        try_start_stage(s, 0.0)
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "done":
            s, a = payload
            stage_busy[s] = False
            pos[s] += 1
            dst = s + 1 if a.kind == "F" else s - 1
            if 0 <= dst < S:
                nb = float(mbytes(min(s, dst), a))
                if nb < 0 or not math.isfinite(nb):
                    raise ValueError(f"message bytes of stage {s} {a} must be finite and >= 0, got {nb}")
                res, bw, lat = resources(s, dst)
                msg = dict(kind=a.kind, src=s, dst=dst, mb=a.microbatch, bytes=nb, ready=now,
                           res=res, bw=bw, lat=lat)
                waiting.append((now, next(seq), msg))
                try_start_messages(now)
            try_start_stage(s, now)
        elif kind == "link_free":
            try_start_messages(now)
        elif kind == "arrive":
            m = payload
            arrived[(m["dst"], m["kind"], m["mb"])] = now
            tl.messages.append((m["kind"], m["src"], m["dst"], m["mb"], m["bytes"], m["ready"], m["start"], now))
            try_start_stage(m["dst"], now)
        tl.step_s = max(tl.step_s, now)
    if any(p != len(acts) for p, acts in zip(pos, schedule)):  # cannot happen after check_schedule
        raise RuntimeError("link model replay stalled")
    tl.busy_s, tl.bytes = busy, nbytes_on
    tl.actions.sort(key=lambda r: (r[2], r[0]))
    return tl


def replay(schedule, compute_times, message_bytes, links: LinkSpec | Sequence[LinkSpec] = LinkSpec(),
           **kw) -> float:
    """Modeled seconds of one pipeline step: ``simulate(...).step_s``."""
    return simulate(schedule, compute_times, message_bytes, links, **kw).step_s


def ring_allreduce_bytes(payload_bytes: float, n: int) -> float:
    """Bytes each of ``n`` nodes sends (and receives) in a ring all-reduce of ``payload_bytes``."""
    if n < 1:
        raise ValueError(f"all-reduce needs n >= 1 nodes, got {n}")
    return 2.0 * (n - 1) / n * payload_bytes


def ring_allreduce_s(payload_bytes: float, n: int, link: LinkSpec = LinkSpec()) -> float:
    """Seconds of a ring all-reduce over ``n`` nodes with access links ``link``: the
    per-node bytes at the link's rate plus 2(n-1) latencies (reduce-scatter + all-gather)."""
    if n == 1:
        return 0.0
    return link.wire_s(ring_allreduce_bytes(payload_bytes, n)) + 2 * (n - 1) * link.latency_s


@dataclass
class StepModel:
    """Result of ``model_step`` (per mesh step)."""

    step_s: float
    pipeline_s: float
    tokens: int
    tokens_per_s: float
    bytes: dict  # axis -> bytes per step over the whole mesh: pp_fwd, pp_bwd, dp, anchor
    bytes_per_token: dict  # same axes plus "total"
    limiting: str  # "pipeline", "dp (blocking)" or the link whose busy + background set the step
    timeline: Timeline | None = None


def model_step(schedule, compute_times, message_bytes, link: LinkSpec = LinkSpec(), *,
               replicas: int, tokens_per_replica: int,
               dp_payload_bytes: float | Sequence[float] = 0.0, dp_blocking: bool = False,
               dp_every: float = 1.0, dp_fragments: int = 1, dp_overlap_steps: float | None = None,
               anchor_up_bytes: float | Sequence[float] = 0.0,
               anchor_down_bytes: float | Sequence[float] = 0.0,
               anchor_up_nodes: int | None = None, anchor_uplink_taken: float = 0.0,
               tied_bytes: float = 0.0) -> StepModel:
    """Model one step of an X x Y mesh (X = ``replicas`` fast rows), "node" topology.

    dp_payload_bytes: what one stage column all-reduces to sync all its parameters once
        (per stage, or one number for all), e.g. its gradient bytes (plain DP) or its
        compressed pseudo-gradient (DiLoCo + PowerSGD); ring all-reduce among the X fast
        nodes.
    dp_blocking: True: a sync ends every step and the step waits for it (plain DP).
        False: Streaming DiLoCo. Every parameter is synced once per ``dp_every`` (H)
        steps, in ``dp_fragments`` (F) staggered fragments, i.e. one sync of 1/F of the
        payload every P = H/F steps, which must finish within ``dp_overlap_steps`` (w)
        steps of compute (None: anywhere within the P steps; 0: the step that starts it
        waits for it, a blocking all-reduce every P steps). Background traffic: on each
        link, a sync's wire time b must fit into the idle time of its w steps, else the
        steps stall: average step = pipeline + (max(0, b + w*a - w*idle) +
        max(0, (P-w)*(a - idle))) / P, with idle = pipeline - the link's pipeline busy
        time and a the anchor's wire time per step. (With w = P this is
        max(pipeline, busy + b/P + a).) Syncs are assumed not to overlap each other
        (w <= P), as the trainer's one sync thread runs them in turn.
    anchor_up_bytes / anchor_down_bytes: per step (amortized), per stage, what a fast
        node sends to / receives from the anchor replica (snapshots up, anchor gradients
        down); background, as above. ``anchor_up_nodes``: how many fast nodes per column
        send ``anchor_up_bytes`` (default all X; 1 when one replica serves the
        snapshots). The anchor nodes' own links carry the mirror image (X times the
        gradient push on their uplink); if that saturates, the anchor falls further
        behind (more staleness) but the fast circuit does not wait, so it is not modeled
        into the step time.
    anchor_uplink_taken: the share of each serving node's uplink the anchor's snapshot
        stream holds on average (``anchor_stream_share``); the pipeline's messages leave
        those nodes at the rest of the rate (``simulate``'s ``uplink_taken``). When > 0, the
        anchor's bytes count on its axis but are not charged again as background.
    tied_bytes: what each of a replica's first and last stage sends the other per step
        to sum a tied embedding's gradient (the trainer's "ends" all-reduce, before the
        optimizer step): a blocking transfer after the pipeline, both directions at once.
    """
    S = len(schedule)
    tl = simulate(schedule, compute_times, message_bytes, link, topology="node", uplink_taken=anchor_uplink_taken)
    dp = _per(dp_payload_bytes, S, "dp_payload_bytes")
    up_anc, down_anc = _per(anchor_up_bytes, S, "anchor_up_bytes"), _per(anchor_down_bytes, S, "anchor_down_bytes")
    X = replicas
    if X < 1 or tokens_per_replica < 1 or dp_every <= 0 or dp_fragments < 1:
        raise ValueError("replicas, tokens_per_replica and dp_fragments must be >= 1 and dp_every > 0")
    period = dp_every / dp_fragments
    window = period if dp_overlap_steps is None else min(float(dp_overlap_steps), period)
    if window < 0:
        raise ValueError(f"dp_overlap_steps must be >= 0, got {dp_overlap_steps}")
    blocking = dp_blocking or window == 0
    dp_s = 0.0  # blocking DP: the links carry only DP for this long after the pipeline
    if blocking:
        per_step, frac = (1.0, 1.0) if dp_blocking else (1.0 / period, 1.0 / dp_fragments)
        dp_s = max(ring_allreduce_s(b * frac, X, link) for b in dp) * per_step
    tied_s = link.wire_s(tied_bytes) if tied_bytes > 0 else 0.0
    step, limiting = tl.step_s + dp_s + tied_s, ("dp (blocking)" if dp_s > 0 else "pipeline")
    if tied_s > max(dp_s, tl.step_s):
        limiting = "tied-embedding gradient all-reduce (blocking)"
    for s in range(S):  # background: overlapped DP bursts and anchor traffic
        burst = 0.0 if blocking else link.wire_s(ring_allreduce_bytes(dp[s], X) / dp_fragments)
        w = window if not blocking else period
        for direction, anc in (("up", up_anc[s]), ("down", down_anc[s])):
            idle = tl.step_s - tl.busy_s.get((direction, s), 0.0)
            a = 0.0 if anchor_uplink_taken > 0 else link.wire_s(anc)
            stall = max(0.0, burst + w * (a - idle)) + max(0.0, (period - w) * (a - idle))
            need = tl.step_s + dp_s + tied_s + stall / period
            if need > step + 1e-12:
                step, limiting = need, f"{direction}link of stage {s} (pipeline busy + background)"
    pp = tl.bytes_by_kind()
    axes = {
        "pp_fwd": pp["F"] * X,
        "pp_bwd": pp["B"] * X,
        "dp": sum(ring_allreduce_bytes(b, X) for b in dp) * X / (1.0 if dp_blocking else dp_every),
        "anchor": sum(up_anc) * (X if anchor_up_nodes is None else anchor_up_nodes) + sum(down_anc) * X,
        "tied": 2.0 * tied_bytes * X,
    }
    tokens = X * tokens_per_replica
    per_tok = {k: v / tokens for k, v in axes.items()}
    per_tok["total"] = sum(per_tok.values())
    return StepModel(step_s=step, pipeline_s=tl.step_s, tokens=tokens, tokens_per_s=tokens / step,
                     bytes=axes, bytes_per_token=per_tok, limiting=limiting, timeline=tl)


def anchor_stream_share(in_flight: float, link_bps: float, max_rate_bps: float = 0.0) -> float:
    """The average share of a serving node's uplink the anchor's snapshot stream takes from
    the pipeline: ``in_flight`` (the fraction of the run a snapshot was on its way, measured)
    times what it holds meanwhile: TCP shares a full link about evenly between the two
    (one half), a stream paced to ``max_rate_bps`` (--anchor.max-rate-bps) holds at most
    that rate. The pipeline's messages are short and bursty, so this is the share it loses
    while both send, not a reservation."""
    if not 0.0 <= in_flight <= 1.0:
        raise ValueError(f"in_flight must be a fraction in [0, 1], got {in_flight}")
    held = 0.5 if max_rate_bps <= 0 else min(0.5, max_rate_bps / link_bps)
    return in_flight * held


# ------------------------------------------------------------------ a finished run
def model_run(cfg, plan, history: list[dict]) -> StepModel | None:
    """The modeled step of a finished trainer run (``model_step``) at --run.bandwidth-bps and
    --run.latency-s, replaying this run's schedule with its measured per-stage compute times
    (median over steps, the first step excluded as warm-up) and its exact byte counts.
    None for a heterogeneous mesh (replicas of different depth), which that model does not describe."""
    import torch

    from orchestration.codecs import codec_for
    from orchestration.distributed.schedule import make_schedule

    t, Y, X = cfg.train, cfg.mesh.stages, cfg.fast_rows
    if len(set(cfg.replica_stages)) > 1:
        return None  # one schedule of X identical replicas: a heterogeneous mesh is not that (summary: n/a)
    hist = history[1:] or history
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    compute = {"F": [med([h["fwd_s"][s] for h in hist]) for s in range(Y)],
               "B": [med([h["bwd_s"][s] for h in hist]) for s in range(Y)]}
    codec = codec_for(cfg.boundary)
    shape = (t.batch_size // t.microbatches, cfg.data.seq_len, plan.hidden_size)
    dtype = getattr(torch, cfg.model.dtype)
    msg = {"F": codec.wire_bytes(shape, dtype, "fwd"), "B": codec.wire_bytes(shape, dtype, "bwd")}
    # Measured DP bytes each node sent per step (ring all-reduce), back to the payload. Counters
    # are cumulative since step 0 (restored on resume). DP's is the steady rate between the first
    # and the last record: under Streaming DiLoCo a fragment's sync is still in flight at each
    # record (counted once its collectives ran), so the last record's total over all steps
    # misses one sync: 1/12 of them in a 12-step run across hosts, where that was 8% of the gap.
    n = history[-1]["step"]
    ring = 2.0 * (X - 1) / X if X > 1 else 1.0
    first, last = history[0], history[-1]
    if last["step"] > first["step"]:
        dp_step = [(last["dp_bytes_by_stage"][s] - first["dp_bytes_by_stage"][s]) / (last["step"] - first["step"])
                   for s in range(Y)]
    else:
        dp_step = [last["dp_bytes_by_stage"][s] / n for s in range(Y)]
    dp_payload = [b / X / ring for b in dp_step]
    anchor = history[-1]["bytes"]["anchor"] / n / max(1, X * Y)
    taken = 0.0
    if "anchor_in_flight_s" in last and last["step"] > first["step"]:
        # The snapshot stream shares the serving node's uplink with the pipeline (one FIFO
        # queue, TCP), not only its idle time: charged by the share of the run it was on its
        # way (measured on rank 0, replica 0's stage 0: every stage of the serving replica
        # streams alike), instead of as background bytes.
        wall = sum(h["step_s"] for h in history[1:])
        busy = min(1.0, (last["anchor_in_flight_s"] - first["anchor_in_flight_s"]) / max(wall, 1e-9))
        taken = anchor_stream_share(busy, cfg.run.bandwidth_bps, cfg.anchor_pace_bps)
    tied = history[-1]["bytes"].get("tied", 0) / n / X / 2  # per end node and step
    return model_step(make_schedule(t.schedule, Y, t.microbatches), compute, msg,
                                LinkSpec(cfg.run.bandwidth_bps, cfg.run.latency_s),
                                replicas=X, tokens_per_replica=t.batch_size * cfg.data.seq_len,
                                dp_payload_bytes=dp_payload, dp_blocking=cfg.dp.mode == "allreduce",
                                anchor_up_bytes=anchor, anchor_uplink_taken=taken, tied_bytes=tied)
