"""What elastic replicas need from the algorithm's state (single process, world 1):

- ``Compressor.clear_error_feedback``: PowerSGD keeps its warm-start Q and restarts its
  error at zero (a later round equals a fresh compressor given only that Q); SparseLoCo and
  int8 drop their whole state (it is all error feedback);
- ``Compressor.reset_stream``: the next round of that stream equals a fresh compressor's
  first round, other streams are untouched;
- ``Compressor.stream_state_dict`` / ``load_stream_state_dict``: one stream's state moves
  to another compressor (a heal by sync segment), which then runs that stream as the
  source does and keeps its own other streams;
- ``StreamingDiLoCo.recover``: after a sync failed in flight, nothing is merged, the
  fragment's compressor stream restarts and the instance is usable again;
- ``StreamingDiLoCo.adopt_peer_parameters``: a replica that took a peer's state and
  parameters sends, at its next sync of each fragment, only its own progress since (the
  peer's unsynced progress is not averaged in twice), and its error feedback is zero;
- the torchft-group rank rule of meshkern.compress.base;
- ElasticGate's records under DiLoCo: a step whose sync failed is uncommitted until a commit.
"""
import concurrent.futures as cf

import pytest
import torch

import dp_helpers as H
from meshkern.compress import Int8, NoCompression, PowerSGD, SparseLoCo, SyncError
from meshkern.compress.base import _group_size_rank
from meshkern.diloco import StreamingDiLoCo


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    with H.world1_group(str(tmp_path_factory.mktemp("pg"))):
        yield


def _grads(seed, shapes=((16, 12), (8, 8), (5,))):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


def test_powersgd_clear_error_feedback_keeps_q_and_zeroes_the_error(world1):
    c = PowerSGD(rank=2)
    c.all_reduce_mean(_grads(0), key="k")
    c.all_reduce_mean(_grads(1), key="k")
    state = c.state_dict()["state"]["k"]
    assert all("err" in st and st["err"].abs().sum() > 0 for st in state.values())
    c.clear_error_feedback()
    kept = c.state_dict()["state"]["k"]
    assert all("err" not in st for st in kept.values())
    for g, st in state.items():
        assert torch.equal(kept[g]["q"], st["q"])
    # reference: a fresh compressor that holds only those Qs (zero error)
    ref = PowerSGD(rank=2)
    ref.load_state_dict({**c.state_dict(), "state": {"k": {g: {"q": st["q"]} for g, st in state.items()}}})
    for a, b in zip(c.all_reduce_mean(_grads(2), key="k"), ref.all_reduce_mean(_grads(2), key="k")):
        assert torch.equal(a, b)


@pytest.mark.parametrize("make", [lambda: SparseLoCo(), lambda: Int8()], ids=["sparseloco", "int8"])
def test_error_feedback_only_compressors_drop_their_state(world1, make):
    c = make()
    c.all_reduce_mean(_grads(0), key="k")
    assert c.state_dict()["state"]
    c.clear_error_feedback()
    assert not c.state_dict()["state"]
    fresh = make()
    for a, b in zip(c.all_reduce_mean(_grads(1), key="k"), fresh.all_reduce_mean(_grads(1), key="k")):
        assert torch.equal(a, b)


@pytest.mark.parametrize("make", [lambda: PowerSGD(rank=2), lambda: SparseLoCo(), lambda: Int8()],
                         ids=["powersgd", "sparseloco", "int8"])
def test_one_streams_state_moves_to_another_compressor_alone(world1, make):
    src, dst = make(), make()
    for step in range(3):
        src.all_reduce_mean(_grads(step), key="seg0")
        dst.all_reduce_mean(_grads(20 + step), key="seg0")
        dst.all_reduce_mean(_grads(40 + step), key="seg1")
    keep = dst.stream_state_dict("seg1")
    assert src.stream_state_dict("seg1") is None  # a stream never run has no state
    dst.load_stream_state_dict("seg0", src.stream_state_dict("seg0"))
    later = _grads(9)
    for a, b in zip(dst.all_reduce_mean(later, key="seg0"), src.all_reduce_mean(later, key="seg0")):
        assert torch.equal(a, b)  # seg0 now runs as the source's does
    assert _same_state(dst.stream_state_dict("seg0"), src.stream_state_dict("seg0"))
    # seg1 was not touched: it runs on as a compressor that only ever had dst's seg1 history
    ref = make()
    ref.load_stream_state_dict("seg1", keep)
    for a, b in zip(dst.all_reduce_mean(_grads(3), key="seg1"), ref.all_reduce_mean(_grads(3), key="seg1")):
        assert torch.equal(a, b)
    dst.load_stream_state_dict("seg1", None)
    assert dst.stream_state_dict("seg1") is None and dst.stream_state_dict("seg0") is not None


def _same_state(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    return torch.equal(a, b)


def test_reset_stream_restarts_one_stream_only(world1):
    c = PowerSGD(rank=2)
    for step in range(3):
        c.all_reduce_mean(_grads(step), key="a")
        c.all_reduce_mean(_grads(10 + step), key="b")
    b_before = c.state_dict()["state"]["b"]
    c.reset_stream("a")
    assert "a" not in c.state_dict()["state"]
    assert all(torch.equal(b_before[g]["q"], st["q"]) for g, st in c.state_dict()["state"]["b"].items())
    fresh = PowerSGD(rank=2)
    for x, y in zip(c.all_reduce_mean(_grads(7), key="a"), fresh.all_reduce_mean(_grads(7), key="a")):
        assert torch.equal(x, y)


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((12, 10), (6, 6), (7,))]


def _drift(params, step):
    with torch.no_grad():
        for i, p in enumerate(params):
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i)))


def test_recover_after_a_failed_sync_merges_nothing_and_stays_usable(world1):
    params = _params()
    d = StreamingDiLoCo(params, None, sync_every=4, num_fragments=2, overlap_steps=1, compressor=PowerSGD(rank=2))
    for t in range(1, 3):  # fragment 0 starts a sync at step 2 (in flight, overlap 1)
        _drift(params, t)
        d.step()
    assert d.in_flight
    glob = [g.clone() for g in d._global]
    before = [p.detach().clone() for p in params]
    failed: cf.Future = cf.Future()
    failed.set_exception(SyncError("peer died"))
    due, f, start, _ = d._pending[0]
    d._pending[0] = (due, f, start, failed)  # the sync in flight failed
    with pytest.raises(SyncError):
        _drift(params, 3)
        d.step()
    assert d.recover() == [0]
    assert not d.in_flight
    assert all(torch.equal(a, b) for a, b in zip(d._global, glob))  # nothing merged
    assert "fragment0" not in d.compressor.state_dict()["state"]  # the half-updated stream restarts
    assert not torch.equal(params[0].detach(), before[0])  # the local step after the failure stands
    for t in range(4, 9):  # usable again: later syncs run and merge
        _drift(params, t)
        d.step()
    assert d.syncs_done >= 2


class _Spy(NoCompression):
    """Records what each sync hands to the compressor."""

    def __init__(self):
        super().__init__()
        self.sent = []

    def _all_reduce_mean(self, tensors, group, world, key):
        self.sent.append((key, [t.clone() for t in tensors]))
        return super()._all_reduce_mean(tensors, group, world, key)


def test_a_replica_that_adopts_a_peers_parameters_sends_only_its_own_progress(world1):
    peer_params = _params(1)
    peer = StreamingDiLoCo(peer_params, None, sync_every=4, num_fragments=2, overlap_steps=0, compressor=PowerSGD(rank=2))
    for t in range(1, 8):  # syncs ran; the peer holds unsynced progress now
        _drift(peer_params, t)
        peer.step()
    assert not peer.in_flight
    me_params = _params(2)
    # overlap 0: each sync runs inside step(), so the spy sees it before the next drift
    me = StreamingDiLoCo(me_params, None, sync_every=4, num_fragments=2, overlap_steps=0, compressor=_Spy())
    state = peer.state_dict()
    state["compressor"] = _Spy().state_dict()
    me.load_state_dict(state)
    with torch.no_grad():
        for m, p in zip(me_params, peer_params):
            m.copy_(p)
    at_heal = [p.detach().clone() for p in me_params]
    assert any(not torch.equal(g, p) for g, p in zip(me._global, at_heal))  # the peer's unsynced progress
    me.adopt_peer_parameters()
    seen = {}
    for t in range(8, 14):  # its own steps; each fragment's next sync must carry them alone
        _drift(me_params, 100 + t)
        before = [p.detach().clone() for p in me_params]  # what the sync starting in this step reads
        n = len(me.compressor.sent)
        me.step()
        for key, sent in me.compressor.sent[n:]:
            f = int(key[len("fragment"):])
            # the first sync of f after the heal: minus this replica's own progress since the
            # heal, nothing of the peer's (a plain replica would send global - params)
            seen.setdefault(f, all(torch.allclose(x, at_heal[i] - before[i], atol=1e-6)
                                   for x, i in zip(sent, me.fragments[f])))
    assert seen == {0: True, 1: True}
    assert me._adopted == {}  # used once per fragment


def test_adopt_zeroes_error_feedback_and_keeps_the_shared_q(world1):
    params = _params(3)
    d = StreamingDiLoCo(params, None, sync_every=2, num_fragments=1, compressor=PowerSGD(rank=2))
    for t in range(1, 6):
        _drift(params, t)
        d.step()
    qs = {g: st["q"].clone() for g, st in d.compressor.state_dict()["state"]["fragment0"].items()}
    d.adopt_peer_parameters()
    kept = d.compressor.state_dict()["state"]["fragment0"]
    assert all("err" not in st for st in kept.values())
    assert all(torch.equal(kept[g]["q"], q) for g, q in qs.items())


def test_group_rank_of_a_group_torch_distributed_does_not_register(world1):
    class Unregistered:  # what a torchft process group looks like to the compressors
        meshkern_rank = staticmethod(lambda: 0)

        def size(self):
            return 1

    with pytest.raises((ValueError, RuntimeError)):
        torch.distributed.get_rank(Unregistered())
    import torch.distributed as dist

    orig = dist.get_world_size
    try:
        dist.get_world_size = lambda group=None: group.size() if isinstance(group, Unregistered) else orig(group)
        assert _group_size_rank(Unregistered()) == (1, 0)
    finally:
        dist.get_world_size = orig


class _Replica:
    """What ElasticGate asks of its ElasticReplica in a step: failures, commits, records."""
    def __init__(self):
        self.records, self.errors, self.commits = [], [], []

    def failed(self, err):
        self.errors.append(err)

    def commit(self):  # torchft's should_commit: False after a failure since the last commit
        ok = not self.errors
        self.errors.clear()
        self.commits.append(ok)
        return ok

    def record(self, step, committed, quorum):
        self.records.append((step + 1, committed, quorum))


class _Sync:
    allreduce, diloco = None, ()

    def __init__(self):
        self.recovered = 0

    def recover(self):
        self.recovered += 1


def test_a_diloco_step_whose_sync_failed_is_recorded_uncommitted_until_a_commit():
    """DiLoCo: a step without a quorum keeps the last commit's outcome, except that a sync
    failing on this rank (a peer or the link gone mid-collective) marks that step and the
    ones after it uncommitted, until the next quorum's commit (which that failure refuses)
    and the one after it succeeds. Seen on two hosts: a link cut inside a sync that a
    sibling stage had finished left this stage's step "committed" with the state before it."""
    from orchestration.elastic.gate import ElasticGate
    gate, r, sync = object.__new__(ElasticGate), _Replica(), _Sync()
    gate.replica, gate.committed, gate._quorum, gate.retried = r, True, False, 0

    def broken_sync():
        raise SyncError("peer gone mid-sync")

    def step(n, quorum, fails=False):
        gate._quorum = quorum
        gate.sync(broken_sync if fails else (lambda: None), sync)
        assert gate.end_step(n, sync)  # diloco: a step never runs again

    step(0, True)
    step(1, False)
    step(2, False, fails=True)
    step(3, False)
    step(4, True)  # the failure reaches torchft here: no commit
    step(5, False)
    step(6, True)
    step(7, False)
    assert r.records == [(1, True, True), (2, True, False), (3, False, False), (4, False, False),
                         (5, False, True), (6, False, False), (7, True, True), (8, True, False)]
    assert r.commits == [True, False, True] and sync.recovered == 1
