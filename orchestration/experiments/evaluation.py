"""One finished trainer run of an experiment row, evaluated: the held-out curve over its
checkpoints, bytes per token, modeled tokens/s and the codec-on loss, as a result record."""
from __future__ import annotations

import os
import shlex

from orchestration.codecs import pp_ratios
from orchestration.components import checkpoint as ckpt
from orchestration.components.metrics import read_jsonl
from orchestration.experiments.rows import Row, Settings

_PLANS: dict = {}


def _plan_for(argv: list[str]):
    """The trainer's own (cfg, plan) for these flags: config parsing + held-out split, no
    model load. Cached by what determines the split (data, model, seq_len, split seed)."""
    from orchestration.launch.prepare import prepare
    from orchestration.config import parse_args

    cfg, _ = parse_args(argv)
    key = (cfg.data.source, cfg.model.path, cfg.data.seq_len, cfg.data.max_sequences,
           cfg.data.eval_fraction, cfg.data.split_seed, cfg.mesh.rows, cfg.train.batch_size)
    if key not in _PLANS:
        _PLANS[key] = prepare(cfg, load_model=False)
    return cfg, _PLANS[key]


_BASE_LOSS: dict = {}  # (base model path, held-out rows) -> eval_loss result, within one invocation


def codec_eval_loss(model, held, cfg, *, seed: int = 0, step: int = 0, run_dir: str | None = None) -> dict:
    """Held-out loss of ``model`` through the training-time pipeline: split into
    ``cfg.mesh.stages`` stages as the trainer splits it (``stages.split_model`` with
    ``--mesh.layers-per-stage``), the trainer's boundary codec (``codecs.codec_for`` of
    ``cfg.boundary``) round-tripped at every stage boundary by ``codecs.apply_codec``, the
    loss by ``scoring.eval_loss``; no training. Mask keys ``MaskKey(replica_mask_seed(seed, 0), i, step, 0)``
    between stages i and i+1: replica 0's seed rule, at a step the run never trained on
    (``step`` = the run's step count), as in ``diagnose.anchor_diagnostics``. With the dense
    codec this is the unsplit model's loss (the split is exact)."""
    from meshkern.mask import MaskKey
    from orchestration.codecs import apply_codec, codec_for
    from orchestration.components.builders import replica_mask_seed
    from orchestration.models.scoring import eval_loss
    from orchestration.distributed.stages import split_model

    stages = split_model(model, cfg.mesh.stages, cfg.mesh.layers_per_stage or None)
    codec = codec_for(cfg.boundary)
    if codec.needs_calibration:  # the basis the run trained with (RUN_DIR/pca_basis.pt)
        from orchestration.components import calibration
        codec.bases = calibration.load_split(run_dir, model.config.num_hidden_layers, cfg.mesh.stages,
                                             cfg.mesh.layers_per_stage)
    mask_seed = replica_mask_seed(seed, 0)
    chain: list = [stages[0]]
    for i, st in enumerate(stages[1:]):
        chain.append(lambda h, i=i: apply_codec(codec, h, MaskKey(mask_seed, i, int(step), 0)))
        chain.append(st)
    return eval_loss(chain, held)


def _epochs(cfg, plan, steps: int) -> float:
    """Passes over its data shard that fast replica 0 made in ``steps`` steps (a per-sample
    codec such as aqsgd compresses better from each sample's second visit on)."""
    from orchestration.data.sampling import shard_rows

    per_epoch = len(shard_rows(plan.train_rows, 0, cfg.fast_rows)) // cfg.train.batch_size
    return round(steps / per_epoch, 3) if per_epoch else float("nan")


def _train_state(cfg, plan) -> dict:
    """What replica 0 trains and holds per stage (orchestration.components.memory: exact
    parameter counts and AdamW state bytes, tests/test_memory.py)."""
    from transformers import AutoConfig

    from orchestration.components import memory

    rows = memory.for_config(cfg, AutoConfig.from_pretrained(plan.model_path, local_files_only=True))
    return {"adapter": cfg.adapter.kind, "trainable_params": sum(r.trainable for r in rows),
            "params": sum(r.params for r in rows), "optimizer_bytes": [r.optimizer for r in rows]}


def _mesh_label(cfg) -> str:
    """'3x2 (2 fast + anchor)', or 'replicas 1,2,2 + anchor' for a heterogeneous mesh."""
    anchor = " + anchor" if cfg.anchor.enabled else ""
    if cfg.mesh.replicas:
        return f"replicas {','.join(map(str, cfg.replica_stages))}{anchor}"
    return f"{cfg.mesh.rows}x{cfg.mesh.stages} ({cfg.fast_rows} fast{anchor})"


def evaluate_run(row: Row, seed: int, s: Settings, argv: list[str], run_dir: str) -> dict:
    """Evaluates a finished trainer run; returns the row's result record."""
    from orchestration import evaluate
    from orchestration.distributed.linkmodel import model_run
    from orchestration.models.loading import load_causal_lm

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
    final_model, final_path = None, None
    for step, path in [(0, plan.model_path)] + ckpt.complete_checkpoints(os.path.join(run_dir, "checkpoints")):
        base_key = (path, tuple(held.shape), hash(held.numpy().tobytes()))
        if step == 0 and base_key in _BASE_LOSS:  # the base model on the same held-out rows: scored once
            r = _BASE_LOSS[base_key]
        else:
            model, _ = load_causal_lm(path, boundary=False)  # the plain model: the records' deployed loss
            r = evaluate.eval_loss(model, held)
            if step == 0:
                _BASE_LOSS[base_key] = r
            if step == s.steps:
                final_model, final_path = model, path
        curve.append({"step": step, "tokens": step * tokens_per_step,
                      "modeled_s": step * model_step.step_s, "loss": r["loss"], "perplexity": r["perplexity"]})
    if final_model is None:
        raise RuntimeError(f"{run_dir}: no complete checkpoint at the last step {s.steps}")
    # The final model with its checkpoint's boundary transform (position 0's int8 round trip at the
    # boundary layers, a codec with a sink row: orchestration.models.boundary_transform), when it has one.
    from orchestration.models import boundary_transform

    final_boundary = None
    if boundary_transform.apply_from(final_model, final_path) is not None:
        final_boundary = evaluate.eval_loss(final_model, held)["loss"]
        boundary_transform.remove(final_model)
    # The deployed model is unmasked; the masked rows trained through their boundary codec.
    # Their final model scored WITH that codec at every stage boundary (no training) shows
    # how much of the deployed model's loss is train/test mismatch.
    codec_on = None
    if cfg.boundary.codec != "dense" or cfg.boundary.options:  # dense:dtype=bfloat16 rounds at the boundaries
        codec_on = codec_eval_loss(final_model, held, cfg, seed=seed, step=s.steps, run_dir=run_dir)["loss"]

    rec: dict = {
        "row": row.name, "group": row.group, "label": row.label, "seed": seed,
        "settings": s.key(), "trainer_argv": argv,
        "command": "python -m orchestration.train " + " ".join(shlex.quote(a) for a in argv),
        "mesh": _mesh_label(cfg),
        "hidden_size": plan.hidden_size,
        "eval_sequences": int(held.shape[0]), "eval_tokens": int(held.shape[0] * (held.shape[1] - 1)),
        "base_loss": curve[0]["loss"], "final_loss": curve[-1]["loss"],
        "final_perplexity": curve[-1]["perplexity"], "curve": curve,
        "boundary_codec": cfg.boundary.codec, "boundary_options": dict(cfg.boundary.options),
        "codec_on_loss": codec_on, "final_loss_boundary": final_boundary, "epochs": _epochs(cfg, plan, s.steps),
        "train_config": {"lr": cfg.train.lr, "min_lr_ratio": cfg.train.min_lr_ratio,
                         "warmup_steps": cfg.train.warmup_steps, "optimizer": cfg.train.optimizer,
                         "tau": cfg.train.tau, "alpha": cfg.train.alpha, "beta_anc": cfg.train.beta_anc,
                         "split_seed": cfg.data.split_seed},
        "train_loss": [h["loss"] for h in history],
        "bytes_per_token": history[-1]["bytes_per_token"],
        "bytes_per_token_total": sum(history[-1]["bytes_per_token"].values()),
        "pp_ratio": pp_ratios(history[-1]["bytes_per_token"]["pp_fwd"] + history[-1]["bytes_per_token"]["pp_bwd"],
                              plan.hidden_size, cfg.replica_stages),
        "modeled_step_s": model_step.step_s, "modeled_tokens_per_s": model_step.tokens_per_s,
        "modeled_limit": model_step.limiting,
        "network_bound_tokens_per_s": net_step.tokens_per_s, "network_limit": net_step.limiting,
        "measured_tokens_per_s": tokens_per_step * len(history) / sum(h["step_s"] for h in history),
        "anchor": {k: v for k, v in history[-1].items() if k.startswith("anchor_")},
        **_train_state(cfg, plan),
    }
    if row.group == "main" and s.prune:
        pr = evaluate.pruning_robustness(final_model, held, fractions=s.prune)
        rec["pruning"] = {str(f): {"loss": v["loss"], "loss_increase_pct": v["loss_increase_pct"]}
                          for f, v in pr.items()}
    if s.data.startswith("task:"):
        from orchestration.data import tasks

        spec = s.data[len("task:"):]
        names = sorted(tasks.TASKS) if spec == "all" else [t.strip() for t in spec.split(",") if t.strip()]
        rec["exact_match"] = {t: evaluate.exact_match(final_model, plan.model_path, t, n=s.n_task)["accuracy"]
                              for t in names}
    return rec
