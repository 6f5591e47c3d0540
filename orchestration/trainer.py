"""One rank of the mesh: ``Trainer`` runs a fast rank, ``build_stage`` gives every rank
(fast or anchor) its stage of the model.

A ``Trainer`` (torchtitan-like) owns everything a fast rank uses: the mesh, its stage and
parameters, the boundary codec and the pipeline executor, the inner optimizer, the DP
sync (a gradient all-reduce compressor or Streaming DiLoCo), the anchor hook, the
checkpointer (orchestration.checkpoint.Checkpointer: save and load) and the metrics
(orchestration.metrics). One step:

    pipeline step (schedule + codec boundaries, grad accumulation over micro-batches)
    -> tied-embedding grad sync -> DP gradient all-reduce (dp.mode=allreduce)
    -> global grad-norm clip -> anchor hook (folds in what the anchor sent) -> inner optimizer
    -> Streaming DiLoCo (dp.mode=diloco) -> metrics / progress / checkpoint

Anchor ranks run ``orchestration.anchor.run_anchor_rank(RankContext)`` instead.
"""
from __future__ import annotations

import math
import os
import signal
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from meshkern.optim import warmup_cosine_lr
from orchestration.checkpoint import Checkpointer, continue_command
from orchestration.codecs import make_codec
from orchestration.config import Config
from orchestration.dp_sync import ReplicaSync
from orchestration.run_summary import format_summary
from orchestration.metrics import LinkCounter, RunLog, reduce_step, summarize, \
    write_link_bytes
from orchestration.pipeline import PipelineExecutor
from orchestration.sampling import BatchSampler, shard_rows
from orchestration.schedule import make_schedule


def lr_at(step: int, cfg: Config) -> float:
    """Linear warmup to train.lr, then cosine decay to lr * min_lr_ratio at the last step
    (meshkern.optim.warmup_cosine_lr)."""
    t = cfg.train
    return warmup_cosine_lr(step, lr=t.lr, steps=t.steps, warmup_steps=t.warmup_steps, min_lr_ratio=t.min_lr_ratio)


def data_shard(cfg: Config, plan, row: int) -> torch.Tensor:
    """Training rows of fast replica ``row``: one disjoint strided shard per fast replica
    (orchestration.sampling.shard_rows). The anchor row takes no shard (it samples the whole
    training set with its own seed: orchestration.anchor.round_batch), so for a given seed
    the fast replicas see the same batches with and without the anchor row."""
    return shard_rows(plan.train_rows, row, cfg.fast_rows)


def replica_sampler(cfg: Config, plan, row: int) -> BatchSampler:
    """The batches fast replica ``row`` trains on: its shard, its own seed (a function of
    --train.seed and the row only, not of the anchor setting)."""
    return BatchSampler(data_shard(cfg, plan, row), cfg.train.batch_size, cfg.train.seed + 7919 * row)


@dataclass
class RankContext:
    """What an anchor rank holds (orchestration.anchor.run_anchor_rank's argument)."""

    cfg: Config
    plan: object
    mesh: object
    stage: object
    params: list
    counter: LinkCounter = field(default_factory=LinkCounter)


def build_stage(cfg: Config, plan, mesh):
    """This rank's stage of the model (seeded, on the mesh's device, in train mode)."""
    from orchestration.models import load_causal_lm
    from orchestration.stages import replica_split, split_model

    torch.manual_seed(cfg.train.seed)
    model = plan.model
    if model is None:
        model, _ = load_causal_lm(plan.model_path, dtype=getattr(torch, cfg.model.dtype))
    from orchestration import subspace_train

    plan.subspace = subspace_train.prepare_model(cfg, model) if subspace_train.uses_subspace(cfg) else None
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

    The contract ``orchestration.anchor.FastHook(trainer)`` implements on fast ranks
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


class DivergenceError(RuntimeError):
    """The run diverged: ``--train.max-bad-steps`` consecutive bad steps (DivergenceGuard)."""


class DivergenceGuard:
    """Decides, from the step records (identical on every fast rank: they are all-reduced),
    whether a step is bad and whether the run has diverged.

    A step is bad when its loss is non-finite, when any replica skipped its update (a
    non-finite gradient: the record's cumulative ``skipped_steps`` grew), when its gradient
    norm (the mean over replicas) is exactly zero, or when its loss
    exceeds ``spike_factor`` times the median loss of the last ``WINDOW`` good steps (0:
    no spike rule). ``max_bad`` consecutive bad steps trip it (0: never). Bad steps never
    enter the median. Saved in every rank's checkpoint (part "guard"), with the trainer's
    count of skipped updates, so a resumed run judges steps exactly as an uninterrupted one.
    """

    WINDOW = 50

    def __init__(self, max_bad: int, spike_factor: float, trainer=None):
        self.max_bad, self.spike_factor, self.trainer = max_bad, spike_factor, trainer
        self.good: deque = deque(maxlen=self.WINDOW)
        self.streak = 0
        self.first_bad = 0  # record step (1-based) of the streak's first bad step
        self.bad_total = 0
        self.skipped_seen = 0
        self.reason = ""

    def observe(self, rec: dict) -> str:
        """Judges one step record; returns why it is bad ("" if good)."""
        loss, skipped = rec["loss"], int(rec["skipped_steps"])
        new_skips, self.skipped_seen = skipped - self.skipped_seen, skipped
        reason = ""
        if not math.isfinite(loss):
            reason = f"non-finite loss {loss}"
        elif new_skips > 0:
            reason = f"non-finite gradient in {new_skips} replica(s), update skipped"
        elif rec.get("grad_norm") == 0.0:
            # A finite loss whose gradient is exactly zero in every replica: the model no
            # longer learns. Seen after a blow-up (--train.lr 1e3): the hidden state's square
            # overflows in RMSNorm, the norm outputs zeros, the logits are uniform (loss
            # ln(vocab), below the spike bound) and every gradient is 0.
            reason = "zero gradient norm with a finite loss (saturated activations: nothing learns)"
        elif self.spike_factor and self.good:
            med = statistics.median(self.good)
            if loss > self.spike_factor * med:
                reason = f"loss {loss:.4g} above {self.spike_factor:g} x the running median {med:.4g}"
        if reason:
            self.streak += 1
            self.bad_total += 1
            if self.streak == 1:
                self.first_bad = int(rec["step"])
            self.reason = reason
        else:
            self.streak = 0
            self.good.append(float(loss))
        return reason

    @property
    def tripped(self) -> bool:
        return self.max_bad > 0 and self.streak >= self.max_bad

    def state_dict(self) -> dict:
        return {"good": list(self.good), "streak": self.streak, "first_bad": self.first_bad,
                "bad_total": self.bad_total, "skipped_seen": self.skipped_seen,
                "skipped": 0 if self.trainer is None else self.trainer.skipped}

    def load_state_dict(self, sd: dict) -> None:
        self.good = deque((float(x) for x in sd["good"]), maxlen=self.WINDOW)
        self.streak, self.first_bad = int(sd["streak"]), int(sd["first_bad"])
        self.bad_total, self.skipped_seen = int(sd["bad_total"]), int(sd["skipped_seen"])
        if self.trainer is not None:
            self.trainer.skipped = int(sd["skipped"])


class Trainer:
    """A fast rank: built from (rank, cfg, plan, mesh, stage); ``run()`` trains to the end
    (or to a stop request) and returns the rank's record (rank 0: with the summary)."""

    def __init__(self, rank: int, cfg: Config, plan, mesh, stage):
        self.rank, self.cfg, self.plan, self.mesh, self.stage = rank, cfg, plan, mesh, stage
        self.params = [p for p in stage.parameters() if p.requires_grad]
        self.counter = LinkCounter()
        self.optimizer = make_optimizer(cfg, stage)
        t = cfg.train
        name = cfg.replica_codec(mesh.row)  # --boundary.codec, or dense for a full replica left uncompressed
        self.codec = make_codec(name, p=cfg.boundary.p, rescale=cfg.boundary.rescale,
                                **(cfg.boundary.options if name == cfg.boundary.codec else {}))
        from orchestration.calibration import attach  # pca codec: the run's basis, bytes counted once
        attach(self)
        actions = make_schedule(t.schedule, mesh.layout.stages_of(mesh.row), t.microbatches)[mesh.stage]
        mask_seed = (t.seed << 16) | mesh.row  # each replica draws its own masks: the row is in the Philox seed
        self.executor = PipelineExecutor(stage, actions, codec=self.codec, prev_rank=mesh.prev_rank,
                                         next_rank=mesh.next_rank, rank=rank, seed=mask_seed, counter=self.counter)
        self.sampler = replica_sampler(cfg, plan, mesh.row)
        self.subspace = None
        if getattr(plan, "subspace", None) is not None:  # before the DP sync snapshots the weights
            from orchestration.subspace_train import SubspaceRun

            self.subspace = SubspaceRun(self, plan.subspace)
        self.sync = ReplicaSync(cfg, mesh, stage, lambda: make_compressor(cfg),
                                projector=self.subspace.projector if self.subspace else None)
        tied = stage.tied_lm_head or stage.tied_embed  # split_model / _untie decided, from the weights themselves
        untie = cfg.model.tied_embeddings == "untie"
        self.tied_param = (stage.lm_head.weight if stage.is_last else stage.embed_tokens.weight) if tied and not untie else None
        if self.tied_param is not None and not self.tied_param.requires_grad:
            self.tied_param = None  # frozen (subspace codec): nothing to sum
        self.hook = NullAnchor()
        if cfg.anchor.enabled:
            from orchestration.anchor import FastHook

            self.hook = FastHook(self)
        self.stop_requested = False
        self.skipped = 0  # this rank's replica-steps whose update was skipped (non-finite gradient)
        self.guard = DivergenceGuard(t.max_bad_steps, t.spike_factor, trainer=self)
        self.checkpointer = Checkpointer(cfg, plan, mesh, stage, {
            "stage": stage, "optimizer": self.optimizer, **self.sync.parts(),
            "counter": self.counter, "guard": self.guard,
            "anchor": self.hook if cfg.anchor.enabled else None})  # delay mode: what makes a resume exact

    # ------------------------------------------------------------------ one step
    def step(self, step: int):
        """One training step; returns the executor's stats and the replica's grad norm."""
        opt, mesh, params = self.optimizer, self.mesh, self.params
        for g in opt.param_groups:
            g["lr"] = lr_at(step, self.cfg)
        stats = self.executor.step(step, self.sampler(step), num_microbatches=self.cfg.train.microbatches,
                                   sample_ids=self.sampler.indices(step))
        if self.tied_param is not None and self.stage.is_first and self.stage.is_last:  # a full replica (_untie)
            g = self.stage.embed_tokens.weight.grad + self.stage.lm_head.weight.grad
            self.stage.embed_tokens.weight.grad, self.stage.lm_head.weight.grad = g, g.clone()
        elif self.tied_param is not None:
            grad = self.tied_param.grad
            dist.all_reduce(grad, group=mesh.groups[f"ends{mesh.row}"])
            # An all-reduce of two ranks sends the tensor's size from each (reduce-scatter
            # and all-gather of halves): not small, and no boundary codec compresses it.
            lay = mesh.layout
            ends = (lay.rank_of(mesh.row, 0), lay.rank_of(mesh.row, lay.stages_of(mesh.row) - 1))
            self.counter.add("tied", mesh.rank, ends[1] if mesh.rank == ends[0] else ends[0],
                             grad.numel() * grad.element_size())
        if self.sync.allreduce is not None:
            self.sync.all_reduce_grads()
            self.counter.set_total("dp", self.sync.bytes_sent)
        # The last stage's copy of a tied weight holds the same summed gradient as the first
        # stage's: the unsplit model counts that weight once in its norm, so do we.
        twin = self.tied_param if self.tied_param is not None and self.stage.tied_lm_head else None
        if self.subspace is not None:
            self.subspace.project_grads()  # every split (and the unsplit model) gives AdamW the same gradient
        gnorm = _clip(params, self.cfg.train.clip_grad_norm, mesh.pp, skip_in_norm=twin)
        self.hook.poll(step)  # folds in what the anchor sent (anchor on)
        if math.isfinite(gnorm):
            opt.step()
            if self.subspace is not None:
                self.subspace.after_update()  # AdamW's step leaves the subspace: back into it
        else:
            # Non-finite gradient anywhere in this replica (the norm is all-reduced over its
            # stages, so every stage agrees): skip the update rather than corrupt the weights.
            self.skipped += 1
        opt.zero_grad(set_to_none=True)
        if self.sync.diloco:
            self.sync.step()
            if self.subspace is not None:
                self.subspace.after_update()  # whatever --dp.projection did, the codec needs the constraint
            # Read while a fragment's sync may still run in the background: its bytes count
            # when its collectives have run (exact totals after finish()).
            self.counter.set_total("dp", self.sync.bytes_sent)
        self.counter.set_total("anchor", self.hook.bytes_sent)
        self.hook.after_step(step)
        return stats, gnorm

    def save(self, step: int, final: bool = False) -> str | None:
        """Checkpoint at ``step`` (None if the weights are not finite: nothing is written).
        Only the end of training waits for and merges DiLoCo syncs in flight; a checkpoint
        during training saves them as they are (StreamingDiLoCo.state_dict), so saving
        never changes the run's trajectory and a resume continues it exactly."""
        if self.sync.diloco and final:
            self.sync.finish()
            self.counter.set_total("dp", self.sync.bytes_sent)
            if self.subspace is not None:
                self.subspace.after_update()  # the merges finish() made, whatever --dp.projection did  # in-flight syncs are now counted too
        return self.checkpointer.save(step)

    def _diverged(self, step: int, last_ckpt: str) -> str:
        """The DivergenceError message; rank 0 points ``latest`` at the newest checkpoint
        that predates the bad stretch (weights after step first_bad - 2 produced the loss of
        step first_bad - 1, the last good one)."""
        from orchestration import checkpoint as ckpt

        g, cfg = self.guard, self.cfg
        good = ckpt.newest_valid(self.plan.ckpt_dir, max_step=g.first_bad - 2) if self.rank == 0 else None
        if good and self.rank == 0:
            ckpt.set_latest(self.plan.ckpt_dir, good)
        where = (f"the last good checkpoint is {good} (now `latest`)" if good else
                 "no checkpoint predates the bad stretch")
        return (f"DivergenceError: the run diverged: {g.streak} consecutive bad steps "
                f"({g.first_bad}..{step + 1}, --train.max-bad-steps {cfg.train.max_bad_steps}); last: {g.reason}; "
                f"{self.skipped_total()} replica-steps skipped in all; nothing saved since step {g.first_bad}; {where}. "
                f"Lower --train.lr (now {cfg.train.lr:g}) or raise --train.clip-grad-norm / --train.warmup-steps")

    def skipped_total(self) -> int:
        return self.guard.skipped_seen

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict:
        cfg, plan, rank = self.cfg, self.plan, self.rank
        start = 0
        if plan.resume_from:
            start = self.checkpointer.load(plan.resume_from)
            if rank == 0:
                print(f"resumed from {plan.resume_from} at step {start}", file=sys.stderr, flush=True)

        def on_stop(signum, frame):  # stop at the next step boundary, checkpoint, exit
            self.stop_requested = True

        signal.signal(signal.SIGINT, on_stop)
        signal.signal(signal.SIGTERM, on_stop)  # a scheduler's / container's stop: same clean stop
        log = RunLog(cfg, plan, start, active=rank == 0)
        history: list[dict] = []
        last_ckpt = plan.resume_from
        t_start = t_last = time.perf_counter()
        steps_done, step, interrupted, diverged = 0, start, False, ""
        for step in range(start, cfg.train.steps):
            if rank == cfg.run.fail_rank and step == cfg.run.fail_step:
                os.kill(os.getpid(), signal.SIGKILL)  # fault injection (tests): die like a crashed node
            stats, gnorm = self.step(step)
            now = time.perf_counter()
            rec, stopping = reduce_step(cfg, self.mesh, step, stats, gnorm, self.skipped, self.counter,
                                        self.stop_requested, now - t_last, lr_at(step, cfg))
            rec.update({f"anchor_{k}": v for k, v in self.hook.stats().items()})
            if hasattr(self.optimizer, "anchor_stats") and cfg.anchor.enabled:
                rec["anchor_optim"] = {k: v for k, v in self.optimizer.anchor_stats().items()
                                       if isinstance(v, (int, float, type(None)))}
            steps_done += 1
            t_last = now
            history.append(rec)
            log.record(rec, step)
            bad = self.guard.observe(rec)
            if bad and rank == 0:
                print(f"\nwarning: step {step + 1} is bad ({bad}); {self.guard.streak} in a row"
                      + (f" of --train.max-bad-steps {cfg.train.max_bad_steps}" if cfg.train.max_bad_steps else ""),
                      file=sys.stderr, flush=True)
            if self.guard.tripped:
                diverged = self._diverged(step, last_ckpt)
                break
            due = cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0
            if due or stopping or step + 1 == cfg.train.steps:
                if self.guard.streak:  # never publish weights of a bad stretch: the last good checkpoint stays latest
                    if rank == 0:
                        print(f"warning: no checkpoint at step {step + 1}: the run is in a bad stretch "
                              f"(since step {self.guard.first_bad})", file=sys.stderr, flush=True)
                else:
                    last_ckpt = self.save(step + 1, final=step + 1 == cfg.train.steps) or last_ckpt
            if stopping:
                interrupted = True
                break
        log.close_bar()
        self.hook.close()
        elapsed = time.perf_counter() - t_start
        links_path = write_link_bytes(plan, self.mesh, self.counter)
        out = {"rank": rank, "losses": [h["loss"] for h in history], "bytes": self.counter.totals(),
               "by_link": self.counter.by_link(), "interrupted": interrupted, "checkpoint": last_ckpt,
               "diverged": diverged}
        if rank == 0:
            log.close()
            out["summary"] = self._summary(history, elapsed, steps_done, last_ckpt, links_path, diverged)
            if interrupted:
                print(f"interrupted: checkpoint saved at step {step + 1} in {last_ckpt}; continue with: "
                      f"{continue_command(plan)}", flush=True)
            print(format_summary(out["summary"]), flush=True)
        return out

    def _summary(self, history, elapsed, steps_done, last_ckpt, links_path, diverged: str = "") -> dict:
        from orchestration.linkmodel import model_run

        cfg, plan = self.cfg, self.plan
        s = summarize(cfg, plan, history, elapsed, steps_done, last_ckpt, model_run(cfg, plan, history))
        s["skipped_steps"] = self.guard.skipped_seen
        s["bad_steps"] = self.guard.bad_total
        s["diverged"] = diverged
        if diverged:
            s["eval_loss"] = s["eval_loss_base"] = None
            s["links_path"] = links_path
            return s
        scored = plan.eval_rows is not None and cfg.run.eval_sequences > 0
        dtype = getattr(torch, cfg.model.dtype)
        rows = plan.eval_rows[:cfg.run.eval_sequences] if scored else None
        s["eval_loss"] = checkpoint_loss(last_ckpt, rows, dtype=dtype) if scored and last_ckpt else None
        s["eval_loss_base"] = checkpoint_loss(plan.model_path, rows, dtype=dtype) if scored else None
        s["links_path"] = links_path
        return s


def checkpoint_loss(path: str, rows: torch.Tensor, *, dtype: torch.dtype = torch.float32) -> float:
    """Mean next-token loss of the checkpoint at ``path`` (loaded in ``dtype``) on ``rows``
    (int64 [N, T]): the run's held-out score of its exported checkpoint (and of the base)."""
    from orchestration.models import load_causal_lm
    from orchestration.scoring import eval_loss

    model, _ = load_causal_lm(path, dtype=dtype)
    return eval_loss(model, rows)["loss"]


def _clip(params, max_norm: float, pp_group, skip_in_norm=None) -> float:
    """Global L2 norm of the replica's gradient (all stages) and clipping to ``max_norm``;
    ``skip_in_norm`` (a tied weight's second copy) is clipped but not counted."""
    sq = torch.zeros(1, dtype=torch.float64, device=params[0].device)
    for p in params:
        if p.grad is not None and p is not skip_in_norm:
            sq += p.grad.detach().double().pow(2).sum()
    dist.all_reduce(sq, group=pp_group)
    norm = math.sqrt(sq.item())
    if max_norm > 0 and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm
