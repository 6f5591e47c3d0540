"""``python -m orchestration.train``: adapt a causal LM on an X x Y mesh of processes.

    python -m orchestration.train                      # embedded default: 3x2 CPU mesh, a few minutes
    python -m orchestration.train --preset m95 --steps 50
    python -m orchestration.train --config run.yaml --mesh.rows 4
    torchrun --nnodes 2 --nproc-per-node 3 ... -m orchestration.train --preset m95   # multi-node

Three steps: parse the command line (orchestration.config: every rule on the config
itself), prepare (orchestration.launch.prepare: the config checked against the model, data
and checkpoint it names, all loaded once, BEFORE a process starts: bad input is a clear
error, never a dead mesh), launch (orchestration.launch: this machine's processes, or
this one process as a torchrun rank). Every rank then runs orchestration.launch.rank.run_rank.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP (environment.md)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # we fork after tokenizing
if not os.isatty(1) and not os.isatty(2):  # output to a log file: the base model build's and a GGUF
    os.environ.setdefault("TQDM_MININTERVAL", "30")  # conversion's bars redraw every 30 s (read at tqdm's import)

import sys

import torch

from orchestration.components import checkpoint as ckpt
from orchestration.components import memory
from orchestration.components.divergence import DIVERGED  # noqa: F401 (the exit code, importable from here too)
from orchestration.config import Config, parse_args, to_yaml
from orchestration.distributed import devices
from orchestration.distributed.mesh import MeshLayout, mesh_name
from orchestration.launch.prepare import DEFAULT_DATA, Plan, checked_model, prepare, under_torchrun  # noqa: F401
from orchestration.launch.rank import run_rank  # noqa: F401 (the rank entry, importable from here too)


def main(argv: list[str] | None = None) -> int:
    """The exit code (orchestration.launch.outcome): 0, 2 for a bad command line or input."""
    try:
        cfg, ns = parse_args(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if ns.print_config:
        print(to_yaml(cfg), end="")
        return 0
    if ns.dry_run:
        return _dry_run(cfg)
    torch.set_num_threads(cfg.mesh.threads_per_rank)
    _check_tensorboard(cfg)
    _check_wandb(cfg)
    try:
        start = devices.start_method(cfg.mesh.start_method, cfg.mesh.device)
        plan = prepare(cfg, load_model=start == "fork" and not under_torchrun())
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    joining = cfg.anchor.join or cfg.mesh.join  # a part of a running run: nothing of it is clobbered
    if not plan.resume_from and not joining and (found := ckpt.existing_run(plan.run_dir, plan.ckpt_dir)):
        # (here, not in prepare: tools such as orchestration.experiments prepare finished runs to evaluate them)
        print(f"error: run {os.path.basename(plan.run_dir)!r} already exists ({found}): continue it with "
              "--checkpoint.resume latest (same --run.name), or choose another --run.name", file=sys.stderr)
        return 2
    layout = MeshLayout.of(cfg)
    if under_torchrun():
        from orchestration.launch.torchrun import launch_torchrun

        return launch_torchrun(cfg, plan, layout)
    from orchestration.launch.local import launch_local

    return launch_local(cfg, plan, layout)


def _check_tensorboard(cfg: Config) -> None:
    if cfg.run.tensorboard:
        from orchestration.components.metrics import tensorboard_available

        if not tensorboard_available():
            print("warning: --run.tensorboard: the tensorboard package is not installed (pip install tensorboard); "
                  "logging to metrics.jsonl only", file=sys.stderr, flush=True)
            cfg.run.tensorboard = False


def _check_wandb(cfg: Config) -> None:
    """--run.wandb without the wandb package: one warning line, and the run goes on with
    W&B off (as --run.tensorboard without tensorboard)."""
    if cfg.run.wandb:
        from orchestration.components.metrics import wandb_available

        if not wandb_available():
            print("warning: --run.wandb: the wandb package is not installed (pip install wandb); "
                  "logging to metrics.jsonl only", file=sys.stderr, flush=True)
            cfg.run.wandb = False


def _dry_run(cfg: Config) -> int:
    """--dry-run: the checked model and mesh, and the memory each stage needs; starts nothing."""
    try:
        path, hf_cfg, arch = checked_model(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"model {arch} from {path}; mesh {mesh_name(cfg.replica_stages)}")
    print(memory.banner(cfg, hf_cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
