"""``python -m orchestration.train``: adapt a causal LM on an X x Y mesh of processes.

    python -m orchestration.train                      # embedded default: 3x2 CPU mesh, a few minutes
    python -m orchestration.train --preset m95 --steps 50
    python -m orchestration.train --config run.yaml --mesh.rows 4
    torchrun --nnodes 2 --nproc-per-node 3 ... -m orchestration.train --preset m95   # multi-node

Under torchrun (multi-node) every rank runs ``prepare`` itself (deterministic, so all
agree), and ``--checkpoint.dir`` must be on storage every node sees: ranks write their
own files, rank 0 indexes the stage shards and publishes the checkpoint.

Flow: ``main`` parses and validates the config, then ``prepare`` checks every path and
builds the model and token data once, all BEFORE a process is spawned (bad input is a
clear error, never a dead mesh). Without torchrun variables it spawns the local mesh
itself (orchestration.launch); under torchrun each process is one rank. Every rank runs
``run_rank``: join the mesh, take its stage of the model, then the step loop:

    pipeline step (schedule + codec boundaries, grad accumulation over micro-batches)
    -> tied-embedding grad sync -> DP gradient all-reduce (dp.mode=allreduce)
    -> global grad-norm clip -> anchor gradients (if any arrived) -> inner optimizer
    -> Streaming DiLoCo (dp.mode=diloco) -> metrics / progress / checkpoint

The anchor circuit plugs in through ``orchestration.anchor``: fast ranks poll a
``FastHook`` once per step; anchor ranks run ``anchor.run_anchor_rank(ctx)`` in a world of
their own. The local launcher restarts a dead anchor row (``--anchor.restarts``); by hand,
or on another machine, ``--anchor.join --anchor.store HOST:PORT`` with the run's
config.yaml starts just the anchor row, which joins the running fast circuit.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP (environment.md)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # we fork after tokenizing

import math
import signal
import socket
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from orchestration import checkpoint as ckpt
from orchestration.config import Config, parse_args, to_yaml
from orchestration.data import BatchSampler, shard_rows
from orchestration.launch import MeshFailure, free_port, run_local
from orchestration.mesh import MeshLayout, init_mesh, destroy_mesh
from orchestration.metrics import (AXES, JsonlWriter, LinkCounter, format_table, held_out_loss,  # noqa: F401
                                   modeled_step, summarize, summary_rows, write_link_bytes)

DEFAULT_DATA = "corpus:python"  # domain B of orchestration.corpora: the base model never saw it


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


def prepare(cfg: Config, *, load_model: bool = True) -> Plan:
    """Checks the model, data and checkpoint inputs and loads them; ValueError/FileNotFoundError
    name the problem. Nothing here needs another process."""
    from transformers import AutoConfig

    from orchestration import data as data_mod
    from orchestration import models
    from orchestration.stages import SUPPORTED_ARCHITECTURES, balanced_layers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one progress bar on screen: ours
    from meshkern import _backend

    _backend.load_all()  # load (or warn about) the extensions once here; forked ranks inherit it

    path = models.resolve_model(cfg.model.path, progress=True)  # default, built-in name, .gguf or a directory
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
    if lps:
        if sum(lps) != n_layers:
            raise ValueError(f"--mesh.layers_per_stage {lps} sums to {sum(lps)}, the model has {n_layers} decoder layers")
    else:
        try:
            balanced_layers(n_layers, cfg.mesh.stages)
        except ValueError as e:  # more stages than layers
            raise ValueError(f"--mesh.stages {cfg.mesh.stages}: {e}") from None
    if cfg.mesh.backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("--mesh.backend nccl needs CUDA GPUs, and torch sees none (torch.cuda.is_available() is False)")
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
                         f"give each of {cfg.fast_rows} fast replicas {per_row}, fewer than --train.batch_size "
                         f"{cfg.train.batch_size}; use more text, a shorter --data.seq_len or a smaller batch")
    if hf_cfg.vocab_size <= int(ds.tokens.max()):
        raise ValueError(f"--data.source tokens reach id {int(ds.tokens.max())} but the model's vocab is {hf_cfg.vocab_size}")

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
    if cfg.checkpoint.resume:
        resume_from = ckpt.resolve(cfg.checkpoint.resume, ckpt_dir)
        meta = ckpt.read_meta(resume_from)
        if (meta["rows"], meta["stages"]) != (cfg.mesh.rows, cfg.mesh.stages):
            raise ValueError(f"--checkpoint.resume {resume_from} was written by a {meta['rows']}x{meta['stages']} mesh, "
                             f"this run is {cfg.mesh.rows}x{cfg.mesh.stages}")
        if meta["step"] >= cfg.train.steps:
            raise ValueError(f"--checkpoint.resume {resume_from} is at step {meta['step']}, not before --train.steps {cfg.train.steps}")
        _check_resumable(cfg, resume_from, meta, hf_cfg)
    max_pos = getattr(hf_cfg, "max_position_embeddings", None)
    if max_pos and cfg.data.seq_len > max_pos:
        print(f"warning: --data.seq_len {cfg.data.seq_len} exceeds the model's max_position_embeddings {max_pos}",
              file=sys.stderr, flush=True)
    plan = Plan(path, run_dir, ckpt_dir, train_ds.tokens, None if eval_ds is None else eval_ds.tokens,
                resume_from, num_layers=n_layers, hidden_size=hf_cfg.hidden_size, arch=arch)
    if load_model:
        plan.model = _load_model(cfg, path)
    return plan


def _check_resumable(cfg: Config, path: str, meta: dict, hf_cfg) -> None:
    """ValueError naming the difference if the checkpoint at ``path`` was written by a run
    whose state this one cannot load: another optimizer or anchor setting, another layer
    split, another model shape."""
    from orchestration.stages import balanced_layers

    old = meta.get("config", {})
    n = hf_cfg.num_hidden_layers
    split = lambda lps: list(lps) if lps else balanced_layers(n, cfg.mesh.stages)  # noqa: E731
    for section, key in (("train", "optimizer"), ("anchor", "enabled"), ("mesh", "layers_per_stage")):
        was, now = old.get(section, {}).get(key), getattr(getattr(cfg, section), key)
        if key == "layers_per_stage" and was is not None:
            was, now = split(was), split(now)
        if was is not None and was != now:
            raise ValueError(f"--checkpoint.resume {path} was written with --{section}.{key} {was}, this run has {now} "
                             f"(resume with the run's own config: --config RUN_DIR/config.yaml)")
    try:
        from transformers import AutoConfig

        saved = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        return  # no config.json copied (model dir had none): nothing more to compare
    for key in ("hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size", "num_key_value_heads"):
        was, now = getattr(saved, key, None), getattr(hf_cfg, key, None)
        if was != now:
            raise ValueError(f"--checkpoint.resume {path} holds a model with {key}={was}, --model.path has {now}")


def _load_model(cfg: Config, path: str):
    from orchestration.models import load_causal_lm

    model, _ = load_causal_lm(path, dtype=getattr(torch, cfg.model.dtype))
    return model


# ============================================================== per-rank pieces
def lr_at(step: int, cfg: Config) -> float:
    """Linear warmup to train.lr, then cosine decay to lr * min_lr_ratio at the last step
    (meshkern.optim.warmup_cosine_lr)."""
    from meshkern.optim import warmup_cosine_lr

    t = cfg.train
    return warmup_cosine_lr(step, lr=t.lr, steps=t.steps, warmup_steps=t.warmup_steps, min_lr_ratio=t.min_lr_ratio)


def data_shard(cfg: Config, plan: Plan, row: int) -> torch.Tensor:
    """Training rows of fast replica ``row``: one disjoint strided shard per fast replica
    (orchestration.data.shard_rows). The anchor row takes no shard (it samples the whole
    training set with its own seed: orchestration.anchor.round_batch), so for a given seed
    the fast replicas see the same batches with and without the anchor row."""
    return shard_rows(plan.train_rows, row, cfg.fast_rows)


def replica_sampler(cfg: Config, plan: Plan, row: int) -> BatchSampler:
    """The batches fast replica ``row`` trains on: its shard, its own seed (a function of
    --train.seed and the row only, not of the anchor setting)."""
    return BatchSampler(data_shard(cfg, plan, row), cfg.train.batch_size, cfg.train.seed + 7919 * row)


class NullAnchor:
    """The anchor hook when the anchor is off: never anything to fold in.

    The contract ``orchestration.anchor.FastHook(ctx: RankContext)`` implements on
    fast ranks (polled once per fast step, on the critical path, so it must never block
    on the anchor): ``poll(step)`` hands whatever arrived to ``ctx.optimizer`` itself
    (``SpectralAdamW.observe_anchor_update``, both transports) before the inner step,
    and switches the prior off and on (``set_prior_enabled``); ``after_step(step)`` (e.g. serve
    a parameter snapshot); ``bytes_sent`` (this rank's anchor-axis bytes, both ways it
    sends); ``stats()`` -> flat dict logged as ``anchor_<key>``; ``close()`` at the end
    of training (tell the anchor row to stop). Anchor ranks run
    ``orchestration.anchor.run_anchor_rank(ctx)`` instead of the fast loop and return a
    dict; the launcher treats them as optional (their death does not stop the run).
    """

    bytes_sent = 0

    def poll(self, step: int) -> None:
        pass

    def after_step(self, step: int) -> None:
        pass

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        pass


def make_compressor(cfg: Config):
    from meshkern import compress

    names = {"none": "NoCompression", "powersgd": "PowerSGD", "sparseloco": "SparseLoCo", "int8": "Int8"}
    cls = getattr(compress, names[cfg.dp.compressor], None)
    if cls is None:
        raise ValueError(f"--dp.compressor {cfg.dp.compressor}: meshkern.compress.{names[cfg.dp.compressor]} is not available")
    return cls(timeout_s=cfg.mesh.timeout_s, **cfg.dp.compressor_options)


def make_optimizer(cfg: Config, stage):
    t = cfg.train
    kw = dict(lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, weight_decay=t.weight_decay)
    if t.optimizer == "spectral":
        from meshkern.optim import SpectralAdamW, spectral_param_groups

        return SpectralAdamW(spectral_param_groups(stage), tau=t.tau, alpha=t.alpha, beta_anc=t.beta_anc,
                             rank=t.spectral_rank, seed=t.seed, **kw)
    return torch.optim.AdamW([p for p in stage.parameters() if p.requires_grad], **kw)


@dataclass
class RankContext:
    """What a rank holds; handed to the anchor module's hooks."""

    cfg: Config
    plan: Plan
    mesh: object
    stage: object
    params: list
    optimizer: object = None
    counter: LinkCounter = field(default_factory=LinkCounter)
    step: int = 0


# ============================================================== the rank's main loop
def run_rank(rank: int, world_size: int, cfg: Config, plan: Plan) -> dict:
    """Runs one rank to the end of training; returns its record (rank 0: the summary)."""
    torch.set_num_threads(cfg.mesh.threads_per_rank)
    layout = MeshLayout(cfg.mesh.rows, cfg.mesh.stages, cfg.anchor.enabled)
    if layout.is_anchor(rank):  # the anchor row is a world of its own (orchestration.mesh)
        from orchestration import anchor

        mesh = anchor.join_anchor_row(layout, rank, cfg)
    else:
        mesh = init_mesh(layout, backend=cfg.mesh.backend, timeout_s=cfg.mesh.timeout_s)
    try:
        return _run(rank, cfg, plan, mesh)
    finally:
        destroy_mesh()


def continue_command(plan: Plan) -> str:
    """The command that continues this run from its latest checkpoint."""
    return (f"python -m orchestration.train --config {os.path.join(plan.run_dir, 'config.yaml')} "
            "--checkpoint.resume latest")


def run_anchor_row_rank(index: int, world_size: int, cfg: Config, plan: Plan) -> dict:
    """``--anchor.join`` (local launcher): process ``index`` is the anchor rank of stage ``index``."""
    layout = MeshLayout(cfg.mesh.rows, cfg.mesh.stages, True)
    return run_rank(layout.anchor_rank(index), world_size, cfg, plan)


def _run(rank: int, cfg: Config, plan: Plan, mesh) -> dict:
    from orchestration.codecs import make_codec
    from orchestration.pipeline import PipelineExecutor
    from orchestration.schedule import make_schedule
    from orchestration.stages import split_model

    torch.manual_seed(cfg.train.seed)
    model = plan.model if plan.model is not None else _load_model(cfg, plan.model_path)
    stages = split_model(model, cfg.mesh.stages, cfg.mesh.layers_per_stage or None)
    stage = stages[mesh.stage]
    del stages, model
    plan.model = None
    stage.to(mesh.device).train()
    params = [p for p in stage.parameters() if p.requires_grad]
    ctx = RankContext(cfg, plan, mesh, stage, params)

    if mesh.is_anchor:
        from orchestration import anchor

        return anchor.run_anchor_rank(ctx)

    opt = ctx.optimizer = make_optimizer(cfg, stage)
    counter = ctx.counter
    t = cfg.train
    M = t.microbatches
    codec = make_codec(cfg.boundary.codec, p=cfg.boundary.p, rescale=cfg.boundary.rescale, **cfg.boundary.options)
    actions = make_schedule(t.schedule, cfg.mesh.stages, M)[mesh.stage]
    # Each replica draws its own masks: mix the row into the Philox seed.
    mask_seed = (t.seed << 16) | mesh.row
    pipe = PipelineExecutor(stage, actions, codec=codec, prev_rank=mesh.prev_rank, next_rank=mesh.next_rank,
                            rank=rank, seed=mask_seed, counter=counter)
    sampler = replica_sampler(cfg, plan, mesh.row)

    n_fast = cfg.fast_rows
    allreduce = diloco = None
    if n_fast > 1 and cfg.dp.mode == "allreduce":
        allreduce = make_compressor(cfg)
    elif n_fast > 1 and cfg.dp.mode == "diloco":
        from meshkern.diloco import StreamingDiLoCo

        d = cfg.dp
        diloco = StreamingDiLoCo(list(stage.named_parameters()), mesh.dp, sync_every=d.sync_every,
                                 num_fragments=d.fragments, outer_lr=d.outer_lr, outer_momentum=d.outer_momentum,
                                 overlap_steps=d.overlap_steps, compressor=make_compressor(cfg),
                                 timeout_s=cfg.mesh.timeout_s)
    tied = stage.tied_lm_head or (stage.is_first and _tied_across(plan, cfg))
    tied_param = (stage.lm_head.weight if stage.is_last else stage.embed_tokens.weight) if tied else None

    hook = NullAnchor()
    if cfg.anchor.enabled:
        from orchestration import anchor

        hook = anchor.FastHook(ctx)

    start = 0
    if plan.resume_from:
        st = ckpt.load_rank_state(plan.resume_from, rank)
        stage.load_state_dict(st["stage"])
        opt.load_state_dict(st["optimizer"])
        counter.load_state_dict(st["counter"])
        if diloco is not None and st.get("diloco") is not None:
            diloco.load_state_dict(st["diloco"])
        if allreduce is not None and st.get("compressor") is not None:
            allreduce.load_state_dict(st["compressor"])
        start = int(st["step"])
        if rank == 0:
            print(f"resumed from {plan.resume_from} at step {start}", file=sys.stderr, flush=True)

    stop = {"flag": False}

    def on_sigint(signum, frame):  # stop at the next step boundary, checkpoint, exit
        stop["flag"] = True

    signal.signal(signal.SIGINT, on_sigint)
    signal.signal(signal.SIGTERM, on_sigint)  # a scheduler's / container's stop: same clean stop

    is_log = rank == 0
    writer = JsonlWriter(os.path.join(plan.run_dir, "metrics.jsonl")) if is_log else None
    bar = None
    if is_log and cfg.run.progress:
        from tqdm import tqdm

        bar = tqdm(total=t.steps, initial=start, desc="train", unit="step", dynamic_ncols=True, file=sys.stdout)
    history: list[dict] = []
    last_ckpt = plan.resume_from
    t_start = time.perf_counter()
    t_last = t_start
    steps_done = 0
    skipped = 0
    step = start
    interrupted = False
    for step in range(start, t.steps):
        ctx.step = step
        if rank == cfg.run.fail_rank and step == cfg.run.fail_step:
            os.kill(os.getpid(), signal.SIGKILL)  # fault injection (tests): die like a crashed node
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        stats = pipe.step(step, sampler(step), num_microbatches=M)

        if tied_param is not None:
            dist.all_reduce(tied_param.grad, group=mesh.groups[f"ends{mesh.row}"])
        if allreduce is not None:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            for p, g in zip(params, allreduce.all_reduce_mean(grads, mesh.dp, key=f"stage{mesh.stage}")):
                p.grad = g
            counter.set_total("dp", allreduce.bytes_sent)
        gnorm = _clip(params, t.clip_grad_norm, mesh.pp)
        hook.poll(step)  # folds in what the anchor sent (anchor on)
        if math.isfinite(gnorm):
            opt.step()
        else:
            # Non-finite gradient anywhere in this replica (the norm is all-reduced over its
            # stages, so every stage agrees): skip the update rather than corrupt the weights.
            skipped += 1
        opt.zero_grad(set_to_none=True)
        if diloco is not None:
            diloco.step()
            # Read while a fragment's sync may still run in the background: its bytes count
            # when its collectives have run (exact totals after finish()).
            counter.set_total("dp", diloco.bytes_sent)
        counter.set_total("anchor", hook.bytes_sent)
        hook.after_step(step)

        now = time.perf_counter()
        rec, stopping = reduce_step_metrics(cfg, mesh, step, stats, gnorm, skipped, counter, stop["flag"], now - t_last)
        rec.update({f"anchor_{k}": v for k, v in hook.stats().items()})
        if hasattr(opt, "anchor_stats") and cfg.anchor.enabled:
            rec["anchor_optim"] = {k: v for k, v in opt.anchor_stats().items() if isinstance(v, (int, float, type(None)))}
        steps_done += 1
        t_last = now
        history.append(rec)
        if is_log:
            if (step + 1) % cfg.run.log_every == 0 or step + 1 == t.steps:
                writer.write(rec)
            if bar is not None:
                bpt = rec["bytes_per_token"]
                bar.set_postfix_str(f"loss {rec['loss']:.3f} | {rec['tokens_per_s']:.0f} tok/s | "
                                    f"B/tok PP {bpt['pp_fwd'] + bpt['pp_bwd']:.0f} DP {bpt['dp']:.0f}", refresh=False)
                bar.update(1)
        due = cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0
        if due or stopping or step + 1 == t.steps:
            if diloco is not None:
                diloco.finish()
                counter.set_total("dp", diloco.bytes_sent)  # in-flight syncs are now counted too
            last_ckpt = ckpt.save_checkpoint(cfg, plan, mesh, stage, opt, diloco, allreduce, counter, step + 1)
        if stopping:
            interrupted = True
            break
    if bar is not None:
        bar.close()
    hook.close()
    elapsed = time.perf_counter() - t_start
    links_path = write_link_bytes(plan, mesh, counter)
    out = {"rank": rank, "losses": [h["loss"] for h in history], "bytes": counter.totals(),
           "by_link": counter.by_link(), "interrupted": interrupted, "checkpoint": last_ckpt}
    if is_log:
        writer.close()
        s = summarize(cfg, plan, history, elapsed, steps_done, last_ckpt)
        s["eval_loss"] = held_out_loss(cfg, plan, last_ckpt)
        s["eval_loss_base"] = held_out_loss(cfg, plan, plan.model_path)
        s["links_path"] = links_path
        out["summary"] = s
        if interrupted:
            print(f"interrupted: checkpoint saved at step {step + 1} in {last_ckpt}; continue with: "
                  f"{continue_command(plan)}", flush=True)
        print(format_table(summary_rows(s), title="meshkern run summary"), flush=True)
    return out


def reduce_step_metrics(cfg: Config, mesh, step: int, stats, gnorm: float, skipped: int, counter: LinkCounter,
                        stop: bool, step_s: float) -> tuple[dict, bool]:
    """One small SUM all-reduce over the fast ranks (the anchor never joins it) of
    [stop flag, loss, grad norm, skipped steps, per-stage F and B compute seconds, bytes
    per axis, DP bytes per stage]; returns (the step's metrics record, stop requested)."""
    Y, X, t = cfg.mesh.stages, cfg.fast_rows, cfg.train
    vec = torch.zeros(4 + 3 * Y + len(AXES), dtype=torch.float64)  # filled on CPU, reduced on mesh.device
    vec[0] = float(stop)
    vec[1] = stats.loss if mesh.is_last else 0.0
    vec[2] = (gnorm if math.isfinite(gnorm) else 0.0) / Y if mesh.is_first else 0.0
    vec[3] = float(skipped) / Y
    vec[4 + mesh.stage] = sum(stats.fwd_s) / len(stats.fwd_s) / X
    vec[4 + Y + mesh.stage] = sum(stats.bwd_s) / len(stats.bwd_s) / X
    tot = counter.totals()
    for i, a in enumerate(AXES):
        vec[4 + 2 * Y + i] = tot[a]
    vec[4 + 2 * Y + len(AXES) + mesh.stage] = tot["dp"]
    vec = vec.to(mesh.device)
    dist.all_reduce(vec, group=mesh.fast)
    vec = vec.cpu()
    tokens_per_step = X * t.batch_size * cfg.data.seq_len
    rec = {"step": step + 1, "loss": vec[1].item() / X, "lr": lr_at(step, cfg), "grad_norm": vec[2].item(),
           "tokens": (step + 1) * tokens_per_step, "step_s": step_s,
           "tokens_per_s": tokens_per_step / max(step_s, 1e-9), "skipped_steps": round(vec[3].item()),
           "fwd_s": vec[4:4 + Y].tolist(), "bwd_s": vec[4 + Y:4 + 2 * Y].tolist(),
           "bytes": {a: int(vec[4 + 2 * Y + i]) for i, a in enumerate(AXES)},
           "dp_bytes_by_stage": [int(v) for v in vec[4 + 2 * Y + len(AXES):].tolist()]}
    rec["bytes_per_token"] = {a: rec["bytes"][a] / rec["tokens"] for a in AXES}
    return rec, vec[0].item() > 0


def _tied_across(plan: Plan, cfg: Config) -> bool:
    from transformers import AutoConfig

    return cfg.mesh.stages > 1 and bool(getattr(AutoConfig.from_pretrained(plan.model_path), "tie_word_embeddings", False))


def _clip(params, max_norm: float, pp_group) -> float:
    """Global L2 norm of the replica's gradient (all stages) and clipping to ``max_norm``."""
    sq = torch.zeros(1, dtype=torch.float64, device=params[0].device)
    for p in params:
        if p.grad is not None:
            sq += p.grad.detach().double().pow(2).sum()
    dist.all_reduce(sq, group=pp_group)
    norm = math.sqrt(sq.item())
    if max_norm > 0 and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm


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
    torch.set_num_threads(cfg.mesh.threads_per_rank)
    try:
        plan = prepare(cfg, load_model=cfg.mesh.start_method == "fork" and not under_torchrun())
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    layout = MeshLayout(cfg.mesh.rows, cfg.mesh.stages, cfg.anchor.enabled)
    join = cfg.anchor.join  # start only the anchor row, joining a running fast circuit
    if not plan.resume_from and not join and (found := ckpt.existing_run(plan.run_dir, plan.ckpt_dir)):
        # (here, not in prepare: tools such as orchestration.experiments prepare finished runs to evaluate them)
        print(f"error: run {os.path.basename(plan.run_dir)!r} already exists ({found}): continue it with "
              "--checkpoint.resume latest (same --run.name), or choose another --run.name", file=sys.stderr)
        return 2
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        want = layout.stages if join else layout.fast_world_size
        if world != want:
            what = "anchor row (one process per stage)" if join else f"{cfg.mesh.rows}x{cfg.mesh.stages} mesh"
            extra = " plus an anchor row started with --anchor.join" if cfg.anchor.enabled and not join else ""
            print(f"error: torchrun started {world} processes, the {what} needs {want}{extra}", file=sys.stderr)
            return 2
        rank = int(os.environ["RANK"])
        if rank == 0 and cfg.anchor.enabled and not join:
            addr = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
            print(f"[anchor] the fast circuit's store is {addr}; start the anchor row (one process per stage) "
                  f"with: torchrun --nproc-per-node {layout.stages} ... -m orchestration.train <this run's flags> "
                  f"--anchor.join --anchor.store {addr}", file=sys.stderr, flush=True)
        run_rank(layout.anchor_rank(rank) if join else rank, world, cfg, plan)
        return 0
    os.makedirs(plan.run_dir, exist_ok=True)
    if not join:
        cfg.run.name = os.path.basename(plan.run_dir)  # so that --config RUN_DIR/config.yaml names this run
        with open(os.path.join(plan.run_dir, "config.yaml"), "w") as f:
            f.write(to_yaml(cfg))
    if join:  # fail fast, not after the store client's minutes of retries, if nothing listens there
        from orchestration.anchor import store_address

        host, port = store_address(cfg)
        try:
            socket.create_connection((host, port), timeout=10).close()
        except OSError as e:
            print(f"error: --anchor.store {host}:{port}: cannot connect ({e.strerror or e}); is the fast circuit "
                  "running? (its launcher prints the address)", file=sys.stderr)
            return 2
    try:
        if join:
            res = run_local(run_anchor_row_rank, layout.stages, (cfg, plan), start_method=cfg.mesh.start_method,
                            threads=cfg.mesh.threads_per_rank, optional=set(range(layout.stages)),
                            describe=lambda r: layout.describe(layout.anchor_rank(r)),
                            restarts=cfg.anchor.restarts)
            for r in res:
                if r is not None:
                    print(f"[anchor] {layout.describe(r['rank'])}, generation {r['generation']}: {r['rounds']} rounds, "
                          f"stopped: {r['stopped']}", file=sys.stderr, flush=True)
            return 0 if all(r is not None for r in res) else 1
        port = free_port()
        anchors = {r for r in range(cfg.world_size) if layout.is_anchor(r)}
        if anchors:
            print(f"[anchor] the fast circuit's store is 127.0.0.1:{port}; a new anchor row joins it with: "
                  f"python -m orchestration.train --config {os.path.join(plan.run_dir, 'config.yaml')} "
                  f"--anchor.join --anchor.store 127.0.0.1:{port}", file=sys.stderr, flush=True)
        res = run_local(run_rank, cfg.world_size, (cfg, plan), start_method=cfg.mesh.start_method,
                        threads=cfg.mesh.threads_per_rank, describe=layout.describe, optional=anchors,
                        restarts=cfg.anchor.restarts if anchors else 0, port=port)
        if res and res[0] and res[0].get("interrupted"):
            return 130  # stopped by Ctrl-C / SIGTERM after saving: the shell's convention
    except MeshFailure as e:
        print(f"\nerror: the mesh stopped: {e}", file=sys.stderr)
        if e.details:
            print(e.details, file=sys.stderr)
        try:
            last = ckpt.resolve("latest", plan.ckpt_dir)
        except ValueError:
            last = None  # none, or `latest` names a checkpoint that is gone
        if last:
            print(f"last complete checkpoint: {last} (continue with: {continue_command(plan)})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
