"""Issue #14 (items 2-3): what a process without the run's secret, or an anchor that
sends garbage, can do to the fast circuit. In-process (fast): 1,000 fuzzed anchor
messages against the link thread's decoder and the hook, the handshake on real gloo pair
links, the store's listening address, malformed store keys. Spawned meshes: huge (1e10
factored, 3e38 dense), non-orthonormal and non-finite payloads are rejected and counted,
the weights stay finite; a plain TCPStore client on the store's port gets no weights and
changes nothing."""
import datetime
import math
import os
import queue
import random
import threading
import time
import types

import pytest
import torch
import torch.distributed as dist

from orchestration import anchor as A
from orchestration.components import checkpoint as ckpt
from orchestration.anchor import auth, wire
from orchestration.distributed import secret
from orchestration.launch.processes import free_port
from orchestration.distributed.mesh import MeshLayout, listen_socket, rendezvous_store

KEY = b"0123456789abcdef0123456789abcdef"


# ------------------------------------------------------------------ a hook without a mesh
class _Stage(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(12, 8, generator=g) * 0.1)
        self.b = torch.nn.Parameter(torch.randn(6, 12, generator=g) * 0.1)
        self.bias = torch.nn.Parameter(torch.zeros(6))

    def hf_name(self, n):
        return n


class _NoLink:
    """Stands in for FastLink: the test fills ``events`` itself."""

    def __init__(self, **kw):
        self.events, self.wire_bytes, self.snapshots_sent = queue.Queue(), 0, 0
        self.snapshot_bytes = self.update_bytes = 0
        self.in_flight_s = 0.0

    def offer(self, *a, **k):
        pass

    def close(self):
        pass


def _hook(tmp_path, monkeypatch, transport):
    from meshkern.optim import SpectralAdamW

    monkeypatch.setattr("orchestration.anchor.hook.FastLink", _NoLink)
    monkeypatch.delenv(secret.SECRET_ENV, raising=False)
    stage = _Stage()
    params = list(stage.parameters())
    opt = SpectralAdamW(params, lr=1e-2, rank=4)
    x = torch.randn(5, 8)
    (stage.b @ torch.tanh(stage.a @ x.T)).sum().add(stage.bias.sum()).backward()
    cfg = types.SimpleNamespace(
        anchor=types.SimpleNamespace(snapshot_every=1, delay=0, max_staleness=50, transport=transport,
                                     snapshot_codec="full", secret_file="", store=""),
        train=types.SimpleNamespace(steps=10_000, spectral_rank=4),
        mesh=types.SimpleNamespace(timeout_s=5.0, elastic=False), anchor_pace_bps=0.0)
    ctx = types.SimpleNamespace(cfg=cfg, mesh=types.SimpleNamespace(stage=0, row=1, rank=1, layout=MeshLayout(3, 2, True)),
                                optimizer=opt,
                                params=params, stage=stage, plan=types.SimpleNamespace(run_dir=str(tmp_path), secret=KEY),
                                counter=types.SimpleNamespace(extra={}))
    return A.FastHook(ctx), opt, params


class _FeedPG:
    """A pair link whose peer sends ``payload`` (values cast to what the receiver asks), one
    receive after the other (a payload comes in pieces: wire.pieces)."""

    def __init__(self, values):
        self.values, self.at = values, 0

    def recv(self, ts, peer, tag):
        t = ts[0]
        src = self.values[self.at: self.at + t.numel()]
        self.at += t.numel()
        if src.numel() < t.numel():
            src = torch.zeros(t.numel())
        t.copy_(src.to(t.dtype) if t.dtype.is_floating_point else torch.zeros(t.numel(), dtype=t.dtype))
        return types.SimpleNamespace(wait=lambda *a: True)


def _fuzz_payload(rng, n, layout):
    """Random values of random scale; sometimes NaN/Inf, sometimes proper SVD factors."""
    kind = rng.random()
    if kind < 0.15 and layout.transport == "factored":  # well formed: orthonormal U, V, small S
        out = []
        for (m, r), (r2,), (k, r3) in layout.pieces():
            U = torch.linalg.qr(torch.randn(m, r)).Q
            V = torch.linalg.qr(torch.randn(k, r)).Q
            out += [U.reshape(-1), torch.rand(r).sort(descending=True).values * 10 ** rng.uniform(-3, 6),
                    V.reshape(-1)]
        return torch.cat(out)
    v = torch.randn(n, dtype=torch.float64) * 10 ** rng.uniform(-4, 45)
    if rng.random() < 0.4:  # no negative S: gets as far as the orthonormality / magnitude checks
        v = v.abs()
    if rng.random() < 0.2:
        v[rng.randrange(n)] = rng.choice([float("nan"), float("inf"), -float("inf")])
    return v


@pytest.mark.parametrize("transport", ["dense", "factored"])
def test_1000_fuzzed_anchor_messages_never_crash_and_never_touch_a_weight(tmp_path, monkeypatch, transport):
    """Random headers (magic, kind, transport, dtype, sizes, layout hash: each right or
    random), random payload sizes and values, straight through the link thread's header
    check (FastLink._receive_update) and the hook (FastHook.poll). Every message ends as
    a clean rejection, a ProtocolError (the link would be dropped), or an update that is
    within the bounds; poll never raises, no weight changes, and what the optimizer took
    passed the same bounds checked here independently."""
    torch.manual_seed(14)
    hook, opt, params = _hook(tmp_path, monkeypatch, transport)
    lay = hook.layout
    before = [p.detach().clone() for p in params]
    link = A.FastLink.__new__(A.FastLink)  # the decoder only: no thread, no store
    link.layout, link.events, link.wire_bytes, link.update_bytes = lay, hook.link.events, 0, 0
    link.cv, link.update_version, link.round_s = threading.Condition(), -1, 0.0
    rng = random.Random(14)
    outcomes = {"protocol": 0, "rejected": 0, "update": 0}
    for i in range(1000):
        good = lay.grad_header(i, max(0, i - rng.randrange(3)))
        h = good.clone()
        for f in range(wire.HEADER_LEN):
            if rng.random() < 0.15:
                h[f] = rng.choice([0, -1, 1, 2 ** 62, rng.randrange(-2 ** 40, 2 ** 40), int(good[f]) ^ 1])
        n = int(h[wire.F_NUMEL])
        size = max(0, min(n, 4 * lay.numel + 4096)) if 0 <= n else 0
        link.pg = _FeedPG(_fuzz_payload(rng, max(1, size), lay))
        try:
            link._receive_update(h)
        except wire.ProtocolError:
            outcomes["protocol"] += 1
            continue
        ev = hook.link.events.queue[-1]
        outcomes["update" if ev[0] == "update" else "rejected"] += 1
        hook.poll(i)  # never raises
        for p, b in zip(params, before):
            assert torch.equal(p.detach(), b)  # poll hands updates to the optimizer; it never writes a weight
    st = hook.stats()
    print(outcomes, {k: v for k, v in st.items() if k.startswith("rejected") or k == "applied"})
    assert sum(outcomes.values()) == 1000 and min(outcomes.values()) > 0, outcomes
    assert st["arrivals"] == outcomes["update"] + outcomes["rejected"]
    assert st["applied"] + st["rejected"] == st["arrivals"] and not hook.pending  # each one ends one way
    assert st["rejected_optimizer"] == 0  # the hook's own checks caught everything the optimizer would refuse
    assert st["rejected_magnitude"] > 0 and st["rejected_nonfinite"] > 0 and st["rejected_shape"] > 0
    if transport == "factored":
        assert st["rejected_ortho"] > 0 and st["applied"] > 0
    got = opt.anchor_stats()
    assert got["rejected"] == 0 and got["arrivals" if transport == "dense" else "factored_arrivals"] == st["applied"]
    for p in params:  # and the optimizer's step with whatever was accepted stays finite
        p.grad = torch.randn_like(p) * 1e-2
    opt.step()
    assert all(torch.isfinite(p).all() for p in params)


@pytest.mark.parametrize("case", ["huge 1e10 factored", "huge 3e38 dense", "U not orthonormal", "S negative",
                                  "NaN", "good"])
def test_bad_payloads_are_rejected_before_the_optimizer_and_change_nothing(tmp_path, monkeypatch, case):
    transport = "dense" if "dense" in case or case == "NaN" else "factored"
    hook, opt, params = _hook(tmp_path, monkeypatch, transport)
    lay = hook.layout
    if transport == "dense":
        payload = torch.full((lay.numel,), 3e38) if "3e38" in case else torch.randn(lay.numel) * 1e-3
    else:
        parts = []
        for (m, r), _, (k, _) in lay.pieces():
            U, V = torch.linalg.qr(torch.randn(m, r)).Q, torch.linalg.qr(torch.randn(k, r)).Q
            S = torch.linspace(1.0, 0.1, r)
            if case == "U not orthonormal":
                U = U * 2
            if case == "S negative":
                S = -S
            parts += [U.reshape(-1), S, V.reshape(-1)]
        payload = torch.cat(parts)
        if "1e10" in case:
            payload = torch.full((lay.numel,), 1e10)
    if case == "NaN":
        payload[3] = float("nan")
    prior = opt.prior_enabled
    hook.link.events.put(("update", A.Arrival(0, 0, payload.to(lay.dtype), 0, payload.numel() * 4)))
    hook.poll(1)
    st = hook.stats()
    if case == "good":
        assert st["applied"] == 1 and st["rejected"] == 0
        return
    reason = {"huge 1e10 factored": "ortho", "huge 3e38 dense": "magnitude", "U not orthonormal": "ortho",
              "S negative": "negative", "NaN": "nonfinite"}[case]
    assert st["applied"] == 0 and st["rejected"] == 1 and st[f"rejected_{reason}"] == 1, st
    assert opt.anchor_stats()["arrivals"] == opt.anchor_stats()["factored_arrivals"] == 0
    assert opt.prior_enabled == prior


def test_out_of_scale_orthonormal_factors_are_rejected_for_their_magnitude(tmp_path, monkeypatch):
    """Orthonormal U, V with S = 1e10: the magnitude bound (||S|| vs the parameter's scale)."""
    hook, opt, _ = _hook(tmp_path, monkeypatch, "factored")
    parts = []
    for (m, r), _, (k, _) in hook.layout.pieces():
        parts += [torch.linalg.qr(torch.randn(m, r)).Q.reshape(-1), torch.full((r,), 1e10),
                  torch.linalg.qr(torch.randn(k, r)).Q.reshape(-1)]
    hook.link.events.put(("update", A.Arrival(0, 0, torch.cat(parts), 0, 0)))
    hook.poll(1)
    assert hook.stats()["rejected_magnitude"] == 1 and hook.stats()["applied"] == 0


# ------------------------------------------------------------------ the secret and the store keys
def test_secret_file_is_private_and_shared(tmp_path, monkeypatch, capfd):
    monkeypatch.delenv(secret.SECRET_ENV, raising=False)
    path = str(tmp_path / "run" / "anchor.secret")
    k1 = secret.ensure_secret(path)
    assert os.stat(path).st_mode & 0o777 == 0o600 and len(k1) >= 32
    assert secret.ensure_secret(path) == k1  # a second process reads the first one's
    run_dir = str(tmp_path / "run")
    cfg = types.SimpleNamespace(anchor=types.SimpleNamespace(secret_file="", join=True),
                                mesh=types.SimpleNamespace(join=""))
    monkeypatch.setenv(secret.SECRET_ENV, KEY.hex())
    assert secret.run_secret(cfg, run_dir, create=False) == KEY  # the environment wins
    monkeypatch.delenv(secret.SECRET_ENV)
    assert secret.run_secret(cfg, run_dir, create=False) == k1  # --config RUN/config.yaml --anchor.join finds it
    with pytest.raises(FileNotFoundError, match="--anchor.secret-file"):
        secret.run_secret(cfg, str(tmp_path / "other"), create=False)  # a joiner never makes one
    cfg.anchor.secret_file = path  # another machine: a copy passed with --anchor.secret-file
    assert secret.run_secret(cfg, str(tmp_path / "other"), create=False) == k1
    os.chmod(path, 0o644)
    assert secret.run_secret(cfg, run_dir, create=False) == k1  # still used, with a warning
    assert "readable by others" in capfd.readouterr().err


def test_only_the_local_launcher_of_a_new_run_creates_the_secret():
    def cfg(anchor_join=False, mesh_join=""):
        return types.SimpleNamespace(anchor=types.SimpleNamespace(join=anchor_join),
                                     mesh=types.SimpleNamespace(join=mesh_join))

    assert secret.creates_secret(cfg(), under_torchrun=False)
    assert not secret.creates_secret(cfg(), under_torchrun=True)  # every host would make its own
    assert not secret.creates_secret(cfg(anchor_join=True), under_torchrun=False)
    assert not secret.creates_secret(cfg(mesh_join="http://h:1"), under_torchrun=False)


def test_generation_announces_need_the_secret():
    v = auth.generation_value(KEY, 7)
    assert auth.parse_generation(KEY, v) == 7 and auth.parse_generation(KEY, v.encode()) == 7
    for bad in (b"7", b"abc", b"\xff\xfe", v.replace("7:", "8:"), auth.generation_value(b"x" * 32, 7), "0:" + "0" * 64,
                b"7:" + b"a" * 64, b"", b"99999999999999999999:" + b"0" * 64):
        assert auth.parse_generation(KEY, bad) is None


def _master():
    port = free_port()
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10)), port


def test_malformed_store_keys_are_ignored_once_and_break_nothing(capfd):
    """Garbage where the protocol keeps its generation keys (an increment of a non-number
    would make the store drop the connection: nothing adds to these keys any more), forged
    announces and squatted claims: generations still form, one warning per key."""
    store, _ = _master()
    P = A.PREFIX
    store.set(f"{P}latest", "abc")
    store.set(f"{P}rowgen", "abc")
    store.set(f"{P}g1/announce", "1:" + "0" * 64)  # a forged MAC
    store.set(f"{P}g2/claim/0", "squatter")
    assert A.claim_generation(store, 0, 1, secret=KEY) == 1  # g1/claim/0 was free
    store.set(f"{P}latest", b"\xff\x00junk")
    assert A.claim_generation(store, 1, 1, secret=KEY) == 1  # found through g1/announce
    assert A.claim_generation(store, 0, 1, secret=KEY) == 3  # skips the squatted 2
    assert A.claim_generation(store, 1, 1, secret=KEY) == 3
    assert A.announced_generation(store, KEY, after=1) == 3
    store.set(f"{P}g4/announce", "4:" + "f" * 64)
    assert A.announced_generation(store, KEY) == 3  # a forged next generation is not taken
    err = capfd.readouterr().err
    assert err.count("ignoring a malformed or unauthenticated store key") >= 1
    assert err.count(f"{P}g1/announce") <= 2  # once per claiming process (Warner), not per poll


def test_the_fast_circuits_store_listens_on_master_addr_only(monkeypatch):
    """torch's TCPStore master binds every interface; the fast circuit's (mesh.rendezvous_store)
    listens on MASTER_ADDR (127.0.0.1 for a local launch) and nowhere else."""
    def listening(port):
        out = []
        for f in ("/proc/net/tcp", "/proc/net/tcp6"):
            if os.path.exists(f):
                for line in open(f).read().splitlines()[1:]:
                    local, st = line.split()[1], line.split()[3]
                    addr, p = local.split(":")
                    if st == "0A" and int(p, 16) == port:
                        out.append(addr)
        return out

    plain, port = _master()
    assert listening(port) and all(set(a) == {"0"} for a in listening(port))  # 0.0.0.0 / :: : every interface
    port2 = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port2))
    monkeypatch.delenv("MESHKERN_STORE_BIND", raising=False)
    store = rendezvous_store(0, 1, 10)
    assert listening(port2) == ["0100007F"]  # 127.0.0.1, IPv4 only
    client = A.side_store(("127.0.0.1", port2), 10)
    client.set("x", "1")
    assert store.get("x") == b"1"
    s = listen_socket("127.0.0.1", 0)
    assert s.getsockname()[0] == "127.0.0.1"
    s.close()


# ------------------------------------------------------------------ the handshake on real pair links
def _anchor_end(store, gen, stage, row, secret, timeout_s, out, answer=None):
    """An anchor end of generation ``gen``'s pair link; with ``secret`` None it answers the
    challenge with ``answer`` bytes (an impostor), then tries to get a snapshot."""
    try:
        store.set(f"{A.PREFIX}g{gen}/open/{stage}", "1")
        store.wait([f"{A.PREFIX}g{gen}/here/{stage}/{row}"], datetime.timedelta(seconds=timeout_s))
        assert A.accept_slot(store, gen, stage, row, 0)  # the fast end links once its slot is accepted
        pg = A.pair_link(store, gen, stage, row, A.ANCHOR, timeout_s)
        if secret is not None:
            auth.anchor_handshake(pg, secret, gen, stage, row, timeout_s)
        else:
            auth._recv_bytes(pg, A.FAST, wire.HEADER_LEN * 8, timeout_s)  # header (as bytes: same size)
            auth._recv_bytes(pg, A.FAST, auth.NONCE_BYTES, timeout_s)
            if answer is not None:
                wire.send([auth._u8(answer)], A.FAST, pg)
            else:
                time.sleep(timeout_s)  # silent: the fast end's handshake wait (3 s) runs out first
        wire.send([wire.header(wire.REQ, version=0)], A.FAST, pg)
        h = auth._recv_bytes(pg, A.FAST, wire.HEADER_LEN * 8, timeout_s)
        h = torch.frombuffer(bytearray(h), dtype=torch.int64)
        got = auth._recv_bytes(pg, A.FAST, int(h[wire.F_NUMEL]) * 4, timeout_s)
        out.append(("snapshot", int(h[wire.F_KIND]), torch.frombuffer(bytearray(got), dtype=torch.float32)))
    except Exception as e:  # the fast end dropped the link: nothing received
        out.append(("failed", type(e).__name__))


def test_only_an_anchor_with_the_secret_gets_weights(monkeypatch):
    """Replica 0's link thread with a snapshot to serve. An impostor at the pair link of a
    properly announced generation (it raced the real anchor to the link) answers the
    challenge with garbage, another stays silent: both are refused (counted, the link
    dropped) and get no snapshot byte. Then an anchor with the secret links (next
    generation), proves it and receives the weights."""
    store, port = _master()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    weights = torch.arange(10, dtype=torch.float32)
    link = A.FastLink(stage=0, row=0, layout=None, numel=10, snapshot_codec="full", serves=True, newest_first=True,
                      timeout_s=3.0, secret=KEY)
    link.offer(0, weights, keep_older=False)
    outs = []
    try:
        for gen, answer in ((1, os.urandom(auth.MAC_BYTES + auth.NONCE_BYTES)), (2, None)):
            assert A.claim_generation(store, 0, 1, secret=KEY) == gen  # the real row announces it
            out = []
            t = threading.Thread(target=_anchor_end, args=(store, gen, 0, 0, None, 8, out, answer))
            t.start()
            ev = link.events.get(timeout=60)
            assert ev[0] == "refused" and f"generation {gen}" in ev[1], ev
            t.join(60)
            outs += out
        assert [o[0] for o in outs] == ["failed", "failed"] and link.snapshots_sent == 0
        assert A.claim_generation(store, 0, 1, secret=KEY) == 3
        out = []
        t = threading.Thread(target=_anchor_end, args=(store, 3, 0, 0, KEY, 20, out))
        t.start()
        assert link.events.get(timeout=60) == ("joined", 3)
        t.join(60)
        assert out and out[0][0] == "snapshot" and out[0][1] == wire.SNAP and torch.equal(out[0][2], weights)
        assert link.snapshots_sent == 1
    finally:
        link.close()


# ------------------------------------------------------------------ spawned meshes
def _gated_rank(rank, world, cfg, plan, gate):
    """run_rank, where fast rank 0 waits before step 3 until ``gate`` exists (fork: the
    patch stays in this rank). By step 3 the anchor row has linked (delay mode), so
    whatever the test does before creating ``gate`` happens to a running, linked mesh."""
    from orchestration.launch.rank import run_rank
    from orchestration.trainer import Trainer

    orig = Trainer.step

    def step(self, s):
        if rank == 0 and s == 3:
            for _ in range(1200):  # a bound (120 s), not a timing: the gate is an event
                if os.path.exists(gate):
                    break
                time.sleep(0.1)
        return orig(self, s)

    Trainer.step = step
    return run_rank(rank, world, cfg, plan)


def _mesh_run(tiny, tmp_path, name, *extra, port=None, gate=None):
    from test_anchor import _argv, _run

    argv = _argv(tiny, tmp_path, name, "--train.steps", "8", "--anchor.delay", "2", "--anchor.snapshot-every",
                 "1", *extra)
    kw = {} if port is None else {"port": port}
    if gate is None:
        return _run(argv, **kw)
    return _run(argv, timeout_s=240, rank_fn=_gated_rank, rank_args=(gate,), **kw)


def _finite_weights(plan):
    final = ckpt.resolve("latest", plan.ckpt_dir)
    for r in (0, 1):
        st = ckpt.load_rank_state(final, r)
        assert st["step"] == 8 and all(torch.isfinite(t).all() for t in st["stage"].values())


@pytest.mark.slow
def test_huge_and_non_orthonormal_factored_payloads_are_rejected_through_a_running_mesh(tiny, tmp_path,
                                                                                         monkeypatch):
    """Issue #14's payload of finite 1e10s (factored), factors whose U is not orthonormal
    and a NaN, from a running anchor row (delay mode: deterministic): every fast rank
    rejects and counts them before the optimizer sees them; the run trains all 8 steps
    with finite losses and ends with finite weights."""
    monkeypatch.setenv("MESHKERN_ANCHOR_FAULT", "huge:1,ortho:2,nan:3")
    _, plan, res, recs = _mesh_run(tiny, tmp_path, "fact", "--anchor.transport", "factored")
    assert [r["rounds"] for r in res[2:]] == [6, 6]
    assert len(recs) == 8 and all(math.isfinite(r["loss"]) for r in recs)
    last = recs[-1]
    assert last["anchor_rejected"] == 3 and last["anchor_rejected_ortho"] == 2  # 1e10s are not orthonormal either
    assert last["anchor_rejected_nonfinite"] == 1 and last["anchor_rejected_optimizer"] == 0
    assert last["anchor_applied"] == 3 and last["anchor_optim"]["factored_arrivals"] == 3
    assert last["anchor_optim"]["rejected"] == 0
    _finite_weights(plan)


@pytest.mark.slow
def test_huge_dense_payload_is_rejected_through_a_running_mesh(tiny, tmp_path, monkeypatch):
    """Issue #14's dense payload of finite 3e38s (before: "M's Gram matrix overflows" out
    of rank 0) and one of 1e10s: rejected for their magnitude, counted, never applied."""
    monkeypatch.setenv("MESHKERN_ANCHOR_FAULT", "huge:1=3e38,huge:3")
    _, plan, res, recs = _mesh_run(tiny, tmp_path, "dense", "--anchor.transport", "dense")
    assert len(recs) == 8 and all(math.isfinite(r["loss"]) for r in recs)
    last = recs[-1]
    assert last["anchor_rejected"] == 2 and last["anchor_rejected_magnitude"] == 2
    assert last["anchor_applied"] == 4 and last["anchor_optim"]["arrivals"] == 4
    assert last["anchor_optim"]["rejected"] == 0 and last["anchor_prior_on"]
    _finite_weights(plan)


@pytest.mark.slow
def test_an_unauthenticated_store_client_gets_no_weights_and_changes_nothing(tiny, tmp_path, capfd):
    """A plain TCPStore client on the running fast circuit's store port (no secret) writes
    garbage into every key the protocol trusts (before: an increment of the garbage made
    the store drop every fast rank's link thread: no anchor for the rest of the run),
    forges the announce of a generation 2, squats claim slots and tries to link as that
    generation's anchor. It gets no pair link and no weights; the run is exactly a clean
    run's: every update applied on time, one anchor generation, nothing rejected."""
    port = free_port()
    stop = threading.Event()
    seen = {}

    def attacker():
        try:
            attack()
        finally:
            open(gate, "w").close()  # the mesh, held before step 3, goes on

    def attack():
        end = datetime.datetime.now() + datetime.timedelta(seconds=120)
        while not stop.is_set() and datetime.datetime.now() < end:
            try:
                s = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=5))
                break
            except Exception:
                continue
        else:
            return
        P = A.PREFIX
        for k, v in (("latest", "abc"), ("rowgen", "abc"), ("g2/announce", "2:" + "ab" * 32), ("g2/open/0", "1"),
                     ("g2/open/1", "1"), ("g3/claim/1", "x"), ("g9/claim/0", "x")):
            s.set(P + k, v)
        try:  # link as generation 2's anchor of stage 0, replica 0: the fast side never comes
            pg = A.pair_link(s, 2, 0, 0, A.ANCHOR, 5)
            seen["pg"] = pg
        except Exception as e:
            seen["error"] = type(e).__name__
        s.set(P + "latest", "junk")
        seen["done"] = True

    gate = str(tmp_path / "attack.done")
    t = threading.Thread(target=attacker, daemon=True)
    t.start()
    try:
        _, plan, res, recs = _mesh_run(tiny, tmp_path, "attacked", port=port, gate=gate)
    finally:
        stop.set()
        t.join(60)
    assert seen.get("done") and "pg" not in seen  # no pair link, so not one byte of a snapshot
    assert len(recs) == 8 and all(math.isfinite(r["loss"]) for r in recs)
    last = recs[-1]
    assert last["anchor_generation"] == 1 and last["anchor_joins"] == 1 and last["anchor_link"] == "up"
    assert last["anchor_applied"] == 6 and last["anchor_staleness_hist"] == {"2": 6}  # versions 0..5, on time
    assert last["anchor_rejected"] == 0 and last["anchor_rejected_auth"] == 0
    assert [r["rounds"] for r in res[2:]] == [6, 6]
    _finite_weights(plan)


@pytest.mark.parametrize("transport", ["dense", "factored"])
def test_the_hook_stands_alone_without_the_optimizers_checks(tmp_path, monkeypatch, transport):
    """Issue #14 as reported (before SpectralAdamW had bounds, and in case they are lost
    again, as in e5ad050): with the optimizer's magnitude and orthonormality checks switched
    off, a 1e10 factored / 3e38 dense payload is still rejected by the fast rank, and the
    next step is finite."""
    import meshkern.optim as O

    monkeypatch.setattr(O.SpectralAdamW, "_out_of_bounds", lambda self, norms: [])
    monkeypatch.setattr(O, "orthonormality_error", lambda Q: torch.tensor(0.0))
    hook, opt, params = _hook(tmp_path, monkeypatch, transport)
    value = 3e38 if transport == "dense" else 1e10
    hook.link.events.put(("update", A.Arrival(0, 0, torch.full((hook.layout.numel,), value), 0, 0)))
    hook.poll(1)
    assert hook.stats()["applied"] == 0 and hook.stats()["rejected"] == 1
    assert opt.anchor_stats()["arrivals"] == opt.anchor_stats()["factored_arrivals"] == 0
    opt.step()
    assert all(torch.isfinite(p).all() for p in params)


class _ScriptedPG:
    """A pair link whose peer sends random bytes; records what this end sends."""

    def __init__(self, rng):
        self.rng, self.sent = rng, []

    def send(self, ts, peer, tag):
        self.sent.append(ts[0].clone())
        return types.SimpleNamespace(wait=lambda *a: True)

    def recv(self, ts, peer, tag):
        t = ts[0]
        raw = bytes(self.rng.getrandbits(8) for _ in range(t.numel() * t.element_size()))
        if self.rng.random() < 0.3 and t.dtype == torch.int64:  # sometimes a well-formed AUTH header
            raw = wire.header(wire.AUTH, round=1, version=0, numel=0).numpy().tobytes()
        t.copy_(torch.frombuffer(bytearray(raw), dtype=t.dtype))
        return types.SimpleNamespace(wait=lambda *a: True)


def test_1000_unauthenticated_handshakes_are_all_refused():
    """Random answers to the fast end's challenge and random challenges/answers to an
    anchor end: every one ends in AuthError; the fast end never sends more than its
    challenge (so nothing that depends on the secret), the anchor end never accepts."""
    rng = random.Random(2)
    for i in range(500):
        pg = _ScriptedPG(rng)
        with pytest.raises(auth.AuthError):
            auth.fast_handshake(pg, KEY, 1, 0, 0, 1.0)
        assert len(pg.sent) == 2 and pg.sent[0].dtype == torch.int64 and pg.sent[1].numel() == auth.NONCE_BYTES
    for i in range(500):
        pg = _ScriptedPG(rng)
        with pytest.raises(auth.AuthError):
            auth.anchor_handshake(pg, KEY, 1, 0, 0, 1.0)
