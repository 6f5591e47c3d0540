"""``python -m orchestration.experiments``: the paper's table at small scale, measured.

    python -m orchestration.experiments                          # main rows, 3 seeds
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
    * modeled tokens/s at ``--run.bandwidth_bps`` (200 Mbps) by the trainer's own link
      model replay (``orchestration.train.modeled_step``: measured per-stage compute,
      exact bytes) and the network-only ceiling (same replay with compute set to 0);
    * exact match on the synthetic tasks when the run adapts on ``task:...`` data;
    * magnitude-pruning robustness (30/50/70%) of the final model for the main rows.

Results: one JSON per (row, seed) in ``OUT/records/`` written atomically when the row is
finished (``"complete": true``); a finished row is never run again (resumable: kill
and restart at will; a partial run directory is discarded and the row re-run). After
the runs, ``OUT/table.md``, ``OUT/summary.csv`` and PNG plots in ``--figures`` are
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
import csv
import dataclasses
import glob
import json
import math
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from orchestration.metrics import read_jsonl


# ============================================================== the rows
@dataclass(frozen=True)
class Row:
    """One table row: a trainer preset plus flag overrides."""

    name: str
    group: str          # "main", "baseline" or "ablation"
    preset: str
    flags: tuple = ()   # extra trainer flags, e.g. ("--boundary.p", "0.99")
    label: str = ""
    paper: str = ""     # what the paper reports for this row (method.md), for the table


ROWS: tuple[Row, ...] = (
    Row("dense", "main", "dense", label="Dense (dense PP, full DP all-reduce)",
        paper="MedQA 0.280 / HumanEval 0.177; 22.9k B/tok"),
    Row("dp", "main", "dp", label="+DP (dense PP, DiLoCo+PowerSGD)",
        paper="0.275 / 0.171; 6.9k B/tok"),
    Row("m95", "main", "m95", label="M95 (mask p=0.95, no anchor)",
        paper="0.180 / 0.072; 370 B/tok"),
    Row("m90-ap", "main", "m90-ap", label="M90+AP (mask p=0.90 + anchor + spectral)",
        paper="0.325 / 0.215; 790 B/tok"),
    Row("m95-ap", "main", "m95-ap", label="M95+AP (mask p=0.95 + anchor + spectral)",
        paper="0.321 / 0.207; 446 B/tok"),
    # PP-codec baselines at comparable ratios; everything else as M95 (DiLoCo+PowerSGD).
    # Ratios at H=192, fp32: topk keeps K=round(0.067*192)=13 dims of 4 B value + 2 B index
    # = 78 B vs 768 B dense (9.8x, the paper's 10x); bottleneck r=10 coordinates (19.2x,
    # the paper's 20x); int4 with per-group scales (~4x-ish, the paper's 4x).
    Row("topk", "baseline", "m95", ("--boundary.codec", "topk", "--boundary.p", "0.933"),
        label="top-k ~10x/10x (no anchor)", paper="collapses on generation"),
    Row("int4", "baseline", "m95", ("--boundary.codec", "int4"),
        label="4-bit quantization ~4x/4x (no anchor)", paper="collapses on generation"),
    Row("bottleneck", "baseline", "m95", ("--boundary.codec", "bottleneck", "--boundary.p", "0.95"),
        label="bottleneck projection 20x/20x (no anchor)", paper="collapses on generation"),
    # Ablations around M95+AP (p=0.90 with the anchor is the main row m90-ap; m90 is its
    # no-anchor control, separating the effect of p from the anchor's).
    Row("m90", "ablation", "m95", ("--boundary.p", "0.90"), label="M90 (mask p=0.90, no anchor)",
        paper="(not reported)"),
    Row("p99-ap", "ablation", "m95-ap", ("--boundary.p", "0.99"), label="M99+AP (p=0.99)",
        paper="0.230 / 0.075"),
    Row("delay10", "ablation", "m95-ap", ("--anchor.delay", "10"), label="M95+AP, anchor delay 10 (deterministic)",
        paper="0.328 / 0.215"),
    Row("delay20", "ablation", "m95-ap", ("--anchor.delay", "20"), label="M95+AP, anchor delay 20 (deterministic)",
        paper="(default ~20)"),
    Row("delay50", "ablation", "m95-ap", ("--anchor.delay", "50"), label="M95+AP, anchor delay 50 (deterministic)",
        paper="0.250 / 0.090"),
    Row("tau1e-5", "ablation", "m95-ap", ("--train.tau", "1e-5"), label="M95+AP, tau=1e-5",
        paper="0.215 / 0.105"),
    Row("tau1e-1", "ablation", "m95-ap", ("--train.tau", "1e-1"), label="M95+AP, tau=1e-1",
        paper="0.245 / 0.140"),
    Row("alpha0", "ablation", "m95-ap", ("--train.alpha", "0"), label="M95+AP, alpha=0 (filtered only)",
        paper="0.260 / 0.105"),
    Row("alpha1", "ablation", "m95-ap", ("--train.alpha", "1"), label="M95+AP, alpha=1 (no correction)",
        paper="0.180 / 0.072"),
    Row("factored", "ablation", "m95-ap", ("--anchor.transport", "factored"),
        label="M95+AP, anchor sends top-r SVD factors of its momentum", paper="(anchor axis ~76 B/tok)"),
)
ROW_BY_NAME = {r.name: r for r in ROWS}
GROUPS = ("main", "baseline", "ablation")
GROUP_ALIASES = {"main": "main", "baselines": "baseline", "baseline": "baseline",
                 "ablations": "ablation", "ablation": "ablation", "all": None}


def select_rows(spec: str) -> list[Row]:
    """Rows named by a comma list of row names and/or groups (main, baselines, ablations,
    all), in table order; ValueError names an unknown entry."""
    want: set[str] = set()
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        if item in GROUP_ALIASES:
            g = GROUP_ALIASES[item]
            want |= {r.name for r in ROWS if g is None or r.group == g}
        elif item in ROW_BY_NAME:
            want.add(item)
        else:
            raise ValueError(f"--rows: unknown row or group {item!r}; rows: {', '.join(ROW_BY_NAME)}; "
                             f"groups: main, baselines, ablations, all")
    if not want:
        raise ValueError("--rows selects no row")
    return [r for r in ROWS if r.name in want]


# ============================================================== scale
@dataclass
class Settings:
    """What makes two results comparable (everything but the row and the seed)."""

    model: str
    data: str
    steps: int
    fast_rows: int
    stages: int
    batch_size: int
    microbatches: int
    seq_len: int
    eval_every: int
    eval_sequences: int
    max_sequences: int = 0
    trainer_args: str = ""
    prune: tuple = (0.3, 0.5, 0.7)
    n_task: int = 100

    def key(self) -> dict:
        d = dataclasses.asdict(self)
        d["prune"] = list(d["prune"])
        return d


# Default scale: chosen so one row trains in ~2 min on the shared 2-core machine (the
# default Llama 192h/4L; 2x2 fast mesh; ~1.3 s/step under load). 80 steps leave room for
# the delay-50 ablation (snapshots at 0,5,..,25 applied at 50..75). Evaluation: 64 held-out
# sequences (8128 predicted tokens) at 5 points; 128 sequences at 9 points took as long as
# the training itself (~115 s) on the loaded machine.
DEFAULT = dict(steps=80, fast_rows=2, stages=2, batch_size=8, microbatches=4, seq_len=128,
               eval_every=20, eval_sequences=64, max_sequences=0)
# --quick: a few seconds per row with whatever --model is given (tests use a tiny one).
QUICK = dict(steps=4, fast_rows=1, stages=2, batch_size=2, microbatches=2, seq_len=32,
             eval_every=2, eval_sequences=8, max_sequences=200)


def trainer_argv(row: Row, seed: int, s: Settings, run_root: str, run_name: str) -> list[str]:
    """The trainer's command-line flags for one (row, seed)."""
    anchor = bool(_preset(row.preset).get("anchor", {}).get("enabled", False))
    argv = ["--preset", row.preset, *row.flags,
            "--model", s.model, "--data", s.data,
            "--mesh.rows", str(s.fast_rows + (1 if anchor else 0)), "--mesh.stages", str(s.stages),
            "--train.steps", str(s.steps), "--train.batch_size", str(s.batch_size),
            "--train.microbatches", str(s.microbatches), "--data.seq_len", str(s.seq_len),
            "--data.max_sequences", str(s.max_sequences), "--train.seed", str(seed),
            "--checkpoint.every", str(s.eval_every), "--checkpoint.keep", "100000",
            "--run.out_dir", run_root, "--run.name", run_name, "--run.progress", "false",
            "--run.eval_sequences", "0"]  # we evaluate every checkpoint ourselves
    if "delay" in row.name:  # deterministic delay must not exceed the staleness bound
        argv += ["--anchor.max_staleness", str(max(50, int(row.flags[row.flags.index("--anchor.delay") + 1])))]
    return argv + shlex.split(s.trainer_args)


def _preset(name: str) -> dict:
    from orchestration.config import load_preset

    return load_preset(name)


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


def evaluate_run(row: Row, seed: int, s: Settings, argv: list[str], run_dir: str) -> dict:
    """Evaluates a finished trainer run; returns the row's result record."""
    from orchestration import evaluate, train
    from orchestration.models import load_causal_lm

    cfg, plan = _plan_for(argv)
    history = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    if not history or history[-1]["step"] != s.steps:
        raise RuntimeError(f"{run_dir}: metrics.jsonl ends at step "
                           f"{history[-1]['step'] if history else 0}, expected {s.steps}")
    held = plan.eval_rows[:s.eval_sequences]
    tokens_per_step = cfg.fast_rows * cfg.train.batch_size * cfg.data.seq_len

    model_step = train.modeled_step(cfg, plan, history)
    zero = [dict(h, fwd_s=[0.0] * len(h["fwd_s"]), bwd_s=[0.0] * len(h["bwd_s"])) for h in history]
    net_step = train.modeled_step(cfg, plan, zero)

    curve = []
    final_model = None
    for step, path in [(0, plan.model_path)] + _checkpoints(run_dir):
        model, _ = load_causal_lm(path)
        r = evaluate.eval_loss(model, held)
        curve.append({"step": step, "tokens": step * tokens_per_step,
                      "modeled_s": step * model_step.step_s, "loss": r["loss"], "perplexity": r["perplexity"]})
        if step == s.steps:
            final_model = model
    if final_model is None:
        raise RuntimeError(f"{run_dir}: no complete checkpoint at the last step {s.steps}")

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


def _code_version() -> str:
    """The repository's commit (+ "-dirty" with uncommitted changes): what a result was
    measured with (data generators and presets can change between runs)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("-dirty" if dirty else "")


def _write_json(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)  # a reader sees the old file or the whole new one


# Not "runs": .gitignore ignores every directory of that name (trainer output), and these
# small records are meant to be committed.
RECORDS = "records"


def result_path(out: str, row: str, seed: int) -> str:
    return os.path.join(out, RECORDS, f"{row}-s{seed}.json")


def load_result(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


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
def _mean_sd(xs: list[float]) -> tuple[float, float]:
    m = statistics.fmean(xs)
    return m, (statistics.stdev(xs) if len(xs) > 1 else float("nan"))


def _fmt(xs: list[float], digits: int = 3) -> str:
    if not xs:
        return "-"
    m, sd = _mean_sd(xs)
    if math.isnan(sd) or max(xs) == min(xs):  # one seed, or exact counts identical in every seed
        return f"{m:.{digits}f}"
    return f"{m:.{digits}f} ± {sd:.{digits}f}"


def collect(out: str, s: Settings) -> tuple[dict[str, list[dict]], int]:
    """Complete results in OUT/records matching these settings, by row (table order);
    also the count of complete results left out for other settings."""
    by_row: dict[str, list[dict]] = {}
    other = 0
    for p in sorted(glob.glob(os.path.join(out, RECORDS, "*.json"))):
        r = load_result(p)
        if not r or not r.get("complete"):
            continue
        if r.get("settings") != s.key():
            other += 1
            continue
        by_row.setdefault(r["row"], []).append(r)
    ordered = {row.name: sorted(by_row[row.name], key=lambda r: r["seed"]) for row in ROWS if row.name in by_row}
    return ordered, other


def make_table(by_row: dict[str, list[dict]], s: Settings) -> str:
    """The markdown table: mean ± sample sd over seeds."""
    dense = {r["seed"]: r["final_loss"] for r in by_row.get("dense", [])}
    prune_cols = [str(f) for f in s.prune]
    has_em = any("exact_match" in r for rs in by_row.values() for r in rs)
    head = ["row", "seeds", "held-out loss", "Δ vs base", "Δ vs Dense (paired)", "ppl",
            "B/tok PP fwd", "B/tok PP bwd", "B/tok DP", "B/tok anchor", "B/tok total",
            "modeled tok/s @200Mbps", "network-only tok/s", "prune " + "/".join(f"{float(f):.0%}" for f in s.prune)
            + " (loss +%)"]
    if has_em:
        head.append("exact match")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, rs in by_row.items():
        bpt = lambda ax: [r["bytes_per_token"][ax] for r in rs]  # noqa: E731
        paired = [r["final_loss"] - dense[r["seed"]] for r in rs if r["seed"] in dense]
        prune = "-"
        if all("pruning" in r for r in rs):
            prune = " / ".join(_fmt([r["pruning"][c]["loss_increase_pct"] for r in rs], 1) for c in prune_cols)
        cells = [f"{name}", ",".join(str(r["seed"]) for r in rs),
                 _fmt([r["final_loss"] for r in rs]), _fmt([r["final_loss"] - r["base_loss"] for r in rs]),
                 _fmt(paired) if name != "dense" else "0",
                 _fmt([r["final_perplexity"] for r in rs], 1),
                 _fmt(bpt("pp_fwd"), 1), _fmt(bpt("pp_bwd"), 1), _fmt(bpt("dp"), 1), _fmt(bpt("anchor"), 1),
                 _fmt([r["bytes_per_token_total"] for r in rs], 1),
                 _fmt([r["modeled_tokens_per_s"] for r in rs], 0),
                 _fmt([r["network_bound_tokens_per_s"] for r in rs], 0), prune]
        if has_em:
            cells.append(", ".join(f"{t} {_fmt([r['exact_match'][t] for r in rs])}"
                                   for t in (rs[0].get("exact_match") or {})) or "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_csv(by_row: dict[str, list[dict]], path: str) -> None:
    cols = ["row", "group", "seed", "base_loss", "final_loss", "final_perplexity", "bpt_pp_fwd", "bpt_pp_bwd",
            "bpt_dp", "bpt_anchor", "bpt_total", "modeled_tokens_per_s", "network_bound_tokens_per_s",
            "measured_tokens_per_s", "modeled_limit", "train_wall_s"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for rs in by_row.values():
            for r in rs:
                b = r["bytes_per_token"]
                w.writerow([r["row"], r["group"], r["seed"], r["base_loss"], r["final_loss"], r["final_perplexity"],
                            b["pp_fwd"], b["pp_bwd"], b["dp"], b["anchor"], r["bytes_per_token_total"],
                            r["modeled_tokens_per_s"], r["network_bound_tokens_per_s"],
                            r["measured_tokens_per_s"], r["modeled_limit"], r.get("train_wall_s")])


def make_plots(by_row: dict[str, list[dict]], fig_dir: str) -> list[str]:
    """Per group: held-out loss vs tokens and vs modeled wall-clock (mean over seeds,
    band = min..max). Returns the written paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(fig_dir, exist_ok=True)
    written = []
    for group in GROUPS:
        names = [n for n in by_row if ROW_BY_NAME[n].group == group]
        if group != "main" and names:  # compare against the main rows they vary
            names = [n for n in ("dense", "m95", "m95-ap") if n in by_row] + names
        if not names:
            continue
        for xkey, xlabel, fname in (("tokens", "training tokens (fast circuit)", "loss_vs_tokens"),
                                    ("modeled_s", "modeled wall-clock at 200 Mbps [s]", "loss_vs_wallclock")):
            fig, ax = plt.subplots(figsize=(7, 4.5))
            colors = plt.get_cmap("tab10" if len(names) <= 10 else "tab20").colors  # distinct per row
            for i, n in enumerate(names):
                rs = by_row[n]
                steps = sorted(set.intersection(*[{p["step"] for p in r["curve"]} for r in rs]))
                xs, mean, lo, hi = [], [], [], []
                for st in steps:
                    pts = [next(p for p in r["curve"] if p["step"] == st) for r in rs]
                    xs.append(statistics.fmean(p[xkey] for p in pts))
                    ls = [p["loss"] for p in pts]
                    mean.append(statistics.fmean(ls))
                    lo.append(min(ls))
                    hi.append(max(ls))
                line, = ax.plot(xs, mean, marker="o", ms=3, color=colors[i % len(colors)], label=f"{n} (n={len(rs)})")
                if len(rs) > 1:
                    ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("held-out loss (adaptation domain)")
            ax.set_title(f"{group} rows: mean over seeds, band = min..max")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            fig.tight_layout()
            p = os.path.join(fig_dir, f"{group}_{fname}.png")
            fig.savefig(p, dpi=110)
            plt.close(fig)
            written.append(p)
        ref = {"baseline": "m95", "ablation": "m95-ap"}.get(group)
        if ref in by_row:  # the small differences between variants, paired by seed
            p = _paired_bars(plt, by_row, [n for n in names if ROW_BY_NAME[n].group == group], ref,
                             os.path.join(fig_dir, f"{group}_paired_delta.png"))
            if p:
                written.append(p)
    return written


def _paired_bars(plt, by_row, names, ref, path):
    """Bar chart: final held-out loss minus the reference row's, same seed (mean ± sd)."""
    refs = {r["seed"]: r["final_loss"] for r in by_row[ref]}
    rows = []
    for n in names:
        d = [r["final_loss"] - refs[r["seed"]] for r in by_row[n] if r["seed"] in refs]
        if d:
            rows.append((n, statistics.fmean(d), statistics.stdev(d) if len(d) > 1 else 0.0, len(d)))
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.5))
    ax.barh([f"{n} (n={k})" for n, _, _, k in rows], [m for _, m, _, _ in rows],
            xerr=[sd for _, _, sd, _ in rows], color="tab:blue", alpha=0.7, capsize=3)
    ax.axvline(0, color="black", lw=0.8)
    ax.invert_yaxis()
    ax.set_xlabel(f"final held-out loss minus {ref} (same seed); error bar = sd over seeds")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(a, s: Settings) -> None:
    by_row, other = collect(a.out, s)
    if not by_row:
        print("no complete results for these settings yet; nothing to tabulate", flush=True)
        return
    table = make_table(by_row, s)
    header = (f"<!-- generated by python -m orchestration.experiments; settings: {json.dumps(s.key())} -->\n")
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(header + table)
    write_csv(by_row, os.path.join(a.out, "summary.csv"))
    figs = make_plots(by_row, a.figures)
    print("\n" + table, flush=True)
    print(f"wrote {os.path.join(a.out, 'table.md')}, {os.path.join(a.out, 'summary.csv')}, "
          + ", ".join(figs) + (f" ({other} complete results with other settings left out)" if other else ""),
          flush=True)


# ============================================================== entry point
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m orchestration.experiments",
        description="Run the paper's rows (Dense, +DP, M95, M90+AP, M95+AP), PP-codec baselines (top-k, "
                    "int4, bottleneck) and ablations (p, anchor delay, tau, alpha) at small scale: each row = "
                    "one trainer run + evaluation; writes OUT/records/<row>-s<seed>.json, OUT/table.md, "
                    "OUT/summary.csv and PNG plots. Resumable: finished rows are skipped.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--rows", default="main",
                    help="comma list of rows and/or groups (main, baselines, ablations, all); rows: "
                         + ", ".join(ROW_BY_NAME))
    ap.add_argument("--seeds", default="0,1,2", help="comma list of training seeds (also the held-out split seed)")
    ap.add_argument("--steps", type=int, default=None, help=f"trainer steps per row (default {DEFAULT['steps']}, "
                                                             f"--quick {QUICK['steps']})")
    ap.add_argument("--eval-every", type=int, default=None,
                    help="checkpoint + held-out evaluation every N steps (default: steps/8)")
    ap.add_argument("--eval-sequences", type=int, default=None, help="held-out sequences scored per evaluation")
    ap.add_argument("--fast-rows", type=int, default=None, help="fast replicas (anchor rows add one mesh row)")
    ap.add_argument("--stages", type=int, default=None, help="pipeline stages")
    ap.add_argument("--model", default="", help="local HF checkpoint (default: the default base model, resolved "
                                                "once so every row adapts the same one)")
    ap.add_argument("--data", default="corpus:python",
                    help="adaptation data (trainer --data); task:<names> also scores exact match")
    ap.add_argument("--trainer-args", default="", help="extra flags appended to every trainer command")
    ap.add_argument("--out", default="docs/results", help="results directory (JSON, table.md, summary.csv)")
    ap.add_argument("--figures", default="docs/figures", help="directory of the PNG plots")
    ap.add_argument("--work", default="runs/experiments", help="trainer run directories (checkpoints, logs)")
    ap.add_argument("--quick", action="store_true", help="tiny scale for tests: "
                    + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    ap.add_argument("--row-timeout", type=float, default=1800.0, help="seconds before a trainer run is killed")
    ap.add_argument("--force", action="store_true", help="re-run rows finished with other settings")
    ap.add_argument("--keep-checkpoints", action="store_true", help="keep run checkpoints after evaluation")
    ap.add_argument("--table-only", action="store_true", help="only rebuild table and plots from OUT/records")
    return ap


def settings_from(a) -> Settings:
    base = dict(QUICK if a.quick else DEFAULT)
    for k in ("steps", "fast_rows", "stages", "eval_sequences"):
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
        from orchestration.models import default_base_model

        a.model = default_base_model(progress=True)
    return Settings(model=os.path.abspath(a.model) if os.path.exists(a.model) else a.model, data=a.data,
                    trainer_args=a.trainer_args, prune=(0.5,) if a.quick else (0.3, 0.5, 0.7),
                    n_task=10 if a.quick else 100, **base)


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    try:
        rows = select_rows(a.rows)
        seeds = [int(x) for x in a.seeds.split(",") if x.strip()]
        if not seeds or any(x < 0 for x in seeds):
            raise ValueError(f"--seeds {a.seeds!r}: need >= 1 non-negative integer")
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
