"""Before any process starts: the config checked against the model, data and checkpoint
it names, and those loaded once (``prepare`` -> ``Plan``). Bad input is a clear error here
(ValueError / FileNotFoundError naming the flag), never a dead mesh. Every launcher
(orchestration.launch) prepares first; under torchrun every process prepares itself
(deterministic, so all agree).
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import torch

from orchestration.components import checkpoint as ckpt
from orchestration.components import memory, resume
from orchestration.config import Config, ineffective_settings
from orchestration.distributed import devices
from orchestration.distributed.mesh import mesh_name
from orchestration.distributed.secret import creates_secret, run_secret

DEFAULT_DATA = "corpus:python"  # domain B of orchestration.data.corpora: the base model never saw it


def under_torchrun() -> bool:
    """This process was started by torchrun (or another env:// launcher): it is one rank."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


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
    secret: bytes | None = None  # the run's shared secret when it uses one (anchor, elastic)


def prepare(cfg: Config, *, load_model: bool = True) -> Plan:
    """Checks the model, data and checkpoint inputs and loads them; ValueError/FileNotFoundError
    name the problem. Nothing here needs another process."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one progress bar on screen: ours
    from meshkern import _backend

    _backend.load_all()  # load (or warn about) the extensions once here; forked ranks inherit it
    path, hf_cfg, arch = checked_model(cfg)
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
    if cfg.anchor.enabled or cfg.mesh.elastic:  # the one rule of who makes it: orchestration.distributed.secret
        plan.secret = run_secret(cfg, run_dir, create=creates_secret(cfg, under_torchrun()))
    if load_model:
        plan.model = _load_model(cfg, path)
        from orchestration.components.calibration import prepare_run  # pca codec: fit the basis here, forked ranks inherit it
        prepare_run(cfg, plan)
    return plan


def checked_model(cfg: Config):
    """(path, HF config, architecture) of --model.path, checked against the mesh's split."""
    from transformers import AutoConfig

    from orchestration.distributed.stages import check_splittable, replica_split
    from orchestration.models import paths as model_paths

    path = model_paths.resolve_model(cfg.model.path, progress=True)  # default, built-in name, .gguf or a directory
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"--model.path {path!r} is not a Hugging Face checkpoint directory (no config.json)")
    try:
        hf_cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"--model.path {path}: unreadable or unknown architecture in config.json ({e})") from None
    arch = (getattr(hf_cfg, "architectures", None) or [type(hf_cfg).__name__])[0]
    try:
        check_splittable(hf_cfg)  # one line saying why: encoder-decoder, vision tower, unknown family, ...
    except ValueError as e:
        raise ValueError(f"--model.path {path}: cannot be split into stages: {e}") from None
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
    if r == "latest" and under_torchrun() and not cfg.mesh.elastic and ckpt.disk_is_empty(ckpt_dir):
        # One host of several with nothing on its disk (a replaced machine): its fast ranks
        # join and the mesh says at once which host lacks what (Checkpointer.load), instead
        # of this host failing here while the others wait at the rendezvous; an anchor row
        # (its state is its own, orchestration.anchor.node) starts fresh.
        if cfg.anchor.join:
            print(f"warning: no checkpoint in {ckpt_dir} on this host: the anchor row starts without the run's "
                  "checkpoint (its own saved state, if any, is used)", file=sys.stderr, flush=True)
            return run_dir, ckpt_dir, ""
        print(f"warning: no checkpoint in {ckpt_dir} on this host (an empty disk?): the other hosts are asked "
              "once the mesh is up", file=sys.stderr, flush=True)
        return run_dir, ckpt_dir, ckpt.no_local_checkpoint(ckpt_dir)
    if cfg.checkpoint.resume:
        resume_from = ckpt.resolve(cfg.checkpoint.resume, ckpt_dir)
        meta = ckpt.read_meta(resume_from)
        was, now = ckpt.replica_stages(meta), cfg.replica_stages
        if was != now:
            raise ValueError(f"--checkpoint.resume {resume_from} was written by a mesh of {mesh_name(was)}, "
                             f"this run is {mesh_name(now)}")
        if meta["step"] >= cfg.train.steps:
            raise ValueError(f"--checkpoint.resume {resume_from} is at step {meta['step']}, not before --train.steps {cfg.train.steps}")
        resume.check_resumable(cfg, resume_from, meta, hf_cfg)
    return run_dir, ckpt_dir, resume_from


def _load_model(cfg: Config, path: str):
    from orchestration.models.loading import load_causal_lm

    model, _ = load_causal_lm(path, dtype=getattr(torch, cfg.model.dtype), boundary=False)
    return model
