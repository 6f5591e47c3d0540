"""Side links between the anchor row and the fast circuit (docs/anchor.md, "Worlds and
links"): the fast circuit's rendezvous store, anchor-row generations, the two-process gloo
pair links. Which errors mean "the link is gone": orchestration.distributed.failures
(``is_link_failure``, re-exported here)."""
from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from orchestration.anchor.auth import anchor_handshake, generation_value, parse_generation
from orchestration.distributed.failures import LinkFailure, is_link_failure, is_store_error  # noqa: F401 (re-exported)

# Keys under PREFIX in the fast circuit's rendezvous store, per stage column s (anyone who
# reaches the store can write any key: the ones the protocol trusts are authenticated or
# parsed defensively, and nothing here is ever incremented with add(), which makes the
# store drop the connection of whoever adds to a value that is not a number):
#   latest            "G:MAC": the newest anchor-row generation, announced by its stage 0
#                     with the run secret's MAC (auth.generation_value); a value without a
#                     valid MAC is ignored (one warning)
#   g<G>/announce     "G:MAC" as well, per generation (readers walk up from the last one they
#                     know, so a ``latest`` overwritten with garbage hides no generation)
#   g<G>/claim/s      first writer wins (compare_set): the one stage-s process of generation G
#   g<G>/open/s       anchor s of generation G is up and links to the fast ranks
#   g<G>/here/s/r     fast replica r of stage s waits to link with generation G (first
#                     writer wins); its later links with the same generation (an elastic
#                     replica restarted, or relinking after a drop) under g<G>/here/s/r.k,
#                     k = 1, 2, ... ("slots", slot_key)
#   g<G>/link/s/r/    the pair link's gloo rendezvous (fast end 0, anchor end 1); slot k:
#                     g<G>/link/s/r.k/
#   g<G>/row/         generation G's anchor-row world (orchestration.distributed.anchor_world.init_anchor_row)
#   run_id            a token of this fast circuit, kept with the anchor's saved state
PREFIX = "meshkern/anchor/"
FAST, ANCHOR = 0, 1  # the two ends of a pair link


def store_address(cfg=None) -> tuple[str, int]:
    """(host, port) of the fast circuit's rendezvous store: ``--anchor.store host:port``
    if given, else MASTER_ADDR / MASTER_PORT (what orchestration.launch.processes or torchrun set)."""
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


class FastCircuitGone(LinkFailure):
    """The fast circuit's store closed its connection: the fast circuit finished (or
    failed) before this anchor process got where it was going. Not a timeout: the store
    went away, nothing was waited out."""


def store_failure(e: BaseException, timed_out: str, gone: str) -> Exception:
    """The error to raise for store error ``e``: FastCircuitGone(``gone``) if the store
    closed (DistNetworkError), else TimeoutError(``timed_out``). Raises ``e`` itself if it
    is no store error (a programming error must surface)."""
    if type(e).__name__ == "DistNetworkError":
        return FastCircuitGone(gone)
    if not is_store_error(e):
        raise e
    return TimeoutError(timed_out)


def slot_key(row: int, slot: int) -> str:
    """The store key part of fast replica ``row``'s link number ``slot`` with one generation
    (slot 0, the first: just the row)."""
    return str(row) if slot == 0 else f"{row}.{slot}"


def pair_link(store, generation: int, stage: int, row: int, end: int, timeout_s: float, slot: int = 0):
    """The gloo pair link (fast replica ``row`` of ``stage`` <-> anchor ``stage``) of one
    generation, link number ``slot`` of that replica with it. Its rendezvous waits at most
    ``timeout_s``; transfers wait LINK_TIMEOUT (passed to every ``wait``): a slow anchor is
    not a dead one."""
    pre = dist.PrefixStore(f"{PREFIX}g{generation}/link/{stage}/{slot_key(row, slot)}", store)
    return dist.ProcessGroupGloo(pre, end, 2, timedelta(seconds=timeout_s))


MAX_SLOTS = 10_000  # links of one replica with one generation (restarts, relinks)
ACCEPTED, GONE = "accepted", "gone"  # the two ends of a slot (below)


def _text(v) -> str:
    return v.decode("ascii", "replace") if isinstance(v, bytes) else str(v)


def register_fast(store, generation: int, stage: int, row: int) -> tuple[int, str]:
    """Fast end: claims the next free slot of replica ``row`` with generation G (first
    writer wins; a slot is never reused); returns (slot, token). The slot's key then
    settles who goes on, by compare_set, so neither end ever waits in a rendezvous for a
    peer that left: the anchor end turns the token into ACCEPTED (``accept_slot``) and then
    links; the fast end waits for that (``wait_accepted``) or gives the slot up (GONE)."""
    token = os.urandom(8).hex()
    for slot in range(MAX_SLOTS):
        key = f"{PREFIX}g{generation}/here/{stage}/{slot_key(row, slot)}"
        if _text(store.compare_set(key, "", token)) == token:
            return slot, token
    raise TimeoutError(f"anchor generation {generation}, stage {stage}: replica {row} has no free link slot "
                       f"among {MAX_SLOTS} (someone is writing the store's anchor keys)")


def wait_accepted(store, generation: int, stage: int, row: int, slot: int, token: str, give_up) -> bool:
    """Fast end: True once the anchor end accepted the slot (link now: it is linking too);
    False if ``give_up()`` turned true first (a newer generation, the run ends) and the
    slot could still be given up."""
    key = f"{PREFIX}g{generation}/here/{stage}/{slot_key(row, slot)}"
    pause = 0.01  # an anchor end waiting for this slot accepts it at once: look again soon, then less often
    while True:
        if _text(store.get(key)) == ACCEPTED:
            return True
        if give_up():
            return _text(store.compare_set(key, token, GONE)) != GONE  # the anchor may have accepted meanwhile
        time.sleep(pause)  # polling, not a timed-out store.wait: c10d logs every timeout
        pause = min(2 * pause, 0.2)


def accept_slot(store, generation: int, stage: int, row: int, slot: int) -> bool:
    """Anchor end: takes replica ``row``'s registered ``slot`` (True: link now, the fast end
    is waiting for it) unless the fast end gave it up (False). The slot's key must exist."""
    key = f"{PREFIX}g{generation}/here/{stage}/{slot_key(row, slot)}"
    token = _text(store.get(key))
    if token in (ACCEPTED, GONE):
        return token == ACCEPTED
    return _text(store.compare_set(key, token, ACCEPTED)) == ACCEPTED


MAX_CLAIM_TRIES = 10_000  # generations stage 0 skips at most (slots squatted by someone without the secret)


class Warner:
    """Says each distinct problem once (malformed keys are ignored with one warning)."""

    def __init__(self, who: str):
        self.who, self.said = who, set()

    def __call__(self, key: str, msg: str) -> None:
        if key not in self.said:
            self.said.add(key)
            print(f"[anchor] {self.who}: warning: {msg}", file=sys.stderr, flush=True)


def _valid_generation(store, key: str, secret: bytes, warn) -> int:
    """G from store ``key`` if it holds an announce with a valid MAC, else 0 (warned once)."""
    if not store.check([key]):
        return 0
    raw = store.get(key)
    g = parse_generation(secret, raw)
    if g is None:
        if warn is not None:
            warn(key, f"ignoring a malformed or unauthenticated store key {key} = {raw[:80]!r} (written by a "
                      "process without the run's secret?)")
        return 0
    return g


def announced_generation(store, secret: bytes, warn=None, after: int = 0) -> int:
    """The newest anchor-row generation announced with the secret's MAC (0: none): the
    ``latest`` key as a hint, then the per-generation announces g<G>/announce upwards
    (so a ``latest`` overwritten with garbage hides nothing that follows ``after``)."""
    g = max(after, _valid_generation(store, f"{PREFIX}latest", secret, warn))
    for _ in range(MAX_CLAIM_TRIES):
        nxt = _valid_generation(store, f"{PREFIX}g{g + 1}/announce", secret, warn)
        if nxt != g + 1:
            break
        g = nxt
    return g


def _claim(store, generation: int, stage: int, token: str) -> bool:
    """Takes generation G's stage slot if still free (compare_set: the first writer wins)."""
    got = store.compare_set(f"{PREFIX}g{generation}/claim/{stage}", "", token)
    return (got.decode() if isinstance(got, bytes) else str(got)) == token


def claim_generation(store, stage: int, timeout_s: float, *, secret: bytes) -> int:
    """The anchor-row generation this new anchor process of ``stage`` joins. Stage 0 opens
    a new one (1 for the first anchor row of this fast circuit, 2 for the first restart,
    ...) and announces it with the secret's MAC; a stage s > 0 takes the newest announced
    generation whose stage-s slot is still free, waiting up to ``timeout_s`` for a stage 0
    to announce one. So whatever order the stages of a row are (re)started in, and
    however often one of them failed before, every stage of one row lands in one
    generation; a key written without the secret is ignored (one warning). TimeoutError
    if no stage 0 announced one in time."""
    token = os.urandom(8).hex()
    warn = Warner(f"anchor stage {stage}")
    if stage == 0:
        gen = announced_generation(store, secret, warn) + 1
        for _ in range(MAX_CLAIM_TRIES):
            if _claim(store, gen, 0, token):
                store.set(f"{PREFIX}g{gen}/announce", generation_value(secret, gen))
                store.set(f"{PREFIX}latest", generation_value(secret, gen))
                return gen
            gen += 1  # taken (a previous row, or squatted): the next one
        raise TimeoutError(f"anchor stage 0: {MAX_CLAIM_TRIES} generations after {gen - MAX_CLAIM_TRIES} are all "
                           "taken (someone is writing the store's anchor keys)")
    end = time.monotonic() + timeout_s
    while True:
        gen = announced_generation(store, secret, warn)
        if gen > 0 and _claim(store, gen, stage, token):
            return gen
        if time.monotonic() > end:
            raise TimeoutError(f"anchor stage {stage}: no anchor stage 0 opened a new anchor-row generation within "
                               f"{timeout_s:g} s (start every stage of the anchor row)")
        time.sleep(0.2)  # polling, not a timed-out store.wait: c10d logs every timeout


def join_anchor_row(layout, rank: int, cfg, secret: bytes):
    """Anchor rank ``rank``: connects to the fast circuit's store, takes the next
    generation of its stage and joins that generation's anchor-row world; returns the
    orchestration.distributed.mesh.Mesh (``store``, ``generation`` and ``secret`` set). ``secret``:
    the run's (orchestration.distributed.secret, handed over in the rank's Plan)."""
    from orchestration.distributed.anchor_world import init_anchor_row

    _, stage = layout.coords(rank)
    store = side_store(store_address(cfg), cfg.mesh.timeout_s)
    generation = claim_generation(store, stage, cfg.mesh.timeout_s, secret=secret)
    try:
        mesh = init_anchor_row(layout, stage, store, generation, dist_backend=cfg.mesh.dist_backend,
                               timeout_s=cfg.mesh.timeout_s, device=cfg.mesh.device)
    except Exception as e:
        raise store_failure(
            e, f"{layout.describe(rank)}: the other anchor stages of generation {generation} did not join within "
               f"{cfg.mesh.timeout_s:g} s (restart every stage of the anchor row together)",
            f"{layout.describe(rank)}: the fast circuit's store closed before anchor-row generation {generation} "
            "formed (the fast circuit finished or failed)") from None
    mesh.secret = secret
    return mesh


def link_to_fast(mesh, rows: list[int], timeout_s: float) -> list:
    """Anchor side: one pair link per fast replica ``rows`` of this stage (in that order), each
    made once that replica said it waits for this generation, and authenticated both
    ways (auth.anchor_handshake with ``mesh.secret``; AuthError if the fast end cannot
    prove the secret); TimeoutError names a replica that did not link within
    ``timeout_s``; FastCircuitGone if the fast circuit's store closed first (a short run
    can finish before its anchor row links)."""
    store, g, s = mesh.store, mesh.generation, mesh.stage
    store.set(f"{PREFIX}g{g}/open/{s}", "1")
    pgs = []
    for r in rows:
        try:
            store.wait([f"{PREFIX}g{g}/here/{s}/{r}"], timedelta(seconds=timeout_s))
            if not accept_slot(store, g, s, r, 0):
                raise FastCircuitGone(f"anchor generation {g}, stage {s}: replica {r} gave up its link (a newer "
                                      "anchor generation exists)")
            pg = pair_link(store, g, s, r, ANCHOR, timeout_s)
        except Exception as e:
            who = mesh.layout.describe(mesh.layout.rank_of(r, s))
            raise store_failure(
                e, f"anchor generation {g}, stage {s}: {who} did not link within {timeout_s:g} s",
                f"anchor generation {g}, stage {s}: the fast circuit's store closed before {who} linked (the "
                "fast circuit finished or failed)") from None
        anchor_handshake(pg, mesh.secret, g, s, r, timeout_s)
        pgs.append(pg)
    return pgs
