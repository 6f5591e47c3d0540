"""User mistakes on the evaluate and pretrain command lines (issue #14 item 8): one
``error: ...`` line on stderr and exit code 2, never a traceback. And evaluate verifies a
trainer checkpoint before loading it (item 5)."""
import shutil
import subprocess
import sys

import pytest

from orchestration import evaluate

from orchestration.models import pretrain

from test_checkpoint_verify import ARGS, _truncate  # noqa: F401 (the fixture below uses them)
from test_train import _args


def _one_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line]
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize("argv, message", [
    (["--model", "/no/such/model"], "--model '/no/such/model' does not exist"),
    (["--data", "/no/such.txt"], "--data source '/no/such.txt' does not exist"),
    (["--seq-len", "-1"], "--seq-len must be >= 2"),
    (["--max-batches", "-1"], "--max-batches must be >= 0"),
    (["--n-task", "0"], "--n-task must be >= 1"),
    (["--prune", "1.5"], "--prune fractions must be in [0, 1)"),
    (["--tasks", "nope"], "--tasks: unknown task(s) nope"),
    (["--tokenizer", "/no/tok"], "--tokenizer '/no/tok' does not exist"),
])
def test_evaluate_user_mistakes(tiny, argv, message, capsys):
    full = ["--model", str(tiny / "model"), *argv] if argv[0] != "--model" else argv
    assert evaluate.main(full) == 2
    assert message in _one_error_line(capsys)


def test_evaluate_a_directory_that_is_no_model(tmp_path, capsys):
    assert evaluate.main(["--model", str(tmp_path)]) == 2
    assert "no config.json" in _one_error_line(capsys)


@pytest.mark.parametrize("argv, message", [
    (["--steps", "-1"], "--steps must be a positive int, got -1"),
    (["--lr", "0"], "--lr must be > 0"),
    (["--init-from", "/no/such/ckpt"], "--init-from '/no/such/ckpt' does not exist"),
    (["--corpus", "/no/such.txt"], "--corpus '/no/such.txt' is neither an embedded domain"),
])
def test_pretrain_user_mistakes(tmp_path, argv, message, capsys):
    assert pretrain.main(["--out", str(tmp_path / "out"), "--no-progress", *argv]) == 2
    assert message in _one_error_line(capsys)


def test_pretrain_refuses_a_non_empty_out(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("x")
    assert pretrain.main(["--out", str(tmp_path / "out"), "--no-progress"]) == 2
    assert "exists and is not empty" in _one_error_line(capsys)


@pytest.mark.slow
def test_the_module_entry_points_exit_2_without_a_traceback(tmp_path):
    for mod, argv in (("orchestration.evaluate", ["--model", "/no/such/model"]),
                      ("orchestration.models.pretrain", ["--out", str(tmp_path / "o"), "--steps", "-1"]),
                      ("orchestration.experiments", ["--model", "/no/such/model"])):
        p = subprocess.run([sys.executable, "-m", mod, *argv], capture_output=True, text=True, timeout=300)
        assert p.returncode == 2 and "Traceback" not in p.stderr and p.stderr.startswith("error: "), p.stderr


@pytest.mark.parametrize("model", ["/no/such/model", "no-such-builtin", "rel/missing.gguf"])
def test_experiments_checks_a_missing_model_up_front(model, tmp_path, capsys, monkeypatch):
    from orchestration.experiments import cli as experiments
    from orchestration.models import paths as model_paths

    monkeypatch.setattr(model_paths, "default_base_model", lambda *a, **k: pytest.fail("resolved a model"))
    assert experiments.main(["--model", model, "--rows", "m95", "--seeds", "0", "--work", str(tmp_path)]) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"error: --model {model!r} does not exist") and "smollm2-135m" in line
    assert not (tmp_path / "m95-s0").exists()


@pytest.fixture(scope="module")
def checkpoint_dir(tiny, tmp_path_factory):
    from orchestration import train

    out = tmp_path_factory.mktemp("cli")
    assert train.main(_args(tiny, out, *ARGS, "--train.steps", "1")) == 0
    return out / "t" / "checkpoints" / "step_00000001"


@pytest.mark.slow
def test_evaluate_verifies_a_trainer_checkpoint(checkpoint_dir, tmp_path, capsys):
    good = tmp_path / "ck"
    shutil.copytree(checkpoint_dir, good)
    assert evaluate.main(["--model", str(good), "--data", "corpus:python", "--max-batches", "1"]) == 0
    capsys.readouterr()
    _truncate(good / "model-00001-of-00002.safetensors")
    assert evaluate.main(["--model", str(good), "--max-batches", "1"]) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"error: checkpoint {good} is corrupt: model-00001-of-00002.safetensors has")
