"""``python -m orchestration.experiments``: flags, settings and the main loop (module doc:
orchestration.experiments).

    python -m orchestration.experiments                          # main rows, 3 seeds, into runs/experiments/
    python -m orchestration.experiments --docs                   # the same, into the tracked results, results/figures
    python -m orchestration.experiments --rows baselines,ablations --seeds 0
    python -m orchestration.experiments --rows dense,m95 --quick --out /tmp/x   # tiny (tests)
    python -m orchestration.experiments --table-only              # rebuild table + plots
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import signal
import sys

import torch

from orchestration.experiments.report import report
from orchestration.experiments.rows import DEFAULT, QUICK, RECORDS, ROW_BY_NAME, Settings, select_rows
from orchestration.experiments.runner import run_row

OUT_DEFAULT = os.path.join("runs", "experiments", "results")  # untracked: a run never edits the docs by accident
DOCS_OUT, DOCS_FIGURES = "results", os.path.join("results", "figures")


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
                    help="the base model, resolved like the trainer's --model (orchestration.models.paths."
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
    built-in model, before anything runs (the trainer's rule, orchestration.models.paths)."""
    from orchestration.models.gguf_convert import BUILTIN_MODELS

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
        from orchestration.models.paths import default_base_model

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

