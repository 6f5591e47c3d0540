"""``python -m orchestration.experiments``: the paper's table at small scale, measured.

    python -m orchestration.experiments                          # main rows, 3 seeds, into runs/experiments/
    python -m orchestration.experiments --docs                   # the same, into the tracked docs/results, docs/figures
    python -m orchestration.experiments --rows baselines,ablations --seeds 0
    python -m orchestration.experiments --rows dense,m95 --quick --out /tmp/x   # tiny (tests)
    python -m orchestration.experiments --table-only              # rebuild table + plots

Every row of :data:`ROWS` is one trainer run (``python -m orchestration.train`` as a
subprocess: a preset plus flags, nothing re-implemented here) followed by evaluation
with ``orchestration.evaluate`` on the held-out rows the trainer itself kept (the
trainer's own ``prepare`` rebuilds them, so the split is exactly the run's):

    * held-out loss / perplexity at every checkpoint (``--checkpoint.every``) and of the
      base model (step 0): the curve "eval loss vs tokens"; the same curve against
      modeled wall-clock = steps x the run's modeled step time;
    * bytes/token per axis (pp_fwd, pp_bwd, dp, anchor) from the run's exact counters;
    * modeled tokens/s at ``--run.bandwidth-bps`` (200 Mbps) by the trainer's own link
      model replay (``orchestration.linkmodel.model_run``: measured per-stage compute,
      exact bytes) and the network-only ceiling (same replay with compute set to 0);
    * exact match on the synthetic tasks when the run adapts on ``task:...`` data;
    * magnitude-pruning robustness (30/50/70%) of the final model for the main rows.

Results: one JSON per (row, seed) in ``OUT/records/`` written atomically when the row is
finished (``"complete": true``); a finished row is never run again (resumable: kill
and restart at will; a partial run directory is discarded and the row re-run). After
the runs, ``OUT/table.md``, ``OUT/summary.csv`` and PNG plots in ``--figures`` (default
``OUT/figures``; OUT defaults to runs/experiments/results, and only ``--docs`` writes into
the repository's tracked docs/results and docs/figures) are
rebuilt from every complete JSON in ``OUT/records`` whose settings match this
invocation's (so several invocations with disjoint ``--rows`` can run side by side).

Mesh: ``--fast-rows`` fast replicas x ``--stages`` stages for every row; rows with the
anchor get one more mesh row (the anchor replica), as in the paper ("one extra
replica", off the critical path): the fast circuit sees the same tokens in every row.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import glob
import shlex
import shutil
import signal
import subprocess
import sys
import time

import torch

from orchestration.experiment_report import report
from orchestration.experiment_rows import (DEFAULT, GROUPS, QUICK, RECORDS, ROW_BY_NAME, ROWS, Row,  # noqa: F401
                                           Settings, _write_json, load_result, result_path, select_rows,
                                           trainer_argv)
from orchestration.metrics import read_jsonl

OUT_DEFAULT = os.path.join("runs", "experiments", "results")  # untracked: a run never edits the docs by accident
DOCS_OUT, DOCS_FIGURES = os.path.join("docs", "results"), os.path.join("docs", "figures")

# ============================================================== one row
_PLANS: dict = {}


def _plan_for(argv: list[str]):
    """The trainer's own (cfg, plan) for these flags: config parsing + held-out split, no
    model load. Cached by what determines the split (data, model, seq_len, split seed)."""
    from orchestration import train
    from orchestration.config import parse_args

    cfg, _ = parse_args(argv)
    key = (cfg.data.source, cfg.model.path, cfg.data.seq_len, cfg.data.max_sequences,
           cfg.data.eval_fraction, cfg.data.split_seed, cfg.mesh.rows, cfg.train.batch_size)
    if key not in _PLANS:
        _PLANS[key] = train.prepare(cfg, load_model=False)
    return cfg, _PLANS[key]


def _checkpoints(run_dir: str) -> list[tuple[int, str]]:
    out = []
    for d in sorted(glob.glob(os.path.join(run_dir, "checkpoints", "step_*"))):
        if d.endswith(".tmp") or not os.path.isfile(os.path.join(d, "meta.json")):
            continue
        out.append((int(os.path.basename(d)[5:]), d))
    return out


_BASE_LOSS: dict = {}  # (base model path, held-out rows) -> eval_loss result, within one invocation


def codec_eval_loss(model, held, cfg, *, seed: int = 0, step: int = 0, run_dir: str | None = None) -> dict:
    """Held-out loss of ``model`` through the training-time pipeline: split into
    ``cfg.mesh.stages`` stages as the trainer splits it (``stages.split_model`` with
    ``--mesh.layers-per-stage``), the trainer's boundary codec (``codecs.make_codec`` from
    ``cfg.boundary``) round-tripped at every stage boundary by ``codecs.apply_codec``, the
    loss by ``scoring.eval_loss``; no training. Mask keys ``MaskKey((seed << 16) | 0, i, step, 0)``
    between stages i and i+1: replica 0's seed rule, at a step the run never trained on
    (``step`` = the run's step count), as in ``diagnose.anchor_diagnostics``. With the dense
    codec this is the unsplit model's loss (the split is exact)."""
    from meshkern.mask import MaskKey
    from orchestration.codecs import apply_codec, make_codec
    from orchestration.scoring import eval_loss
    from orchestration.stages import split_model

    stages = split_model(model, cfg.mesh.stages, cfg.mesh.layers_per_stage or None)
    codec = make_codec(cfg.boundary.codec, p=cfg.boundary.p, rescale=cfg.boundary.rescale, **cfg.boundary.options)
    if cfg.boundary.codec == "pca":  # the basis the run trained with (RUN_DIR/pca_basis.pt)
        from orchestration import calibration
        codec.bases = calibration.load(run_dir)
    mask_seed = (int(seed) << 16) | 0
    chain: list = [stages[0]]
    for i, st in enumerate(stages[1:]):
        chain.append(lambda h, i=i: apply_codec(codec, h, MaskKey(mask_seed, i, int(step), 0)))
        chain.append(st)
    return eval_loss(chain, held)


def _epochs(cfg, plan, steps: int) -> float:
    """Passes over its data shard that fast replica 0 made in ``steps`` steps (a per-sample
    codec such as aqsgd compresses better from each sample's second visit on)."""
    from orchestration.sampling import shard_rows

    per_epoch = len(shard_rows(plan.train_rows, 0, cfg.fast_rows)) // cfg.train.batch_size
    return round(steps / per_epoch, 3) if per_epoch else float("nan")


def evaluate_run(row: Row, seed: int, s: Settings, argv: list[str], run_dir: str) -> dict:
    """Evaluates a finished trainer run; returns the row's result record."""
    from orchestration import evaluate
    from orchestration.linkmodel import model_run
    from orchestration.models import load_causal_lm

    cfg, plan = _plan_for(argv)
    history = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    if not history or history[-1]["step"] != s.steps:
        raise RuntimeError(f"{run_dir}: metrics.jsonl ends at step "
                           f"{history[-1]['step'] if history else 0}, expected {s.steps}")
    held = plan.eval_rows[:s.eval_sequences]
    tokens_per_step = cfg.fast_rows * cfg.train.batch_size * cfg.data.seq_len

    model_step = model_run(cfg, plan, history)
    zero = [dict(h, fwd_s=[0.0] * len(h["fwd_s"]), bwd_s=[0.0] * len(h["bwd_s"])) for h in history]
    net_step = model_run(cfg, plan, zero)

    curve = []
    final_model = None
    for step, path in [(0, plan.model_path)] + _checkpoints(run_dir):
        base_key = (path, tuple(held.shape), hash(held.numpy().tobytes()))
        if step == 0 and base_key in _BASE_LOSS:  # the base model on the same held-out rows: scored once
            r = _BASE_LOSS[base_key]
        else:
            model, _ = load_causal_lm(path)
            r = evaluate.eval_loss(model, held)
            if step == 0:
                _BASE_LOSS[base_key] = r
            if step == s.steps:
                final_model = model
        curve.append({"step": step, "tokens": step * tokens_per_step,
                      "modeled_s": step * model_step.step_s, "loss": r["loss"], "perplexity": r["perplexity"]})
    if final_model is None:
        raise RuntimeError(f"{run_dir}: no complete checkpoint at the last step {s.steps}")
    # The deployed model is unmasked; the masked rows trained through their boundary codec.
    # Their final model scored WITH that codec at every stage boundary (no training) shows
    # how much of the deployed model's loss is train/test mismatch.
    codec_on = None
    if cfg.boundary.codec != "dense":
        codec_on = codec_eval_loss(final_model, held, cfg, seed=seed, step=s.steps, run_dir=run_dir)["loss"]

    rec: dict = {
        "row": row.name, "group": row.group, "label": row.label, "seed": seed,
        "settings": s.key(), "trainer_argv": argv,
        "command": "python -m orchestration.train " + " ".join(shlex.quote(a) for a in argv),
        "mesh": f"{cfg.mesh.rows}x{cfg.mesh.stages} ({cfg.fast_rows} fast"
                + (" + anchor" if cfg.anchor.enabled else "") + ")",
        "hidden_size": plan.hidden_size,
        "eval_sequences": int(held.shape[0]), "eval_tokens": int(held.shape[0] * (held.shape[1] - 1)),
        "base_loss": curve[0]["loss"], "final_loss": curve[-1]["loss"],
        "final_perplexity": curve[-1]["perplexity"], "curve": curve,
        "boundary_codec": cfg.boundary.codec, "boundary_options": dict(cfg.boundary.options),
        "codec_on_loss": codec_on, "epochs": _epochs(cfg, plan, s.steps),
        "train_config": {"lr": cfg.train.lr, "min_lr_ratio": cfg.train.min_lr_ratio,
                         "warmup_steps": cfg.train.warmup_steps, "optimizer": cfg.train.optimizer,
                         "tau": cfg.train.tau, "alpha": cfg.train.alpha, "beta_anc": cfg.train.beta_anc,
                         "split_seed": cfg.data.split_seed},
        "train_loss": [h["loss"] for h in history],
        "bytes_per_token": history[-1]["bytes_per_token"],
        "bytes_per_token_total": sum(history[-1]["bytes_per_token"].values()),
        "modeled_step_s": model_step.step_s, "modeled_tokens_per_s": model_step.tokens_per_s,
        "modeled_limit": model_step.limiting,
        "network_bound_tokens_per_s": net_step.tokens_per_s, "network_limit": net_step.limiting,
        "measured_tokens_per_s": tokens_per_step * len(history) / sum(h["step_s"] for h in history),
        "anchor": {k: v for k, v in history[-1].items() if k.startswith("anchor_")},
    }
    if row.group == "main" and s.prune:
        pr = evaluate.pruning_robustness(final_model, held, fractions=s.prune)
        rec["pruning"] = {str(f): {"loss": v["loss"], "loss_increase_pct": v["loss_increase_pct"]}
                          for f, v in pr.items()}
    if s.data.startswith("task:"):
        from orchestration import tasks

        spec = s.data[len("task:"):]
        names = sorted(tasks.TASKS) if spec == "all" else [t.strip() for t in spec.split(",") if t.strip()]
        rec["exact_match"] = {t: evaluate.exact_match(final_model, plan.model_path, t, n=s.n_task)["accuracy"]
                              for t in names}
    return rec


def _code_version(root: str | None = None) -> str:
    """The repository's commit (+ "-dirty" with uncommitted changes): what a result was
    measured with (data generators and presets can change between runs). "unknown" when the
    source tree is not itself a git checkout (an installed package, or a copy of the tree
    inside another checkout, whose commit says nothing about this code)."""
    root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    if os.path.exists(run_dir):  # a partial run from an interrupted invocation: start over
        shutil.rmtree(run_dir)
    os.makedirs(run_dir)
    argv = trainer_argv(row, seed, s, a.work, name)
    cmd = [sys.executable, "-m", "orchestration.train", *argv]
    print(f"[{idx}] {row.name} seed {seed}: training ({s.steps} steps) ...", flush=True)
    t0 = time.time()
    log_path = os.path.join(a.work, f"{name}.log")
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false")
    with open(log_path, "w") as log:
        # Own session: on timeout or when we are stopped, the trainer and its ranks go too.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=a.row_timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
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
    rec.update(train_wall_s=train_s, eval_wall_s=time.time() - t1, finished_utc=time.strftime(
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


# ============================================================== table and plots
# ============================================================== entry point
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m orchestration.experiments",
        description="Run the paper's rows (Dense, +DP, M95, M90+AP, M95+AP), PP-codec baselines (top-k, "
                    "int4, bottleneck) and ablations (p, anchor delay, tau, alpha) at small scale: each row = "
                    "one trainer run + evaluation; writes OUT/records/<row>-s<seed>.json, OUT/table.md, "
                    "OUT/summary.csv and PNG plots. Resumable: finished rows are skipped.",
        formatter_class=_DefaultsOnce)
    ap.add_argument("--rows", default="main",
                    help="comma list of rows and/or groups (main, baselines, ablations, all); rows: "
                         + ", ".join(ROW_BY_NAME))
    ap.add_argument("--seeds", default="0,1,2",
                    help="comma list of training seeds (--train.seed: initialization, data order, masks); the "
                         "held-out split is --data.split-seed (trainer default 0, not set per seed), so every "
                         "seed scores the same held-out set and rows are paired by seed (default: 0,1,2)")
    ap.add_argument("--steps", type=int, default=None, help=f"trainer steps per row (default {DEFAULT['steps']}, "
                                                             f"--quick {QUICK['steps']})")
    ap.add_argument("--eval-every", type=int, default=None,
                    help="checkpoint + held-out evaluation every N steps (default: steps/8)")
    ap.add_argument("--eval-sequences", type=int, default=None, help="held-out sequences scored per evaluation")
    ap.add_argument("--fast-rows", type=int, default=None, help="fast replicas (anchor rows add one mesh row)")
    ap.add_argument("--stages", type=int, default=None, help="pipeline stages")
    ap.add_argument("--batch-size", type=int, default=None,
                    help=f"sequences per step per fast replica (default {DEFAULT['batch_size']})")
    ap.add_argument("--microbatches", type=int, default=None,
                    help=f"pipeline micro-batches per step (default {DEFAULT['microbatches']})")
    ap.add_argument("--seq-len", type=int, default=None, help=f"tokens per sequence (default {DEFAULT['seq_len']})")
    ap.add_argument("--model", default="",
                    help="the base model, resolved like the trainer's --model (orchestration.model_paths."
                         "resolve_model): a built-in name (smollm2-135m: the pretrained SmolLM2-135M-Instruct, "
                         "converted once from its GGUF into ~/.cache/meshkern/gguf), a local .gguf file, or a "
                         "local HF checkpoint directory; default: the default base model, resolved once so every "
                         "row adapts the same one")
    ap.add_argument("--data", default="corpus:python",
                    help="adaptation data (trainer --data); task:<names> also scores exact match")
    ap.add_argument("--trainer-args", default="", help="extra flags appended to every trainer command")
    ap.add_argument("--out", default=None, help=f"results directory (JSON, table.md, summary.csv) (default: "
                                                 f"{OUT_DEFAULT}; with --docs: {DOCS_OUT})")
    ap.add_argument("--figures", default=None, help=f"directory of the PNG plots (default: OUT/figures; with --docs: "
                                                     f"{DOCS_FIGURES})")
    ap.add_argument("--docs", action="store_true", help=f"write the results into the repository's tracked "
                                                        f"{DOCS_OUT} and {DOCS_FIGURES} (what docs/results.md shows)")
    ap.add_argument("--work", default="runs/experiments", help="trainer run directories (checkpoints, logs)")
    ap.add_argument("--quick", action="store_true", help="tiny scale for tests: "
                    + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    ap.add_argument("--row-timeout", type=float, default=1800.0, help="seconds before a trainer run is killed")
    ap.add_argument("--force", action="store_true", help="re-run rows finished with other settings")
    ap.add_argument("--prune", default=None,
                    help="comma list of magnitude-pruning fractions scored on the main rows' final model "
                         "(default 0.3,0.5,0.7; --quick 0.5); 'none' skips the sweep (saves 3 evaluations "
                         "per row on a real model)")
    ap.add_argument("--keep-checkpoints", action="store_true",
                    help="keep run checkpoints after evaluation (default: each is deleted once scored; with "
                         "optimizer state they are ~1.3 GB per rank on smollm2-135m)")
    ap.add_argument("--table-only", action="store_true", help="only rebuild table and plots from OUT/records")
    return ap


class _DefaultsOnce(argparse.HelpFormatter):
    """``(default: X)`` once: only where the help does not say it and X is not None/False."""

    def _get_help_string(self, action):
        h = action.help or ""
        if "default" in h or action.default in (None, False) or action.default is argparse.SUPPRESS:
            return h
        return h + " (default: %(default)s)"


def check_model(model: str) -> None:
    """ValueError (one line, exit 2) if ``--model`` names neither a path that exists nor a
    built-in model, before anything runs (the trainer's rule, orchestration.model_paths)."""
    from orchestration.gguf_convert import BUILTIN_MODELS

    if model and model not in BUILTIN_MODELS and not os.path.exists(model):
        raise ValueError(f"--model {model!r} does not exist (a local HF checkpoint directory, a .gguf file, or a "
                         f"built-in model: {', '.join(sorted(BUILTIN_MODELS))})")


def output_dirs(a) -> None:
    """Resolves --out / --figures: runs/experiments/results by default, the tracked docs
    only with --docs (or when named)."""
    if a.out is None:
        a.out = DOCS_OUT if a.docs else OUT_DEFAULT
    if a.figures is None:
        a.figures = DOCS_FIGURES if a.docs else os.path.join(a.out, "figures")


def settings_from(a) -> Settings:
    base = dict(QUICK if a.quick else DEFAULT)
    for k in ("steps", "fast_rows", "stages", "eval_sequences", "batch_size", "microbatches", "seq_len"):
        if getattr(a, k) is not None:
            base[k] = getattr(a, k)
    if a.eval_every is not None:
        base["eval_every"] = a.eval_every
    elif a.steps is not None:
        base["eval_every"] = max(1, base["steps"] // 8)
    for k, v in base.items():
        if isinstance(v, int) and v < (0 if k == "max_sequences" else 1):
            raise ValueError(f"--{k.replace('_', '-')} must be >= 1, got {v}")
    if base["steps"] % base["eval_every"]:
        raise ValueError(f"--steps {base['steps']} is not a multiple of --eval-every {base['eval_every']}")
    if not a.model:
        from orchestration.model_paths import default_base_model

        a.model = default_base_model(progress=True)
    if a.prune is None:
        prune = (0.5,) if a.quick else (0.3, 0.5, 0.7)
    elif a.prune.strip().lower() in ("", "none"):
        prune = ()
    else:
        try:
            prune = tuple(float(x) for x in a.prune.split(",") if x.strip())
        except ValueError:
            raise ValueError(f"--prune {a.prune!r}: need a comma list of fractions in (0, 1) or 'none'") from None
        if not all(0 < f < 1 for f in prune):
            raise ValueError(f"--prune {a.prune!r}: fractions must be in (0, 1)")
    return Settings(model=os.path.abspath(a.model) if os.path.exists(a.model) else a.model, data=a.data,
                    trainer_args=a.trainer_args, prune=prune,
                    n_task=10 if a.quick else 100, **base)


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    try:
        rows = select_rows(a.rows)
        seeds = [int(x) for x in a.seeds.split(",") if x.strip()]
        if not seeds or any(x < 0 for x in seeds):
            raise ValueError(f"--seeds {a.seeds!r}: need >= 1 non-negative integer")
        check_model(a.model)
        output_dirs(a)
        s = settings_from(a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # evaluation shares the machine with the trainer runs
    # SIGTERM (kill PID) unwinds like Ctrl-C, so the running trainer's group is killed too.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    a.bandwidth_mbps = 200.0
    os.makedirs(os.path.join(a.out, RECORDS), exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    status = []
    if not a.table_only:
        jobs = [(r, sd) for sd in seeds for r in rows]  # seed-major: every seed's table fills up early
        print(f"experiments: {len(jobs)} runs ({', '.join(r.name for r in rows)} x seeds {seeds}); "
              f"model {s.model}; data {s.data}; {s.steps} steps; {s.fast_rows} fast rows x {s.stages} stages",
              flush=True)
        print(f"experiments: results in {a.out}/, plots in {a.figures}/, trainer runs in {a.work}/", flush=True)
        for i, (r, sd) in enumerate(jobs):
            status.append(run_row(r, sd, s, a, f"{i + 1}/{len(jobs)}"))
            report(a, s)  # the table and plots are current after every row
    else:
        report(a, s)
    failed = status.count("failed")
    if status:
        print(f"experiments: {status.count('done')} run, {status.count('skipped')} skipped, {failed} failed",
              flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
