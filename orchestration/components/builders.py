"""What a rank is built from its config: its stage of the model, its optimizer, its DP
compressor, its batches and mask seed, and the no-anchor hook. One rule each, used by fast
and anchor ranks alike (orchestration.trainer, orchestration.anchor.node)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from meshkern.optim import warmup_cosine_lr
from orchestration.config import Config
from orchestration.data.sampling import BatchSampler, shard_rows
from orchestration.distributed.link_counter import LinkCounter

# Replica ``row``'s batch order is seeded with --train.seed + REPLICA_SEED_STRIDE * row: a
# prime stride keeps the replicas' seeds distinct for any --train.seed.
REPLICA_SEED_STRIDE = 7919
# Replica ``row``'s boundary masks use Philox seed (--train.seed << MASK_ROW_BITS) | row:
# each replica draws its own masks, for up to 2**16 replicas.
MASK_ROW_BITS = 16


def replica_mask_seed(seed: int, row: int) -> int:
    """The boundary codecs' seed (MaskKey.seed) of fast replica ``row`` in a run seeded ``seed``."""
    return (int(seed) << MASK_ROW_BITS) | int(row)


def lr_at(step: int, cfg: Config) -> float:
    """Linear warmup to train.lr, then cosine decay to lr * min_lr_ratio at the last step
    (meshkern.optim.warmup_cosine_lr)."""
    t = cfg.train
    return warmup_cosine_lr(step, lr=t.lr, steps=t.steps, warmup_steps=t.warmup_steps, min_lr_ratio=t.min_lr_ratio)


def data_shard(cfg: Config, plan, row: int) -> torch.Tensor:
    """Training rows of fast replica ``row``: one disjoint strided shard per fast replica
    (orchestration.data.sampling.shard_rows). The anchor row takes no shard (it samples the whole
    training set with its own seed: orchestration.anchor.round_batch), so for a given seed
    the fast replicas see the same batches with and without the anchor row."""
    return shard_rows(plan.train_rows, row, cfg.fast_rows)


def replica_sampler(cfg: Config, plan, row: int) -> BatchSampler:
    """The batches fast replica ``row`` trains on: its shard, its own seed (a function of
    --train.seed and the row only, not of the anchor setting)."""
    return BatchSampler(data_shard(cfg, plan, row), cfg.train.batch_size, cfg.train.seed + REPLICA_SEED_STRIDE * row)


@dataclass
class RankContext:
    """What a rank's parts are built from: orchestration.anchor.run_anchor_rank's argument
    on an anchor rank, the anchor hook's (orchestration.anchor.FastHook) on a fast rank."""

    cfg: Config
    plan: object
    mesh: object
    stage: object
    params: list
    counter: LinkCounter = field(default_factory=LinkCounter)
    optimizer: object = None  # a fast rank's inner optimizer


def build_stage(cfg: Config, plan, mesh):
    """This rank's stage of the model (seeded, on the mesh's device, in train mode)."""
    from orchestration.models.loading import load_causal_lm
    from orchestration.distributed.stages import replica_split, split_model

    torch.manual_seed(cfg.train.seed)
    model = plan.model
    if model is None:
        model, _ = load_causal_lm(plan.model_path, dtype=getattr(torch, cfg.model.dtype), boundary=False)
    from orchestration.subspace import training as subspace_train

    plan.subspace = subspace_train.prepare_model(cfg, model) if subspace_train.uses_subspace(cfg) else None
    if cfg.adapter.kind == "lora":  # into the unsplit model: the same adapters whatever the split (adapters.lora)
        from orchestration.adapters import apply_lora

        torch.manual_seed(cfg.train.seed)
        apply_lora(model, cfg.adapter)
    y = mesh.layout.stages_of(mesh.row)  # a heterogeneous mesh's replicas differ in depth
    stages = split_model(model, y, replica_split(model.config.num_hidden_layers, y, cfg.mesh.layers_per_stage))
    stage = stages[mesh.stage]
    if y == 1 and max(cfg.replica_stages) > 1 and stage.lm_head.weight is stage.embed_tokens.weight:
        _untie(stage)  # a full replica beside pipelines holds two copies, as their stages do
    del stages, model
    plan.model = None
    stage.to(mesh.device).train()
    return stage


def _untie(stage) -> None:
    """Give a one-stage replica of a tied model its own copy of the LM head, like a
    pipeline's last stage (stages.split_model): in a heterogeneous mesh the embedding and
    the head then sync by name in their own groups, each copy with its pipeline
    counterparts, and the trainer sums the two copies' gradients every step."""
    import copy

    head = copy.deepcopy(stage.lm_head)
    w = stage.embed_tokens.weight
    head.weight = torch.nn.Parameter(w.detach().clone(), requires_grad=w.requires_grad)
    stage.lm_head, stage.tied_lm_head = head, True


class NullAnchor:
    """The anchor hook when the anchor is off: never anything to fold in.

    The contract ``orchestration.anchor.FastHook(ctx)`` implements on fast ranks
    (polled once per fast step, on the critical path, so it must never block on the
    anchor): ``poll(step)`` hands whatever arrived to the trainer's optimizer itself
    (``SpectralAdamW.observe_anchor_update``, both transports) before the inner step, and
    switches the prior off and on (``set_prior_enabled``); ``after_step(step)`` (e.g.
    serve a parameter snapshot); ``bytes_sent`` (this rank's anchor-axis bytes, both
    ways); ``stats()`` -> flat dict logged as ``anchor_<key>``; ``close()`` at the end of
    training (tell the anchor row to stop)."""

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
