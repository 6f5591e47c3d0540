"""One fast rank of the mesh: ``Trainer`` runs it; every rank's stage, optimizer and
batches come from orchestration.components.builders.

A ``Trainer`` (torchtitan-like) owns everything a fast rank uses: the mesh, its stage and
parameters, the boundary codec and the pipeline executor, the inner optimizer, the DP
sync (a gradient all-reduce compressor or Streaming DiLoCo), the anchor hook, the
checkpointer (orchestration.components.checkpoint.Checkpointer: save and load) and the metrics
(orchestration.components.metrics). Its step gate (orchestration.components.gate) decides
around each step whether it runs, commits or runs again, and who checkpoints: the same
calls for the fixed mesh and an elastic replica, so the loop has no mode of its own.
One step:

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
import sys
import time

import torch
import torch.distributed as dist

from orchestration.codecs import codec_for
from orchestration.components.builders import (NullAnchor, RankContext, lr_at, make_compressor, make_optimizer,
                                               replica_mask_seed, replica_sampler)
from orchestration.components.checkpoint import Checkpointer, continue_command
from orchestration.components.checkpoint_read import step_dir
from orchestration.components.divergence import DivergenceGuard, divergence_report
from orchestration.components.gate import FailPoint, StepGate
from orchestration.components.metrics import RunLog, reduce_step, summarize, write_link_bytes
from orchestration.components.run_summary import format_summary
from orchestration.config import Config
from orchestration.distributed.dp_sync import ReplicaSync
from orchestration.distributed.link_counter import LinkCounter
from orchestration.distributed.pipeline import PipelineExecutor
from orchestration.distributed.schedule import make_schedule
from orchestration.distributed.tensor_broadcast import recv_json, send_json
from orchestration.distributed.tied import TiedGradSync
from orchestration.models.scoring import checkpoint_loss, checkpoint_losses


class Trainer:
    """A fast rank: built from (rank, cfg, plan, mesh, stage); ``run()`` trains to the end
    (or to a stop request) and returns the rank's record (rank 0: with the summary)."""

    def __init__(self, rank: int, cfg: Config, plan, mesh, stage, gate: StepGate | None = None):
        self.rank, self.cfg, self.plan, self.mesh, self.stage = rank, cfg, plan, mesh, stage
        self.gate = gate or StepGate()  # elastic replicas: orchestration.elastic.gate.ElasticGate
        self.params = [p for p in stage.parameters() if p.requires_grad]
        self.counter = LinkCounter()
        self.optimizer = make_optimizer(cfg, stage)
        t = cfg.train
        self.codec = codec_for(cfg.boundary, cfg.replica_codec(mesh.row))  # dense for a full replica left uncompressed
        if self.codec.needs_calibration:  # its bases are fitted before training, their bytes counted once
            from orchestration.components.calibration import attach

            attach(self.codec, cfg, plan, mesh, self.counter)
        actions = make_schedule(t.schedule, mesh.layout.stages_of(mesh.row), t.microbatches)[mesh.stage]
        self.executor = PipelineExecutor(stage, actions, codec=self.codec, prev_rank=mesh.prev_rank,
                                         next_rank=mesh.next_rank, rank=rank, seed=replica_mask_seed(t.seed, mesh.row),
                                         counter=self.counter)
        self.sampler = replica_sampler(cfg, plan, mesh.row)
        self.subspace = None
        if getattr(plan, "subspace", None) is not None:  # before the DP sync snapshots the weights
            from orchestration.subspace.training import SubspaceRun

            self.subspace = SubspaceRun(cfg, mesh, stage, self.codec, plan.subspace)
        self.sync = ReplicaSync(cfg, mesh, stage, lambda: make_compressor(cfg),
                                projector=self.subspace.projector if self.subspace else None)
        self.tied = TiedGradSync(stage, mesh, self.counter, untie=cfg.model.tied_embeddings == "untie")
        self.hook = NullAnchor()
        served = mesh.layout.anchor_rows()
        # the rank whose anchor counters the step records show: the lowest served replica's stage 0
        # (elastic: every replica records its own steps, served or not)
        self.anchor_reporter = mesh.layout.rank_of(served[0], 0) if served and not mesh.elastic else 0
        if mesh.row in served:  # a replica of another split than the anchor's: none
            from orchestration.anchor import FastHook

            self.hook = FastHook(RankContext(cfg, plan, mesh, stage, self.params, self.counter, self.optimizer))
        self.stop_requested = False
        self.guard = DivergenceGuard(t.max_bad_steps, t.spike_factor)  # with this rank's count of skipped updates
        self.faults = FailPoint(cfg, rank, self.gate.incarnation)
        lora = cfg.adapter.kind == "lora"
        if lora:
            from orchestration.adapters import AdapterState
        self.checkpointer = Checkpointer(cfg, plan, mesh, stage, {
            # LoRA: adapter-only checkpoints, each one a PEFT folder
            "stage": AdapterState(stage, cfg.adapter, os.path.abspath(plan.model_path)) if lora else stage,
            "optimizer": self.optimizer, **self.sync.parts(),
            "counter": self.counter, "guard": self.guard,
            "anchor": None if isinstance(self.hook, NullAnchor) else self.hook})  # delay mode: what makes a resume exact
        self.gate.attach(params=self.params, optimizer=self.optimizer, sync=self.sync, save=self.save,
                         facts=self._anchor_facts if cfg.anchor.enabled else None, subspace=self.subspace,
                         stop=lambda: self.stop_requested)

    def _anchor_facts(self) -> dict:
        """The anchor's part of an elastic replica's step record: the generation linked and
        the updates applied so far (by this incarnation); on a heterogeneous mesh a replica of
        another split than the anchor's says it is not served."""
        s = self.hook.stats()
        if not s:  # NullAnchor
            return {"anchor_served": False}
        return {"anchor_generation": s["generation"], "anchor_applied": s["applied"], "anchor_joins": s["joins"],
                "anchor_snapshots_sent": s["snapshots_sent"]}

    # ------------------------------------------------------------------ one step
    def step(self, step: int):
        """One training step; returns the executor's stats and the replica's grad norm."""
        opt, mesh, params = self.optimizer, self.mesh, self.params
        for g in opt.param_groups:
            g["lr"] = lr_at(step, self.cfg)
        tail = self.cfg.boundary.dense_tail
        if tail and step >= self.cfg.train.steps - tail and self.executor.codec.name != "dense":
            self._start_dense_tail(step)  # the codec-free tail (on a resume inside it too)
        stats = self.executor.step(step, self.sampler(step), num_microbatches=self.cfg.train.microbatches,
                                   sample_ids=self.sampler.indices(step))
        self.tied.sync()
        if self.sync.allreduce is not None:
            self.gate.sync(self.sync.all_reduce_grads, self.sync)
            self.counter.set_total("dp", self.sync.bytes_sent)
            if not self.gate.commit_grads(self.sync):  # the update is dropped (the gate runs the step again)
                opt.zero_grad(set_to_none=True)
                return stats, float("nan")
        if self.subspace is not None:
            self.subspace.project_grads()  # every split (and the unsplit model) gives AdamW the same gradient
        # The last stage's copy of a tied weight holds the same summed gradient as the first
        # stage's: the unsplit model counts that weight once in its norm, so do we.
        gnorm = _clip(params, self.cfg.train.clip_grad_norm, mesh.pp, skip_in_norm=self.tied.twin)
        self.hook.poll(step)  # folds in what the anchor sent (anchor on)
        if math.isfinite(gnorm):
            opt.step()
            if self.subspace is not None:
                self.subspace.after_update()  # AdamW's step leaves the subspace: back into it
        else:
            # Non-finite gradient anywhere in this replica (the norm is all-reduced over its
            # stages, so every stage agrees): skip the update rather than corrupt the weights.
            self.guard.skipped += 1
        opt.zero_grad(set_to_none=True)
        if self.sync.diloco:
            self.gate.sync(self.sync.step, self.sync)
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

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict:
        cfg, plan, rank = self.cfg, self.plan, self.rank
        start = 0
        if plan.resume_from:
            start = self.checkpointer.load(plan.resume_from)
            self.gate.resumed(start, self.checkpointer.loaded_state)
            if rank == 0:
                print(f"resumed from {plan.resume_from} at step {start}", file=sys.stderr, flush=True)

        def on_stop(signum, frame):  # stop at the next step boundary, checkpoint, exit
            self.stop_requested = True

        signal.signal(signal.SIGINT, on_stop)
        signal.signal(signal.SIGTERM, on_stop)  # a scheduler's / container's stop: same clean stop
        begun = self.gate.start(start)  # (elastic: the first quorum; a replica that joins late heals here)
        start = start if begun is None else begun
        log = RunLog(cfg, plan, start, active=rank == 0)
        history: list[dict] = []
        last_ckpt = plan.resume_from
        t_start = t_last = time.perf_counter()
        steps_done, step, interrupted, diverged = 0, start, begun is None, ""
        while not interrupted and step < cfg.train.steps:
            self.faults.check(step)
            nxt = self.gate.before_step(step, self.sync)  # (elastic: a heal may move it on)
            if nxt is None:  # stopped while the gate waited (elastic: for a quorum): save where it stands
                if steps_done and self.gate.leader and last_ckpt != step_dir(plan.ckpt_dir, step):
                    last_ckpt = self._checkpoint(step - 1) or last_ckpt
                interrupted = True
                break
            step = nxt
            if step >= cfg.train.steps:
                break
            stats, gnorm = self.step(step)
            if not self.gate.end_step(step, self.sync):  # its update did not count: the same step again
                continue
            now = time.perf_counter()
            rec, stopping = self._record(step, stats, gnorm, now - t_last)
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
                diverged = divergence_report(self.guard, cfg, self.plan, rank, step)
                break
            due = cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0
            if stopping or step + 1 == cfg.train.steps:
                self.gate.settle(self.sync)
            if (due or stopping or step + 1 == cfg.train.steps) and self.gate.leader:
                last_ckpt = self._checkpoint(step) or last_ckpt
            step += 1
            if stopping:
                interrupted = True
                break
        log.close_bar()
        self.checkpointer.close()  # a model still on its way to the leader lands before anything reads it
        self.hook.close()
        self.counter.set_total("anchor", self.hook.bytes_sent)  # the last snapshot, finished at close, in link_bytes too
        stage_state = self._stage_state()
        elapsed = time.perf_counter() - t_start
        links_path = write_link_bytes(plan, self.mesh, self.counter)
        out = {"rank": rank, "losses": [h["loss"] for h in history], "bytes": self.counter.totals(),
               "by_link": self.counter.by_link(), "interrupted": interrupted, "checkpoint": last_ckpt,
               "diverged": diverged}
        out.update(self.gate.summary(steps_done))
        if rank == 0:
            log.close()
        if rank == 0 and history:  # (an elastic replica that healed to the last step has none of its own)
            out["summary"] = self._summary(history, elapsed, steps_done, last_ckpt, links_path, diverged)
            out["summary"]["stage_state"] = stage_state
            if cfg.adapter.kind == "lora" and last_ckpt and not diverged:
                out["summary"].update(self._export(last_ckpt))
            if interrupted:
                print(f"interrupted: checkpoint saved at step {step} in {last_ckpt}; continue with: "
                      f"{continue_command(plan)}", flush=True)
            print(format_summary(out["summary"]), flush=True)
        return out

    def _stage_state(self) -> list[dict]:
        """Per stage of replica 0: trainable and total parameters, the optimizer state's
        bytes and the rank's peak resident memory so far (one SUM all-reduce over the fast
        ranks; every fast rank calls it)."""
        import resource

        y0, k = self.cfg.replica_stages[0], 4
        vec = torch.zeros(k * y0, dtype=torch.float64)
        if self.mesh.row == 0:
            from orchestration.adapters import trainable_summary

            n = trainable_summary(self.stage)
            opt = sum(t.numel() * t.element_size() for st in self.optimizer.state.values()
                      for t in st.values() if torch.is_tensor(t))
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
            vec[k * self.mesh.stage:k * self.mesh.stage + k] = torch.tensor([n["trainable"], n["total"], opt, rss],
                                                                            dtype=torch.float64)
        vec = vec.to(self.mesh.device)
        dist.all_reduce(vec, group=self.mesh.fast)
        v = [int(x) for x in vec.cpu().tolist()]
        return [dict(zip(("trainable", "total", "optimizer_bytes", "peak_rss_bytes"), v[k * i:k * i + k]))
                for i in range(y0)]

    def _export(self, last_ckpt: str) -> dict:
        """Rank 0, end of a LoRA run: RUN_DIR/adapter (and RUN_DIR/merged) from the last checkpoint."""
        from orchestration.export import export_adapter, export_merged

        out = {"adapter_dir": export_adapter(last_ckpt, os.path.join(self.plan.run_dir, "adapter"))}
        if self.cfg.adapter.export == "merged":
            out["merged_dir"] = export_merged(last_ckpt, os.path.join(self.plan.run_dir, "merged"),
                                              dtype=self.cfg.model.dtype)
        return out

    def _record(self, step: int, stats, gnorm: float, step_s: float) -> tuple[dict, bool]:
        """The step's record, reduced over the fast ranks, and whether any rank asked to stop."""
        cfg = self.cfg
        rec, stopping = reduce_step(cfg, self.mesh, step, stats, gnorm, self.guard.skipped, self.counter,
                                    self.stop_requested, step_s, lr_at(step, cfg))
        hook, optim = self._anchor_view()
        rec.update({f"anchor_{k}": v for k, v in hook.items()})
        if optim is not None:
            rec["anchor_optim"] = optim
        return rec, stopping

    def _start_dense_tail(self, step: int) -> None:
        """--boundary.dense-tail: from ``step`` on, this replica's boundaries are sent dense.
        Every stage switches at the same step, so both ends of a boundary agree."""
        from orchestration.codecs import make_codec

        if self.rank == 0:
            print(f"step {step + 1}: the last {self.cfg.boundary.dense_tail} steps send the stage boundaries dense "
                  "(--boundary.dense-tail)", flush=True)
        self.executor.codec = make_codec("dense")

    def _own_anchor_view(self) -> tuple[dict, dict | None]:
        optim = None
        if self.cfg.anchor.enabled and hasattr(self.optimizer, "anchor_stats"):
            optim = {k: v for k, v in self.optimizer.anchor_stats().items() if isinstance(v, (int, float, type(None)))}
        return self.hook.stats(), optim

    def _anchor_view(self) -> tuple[dict, dict | None]:
        """The anchor hook's counters and the optimizer's anchor figures for the step record:
        this rank's, except on rank 0 of a heterogeneous mesh whose replica 0 is not of the
        anchor's split (it has no hook): there, those of the lowest replica of that split,
        stage 0, which sends them as JSON (never a pickle) after the step's reduction."""
        reporter = self.anchor_reporter
        if self.rank == 0 and reporter != 0:
            got = recv_json(reporter, self.mesh.device)
            return got["hook"], got["optim"]
        hook, optim = self._own_anchor_view()
        if self.rank == reporter != 0:
            send_json({"hook": hook, "optim": optim}, 0, self.mesh.device)
        return hook, optim

    def _checkpoint(self, step: int) -> str | None:
        """Saves after ``step`` unless the run is in a bad stretch (its weights are never
        published: the last good checkpoint stays latest); the path saved, or None."""
        if self.guard.streak:
            if self.rank == 0:
                print(f"warning: no checkpoint at step {step + 1}: the run is in a bad stretch "
                      f"(since step {self.guard.first_bad})", file=sys.stderr, flush=True)
            return None
        return self.save(step + 1, final=step + 1 == self.cfg.train.steps)

    def _summary(self, history, elapsed, steps_done, last_ckpt, links_path, diverged: str = "") -> dict:
        from orchestration.distributed.linkmodel import model_run

        cfg, plan = self.cfg, self.plan
        s = summarize(cfg, plan, history, elapsed, steps_done, last_ckpt, model_run(cfg, plan, history),
                      where=f"{self.mesh.device}, {dist.get_backend()}" if dist.is_initialized() else str(self.mesh.device))
        s["skipped_steps"] = self.guard.skipped_seen
        s["bad_steps"] = self.guard.bad_total
        s["diverged"] = diverged
        if diverged:
            s["eval_loss"] = s["eval_loss_base"] = s["eval_loss_plain"] = None
            s["links_path"] = links_path
            return s
        scored = plan.eval_rows is not None and cfg.run.eval_sequences > 0
        dtype = getattr(torch, cfg.model.dtype)
        rows = plan.eval_rows[:cfg.run.eval_sequences] if scored else None
        # as deployed: with the checkpoint's boundary transform (meshkern_boundary.json, a codec with a sink
        # row), and then the plain model's score beside it (eval_loss_plain; None without the transform)
        s["eval_loss"], s["eval_loss_plain"] = checkpoint_losses(last_ckpt, rows, dtype=dtype) \
            if scored and last_ckpt else (None, None)
        s["eval_loss_base"] = checkpoint_loss(plan.model_path, rows, dtype=dtype) if scored else None
        s["links_path"] = links_path
        return s


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
