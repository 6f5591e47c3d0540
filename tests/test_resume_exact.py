"""Exact resume (issue #14 item 6): a run that crashed after a checkpoint taken while a
DiLoCo fragment's sync was in flight, resumed with --checkpoint.resume latest, logs
bit-identically the losses of an uninterrupted run, and its metrics.jsonl holds every
step once. The default preset's DP sync: Streaming DiLoCo + PowerSGD, overlap 1."""
import pytest

from orchestration import checkpoint as ckpt
from orchestration.launch import MeshFailure
from orchestration.metrics import read_jsonl

from test_train import _args, _run


@pytest.mark.slow
def test_crash_then_resume_is_bit_identical_mid_sync_and_logs_each_step_once(tiny, tmp_path):
    common = ["--mesh.rows", "2", "--mesh.stages", "2", "--train.steps", "8", "--boundary.codec", "mask",
              "--boundary.p", "0.95", "--dp.mode", "diloco", "--dp.compressor", "powersgd", "--dp.sync-every", "4",
              "--dp.fragments", "2", "--dp.overlap-steps", "1"]
    full_args = _args(tiny, tmp_path, *common)
    full_args[full_args.index("--run.name") + 1] = "full"
    _, plan_full, res = _run(full_args)
    full = read_jsonl(f"{plan_full.run_dir}/metrics.jsonl")
    assert [r["step"] for r in full] == list(range(1, 9))

    # Checkpoints at steps 2, 4, 6 (fragment 0's syncs start at steps 2 and 6, fragment 1's
    # at 4, each merged one step later: every checkpoint has a sync in flight); rank 3
    # dies before step 6, after step 5 was logged.
    cut = _args(tiny, tmp_path, *common, "--checkpoint.every", "2")
    with pytest.raises(MeshFailure, match="rank 3"):
        _run([*cut, "--run.fail-rank", "3", "--run.fail-step", "5"])
    root = str(tmp_path / "t" / "checkpoints")
    last = ckpt.resolve("latest", root)
    assert ckpt.read_meta(last)["step"] == 4
    pending = ckpt.load_rank_state(last, 0)["diloco"]["pending"]
    assert [(p["fragment"], p["start"], p["due"]) for p in pending] == [(1, 4, 5)]  # saved mid-sync
    before = read_jsonl(str(tmp_path / "t" / "metrics.jsonl"))
    assert [r["step"] for r in before] == [1, 2, 3, 4, 5]
    # saving did not change the trajectory
    assert [r["loss"] for r in before] == [r["loss"] for r in full[:5]]

    _, plan, res2 = _run([*cut, "--checkpoint.resume", "latest"])
    assert res2[1]["losses"] == res[1]["losses"][4:]  # replica 0, bit for bit
    assert res2[3]["losses"] == res[3]["losses"][4:]  # replica 1
    recs = read_jsonl(f"{plan.run_dir}/metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(1, 9))  # each step once
    for a, b in zip(recs, full):
        assert (a["loss"], a["grad_norm"], a["bytes"]) == (b["loss"], b["grad_norm"], b["bytes"]), a["step"]
