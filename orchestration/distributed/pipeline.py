"""Executes one pipeline stage's part of a schedule: micro-batched forward/backward with
codec-compressed boundary transfers over torch.distributed point-to-point.

Why our own isend/recv executor and not torch.distributed.pipelining: every boundary
transfer here goes through a pluggable codec (orchestration.codecs) whose wire is a
list of tensors of codec-specific shapes and dtypes (packed values; values + indices;
int4 nibbles + scales), whose mask depends on (step, micro-batch) through the MaskKey,
and whose backward is not autograd of the forward wire (the receiver encodes the
gradient itself). pipelining's stages exchange exactly one activation tensor of fixed
shape per micro-batch and know neither the step nor the micro-batch id, so the codec
would have to hide inside the stage modules and the byte counts could not be taken
per link and direction. The executor is also what the link model replays: both run
the very same ``schedule.make_schedule`` action list.

Protocol, per micro-batch m of step s, boundary b between stage b and b+1 (ranks of
one replica), key = MaskKey(seed, b, s, m):

    stage b   F(m): out = stage(x); wire, ctx = codec.encode_fwd(out, key); isend(wire) -> b+1
    stage b+1 F(m): recv(wire) <- b; x = codec.decode_fwd(wire, key, shape, dtype) (leaf)
    stage b+1 B(m): backward; wire_b = codec.encode_bwd(x.grad, key, wire); isend -> b
    stage b   B(m): recv(wire_b); g = codec.decode_bwd(wire_b, key, ctx); out.backward(g)

Receivers preallocate from ``codec.wire_specs`` (no shape header travels), so the bytes
on a link are exactly ``codec.wire_bytes`` per micro-batch and direction. Messages
between two ranks are matched in order (one direction carries only activations, the
other only gradients, and both ends follow the schedule's micro-batch order), so no
tags are needed. Sends are asynchronous and completed at the end of the step; receives
block, bounded by the process group's timeout (a dead peer is an error, not a hang).
MoE models whose config turns ``output_router_logits`` on (orchestration.models.routing):
the load-balancing loss needs every stage's expert counts T and row count n. With F(m) each
stage also sends the running totals [T, n] (E + 1 fp32 values) after its wire; the last
stage then knows micro-batch m's totals and sends them back after its B(m) gradient wire,
and every stage adds its share ``stage_aux_term`` (scaled by 1/M: the micro-batches' mean,
as gradient accumulation over M micro-batches gives) to what it backpropagates. The
totals' bytes count on the pp axes. The logged loss stays the cross-entropy.

A received tensor holding NaN/Inf is never decoded into the model: it is replaced by
NaN, which makes the replica's gradient norm non-finite, and the trainer then skips
that step's update on every stage of the replica (counted as ``skipped_steps``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from meshkern.mask import MaskKey
from orchestration.codecs import NonFiniteWire
from orchestration.distributed.devices import needs_cpu_staging
from orchestration.distributed.link_counter import LinkCounter
from orchestration.distributed.stages import causal_lm_loss
from orchestration.models.routing import num_experts, router_stats, stage_aux_term


@dataclass
class StepStats:
    """What one stage measured in one step."""

    loss: float = 0.0                    # sum of micro-batch losses (= the step's mean loss); last stage only
    fwd_s: list = field(default_factory=list)   # compute seconds per F action (recv waits excluded)
    bwd_s: list = field(default_factory=list)   # compute seconds per B action
    wait_s: float = 0.0                  # seconds blocked in recv
    rejected: int = 0                    # received wire tensors with NaN/Inf (see _decode)


class PipelineExecutor:
    """One stage of one replica.

    stage: an orchestration.distributed.stages.Stage. actions: this stage's list of schedule Actions
    (``.kind`` "F"/"B", ``.microbatch``). prev_rank / next_rank: global ranks of the
    neighbouring stages (None at the ends). seed: the mask seed of this replica.
    counter: a LinkCounter receiving the bytes this rank sends (axes "pp_fwd"/"pp_bwd").
    """

    def __init__(self, stage, actions, *, codec, prev_rank, next_rank, rank, seed: int,
                 counter: LinkCounter, group=None):
        self.stage, self.actions, self.codec = stage, list(actions), codec
        self.prev_rank, self.next_rank, self.rank = prev_rank, next_rank, rank
        self.seed, self.counter, self.group = seed, counter, group
        self.index = stage.index
        self.device = next(stage.parameters()).device  # wire buffers live where the stage computes
        # gloo has no CUDA send/recv: ranks sharing a GPU send CPU copies (devices module doc)
        self.via_cpu = dist.is_initialized() and needs_cpu_staging(self.device, dist.get_backend(group))
        self.is_first, self.is_last = stage.is_first, stage.is_last
        self.router = getattr(stage, "_router", None) is not None  # MoE with output_router_logits on
        self.n_experts = num_experts(stage.config) if self.router else 0
        if self.is_first != (prev_rank is None) or self.is_last != (next_rank is None):
            raise ValueError(f"stage {self.index} (first={self.is_first}, last={self.is_last}) does not match "
                             f"neighbours prev={prev_rank}, next={next_rank}")

    # ------------------------------------------------------------------ transport
    def _send(self, wire, dst: int, axis: str, pending: list) -> None:
        for t in wire:
            if self.via_cpu:
                t = t.cpu()  # (the isend's work holds this copy until it completes)
            pending.append(dist.isend(t, dst, group=self.group))
            self.counter.add(axis, self.rank, dst, t.numel() * t.element_size())

    def _post_all(self, shape, dtype) -> dict:
        """Every receive of this step, posted at its start in schedule order: {(direction, m):
        [(buffer, work)]} (the wire's tensors, then the router totals where there are some).
        Why all at once: gloo sends a message only once the receiver has posted its receive,
        and that notice travels on the same TCP stream as data going the other way. Posted
        when the action comes, the notice for micro-batch m+1's activations waited behind
        micro-batch m's gradients on a slow link, and the two directions, which the schedule
        overlaps, ran one after the other (a 1x2 1F1B pipeline at 500 kbit/s: 1.37x the link
        model's step time; bench/hosts_bench.py)."""
        where = "cpu" if self.via_cpu else self.device
        posted: dict = {}
        for act in self.actions:
            direction, src = ("fwd", self.prev_rank) if act.kind == "F" else ("bwd", self.next_rank)
            if src is None:
                continue
            specs = list(self.codec.wire_specs(shape, dtype, direction))
            if self.router:
                specs.append(((self.n_experts + 1,), torch.float32))
            bufs = [torch.empty(sh, dtype=d, device=where) for sh, d in specs]
            posted[(direction, act.microbatch)] = [(b, dist.irecv(b, src, group=self.group)) for b in bufs]
        return posted

    def _take(self, posted: dict, key: tuple, stats: StepStats) -> list[torch.Tensor]:
        """The buffers of a posted receive, once complete (bounded by the group's timeout)."""
        t0 = time.perf_counter()
        bufs = []
        for b, work in posted.pop(key):
            work.wait()
            bufs.append(b)
        stats.wait_s += time.perf_counter() - t0
        return [b.to(self.device) for b in bufs] if self.via_cpu else bufs

    def _decode(self, decode, shape, dtype, stats: StepStats) -> torch.Tensor:
        """``decode()`` (a codec decode, which validates the wire once), or, if the peer
        sent NaN/Inf (codecs.NonFiniteWire), an all-NaN stand-in: the replica's gradient
        norm (all-reduced over its stages) is then non-finite and every stage skips this
        step's update together; the weights never see the garbage and the mesh keeps running."""
        try:
            return decode()
        except NonFiniteWire:
            stats.rejected += 1
            return torch.full(tuple(shape), float("nan"), dtype=dtype, device=self.device)

    def _aux(self, stats_s, totals: torch.Tensor, M: int) -> torch.Tensor:
        """This stage's share of micro-batch m's router loss (mean over the M micro-batches)."""
        return stage_aux_term(stats_s, totals[:-1], totals[-1], self.stage.config) / M

    # ------------------------------------------------------------------ one step
    def step(self, step: int, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
             num_microbatches: int | None = None, sample_ids: torch.Tensor | None = None) -> StepStats:
        """Runs this stage's actions for one optimizer step; accumulates gradients into
        the stage's parameters (not zeroed here). ``input_ids`` [B, T] is the replica's
        batch (every stage holds it: the first embeds it, the last uses it as labels);
        it is split into ``num_microbatches`` equal micro-batches. The loss is the
        unsplit model's mean next-token loss over the whole batch. ``sample_ids`` [B]:
        each row's stable sample id (BatchSampler.indices), split like the batch and
        handed to ``codec.begin_step`` (a per-sample codec, aqsgd, keys its stores by them;
        every stage holds them, so both sides of a boundary agree without communication).
        """
        input_ids = input_ids.to(self.device)
        labels = input_ids if labels is None else labels.to(self.device)
        M = num_microbatches or (1 + max(a.microbatch for a in self.actions))
        if input_ids.shape[0] % M:
            raise ValueError(f"batch of {input_ids.shape[0]} sequences does not split into {M} micro-batches")
        mb_ids = input_ids.chunk(M)
        mb_labels = labels.chunk(M)
        if sample_ids is not None and tuple(sample_ids.shape) != (input_ids.shape[0],):
            raise ValueError(f"sample_ids must be [{input_ids.shape[0]}] (one per sequence), "
                             f"got {tuple(sample_ids.shape)}")
        self.codec.begin_step(step, None if sample_ids is None else sample_ids.chunk(M))
        self.codec.bind_inputs(mb_ids)
        # Same normalisation as the unsplit model's loss on the whole batch.
        n_items = int((labels[:, 1:] != -100).sum())
        H, dtype = self.stage.hidden_size, next(self.stage.parameters()).dtype
        shape = (mb_ids[0].shape[0], mb_ids[0].shape[1], H)
        stats = StepStats()
        inputs: dict[int, torch.Tensor] = {}
        fwd_wire: dict[int, list] = {}
        outputs: dict[int, torch.Tensor] = {}
        ctxs: dict[int, object] = {}
        rs: dict[int, tuple] = {}  # router loss: this stage's (T_s, R_s, n_s) per micro-batch
        totals: dict[int, torch.Tensor] = {}  # router loss: [T, n] per micro-batch (running, then whole)
        pending: list = []
        posted = self._post_all(shape, dtype)
        for act in self.actions:
            m = act.microbatch
            if act.kind == "F":
                if self.is_first:
                    x = mb_ids[m]
                else:
                    wire = self._take(posted, ("fwd", m), stats)
                    if self.router:  # the running totals came after the wire
                        upstream = wire.pop()
                    key = MaskKey(self.seed, self.index - 1, step, m)
                    t0 = time.perf_counter()
                    x = self._decode(lambda: self.codec.decode_fwd(wire, key, shape, dtype),
                                     shape, dtype, stats).detach().requires_grad_(True)
                    fwd_wire[m], inputs[m] = wire, x
                    stats.fwd_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                out = self.stage(x)
                if self.router:  # running [T, n] of the router loss: this stage's added to what came
                    rs[m] = router_stats(self.stage.router_logits, self.stage.config)
                    mine = torch.cat([rs[m][0].detach(), rs[m][2].detach().reshape(1)])
                    totals[m] = mine if self.is_first else upstream + mine
                if self.is_last:
                    out = causal_lm_loss(out, mb_labels[m], num_items_in_batch=n_items)
                    stats.loss += float(out.detach())
                    outputs[m] = out
                else:
                    key = MaskKey(self.seed, self.index, step, m)
                    wire, ctxs[m] = self.codec.encode_fwd(out, key)
                    outputs[m] = out
                dt = time.perf_counter() - t0
                if not self.is_first:
                    stats.fwd_s[-1] += dt
                else:
                    stats.fwd_s.append(dt)
                if not self.is_last:
                    self._send(list(wire) + ([totals[m]] if self.router else []), self.next_rank, "pp_fwd", pending)
            elif act.kind == "B":
                if self.is_last:
                    t0 = time.perf_counter()
                    out = outputs.pop(m)
                    (out + self._aux(rs.pop(m), totals[m], M) if self.router else out).backward()
                else:
                    wire_b = self._take(posted, ("bwd", m), stats)
                    if self.router:  # the micro-batch's totals came back after the gradient wire
                        totals[m] = wire_b.pop()
                    key = MaskKey(self.seed, self.index, step, m)
                    t0 = time.perf_counter()
                    ctx = ctxs.pop(m)
                    g = self._decode(lambda: self.codec.decode_bwd(wire_b, key, ctx),
                                     outputs[m].shape, dtype, stats)
                    if self.router:
                        torch.autograd.backward([outputs.pop(m), self._aux(rs.pop(m), totals[m], M)], [g, None])
                    else:
                        outputs.pop(m).backward(g)
                if not self.is_first:
                    x = inputs.pop(m)
                    grad = x.grad if x.grad is not None else torch.zeros_like(x)
                    key = MaskKey(self.seed, self.index - 1, step, m)
                    wire_b = self.codec.encode_bwd(grad, key, fwd_wire.pop(m))
                    stats.bwd_s.append(time.perf_counter() - t0)
                    self._send(list(wire_b) + ([totals.pop(m)] if self.router else []), self.prev_rank, "pp_bwd",
                               pending)
                else:
                    stats.bwd_s.append(time.perf_counter() - t0)
            else:
                raise ValueError(f"unknown schedule action kind {act.kind!r}")
        for w in pending:
            w.wait()
        if outputs or inputs or posted:
            raise RuntimeError(f"stage {self.index}: schedule left micro-batches {sorted(outputs) or sorted(inputs)} "
                               f"without a backward, or receives {sorted(posted)} never used")
        return stats
