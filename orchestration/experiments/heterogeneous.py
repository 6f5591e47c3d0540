"""Selective vs compress-all on a heterogeneous mesh (issue #16's experiment):

    python -m orchestration.experiments.heterogeneous --out results/heterogeneous \
        --figures results/figures/heterogeneous

On one full replica beside two 2-stage pipeline replicas (``--replicas 1,2,2``, the default),
SparseLoCo DiLoCo, continued pre-training of ``--model`` on ``--data``, for every seed:
``dense`` (no boundary compression), and for each subspace width k in ``--ks``
``all-k<K>`` (every replica keeps the subspace constraint) and ``sel-k<K>`` (only the
pipeline replicas do: selective). Each (row, seed) is one trainer run (a subprocess);
its record (OUT/records/ROW-sSEED.json) holds the held-out loss of two final models, the
full replica's (replica 0, the exported checkpoint) and pipeline replica 1's (rebuilt from
its stages' saved state), and the bytes per trained token of every axis. A record that
exists is not run again; ``--table-only`` rebuilds OUT/table.md and the plot from the
records."""
from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import subprocess
import sys
import time

from orchestration.experiments.report import _fmt
from orchestration.experiments.rows import RECORDS, _write_json, load_result

REPLICAS = "1,2,2"  # the mesh: one full replica beside two 2-stage pipeline replicas


def rows(ks: list[int]) -> list[tuple[str, list[str]]]:
    """(row name, trainer flags) in table order."""
    out = [("dense", ["--boundary.codec", "dense"])]
    for k in ks:
        opts = json.dumps({"k": k})
        out.append((f"all-k{k}", ["--boundary.codec", "subspace", "--boundary.options", opts, "--boundary.compress", "all"]))
        out.append((f"sel-k{k}", ["--boundary.codec", "subspace", "--boundary.options", opts,
                                  "--boundary.compress", "selective"]))
    return out


def settings(a) -> dict:
    """What makes two records comparable (all but the row and the seed)."""
    return {"model": a.model, "data": a.data, "replicas": a.replicas, "steps": a.steps, "lr": a.lr,
            "batch_size": a.batch_size, "seq_len": a.seq_len, "eval_sequences": a.eval_sequences,
            "max_sequences": a.max_sequences, "trainer_args": a.trainer_args}


def trainer_argv(a, flags: list[str], seed: int, run_root: str, name: str) -> list[str]:
    return ["--mesh.replicas", a.replicas, *flags, "--data", a.data, *(["--model", a.model] if a.model else []),
            "--train.steps", str(a.steps), "--train.lr", str(a.lr), "--train.seed", str(seed),
            "--train.batch-size", str(a.batch_size), "--train.microbatches", "2", "--data.seq-len", str(a.seq_len),
            "--data.max-sequences", str(a.max_sequences), "--checkpoint.every", "0",
            "--run.out-dir", run_root, "--run.name", name, "--run.progress", "false", "--run.eval-sequences", "0",
            *shlex.split(a.trainer_args)]


def replica_model(final: str, cfg, row: int, base_path: str):
    """Replica ``row``'s model at checkpoint ``final``: the base model with the weights its
    stages saved (rank_XXXXX.pt "stage" parts, local names mapped to the unsplit model's)."""
    from orchestration.components import checkpoint as ckpt
    from orchestration.distributed.mesh import MeshLayout
    from orchestration.models.loading import load_causal_lm
    from orchestration.distributed.stages import hf_name, replica_split

    model, _ = load_causal_lm(base_path, boundary=False)
    lay = MeshLayout.of(cfg)
    y = lay.stages_of(row)
    split, lo, sd = replica_split(model.config.num_hidden_layers, y, cfg.mesh.layers_per_stage), 0, {}
    for s in range(y):
        for k, v in ckpt.load_rank_state(final, lay.rank_of(row, s))["stage"].items():
            if not k.startswith("rotary_emb."):
                sd[hf_name(k, lo)] = v
        lo += split[s]
    if model.config.tie_word_embeddings:  # the last stage's head is a copy: keep stage 0's, as the export does
        sd.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise RuntimeError(f"replica {row} at {final}: missing {missing}, unexpected {unexpected}")
    return model


def run_one(a, row: str, flags: list[str], seed: int) -> dict:
    """Trains one (row, seed) in a subprocess and scores replica 0's final checkpoint."""
    import torch

    from orchestration.components import checkpoint as ckpt
    from orchestration.config import parse_args
    from orchestration.components.metrics import read_jsonl
    from orchestration.launch.prepare import prepare
    from orchestration.models.scoring import checkpoint_loss

    name = f"{row}-s{seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    argv = trainer_argv(a, flags, seed, a.work, name)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "orchestration.train", *argv], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{row} seed {seed}: the trainer exited {proc.returncode}:\n"
                           f"{(proc.stdout + proc.stderr)[-3000:]}\ncommand: python -m orchestration.train {shlex.join(argv)}")
    cfg, _ = parse_args(argv)
    plan = prepare(cfg, load_model=False)
    final = ckpt.resolve("latest", os.path.join(a.work, name, "checkpoints"))
    held = plan.eval_rows[:a.eval_sequences]
    last = read_jsonl(os.path.join(a.work, name, "metrics.jsonl"))[-1]
    from orchestration.models.scoring import eval_loss

    pipe = eval_loss(replica_model(final, cfg, 1, plan.model_path), held)["loss"]
    return {"row": row, "seed": seed, "settings": settings(a), "argv": argv, "complete": True,
            "final_loss": checkpoint_loss(final, held), "pipeline_loss": pipe,
            "base_loss": checkpoint_loss(plan.model_path, held),
            "bytes_per_token": last["bytes_per_token"], "train_loss_last": last["loss"],
            "wall_s": time.perf_counter() - t0, "torch": torch.__version__}


def collect(out: str, s: dict) -> dict[str, list[dict]]:
    by_row: dict[str, list[dict]] = {}
    for p in sorted(glob.glob(os.path.join(out, RECORDS, "*.json"))):
        r = load_result(p)
        if r and r.get("complete") and r.get("settings") == s:
            by_row.setdefault(r["row"], []).append(r)
    return {k: sorted(v, key=lambda r: r["seed"]) for k, v in by_row.items()}


def _paired(rs: list[dict], ref: list[dict], key: str = "final_loss") -> list[float]:
    base = {r["seed"]: r[key] for r in ref}
    return [r[key] - base[r["seed"]] for r in rs if r["seed"] in base]


def make_table(by_row: dict[str, list[dict]], order: list[str]) -> str:
    """Markdown: held-out loss (mean ± sd over seeds), paired deltas, bytes per token."""
    head = ["row", "seeds", "held-out loss, full replica 0", "Δ vs dense (paired)", "all − selective (paired)",
            "held-out loss, pipeline replica 1", "Δ vs dense (paired)", "B/tok PP fwd+bwd", "B/tok DP", "B/tok total"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    dense = by_row.get("dense", [])
    for name in order:
        rs = by_row.get(name)
        if not rs:
            continue
        bpt = [r["bytes_per_token"] for r in rs]
        vs_sel = "-"
        if name.startswith("all-"):
            vs_sel = _fmt(_paired(rs, by_row.get("sel-" + name[4:], [])))
        lines.append("| " + " | ".join([
            name, str(len(rs)), _fmt([r["final_loss"] for r in rs]),
            "0" if name == "dense" else _fmt(_paired(rs, dense)), vs_sel,
            _fmt([r["pipeline_loss"] for r in rs]),
            "0" if name == "dense" else _fmt(_paired(rs, dense, "pipeline_loss")),
            _fmt([b["pp_fwd"] + b["pp_bwd"] for b in bpt], 1), _fmt([b["dp"] for b in bpt], 1),
            _fmt([sum(b.values()) for b in bpt], 1)]) + " |")
    base = [r["base_loss"] for rs in by_row.values() for r in rs]
    if base:
        lines.append(f"\nBase model (no training): held-out loss {base[0]:.4f}.")
    return "\n".join(lines) + "\n"


def make_plot(by_row: dict[str, list[dict]], ks: list[int], path: str, replicas: str = REPLICAS) -> str:
    """Loss vs pipeline bytes per token: compress-all and selective, one point per k."""
    import statistics

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, label in (("all", "compress all replicas"), ("sel", "selective (pipelines only)")):
        xs, ys, es = [], [], []
        for k in ks:
            rs = by_row.get(f"{mode}-k{k}", [])
            if rs:
                xs.append(statistics.fmean(r["bytes_per_token"]["pp_fwd"] + r["bytes_per_token"]["pp_bwd"] for r in rs))
                ls = [r["final_loss"] for r in rs]
                ys.append(statistics.fmean(ls))
                es.append(statistics.stdev(ls) if len(ls) > 1 else 0.0)
        if xs:
            ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=label + ", full replica 0")
        pys = [statistics.fmean(r["pipeline_loss"] for r in by_row[f"{mode}-k{k}"]) for k in ks if by_row.get(f"{mode}-k{k}")]
        if pys:
            ax.plot(xs, pys, marker="s", ls="--", label=label + ", pipeline replica 1")
    if by_row.get("dense"):
        rs = by_row["dense"]
        ax.axhline(statistics.fmean(r["final_loss"] for r in rs), color="k", ls="--", lw=1, label="dense boundaries")
        ax.axhline(rs[0]["base_loss"], color="gray", ls=":", lw=1, label="base model")
    ax.set_xscale("log")
    ax.set_xlabel("pipeline bytes per trained token (fwd + bwd, all replicas)")
    ax.set_ylabel("held-out loss")
    ax.set_title(f"replicas {replicas}, SparseLoCo")
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m orchestration.experiments.heterogeneous", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="hetero-results", help="records and table.md (default: %(default)s)")
    ap.add_argument("--figures", default="", help="directory of the plot (default: OUT)")
    ap.add_argument("--work", default="", help="trainer run directories (default: OUT/work; large, not for git)")
    ap.add_argument("--model", default="", help="base model (default: the trainer's default model)")
    ap.add_argument("--data", default="corpus:prose", help="training data (default: %(default)s)")
    ap.add_argument("--replicas", default=REPLICAS, help="--mesh.replicas: a full replica first, then pipeline "
                    "replicas; replica 0 and 1 are scored (default: %(default)s)")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default: %(default)s)")
    ap.add_argument("--ks", default="24,12,6", help="subspace widths k, one compression ratio each "
                    "(default %(default)s: 8x, 16x, 32x fewer PP bytes than dense fp32 at H=192)")
    ap.add_argument("--steps", type=int, default=100, help="optimizer steps per run (default: %(default)s)")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default: %(default)s)")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per replica per step (default: %(default)s)")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default: %(default)s)")
    ap.add_argument("--eval-sequences", type=int, default=64, help="held-out sequences scored (default: %(default)s)")
    ap.add_argument("--max-sequences", type=int, default=0, help="cap on packed sequences (0: none)")
    ap.add_argument("--trainer-args", default="", help="extra trainer flags, one string")
    ap.add_argument("--table-only", action="store_true", help="rebuild the table and plot from the records")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    ks = [int(k) for k in a.ks.split(",") if k]
    seeds = [int(s) for s in a.seeds.split(",") if s]
    a.work = a.work or os.path.join(a.out, "work")
    os.makedirs(os.path.join(a.out, RECORDS), exist_ok=True)
    grid = rows(ks)
    if not a.table_only:
        todo = [(r, f, s) for s in seeds for r, f in grid
                if load_result(os.path.join(a.out, RECORDS, f"{r}-s{s}.json")) is None]
        for i, (row, flags, seed) in enumerate(todo, 1):
            print(f"[{i}/{len(todo)}] {row} seed {seed}", flush=True)
            try:
                rec = run_one(a, row, flags, seed)
            except (RuntimeError, ValueError, FileNotFoundError) as e:
                print(f"error: {e}", file=sys.stderr)
                return 1
            _write_json(os.path.join(a.out, RECORDS, f"{row}-s{seed}.json"), rec)
            print(f"    held-out {rec['final_loss']:.4f} (base {rec['base_loss']:.4f}), "
                  f"{sum(rec['bytes_per_token'].values()):.1f} B/token, {rec['wall_s']:.0f} s", flush=True)
    by_row = collect(a.out, settings(a))
    table = make_table(by_row, [r for r, _ in grid])
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(table)
    print(table)
    if by_row:
        print("plot:", make_plot(by_row, ks, os.path.join(a.figures or a.out, "loss_vs_bytes.png"), a.replicas))
    return 0


if __name__ == "__main__":
    sys.exit(main())
