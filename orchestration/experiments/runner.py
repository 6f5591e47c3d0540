"""One (row, seed) of the experiment tool: the trainer as a subprocess, then its evaluation,
recorded atomically (a finished row is never run again). An interrupted row (killed, timed
out, the machine stopped) continues from its last checkpoint when it runs again with the
same trainer flags (the trainer's exact resume), so a long row can be trained over several
invocations."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

from orchestration.experiments.evaluation import evaluate_run
from orchestration.experiments.rows import Row, Settings, _write_json, load_result, result_path, trainer_argv

ROW_FILE = "row.json"  # in a row's run directory: the trainer flags it was started with


def resume_point(run_dir: str, argv: list[str]) -> tuple[str, int] | None:
    """(checkpoint, step) an interrupted row continues from: the run directory's latest
    complete checkpoint, if the run was started with exactly these trainer flags (its
    ROW_FILE); None when there is nothing to continue (start over)."""
    from orchestration.components import checkpoint as ckpt

    started = load_result(os.path.join(run_dir, ROW_FILE))
    if not started or started.get("trainer_argv") != argv:
        return None
    try:
        path = ckpt.resolve("latest", os.path.join(run_dir, "checkpoints"), quiet=True)
    except ValueError:  # no checkpoint yet, or `latest` names one that is gone
        return None
    return (path, int(ckpt.read_meta(path)["step"])) if path else None


def _code_version(root: str | None = None) -> str:
    """The repository's commit (+ "-dirty" with uncommitted changes): what a result was
    measured with (data generators and presets can change between runs). "unknown" when the
    source tree is not itself a git checkout (an installed package, or a copy of the tree
    inside another checkout, whose commit says nothing about this code)."""
    root = root or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        if not top or os.path.realpath(top) != os.path.realpath(root):
            return "unknown"
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("-dirty" if dirty else "")


def run_row(row: Row, seed: int, s: Settings, a, idx: str) -> str:
    """Trains + evaluates one (row, seed) unless its complete result exists. Returns
    "skipped", "done" or "failed"."""
    path = result_path(a.out, row.name, seed)
    old = load_result(path)
    if old is not None and old.get("complete"):
        if old.get("settings") == s.key() or not a.force:
            note = "" if old.get("settings") == s.key() else " (finished with other settings; --force re-runs)"
            print(f"[{idx}] {row.name} seed {seed}: finished, skipped{note}", flush=True)
            return "skipped"
    name = f"{row.name}-s{seed}"
    run_dir = os.path.join(a.work, name)
    argv = trainer_argv(row, seed, s, a.work, name)
    resume = resume_point(run_dir, argv)
    if resume is None and os.path.exists(run_dir):  # started with other flags, or no checkpoint: start over
        shutil.rmtree(run_dir)
    os.makedirs(run_dir, exist_ok=True)
    _write_json(os.path.join(run_dir, ROW_FILE), {"trainer_argv": argv})
    t0 = time.time()
    log_path = os.path.join(a.work, f"{name}.log")
    rc = _train(row, seed, s, a, idx, argv, resume, log_path)
    train_s = time.time() - t0
    if rc != 0:
        with open(log_path) as f:
            tail = f.read()[-2000:]
        _write_json(path, {"row": row.name, "seed": seed, "complete": False, "status": f"trainer exit {rc}",
                           "settings": s.key(), "log_tail": tail})
        print(f"[{idx}] {row.name} seed {seed}: FAILED (trainer exit {rc} after {train_s:.0f} s; "
              f"log {log_path})\n{tail[-600:]}", flush=True)
        return "failed"
    print(f"[{idx}] {row.name} seed {seed}: trained in {train_s:.0f} s, evaluating ...", flush=True)
    t1 = time.time()
    try:
        rec = evaluate_run(row, seed, s, argv, os.path.join(a.work, name))
    except Exception as e:  # keep going with the other rows; the failure is recorded
        _write_json(path, {"row": row.name, "seed": seed, "complete": False, "status": f"evaluation: {e!r}",
                           "settings": s.key()})
        print(f"[{idx}] {row.name} seed {seed}: FAILED in evaluation: {e!r}", flush=True)
        return "failed"
    rec.update(train_wall_s=train_s, resumed_from_step=resume[1] if resume else 0, eval_wall_s=time.time() - t1, finished_utc=time.strftime(
        "%Y-%m-%dT%H:%M:%SZ", time.gmtime()), code_version=_code_version(), complete=True)
    _write_json(path, rec)
    if not a.keep_checkpoints:
        shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)
    bpt = rec["bytes_per_token"]
    print(f"[{idx}] {row.name} seed {seed}: held-out loss {rec['base_loss']:.4f} -> {rec['final_loss']:.4f} | "
          f"B/tok PP {bpt['pp_fwd'] + bpt['pp_bwd']:.0f} DP {bpt['dp']:.0f} anchor {bpt['anchor']:.0f} | "
          f"modeled {rec['modeled_tokens_per_s']:.0f} tok/s @ {a.bandwidth_mbps:g} Mbps "
          f"({time.time() - t0:.0f} s)", flush=True)
    return "done"


def _train(row: Row, seed: int, s: Settings, a, idx: str, argv: list[str], resume, log_path: str):
    """Runs (or continues, from ``resume``) the row's trainer; its exit code, or "timeout"."""
    if resume is not None and resume[1] >= s.steps:  # trained to the end, interrupted in evaluation
        print(f"[{idx}] {row.name} seed {seed}: already trained ({resume[0]}), evaluating", flush=True)
        return 0
    cmd = [sys.executable, "-m", "orchestration.train", *argv]
    if resume is not None:
        cmd += ["--checkpoint.resume", "latest"]
        print(f"[{idx}] {row.name} seed {seed}: continuing from step {resume[1]} of {s.steps} ({resume[0]}) ...",
              flush=True)
    else:
        print(f"[{idx}] {row.name} seed {seed}: training ({s.steps} steps) ...", flush=True)
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false")
    with open(log_path, "a" if resume is not None else "w") as log:
        # Own session: on timeout or when we are stopped, the trainer and its ranks go too.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            return proc.wait(timeout=a.row_timeout)
        except subprocess.TimeoutExpired:
            return "timeout"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
