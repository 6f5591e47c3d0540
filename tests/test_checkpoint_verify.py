"""Checkpoints are verified (issue #14 item 5, issue #18): every file's sha256 and size in
meta.json, checked in prepare before any process is spawned and by evaluate; a corrupt
`latest` falls back to the newest valid checkpoint; a rank dying mid-save leaves only a
.tmp directory that is never read."""
import os
import shutil
import signal

import pytest
import torch

from orchestration.components import checkpoint as ckpt
from orchestration import train
from orchestration.launch.processes import MeshFailure

from test_train import _args, _run

ARGS = ("--mesh.rows", "1", "--mesh.stages", "2", "--checkpoint.every", "1", "--checkpoint.keep", "5")


@pytest.fixture(scope="module")
def finished_run(tiny, tmp_path_factory):
    """A 2-step run with checkpoints at steps 1 and 2 (copied by each test)."""
    out = tmp_path_factory.mktemp("verified")
    assert train.main(_args(tiny, out, *ARGS, "--train.steps", "2")) == 0
    return out / "t"


@pytest.fixture
def run_copy(finished_run, tmp_path):
    shutil.copytree(finished_run, tmp_path / "t")
    return tmp_path / "t" / "checkpoints"


def _truncate(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)


def _no_spawn(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a worker was spawned")

    from orchestration.launch import local

    monkeypatch.setattr(local, "run_local", refuse)


@pytest.mark.slow
def test_meta_lists_every_file_with_its_sha256(run_copy):
    meta = ckpt.verify(str(run_copy / "step_00000002"))
    names = set(meta["files"])
    assert {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "rank_00000.pt",
            "rank_00001.pt", "model.safetensors.index.json", "config.json"} <= names
    assert all(len(v["sha256"]) == 64 and v["size"] > 0 for v in meta["files"].values())


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["model-00001-of-00002.safetensors", "rank_00001.pt"])
def test_truncated_file_is_refused_before_any_worker_spawns(tiny, tmp_path, run_copy, monkeypatch, capfd, victim):
    step2 = run_copy / "step_00000002"
    _truncate(step2 / victim)
    _no_spawn(monkeypatch)
    capfd.readouterr()
    rc = train.main(_args(tiny, tmp_path, *ARGS, "--train.steps", "4", "--checkpoint.resume", str(step2)))
    err = capfd.readouterr().err
    assert rc == 2
    assert f"checkpoint {step2} is corrupt: {victim} has" in err and "truncated" in err
    assert "resumed from" not in err and "Traceback" not in err


@pytest.mark.slow
def test_flipped_byte_is_caught_by_the_sha256(run_copy):
    p = run_copy / "step_00000002" / "rank_00000.pt"
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match="rank_00000.pt does not match its sha256"):
        ckpt.verify(str(run_copy / "step_00000002"))


@pytest.mark.slow
def test_corrupt_latest_falls_back_to_the_newest_valid_checkpoint(tiny, tmp_path, run_copy, capfd):
    _truncate(run_copy / "step_00000002" / "model-00002-of-00002.safetensors")
    capfd.readouterr()
    rc = train.main(_args(tiny, tmp_path, *ARGS, "--train.steps", "3", "--checkpoint.resume", "latest"))
    err = capfd.readouterr().err
    assert rc == 0, err
    step1 = str(run_copy / "step_00000001")
    assert "`latest` is unusable" in err and f"falling back to the newest valid checkpoint {step1}" in err
    assert f"resumed from {step1} at step 1" in err
    assert ckpt.read_meta(ckpt.resolve("latest", str(run_copy)))["step"] == 3


@pytest.mark.slow
def test_no_valid_checkpoint_at_all_is_a_named_error(run_copy):
    for d in ("step_00000001", "step_00000002"):
        _truncate(run_copy / d / "rank_00000.pt")
    with pytest.raises(ckpt.CheckpointError, match="no other valid checkpoint"):
        ckpt.resolve("latest", str(run_copy))


@pytest.mark.slow
def test_resolve_rejects_a_checkpoint_without_meta_json(run_copy):
    os.remove(run_copy / "step_00000002" / "meta.json")
    with pytest.raises(ckpt.CheckpointError, match=r"not a complete checkpoint \(no meta.json\)"):
        ckpt.resolve(str(run_copy / "step_00000002"), str(run_copy))


@pytest.mark.slow
def test_load_rank_state_names_the_missing_rank(run_copy):
    os.remove(run_copy / "step_00000002" / "rank_00001.pt")
    with pytest.raises(ckpt.CheckpointError, match=r"no state for rank 1 \(rank_00001.pt is missing\)"):
        ckpt.load_rank_state(str(run_copy / "step_00000002"), 1)
    with pytest.raises(ckpt.CheckpointError, match="rank_00001.pt is missing"):
        ckpt.verify(str(run_copy / "step_00000002"))


def test_a_rank_dying_mid_save_leaves_only_tmp_and_resolve_ignores_it(tiny, tmp_path, monkeypatch):
    real = ckpt.write_rank_state

    def dying(tmp, rank, state, **kw):  # forked ranks inherit the patch
        if rank == 1 and tmp.endswith("step_00000002.tmp"):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(tmp, rank, state, **kw)

    monkeypatch.setattr(ckpt, "write_rank_state", dying)
    with pytest.raises(MeshFailure, match="rank 1"):
        _run(_args(tiny, tmp_path, *ARGS, "--train.steps", "4"))
    root = tmp_path / "t" / "checkpoints"
    assert sorted(os.listdir(root)) == ["latest", "step_00000001", "step_00000002.tmp"]
    assert ckpt.resolve("latest", str(root)) == str(root / "step_00000001")
    assert ckpt.newest_valid(str(root)) == str(root / "step_00000001")
    with pytest.raises(ckpt.CheckpointError, match="no meta.json"):
        ckpt.verify(str(root / "step_00000002.tmp"))


def test_non_finite_weights_are_never_saved(tiny, tmp_path, monkeypatch):
    """Checkpointer.save refuses (every rank agrees) when any rank's weights are not finite."""
    from orchestration.trainer import Trainer

    real = Trainer.step

    def poisoned(self, step):
        out = real(self, step)
        if step == 1 and self.mesh.rank == 1:
            with torch.no_grad():
                next(self.stage.parameters()).fill_(float("nan"))
        return out

    monkeypatch.setattr(Trainer, "step", poisoned)
    _, plan, res = _run(_args(tiny, tmp_path, *ARGS, "--train.steps", "3", "--train.max-bad-steps", "0",
                              "--run.eval-sequences", "0"))
    root = plan.ckpt_dir
    assert sorted(d for d in os.listdir(root) if d.startswith("step_")) == ["step_00000001"]
    assert ckpt.resolve("latest", root).endswith("step_00000001")
