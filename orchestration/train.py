"""``python -m orchestration.train``: adapt a causal LM on an X x Y mesh of processes.

    python -m orchestration.train                      # embedded default: 3x2 CPU mesh, a few minutes
    python -m orchestration.train --preset m95 --steps 50
    python -m orchestration.train --config run.yaml --mesh.rows 4
    torchrun --nnodes 2 --nproc-per-node 3 ... -m orchestration.train --preset m95   # multi-node

Under torchrun (multi-node) every rank runs ``prepare`` itself (deterministic, so all
agree), and ``--checkpoint.dir`` must be on storage every node sees: ranks write their
own files, rank 0 indexes the stage shards and publishes the checkpoint.

Flow: ``main`` parses and validates the config (orchestration.config.validate: every
rule on the config itself), then ``prepare`` checks it against the model, data and
checkpoint it reads and loads them once, all BEFORE a process is spawned (bad input is a
clear error, never a dead mesh). Without torchrun variables it spawns the local mesh
itself (orchestration.distributed.launch); under torchrun each process is one rank. Every rank runs
``run_rank``: join the mesh, take its stage of the model, then a fast rank runs an
orchestration.trainer.Trainer (the step loop, DP sync, anchor hook, checkpoints,
metrics) and an anchor rank runs orchestration.anchor.run_anchor_rank in a world of its
own. The local launcher restarts a dead anchor row (``--anchor.restarts``); by hand, or
on another machine, ``--anchor.join --anchor.store HOST:PORT`` with the run's
config.yaml starts just the anchor row, which joins the running fast circuit.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP (environment.md)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # we fork after tokenizing
if not os.isatty(1) and not os.isatty(2):  # output to a log file: the base model build's and a GGUF
    os.environ.setdefault("TQDM_MININTERVAL", "30")  # conversion's bars redraw every 30 s (read at tqdm's import)

import socket
import sys
import time
from dataclasses import dataclass

import torch

from orchestration.components import checkpoint as ckpt
from orchestration.config import Config, ineffective_settings, parse_args, to_yaml
from orchestration.distributed import devices
from orchestration.distributed.launch import MeshFailure, free_port, run_local
from orchestration.distributed.mesh import MeshLayout, destroy_mesh, init_mesh, mesh_name
from orchestration.components.builders import RankContext, build_stage
from orchestration.components import memory, resume
from orchestration.components.divergence import DIVERGED  # the exit code (importable from here too)
from orchestration.trainer import Trainer

DEFAULT_DATA = "corpus:python"  # domain B of orchestration.data.corpora: the base model never saw it


# ============================================================== before any process starts
@dataclass
class Plan:
    """Everything resolved in the parent: paths, the token rows, the model (fork only)."""

    model_path: str
    run_dir: str
    ckpt_dir: str
    train_rows: torch.Tensor
    eval_rows: torch.Tensor
    resume_from: str = ""
    model: object = None  # loaded once in the parent and inherited by forked ranks
    num_layers: int = 0
    hidden_size: int = 0
    arch: str = ""
    memory: str = ""  # the per-stage memory table of the start banner


def prepare(cfg: Config, *, load_model: bool = True) -> Plan:
    """Checks the model, data and checkpoint inputs and loads them; ValueError/FileNotFoundError
    name the problem. Nothing here needs another process."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one progress bar on screen: ours
    from meshkern import _backend

    _backend.load_all()  # load (or warn about) the extensions once here; forked ranks inherit it
    path, hf_cfg, arch = _checked_model(cfg)
    train_ds, eval_ds = _checked_data(cfg, path, hf_cfg)
    run_dir, ckpt_dir, resume_from = _run_paths(cfg, hf_cfg)
    for line in ineffective_settings(cfg):
        print(f"warning: {line}", file=sys.stderr, flush=True)
    max_pos = getattr(hf_cfg, "max_position_embeddings", None)
    if max_pos and cfg.data.seq_len > max_pos:
        print(f"warning: --data.seq-len {cfg.data.seq_len} exceeds the model's max_position_embeddings {max_pos}",
              file=sys.stderr, flush=True)
    plan = Plan(path, run_dir, ckpt_dir, train_ds.tokens, None if eval_ds is None else eval_ds.tokens,
                resume_from, num_layers=hf_cfg.num_hidden_layers, hidden_size=hf_cfg.hidden_size, arch=arch,
                memory=memory.banner(cfg, hf_cfg))
    if load_model:
        plan.model = _load_model(cfg, path)
        from orchestration.components.calibration import prepare_run  # pca codec: fit the basis here, forked ranks inherit it
        prepare_run(cfg, plan)
    return plan


def _checked_model(cfg: Config):
    """(path, HF config, architecture) of --model.path, checked against the mesh's split."""
    from transformers import AutoConfig

    from orchestration.distributed.stages import SUPPORTED_ARCHITECTURES, replica_split
    from orchestration.models import paths as model_paths

    path = model_paths.resolve_model(cfg.model.path, progress=True)  # default, built-in name, .gguf or a directory
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"--model.path {path!r} is not a Hugging Face checkpoint directory (no config.json)")
    try:
        hf_cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"--model.path {path}: unreadable or unknown architecture in config.json ({e})") from None
    arch = (getattr(hf_cfg, "architectures", None) or [type(hf_cfg).__name__])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"--model.path {path}: architecture {arch} cannot be split into stages; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    n_layers = hf_cfg.num_hidden_layers
    lps = cfg.mesh.layers_per_stage
    if lps and sum(lps) != n_layers:
        raise ValueError(f"--mesh.layers-per-stage {lps} sums to {sum(lps)}, the model has {n_layers} decoder layers")
    for y in sorted(set(cfg.replica_stages)):
        try:
            replica_split(n_layers, y, lps)
        except ValueError as e:  # more stages than layers
            raise ValueError(f"--mesh.{'replicas' if cfg.mesh.replicas else 'stages'} {y}: {e}") from None
    if cfg.adapter.kind == "lora":
        from orchestration.adapters import check_targets

        check_targets(cfg.adapter, hf_cfg)
    devices.resolve_dist_backend(cfg.mesh.dist_backend, cfg.mesh.device,  # ValueError: no GPU / too few for nccl
                                 local_ranks=devices.local_world_size() if under_torchrun() else cfg.world_size)
    devices.start_method(cfg.mesh.start_method, cfg.mesh.device)
    return path, hf_cfg, arch


def _checked_data(cfg: Config, path: str, hf_cfg):
    """(train, held-out) token datasets of --data.source, tokenized by the model's tokenizer
    (cached), checked against the batch and the model's vocabulary."""
    from orchestration.data import tokens as data_mod
    from orchestration.models import loading as models

    source = cfg.data.source or DEFAULT_DATA
    if not source.startswith(("corpus:", "task:")) and not os.path.exists(source):
        raise FileNotFoundError(f"--data.source {source!r} does not exist")
    max_tokens = cfg.data.max_sequences * cfg.data.seq_len if cfg.data.max_sequences else None
    cache = cfg.data.token_cache
    if cache == "auto":
        cache = str(models.cache_root() / "tokens")
    ds = data_mod.build_token_dataset(source, path, cfg.data.seq_len, max_tokens=max_tokens,
                                      text_field=cfg.data.text_field, on_decode_error=cfg.data.on_decode_error,
                                      token_cache=cache or None)
    if cfg.data.eval_fraction > 0:
        train_ds, eval_ds = ds.split(cfg.data.eval_fraction, seed=cfg.data.split_seed)
    else:
        train_ds, eval_ds = ds, None
    per_row = len(train_ds) // cfg.fast_rows
    if per_row < cfg.train.batch_size:
        raise ValueError(f"--data.source {source}: {len(train_ds)} training sequences of {cfg.data.seq_len} tokens "
                         f"give each of {cfg.fast_rows} fast replicas {per_row}, fewer than --train.batch-size "
                         f"{cfg.train.batch_size}; use more text, a shorter --data.seq-len or a smaller batch")
    if hf_cfg.vocab_size <= int(ds.tokens.max()):
        raise ValueError(f"--data.source tokens reach id {int(ds.tokens.max())} but the model's vocab is {hf_cfg.vocab_size}")
    return train_ds, eval_ds


def _run_paths(cfg: Config, hf_cfg) -> tuple[str, str, str]:
    """(run directory, checkpoint directory, checkpoint to resume from or "") of this run;
    a checkpoint to resume is checked against this run's mesh, steps and settings."""
    # Under torchrun every rank derives the run directory: it must not depend on the clock.
    rid = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    stamp = (rid if rid != "none" else "torchrun") if under_torchrun() else time.strftime("%Y%m%d-%H%M%S")
    name = cfg.run.name or f"{cfg.preset or 'default'}-{stamp}"
    run_dir = os.path.join(cfg.run.out_dir, name)
    ckpt_dir = cfg.checkpoint.dir or os.path.join(run_dir, "checkpoints")
    r = cfg.checkpoint.resume
    if r and r != "latest" and not cfg.run.name and not cfg.checkpoint.dir:
        # Resuming from RUN_DIR/checkpoints/step_N: continue that run (same metrics file and
        # checkpoint directory) instead of starting a new run directory.
        ckpt_dir = os.path.dirname(os.path.abspath(r))
        if os.path.basename(ckpt_dir) == "checkpoints":
            run_dir = os.path.dirname(ckpt_dir)
    resume_from = ""
    if r == "latest" and not cfg.run.name and not cfg.checkpoint.dir and not under_torchrun():  # (torchrun: named by its run id)
        raise ValueError(resume.resume_needs_a_run(cfg.run.out_dir))
    if cfg.checkpoint.resume:
        resume_from = ckpt.resolve(cfg.checkpoint.resume, ckpt_dir)
        meta = ckpt.read_meta(resume_from)
        if meta.get("replicas") is not None:  # stages of each fast replica
            was, now = [int(y) for y in meta["replicas"]], cfg.replica_stages
        else:  # a checkpoint from before heterogeneous meshes: rows (the anchor row included) x stages
            was, now = [meta["stages"]] * (meta["rows"] - bool(meta.get("anchor"))), cfg.replica_stages
        if was != now:
            raise ValueError(f"--checkpoint.resume {resume_from} was written by a mesh of {mesh_name(was)}, "
                             f"this run is {mesh_name(now)}")
        if meta["step"] >= cfg.train.steps:
            raise ValueError(f"--checkpoint.resume {resume_from} is at step {meta['step']}, not before --train.steps {cfg.train.steps}")
        resume.check_resumable(cfg, resume_from, meta, hf_cfg)
    return run_dir, ckpt_dir, resume_from


def _load_model(cfg: Config, path: str):
    from orchestration.models.loading import load_causal_lm

    model, _ = load_causal_lm(path, dtype=getattr(torch, cfg.model.dtype))
    return model


# ============================================================== one rank
def run_rank(rank: int, world_size: int, cfg: Config, plan: Plan) -> dict:
    """Runs one rank to the end of training; returns its record (rank 0: the summary).
    A fast rank is an orchestration.trainer.Trainer; an anchor rank joins a world of its
    own (orchestration.distributed.mesh) and runs orchestration.anchor.run_anchor_rank."""
    torch.set_num_threads(cfg.mesh.threads_per_rank)
    layout = MeshLayout.of(cfg)
    if layout.is_anchor(rank):
        from orchestration import anchor

        mesh = anchor.join_anchor_row(layout, rank, cfg)
    else:
        mesh = init_mesh(layout, dist_backend=cfg.mesh.dist_backend, timeout_s=cfg.mesh.timeout_s,
                         num_layers=plan.num_layers, layers_per_stage=cfg.mesh.layers_per_stage,
                         device=cfg.mesh.device)
    try:
        stage = build_stage(cfg, plan, mesh)
        if mesh.is_anchor:
            from orchestration import anchor

            params = [p for p in stage.parameters() if p.requires_grad]
            return anchor.run_anchor_rank(RankContext(cfg, plan, mesh, stage, params))
        return Trainer(rank, cfg, plan, mesh, stage).run()
    finally:
        destroy_mesh()


def run_anchor_row_rank(index: int, world_size: int, cfg: Config, plan: Plan) -> dict:
    """``--anchor.join`` (local launcher): process ``index`` is the anchor rank of stage ``index``."""
    layout = MeshLayout.of(cfg, anchor=True)
    return run_rank(layout.anchor_rank(index), world_size, cfg, plan)


# ============================================================== entry point
def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def main(argv: list[str] | None = None) -> int:
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
    if cfg.run.tensorboard:
        from orchestration.components.metrics import tensorboard_available

        if not tensorboard_available():
            print("warning: --run.tensorboard: the tensorboard package is not installed (pip install tensorboard); "
                  "logging to metrics.jsonl only", file=sys.stderr, flush=True)
            cfg.run.tensorboard = False
    try:
        start = devices.start_method(cfg.mesh.start_method, cfg.mesh.device)
        plan = prepare(cfg, load_model=start == "fork" and not under_torchrun())
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    layout = MeshLayout.of(cfg)
    join = cfg.anchor.join  # start only the anchor row, joining a running fast circuit
    if not plan.resume_from and not join and not cfg.mesh.join and (found := ckpt.existing_run(plan.run_dir, plan.ckpt_dir)):
        # (here, not in prepare: tools such as orchestration.experiments prepare finished runs to evaluate them)
        print(f"error: run {os.path.basename(plan.run_dir)!r} already exists ({found}): continue it with "
              "--checkpoint.resume latest (same --run.name), or choose another --run.name", file=sys.stderr)
        return 2
    if under_torchrun():
        return _main_torchrun(cfg, plan, layout, join)
    return _main_local(cfg, plan, layout, join)


def _dry_run(cfg: Config) -> int:
    """--dry-run: the checked model and mesh, and the memory each stage needs; starts nothing."""
    try:
        path, hf_cfg, arch = _checked_model(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"model {arch} from {path}; mesh {mesh_name(cfg.replica_stages)}")
    print(memory.banner(cfg, hf_cfg))
    return 0


def _main_torchrun(cfg: Config, plan: Plan, layout: MeshLayout, join: bool) -> int:
    """This process is one rank (torchrun): check the world, run the rank; the exit code."""
    world = int(os.environ["WORLD_SIZE"])
    want = layout.stages if join or cfg.mesh.elastic else layout.fast_world_size
    if world != want:
        what = "anchor row (one process per stage)" if join else f"{layout.name} mesh"
        extra = " plus an anchor row started with --anchor.join" if cfg.anchor.enabled and not join else ""
        print(f"error: torchrun started {world} processes, the {what} needs {want}{extra}", file=sys.stderr)
        return 2
    rank = int(os.environ["RANK"])
    if cfg.mesh.elastic:  # one torchrun per replica, joining a lighthouse
        from orchestration.elastic.run import torchrun_replica

        return torchrun_replica(cfg, plan, layout, rank, world)
    if rank == 0 and cfg.anchor.enabled and not join:
        addr = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        print(f"[anchor] the fast circuit's store is {addr}; start the anchor row (one process per stage) "
              f"with: torchrun --nproc-per-node {layout.stages} ... -m orchestration.train <this run's flags> "
              f"--anchor.join --anchor.store {addr}", file=sys.stderr, flush=True)
    out = run_rank(layout.anchor_rank(rank) if join else rank, world, cfg, plan)
    if isinstance(out, dict) and out.get("diverged"):
        if rank == 0:
            print(f"error: {out['diverged']}", file=sys.stderr, flush=True)
        return DIVERGED
    return 0


def _main_local(cfg: Config, plan: Plan, layout: MeshLayout, join: bool) -> int:
    """Spawns the local mesh (or, with --anchor.join, just the anchor row); the exit code."""
    os.makedirs(plan.run_dir, exist_ok=True)
    if join:
        return _join_anchor_row(cfg, plan, layout)
    if cfg.mesh.join:
        from orchestration.elastic.run import run_elastic

        return run_elastic(cfg, plan, layout, [cfg.mesh.replica_id], cfg.mesh.join)
    print(f"run folder: {plan.run_dir}/ (config.yaml, metrics.jsonl, checkpoints/"
          + (", tensorboard/" if cfg.run.tensorboard else "") + "; a summary at the end)", flush=True)
    if plan.memory:
        print(plan.memory, flush=True)
    cfg.run.name = os.path.basename(plan.run_dir)  # so that --config RUN_DIR/config.yaml names this run
    with open(os.path.join(plan.run_dir, "config.yaml"), "w") as f:
        f.write(to_yaml(cfg))
    if cfg.mesh.elastic:
        from orchestration.elastic.run import run_elastic

        return run_elastic(cfg, plan, layout, [int(r) for r in cfg.mesh.local_replicas] or list(range(layout.fast_rows)))
    try:
        port = free_port()
        anchors = {r for r in range(cfg.world_size) if layout.is_anchor(r)}
        if anchors:
            print(f"[anchor] the fast circuit's store is 127.0.0.1:{port}; a new anchor row joins it with: "
                  f"python -m orchestration.train --config {os.path.join(plan.run_dir, 'config.yaml')} "
                  f"--anchor.join --anchor.store 127.0.0.1:{port}", file=sys.stderr, flush=True)
        res = run_local(run_rank, cfg.world_size, (cfg, plan),
                        start_method=devices.start_method(cfg.mesh.start_method, cfg.mesh.device),
                        threads=cfg.mesh.threads_per_rank, describe=layout.describe, optional=anchors,
                        restarts=cfg.anchor.restarts if anchors else 0, port=port)
    except MeshFailure as e:
        return resume.mesh_stopped(e, plan)
    if res and res[0] and res[0].get("diverged"):
        print(f"error: {res[0]['diverged']}", file=sys.stderr, flush=True)
        return DIVERGED
    if res and res[0] and res[0].get("interrupted"):
        return 130  # stopped by Ctrl-C / SIGTERM after saving: the shell's convention
    return 0


def _join_anchor_row(cfg: Config, plan: Plan, layout: MeshLayout) -> int:
    """--anchor.join: the anchor row's processes, joining the running fast circuit."""
    from orchestration.anchor import store_address

    host, port = store_address(cfg)
    try:  # fail fast, not after the store client's minutes of retries, if nothing listens there
        socket.create_connection((host, port), timeout=10).close()
    except OSError as e:
        print(f"error: --anchor.store {host}:{port}: cannot connect ({e.strerror or e}); is the fast circuit "
              "running? (its launcher prints the address)", file=sys.stderr)
        return 2
    try:
        res = run_local(run_anchor_row_rank, layout.stages, (cfg, plan),
                        start_method=devices.start_method(cfg.mesh.start_method, cfg.mesh.device),
                        threads=cfg.mesh.threads_per_rank, optional=set(range(layout.stages)),
                        describe=lambda r: layout.describe(layout.anchor_rank(r)),
                        restarts=cfg.anchor.restarts)
    except MeshFailure as e:
        return resume.mesh_stopped(e, plan)
    for r in res:
        if r is not None:
            print(f"[anchor] {layout.describe(r['rank'])}, generation {r['generation']}: {r['rounds']} rounds, "
                  f"stopped: {r['stopped']}", file=sys.stderr, flush=True)
    return 0 if all(r is not None for r in res) else 1


if __name__ == "__main__":
    sys.exit(main())
