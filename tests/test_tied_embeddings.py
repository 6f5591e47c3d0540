"""Tied input/output embeddings split over pipeline stages, ``--model.tied-embeddings``:
sync (the two copies' gradients summed every step, counted on the "tied" byte axis;
tests/test_heterogeneous.py checks the count) and untie (no such traffic; the run trains
and exports exactly the untied model)."""
import json
import shutil

import pytest
import torch

from orchestration.components import checkpoint as ckpt
from orchestration.config import parse_args
from orchestration.models.loading import load_causal_lm

from test_train import _args, _run


@pytest.fixture(scope="module")
def tied_pair(tiny_factory):
    """(root, untied_dir): the tiny model with tied embeddings at root/model, and the same
    weights saved as an untied model (a separate lm_head equal to the embedding)."""
    root = tiny_factory("tied_pair")
    model, _ = load_causal_lm(str(root / "model"))
    untied = root / "untied"
    shutil.copytree(root / "model", untied)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    model.save_pretrained(root / "model")
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    model.save_pretrained(untied)
    ref, _ = load_causal_lm(str(untied))
    assert ref.lm_head.weight is not ref.model.embed_tokens.weight
    assert torch.equal(ref.lm_head.weight, ref.model.embed_tokens.weight)
    return root, untied


def _export(plan) -> tuple[dict, dict]:
    path = ckpt.resolve("latest", plan.ckpt_dir)
    model, _ = load_causal_lm(path)
    with open(f"{path}/config.json") as f:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}, json.load(f)


@pytest.mark.slow
def test_untie_trains_and_exports_the_untied_model_without_tied_traffic(tied_pair, tmp_path):
    """A 2-stage run of the tied model with untie equals a 1-stage run of the same weights
    saved untied (no split, nothing to sync): same data, so the same final weights; the
    export says untied, its head moved apart from the embedding, and no rank sent a byte
    on the tied axis."""
    root, untied = tied_pair
    common = ["--train.steps", "3", "--boundary.codec", "dense", "--mesh.rows", "1"]
    _, plan_s, res_s = _run(_args(root, tmp_path / "split", *common, "--mesh.stages", "2",
                                  "--model.tied-embeddings", "untie"))
    _, plan_1, res_1 = _run(_args(root, tmp_path / "one", *common, "--mesh.stages", "1", "--model", str(untied)))
    (ws, cs), (w1, c1) = _export(plan_s), _export(plan_1)
    assert cs["tie_word_embeddings"] is False and c1["tie_word_embeddings"] is False
    assert ws.keys() == w1.keys() and "lm_head.weight" in ws
    for k in ws:
        torch.testing.assert_close(ws[k], w1[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    assert (ws["lm_head.weight"] - ws["model.embed_tokens.weight"]).abs().max() > 1e-4  # trained apart
    assert [r["bytes"]["tied"] for r in res_s] == [0, 0]


@pytest.mark.slow
def test_sync_keeps_the_export_tied(tied_pair, tmp_path):
    """The default (sync) on the same split: one weight in the export, tied."""
    root, _ = tied_pair
    _, plan, res = _run(_args(root, tmp_path, "--train.steps", "2", "--boundary.codec", "dense",
                              "--mesh.rows", "1", "--mesh.stages", "2"))
    w, c = _export(plan)
    assert c["tie_word_embeddings"] is True
    model, _ = load_causal_lm(ckpt.resolve("latest", plan.ckpt_dir))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(r["bytes"]["tied"] > 0 for r in res)


def test_tied_embeddings_value_is_checked(tied_pair, tmp_path):
    root, _ = tied_pair
    with pytest.raises(ValueError, match="--model.tied-embeddings must be sync or untie"):
        parse_args(_args(root, tmp_path, "--model.tied-embeddings", "loose"))
