"""What a run prints and writes for a newcomer (issue #17): the run folder first, plain
progress lines when stdout is no terminal, a summary that explains each figure in a line
(and why modeled and measured tokens/s differ), a resumed run's summary that separates
the whole run from this invocation, TensorBoard scalars equal to metrics.jsonl's, and a
helpful error for ``--checkpoint.resume latest`` without a run name."""
import os
import re
import subprocess
import sys
import types
from types import SimpleNamespace

import pytest

from orchestration.components import metrics
from orchestration.config import parse_args
from orchestration.components.metrics import RunLog, read_jsonl, scalars
from orchestration.components.run_summary import format_summary, summary_rows
from orchestration.train import main

from test_train import _args


def _summary(**over):
    s = {"mesh": "3x2 (3 fast replicas x 2 stages)", "model": "LlamaForCausalLM (4 layers, H=128) from m",
         "codec": "mask p=0.95", "dp": "diloco + powersgd", "steps": 60, "tokens": 184320, "loss_first": 6.3,
         "loss_last": 5.1, "eval_loss": 5.2, "eval_loss_base": 6.2, "skipped_steps": 0, "bad_steps": 0,
         "tokens_per_s": 3828.8, "modeled_tokens_per_s": 6214.6, "modeled_limit": "pipeline",
         "bandwidth_bps": 200e6, "bytes_per_token": {"pp_fwd": 40.0, "pp_bwd": 40.0, "dp": 38.0, "anchor": 0.0},
         "bytes_per_token_pp": 80.0, "bytes_per_token_total": 118.0, "checkpoint": "runs/x/checkpoints/step_60",
         "metrics_path": "runs/x/metrics.jsonl", "links_path": "runs/x/link_bytes.json", "run_dir": "runs/x",
         "ranks": 6, "start_step": 0, "steps_this": 60, "loss_first_run": None}
    s.update(over)
    return s


def test_the_summary_explains_every_figure_in_one_line():
    text = format_summary(_summary())
    lines = text.splitlines()
    assert lines[0] == "meshkern run summary"
    body = lines[2:]
    assert len(body) == 2 * len(summary_rows(_summary()))  # a figure, then its one line
    for fig, why in zip(body[::2], body[1::2]):
        assert not fig.startswith(" ") and why.lstrip().startswith("- ") and len(why.strip()) > 10, (fig, why)
    assert re.search(r"^modeled tokens/s @ 200 Mbps +6214\.6$", text, re.M)
    assert re.search(r"^measured tokens/s +3828\.8$", text, re.M)
    why = text[text.index("why they differ"):]
    assert "share its cores" in why and "200 Mbps links" in why and "Shared cores make measured lower" in why
    assert "replica sync" in text and "activations sent forward" in text  # what each bytes/token axis is
    assert "(whole run)" not in text and "this invocation" not in text


def test_a_resumed_runs_summary_separates_the_whole_run_from_this_invocation():
    text = format_summary(_summary(start_step=40, steps_this=20, loss_first_run=7.0, loss_first=5.5))
    assert re.search(r"^steps \(whole run\) +60 ", text, re.M)
    assert re.search(r"^this invocation +steps 41\.\.60 \(20 steps\), resumed from step 40$", text, re.M)
    assert re.search(r"^loss first -> last \(whole run\) +7\.0000 -> 5\.1000$", text, re.M)
    assert re.search(r"^loss first -> last \(this invocation\) +5\.5000 -> 5\.1000$", text, re.M)
    assert re.search(r"^measured tokens/s \(this invocation\) +3828\.8$", text, re.M)
    assert re.search(r"^bytes/token dp \(whole run\) +38\.0$", text, re.M)


def _rec(step, loss=5.0):
    return {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 0.5, "tokens": step * 100, "step_s": 0.1,
            "tokens_per_s": 1000.0, "skipped_steps": 0, "fwd_s": [0.01, 0.02], "bwd_s": [0.03, 0.04],
            "bytes": {a: step * 10 for a in metrics.AXES}, "dp_bytes_by_stage": [step, step],
            "bytes_per_token": {a: 0.1 for a in metrics.AXES}, "anchor_link": None}


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_progress_is_plain_periodic_lines_when_stdout_is_no_terminal(tmp_path):
    cfg, _ = parse_args(["--train.steps", "10", "--run.progress-every-s", "30"])
    clock, out = FakeClock(), open(tmp_path / "out.log", "w")
    log = RunLog(cfg, SimpleNamespace(run_dir=str(tmp_path)), 0, active=True, clock=clock, out=out)
    assert log.bar is None  # a file is no terminal
    for step in range(10):
        clock.t = 10.0 * step  # 10 s a step: a line at steps 1, 4, 7 (30 s apart) and the last
        log.record(_rec(step + 1), step)
    log.close()
    out.close()
    text = (tmp_path / "out.log").read_text()
    assert "\r" not in text
    lines = text.splitlines()
    assert [int(re.match(r"train step (\d+)/10 \| loss", l).group(1)) for l in lines] == [1, 4, 7, 10]
    assert len(read_jsonl(str(tmp_path / "metrics.jsonl"))) == 10


def test_progress_is_a_bar_on_a_terminal(tmp_path):
    cfg, _ = parse_args(["--train.steps", "3"])
    log = RunLog(cfg, SimpleNamespace(run_dir=str(tmp_path)), 0, active=True, isatty=True,
                 out=open(os.devnull, "w"))
    assert log.bar is not None
    log.close_bar()
    log.close()


class FakeWriter:
    made = []

    def __init__(self, log_dir, purge_step=None):
        self.log_dir, self.purge_step, self.scalars, self.closed = log_dir, purge_step, [], False
        FakeWriter.made.append(self)

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def close(self):
        self.closed = True


def test_tensorboard_gets_the_same_scalars_as_metrics_jsonl(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=FakeWriter))
    cfg, _ = parse_args(["--train.steps", "4", "--run.tensorboard", "--run.log-every", "2", "--run.progress", "false"])
    log = RunLog(cfg, SimpleNamespace(run_dir=str(tmp_path)), 0, active=True)
    for step in range(4):
        log.record(_rec(step + 1, loss=5.0 - step), step)
    log.close()
    w = FakeWriter.made[-1]
    assert w.log_dir == str(tmp_path / "tensorboard") and w.closed
    want = [(tag, v, r["step"]) for r in read_jsonl(str(tmp_path / "metrics.jsonl")) for tag, v in scalars(r).items()]
    assert w.scalars == want and len(want) > 0
    tags = {t for t, _, _ in want}
    assert {"loss", "tokens_per_s", "bytes_per_token/dp", "fwd_s/1", "dp_bytes_by_stage/0"} <= tags
    assert "step" not in tags and "anchor_link" not in tags  # the x axis; None is no scalar


def test_tensorboard_for_real_when_installed(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg, _ = parse_args(["--train.steps", "2", "--run.tensorboard", "--run.progress", "false"])
    log = RunLog(cfg, SimpleNamespace(run_dir=str(tmp_path)), 0, active=True)
    for step in range(2):
        log.record(_rec(step + 1, loss=4.0 + step), step)
    log.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 4.0), (2, 5.0)]


def test_tensorboard_without_the_package_is_a_warning_not_an_error(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(metrics, "tensorboard_available", lambda: False)
    assert main(_args(tiny, tmp_path, "--run.tensorboard", "--data", str(tmp_path / "missing.txt"))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("warning: --run.tensorboard: the tensorboard package is not installed")
    assert err[1].startswith("error: --data.source")


def _without_name(argv):
    i = argv.index("--run.name")
    return argv[:i] + argv[i + 2:]


def test_resume_latest_without_a_run_name_lists_the_runs(tiny, tmp_path, capsys):
    argv = _without_name(_args(tiny, tmp_path, "--checkpoint.resume", "latest"))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "which run? name the run: --run.name NAME, or --config RUN_DIR/config.yaml" in err[0]
    assert f"no run under {tmp_path}/ has a checkpoint" in err[0]
    for name in ("a-run", "b-run"):
        os.makedirs(tmp_path / name / "checkpoints")
        (tmp_path / name / "checkpoints" / "latest").write_text("step_2")
    os.makedirs(tmp_path / "no-ckpt")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"runs under {tmp_path}/ with a checkpoint: a-run, b-run " in err[0]
    assert f"--config {tmp_path}/b-run/config.yaml --checkpoint.resume latest" in err[0]


@pytest.mark.slow
def test_a_run_names_its_folder_first_and_a_resume_separates_its_part(tiny, tmp_path, capfd):
    base = _args(tiny, tmp_path, "--mesh.rows", "1", "--mesh.stages", "2", "--run.progress", "true",
                 "--checkpoint.every", "2")
    assert main(base + ["--train.steps", "2"]) == 0
    out = capfd.readouterr().out
    lines = out.splitlines()
    assert lines[0] == f"run folder: {tmp_path}/t/ (config.yaml, metrics.jsonl, checkpoints/; a summary at the end)"
    assert "\r" not in out and re.search(r"^train step 2/2 \| loss ", out, re.M)  # plain progress: no terminal
    assert "meshkern run summary" in out and "why they differ" in out
    assert main(base + ["--train.steps", "4", "--checkpoint.resume", "latest"]) == 0
    out = capfd.readouterr().out
    assert re.search(r"^this invocation +steps 3\.\.4 \(2 steps\), resumed from step 2$", out, re.M)
    assert re.search(r"^steps \(whole run\) +4 ", out, re.M) and "loss first -> last (whole run)" in out


def test_other_progress_bars_update_rarely_in_a_log_file():
    """The base model build's and a GGUF conversion's tqdm bars (drawn before the mesh
    starts) redraw every 30 s, not 10 times a second, when the output goes to a file."""
    code = ("import os, orchestration.train; from tqdm import tqdm; "
            "print(tqdm(total=1, file=open(os.devnull, 'w')).mininterval)")
    env = {k: v for k, v in os.environ.items() if k != "TQDM_MININTERVAL"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "30.0", p.stderr


def test_slow_rates_and_runs_across_hosts_are_said_as_they_are():
    from orchestration.components.run_summary import format_rate

    assert [format_rate(b) for b in (200e6, 1.5e6, 0.5e6, 64e3)] == ["200 Mbps", "1.5 Mbps", "500 kbps", "64 kbps"]
    text = format_summary(_summary(bandwidth_bps=0.5e6, links_local=False))
    assert re.search(r"^modeled tokens/s @ 500 kbps +6214\.6$", text, re.M)
    why = text[text.index("why they differ"):]
    assert "links are local" not in why and "these hosts" in why and "500 kbps links" in why


def test_links_are_local_when_the_rendezvous_is_loopback(monkeypatch):
    from orchestration.components.metrics import links_local

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert links_local()
    monkeypatch.setenv("MASTER_ADDR", "10.213.0.2")
    assert not links_local()
