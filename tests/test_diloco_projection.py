"""Streaming DiLoCo with subspace-constrained weights (issue #16, item 3).

Weights named ``*o_proj.weight`` / ``*down_proj.weight`` ([H, in]) must keep their
columns in span(U) (U [H, k] orthonormal): W = U U^T W. The projector under test is the
plain P(W) = U (U^T W) written here; the reference loops below are written
independently of StreamingDiLoCo (and of SparseLoCo.project_error's slicing).

- argument checks: unknown / repeated steps, a projection without a projector, "error"
  with a compressor that has no error buffer, a projector of the wrong shape;
- world 1: "outer" / "reproject" / "outer+error" against reference loops; unconstrained
  parameters bit-identical to projector=None under every projection;
- checkpoint: the projection is saved, a mismatch refused, a resume exact;
- 3 spawned gloo ranks training a constrained toy model with SparseLoCo: after every
  merge, every constrained weight (local and global copy) is in the subspace to 1e-5
  (relative) under "outer", "reproject", "outer+error", "error+reproject"; under "none"
  and "error" alone it is not (> 1e-3), so the check can fail.
"""
import io
import os

import pytest
import torch

import dp_helpers as H
from meshkern.compress import NoCompression, PowerSGD, SparseLoCo
from meshkern.compress.packing import from_chunks, to_chunks
from meshkern.diloco import StreamingDiLoCo, parse_projection

torch.set_num_threads(1)

CONSTRAINED = ("o_proj.weight", "down_proj.weight")


def basis(h: int, k: int, seed: int = 5) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(h, k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return q.to(torch.float32)


def make_projector(U: torch.Tensor):
    def projector(name, t):
        if name.endswith(CONSTRAINED):
            return U @ (U.T @ t)
        return t
    return projector


def violation(W: torch.Tensor, U: torch.Tensor) -> float:
    """||W - U U^T W|| / ||W|| in fp64."""
    W, U = W.detach().double(), U.double()
    return float((W - U @ (U.T @ W)).norm() / W.norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    with H.world1_group(str(tmp_path_factory.mktemp("pg"))):
        yield


# ---- arguments -------------------------------------------------------------------------------
def test_parse_projection():
    assert parse_projection("none") == ()
    assert parse_projection("error+outer") == ("outer", "error")
    assert parse_projection("reproject+error+outer") == ("outer", "error", "reproject")
    for bad in ("", "outer+", "outer+outer", "project", "none+outer", "Outer"):
        with pytest.raises(ValueError, match="projection"):
            parse_projection(bad)
    with pytest.raises(TypeError, match="projection"):
        parse_projection(None)


def test_bad_projection_arguments_raise_clear_errors():
    U = basis(6, 2)
    named = [("l.o_proj.weight", torch.zeros(6, 4)), ("l.bias", torch.zeros(6))]
    P = make_projector(U)
    with pytest.raises(ValueError, match="needs a projector"):
        StreamingDiLoCo(named, sync_every=2, projection="outer")
    with pytest.raises(TypeError, match="callable"):
        StreamingDiLoCo(named, sync_every=2, projector=U, projection="outer")
    with pytest.raises(ValueError, match="projection"):
        StreamingDiLoCo(named, sync_every=2, projector=P, projection="outer+bogus")
    for comp in (NoCompression(), PowerSGD(2)):
        with pytest.raises(ValueError, match="error-feedback"):
            StreamingDiLoCo(named, sync_every=2, projector=P, projection="error", compressor=comp)
    # a projector of the wrong shape (here: the coordinates U^T W instead of U U^T W) is
    # refused at construction, naming the parameter
    with pytest.raises(ValueError, match=r"projector returned shape \(2, 4\) for parameter 'l.o_proj.weight'"):
        StreamingDiLoCo(named, sync_every=2, compressor=SparseLoCo(),
                        projector=lambda n, t: U.T @ t if n.endswith(CONSTRAINED) else t, projection="outer+error")
    with pytest.raises(ValueError, match="must return a tensor"):
        StreamingDiLoCo(named, sync_every=2, projector=lambda n, t: None, projection="reproject")
    # accepted: canonical name; projector=None or projection="none" leave everything off
    dl = StreamingDiLoCo(named, sync_every=2, compressor=SparseLoCo(), projector=P, projection="error+outer")
    assert dl.projection == "outer+error"
    assert StreamingDiLoCo(named, sync_every=2, projector=P).projector is None


def test_sparseloco_project_error_slices_per_tensor(world1):
    """project_error hands fn each tensor's part of the chunked accumulator, in order,
    and writes the result back; padding stays zero."""
    shapes = [(3, 5), (7,), (2, 2)]  # 26 elements, chunk 8: 4 chunks, 6 padding
    comp = SparseLoCo(0.25, chunk=8)
    x = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
    comp.all_reduce_mean(x, None, key="k")
    before = from_chunks(comp._state["k"].clone(), x)
    seen = []

    def fn(j, e):
        seen.append(j)
        torch.testing.assert_close(e, before[j], rtol=0, atol=0)
        return e * (j + 2)

    comp.project_error("k", shapes, fn)
    assert seen == [0, 1, 2]
    after = from_chunks(comp._state["k"], x)
    for j in range(3):
        assert torch.equal(after[j], before[j] * (j + 2))
    assert torch.equal(comp._state["k"].view(-1)[26:], torch.zeros(6))
    comp.project_error("missing", shapes, fn)  # no state yet: nothing to do
    with pytest.raises(ValueError, match="same shape"):
        comp.project_error("k", shapes, lambda j, e: e[:1])
    with pytest.raises(ValueError, match="chunks"):
        comp.project_error("k", [(100,)], fn)


# ---- world 1: semantics against reference loops ------------------------------------------------
SHAPES = [("a.o_proj.weight", (8, 6)), ("a.norm", (8,)), ("b.down_proj.weight", (8, 16)), ("b.up", (16, 8))]


def _start(U, seed=0):
    """Parameters with the constrained ones in span(U)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, s in SHAPES:
        t = torch.randn(s, generator=g)
        out.append(U @ (U.T @ t) if name.endswith(CONSTRAINED) else t)
    return out


def _inner(t, params, U, constrained=True):
    """A deterministic, state-dependent 'inner step' that never mixes parameters and,
    if ``constrained``, keeps the constrained ones in span(U) (as a constrained inner
    optimizer does)."""
    g = torch.Generator().manual_seed(100 + t)
    with torch.no_grad():
        for (name, _), p in zip(SHAPES, params):
            u = 0.1 * torch.randn(p.shape, generator=g) - 0.05 * p
            p.add_(U @ (U.T @ u) if constrained and name.endswith(CONSTRAINED) else u)


def test_outer_and_reproject_match_reference_loop(world1):
    """NoCompression on world 1, outer momentum 0.9 Nesterov: "outer" applies P(avg)
    through the momentum; "reproject" applies avg, then projects theta_g and the mixed
    local copy. The inner steps here leave the subspace, so every projection matters."""
    U = basis(8, 3)
    P = make_projector(U)
    for projection in ("outer", "reproject", "outer+reproject"):
        params = _start(U)
        dl = StreamingDiLoCo(list(zip([n for n, _ in SHAPES], params)), None, sync_every=3, num_fragments=2,
                             overlap_steps=1, mix=0.5, outer_lr=0.7, outer_momentum=0.9,
                             projector=P, projection=projection)
        ref = [p.clone() for p in params]
        glob = [p.clone() for p in params]
        mom = [None] * len(SHAPES)
        pending = []
        for t in range(1, 13):
            _inner(t, params, U, constrained=False)
            _inner(t, ref, U, constrained=False)
            dl.step()
            for f, frag in enumerate(dl.fragments):
                if t % 3 == ((f + 1) * 3 // 2) % 3:
                    pending.append((t + 1, frag, [glob[i] - ref[i] for i in frag]))
            for job in [j for j in pending if j[0] == t]:
                pending.remove(job)
                for i, d in zip(job[1], job[2]):
                    name = SHAPES[i][0]
                    if "outer" in projection:
                        d = P(name, d)
                    mom[i] = d.clone() if mom[i] is None else 0.9 * mom[i] + d
                    glob[i] = glob[i] - 0.7 * (d + 0.9 * mom[i])
                    if "reproject" in projection:
                        glob[i] = P(name, glob[i])
                    ref[i] = 0.5 * glob[i] + 0.5 * ref[i]
                    if "reproject" in projection:
                        ref[i] = P(name, ref[i])
            for p, r in zip(params, ref):
                torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6, msg=lambda m: f"{projection} step {t}: {m}")
        assert dl.syncs_done == 7  # 8 started, the one of step 12 still in flight


def test_error_projection_matches_reference_sparseloco(world1):
    """"outer+error" with SparseLoCo on world 1 == a bare SparseLoCo whose accumulator
    and input are projected by the test's own chunk slicing before every call, and whose
    average is projected before the (momentum-free) outer step."""
    U = basis(8, 3)
    P = make_projector(U)
    names = [n for n, _ in SHAPES]
    params = _start(U)
    dl = StreamingDiLoCo(list(zip(names, params)), None, sync_every=2, compressor=SparseLoCo(1 / 8, chunk=16),
                         projector=P, projection="outer+error")
    ref_comp = SparseLoCo(1 / 8, chunk=16)
    ref = [p.clone() for p in params]
    glob = [p.clone() for p in params]
    for t in range(1, 13):
        _inner(t, params, U)
        _inner(t, ref, U)
        dl.step()
        if t % 2 == 0:
            delta = [P(n, g - r) for n, g, r in zip(names, glob, ref)]
            if "fragment0" in ref_comp._state:
                e = from_chunks(ref_comp._state["fragment0"], delta)
                ref_comp._state["fragment0"] = to_chunks([P(n, x) for n, x in zip(names, e)], 16)[0]
            avg = ref_comp.all_reduce_mean(delta, None, key="fragment0")
            glob = [g - 0.7 * P(n, a) for n, g, a in zip(names, glob, avg)]
            ref = [g.clone() for g in glob]
        for p, r in zip(params, ref):
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {t}: {m}")
    assert dl.syncs_done == 6


@pytest.mark.parametrize("projection", ["outer", "error", "reproject", "outer+error", "outer+error+reproject"])
def test_unconstrained_params_bit_identical_to_no_projector(world1, projection):
    """Unconstrained parameters never see the projector: bit-identical to a run without
    one (chunk 8 divides every tensor's size, so no SparseLoCo chunk mixes a constrained
    and an unconstrained tensor)."""
    U = basis(8, 3)

    def run(projector, proj):
        params = _start(U)
        dl = StreamingDiLoCo(list(zip([n for n, _ in SHAPES], params)), None, sync_every=3, num_fragments=2,
                             overlap_steps=1, compressor=SparseLoCo(1 / 4, chunk=8), projector=projector,
                             projection=proj)
        for t in range(1, 16):
            _inner(t, params, U)
            dl.step()
        dl.finish()
        return params, dl

    base, dl0 = run(None, "none")
    got, dl1 = run(make_projector(U), projection)
    assert dl0.syncs_done == dl1.syncs_done == 10
    for (name, _), a, b in zip(SHAPES, base, got):
        if name.endswith(CONSTRAINED):
            if projection != "error":  # the error buffer alone does not keep the constraint
                assert violation(b, U) < 1e-5, name
        else:
            assert torch.equal(a, b), name
    assert violation(base[0], U) > 1e-3  # the constrained ones did leave the subspace without it


def test_state_dict_saves_projection_and_resume_is_exact(world1):
    U = basis(8, 3)
    names = [n for n, _ in SHAPES]

    def mk(ps, projection="outer+error"):
        return StreamingDiLoCo(list(zip(names, ps)), None, sync_every=2, num_fragments=2, overlap_steps=1,
                               compressor=SparseLoCo(1 / 4, chunk=8), projector=make_projector(U),
                               projection=projection)

    a = _start(U)
    da = mk(a)
    for t in range(1, 8):
        _inner(t, a, U)
        da.step()
    buf = io.BytesIO()
    torch.save(da.state_dict(), buf)
    saved = [p.clone() for p in a]
    for t in range(8, 15):
        _inner(t, a, U)
        da.step()

    b = [p.clone() for p in saved]
    db = mk(b)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert sd["projection"] == "outer+error"
    db.load_state_dict(sd)
    for t in range(8, 15):
        _inner(t, b, U)
        db.step()
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    with pytest.raises(ValueError, match="projection='outer\\+error'"):
        mk([p.clone() for p in saved], "outer").load_state_dict(sd)
    plain = StreamingDiLoCo(list(zip(names, [p.clone() for p in saved])), None, sync_every=2, num_fragments=2,
                            overlap_steps=1, compressor=SparseLoCo(1 / 4, chunk=8))
    with pytest.raises(ValueError, match="projection"):
        plain.load_state_dict(sd)
    old = {k: v for k, v in plain.state_dict().items() if k != "projection"}  # pre-projection checkpoint
    plain.load_state_dict(old)


# ---- spawned gloo ranks: a constrained toy model ------------------------------------------------
HID, K = 16, 4
MODES = ["none", "outer", "error", "reproject", "outer+error", "error+reproject"]


class Toy(torch.nn.Module):
    """x [B, 8] -> residual stream [B, 16] written by o_proj and down_proj -> [B, 4]."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, HID)
        self.q = torch.nn.Linear(HID, HID)
        self.o_proj = torch.nn.Linear(HID, HID, bias=False)
        self.up = torch.nn.Linear(HID, 32)
        self.down_proj = torch.nn.Linear(32, HID, bias=False)
        self.head = torch.nn.Linear(HID, 4)

    def forward(self, x):
        h = self.embed(x)
        h = h + self.o_proj(torch.tanh(self.q(h)))
        h = h + self.down_proj(torch.tanh(self.up(h)))
        return self.head(h)


def constrained_worker(rank, world, port, outdir, steps):
    """For every mode: AdamW inner steps that re-project the constrained weights (the
    trainer's job), Streaming DiLoCo with SparseLoCo; records the largest relative
    out-of-subspace norm of every constrained weight (local and global copy) right after
    each merge, and the final parameters."""
    H.init(rank, world, port)
    U = basis(HID, K)
    P = make_projector(U)
    res = {}
    for mode in MODES:
        torch.manual_seed(0)
        model = Toy()
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(P(n, p))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        dl = StreamingDiLoCo(model.named_parameters(), None, sync_every=4, num_fragments=2, overlap_steps=1,
                             compressor=SparseLoCo(1 / 8, chunk=64), projector=P, projection=mode)
        worst, merges = 0.0, 0

        def check(n_hist):
            nonlocal worst, merges
            merges += len(dl.history) - n_hist
            if len(dl.history) > n_hist:
                for i, (n, p) in enumerate(zip(dl.names, dl.params)):
                    if n.endswith(CONSTRAINED):
                        worst = max(worst, violation(p, U), violation(dl._global[i], U))

        for t in range(steps):
            x, y = H.mlp_batch(rank, t)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(P(n, p))
            n_hist = len(dl.history)
            dl.step()
            check(n_hist)
        n_hist = len(dl.history)
        dl.finish()  # before the next mode's instance: one sync thread per process at a time
        check(n_hist)
        res[f"{mode}.worst"] = torch.tensor(worst, dtype=torch.float64)
        res[f"{mode}.merges"] = torch.tensor(merges)
        res[f"{mode}.global"] = torch.cat([g.reshape(-1) for g in dl._global])
    H.save(os.path.join(outdir, f"rank{rank}.safetensors"), res)
    H.shutdown()


@pytest.mark.slow
def test_constraint_kept_after_every_outer_step_on_three_ranks(tmp_path):
    world, steps = 3, 24
    codes = H.spawn(constrained_worker, world, str(tmp_path), steps, timeout=300)
    assert codes == [0] * world
    res = [H.load(str(tmp_path / f"rank{r}.safetensors")) for r in range(world)]
    for mode in MODES:
        assert int(res[0][f"{mode}.merges"]) == 12  # 6 per fragment: the check ran after every outer step
        for r in range(1, world):  # SparseLoCo averages are bitwise equal on every rank
            assert torch.equal(res[r][f"{mode}.global"], res[0][f"{mode}.global"]), mode
    worst = {m: float(res[0][f"{m}.worst"]) for m in MODES}
    for mode in ("outer", "reproject", "outer+error", "error+reproject"):
        assert worst[mode] <= 1e-5, worst
    # without a projection of the update the sparse pseudo-gradient leaves the subspace;
    # projecting only the error buffer is not enough (top-k of a subspace matrix is not in it)
    assert worst["none"] > 1e-3 and worst["error"] > 1e-3, worst
