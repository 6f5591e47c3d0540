"""orchestration.components.memory: the per-stage memory table, checked against the real
thing: the split model's parameters, peft's adapters, AdamW's state after a step."""
import copy
import os

import pytest
import torch

from orchestration.adapters import apply_lora
from orchestration.config import AdapterConfig
from orchestration.distributed.stages import split_model
from orchestration.components import memory

from test_stages import _model


@pytest.mark.parametrize("adapter,dtype", [("none", torch.float32), ("lora", torch.float32), ("lora", torch.bfloat16),
                                           ("none", torch.bfloat16)])
def test_counts_and_state_bytes_match_the_split_model_and_adamw(adapter, dtype):
    acfg = AdapterConfig(kind=adapter, rank=4, targets="q_proj,v_proj,down_proj")
    model = _model("llama", tied=True).to(dtype)
    rows = memory.stage_memory(model.config, 2, layers_per_stage=[1, 3], dtype=str(dtype).split(".")[1],
                               adapter=acfg, micro_batch=2, seq_len=12, microbatches=2)
    real = copy.deepcopy(model)
    if adapter == "lora":
        apply_lora(real, acfg)
    stages = split_model(real, 2, [1, 3])
    for r, st in zip(rows, stages):
        params = {id(p): p for p in st.parameters()}.values()
        trainable = [p for p in params if p.requires_grad]
        assert r.params == sum(p.numel() for p in params) and r.trainable == sum(p.numel() for p in trainable)
        assert r.weights == sum(p.numel() * p.element_size() for p in params)
        opt = torch.optim.AdamW(trainable)
        for p in trainable:
            p.grad = torch.zeros_like(p)
        opt.step()
        state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim() > 0)
        assert r.optimizer == state and r.grads == sum(p.grad.numel() * p.grad.element_size() for p in trainable)
        assert r.layers == st.layer_range


def test_in_flight_micro_batches_follow_the_schedule():
    cfg = _model("llama").config
    one = memory.stage_memory(cfg, 4, layers_per_stage=[1, 1, 1, 1], microbatches=1, micro_batch=1, seq_len=8)
    f1b = memory.stage_memory(cfg, 4, layers_per_stage=[1, 1, 1, 1], microbatches=8, micro_batch=1, seq_len=8)
    gp = memory.stage_memory(cfg, 4, layers_per_stage=[1, 1, 1, 1], microbatches=8, micro_batch=1, seq_len=8,
                             schedule="gpipe")
    assert [b.activations // a.activations for a, b in zip(one, f1b)] == [4, 3, 2, 1]
    assert [b.activations // a.activations for a, b in zip(one, gp)] == [8, 8, 8, 8]


def test_published_geometries_have_their_published_sizes():
    # Llama-3.2-1B: 1.24B parameters (tied); Llama-3-8B: 8.03B (untied). A split counts
    # the tied embedding twice (the last stage holds a copy).
    one = memory.stage_memory(memory.geometry_config("llama-3.2-1b"), 1)
    assert round(one[0].params / 1e9, 2) == 1.24
    eight = memory.stage_memory(memory.geometry_config("llama-3-8b"), 1,
                                adapter=AdapterConfig(kind="lora", rank=16))
    assert round((eight[0].params - eight[0].trainable) / 1e9, 2) == 8.03
    assert eight[0].trainable == 41_943_040  # r=16 on all 7 projections of 32 layers: peft's count


def test_dry_run_prints_the_table_and_starts_nothing(tiny, tmp_path, capsys):
    from orchestration import train

    assert train.main(["--model", str(tiny / "model"), "--run.out-dir", str(tmp_path), "--mesh.stages", "2",
                       "--adapter", "lora", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "memory per stage of replica 0 (LoRA r=16" in out and out.count("\n    ") >= 2
    assert not os.listdir(tmp_path)
