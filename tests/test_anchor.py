"""The slow anchor circuit (orchestration.anchor) on spawned gloo meshes with a tiny Llama:
the anchor gradient is the unsplit model's dense gradient at the snapshot, factored and
dense transport give the same filter, stalls / NaN / wrong shapes / a killed anchor
never stop or corrupt the fast circuit. Plus the wire layout checks in-process."""
import math
import os
import re

import pytest
import torch

from orchestration import anchor as A
from orchestration.components import checkpoint as ckpt
from orchestration.config import parse_args, validate
from orchestration.launch.processes import run_local
from orchestration.distributed.mesh import MeshLayout
from orchestration.components.metrics import read_jsonl
from orchestration.train import prepare, run_rank


def _argv(tiny, tmp_path, name, *extra):
    return ["--preset", "m95-ap", "--model", str(tiny / "model"), "--data", str(tiny / "data.txt"),
            "--data.seq-len", "32", "--data.max-sequences", "200", "--train.batch-size", "4",
            "--train.microbatches", "2", "--anchor.microbatches", "2", "--train.spectral-rank", "8",
            "--run.out-dir", str(tmp_path), "--run.name", name, "--run.progress", "false",
            "--run.eval-sequences", "0", "--mesh.timeout-s", "30", "--mesh.rows", "2", "--mesh.stages", "2",
            "--dp.mode", "none", *extra]


def _spy_rank(rank, world, cfg, plan, outdir):
    """run_rank, recording every update a fast rank applies (fork: the patch stays in this rank)."""
    orig = A.FastHook._applied

    def spy(self, x, entries, staleness):
        flat = [list(e) if isinstance(e, tuple) else [e] for e in entries]
        torch.save({"round": x.round, "version": x.version, "staleness": staleness, "names": list(self.layout.names),
                    "entries": [[t.clone() for t in e] for e in flat]},
                   os.path.join(outdir, f"r{rank}_k{x.round}.pt"))
        return orig(self, x, entries, staleness)

    A.FastHook._applied = spy
    return run_rank(rank, world, cfg, plan)


def _run(argv, outdir=None, timeout_s=150, rank_fn=None, rank_args=(), **launch):
    """Runs the mesh of ``argv``; each rank runs ``rank_fn(rank, world, cfg, plan, *rank_args)``
    (default run_rank, or _spy_rank recording into ``outdir``)."""
    cfg, _ = parse_args(argv)
    plan = prepare(cfg)
    lay = MeshLayout(cfg.mesh.rows, cfg.mesh.stages, True)
    anchors = {r for r in range(lay.world_size) if lay.is_anchor(r)}
    if rank_fn is not None:
        fn, args = rank_fn, (cfg, plan, *rank_args)
    else:
        fn, args = (run_rank, (cfg, plan)) if outdir is None else (_spy_rank, (cfg, plan, str(outdir)))
    res = run_local(fn, cfg.world_size, args, timeout_s=timeout_s, describe=lay.describe, optional=anchors, **launch)
    recs = read_jsonl(os.path.join(plan.run_dir, "metrics.jsonl"))
    return cfg, plan, res, recs


# ------------------------------------------------------------------ in-process: the wire
def _named(shapes):
    return [(f"w{i}", torch.nn.Parameter(torch.randn(s))) for i, s in enumerate(shapes)]


def test_layout_sizes_and_round_trip():
    named = _named([(6, 4), (3, 5), (8, 2)])
    dense = A.Layout.build(named, "dense", 3, torch.float32)
    fact = A.Layout.build(named, "factored", 3, torch.float32)
    assert dense.numel == 6 * 4 + 3 * 5 + 8 * 2
    assert fact.numel == sum(min(3, m, n) * (m + n + 1) for m, n in [(6, 4), (3, 5), (8, 2)])
    grads = [torch.randn(p.shape) for _, p in named]
    out = dense.decode(dense.encode(grads))
    for g, o in zip(grads, out):
        torch.testing.assert_close(o, g, rtol=0, atol=0)
    from meshkern.optim import AnchorMomentum

    mom = AnchorMomentum([p for _, p in named], 0.9, 3)
    facs = fact.decode(fact.encode(grads, mom))
    for (U, S, V), (U2, S2, V2) in zip(facs, AnchorMomentum.factors(mom)):
        torch.testing.assert_close(U, U2)
        torch.testing.assert_close(S, S2)
        torch.testing.assert_close(V, V2)
    dense.check_header(dense.grad_header(0, 0))
    fact.check_header(fact.grad_header(0, 0))


@pytest.mark.parametrize("tamper, reason", [
    (lambda h: h.__setitem__(A.F_NUMEL, h[A.F_NUMEL] + 1), "shape"),
    (lambda h: h.__setitem__(A.F_LAYOUT, h[A.F_LAYOUT] ^ 1), "shape"),
    (lambda h: h.__setitem__(A.F_DTYPE, 1), "shape"),
    (lambda h: h.__setitem__(A.F_TRANSPORT, 1), "shape"),
    (lambda h: h.__setitem__(A.F_MAGIC, 7), "protocol"),
    (lambda h: h.__setitem__(A.F_KIND, A.SNAP), "protocol"),
])
def test_bad_headers_are_rejected(tamper, reason):
    lay = A.Layout.build(_named([(6, 4), (3, 5)]), "dense", 3, torch.float32)
    h = lay.grad_header(1, 2)
    tamper(h)
    with pytest.raises(A.Rejected) as e:
        lay.check_header(h)
    assert e.value.reason == reason


def test_bad_payloads_are_rejected():
    named = _named([(6, 4), (3, 5)])
    lay = A.Layout.build(named, "dense", 3, torch.float32)
    good = lay.encode([torch.randn(p.shape) for _, p in named])
    for bad, reason in [(good[:-1], "shape"), (good.double(), "shape"),
                        (good.clone().index_fill_(0, torch.tensor([5]), float("nan")), "nonfinite"),
                        (good.clone().index_fill_(0, torch.tensor([0]), float("inf")), "nonfinite")]:
        with pytest.raises(A.Rejected) as e:
            lay.decode(bad)
        assert e.value.reason == reason
    fact = A.Layout.build(named, "factored", 3, torch.float32)
    p = torch.rand(fact.numel)
    p[6 * 3] = -1.0  # first S entry of the first matrix (after U[6, 3])
    with pytest.raises(A.Rejected, match="negative"):
        fact.decode(p)


def test_nonfinite_anchor_gradient_is_sent_as_a_rejectable_update():
    from meshkern.optim import AnchorMomentum

    named = _named([(6, 4), (3, 5)])
    fact = A.Layout.build(named, "factored", 3, torch.float32)
    mom = AnchorMomentum([p for _, p in named], 0.9, 3)
    good = [torch.randn(p.shape) for _, p in named]
    fact.encode(good, mom)
    before = [m.clone() for m in mom.m]
    bad = [good[0], good[1].clone().fill_(float("inf"))]
    with pytest.warns(RuntimeWarning, match="rejected anchor gradients"):
        payload = fact.encode(bad, mom)
    with pytest.raises(A.Rejected) as e:
        fact.decode(payload)
    assert e.value.reason == "nonfinite"
    assert all(torch.equal(x, y) for x, y in zip(before, mom.m))  # the anchor's momentum is untouched


def test_layout_hash_depends_on_shapes_and_order():
    assert A.layout_hash([(4, 6), (3,)]) == A.layout_hash([(4, 6), (3,)])
    assert A.layout_hash([(4, 6), (3,)]) != A.layout_hash([(6, 4), (3,)])
    assert A.layout_hash([(4, 6), (3,)]) != A.layout_hash([(3,), (4, 6)])
    assert A.layout_hash([(4, 6)]) != A.layout_hash([(4,), (6,)])


def test_fault_spec_and_config_checks():
    assert A.parse_faults("nan:1, stall:3=2.5,die:4") == {"nan": {1: 0.0}, "stall": {3: 2.5}, "die": {4: 0.0}}
    with pytest.raises(ValueError, match="bad item"):
        A.parse_faults("boom:1")
    cfg, _ = parse_args(["--preset", "m95-ap"])  # the anchor's rules live in config.validate
    validate(cfg)
    cfg.train.optimizer = "adamw"
    with pytest.raises(ValueError, match="--train.optimizer spectral"):
        validate(cfg)
    with pytest.raises(ValueError, match="exceeds --anchor.max-staleness"):
        parse_args(["--preset", "m95-ap", "--anchor.delay", "60"])



def test_only_link_failures_count_as_a_lost_anchor():
    for e in (ConnectionError("reset"), TimeoutError("x"), A.ProtocolError("anchor protocol: bad header"),
              RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"),
              A.FastCircuitGone("gone")):
        assert A.is_link_failure(e), e
    for e in (TypeError("x"), AttributeError("x"), KeyError(1), IndexError(2), RuntimeError("shape mismatch")):
        assert not A.is_link_failure(e), e


def test_a_bug_in_the_link_thread_is_raised_on_the_trainers_thread(monkeypatch):
    """A programming error in the link thread is not "anchor lost": the next poll raises it."""
    def buggy(self):
        raise TypeError("a bug")

    monkeypatch.setattr(A.FastLink, "_link", buggy)
    link = A.FastLink(stage=0, row=0, layout=None, numel=1, snapshot_codec="full", serves=False, newest_first=True,
                      timeout_s=1.0, secret=b"k" * 32)
    link.thread.join(10)
    hook = A.FastHook.__new__(A.FastHook)  # only what _drain reads
    hook.link, hook.stage_index = link, 0
    with pytest.raises(RuntimeError, match="a bug, not a lost anchor") as e:
        hook._drain(0)
    assert isinstance(e.value.__cause__, TypeError)

# ------------------------------------------------------------------ spawned gloo meshes
def _unsplit_grads(model_dir, batch):
    from orchestration.models.loading import load_causal_lm

    model, _ = load_causal_lm(str(model_dir))
    model(input_ids=batch, labels=batch).loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("codec, rtol", [("full", 1e-4), ("int8", 1e-3)])
def test_anchor_gradient_is_the_unsplit_dense_gradient_at_the_snapshot(tiny, tmp_path, codec, rtol):
    """3x2 mesh (2 fast replicas + anchor row), delay mode: each update every fast rank
    applies is the unsplit model's gradient on the anchor's batch at the snapshot's
    parameters (version 0 = the base model, version 2 = the step-2 checkpoint of replica 0):
    exactly with full snapshots; with int8-delta snapshots (version 2 arrives as a delta)
    up to the quantization of the parameters (passes at 2e-4 here; 1e-3 leaves margin)."""
    spy = tmp_path / "spy"
    spy.mkdir()
    cfg, plan, res, recs = _run(_argv(tiny, tmp_path, "grad", "--anchor.transport", "dense", "--mesh.rows", "3",
                                      "--train.steps", "5",
                                      "--dp.mode", "allreduce", "--dp.compressor", "none", "--anchor.snapshot-codec", codec,
                                      "--anchor.delay", "2", "--anchor.snapshot-every", "2",
                                      "--checkpoint.every", "2", "--checkpoint.keep", "5"), outdir=spy)
    assert [r["rounds"] for r in res[4:]] == [2, 2]  # versions 0 and 2 (4 + 2 >= 5 steps: not taken)
    at = {0: tiny / "model", 2: ckpt.step_dir(plan.ckpt_dir, 2)}
    for k, version in enumerate((0, 2)):
        ref = _unsplit_grads(at[version], A.round_batch(cfg, plan, k))
        for stage in (0, 1):
            got = [torch.load(spy / f"r{row * 2 + stage}_k{k}.pt", weights_only=True) for row in (0, 1)]
            for g in got:
                assert (g["version"], g["staleness"]) == (version, 2)
                assert len(g["names"]) == 7 * 2  # q k v o gate up down of this stage's 2 layers
                for name, (t,) in zip(g["names"], g["entries"]):
                    torch.testing.assert_close(t, ref[name], rtol=rtol, atol=rtol * ref[name].abs().max().item())
            for (a,), (b,) in zip(got[0]["entries"], got[1]["entries"]):  # both replicas got the same
                assert torch.equal(a, b)
    last = recs[-1]
    assert last["anchor_applied"] == 2 and last["anchor_staleness_hist"] == {"2": 2}
    assert last["anchor_optim"]["arrivals"] == 2 and last["anchor_rejected"] == 0


@pytest.mark.slow
def test_factored_transport_applies_the_same_filter_as_dense(tiny, tmp_path):
    """Delay mode makes both runs see the same anchor gradients at the same steps; the
    factored run ships the anchor momentum's rank-r factors instead of the gradient and must
    train identically (same M_anc, same truncated SVD), for r(m+n+1) instead of m*n numbers."""
    common = ("--train.steps", "7", "--anchor.delay", "2", "--anchor.snapshot-every", "2")
    _, _, res_d, recs_d = _run(_argv(tiny, tmp_path, "dense", *common, "--anchor.transport", "dense"))
    _, _, res_f, recs_f = _run(_argv(tiny, tmp_path, "fact", *common, "--anchor.transport", "factored"))
    ld, lf = res_d[1]["losses"], res_f[1]["losses"]
    assert len(ld) == len(lf) == 7
    torch.testing.assert_close(torch.tensor(lf), torch.tensor(ld), rtol=1e-5, atol=1e-6)
    for d, f in zip(recs_d[3:], recs_f[3:]):  # the filter is active from step 2's update on
        assert d["anchor_optim"]["filtered"] == f["anchor_optim"]["filtered"] == 7 * 2
        assert 0 < d["anchor_optim"]["energy_kept"] < 1
        assert math.isclose(f["anchor_optim"]["mean_gain"], d["anchor_optim"]["mean_gain"], rel_tol=1e-4)
        assert math.isclose(f["anchor_optim"]["energy_kept"], d["anchor_optim"]["energy_kept"], rel_tol=1e-3)
    assert recs_f[-1]["anchor_optim"]["factored_arrivals"] == recs_d[-1]["anchor_optim"]["arrivals"] == 3
    # stage 0 holds layers 0-1: q [40,40], k/v [20,40], o [40,40], gate/up [64,40], down [40,64]
    shapes = [(40, 40), (20, 40), (20, 40), (40, 40), (64, 40), (64, 40), (40, 64)] * 2
    assert recs_d[-1]["anchor_update_payload_bytes"] == 4 * sum(m * n for m, n in shapes)
    assert recs_f[-1]["anchor_update_payload_bytes"] == 4 * sum(min(8, m, n) * (m + n + 1) for m, n in shapes)
    assert recs_f[-1]["bytes"]["anchor"] < recs_d[-1]["bytes"]["anchor"]


@pytest.mark.slow
def test_nan_and_wrong_shape_updates_are_rejected_and_counted(tiny, tmp_path, monkeypatch, capfd):
    """Delay mode (deterministic): the anchor's round 1 carries a NaN, round 2 a payload of
    the wrong size and layout. Every fast rank rejects both, never applies them (the
    optimizer saw exactly the good ones) and goes on with rounds 3-5."""
    monkeypatch.setenv("MESHKERN_ANCHOR_FAULT", "nan:1,shape:2")
    _, plan, res, recs = _run(_argv(tiny, tmp_path, "bad", "--train.steps", "8", "--anchor.delay", "2",
                                    "--anchor.snapshot-every", "1", "--anchor.transport", "dense"))
    assert [r["rounds"] for r in res[2:]] == [6, 6]  # versions 0..5 (5 + 2 < 8)
    assert len(recs) == 8 and all(math.isfinite(r["loss"]) for r in recs)
    last = recs[-1]
    assert last["anchor_rejected_nonfinite"] == 1 and last["anchor_rejected_shape"] == 1
    assert last["anchor_rejected"] == 2 and last["anchor_arrivals"] == 6
    assert last["anchor_applied"] == 4 and last["anchor_staleness_hist"] == {"2": 4}
    assert last["anchor_optim"]["arrivals"] == 4 and last["anchor_optim"]["rejected"] == 0
    # steps 3 and 4 (the bad rounds' due steps) folded in nothing: the optimizer count stalls
    assert [r["anchor_optim"]["arrivals"] for r in recs] == [0, 0, 1, 1, 1, 2, 3, 4]
    assert last["anchor_blocked_s"] < 25  # a refused update ends the wait at once (timeout is 30 s)
    st = ckpt.load_rank_state(ckpt.resolve("latest", plan.ckpt_dir), 0)
    assert all(torch.isfinite(t).all() for t in st["stage"].values())


@pytest.mark.slow
def test_stalled_anchor_never_stops_the_fast_circuit(tiny, tmp_path, monkeypatch, capfd):
    """The anchor hangs in its first round: the fast circuit never waits for it, trains every
    step, says once that the anchor is stalled, trains as plain masked AdamW (the optimizer's prior
    switched off, saved in the checkpoint) and checkpoints; the hung anchor ranks
    are terminated at the end."""
    monkeypatch.setenv("MESHKERN_ANCHOR_FAULT", "stall:0=inf")
    _, plan, res, recs = _run(_argv(tiny, tmp_path, "stall", "--train.steps", "10", "--anchor.max-staleness", "3",
                                    "--checkpoint.every", "5"))
    assert res[2] is None and res[3] is None, (res[2] or {}).get("stopped", "") + " | " + str((res[3] or {}).get("stopped", ""))
    assert len(recs) == 10 and all(math.isfinite(r["loss"]) for r in recs)
    last = recs[-1]
    assert last["anchor_applied"] == 0 and last["anchor_blocked_s"] == 0.0
    assert last["anchor_stalled"] and not last["anchor_prior_on"] and last["anchor_link"] == "up"
    assert [r["anchor_stalled"] for r in recs] == [False] * 4 + [True] * 6  # more than 3 steps without update
    st = ckpt.load_rank_state(ckpt.resolve("latest", plan.ckpt_dir), 0)
    assert st["step"] == 10 and st["optimizer"]["spectral"]["prior_enabled"] is False
    err = capfd.readouterr().err
    assert err.count("no anchor update for 4 fast steps") == 2  # once per stage column
    assert "continuing as plain masked AdamW" in err


@pytest.mark.slow
def test_killed_anchor_leaves_the_fast_circuit_training_and_checkpointing(tiny, tmp_path, capfd):
    """SIGKILL anchor rank 2 (stage 0) at its round on snapshot version 3: the other
    anchor rank stops on the broken row, the fast ranks log the loss once and train and
    checkpoint to the end."""
    _, plan, res, recs = _run(_argv(tiny, tmp_path, "kill", "--train.steps", "12", "--anchor.snapshot-every", "1",
                                    "--anchor.delay", "2", "--checkpoint.every", "4",
                                    "--run.fail-rank", "2", "--run.fail-step", "3"))
    assert res[2] is None  # killed
    assert res[3]["stopped"].startswith("anchor row closed")  # its anchor peer is gone
    assert len(recs) == 12 and all(math.isfinite(r["loss"]) for r in recs)
    last = recs[-1]
    assert last["anchor_link"] == "lost" and not last["anchor_prior_on"]
    assert last["anchor_applied"] == 3  # versions 0, 1, 2 at steps 2, 3, 4; it died on version 3
    final = ckpt.resolve("latest", plan.ckpt_dir)
    assert ckpt.read_meta(final)["step"] == 12
    for r in (0, 1):
        assert ckpt.load_rank_state(final, r)["step"] == 12
    from orchestration.models.loading import load_causal_lm

    load_causal_lm(final)
    err = capfd.readouterr().err
    assert "rank 2 (anchor replica, stage 0)" in err
    # The killed rank's column notices at once. Stage 1's fast ranks notice only when its
    # anchor rank (which stops on the broken row) closes the link, which on an idle
    # machine can come after the 12 fast steps are done: its line is allowed, not required.
    # (Searched anywhere in stderr, not per line: several processes write to it at once.)
    stages = re.findall(r"\[anchor\] stage (\d+): step \d+: lost the anchor", err)
    assert "0" in stages and set(stages) <= {"0", "1"}, err
    assert len(stages) == len(set(stages)), err  # said once per column
    assert "prior back on" not in err.split("lost the anchor")[-1]


def test_int8_snapshot_stream_keeps_both_views_identical():
    """Replica 0's and the anchor's views of an int8-delta snapshot stream are bit-identical;
    the anchor's view stays within half a quantization step of each snapshot (no drift),
    and a delta costs numel + 4 * ceil(numel / 1024) bytes."""
    torch.manual_seed(0)
    n = 5000  # not a multiple of the chunk: the last chunk is padded
    send, recv = A.SnapshotCoder("int8", n), A.SnapshotCoder("int8", n)
    w = torch.randn(n)
    for i in range(6):
        before = None if send.view is None else send.view.clone()
        code, payload = send.encode(w.clone())
        got = recv.decode(code, payload.clone())
        assert code == (A.SNAP_FULL if i == 0 else A.SNAP_DELTA)
        if i == 0:
            assert torch.equal(got, w) and torch.equal(send.view, recv.view)
        else:
            assert payload.dtype == torch.uint8 and payload.numel() == 5 * 1024 + 4 * 5 == A.SnapshotCoder.delta_numel(n)
            assert torch.equal(send.view, recv.view) and torch.equal(got, recv.view)
            half_step = float((w - before).abs().max()) / 127 / 2  # the delta's quantization, whole-tensor bound
            assert float((got - w).abs().max()) <= half_step * (1 + 1e-5) + 1e-7
        w = w + torch.randn(n) * 1e-2 * (i + 1)  # growing steps: the error follows the last delta, no drift
    full = A.SnapshotCoder("full", n)
    code, payload = full.encode(w)
    assert code == A.SNAP_FULL and torch.equal(A.SnapshotCoder("full", n).decode(code, payload), w)
    with pytest.raises(RuntimeError, match="before its first full snapshot"):
        A.SnapshotCoder("int8", n).decode(A.SNAP_DELTA, payload)
    with pytest.raises(RuntimeError, match="expected 5140 uint8"):
        recv.decode(A.SNAP_DELTA, torch.zeros(5139, dtype=torch.uint8))
    with pytest.raises(ValueError, match="--anchor.snapshot-codec"):
        A.SnapshotCoder("int4", n)


# ------------------------------------------------------------------ restart and rejoin
def _pause_while_lost(monkeypatch, limit_s=8.0):
    """Test instrumentation (inherited by forked ranks): a fast rank waits in ``poll`` until
    an anchor generation has joined, both before the first one links and after it lost
    one, so that the first link and a rejoin happen mid-run however fast the tiny model
    trains and however slowly a loaded machine starts the anchor row (the real hook never
    waits). Event-driven: it returns as soon as the link thread reports the join. At most
    ``limit_s`` per poll, then again at the next step's poll while still unlinked: the
    stages of a replica notice a lost anchor independently, and one that noticed a step
    before its pipeline peer must not hold that peer in a wait past the mesh's 30 s
    timeout (a 120 s pause did, on a loaded machine). (Waiting for a delivery as well
    would deadlock: a stage's anchor round needs snapshots that its pipeline peer, held in
    a recv by the waiting stage, cannot offer.)"""
    import time

    orig = A.FastHook.poll

    def poll(self, step):
        end = time.monotonic() + limit_s
        self._drain(step)
        while (self.generation == 0 or self.link_state == "lost") and time.monotonic() < end:
            self._drain(step, block_s=0.2)
        return orig(self, step)

    monkeypatch.setattr(A.FastHook, "poll", poll)


def test_anchor_state_round_trip_and_ownership(tmp_path):
    """The anchor's saved state restores its momentum exactly, and is only taken by a rejoin
    of the same fast circuit (run id) or a resumed run with the same layout."""
    from meshkern.optim import AnchorMomentum

    named = _named([(6, 4), (5, 3)])
    lay = A.Layout.build(named, "factored", 2, torch.float32)
    mom = AnchorMomentum([p for _, p in named], 0.9, 2, seed=3)
    for _ in range(3):
        lay.encode([torch.randn(p.shape) for _, p in named], mom)
    path = str(tmp_path / "anchor" / "stage_00.pt")
    A.save_state(path, "run-a", 3, lay, mom)
    fresh = AnchorMomentum([p for _, p in named], 0.9, 2, seed=3)
    k, why = A.load_state(path, "run-a", lay, fresh, resuming=False)
    assert k == 3 and "restored round 3" in why
    for a, b in zip(mom.factors(), fresh.factors()):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    g = [torch.randn(p.shape) for _, p in named]  # and they go on identically
    assert torch.equal(lay.encode(g, mom), lay.encode(g, fresh))
    assert A.load_state(path, "run-b", lay, fresh, resuming=False)[0] is None  # another run's state
    assert A.load_state(path, "run-b", lay, fresh, resuming=True)[0] == 3  # a resumed run takes it
    other = A.Layout.build(_named([(6, 4)]), "factored", 2, torch.float32)
    assert A.load_state(path, "run-a", other, AnchorMomentum([torch.zeros(6, 4)], 0.9, 2), resuming=True)[0] is None
    assert A.load_state(str(tmp_path / "none.pt"), "run-a", lay, fresh, resuming=False)[0] is None


@pytest.mark.slow
def test_dead_anchor_row_is_restarted_and_rejoins(tiny, tmp_path, monkeypatch, capfd):
    """Both anchor ranks die at the start of their round 2 (generation 1 only). The launcher
    starts a new anchor row (generation 2), which joins the running fast circuit through
    its store, restores the saved round counter and factored momentum, and delivers
    updates again: the fast ranks say so, apply them, and the prior is back on."""
    spy = tmp_path / "spy"
    spy.mkdir()
    monkeypatch.setenv("MESHKERN_ANCHOR_FAULT", "die:2")
    _pause_while_lost(monkeypatch)
    _, plan, res, recs = _run(_argv(tiny, tmp_path, "restart", "--train.steps", "40", "--anchor.snapshot-every", "1",
                                    "--anchor.transport", "factored", "--anchor.max-staleness", "40"),
                              outdir=spy, restarts=1)
    gen2 = res[2:]
    assert all(r["generation"] == 2 and r["restored"] == f"restored round 2 from {A.state_path(plan, s)}"
               for s, r in enumerate(gen2))
    assert all(r["rounds"] >= 1 and r["stopped"] == "the fast circuit finished" for r in gen2), \
        [(r["rounds"], r["stopped"]) for r in gen2]
    last = recs[-1]
    assert last["anchor_generation"] == 2 and last["anchor_joins"] == 2 and last["anchor_link"] == "up"
    assert last["anchor_prior_on"] and last["anchor_rejected"] == 0
    rounds = sorted(torch.load(f, weights_only=True)["round"] for f in spy.glob("r0_k*.pt"))
    # rounds 0, 1 from generation 1; generation 2 continues at round 2 (its data position), never repeats
    assert rounds[:3] == [0, 1, 2] and rounds == list(range(len(rounds))) and len(rounds) >= 3
    assert last["anchor_applied"] == len(rounds)
    err = capfd.readouterr().err
    assert "restarting ranks [2, 3] (restart 1 of 1)" in err
    for s in (0, 1):
        assert f"[anchor] stage {s}: " in err and err.count(f"[anchor] stage {s}: step") >= 2
    assert err.count("anchor row generation 2 joined") == 2  # once per stage column


@pytest.mark.slow
def test_anchor_row_joins_a_running_fast_circuit_by_command(tiny, tmp_path, monkeypatch, capfd):
    """The user's path: the fast circuit runs (``main``, no automatic restarts), its anchor
    row dies at round 1; the command the launcher printed (``--config RUN/config.yaml
    --anchor.join --anchor.store HOST:PORT``) starts a new anchor row, which joins the
    running fast circuit, delivers updates, and exits when the fast circuit finishes."""
    import multiprocessing as mp
    import shlex
    import threading
    import time

    from orchestration.train import main

    monkeypatch.setenv("MESHKERN_ANCHOR_FAULT", "die:1")  # generation 1 only
    _pause_while_lost(monkeypatch)
    argv = _argv(tiny, tmp_path, "join", "--train.steps", "40", "--anchor.snapshot-every", "1",
                 "--anchor.max-staleness", "40", "--anchor.restarts", "0")
    codes = []
    fast = threading.Thread(target=lambda: codes.append(main(argv)))
    fast.start()
    err, cmd, t0 = "", None, time.monotonic()
    while time.monotonic() - t0 < 120 and fast.is_alive():
        err += capfd.readouterr().err
        m = re.search(r"a new anchor row joins it with: python -m orchestration.train (.*)", err)
        if m and "[anchor] stage 0: " in err and "lost the anchor" in err:
            cmd = shlex.split(m.group(1))
            break
        time.sleep(0.2)
    assert cmd is not None, f"the fast circuit never printed the join command or never lost its anchor:\n{err}"
    joiner = mp.get_context("fork").Process(target=lambda: os._exit(main(cmd)))
    joiner.start()
    fast.join(180)
    joiner.join(60)
    assert codes == [0] and joiner.exitcode == 0
    recs = read_jsonl(str(tmp_path / "join" / "metrics.jsonl"))
    last = recs[-1]
    assert last["anchor_generation"] == 2 and last["anchor_joins"] == 2 and last["anchor_link"] == "up"
    before = max(r["anchor_applied"] for r in recs if r["anchor_generation"] == 1)
    assert last["anchor_applied"] > before and last["anchor_prior_on"]  # generation 2 delivered
    err += capfd.readouterr().err
    assert err.count("anchor row generation 2 joined") == 2


@pytest.mark.slow
def test_resumed_run_restores_the_anchor_state(tiny, tmp_path):
    """A fast circuit resumed from its checkpoint starts a new anchor row, which continues
    from the saved round counter and factored momentum instead of from zero. Delay mode:
    the fast ranks wait for each due update, so both 4-step runs get anchor rounds however
    slowly the anchor row starts (in asynchronous mode a short run may end before its
    anchor row links)."""
    common = ("--anchor.snapshot-every", "1", "--anchor.delay", "1", "--anchor.transport", "factored",
              "--checkpoint.every", "3", "--mesh.timeout-s", "120")
    _, plan, res, _ = _run(_argv(tiny, tmp_path, "resume", "--train.steps", "4", *common))
    done = min(r["rounds"] for r in res[2:])
    assert done >= 1 and all(r["restored"] == "" for r in res[2:])
    saved = [torch.load(A.state_path(plan, s), weights_only=True) for s in (0, 1)]
    assert all(st["momentum"]["updates"] >= 1 for st in saved)
    cfg2, plan2, res2, recs2 = _run(_argv(tiny, tmp_path, "resume", "--train.steps", "7", *common,
                                          "--checkpoint.resume", "latest"))
    assert [r["step"] for r in recs2] == list(range(1, 8))  # one metrics file: steps 1-4, then 5-7 resumed
    k = A.exact_resume_round(cfg2, 4)  # delay mode: the anchor continues from the round of step 4
    for s, r in enumerate(res2[2:]):
        if saved[s]["round"] == k:  # the per-round state of that round exists (written before the latest)
            assert r["restored"] == f"restored round {k} from {A.round_state_path(plan2, s, k)}"
        else:
            assert r["restored"] == f"restored round {saved[s]['round']} from {A.state_path(plan2, s)}"


def test_anchor_that_outlives_the_fast_circuit_says_so():
    """The fast circuit's store (fast rank 0) closes while an anchor stage waits for its fast
    replicas to link, as when a short run finishes before its anchor row linked: the wait
    ends with FastCircuitGone, not with a false "did not link within T s" TimeoutError
    (run_anchor_rank turns FastCircuitGone into a clean stop)."""
    import datetime
    import multiprocessing as mp
    import types

    import torch.distributed as dist

    from orchestration.launch.processes import free_port

    port = free_port()
    ready = mp.get_context("fork").Event()
    quit_ = mp.get_context("fork").Event()

    def server():
        master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=60))
        ready.set()
        quit_.wait(60)
        del master  # the process exits: the store closes

    proc = mp.get_context("fork").Process(target=server)
    proc.start()
    try:
        assert ready.wait(60)
        store = A.side_store(("127.0.0.1", port), 60)
        mesh = types.SimpleNamespace(store=store, generation=1, stage=0, layout=MeshLayout(2, 2, True))
        quit_.set()
        with pytest.raises(A.FastCircuitGone, match="store closed before rank 0 .* linked"):
            A.link_to_fast(mesh, [0], timeout_s=60)
    finally:
        quit_.set()
        proc.join(30)


def test_generations_form_whatever_the_start_order():
    """Stages of one anchor row land in one generation whatever order they (re)start in,
    even after a stage failed before claiming (its slot stays free for the next row)."""
    import datetime

    import torch.distributed as dist

    from orchestration.launch.processes import free_port

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=5))
    key = b"k" * 32  # the run's anchor secret (orchestration.anchor.auth)
    assert A.claim_generation(store, 0, 1, secret=key) == 1
    assert A.claim_generation(store, 1, 1, secret=key) == 1 and A.claim_generation(store, 2, 1, secret=key) == 1
    # row 2: stage 2 starts first and waits for a stage 0; stage 1 never comes (crashed)
    with pytest.raises(TimeoutError, match="no anchor stage 0 opened"):
        A.claim_generation(store, 2, 0.5, secret=key)  # generation 1's slot 2 is taken
    assert A.claim_generation(store, 0, 1, secret=key) == 2
    assert A.claim_generation(store, 2, 1, secret=key) == 2
    # row 3 (stage 1 of row 2 never claimed): every stage lands in generation 3
    assert A.claim_generation(store, 0, 1, secret=key) == 3
    assert [A.claim_generation(store, s, 1, secret=key) for s in (2, 1)] == [3, 3]
