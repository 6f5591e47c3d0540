"""The pca codec on heterogeneous meshes (issue #41 item 3): a basis for every distinct
boundary of every replica's split, named by the decoder layer it sits after, fitted on that
layer's hidden states, counted once per sending rank; selective leaves a full replica dense."""
import json
import os

import pytest
import torch

from orchestration import codecs
from orchestration.components import calibration
from orchestration.config import parse_args
from orchestration.distributed.mesh import MeshLayout
from orchestration.launch.processes import run_local
from orchestration.train import prepare, run_rank

from test_train import _args

OPTIONS = {"seq_len": 32, "calib_rows": 8, "grad_rows": 4}


def _cfg(tiny, tmp_path, replicas, *extra):
    return parse_args(_args(tiny, tmp_path, "--mesh.replicas", replicas, "--boundary.codec", "pca",
                            "--boundary.options", json.dumps(OPTIONS), *extra))[0]


@pytest.mark.parametrize("replicas,compress,layers", [
    ("1,2,2", "selective", {1: [1], 2: [1]}),  # the full replica is left dense: no boundary to fit
    ("2,3", "all", {0: [1], 1: [1, 2]}),       # 4 layers: 2|2 and 2|1|1 share the cut after layer 1
    ("2,2", "all", {0: [1], 1: [1]}),          # homogeneous: its own split's one cut
])
def test_every_boundary_is_fitted_on_the_layer_it_sits_after(tiny, tmp_path, replicas, compress, layers):
    """The run's bases, one per distinct boundary layer, equal a basis fitted on the
    unsplit model's hidden states (and gradients) at that layer (``boundary_states`` of
    the replica split that has it), and each replica's codec view maps its stage
    boundaries onto them."""
    from orchestration.models.loading import load_causal_lm

    cfg = _cfg(tiny, tmp_path, replicas, "--boundary.compress", compress)
    assert calibration.run_boundary_layers(cfg, 4) == layers
    model, _ = load_causal_lm(tiny / "model")
    rows = torch.randint(0, model.config.vocab_size, (200, 32), generator=torch.Generator().manual_seed(0))
    bases = calibration.bases_for_run(cfg, model, rows)
    assert sorted(bases) == sorted({L for v in layers.values() for L in v})
    codec = calibration.codec_of(cfg)
    calib = calibration.calibration_rows(rows, codec.calib_rows, cfg.train.seed)
    for row, cuts in layers.items():
        y = cfg.replica_stages[row]
        hs, gs = calibration.boundary_states(model, calib, y, grad_rows=codec.grad_rows)
        view = calibration.for_split(bases, cuts)
        for b, L in enumerate(cuts):
            want = calibration.fit_for(codec, hs[b], gs[b])
            assert view[b] is bases[L]
            for name in ("mean", "U", "sd", "gsd", "bits", "gbits"):
                torch.testing.assert_close(getattr(bases[L], name), getattr(want, name), rtol=1e-5, atol=1e-6)
    if 2 in bases:  # two different boundaries get different bases (the test can fail)
        assert not torch.allclose(bases[1].mean, bases[2].mean)


@pytest.mark.slow
@pytest.mark.parametrize("replicas,start", [("1,2,2", "spawn"), ("2,3", "fork")])
def test_pca_trains_a_heterogeneous_mesh_and_counts_each_basis_once_per_sender(tiny, tmp_path, replicas, start):
    """--mesh.replicas with the default codec: the loss is finite and falls; RUN_DIR holds
    one basis per boundary layer, equal to a fit on the model as loaded; every rank that
    sends across a boundary counts the wire of each micro-batch plus that boundary's
    basis once on its pp_fwd link, and the backward only the wire; a full replica left
    dense (selective) sends nothing. Spawn: the calibrating ranks (all but the full
    replica's) get the basis by broadcast from the first of them, not by fork."""
    from orchestration.models.loading import load_causal_lm

    steps = 6
    cfg = _cfg(tiny, tmp_path, replicas, "--train.steps", str(steps), "--train.lr", "3e-3",
               "--mesh.start-method", start, "--mesh.timeout-s", "120")
    codecs.PCA_BASES.clear()
    try:
        plan = prepare(cfg)
        res = run_local(run_rank, cfg.world_size, (cfg, plan), timeout_s=400, describe=MeshLayout.of(cfg).describe,
                        start_method=start)
    finally:
        codecs.PCA_BASES.clear()
    losses = res[0]["losses"]
    assert len(losses) == steps and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-2:]) / 2 < losses[0]
    layers = calibration.run_boundary_layers(cfg, 4)
    saved = calibration.load(plan.run_dir)
    model, _ = load_causal_lm(tiny / "model")
    fresh = calibration.bases_for_run(cfg, model, plan.train_rows)
    assert sorted(saved) == sorted(fresh) == sorted({L for v in layers.values() for L in v})
    for L in saved:
        torch.testing.assert_close(saved[L].U, fresh[L].U, rtol=1e-4, atol=1e-5)
    codec = calibration.codec_of(cfg)
    per_mb = codec.wire_bytes((2, 32, 40), torch.float32, "fwd")
    assert per_mb == codec.wire_bytes((2, 32, 40), torch.float32, "bwd")
    links = json.load(open(os.path.join(plan.run_dir, "link_bytes.json")))["links"]
    lay = MeshLayout.of(cfg)
    want_fwd, want_bwd = {}, {}
    for row, cuts in layers.items():
        for b, L in enumerate(cuts):
            src, dst = lay.rank_of(row, b), lay.rank_of(row, b + 1)
            want_fwd[f"pp_fwd:{src}->{dst}"] = steps * 2 * per_mb + saved[L].nbytes()
            want_bwd[f"pp_bwd:{dst}->{src}"] = steps * 2 * per_mb
    assert {k: v for k, v in links.items() if k.startswith("pp_")} == {**want_fwd, **want_bwd}
    if replicas == "1,2,2":
        assert cfg.replica_codec(0) == "dense" and res[0]["bytes"]["pp_fwd"] == res[0]["bytes"]["pp_bwd"] == 0
    else:  # replica 1's second boundary has a basis of its own, counted on its own link
        assert not torch.allclose(saved[1].mean, saved[2].mean)
