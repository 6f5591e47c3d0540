"""LoRA adapters (--adapter lora, orchestration.adapters): built with peft on the unsplit
model, split into stages like any model; adapter-only training, checkpoints, DP sync and
the PEFT export. References: peft's own ``get_peft_model`` / ``PeftModel`` on the unsplit
model, and the stage-equivalence rules of tests/test_stages.py."""
import copy
import json
import os

import pytest
import torch

from orchestration.adapters import apply_lora, check_targets, layer_linear_names, peft_key
from orchestration.config import AdapterConfig, parse_args
from orchestration.distributed.stages import causal_lm_loss, run_stages, split_model

from test_stages import _batch, _model

peft = pytest.importorskip("peft")

ALL = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def _acfg(**kw):
    return AdapterConfig(kind="lora", **{"rank": 4, "alpha": 8.0, "targets": ALL, **kw})


def _perturbed_peft_reference(model, acfg):
    """peft's unsplit LoRA model of ``model`` with every B factor made non-zero (at init B
    is zero, and then no gradient reaches A: the test would not see A's)."""
    from orchestration.adapters import lora_config

    ref = peft.get_peft_model(model, lora_config(acfg))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "lora_B" in n:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return ref


@pytest.mark.parametrize("family,layers,tied", [("llama", [1, 3], False), ("qwen2", None, False),
                                                ("qwen3", [3, 1], True), ("mistral", [2, 1, 1], False)])
def test_split_lora_model_reproduces_peft_unsplit_model(family, layers, tied):
    """Our adapters (peft layers injected, then split) give peft's unsplit LoRA model's
    logits bit for bit, its loss, and its adapter gradients; base weights get none."""
    acfg = _acfg()
    ref = _perturbed_peft_reference(_model(family, tied=tied), acfg)
    ours = apply_lora(_model(family, tied=tied), acfg)
    ref_params = dict(ref.named_parameters())
    with torch.no_grad():  # the same adapter values: copy peft's into ours by the PEFT names
        for n, p in ours.named_parameters():
            if p.requires_grad:
                p.copy_(ref_params["base_model.model." + n])
    ids = _batch()
    labels = ids.clone()
    out = ref(input_ids=ids, labels=labels)
    out.loss.backward()
    stages = split_model(ours, len(layers) if layers else 2, layers)
    logits = run_stages(stages, ids)
    assert torch.equal(logits, out.logits)
    loss = causal_lm_loss(logits, labels)
    torch.testing.assert_close(loss, out.loss, rtol=0, atol=1e-6)
    loss.backward()
    seen = 0
    for st in stages:
        for hf, p in st.hf_named_parameters():
            if not p.requires_grad:
                assert p.grad is None, hf
                continue
            assert p.dtype == torch.float32 and (".lora_A." in hf or ".lora_B." in hf), hf
            torch.testing.assert_close(p.grad, ref_params["base_model.model." + hf].grad, rtol=1e-5, atol=1e-7)
            seen += 1
    assert seen == sum(1 for n, p in ref.named_parameters() if p.requires_grad) == 4 * 7 * 2


def test_bf16_base_trains_fp32_adapters():
    model = apply_lora(_model("llama").to(torch.bfloat16), _acfg(targets="q_proj,down_proj"))
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert len(trainable) == 4 * 2 * 2 and all(p.dtype == torch.float32 for p in trainable.values())
    assert all(p.dtype == torch.bfloat16 for n, p in model.named_parameters() if n not in trainable)
    model(_batch()).logits.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in trainable.values())


def test_peft_keys_are_the_unsplit_models():
    assert peft_key("model.layers.3.mlp.up_proj.lora_B.default.weight") == \
        "base_model.model.model.layers.3.mlp.up_proj.lora_B.weight"


def test_targets_are_checked_against_the_models_layers():
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      vocab_size=128)
    assert layer_linear_names(cfg) == sorted(ALL.split(","))
    check_targets(_acfg(), cfg)
    with pytest.raises(ValueError, match=r"qkv_proj is not a linear layer of LlamaForCausalLM.*q_proj"):
        check_targets(_acfg(targets="q_proj,qkv_proj"), cfg)


@pytest.mark.parametrize("flags,msg", [
    (["--adapter.rank", "0"], "--adapter.rank must be an integer >= 1"),
    (["--adapter.dropout", "1.0"], r"--adapter.dropout must be a float in \[0, 1\)"),
    (["--adapter.targets", ","], "--adapter.targets is empty"),
    (["--adapter.targets", "q_proj,q_proj"], "names a layer twice"),
    (["--adapter.alpha", "nan"], "--adapter.alpha must be a finite number > 0"),
    (["--boundary.codec", "subspace"], "cannot work"),
    (["--adapter.export", "gguf"], "--adapter.export must be one of adapter, merged"),
])
def test_bad_adapter_flags_are_one_clear_error(flags, msg):
    with pytest.raises(ValueError, match=msg):
        parse_args(["--adapter", "lora", *flags])
    with pytest.raises(ValueError, match="--adapter must be one of none, lora"):
        parse_args(["--adapter", "qlora"])


def test_unknown_target_fails_before_any_rank_starts(tiny, tmp_path, capsys):
    from orchestration import train

    rc = train.main(["--model", str(tiny / "model"), "--data", str(tiny / "data.txt"), "--run.out-dir", str(tmp_path),
                     "--adapter", "lora", "--adapter.targets", "q_proj,w1"])
    assert rc == 2
    assert "--adapter.targets: w1 is not a linear layer of LlamaForCausalLM" in capsys.readouterr().err
    assert not os.listdir(tmp_path)  # no run directory: nothing started


def test_adapter_flags_without_lora_are_a_warning():
    from orchestration.config import ineffective_settings

    cfg, _ = parse_args(["--adapter.rank", "8"])
    assert any(line.startswith("--adapter.rank: it configures LoRA adapters") for line in ineffective_settings(cfg))
    assert not any("--adapter" in line for line in ineffective_settings(parse_args(["--adapter", "lora"])[0]))
