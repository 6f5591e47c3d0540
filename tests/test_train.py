"""The trainer end to end on spawned gloo meshes with a tiny model: checkpoint/resume,
a killed rank, and bad input refused before any process starts."""
import json
import os
import re
import time

import pytest
import torch

from orchestration.components import checkpoint as ckpt
from orchestration.config import parse_args
from orchestration.launch.processes import MeshFailure, run_local
from orchestration.distributed.mesh import MeshLayout
from orchestration.components.builders import replica_sampler
from orchestration.train import main, prepare, run_rank


def _args(tiny, tmp_path, *extra):
    return ["--model", str(tiny / "model"), "--data", str(tiny / "data.txt"), "--data.seq-len", "32",
            "--data.max-sequences", "200", "--train.batch-size", "4", "--train.microbatches", "2",
            "--run.out-dir", str(tmp_path), "--run.name", "t", "--run.progress", "false", "--run.eval-sequences", "4",
            "--mesh.timeout-s", "30", *extra]


def _run(argv):
    cfg, _ = parse_args(argv)
    plan = prepare(cfg)
    lay = MeshLayout(cfg.mesh.rows, cfg.mesh.stages)
    return cfg, plan, run_local(run_rank, cfg.world_size, (cfg, plan), timeout_s=180, describe=lay.describe)


@pytest.mark.slow
@pytest.mark.parametrize("dp", [["--dp.mode", "allreduce", "--dp.compressor", "none"],
                                ["--dp.mode", "diloco", "--dp.compressor", "powersgd", "--dp.sync-every", "2"]],
                         ids=["allreduce", "diloco-powersgd"])
def test_checkpoint_then_resume_continues_with_identical_losses(tiny, tmp_path, dp):
    base = _args(tiny, tmp_path, "--mesh.rows", "2", "--mesh.stages", "2", "--train.steps", "4",
                 "--checkpoint.every", "2", "--boundary.codec", "mask", "--boundary.p", "0.9", *dp)
    cfg, plan, res = _run(base)
    full = res[1]["losses"]  # rank 1 = replica 0's last stage
    assert len(full) == 4 and all(l > 0 for l in full)
    step2 = ckpt.step_dir(plan.ckpt_dir, 2)
    assert os.path.isdir(step2) and ckpt.read_meta(step2)["step"] == 2

    # The exported model is a standard (sharded) HF checkpoint with replica 0's weights.
    from orchestration.models.loading import load_causal_lm

    final = ckpt.resolve("latest", plan.ckpt_dir)
    model, tok_path = load_causal_lm(final)
    assert tok_path == final
    st = ckpt.load_rank_state(final, 0)["stage"]
    torch.testing.assert_close(model.model.embed_tokens.weight, st["embed_tokens.weight"])
    torch.testing.assert_close(model.model.layers[0].mlp.up_proj.weight, st["layers.0.mlp.up_proj.weight"])

    _, _, res2 = _run(base + ["--checkpoint.resume", step2])
    assert res2[1]["losses"] == full[2:]  # bit-identical continuation
    assert res2[0]["bytes"] == res[0]["bytes"]  # counters restored, then the same traffic

    if dp[1] == "allreduce":  # a checkpoint from before heterogeneous meshes (no "replicas" in its meta)
        path = os.path.join(step2, "meta.json")
        with open(path) as f:
            meta = json.load(f)
        del meta["replicas"]
        with open(path, "w") as f:
            json.dump(meta, f)
        # 2,1 derives rows 2 x stages 2 like the checkpoint, but its replicas differ
        with pytest.raises(ValueError, match=r"written by a mesh of 2x2, this run is replicas 2,1"):
            prepare(parse_args(_args(tiny, tmp_path, "--mesh.replicas", "2,1", "--train.steps", "4",
                                     "--boundary.codec", "dense", "--boundary.compress", "all", *dp,
                                     "--checkpoint.resume", step2))[0], load_model=False)


@pytest.mark.slow
def test_killed_rank_stops_the_mesh_and_keeps_the_last_checkpoint(tiny, tmp_path):
    argv = _args(tiny, tmp_path, "--mesh.rows", "2", "--mesh.stages", "2", "--train.steps", "50",
                 "--checkpoint.every", "2", "--run.fail-rank", "3", "--run.fail-step", "3")
    cfg, _ = parse_args(argv)
    plan = prepare(cfg)
    lay = MeshLayout(2, 2)
    t0 = time.monotonic()
    with pytest.raises(MeshFailure, match=r"rank 3 \(replica 1, stage 1\) died: killed by signal SIGKILL"):
        run_local(run_rank, 4, (cfg, plan), timeout_s=120, describe=lay.describe)
    assert time.monotonic() - t0 < 60
    last = ckpt.resolve("latest", plan.ckpt_dir)
    assert ckpt.read_meta(last)["step"] == 2
    for r in range(4):
        assert ckpt.load_rank_state(last, r)["step"] == 2
    from orchestration.models.loading import load_causal_lm

    load_causal_lm(last)


@pytest.mark.slow
def test_main_reports_a_dead_rank(tiny, tmp_path, capsys):
    rc = main(_args(tiny, tmp_path, "--mesh.rows", "1", "--mesh.stages", "2", "--train.steps", "20",
                    "--run.fail-rank", "0", "--run.fail-step", "1"))
    assert rc == 1
    assert "rank 0 (replica 0, stage 0) died: killed by signal SIGKILL" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--mesh.stages", "5"], "more stages than layers"),
    (["--mesh.layers-per-stage", "3,2"], "sums to 5"),
    (["--train.batch-size", "5"], "does not split into"),
    (["--data.source", "/nonexistent/text"], "does not exist"),
    (["--model.path", "/nonexistent/model"], "not a Hugging Face checkpoint"),
    (["--boundary.codec", "zip"], "--boundary.codec must be one of"),
])
def test_bad_input_is_refused_before_spawning(tiny, tmp_path, capsys, monkeypatch, extra, message):
    import orchestration.launch.local as local_launch

    def no_spawn(*a, **k):
        raise AssertionError("a process was spawned")

    monkeypatch.setattr(local_launch, "run_local", no_spawn)
    assert main(_args(tiny, tmp_path, *extra)) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_a_finished_run_is_never_clobbered_and_resume_must_match(tiny, tmp_path, capfd):
    """Re-running an existing run name without --checkpoint.resume is refused (it would
    append to its metrics and prune its checkpoints); resuming with a config whose state
    cannot be loaded (another optimizer, another layer split) is refused up front."""
    base = _args(tiny, tmp_path, "--mesh.rows", "1", "--mesh.stages", "2", "--train.steps", "2",
                 "--run.eval-sequences", "0")
    assert main(base) == 0
    last = ckpt.resolve("latest", str(tmp_path / "t" / "checkpoints"))
    capfd.readouterr()
    assert main(base) == 2
    assert "run 't' already exists" in capfd.readouterr().err
    assert ckpt.resolve("latest", str(tmp_path / "t" / "checkpoints")) == last  # untouched
    more = [*base[:base.index("--train.steps")], "--train.steps", "3", *base[base.index("--train.steps") + 2:],
            "--checkpoint.resume", "latest"]
    assert main([*more, "--train.optimizer", "spectral"]) == 2
    assert "was written with --train.optimizer adamw, this run has spectral" in capfd.readouterr().err
    assert main([*more, "--mesh.layers-per-stage", "3,1"]) == 2
    assert "--mesh.layers-per-stage [2, 2], this run has [3, 1]" in capfd.readouterr().err
    assert main(more) == 0  # the matching resume still works
    assert "resumed from" in capfd.readouterr().err


def test_pruning_never_deletes_the_checkpoint_just_written(tmp_path):
    root = tmp_path / "ck"
    for step in (6, 10, 3):  # stale step_6 / step_10 from another run, then this run's step_3
        (root / f"step_{step:08d}").mkdir(parents=True)
    ckpt._prune(str(root), 2, protect={"step_00000003"})
    assert sorted(os.listdir(root)) == ["step_00000003", "step_00000010"]


def test_model_without_weights_and_join_without_fast_circuit_are_refused(tiny, tmp_path, capsys, monkeypatch):
    import shutil

    from orchestration.launch.processes import free_port

    bare = tmp_path / "noweights"
    bare.mkdir()
    for f in os.listdir(tiny / "model"):
        if "safetensors" not in f:  # weights and their index
            shutil.copy(tiny / "model" / f, bare / f)
    assert main(_args(tiny, tmp_path, "--model.path", str(bare))) == 2
    assert "cannot load the model weights" in capsys.readouterr().err
    join = _args(tiny, tmp_path, "--mesh.rows", "2", "--anchor.enabled", "--train.optimizer", "spectral",
                 "--anchor.join", "--anchor.store", f"127.0.0.1:{free_port()}")
    monkeypatch.delenv("MESHKERN_ANCHOR_SECRET", raising=False)
    assert main(join) == 2  # a joiner never makes the run's secret: it must be given one
    assert "needs the run's secret" in capsys.readouterr().err
    monkeypatch.setenv("MESHKERN_ANCHOR_SECRET", "ab" * 32)
    t0 = time.monotonic()
    assert main(join) == 2
    assert "cannot connect" in capsys.readouterr().err and time.monotonic() - t0 < 30


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_nccl_without_cuda_is_refused(tiny, tmp_path, capsys):
    assert main(_args(tiny, tmp_path, "--mesh.dist-backend", "nccl")) == 2
    assert "--mesh.dist-backend nccl needs CUDA GPUs" in capsys.readouterr().err
    assert main(_args(tiny, tmp_path, "--mesh.backend", "nccl")) == 2  # the field's old name still works
    assert "--mesh.dist-backend nccl needs CUDA GPUs" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(_args(tiny, tmp_path, "--mesh.device", "cuda")) == 2
        assert "--mesh.device cuda needs a CUDA GPU" in capsys.readouterr().err


def test_unknown_architecture_is_refused(tiny, tmp_path, capsys):
    bad = tmp_path / "gpt2"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                                                 "n_layer": 2, "n_embd": 16, "n_head": 2, "vocab_size": 300}))
    assert main(_args(tiny, tmp_path, "--model.path", str(bad))) == 2
    assert "cannot be split into stages" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm-to-launcher"])
def test_ctrl_c_saves_a_checkpoint_and_resume_continues(tiny, tmp_path, how):
    """SIGINT to the whole process group (what a terminal's Ctrl-C does), or SIGTERM to the
    launcher alone (a scheduler / container stop): every rank stops at the same step
    boundary, a checkpoint is written, the exit code is 130, and the printed command
    (--config RUN/config.yaml --checkpoint.resume latest) continues the run."""
    import signal
    import subprocess
    import sys

    argv = _args(tiny, tmp_path, "--mesh.rows", "1", "--mesh.stages", "2", "--train.steps", "100000",
                 "--checkpoint.every", "0")
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.Popen([sys.executable, "-m", "orchestration.train", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)
    metrics = tmp_path / "t" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
            time.sleep(0.2)
        assert metrics.exists(), "the run never started"
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    m = re.search(r"interrupted: checkpoint saved at step \d+ in \S+; continue with: python -m orchestration.train "
                  r"(--config \S+ --checkpoint.resume latest)", out)
    assert m, out
    ck = ckpt.resolve("latest", str(tmp_path / "t" / "checkpoints"))
    stopped = ckpt.read_meta(ck)["step"]
    assert 3 <= stopped < 100000
    cfg, _ = parse_args(m.group(1).split() + ["--train.steps", str(stopped + 2)])
    plan = prepare(cfg)
    res = run_local(run_rank, 2, (cfg, plan), timeout_s=120)
    assert len(res[1]["losses"]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    ["--boundary.codec", "topk", "--train.optimizer", "spectral", "--train.schedule", "gpipe",
     "--dp.mode", "allreduce", "--dp.compressor", "int8"],
    ["--boundary.codec", "int4", "--dp.mode", "diloco", "--dp.compressor", "sparseloco", "--dp.sync-every", "2"],
], ids=["topk-spectral-gpipe-int8", "int4-sparseloco"])
def test_other_codecs_optimizers_and_compressors_train(tiny, tmp_path, extra):
    from orchestration.codecs import make_codec

    cfg, plan, res = _run(_args(tiny, tmp_path, "--mesh.rows", "2", "--mesh.stages", "2", "--train.steps", "3",
                                *extra))
    assert all(l == l and l > 0 for l in res[1]["losses"])  # finite
    # PP bytes are exactly the codec's wire bytes: 3 steps x 2 micro-batches per replica.
    codec = make_codec(cfg.boundary.codec, p=cfg.boundary.p)
    per_mb = codec.wire_bytes((2, 32, 40), torch.float32, "fwd")
    assert res[0]["bytes"]["pp_fwd"] == 3 * 2 * per_mb
    links = json.load(open(os.path.join(plan.run_dir, "link_bytes.json")))["links"]
    assert links["pp_fwd:0->1"] == links["pp_fwd:2->3"] == 3 * 2 * per_mb
    assert res[0]["bytes"]["dp"] > 0


@pytest.mark.slow
def test_a_dense_tail_is_the_codec_run_continued_dense(tiny, tmp_path):
    """--boundary.dense-tail 2 of 4 steps: the first 2 steps are the int4 run's, the last 2
    those of its step-2 checkpoint resumed with --boundary.codec dense (bit for bit), and the
    pipeline bytes are 2 steps of int4 wire plus 2 of dense."""
    from orchestration.codecs import make_codec

    base = ["--mesh.rows", "1", "--mesh.stages", "2", "--train.steps", "4", "--checkpoint.every", "2",
            "--dp.mode", "none", "--boundary.codec", "int4"]
    _, _, tail = _run(_args(tiny, tmp_path / "tail", *base, "--boundary.dense-tail", "2"))
    _, plan, plain = _run(_args(tiny, tmp_path / "int4", *base))
    step2 = ckpt.step_dir(plan.ckpt_dir, 2)
    _, _, cont = _run(_args(tiny, tmp_path / "int4", *base, "--boundary.codec", "dense", "--checkpoint.resume", step2))
    assert tail[1]["losses"][:2] == plain[1]["losses"][:2]
    assert tail[1]["losses"][2:] == cont[1]["losses"] and tail[1]["losses"][2:] != plain[1]["losses"][2:]
    per_mb = {n: make_codec(n).wire_bytes((2, 32, 40), torch.float32, "fwd") for n in ("int4", "dense")}
    assert tail[0]["bytes"]["pp_fwd"] == 2 * 2 * per_mb["int4"] + 2 * 2 * per_mb["dense"]


@pytest.mark.slow
def test_tied_embeddings_stay_tied_across_stages(tiny, tmp_path):
    """A tied checkpoint split over 2 stages: the last stage's lm_head copy gets the summed
    gradient like stage 0's embedding, so the two copies remain equal after training."""
    from orchestration.models.loading import load_causal_lm

    model, _ = load_causal_lm(tiny / "model")
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    tied_dir = tmp_path / "tied"
    model.save_pretrained(tied_dir)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (tiny / "model" / f).exists():
            (tied_dir / f).write_bytes((tiny / "model" / f).read_bytes())
    cfg, plan, res = _run(_args(tiny, tmp_path, "--model.path", str(tied_dir), "--mesh.rows", "1",
                                "--mesh.stages", "2", "--train.steps", "3", "--train.lr", "1e-2"))
    last = ckpt.resolve("latest", plan.ckpt_dir)
    s0 = ckpt.load_rank_state(last, 0)["stage"]["embed_tokens.weight"]
    s1 = ckpt.load_rank_state(last, 1)["stage"]["lm_head.weight"]
    assert not torch.equal(s0, model.model.embed_tokens.weight)  # it trained
    torch.testing.assert_close(s0, s1, rtol=0, atol=0)
    reloaded, _ = load_causal_lm(last)  # the HF export has one copy and ties it again
    torch.testing.assert_close(reloaded.lm_head.weight, s0)


@pytest.mark.slow
def test_garbage_activations_from_a_peer_skip_the_step_not_corrupt_weights(tiny, tmp_path, monkeypatch):
    """A peer delivers NaN activations at step 1 (forked ranks inherit the patched codec):
    every stage of the replica skips that update, the weights stay finite, training goes on."""
    from orchestration import codecs
    from orchestration.components.metrics import read_jsonl

    real = codecs.DenseCodec.decode_fwd

    def poisoned(self, wire, key, shape, dtype):
        h = real(self, wire, key, shape, dtype)
        return h * float("nan") if key.step == 1 else h

    monkeypatch.setattr(codecs.DenseCodec, "decode_fwd", poisoned)
    cfg, plan, res = _run(_args(tiny, tmp_path, "--mesh.rows", "1", "--mesh.stages", "2", "--train.steps", "3",
                                "--boundary.codec", "dense"))
    recs = read_jsonl(os.path.join(plan.run_dir, "metrics.jsonl"))
    assert [r["skipped_steps"] for r in recs] == [0, 1, 1]
    assert recs[1]["loss"] != recs[1]["loss"] and recs[2]["loss"] == recs[2]["loss"]  # NaN, then finite again
    last = ckpt.resolve("latest", plan.ckpt_dir)
    for r in (0, 1):
        assert all(torch.isfinite(v).all() for v in ckpt.load_rank_state(last, r)["stage"].values())


def test_fast_replicas_see_the_same_data_with_and_without_the_anchor_row(tiny, tmp_path):
    """M95+AP (2 fast replicas + the anchor row) and M95 (2 fast replicas) with one seed: each
    fast replica trains on the very same batches in the same order (two epochs' worth);
    the replicas' shards are disjoint and cover the training rows; the anchor's batches come
    from the training rows only (never the held-out ones)."""
    from orchestration import anchor

    common = _args(tiny, tmp_path, "--train.seed", "3", "--mesh.stages", "2", "--anchor.microbatches", "2")
    cfg_ap, _ = parse_args([*common, "--preset", "m95-ap", "--mesh.rows", "3"])
    cfg_m, _ = parse_args([*common, "--preset", "m95", "--mesh.rows", "2"])
    plan_ap, plan_m = prepare(cfg_ap, load_model=False), prepare(cfg_m, load_model=False)
    assert cfg_ap.fast_rows == cfg_m.fast_rows == 2
    assert torch.equal(plan_ap.train_rows, plan_m.train_rows)
    shards = []
    for row in range(2):
        a, m = replica_sampler(cfg_ap, plan_ap, row), replica_sampler(cfg_m, plan_m, row)
        steps = 2 * a.per_epoch + 1
        assert all(torch.equal(a(s), m(s)) for s in range(steps))
        shards.append({tuple(r.tolist()) for s in range(a.per_epoch) for r in a(s)})
    train = {tuple(r.tolist()) for r in plan_m.train_rows}
    held = {tuple(r.tolist()) for r in plan_m.eval_rows}
    assert not shards[0] & shards[1]
    assert len(shards[0] | shards[1]) >= len(train) - 2 * cfg_m.train.batch_size  # all but each epoch's remainder
    got = {tuple(r.tolist()) for k in range(20) for r in anchor.round_batch(cfg_ap, plan_ap, k)}
    assert got <= train and not got & held and len(got) > cfg_ap.train.batch_size


def test_held_out_split_does_not_depend_on_the_training_seed(tiny, tmp_path):
    """Every seed of an experiment scores the same held-out rows; --data.split-seed (not
    --train.seed) chooses them."""
    plans = {}
    for seed, split in ((0, 0), (1, 0), (7, 0), (0, 1)):
        cfg, _ = parse_args(_args(tiny, tmp_path, "--train.seed", str(seed), "--data.split-seed", str(split)))
        plans[seed, split] = prepare(cfg, load_model=False)
    base = plans[0, 0]
    for key in ((1, 0), (7, 0)):
        assert torch.equal(plans[key].eval_rows, base.eval_rows) and torch.equal(plans[key].train_rows, base.train_rows)
    assert not torch.equal(plans[0, 1].eval_rows, base.eval_rows)


def test_a_checkpoint_kept_for_its_model_does_not_take_a_newer_ones_place(tmp_path):
    """Across hosts the leader keeps the newest checkpoint whose model landed (step 2) while a
    later one's model was skipped (step 4): with --checkpoint.keep 2 the two newest (4, 6) stay
    as well, so every disk still holds step 4 to resume from."""
    root = tmp_path / "ck"
    for step in (2, 4, 6):
        (root / f"step_{step:08d}").mkdir(parents=True)
    ckpt._prune(str(root), 2, {"step_00000006"}, {"step_00000002"})
    assert sorted(os.listdir(root)) == ["step_00000002", "step_00000004", "step_00000006"]
    ckpt._prune(str(root), 2, {"step_00000006"}, {"step_00000006"})  # the model is the one just written
    assert sorted(os.listdir(root)) == ["step_00000004", "step_00000006"]
