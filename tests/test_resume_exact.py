"""Exact resume (issue #14 item 6): a run that crashed after a checkpoint taken while a
DiLoCo fragment's sync was in flight, resumed with --checkpoint.resume latest, logs
bit-identically the losses of an uninterrupted run, and its metrics.jsonl holds every
step once. The default preset's DP sync: Streaming DiLoCo + PowerSGD, overlap 1."""
import pytest
import torch

from orchestration import anchor as A
from orchestration.components import checkpoint as ckpt
from orchestration.launch.processes import MeshFailure
from orchestration.components.metrics import read_jsonl

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


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["factored", "dense"])
def test_m95_ap_delay_mode_crash_then_resume_is_bit_identical(tiny, tmp_path, transport):
    """Issue #14's exact resume for the m95-ap preset in deterministic delay mode (the
    anchor's update of snapshot v applied exactly at step v + 2; snapshots every 2 steps,
    int8-delta snapshot stream): fast rank 1 dies before step 6, the run resumes from its
    step-3 checkpoint, and every step's loss and the final weights equal an uninterrupted
    run's bit for bit. At step 3 the update of snapshot 2 is due at step 4 and not yet
    applied: the resumed replica 0 re-serves snapshot 2 (kept in its checkpoint, sent as
    the anchor's int8 view of it), and the new anchor row continues from its state before
    round 1 (round counter = data position, factored momentum). Factored transport is the
    preset's; dense is pinned."""
    from test_anchor import _argv, _run as _run_anchor

    pin = () if transport == "factored" else ("--anchor.transport", "dense")
    common = ("--train.steps", "8", "--anchor.delay", "2", "--anchor.snapshot-every", "2", "--checkpoint.every", "3",
              "--mesh.timeout-s", "120", *pin)
    cfg, plan_full, res_full, full = _run_anchor(_argv(tiny, tmp_path, "full", *common))
    assert cfg.anchor.transport == transport and cfg.anchor.snapshot_codec == "int8"
    assert [r["step"] for r in full] == list(range(1, 9))
    assert full[-1]["anchor_applied"] == 3 and full[-1]["anchor_staleness_hist"] == {"2": 3}  # versions 0, 2, 4

    cut = _argv(tiny, tmp_path, "cut", *common)
    with pytest.raises(MeshFailure, match="rank 1"):
        _run_anchor([*cut, "--run.fail-rank", "1", "--run.fail-step", "5"])
    root = str(tmp_path / "cut" / "checkpoints")
    last = ckpt.resolve("latest", root)
    assert ckpt.read_meta(last)["step"] == 3
    saved = ckpt.load_rank_state(last, 0)["anchor"]
    assert sorted(saved["kept"]) == [2] and saved["view"]["version"] == 0  # snapshot 2's update is due at step 4

    _, plan, res, recs = _run_anchor([*cut, "--checkpoint.resume", "latest"])
    assert [r["restored"] for r in res[2:]] == [
        f"restored round 1 from {A.round_state_path(plan, s, 1)}" for s in (0, 1)]
    assert [r["step"] for r in recs] == list(range(1, 9))
    for a, b in zip(recs, full):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), a["step"]
    assert recs[-1]["anchor_applied"] == 3 and recs[-1]["anchor_staleness_hist"] == {"2": 3}
    assert res[1]["losses"] == res_full[1]["losses"][3:]
    end, end_full = ckpt.resolve("latest", plan.ckpt_dir), ckpt.resolve("latest", plan_full.ckpt_dir)
    for r in (0, 1):
        got, want = ckpt.load_rank_state(end, r), ckpt.load_rank_state(end_full, r)
        assert got["step"] == want["step"] == 8
        assert got["stage"].keys() == want["stage"].keys()
        for k in want["stage"]:
            assert torch.equal(got["stage"][k], want["stage"][k]), (r, k)
