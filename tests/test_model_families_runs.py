"""The trainer end to end on a tiny checkpoint of every family (written by transformers'
own save_pretrained, with a real tokenizer): a 2-stage run through the default pca codec
trains (finite, falling loss); a 2-stage LoRA run with the family's default targets
checkpoints, resumes exactly, and exports a PEFT folder that PeftModel.from_pretrained loads
on the unsplit model with the pipeline's logits, a merged model, and orchestration.evaluate
reads it."""
import os

import pytest
import torch

from family_models import FAMILIES, tiny_config
from test_train import _args, _run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def family_dirs(tiny, tmp_path_factory):
    """family -> a directory like the shared ``tiny`` one (data.txt + model/) holding that
    family's tiny model with the tiny model's tokenizer; built on first use."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(tiny / "model"))
    built = {}

    def get(family):
        if family not in built:
            root = tmp_path_factory.mktemp(family)
            (root / "data.txt").write_text((tiny / "data.txt").read_text())
            torch.manual_seed(0)
            cfg = tiny_config(family, vocab_size=len(tok), pad_token_id=None, bos_token_id=None, eos_token_id=None)
            transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(root / "model")
            tok.save_pretrained(root / "model")
            built[family] = root
        return built[family]

    return get


def _falling(losses):
    return len(losses) >= 3 and all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_two_stage_run_trains(family, family_dirs, tmp_path):
    root = family_dirs(family)
    _, _, res = _run(_args(root, tmp_path, "--mesh.rows", "1", "--mesh.stages", "2", "--train.steps", "4",
                           "--train.lr", "1e-2", "--boundary.codec", "pca"))
    losses = res[1]["losses"]  # the last stage's
    assert _falling(losses), losses


@pytest.mark.parametrize("family", FAMILIES)
def test_two_stage_lora_run_exports_what_peft_loads(family, family_dirs, tmp_path):
    peft = pytest.importorskip("peft")
    from orchestration import evaluate
    from orchestration.components import checkpoint as ckpt
    from orchestration.models.families import default_targets
    from orchestration.models.loading import load_causal_lm

    root = family_dirs(family)
    model_dir = str(root / "model")
    common = ("--mesh.rows", "1", "--mesh.stages", "2", "--train.steps", "4", "--checkpoint.every", "2",
              "--adapter", "lora", "--adapter.rank", "2", "--adapter.alpha", "4", "--train.lr", "2e-2",
              "--adapter.export", "merged")
    cfg, plan, res = _run(_args(root, tmp_path / "full", *common))
    # (falling loss: test_two_stage_run_trains; rank-2 adapters on a random base barely move it in 4 steps)
    assert len(res[1]["losses"]) == 4 and all(torch.isfinite(torch.tensor(res[1]["losses"])))
    assert cfg.adapter.target_list() == default_targets(tiny_config(family))  # the family's own targets

    # resume from the step-2 checkpoint: the same last two losses
    step2 = ckpt.step_dir(plan.ckpt_dir, 2)
    _, _, res2 = _run(_args(root, tmp_path / "cut", *common, "--checkpoint.resume", step2))
    torch.testing.assert_close(torch.tensor(res2[1]["losses"][-2:]), torch.tensor(res[1]["losses"][-2:]),
                               rtol=1e-6, atol=0)

    adapter, ids = os.path.join(plan.run_dir, "adapter"), plan.eval_rows[:2]
    with torch.no_grad():
        base, _ = load_causal_lm(model_dir)
        before = base(ids).logits
        got = peft.PeftModel.from_pretrained(base, adapter)(input_ids=ids).logits
        assert torch.isfinite(got).all() and not torch.allclose(got, before, atol=1e-4)  # it trained
        merged, _ = load_causal_lm(os.path.join(plan.run_dir, "merged"), boundary=False)  # got: no transform
        torch.testing.assert_close(merged(ids).logits, got, rtol=1e-4, atol=1e-4)
    assert evaluate.main(["--model", adapter, "--data", str(root / "data.txt"), "--seq-len", "32",
                          "--max-batches", "1", "--threads", "1"]) == 0


@pytest.mark.parametrize("family", ["gemma2", "phi3", "mixtral"])
def test_the_other_circuits_run_on_the_most_different_families(family, family_dirs, tmp_path):
    """Soft-capped Gemma 2, fused-projection Phi-3 and MoE Mixtral through the rest of the
    stack: two fast replicas synced by Streaming DiLoCo + PowerSGD with the anchor row (its
    updates applied), and a heterogeneous mesh (a full replica beside a 2-stage one) with
    the default codec."""
    root = family_dirs(family)
    _, _, res = _run(_args(root, tmp_path / "anchor", "--mesh.rows", "3", "--mesh.stages", "2", "--train.steps", "6",
                           "--train.lr", "1e-2", "--train.optimizer", "spectral", "--anchor.enabled",
                           "--anchor.delay", "1", "--anchor.snapshot-every", "1", "--dp.mode", "diloco",
                           "--dp.compressor", "powersgd", "--dp.sync-every", "2"))
    fast = [r for r in res if r and "losses" in r]
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in fast)
    assert res[0]["bytes"]["dp"] > 0 and res[0]["bytes"]["anchor"] > 0
    assert res[0]["summary"]["anchor"]["applied"] >= 1, res[0]["summary"]["anchor"]
    _, _, het = _run(_args(root, tmp_path / "het", "--mesh.replicas", "1,2", "--train.steps", "4",
                           "--dp.sync-every", "2",
                           "--train.lr", "1e-2"))
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in het if r)
    assert het[0]["bytes"]["dp"] > 0
