"""Streaming DiLoCo: single-process semantics (world 1) and spawned gloo ranks.

- schedule, overlap, mix and outer Nesterov step vs an independent reference loop;
- H=1, F=1, no overlap, no compression on 3 ranks == synchronous DP with the same
  outer optimizer (single-process reference with 3 model replicas);
- tiny Llama: fragments + overlap + PowerSGD trains to within the stated tolerance of
  synchronous DP on the same budget;
- a peer that dies or hangs mid-sync: SyncError within the timeout, nothing merged;
- checkpoint/resume reproduces an uninterrupted run; non-finite averages are skipped.
"""
import io

import pytest
import torch

import dp_helpers as H
from meshkern.compress import NoCompression, PowerSGD, SparseLoCo
from meshkern.diloco import StreamingDiLoCo


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    with H.world1_group(str(tmp_path_factory.mktemp("pg"))):
        yield


def _updates(step, shapes):
    g = torch.Generator().manual_seed(step)
    return [0.1 * torch.randn(s, generator=g) for s in shapes]


@pytest.mark.parametrize("H_,F_,tau,mix", [(4, 2, 1, 0.5), (6, 3, 2, 0.7), (3, 1, 0, 1.0)])
def test_schedule_overlap_mix_match_reference(world1, H_, F_, tau, mix):
    shapes = [(4, 3), (5,), (2, 2), (3, 3)]
    params = [torch.zeros(s) for s in shapes]
    dl = StreamingDiLoCo(params, None, sync_every=H_, num_fragments=F_, overlap_steps=tau, mix=mix,
                         outer_lr=0.7, outer_momentum=0.9)
    # reference: world 1, so the averaged pseudo-gradient is the local one
    ref = [torch.zeros(s) for s in shapes]
    glob = [torch.zeros(s) for s in shapes]
    mom = [None] * len(shapes)
    pending = []
    for t in range(1, 4 * H_ + 1):
        for p, r, u in zip(params, ref, _updates(t, shapes)):
            p.add_(u)
            r.add_(u)
        dl.step()
        for f, frag in enumerate(dl.fragments):
            if t % H_ == ((f + 1) * H_ // F_) % H_:
                pending.append((t + tau, frag, [glob[i] - ref[i] for i in frag]))
        for due, frag, delta in [j for j in pending if j[0] == t]:
            pending.remove((due, frag, delta))
            for i, d in zip(frag, delta):
                mom[i] = d.clone() if mom[i] is None else 0.9 * mom[i] + d
                glob[i] = glob[i] - 0.7 * (d + 0.9 * mom[i])  # Nesterov
                ref[i] = mix * glob[i] + (1 - mix) * ref[i]
        for p, r in zip(params, ref):
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {t}: {m}")
    dl.finish()
    assert dl.syncs_done == len(dl.history) == 4 * F_
    assert sorted({h["fragment"] for h in dl.history}) == list(range(F_))
    assert sum(h["bytes_sent"] for h in dl.history) == dl.bytes_sent == 0  # world 1 sends nothing
    assert dl.compressor.payload_bytes == 4 * 4 * sum(torch.Size(s).numel() for s in shapes)


def test_fragments_are_contiguous_balanced_and_cover_everything():
    params = [torch.zeros(n) for n in (100, 10, 10, 80, 5, 95)]
    dl = StreamingDiLoCo(params, None, sync_every=8, num_fragments=3, compressor=NoCompression())
    assert [i for f in dl.fragments for i in f] == list(range(6))
    assert all(dl.fragments)
    assert dl.offsets == [2, 5, 0]


def test_bad_arguments_raise_clear_errors():
    p = [torch.zeros(3, requires_grad=True)]
    with pytest.raises(ValueError, match="sync_every"):
        StreamingDiLoCo(p, sync_every=0)
    with pytest.raises(ValueError, match="num_fragments"):
        StreamingDiLoCo(p, sync_every=4, num_fragments=2)
    with pytest.raises(ValueError, match="overlap_steps"):
        StreamingDiLoCo(p, sync_every=2, overlap_steps=2)
    with pytest.raises(TypeError, match="floating"):
        StreamingDiLoCo([torch.zeros(3, dtype=torch.long)])
    with pytest.raises(ValueError, match="mix"):
        StreamingDiLoCo(p, sync_every=2, mix=0.0)
    with pytest.raises(TypeError, match="Compressor"):
        StreamingDiLoCo(p, compressor=object())
    assert StreamingDiLoCo(p, compressor=SparseLoCo())._outer.defaults["momentum"] == 0.0
    assert StreamingDiLoCo(p)._outer.defaults["momentum"] == 0.9


def _train(dl, params, steps, start):
    for t in range(start, start + steps):
        for p, u in zip(params, _updates(t, [p.shape for p in params])):
            p.add_(u + 0.05 * p)  # state-dependent, so divergence would show
        dl.step()


def test_checkpoint_resume_reproduces_uninterrupted_run(world1):
    shapes = [(16, 12), (12,), (12, 8)]
    mk = lambda ps: StreamingDiLoCo(ps, None, sync_every=2, num_fragments=2,  # noqa: E731
                                    compressor=PowerSGD(2, min_compression_rate=1.0, seed=3))
    a = [torch.zeros(s) for s in shapes]
    da = mk(a)
    _train(da, a, 7, 1)
    buf = io.BytesIO()
    torch.save(da.state_dict(), buf)
    saved = [p.clone() for p in a]
    _train(da, a, 6, 8)

    b = [p.clone() for p in saved]
    db = mk(b)
    buf.seek(0)
    db.load_state_dict(torch.load(buf, weights_only=True))
    _train(db, b, 6, 8)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert (da.step_count, da.syncs_done, da.compressor.payload_bytes) == \
           (db.step_count, db.syncs_done, db.compressor.payload_bytes)
    with pytest.raises(ValueError, match="different parameters"):
        StreamingDiLoCo([torch.zeros(3)], None, sync_every=2, num_fragments=1).load_state_dict(da.state_dict())


def test_non_finite_average_is_skipped_and_state_kept(world1):
    p = [torch.zeros(4), torch.zeros(3)]
    dl = StreamingDiLoCo(p, None, sync_every=1)
    p[0].add_(1.0)
    dl.step()
    glob = [g.clone() for g in dl._global]
    p[1][0] = float("nan")
    with pytest.warns(RuntimeWarning, match="non-finite"):
        dl.step()
    assert dl.syncs_skipped == 1 and dl.history[-1]["merged"] is False
    assert all(torch.equal(g, h) for g, h in zip(dl._global, glob))


def test_state_dict_saves_syncs_in_flight_and_a_restore_merges_them_on_time(world1):
    """A checkpoint mid-sync neither merges early nor loses the sync: the restored
    instance merges it at its due step, exactly as the uninterrupted one (issue #14)."""
    def run(interrupt_at=None, steps=6):
        torch.manual_seed(0)
        p = [torch.zeros(4), torch.zeros(3)]
        dl = StreamingDiLoCo(p, None, sync_every=2, overlap_steps=1)
        for t in range(1, steps + 1):
            with torch.no_grad():
                for q in p:
                    q.add_(torch.randn(q.shape))
            dl.step()
            if t == interrupt_at:
                assert dl._pending  # a sync is in flight
                buf = io.BytesIO()
                torch.save(dl.state_dict(), buf)
                sd_live = dl.state_dict()
                new_p = [q.clone() for q in p]
                dl = StreamingDiLoCo(new_p, None, sync_every=2, overlap_steps=1)
                buf.seek(0)
                dl.load_state_dict(torch.load(buf, weights_only=True))
                p = new_p
                assert all(torch.equal(a, b) for a, b in zip(sd_live["global"], dl._global))
        return [q.clone() for q in p], dl.syncs_done

    full, done = run()
    resumed, done2 = run(interrupt_at=4)
    assert done == done2 == 2  # merged at steps 3 and 5 (the one started at 4 was in flight at the save)
    assert all(torch.equal(a, b) for a, b in zip(full, resumed))


def test_state_dict_returns_copies(world1):
    p = [torch.zeros(4)]
    dl = StreamingDiLoCo(p, None, sync_every=1, outer_momentum=0.9)
    p[0].add_(1.0)
    dl.step()
    sd = dl.state_dict()
    before = [g.clone() for g in sd["global"]], [v.clone() for v in sd["outer"]["state"][0].values()
                                                if isinstance(v, torch.Tensor)]
    p[0].add_(1.0)
    dl.step()
    assert all(torch.equal(a, b) for a, b in zip(before[0], sd["global"]))
    assert all(torch.equal(a, b) for a, b in zip(before[1], [v for v in sd["outer"]["state"][0].values()
                                                            if isinstance(v, torch.Tensor)]))


# ---- spawned gloo ranks -------------------------------------------------------------------------
@pytest.mark.slow
def test_h1_f1_matches_synchronous_dp_with_outer_optimizer(tmp_path):
    world, steps = 3, 5
    codes = H.spawn(H.diloco_equiv_worker, world, str(tmp_path), steps, timeout=300)
    assert codes == [0] * world
    # single-process reference: 3 replicas with their own AdamW, averaged every step
    # through the same outer Nesterov SGD (lr 0.7, momentum 0.9)
    models = [H.tiny_mlp() for _ in range(world)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    glob = [p.detach().clone() for p in models[0].parameters()]
    outer = torch.optim.SGD(glob, lr=0.7, momentum=0.9, nesterov=True)
    for t in range(steps):
        for r, (m, o) in enumerate(zip(models, opts)):
            x, y = H.mlp_batch(r, t)
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
        with torch.no_grad():
            for i, g in enumerate(glob):
                g.grad = sum(g - list(m.parameters())[i] for m in models) / world
            outer.step()
            for m in models:
                for p, g in zip(m.parameters(), glob):
                    p.copy_(g)
    expect = models[0].state_dict()
    numel = sum(p.numel() for p in models[0].parameters())
    for r in range(world):
        got = H.load(str(tmp_path / f"rank{r}.safetensors"))
        for k, v in expect.items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)
        assert int(got["counters"][2]) == steps
    sent = sum(int(H.load(str(tmp_path / f"rank{r}.safetensors"))["counters"][0]) for r in range(world))
    assert sent == steps * 2 * (world - 1) * numel * 4  # ring all-reduce of fp32 pseudo-gradients


# Stated tolerance: after the same 60-step budget on 2 ranks, Streaming DiLoCo (H=8,
# F=2, overlap 1 step, mix 0.5, PowerSGD rank 8: ~4.7x fewer bytes per sync, 8x fewer
# syncs than DP's per-step all-reduce) reaches an eval loss within 15% of synchronous
# DP's (measured: 1.863 vs 1.705, +9.2%; initial 4.85, floor ln 4 = 1.39), and both learn.
# (Without compression the same schedule reaches 1.686, slightly below synchronous DP.)
LLAMA_TOL = 0.15


@pytest.mark.slow
def test_streaming_diloco_powersgd_trains_tiny_llama_close_to_sync_dp(tmp_path):
    world, steps, H_ = 2, 60, 8
    kw = dict(sync_every=H_, num_fragments=2, overlap_steps=1, rank=8)
    codes = H.spawn(H.llama_worker, world, str(tmp_path), steps, kw, timeout=480)
    assert codes == [0] * world
    res = [H.load(str(tmp_path / f"rank{r}.safetensors")) for r in range(world)]
    init, sync, dil = float(res[0]["initial"]), float(res[0]["sync"]), float(res[0]["diloco"])
    assert sync < 0.5 * init and dil < 0.5 * init, (init, sync, dil)
    assert dil <= sync * (1 + LLAMA_TOL), (init, sync, dil)
    # synchronous DP keeps replicas identical
    torch.testing.assert_close(res[0]["sync.params"], res[1]["sync.params"])
    sent, received, syncs = (int(v) for v in res[0]["bytes"])
    assert syncs == sum(1 for t in range(1, steps + 1) for off in (H_ // 2, 0) if t % H_ == off)
    assert sent == received > 0
    dense_per_sync = int(res[0]["dense_bytes"]) / 2  # half the model per fragment; world-2 ring sends the payload
    assert sent < syncs * dense_per_sync / 4  # PowerSGD rank 8: more than 4x below dense per sync


@pytest.mark.slow
@pytest.mark.parametrize("how", ["die", "hang"])
def test_peer_failing_mid_sync_raises_in_time_and_nothing_is_merged(tmp_path, how):
    codes = H.spawn(H.dying_peer_worker, 2, str(tmp_path), how, timeout=300)
    assert codes[0] == 0
    res = H.load(str(tmp_path / "rank0.safetensors"))
    assert int(res["raised"]) == 1
    # compressor timeout 10 s (not less: a loaded 2-core CI machine can skew ranks by
    # seconds); gloo's own is 120 s and the hung peer waits until rank 0 has reported,
    # so only our timeout can end rank 0's wait
    assert float(res["elapsed"]) < 60.0
    assert all(int(v) == 1 for k, v in res.items() if k.startswith("same."))
    assert int(res["usable_after"]) == 0
    msg = open(tmp_path / "error.txt").read()
    assert "fragment 0" in msg and "step 5" in msg and "failed" in msg
