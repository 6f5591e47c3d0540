"""The anchor node: one anchor rank's loop over rounds (docs/anchor.md): pull a snapshot
of its stage from the lowest fast replica of its split (replica 0 on a homogeneous mesh;
elastic replicas: the lowest one linked), run an
unmasked forward/backward over its own batches through the anchor row's pipeline, send the
result to every fast replica of its column.
Also its fault injection (MESHKERN_ANCHOR_FAULT, --run.fail-rank) and its saved state
(round counter, factored momentum) for restarts."""
from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from meshkern.optim import AnchorMomentum, spectral_param_groups
from orchestration.anchor.links import FAST, PREFIX, FastCircuitGone, is_link_failure, is_store_error
from orchestration.anchor.peers import FastPeers
from orchestration.anchor.wire import (CODE_DTYPES, F_DTYPE, F_KIND, F_LAYOUT, F_MAGIC, F_NUMEL, F_TRANSPORT, F_VERSION,
                                       HEADER_BYTES, HEADER_LEN, LINK_TIMEOUT, MAGIC, REQ, SNAP, STOP, Layout,
                                       ProtocolError, eligible_params, header, payload_timeout, recv, send)
from orchestration.codecs import make_codec
from orchestration.data.sampling import BatchSampler
from orchestration.distributed.failures import is_peer_error
from orchestration.distributed.anchor_world import set_collective_timeout
from orchestration.distributed.pipeline import PipelineExecutor
from orchestration.distributed.schedule import make_schedule


FAULT_KINDS = ("nan", "shape", "stall", "die", "huge", "ortho")
HUGE_DEFAULT = 1e10  # huge:K without a value: a finite payload of 1e10s (issue #14)


class AnchorRowBroken(Exception):
    """A collective of the anchor row's own world failed: another stage of this row died or
    was cut off (not a fast replica's link, which ``FastPeers`` drops and relinks)."""


@contextmanager
def _in_row(what: str):
    """Names a communication failure inside the block as the anchor row's own."""
    try:
        yield
    except Exception as e:
        if not (is_peer_error(e) or is_store_error(e)):
            raise
        raise AnchorRowBroken(f"{what}: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}") from e


def row_wait_s(cfg, update_bytes: int, snapshot_bytes: int) -> float:
    """How long the anchor row's stages wait on each other in their own collectives: what one
    of them may spend on its fast links between two of them, each wait bounded as the link
    bounds it (``payload_timeout``: --mesh.timeout-s plus the bytes at PAYLOAD_FLOOR_BPS):
    an update to every fast replica and a new link taken from each (rendezvous and
    handshake), a snapshot's header and payload, and --mesh.timeout-s for the stages' compute
    skew. With --mesh.timeout-s it timed out while the other stage waited out an update to a
    replica that had just died, and the row ended for good. A stage silent for longer is gone."""
    t = cfg.mesh.timeout_s
    per_replica = payload_timeout(update_bytes, t).total_seconds() + 2 * t
    return 2 * t + cfg.fast_rows * per_replica + payload_timeout(snapshot_bytes, t).total_seconds()


def _store_up(store) -> bool:
    """Whether the fast circuit's store still answers (it closes when the run is over)."""
    try:
        store.check([f"{PREFIX}run_id"])
        return True
    except Exception:
        return False


def parse_faults(spec: str) -> dict[str, dict[int, float]]:
    """``"nan:1,stall:3=30"`` -> {"nan": {1: 0.0}, "stall": {3: 30.0}} (docs/anchor.md, "Fault injection")."""
    out: dict[str, dict[int, float]] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        try:
            kind, rest = item.split(":", 1)
            rnd, _, arg = rest.partition("=")
            if kind not in FAULT_KINDS:
                raise ValueError
            out.setdefault(kind, {})[int(rnd)] = float(arg) if arg else 0.0
        except ValueError:
            raise ValueError(f"MESHKERN_ANCHOR_FAULT: bad item {item!r}; use kind:round[=seconds] with kind "
                             + ", ".join(FAULT_KINDS)) from None
    return out


def round_batch(cfg, plan, index: int) -> torch.Tensor:
    """The anchor's batch of round ``index``: ``anchor.microbatches`` micro-batches of the
    fast circuit's micro-batch size, drawn from the whole training set by the anchor's own
    seeded sampler (it takes no fast replica's shard, so adding the anchor row changes no
    fast replica's data); the same on every anchor stage."""
    mb = cfg.train.batch_size // cfg.train.microbatches
    n = mb * cfg.anchor.microbatches
    rows = plan.train_rows
    if len(rows) < n:
        raise ValueError(f"the anchor needs {n} sequences per round, the training set has {len(rows)}")
    return BatchSampler(rows, n, cfg.train.seed + 104_729)(index)


def rounds_path(run_dir: str, stage: int) -> str:
    """RUN_DIR/anchor/rounds_stage_SS.jsonl: one line per round of anchor ``stage``, every
    generation appending (generation, round, snapshot version, the replica it came from,
    the replicas linked, the process id)."""
    return os.path.join(run_dir, "anchor", f"rounds_stage_{stage:02d}.jsonl")


def state_path(plan, stage: int) -> str:
    """Where anchor ``stage`` keeps its state: the checkpoint directory of the run."""
    return os.path.join(plan.ckpt_dir, "anchor", f"stage_{stage:02d}.pt")


def round_state_path(plan, stage: int, next_round: int) -> str:
    """Delay mode: anchor ``stage``'s state before round ``next_round`` (a resumed run's
    anchor takes the one that matches its checkpoint: exact_resume_round)."""
    return os.path.join(plan.ckpt_dir, "anchor", f"stage_{stage:02d}.round_{next_round:06d}.pt")


def exact_resume_round(cfg, step: int) -> int:
    """Delay mode: the anchor round to continue from when the fast circuit resumes at
    ``step``: the number of snapshot versions v = 0, every, 2 every, ... whose update was
    applied before it (v + delay < step); round k works on version k * every."""
    a = cfg.anchor
    last = step - a.delay - 1
    return 0 if last < 0 else last // a.snapshot_every + 1


def round_states_kept(cfg) -> int:
    """How many per-round states delay mode keeps: enough to cover how far the anchor can
    be ahead of the newest checkpoint (the delay, the checkpoint interval, two rounds)."""
    a = cfg.anchor
    return -(-(a.delay + max(cfg.checkpoint.every, 1)) // a.snapshot_every) + 3


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
    try:  # Ctrl-C is for the fast circuit (it checkpoints); the anchor ends with it
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:
        pass
    cfg, mesh, stage, plan = ctx.cfg, ctx.mesh, ctx.stage, ctx.plan
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
    elastic = cfg.mesh.elastic
    numel = sum(p.numel() for p in params)
    peers = FastPeers(mesh, cfg.fast_rows, elastic=elastic, timeout_s=cfg.mesh.timeout_s,
                      numel=numel, snapshot_codec=a.snapshot_codec)
    if mesh.layout.stages > 1:
        set_collective_timeout(row_wait_s(cfg, layout.nbytes + HEADER_BYTES, numel * pdtype.itemsize + HEADER_BYTES))
    os.makedirs(os.path.join(plan.run_dir, "anchor"), exist_ok=True)
    rounds_log = open(rounds_path(plan.run_dir, mesh.stage), "a")
    try:
        if elastic:
            peers.open()
        else:
            peers.link_all()
        run_id = mesh.store.get(f"{PREFIX}run_id").decode("ascii", "replace")  # a token; junk only loses a restore
        path = state_path(plan, mesh.stage)
        exact = bool(plan.resume_from) and a.delay > 0 and mesh.generation == 1
        if exact:  # delay mode: continue exactly where the checkpoint's fast circuit was
            from orchestration.components import checkpoint as ckpt

            k = exact_resume_round(cfg, int(ckpt.read_meta(plan.resume_from)["step"]))
            if k == 0:
                rec["restored"] = "round 0: nothing to restore"
            else:
                got, rec["restored"] = load_state(round_state_path(plan, mesh.stage, k), run_id, layout, momentum,
                                                  True)
                if got != k:  # no state of that round: the latest one (the resume is then not exact)
                    exact = False
            want = k * a.snapshot_every
        if (mesh.generation > 1 or plan.resume_from) and not exact:
            got, rec["restored"] = load_state(path, run_id, layout, momentum, bool(plan.resume_from))
            k, want = got or 0, 0
        while True:
            got = _next_snapshot(mesh, peers, want, params, rec, cfg)
            if got is None:
                rec["stopped"] = "the fast circuit finished"
                break
            version, server = got
            if rec["rounds"] == 0 and mesh.stage == 0:
                print(f"[anchor] row generation {mesh.generation} linked with {len(peers.links)} fast replicas; first "
                      f"snapshot: version {version} from replica {server}", file=sys.stderr, flush=True)
            if first and mesh.rank == cfg.run.fail_rank and version >= cfg.run.fail_step >= 0:
                os.kill(os.getpid(), signal.SIGKILL)  # fault injection: die like a crashed node
            if k in faults.get("die", {}):
                os.kill(os.getpid(), signal.SIGKILL)
            t0 = time.perf_counter()
            for p in params:
                p.grad = None
            with _in_row("the anchor row's pipeline step"):
                stats = pipe.step(version, round_batch(cfg, plan, k), num_microbatches=a.microbatches)
            payload = layout.encode([p.grad for _, p in named], momentum)
            ms = int(1000 * (time.perf_counter() - t0))
            hdr = layout.grad_header(k, version, ms)
            if k in faults.get("nan", {}):
                payload = payload.clone()
                payload[payload.numel() // 2] = float("nan")
            if k in faults.get("huge", {}):  # finite but far out of scale: every value = arg (default 1e10)
                payload = torch.full_like(payload, faults["huge"][k] or HUGE_DEFAULT)
            if k in faults.get("ortho", {}) and layout.transport == "factored":
                payload = payload.clone()  # U of every entry scaled by 2: finite, in scale, not orthonormal
                for U, _, _ in layout.decode(payload):
                    U.mul_(2.0)
            if k in faults.get("shape", {}):
                payload = torch.cat([payload, torch.zeros(3, dtype=payload.dtype)])
                hdr[F_NUMEL], hdr[F_LAYOUT] = payload.numel(), layout.hash ^ 1
            if k in faults.get("stall", {}):
                secs = faults["stall"][k]
                end = time.monotonic() + secs
                while math.isinf(secs) or time.monotonic() < end:
                    time.sleep(0.5)
            rec["bytes_to_fast"] += _fan_out(peers, [hdr, payload], cfg)
            rec["rounds"] += 1
            rec["versions"].append(version)
            rec.setdefault("servers", []).append(server)
            rec["linked"] = sorted(peers.links)
            rounds_log.write(json.dumps({"generation": mesh.generation, "round": k, "version": version,
                                         "server": server, "linked": rec["linked"], "pid": os.getpid(),
                                         "wall": time.time()}) + "\n")
            rounds_log.flush()
            rec["round_s"].append(ms / 1000)
            if mesh.is_last:
                rec["losses"].append(stats.loss)
            want = version + a.snapshot_every
            k += 1
            if a.delay and a.state_every:  # per-round states for an exact resume (exact_resume_round)
                save_state(round_state_path(plan, mesh.stage, k), run_id, k, layout, momentum)
                old = round_state_path(plan, mesh.stage, k - round_states_kept(cfg))
                if k - round_states_kept(cfg) > 0 and os.path.exists(old):
                    os.remove(old)
            if a.state_every and k % a.state_every == 0:
                save_state(path, run_id, k, layout, momentum)
    except FastCircuitGone:  # e.g. a short run that finished before this row linked
        rec["stopped"] = "the fast circuit ended before this anchor row linked"
    except AnchorRowBroken as e:
        if elastic and _store_up(mesh.store):  # the replicas train on: the launcher restarts the row
            raise AnchorRowBroken(f"anchor stage {mesh.stage}, generation {mesh.generation}: the anchor row "
                                  f"broke while the fast replicas train ({e})") from None
        rec["stopped"] = f"anchor row closed: {e}"
    except Exception as e:  # a fast rank or anchor peer is gone: the run ended or broke
        if not (is_peer_error(e) or is_store_error(e)):
            raise
        rec["stopped"] = f"link closed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    rounds_log.close()
    rec["bytes"] = ctx.counter.totals()
    rec["dropped"] = peers.dropped
    return rec


def _fan_out(peers: FastPeers, tensors, cfg) -> int:
    """Sends a round's update to every linked fast replica of this column; the bytes sent.
    Elastic: a replica whose link fails (or that takes longer than ``payload_timeout`` of
    the update's bytes) is dropped and the others still get it; a fixed mesh's link
    failure ends the anchor row (the fast circuit itself is gone)."""
    sent = 0
    timeout = payload_timeout(sum(t.numel() * t.element_size() for t in tensors), cfg.mesh.timeout_s) \
        if peers.elastic else LINK_TIMEOUT
    for r, peer in sorted(peers.links.items()):
        try:
            sent += send(tensors, FAST, peer.pg, timeout, max_bps=cfg.anchor_pace_bps)
        except Exception as e:
            if not (peers.elastic and is_link_failure(e)):
                raise
            peers.drop(r, f"the update did not go through: {type(e).__name__}")
    return sent


def _next_snapshot(mesh, peers: FastPeers, want: int, params, rec, cfg) -> tuple[int, int] | None:
    """(version, replica) of the snapshot >= ``want`` now loaded into ``params``, the same on
    every anchor stage; None when the fast circuit finished. A fixed mesh pulls from the
    lowest replica of the anchor's split (MeshLayout.anchor_rows: replica 0 when alike). Elastic: from the lowest replica linked on every stage (``FastPeers.common_server``),
    taking new links first; a server whose link fails or that says it stopped is dropped and
    the pull starts again with another; with no replica linked it waits, up to
    --mesh.rejoin-timeout-s, for one to link."""
    if not peers.elastic:
        server = min(peers.links)  # the lowest replica of the anchor's split
        got = _pull_snapshot(mesh, peers.links[server], want, params, rec, cfg.mesh.timeout_s, elastic=False)
        return None if got is None else (got, server)
    waited_since = None
    while True:
        peers.accept()
        with _in_row("choosing the snapshot's server"):
            server = peers.common_server()
        if server is None:
            waited_since = waited_since or time.monotonic()
            if _row_any(mesh, time.monotonic() - waited_since > cfg.mesh.rejoin_timeout_s):  # all stages give up together
                raise FastCircuitGone(f"no fast replica linked with every anchor stage for "
                                      f"{cfg.mesh.rejoin_timeout_s:g} s (--mesh.rejoin-timeout-s)")
            time.sleep(0.5)
            continue
        waited_since = None
        got = _pull_snapshot(mesh, peers.links[server], want, params, rec, cfg.mesh.timeout_s, elastic=True,
                             drop=peers.drop, others=len(peers.links) > 1)
        if got is None:
            return None
        if got != RETRY:
            return got, server


def _row_any(mesh, flag: bool) -> bool:
    """Whether ``flag`` holds on any stage of the anchor row (every stage must call it)."""
    if mesh.layout.stages == 1:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int64, device=mesh.device)
    with _in_row("agreeing to stop waiting for a fast replica"):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(int(t))


RETRY = -1  # _pull_snapshot, elastic: the server failed or stopped on some stage, pick another


def _pull_snapshot(mesh, peer, want: int, params, rec, timeout_s: float, *, elastic: bool, drop=None,
                   others: bool = False) -> int | None:
    """Loads the stage parameters of snapshot version >= ``want`` from fast replica
    ``peer.row`` (decoded by its stream's coder), the same version on every anchor stage
    (agreed over the anchor row's world); None when the fast circuit ended. ``elastic``: a
    link failure (or, with ``others`` linked, a STOP: that replica's run ended) drops the
    peer (``drop``) and returns RETRY on every stage; the header's wait is bounded by
    ``timeout_s`` (a replica cut off holds no anchor for long)."""
    target, version, flat, stop, failed = want, None, None, False, False
    link, coder = peer.pg, peer.coder
    header_wait = timedelta(seconds=timeout_s) if elastic else LINK_TIMEOUT
    while True:
        if not (stop or failed) and (version is None or version < target):
            try:
                rec["bytes_to_fast"] += send([header(REQ, version=target)], FAST, link,
                                             payload_timeout(HEADER_BYTES, timeout_s) if elastic else LINK_TIMEOUT)
                h = recv(HEADER_LEN, torch.int64, FAST, link, header_wait)
                rec["bytes_from_fast"] += HEADER_BYTES
                if int(h[F_MAGIC]) != MAGIC or int(h[F_KIND]) not in (SNAP, STOP):
                    raise ProtocolError(f"anchor protocol: expected SNAP/STOP from replica {peer.row}, got header "
                                        f"{h.tolist()}")
                if int(h[F_KIND]) == STOP:
                    stop = True
                    if elastic and others:
                        drop(peer.row, "its run ended")
                else:
                    n, code = int(h[F_NUMEL]), int(h[F_DTYPE])
                    if code not in CODE_DTYPES or not 0 < n <= 4 * coder.numel + 4096:
                        raise ProtocolError(f"anchor protocol: snapshot of {n} elements, dtype code {code}, from "
                                            f"replica {peer.row}; this stage has {coder.numel} parameters")
                    size = n * torch.empty(0, dtype=CODE_DTYPES[code]).element_size()
                    payload = recv(n, CODE_DTYPES[code], FAST, link, payload_timeout(size, timeout_s))
                    rec["bytes_from_fast"] += payload.numel() * payload.element_size()
                    flat = coder.decode(int(h[F_TRANSPORT]), payload)
                    version = int(h[F_VERSION])
            except Exception as e:
                if not (elastic and is_link_failure(e)):
                    raise
                failed = True
                drop(peer.row, f"no snapshot: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
        # per stage: finished (STOP, nobody else to ask), retry (failed, or STOP with others linked), version
        done = stop and not (elastic and others)
        retry = failed or (stop and not done)
        mine = torch.tensor([int(done), int(retry), -1 if version is None else version], dtype=torch.int64,
                            device=mesh.device)
        if mesh.layout.stages > 1:
            everyone = [torch.zeros_like(mine) for _ in range(mesh.layout.stages)]
            with _in_row("agreeing on the snapshot's version"):
                dist.all_gather(everyone, mine)
        else:
            everyone = [mine]
        if any(int(e[0]) for e in everyone):
            return None
        if any(int(e[1]) for e in everyone):
            return RETRY
        versions = [int(e[2]) for e in everyone]
        if min(versions) == max(versions):
            break
        target = max(versions)
    o = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[o:o + p.numel()].view_as(p))
            o += p.numel()
    return version
