"""``validate(cfg)``: the one place for every rule on the configuration itself (shapes of
the mesh, divisibility of the batch, names of codecs/compressors, ranges, the optimizer's
and the anchor's settings). It checks and never changes the config; every problem is a
ValueError that names the flag. ``orchestration.launch.prepare`` then checks the config
against the model and data it reads, before any rank starts.
"""
from __future__ import annotations

import math

from meshkern._checks import fraction
from orchestration.config.job_config import (ADAPTER_EXPORTS, ADAPTERS, ANCHOR_TRANSPORTS, COMPRESSORS, SNAPSHOT_CODECS,
                                             WANDB_MODES, AdapterConfig, Config, DPConfig)


def ineffective_settings(cfg: Config) -> list[str]:
    """Settings a valid config accepts that change nothing in this mesh, one line each
    (the trainer prints them as warnings)."""
    out = []
    codecs = {cfg.replica_codec(r) for r in range(cfg.fast_rows)}
    if cfg.boundary.compress == "selective" and not cfg.mesh.replicas and cfg.mesh.stages > 1:
        out.append("--boundary.compress selective: this mesh has no full replica, so every replica's boundaries "
                   "are compressed, as with all")
    if cfg.boundary.codec == "subspace" and "subspace" not in codecs:
        out.append("--boundary.codec subspace: no replica uses it (selective keeps full replicas dense and this "
                   "mesh has no pipeline replica)")
    if cfg.dp.projection != DPConfig().projection and (
            cfg.dp.mode != "diloco" or cfg.fast_rows < 2 or "subspace" not in codecs):
        out.append(f"--dp.projection {cfg.dp.projection}: it acts on the DiLoCo sync (--dp.mode diloco, 2+ replicas) of "
                   f"subspace-constrained replicas; this run has none, so it is ignored")
    a = cfg.adapter
    if a.kind == "none":
        changed = [f for f in ("rank", "alpha", "dropout", "targets", "export")
                   if getattr(a, f) != getattr(AdapterConfig(), f)]
        if changed:
            out.append(f"--adapter.{changed[0]}: it configures LoRA adapters, and this run trains the full model "
                       f"(add --adapter lora)")
    return out


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def validate(cfg: Config) -> Config:
    """Checks ranges and combinations; raises ValueError naming the flag. Touches no files
    and changes nothing (parsing, orchestration.config.manager.normalize, derives what the
    settings imply). Returns ``cfg``. A pair of features that cannot run together is refused
    by the composition matrix (orchestration.config.composition), the one list of them."""
    from orchestration.config.composition import refusal  # (here: -m orchestration.config.composition runs it)

    _need(refusal(cfg) is None, refusal(cfg) or "")
    _check_mesh(cfg)
    _check_model_and_data(cfg)
    _check_train(cfg)
    _check_boundary(cfg)
    _check_dp(cfg)
    _check_anchor(cfg)
    _check_adapter(cfg)
    _check_run(cfg)
    _check_elastic(cfg)
    return cfg


def _check_elastic(cfg: Config) -> None:
    m, dp = cfg.mesh, cfg.dp
    _need(not (m.join or m.local_replicas or m.replica_id >= 0) or m.elastic,
          "--mesh.join, --mesh.local-replicas and --mesh.replica-id belong to an elastic run: add --mesh.elastic")
    if not m.elastic:
        return
    _need(m.min_replicas >= 1, f"--mesh.min-replicas must be >= 1, got {m.min_replicas}")
    _need(m.replica_restarts >= 0, f"--mesh.replica-restarts must be >= 0, got {m.replica_restarts}")
    _need(m.heartbeat_s > 0 and m.quorum_timeout_s > 0, "--mesh.heartbeat-s and --mesh.quorum-timeout-s must be > 0")
    _need(m.rejoin_timeout_s >= 0, f"--mesh.rejoin-timeout-s must be >= 0, got {m.rejoin_timeout_s}")
    from orchestration.distributed.addresses import advertise_problem

    problem = advertise_problem(m.bind, m.join)
    _need(problem is None, problem or "")
    ids = [int(r) for r in m.local_replicas]
    _need(all(0 <= r < m.rows for r in ids) and len(set(ids)) == len(ids),
          f"--mesh.local-replicas {m.local_replicas}: distinct replica ids in 0..{m.rows - 1}")
    if m.join:
        _need(m.join.startswith("http://"), f"--mesh.join {m.join!r}: the lighthouse URL, http://HOST:PORT")
        _need(0 <= m.replica_id < m.rows, f"--mesh.join needs --mesh.replica-id in 0..{m.rows - 1} (the replica it "
                                          f"stands for: its data shard), got {m.replica_id}")
    if dp.mode == "diloco":
        # A quorum is taken only at a step with no fragment sync in flight (orchestration.elastic.replica).
        offs = sorted({((f + 1) * dp.sync_every // dp.fragments) % dp.sync_every for f in range(dp.fragments)})
        gap = min([(b - a) for a, b in zip(offs, offs[1:])] + [offs[0] + dp.sync_every - offs[-1]])
        _need(dp.overlap_steps < gap, f"--mesh.elastic: --dp.overlap-steps {dp.overlap_steps} keeps a fragment sync "
                                      f"in flight at every step (fragments start every {gap} steps), so no quorum "
                                      f"could ever form; use fewer --dp.fragments or a smaller overlap")


def _check_mesh(cfg: Config) -> None:
    m, a = cfg.mesh, cfg.anchor
    if m.replicas:
        _need(all(isinstance(y, int) and y >= 1 for y in m.replicas),
              f"--mesh.replicas entries are stage counts >= 1, got {m.replicas}")
        _need((m.rows, m.stages) == (cfg.replicas_rows, max(m.replicas)),
              f"--mesh.replicas {','.join(map(str, m.replicas))} makes {len(m.replicas)} replicas of up to "
              f"{max(m.replicas)} stages{' and the anchor row' if a.enabled else ''}, not --mesh.rows {m.rows} x "
              f"--mesh.stages {m.stages}")
    _need(m.rows >= 1, f"--mesh.rows must be >= 1, got {m.rows}")
    _need(m.stages >= 1, f"--mesh.stages must be >= 1, got {m.stages}")
    _need(not a.enabled or m.rows >= 2, "--anchor.enabled needs --mesh.rows >= 2 (the last row is the anchor)")
    if m.layers_per_stage:
        _need(len(m.layers_per_stage) == m.stages,
              f"--mesh.layers-per-stage has {len(m.layers_per_stage)} entries for {m.stages} stages")
        _need(all(n >= 1 for n in m.layers_per_stage), "--mesh.layers-per-stage entries must be >= 1")
    _need(m.dist_backend in ("auto", "gloo", "nccl"),
          f"--mesh.dist-backend must be auto, gloo or nccl, got {m.dist_backend!r}")
    _need(m.timeout_s > 0, f"--mesh.timeout-s must be > 0, got {m.timeout_s}")
    _need(m.start_method in ("auto", "fork", "spawn"),
          f"--mesh.start-method must be auto, fork or spawn, got {m.start_method!r}")
    _need(m.device in ("auto", "cpu", "cuda"), f"--mesh.device must be auto, cpu or cuda, got {m.device!r}")
    _need(m.threads_per_rank >= 1, "--mesh.threads-per-rank must be >= 1")


def _check_model_and_data(cfg: Config) -> None:
    _need(cfg.model.dtype in ("float32", "bfloat16"), f"--model.dtype must be float32 or bfloat16, got {cfg.model.dtype!r}")
    _need(cfg.model.tied_embeddings in ("sync", "untie"),
          f"--model.tied-embeddings must be sync or untie, got {cfg.model.tied_embeddings!r}")
    _need(cfg.data.seq_len >= 2, f"--data.seq-len must be >= 2, got {cfg.data.seq_len}")
    _need(0.0 <= cfg.data.eval_fraction < 1.0, "--data.eval-fraction must be in [0, 1)")
    _need(cfg.data.on_decode_error in ("auto", "raise", "skip"),
          f"--data.on-decode-error must be auto, raise or skip, got {cfg.data.on_decode_error!r}")


def _check_train(cfg: Config) -> None:
    t = cfg.train
    _need(t.steps >= 1, f"--train.steps must be >= 1, got {t.steps}")
    _need(t.batch_size >= 1 and t.microbatches >= 1, "--train.batch-size and --train.microbatches must be >= 1")
    _need(t.batch_size % t.microbatches == 0,
          f"--train.batch-size {t.batch_size} does not split into --train.microbatches {t.microbatches} "
          f"equal micro-batches")
    _need(t.schedule in ("1f1b", "gpipe"), f"--train.schedule must be 1f1b or gpipe, got {t.schedule!r}")
    _need(t.optimizer in ("adamw", "spectral"), f"--train.optimizer must be adamw or spectral, got {t.optimizer!r}")
    _need(t.lr > 0 and 0 <= t.min_lr_ratio <= 1 and t.warmup_steps >= 0, "--train.lr/min_lr_ratio/warmup_steps out of range")
    _need(t.clip_grad_norm >= 0, "--train.clip-grad-norm must be >= 0")
    _need(t.max_bad_steps >= 0, f"--train.max-bad-steps must be >= 0, got {t.max_bad_steps}")
    _need(t.spike_factor == 0 or t.spike_factor > 1, f"--train.spike-factor must be 0 (off) or > 1, got {t.spike_factor}")
    # The optimizer's own arguments, checked here so that a bad value stops the run before
    # spawn with the flag's name (the constructors on every rank check them again).
    for flag, v in (("--train.beta1", t.beta1), ("--train.beta2", t.beta2), ("--train.beta-anc", t.beta_anc)):
        fraction(flag, v)
    _need(0.0 <= t.alpha <= 1.0, f"--train.alpha must be in [0, 1], got {t.alpha}")
    for flag, v in (("--train.tau", t.tau), ("--train.eps", t.eps), ("--train.weight-decay", t.weight_decay)):
        _need(math.isfinite(v) and v >= 0, f"{flag} must be a finite number >= 0, got {v}")
    _need(t.spectral_rank >= 1, f"--train.spectral-rank must be >= 1, got {t.spectral_rank}")


def _check_boundary(cfg: Config) -> None:
    m, b = cfg.mesh, cfg.boundary
    from orchestration.codecs import CODECS  # the one list of boundary codecs

    _need(b.codec in CODECS, f"--boundary.codec must be one of {', '.join(CODECS)}, got {b.codec!r}")
    _need(b.compress in ("all", "selective"), f"--boundary.compress must be all or selective, got {b.compress!r}")
    _need(isinstance(b.dense_tail, int) and 0 <= b.dense_tail <= cfg.train.steps,
          f"--boundary.dense-tail must be a step count in 0..--train.steps ({cfg.train.steps}), got {b.dense_tail!r}")
    if m.replicas and len(set(m.replicas)) > 1:
        full_compressed = [r for r in range(len(m.replicas)) if m.replicas[r] == 1 and cfg.replica_codec(r) not in ("dense", "subspace")]
        _need(not full_compressed, f"--mesh.replicas: replica {full_compressed[:1]} is a full replica (no stage boundary) "
                                   f"and --boundary.codec {b.codec} compresses boundaries only; use --boundary.compress "
                                   f"selective, or the subspace codec (a full replica keeps its constraint)")
    fraction("--boundary.p", b.p)  # the codecs' own rule (meshkern.kept_dims)


def _check_dp(cfg: Config) -> None:
    dp = cfg.dp
    _need(dp.mode in ("allreduce", "diloco", "none"), f"--dp.mode must be allreduce, diloco or none, got {dp.mode!r}")
    _need(dp.compressor in COMPRESSORS, f"--dp.compressor must be one of {', '.join(COMPRESSORS)}, got {dp.compressor!r}")
    _need(dp.sync_every >= 1 and dp.fragments >= 1, "--dp.sync-every and --dp.fragments must be >= 1")
    _need(dp.mode != "diloco" or 0 <= dp.overlap_steps < dp.sync_every,
          f"--dp.overlap-steps {dp.overlap_steps} must be in [0, --dp.sync-every {dp.sync_every})")
    _need(dp.mode != "diloco" or dp.fragments <= dp.sync_every,
          f"--dp.fragments {dp.fragments} must be <= --dp.sync-every {dp.sync_every} (one fragment starts per step)")
    try:
        from meshkern.diloco import parse_projection

        steps = parse_projection(dp.projection)
    except ValueError as e:
        _need(False, f"--dp.projection: {e}")
    subspace_used = "subspace" in {cfg.replica_codec(r) for r in range(cfg.fast_rows)}
    _need(not (subspace_used and dp.mode == "diloco" and "error" in steps and dp.compressor != "sparseloco"),
          f"--dp.projection {dp.projection}: the 'error' step projects SparseLoCo's error feedback; "
          f"--dp.compressor {dp.compressor} has none (use outer or reproject, or --dp.compressor sparseloco)")
    _need(dp.outer_momentum == -1 or 0 <= dp.outer_momentum < 1,
          f"--dp.outer-momentum must be -1 (auto) or in [0, 1), got {dp.outer_momentum}")


def _check_anchor(cfg: Config) -> None:
    a, t = cfg.anchor, cfg.train
    _need(a.transport in ANCHOR_TRANSPORTS,
          f"--anchor.transport must be {' or '.join(ANCHOR_TRANSPORTS)}, got {a.transport!r}")
    _need(a.snapshot_codec in SNAPSHOT_CODECS,
          f"--anchor.snapshot-codec must be {' or '.join(SNAPSHOT_CODECS)}, got {a.snapshot_codec!r}")
    reps = list(cfg.mesh.replicas)
    _need(not (a.enabled and reps and cfg.dp.mode == "none" and reps[0] != max(reps)),
          f"--anchor.enabled with --mesh.replicas {','.join(map(str, reps))} and --dp.mode none: the model a run "
          "exports is replica 0's, which the anchor row does not serve (it serves the replicas of the deepest split), "
          "and with no DP sync nothing of the anchor reaches it; use a DP sync, or list a replica of the deepest "
          "split first")
    if a.enabled:
        _need(t.optimizer == "spectral", "--anchor.enabled needs --train.optimizer spectral (SpectralAdamW consumes "
                                         f"the anchor updates), got {t.optimizer!r}")
        _need(a.snapshot_every >= 1 and a.microbatches >= 1,
              "--anchor.snapshot-every and --anchor.microbatches must be >= 1")
        _need(a.max_rate_bps == -1 or (math.isfinite(a.max_rate_bps) and a.max_rate_bps >= 0),
              f"--anchor.max-rate-bps must be -1 (auto), 0 (unpaced) or a finite rate in bit/s, got {a.max_rate_bps}")
        _need(a.max_staleness >= 0 and a.delay >= 0, "--anchor.max-staleness and --anchor.delay must be >= 0")
        _need(a.delay <= a.max_staleness, f"--anchor.delay {a.delay} exceeds --anchor.max-staleness "
                                          f"{a.max_staleness}: every update would be rejected")
    _need(a.state_every >= 0 and a.restarts >= 0, "--anchor.state-every and --anchor.restarts must be >= 0")
    _need(not a.join or a.enabled, "--anchor.join needs --anchor.enabled (the config of the running fast circuit)")
    _need(not a.join or bool(a.store), "--anchor.join needs --anchor.store host:port (printed by the fast circuit's launcher)")
    _need(a.join or cfg.mesh.elastic or not a.store,
          "--anchor.store is for --anchor.join and elastic replicas (a local run's anchor row uses its own launcher's "
          "store)")
    if a.enabled and cfg.mesh.elastic:
        _need(not cfg.mesh.join or bool(a.store),
              "--mesh.join with --anchor.enabled needs --anchor.store host:port (the anchor store the lighthouse "
              "hosts: its launcher prints it; by hand, python -m orchestration.elastic.lighthouse --anchor-store PORT)")
        _need(a.delay == 0, f"--anchor.delay {a.delay} with --mesh.elastic: the delay mode makes every fast rank wait "
                            "for the update of each snapshot, which a replica that drops out never lets arrive; "
                            "elastic replicas use the asynchronous anchor (--anchor.delay 0)")
    if a.store:
        host, _, port = a.store.rpartition(":")
        _need(bool(host) and port.isdigit() and 0 < int(port) < 65536, f"--anchor.store must be host:port, got {a.store!r}")


def _check_adapter(cfg: Config) -> None:
    """The adapter flags on their own; orchestration.launch.prepare checks --adapter.targets
    against the model's layers."""
    a = cfg.adapter
    _need(a.kind in ADAPTERS, f"--adapter must be one of {', '.join(ADAPTERS)}, got {a.kind!r}")
    _need(a.export in ADAPTER_EXPORTS, f"--adapter.export must be one of {', '.join(ADAPTER_EXPORTS)}, got {a.export!r}")
    if a.kind == "none":
        return
    _need(isinstance(a.rank, int) and a.rank >= 1, f"--adapter.rank must be an integer >= 1, got {a.rank!r}")
    _need(math.isfinite(a.alpha) and a.alpha > 0, f"--adapter.alpha must be a finite number > 0, got {a.alpha}")
    fraction("--adapter.dropout", a.dropout)
    targets = a.target_list()
    _need(bool(targets), "--adapter.targets is empty: name the linear layers to adapt, e.g. q_proj,v_proj")
    _need(len(set(targets)) == len(targets), f"--adapter.targets names a layer twice: {a.targets}")


def _check_run(cfg: Config) -> None:
    _need(cfg.checkpoint.every >= 0 and cfg.checkpoint.keep >= 1, "--checkpoint.every must be >= 0 and --checkpoint.keep >= 1")
    _need(cfg.run.eval_sequences >= 0, "--run.eval-sequences must be >= 0")
    _need(cfg.run.log_every >= 1, "--run.log-every must be >= 1")
    _need(cfg.run.progress_every_s > 0, f"--run.progress-every-s must be > 0, got {cfg.run.progress_every_s}")
    _need(cfg.run.bandwidth_bps > 0 and cfg.run.latency_s >= 0, "--run.bandwidth-bps must be > 0, --run.latency-s >= 0")
    _need(cfg.run.fail_rank < cfg.world_size, f"--run.fail-rank {cfg.run.fail_rank} is not a rank of a {cfg.world_size}-rank mesh")
    _need(cfg.run.wandb_mode in WANDB_MODES,
          f"--run.wandb-mode must be one of {', '.join(WANDB_MODES)}, got {cfg.run.wandb_mode!r}")


