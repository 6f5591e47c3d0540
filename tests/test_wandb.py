"""--run.wandb (issue #42): a real offline W&B run beside metrics.jsonl, read back from
its .wandb transaction log: the same scalars at the same steps, the run's config, a
clean finish, and a resume that continues the same W&B run after its checkpoint's step.
Without the wandb package, one warning line and the run goes on."""
import glob
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import yaml

pytest.importorskip("wandb")

from orchestration.components import metrics  # noqa: E402
from orchestration.components.metrics import open_wandb, read_jsonl, scalars  # noqa: E402
from orchestration.config import parse_args  # noqa: E402
from orchestration.train import main  # noqa: E402

from test_train import _args  # noqa: E402


def _wandb_records(path: str, cwd) -> list[dict]:
    """Every record of the .wandb transaction log at ``path``, as wandb's own reader
    (``wandb leet inspect --json``, wandb >= 0.31: the Python reader is gone) prints them."""
    p = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", path, "--json"], cwd=cwd,
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "WANDB_ERROR_REPORTING": "false"})
    assert p.returncode == 0, p.stderr
    return [json.loads(line) for line in p.stdout.splitlines() if line.strip()]


def _offline_runs(run_dir) -> list[str]:
    """The .wandb logs of RUN_DIR/wandb's offline runs, oldest first (the folder names
    start with their start time; two in the same second get a suffix, so compare mtimes)."""
    return sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb")), key=os.path.getmtime)


def _history(records: list[dict]) -> dict[int, dict]:
    """{step: the row's scalars} of the log's history records (wandb's own keys, _step,
    _runtime, _timestamp, left out)."""
    return {r["history"]["step"]["num"]: {k: v for k, v in r["history"]["item"].items() if not k.startswith("_")}
            for r in records if r["type"] == "history"}


def _one(records: list[dict], kind: str) -> dict:
    found = [r[kind] for r in records if r["type"] == kind]
    assert len(found) == 1, (kind, len(found))
    return found[0]


@pytest.mark.slow
def test_an_offline_wandb_run_holds_metrics_jsonls_scalars_and_the_config_and_a_resume_continues_it(
        tiny, tmp_path, capfd, monkeypatch):
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):  # wandb's own files stay in tmp_path too
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    base = _args(tiny, tmp_path, "--mesh.rows", "1", "--mesh.stages", "1", "--checkpoint.every", "2",
                 "--run.log-every", "2", "--run.wandb", "--run.wandb-mode", "offline", "--run.wandb-project", "p")
    run_dir = tmp_path / "t"
    assert main(base + ["--train.steps", "3"]) == 0
    out = capfd.readouterr().out
    assert out.splitlines()[0] == (f"run folder: {run_dir}/ (config.yaml, metrics.jsonl, checkpoints/, wandb/; "
                                   "a summary at the end)")
    assert "checkpoints/, wandb/" in out  # the summary's run folder line
    [first] = _offline_runs(run_dir)
    recs = _wandb_records(first, tmp_path)
    logged = read_jsonl(str(run_dir / "metrics.jsonl"))
    assert [r["step"] for r in logged] == [2, 3]  # every 2nd step and the last
    assert _history(recs) == {r["step"]: scalars(r) for r in logged}
    run = _one(recs, "run")
    assert run["project"] == "p" and run["display_name"] == "t"
    config = {k: v for k, v in run["config"]["update"].items() if k != "_wandb"}
    assert config == yaml.safe_load((run_dir / "config.yaml").read_text())  # the config the run records
    assert config["run"]["wandb_mode"] == "offline" and config["train"]["steps"] == 3
    assert _one(recs, "exit")["exit_code"] == 0  # finished, not crashed

    assert main(base + ["--train.steps", "5", "--checkpoint.resume", "latest"]) == 0
    capfd.readouterr()
    old, new = _offline_runs(run_dir)
    assert old == first
    recs = _wandb_records(new, tmp_path)
    logged = read_jsonl(str(run_dir / "metrics.jsonl"))
    assert [r["step"] for r in logged] == [2, 3, 4, 5]
    assert _history(recs) == {r["step"]: scalars(r) for r in logged[2:]}  # steps after the resume step (3) only
    assert _one(recs, "run")["run_id"] == run["run_id"]  # the same W&B run goes on
    assert _one(recs, "exit")["exit_code"] == 0


def test_wandb_without_the_package_is_a_warning_not_an_error(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(metrics, "wandb_available", lambda: False)
    assert main(_args(tiny, tmp_path, "--run.wandb", "--data", str(tmp_path / "missing.txt"))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == ("warning: --run.wandb: the wandb package is not installed (pip install wandb); "
                      "logging to metrics.jsonl only")
    assert err[1].startswith("error: --data.source")


def test_open_wandb_without_the_package_logs_to_metrics_jsonl_only(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    cfg, _ = parse_args(["--run.wandb"])
    assert open_wandb(cfg, str(tmp_path), 0) is None
    assert "(pip install wandb)" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "wandb")


def test_wandb_mode_is_checked():
    with pytest.raises(ValueError, match="--run.wandb-mode must be one of offline, online, disabled"):
        parse_args(["--run.wandb", "--run.wandb-mode", "cloud"])


def test_a_resume_continues_the_recorded_wandb_run_id_and_a_new_run_gets_a_new_one(tmp_path):
    d = str(tmp_path / "wandb")
    rid = metrics.wandb_run_id(d, 0)
    assert metrics.wandb_run_id(d, 40) == rid
    assert metrics.wandb_run_id(d, 0) != rid


def test_runlog_mirrors_each_logged_record_to_wandb_at_its_step(tmp_path, monkeypatch):
    runs = []

    class FakeRun:
        def __init__(self):
            self.logged, self.finished = [], False
            runs.append(self)

        def log(self, data, step):
            self.logged.append((data, step))

        def finish(self):
            self.finished = True

    monkeypatch.setattr(metrics, "open_wandb", lambda cfg, run_dir, start: FakeRun())
    monkeypatch.setattr(metrics, "close_wandb", lambda run: run.finish())
    from test_cli_run import _rec

    cfg, _ = parse_args(["--train.steps", "4", "--run.wandb", "--run.log-every", "2", "--run.progress", "false"])
    log = metrics.RunLog(cfg, SimpleNamespace(run_dir=str(tmp_path)), 0, active=True)
    for step in range(4):
        log.record(_rec(step + 1, loss=5.0 - step), step)
    log.close()
    [run] = runs
    assert run.finished
    assert run.logged == [(scalars(r), r["step"]) for r in read_jsonl(str(tmp_path / "metrics.jsonl"))]
    assert [s for _, s in run.logged] == [2, 4]
