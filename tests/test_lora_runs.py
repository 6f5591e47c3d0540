"""LoRA runs of the trainer (--adapter lora) on the tiny model: the pipeline trains what
the unsplit model trains, checkpoints are adapter-only PEFT folders that peft loads and
that resume bit for bit, and the DP axis carries only the adapters."""
import json
import os

import pytest
import torch

from orchestration.components import checkpoint as ckpt
from orchestration.launch.processes import MeshFailure
from orchestration.components.metrics import read_jsonl

from test_train import _args, _run

peft = pytest.importorskip("peft")

LORA = ("--adapter", "lora", "--adapter.rank", "2", "--adapter.alpha", "4", "--train.lr", "1e-2")


def _adapters(path: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, ckpt.ADAPTER_WEIGHTS))


def _stages_from_checkpoint(cfg, model_dir, path):
    """The pipeline's model as the ranks hold it: base + our adapters, split, each stage's
    adapter state loaded from its rank file (replica 0)."""
    from orchestration.adapters import AdapterState, apply_lora
    from orchestration.distributed.stages import split_model
    from orchestration.models.loading import load_causal_lm

    model, _ = load_causal_lm(model_dir)
    apply_lora(model, cfg.adapter)
    stages = split_model(model, cfg.mesh.stages)
    for i, st in enumerate(stages):
        AdapterState(st, cfg.adapter, model_dir).load_state_dict(ckpt.load_rank_state(path, i)["stage"])
    return stages


@pytest.mark.slow
def test_lora_checkpoint_is_a_peft_folder_that_reproduces_the_pipeline(tiny, tmp_path):
    """2 replicas x 2 stages, the default codec (pca) and DP sync (DiLoCo + PowerSGD): the
    checkpoint holds no model weights, only the adapters of all stages under peft's names
    for the unsplit model; PeftModel.from_pretrained on RUN_DIR/adapter gives the logits of
    the pipeline's stages; the merged export and orchestration.evaluate read it."""
    from orchestration import evaluate
    from orchestration import export
    from orchestration.adapters import lora_config
    from orchestration.distributed.stages import run_stages
    from orchestration.models.loading import load_causal_lm

    model_dir = str(tiny / "model")
    cfg, plan, res = _run(_args(tiny, tmp_path, "--mesh.rows", "2", "--mesh.stages", "2", "--train.steps", "4",
                                "--dp.sync-every", "2", *LORA))
    last = ckpt.resolve("latest", plan.ckpt_dir)
    names = set(os.listdir(last))
    assert not any(n.startswith(("model-", "model.safetensors")) for n in names), names
    assert {ckpt.ADAPTER_WEIGHTS, ckpt.ADAPTER_CONFIG} <= names
    ckpt.verify(last)
    for r in range(4):  # every rank's state: the adapters, nothing of the base
        assert all(".lora_" in k for k in ckpt.load_rank_state(last, r)["stage"])
    # what peft's own save_pretrained writes for the unsplit LoRA model: the same keys and shapes
    base, _ = load_causal_lm(model_dir)
    peft.get_peft_model(base, lora_config(cfg.adapter)).save_pretrained(tmp_path / "peft_ref")
    want, got = _adapters(str(tmp_path / "peft_ref")), _adapters(os.path.join(plan.run_dir, "adapter"))
    assert {(k, tuple(v.shape)) for k, v in want.items()} == {(k, tuple(v.shape)) for k, v in got.items()}
    assert all(v.dtype == torch.float32 for v in got.values())
    with open(os.path.join(plan.run_dir, "adapter", ckpt.ADAPTER_CONFIG)) as f:
        assert json.load(f)["base_model_name_or_path"] == os.path.abspath(model_dir)

    ids = plan.eval_rows[:4]
    with torch.no_grad():
        ours = run_stages(_stages_from_checkpoint(cfg, model_dir, last), ids)
        base, _ = load_causal_lm(model_dir)
        theirs = peft.PeftModel.from_pretrained(base, os.path.join(plan.run_dir, "adapter"))(input_ids=ids).logits
        torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(load_causal_lm(model_dir)[0](ids).logits, ours, atol=1e-3)  # it did train
        merged_dir = export.export_merged(last, str(tmp_path / "merged"))
        # the pca run's boundary transform travels with the exports (tests/test_boundary_transform.py);
        # the stages above ran without it: compare the plain model
        assert all(os.path.isfile(os.path.join(d, "meshkern_boundary.json"))
                   for d in (last, merged_dir, os.path.join(plan.run_dir, "adapter")))
        merged = load_causal_lm(merged_dir, boundary=False)[0](ids).logits
        torch.testing.assert_close(merged, ours, rtol=1e-4, atol=1e-4)
    assert evaluate.main(["--model", os.path.join(plan.run_dir, "adapter"), "--data", str(tiny / "data.txt"),
                          "--seq-len", "32", "--max-batches", "1", "--threads", "1"]) == 0
    assert export.main([str(tmp_path / "t" / "checkpoints" / "latest"), "--out", str(tmp_path / "x")]) == 0


@pytest.mark.slow
def test_two_stage_lora_pipeline_trains_as_the_unsplit_model(tiny, tmp_path):
    """Dense boundaries, one replica: a 2-stage LoRA run and a 1-stage one (the unsplit
    model in one process) see the same batches and end with the same adapters."""
    common = ("--mesh.rows", "1", "--train.steps", "3", "--boundary.codec", "dense", *LORA)
    _, plan2, res2 = _run(_args(tiny, tmp_path / "two", "--mesh.stages", "2", *common))
    _, plan1, res1 = _run(_args(tiny, tmp_path / "one", "--mesh.stages", "1", *common))
    torch.testing.assert_close(torch.tensor(res2[1]["losses"]), torch.tensor(res1[0]["losses"]), rtol=1e-6, atol=0)
    a2, a1 = _adapters(os.path.join(plan2.run_dir, "adapter")), _adapters(os.path.join(plan1.run_dir, "adapter"))
    assert a2.keys() == a1.keys() and len(a1) == 4 * 7 * 2
    for k in a1:
        torch.testing.assert_close(a2[k], a1[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.slow
def test_lora_crash_then_resume_is_bit_identical(tiny, tmp_path):
    """2 x 2 mesh, DiLoCo + PowerSGD: rank 3 dies before step 5, the run resumes from its
    step-3 adapter-only checkpoint and logs, and ends with, exactly an uninterrupted run's
    losses and adapters."""
    common = ("--mesh.rows", "2", "--mesh.stages", "2", "--train.steps", "6", "--dp.sync-every", "2",
              "--checkpoint.every", "3", *LORA)
    _, plan_full, res_full = _run(_args(tiny, tmp_path / "full", *common))
    cut = _args(tiny, tmp_path / "cut", *common)
    with pytest.raises(MeshFailure, match="rank 3"):
        _run([*cut, "--run.fail-rank", "3", "--run.fail-step", "4"])
    _, plan, res = _run([*cut, "--checkpoint.resume", "latest"])
    assert res[1]["losses"] == res_full[1]["losses"][3:] and res[3]["losses"] == res_full[3]["losses"][3:]
    assert [r["loss"] for r in read_jsonl(f"{plan.run_dir}/metrics.jsonl")] == \
        [r["loss"] for r in read_jsonl(f"{plan_full.run_dir}/metrics.jsonl")]
    a, b = _adapters(os.path.join(plan.run_dir, "adapter")), _adapters(os.path.join(plan_full.run_dir, "adapter"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_dp_all_reduce_sends_exactly_the_adapters(tiny, tmp_path):
    """Two full replicas, gradient all-reduce without compression: each step every rank
    sends the ring all-reduce of the adapters' fp32 gradients, and nothing else."""
    from meshkern.compress.base import ring_all_reduce_bytes

    cfg, plan, res = _run(_args(tiny, tmp_path, "--mesh.rows", "2", "--mesh.stages", "1", "--train.steps", "2",
                                "--dp.mode", "allreduce", "--dp.compressor", "none", *LORA))
    n = sum(v.numel() for v in _adapters(os.path.join(plan.run_dir, "adapter")).values())
    # 4 layers x r=2 x (in + out) of q, k, v, o (GQA: k, v out 20) and gate, up, down (40 <-> 64)
    assert n == 4 * 2 * ((40 + 40) + 2 * (40 + 20) + (40 + 40) + 3 * (40 + 64))
    for rank in (0, 1):
        assert res[rank]["bytes"]["dp"] == 2 * ring_all_reduce_bytes(n, 4, 2, rank)[0]


COMPOSITIONS = {  # every boundary codec family, every DP compressor, the anchor, a heterogeneous mesh
    "pca": ["--mesh.rows", "1", "--mesh.stages", "2"],
    "m95": ["--mesh.rows", "1", "--mesh.stages", "2", "--boundary.codec", "mask", "--boundary.p", "0.95"],
    "int4": ["--mesh.rows", "1", "--mesh.stages", "2", "--boundary.codec", "int4"],
    "topk": ["--mesh.rows", "1", "--mesh.stages", "2", "--boundary.codec", "topk"],
    "aqsgd": ["--mesh.rows", "1", "--mesh.stages", "2", "--boundary.codec", "aqsgd"],
    "tahquant": ["--mesh.rows", "1", "--mesh.stages", "2", "--boundary.codec", "tahquant:tile=8"],
    "sparseloco": ["--mesh.rows", "2", "--mesh.stages", "2", "--dp.compressor", "sparseloco", "--dp.sync-every", "2"],
    "int8-allreduce": ["--mesh.rows", "2", "--mesh.stages", "2", "--dp.mode", "allreduce", "--dp.compressor", "int8"],
    "m95-ap": ["--preset", "m95-ap", "--mesh.rows", "2", "--mesh.stages", "2", "--dp.mode", "none",
               "--anchor.microbatches", "2", "--train.spectral-rank", "2", "--anchor.snapshot-every", "1",
               "--anchor.delay", "1"],  # deterministic: each update applied one step after its snapshot, whatever the load
    "replicas-1,2": ["--mesh.replicas", "1,2", "--dp.sync-every", "2"],
    "bf16-base": ["--mesh.rows", "2", "--mesh.stages", "2", "--model.dtype", "bfloat16", "--dp.sync-every", "2"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMPOSITIONS))
def test_lora_composes_with_every_circuit(tiny, tmp_path, name):
    """The same run with and without --adapter lora: the boundaries carry exactly the same
    (compressed) bytes both ways (the codec does not care what trains), the DP axis
    carries fewer (only the adapters sync), the loss stays finite, the adapters move off
    their initial value (B = 0) and, with the anchor, its updates are applied."""
    extra = COMPOSITIONS[name]
    steps = ["--train.steps", "3"]
    _, _, full = _run(_args(tiny, tmp_path / "full", *steps, *extra))
    cfg, plan, lora = _run(_args(tiny, tmp_path / "lora", *steps, *extra, *LORA))
    for rank, rec in enumerate(lora):
        if "bytes" not in rec:  # an anchor rank
            continue
        assert all(l == l for l in rec["losses"]), (rank, rec["losses"])
        for axis in ("pp_fwd", "pp_bwd"):
            assert rec["bytes"][axis] == full[rank]["bytes"][axis], (rank, axis)
        if cfg.fast_rows > 1 and cfg.dp.mode != "none":
            assert 0 < rec["bytes"]["dp"] < full[rank]["bytes"]["dp"], rank
    assert lora[0]["bytes"]["pp_fwd"] > 0 or cfg.replica_stages[0] == 1
    adapters = _adapters(os.path.join(plan.run_dir, "adapter"))
    assert all(v.abs().max() > 0 for k, v in adapters.items() if ".lora_B." in k)
    if cfg.anchor.enabled:
        recs = read_jsonl(f"{plan.run_dir}/metrics.jsonl")
        assert recs[-1]["anchor_applied"] > 0
