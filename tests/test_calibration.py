"""orchestration.components.calibration: the pca codec's per-boundary basis, fitted from training
rows, the same on both sides of a boundary, counted once on the pp link."""
import json
import os

import pytest
import torch

from meshkern.mask import MaskKey
from orchestration import codecs
from orchestration.components import calibration
from orchestration.codecs import PCACodec, apply_codec


def test_codec_forward_equals_the_diagnose_sink_pca_int4_candidate():
    """The real codec with a fit_basis basis = diagnose's sink+pca-int4 (robust PCA, int4
    coordinates over their calibration std, position 0 as int8)."""
    from orchestration import diagnose as dg

    g = torch.Generator().manual_seed(0)
    H, k = 32, 10
    h_cal = torch.randn(8, 16, H, generator=g) @ torch.randn(H, H, generator=g) * 0.3 + 2.0
    h_cal[:, 0] *= 200  # attention-sink-like position 0: an outlier, left out of the fit either way
    h = torch.randn(3, 16, H, generator=g) @ torch.randn(H, H, generator=g) * 0.3 + 2.0
    h[:, 0] *= 200
    basis = calibration.fit_basis(h_cal, k, sink=True)
    codec = PCACodec(quant="absmax", bits=4, k=k, sink=True, bases={5: basis})
    out = apply_codec(codec, h, MaskKey(0, 5, 0, 0))
    rp = dg.calibrate(h_cal, torch.zeros_like(h_cal)).pca_robust
    ref = torch.cat([dg._quant(h[..., :1, :], 8), dg.pca_project(h[..., 1:, :], rp, k, bits=4)], dim=-2)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(basis.sd, rp.eigvals[:k].sqrt().float())


def test_gradient_std_and_rows_are_from_training_rows():
    H, k = 16, 4
    g = torch.Generator().manual_seed(1)
    h = torch.randn(4, 8, H, generator=g)
    grads = torch.randn(4, 8, H, generator=g)
    b = calibration.fit_basis(h, k, sink=False, grads=grads)
    c = grads.reshape(-1, H).double() @ b.U.double()
    torch.testing.assert_close(b.gsd, c.pow(2).mean(0).sqrt().float())
    rows = torch.arange(100).unsqueeze(1).repeat(1, 3)
    a, a2 = calibration.calibration_rows(rows, 10, seed=3), calibration.calibration_rows(rows, 10, seed=3)
    assert torch.equal(a, a2) and a.shape == (10, 3) and len(set(a[:, 0].tolist())) == 10


def run_pca_mesh(tiny, tmp_path, options: dict, rows: int, start: str = "fork", steps: int = 3):
    """A ``rows`` x 2 mesh of the tiny model trained ``steps`` steps with preset pca4 and
    --boundary.options ``options``: (cfg, plan, per-rank results)."""
    from orchestration.config import parse_args
    from orchestration.launch.processes import run_local
    from orchestration.distributed.mesh import MeshLayout
    from orchestration.train import prepare, run_rank

    argv = ["--model", str(tiny / "model"), "--data", str(tiny / "data.txt"), "--data.seq-len", "32",
            "--data.max-sequences", "200", "--train.batch-size", "4", "--train.microbatches", "2",
            "--run.out-dir", str(tmp_path), "--run.name", "t", "--run.progress", "false",
            "--run.eval-sequences", "4", "--mesh.timeout-s", "60", "--mesh.rows", str(rows), "--mesh.stages", "2",
            "--train.steps", str(steps), "--preset", "pca4", "--boundary.options", json.dumps(options),
            "--mesh.start-method", start]
    codecs.PCA_BASES.clear()
    try:
        cfg, _ = parse_args(argv)
        plan = prepare(cfg)
        lay = MeshLayout(cfg.mesh.rows, cfg.mesh.stages)
        res = run_local(run_rank, cfg.world_size, (cfg, plan), timeout_s=240, describe=lay.describe,
                        start_method=start)
    finally:
        codecs.PCA_BASES.clear()
    return cfg, plan, res


@pytest.mark.slow
@pytest.mark.parametrize("start,bwd", [("spawn", "span"), ("fork", "span"), ("fork", "gbasis")])
def test_pca_codec_trains_through_the_mesh(tiny, tmp_path, start, bwd):
    """2x2 mesh, pca codec: finite losses; the basis in RUN_DIR equals a fit on the run's
    training rows with the model as loaded; PP bytes = the codec's wire bytes per
    micro-batch + the basis once per boundary link (pp_fwd; with bwd=gbasis the gradient
    basis Ug too, and the backward's bytes are span's)."""
    from orchestration.models.loading import load_causal_lm

    cfg, plan, res = run_pca_mesh(tiny, tmp_path, {"quant": "absmax", "seq_len": 32, "calib_rows": 8, "bwd": bwd}, rows=2, start=start)
    assert all(l == l and l > 0 for l in res[1]["losses"])
    saved = calibration.load(plan.run_dir)
    model, _ = load_causal_lm(tiny / "model")
    fresh = calibration.bases_for_run(cfg, model, plan.train_rows)
    assert sorted(saved) == sorted(fresh) == [1]  # 4 layers in 2 stages: the boundary after layer 1
    for name in ("mean", "U", "sd", "gsd") + (("Ug",) if bwd == "gbasis" else ()):
        torch.testing.assert_close(getattr(saved[1], name), getattr(fresh[1], name), rtol=1e-4, atol=1e-5)
    assert (saved[1].Ug is None) == (bwd == "span")
    codec = calibration.codec_of(cfg)
    assert codec.width(40) == saved[1].k == 8  # B = 160 // 15 = 10: 2 for position 0, 4 for the scale, 4 B of int4
    per_mb = codec.wire_bytes((2, 32, 40), torch.float32, "fwd")
    assert per_mb == 2 * (44 + 31 * (4 + 4))
    links = json.load(open(os.path.join(plan.run_dir, "link_bytes.json")))["links"]
    basis = 4 * (40 + 40 * 8 + 2 * 8) + (4 * 40 * 8 if bwd == "gbasis" else 0)
    assert links["pp_fwd:0->1"] == links["pp_fwd:2->3"] == 3 * 2 * per_mb + basis
    assert links["pp_bwd:1->0"] == links["pp_bwd:3->2"] == 3 * 2 * per_mb


def test_diagnose_codec_transform_fits_the_pca_basis_and_counts_bytes_per_row():
    from orchestration import diagnose as dg

    h_cal = torch.randn(2, 128, 576)
    t = dg.codec_transform("pca:bits=4,budget=15", 576, 15, 0, h_cal=h_cal)
    assert t.bytes_fwd == t.bytes_bwd == 152  # ceil((580 + 127 * (144 + 4)) / 128) <= 153 = 2304 // 15
    h = torch.randn(1, 128, 576)
    out = t.fn(h, None)
    assert out.shape == h.shape and torch.isfinite(out).all()
    with pytest.raises(dg.UsageError):
        dg.codec_transform("pca", 576, 15, 0)


@pytest.mark.parametrize("layout", ["after_layer", "by_stage"])
def test_a_resumed_run_keeps_its_basis(tmp_path, layout):
    """prepare_run with RUN_DIR/pca_basis.pt present installs that file's basis (no refit:
    the model it gets may already be trained), keyed by the layer its boundary sits after;
    a file written before layer keys ({stage boundary: basis}, a homogeneous run's) loads
    too, its boundary 0 being the one after layer 1 of a 4-layer model in 2 stages."""
    from types import SimpleNamespace

    from orchestration.config import parse_args

    g = torch.Generator().manual_seed(2)
    U, _ = torch.linalg.qr(torch.randn(16, 4, generator=g, dtype=torch.float64))
    b = codecs.PCABasis(torch.randn(16, generator=g), U.float(), torch.rand(4, generator=g) + 0.1, torch.ones(4))
    if layout == "after_layer":
        calibration.save({1: b}, str(tmp_path))
    else:  # what calibration.save wrote before
        torch.save({0: b.state_dict()}, os.path.join(tmp_path, calibration.BASIS_FILE))
    cfg, _ = parse_args(["--preset", "pca4", "--mesh.stages", "2"])
    model = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=4))  # no weights: it must not be run
    plan = SimpleNamespace(model=model, train_rows=None, run_dir=str(tmp_path))
    codecs.PCA_BASES.clear()
    try:
        calibration.prepare_run(cfg, plan)
        assert sorted(codecs.PCA_BASES) == [1]
        for name in ("mean", "U", "sd", "gsd"):
            assert torch.equal(getattr(codecs.PCA_BASES[1], name), getattr(b, name))
        assert calibration.load_split(str(tmp_path), 4, 2)[0] is not None
        if layout == "after_layer":  # a 1 | 3 split cuts elsewhere (an old file only knows its own split)
            with pytest.raises(ValueError, match="after decoder layer 0"):
                calibration.load_split(str(tmp_path), 4, 2, [1, 3])
    finally:
        codecs.PCA_BASES.clear()


def test_a_one_stage_split_has_no_boundary_to_fit():
    """--mesh.stages 1 with the default pca codec (full replicas syncing over DP): no
    boundary, so no states, gradients or bases (it used to ask autograd for the gradient
    of nothing and fail before the run started)."""
    from test_stages import _model

    rows = torch.randint(0, 128, (4, 8))
    assert calibration.boundary_states(_model("llama"), rows, 1, grad_rows=4) == ([], [])
    assert calibration.fit_model_bases(_model("llama"), rows, PCACodec(quant="absmax", k=8), 1, grad_rows=4) == {}


def test_boundary_gradients_of_a_frozen_model_are_the_trainable_models():
    """A frozen base (LoRA's, as orchestration.diagnose.drift loads it) has no weight that
    requires grad before the boundary; its boundary gradients must still be d loss / d h,
    the same as with every weight trainable (this used to fail in autograd)."""
    from test_stages import _model

    rows = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(3))
    model = _model("llama")
    hs, gs = calibration.boundary_states(model, rows, 2, grad_rows=4)
    for p in model.parameters():
        p.requires_grad_(False)
    hs_f, gs_f = calibration.boundary_states(model, rows, 2, grad_rows=4)
    assert len(gs_f) == 1 and gs_f[0] is not None and gs_f[0].abs().sum() > 0
    torch.testing.assert_close(hs_f[0], hs[0], rtol=0, atol=0)
    torch.testing.assert_close(gs_f[0], gs[0], rtol=0, atol=0)


def test_loss_allocation_spends_the_same_bits_where_the_gradient_is():
    """quant=nf, alloc=loss: the forward's widths minimise sum_i w_i var_i D(b_i), w_i the
    calibration gradient's mean square along coordinate i (the first-order change of the
    loss), where alloc=var minimises sum_i var_i D(b_i); each is the optimum of its own
    objective at the same bit count (the greedy allocation is exact: D is convex)."""
    from meshkern.pca_nf import distortion

    g = torch.Generator().manual_seed(2)
    H, N, nf_bits = 24, 4000, 8 * 6
    h = torch.randn(4, N // 4, H, generator=g) * torch.logspace(0.5, -1.5, H)  # PCA axes = coordinate axes
    grads = torch.randn(4, N // 4, H, generator=g) * 0.05
    grads[..., -1] *= 400  # the loss is sensitive along the smallest-variance direction
    bv = calibration.fit_basis(h, H, sink=False, grads=grads, nf_bits=nf_bits)
    bl = calibration.fit_basis(h, H, sink=False, grads=grads, nf_bits=nf_bits, alloc="loss")
    assert int(bv.bits.sum()) == int(bl.bits.sum()) == nf_bits  # the same bytes

    def objectives(b):
        """(squared error, first-order loss change) of basis b's widths over all H axes."""
        var = (h.reshape(-1, H).double() - h.reshape(-1, H).double().mean(0)) @ b.U.double()
        var = var.pow(2).mean(0)
        w = (grads.reshape(-1, H).double() @ b.U.double()).pow(2).mean(0)
        d = torch.tensor([distortion(int(x)) if int(x) else 1.0 for x in b.bits], dtype=torch.float64)
        full = h.reshape(-1, H).double().var(0, unbiased=False).sum()  # dropped axes cost their whole variance
        wfull = ((h.reshape(-1, H).double() - h.reshape(-1, H).double().mean(0)).pow(2).mean(0)
                 * grads.reshape(-1, H).double().pow(2).mean(0)).sum()
        return float(full - var.sum() + (var * d).sum()), float(wfull - (w * var).sum() + (w * var * d).sum())

    (mse_v, loss_v), (mse_l, loss_l) = objectives(bv), objectives(bl)
    assert loss_l < 0.5 * loss_v and mse_v < mse_l  # each wins its own objective, by a clear margin here
    last = lambda b: int(torch.argmax(b.U.abs()[-1]))  # noqa: E731 (the column on the last axis, if kept)
    assert bv.U.abs()[-1].max() < 0.5 and bl.U.abs()[-1].max() > 0.99 and int(bl.bits[last(bl)]) >= 2
    # the backward's widths are allocated over the kept coordinates by gsd^2, as with alloc=var
    assert int(bl.gbits.sum()) == nf_bits and bl.gsd.shape == (bl.k,)
    with pytest.raises(ValueError, match="alloc=loss"):
        calibration.fit_basis(h, H, sink=False, nf_bits=nf_bits, alloc="loss")
    with pytest.raises(ValueError, match="alloc must be"):
        calibration.fit_basis(h, H, sink=False, grads=grads, nf_bits=nf_bits, alloc="entropy")
    with pytest.raises(ValueError, match="grad_rows"):
        codecs.make_codec("pca:alloc=loss,grad_rows=0")
    assert codecs.make_codec("pca:alloc=loss").fit_options(H)["alloc"] == "loss"
