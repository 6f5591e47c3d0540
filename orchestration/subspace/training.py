"""The trainer's side of subspace-projected boundaries (the ``subspace`` codec): which
replicas keep the constraint, the run's basis U and frozen token embedding E, and when
the constraint is re-applied. The constraint itself is orchestration.subspace.constraint; the codec
is orchestration.codecs.subspace.

A run "uses the subspace" when any fast replica's codec (``Config.replica_codec``) is
``subspace``. Then, on every replica (so that every copy of E stays the one the codecs
re-add):
- the token embedding is frozen (and with it a tied LM head, which is the same weight);
- U [H, k] is made once from the base model before the split (``make_basis``: fitted to
  the output projections by default, ``basis=random`` for the paper's seeded random one)
  and broadcast from fast rank 0, so every rank holds the same bits.
A *constrained* replica (codec ``subspace``; under ``--boundary.compress selective`` a
full replica is not one) projects its output projections onto span(U) before the first
step and after every optimizer step and every DP outer step (the final merge included),
projects their gradients onto span(U) before the optimizer sees them, and its DiLoCo
applies ``--dp.projection`` to the pseudo-gradient sync (meshkern.diloco).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from orchestration.subspace import constraint as sub


def uses_subspace(cfg) -> bool:
    return any(cfg.replica_codec(r) == "subspace" for r in range(cfg.fast_rows))


def freeze_embeddings(model) -> None:
    """Freeze the token embedding (both sides of a boundary must re-add the same E); a tied
    LM head is the same Parameter and freezes with it."""
    model.get_input_embeddings().weight.requires_grad_(False)


def prepare_model(cfg, model) -> dict:
    """build_stage, before the split (the whole base model at hand): freeze E; return the
    run's E (a detached fp32 copy) and its U (not yet agreed between ranks: ``SubspaceRun``
    broadcasts rank 0's)."""
    from orchestration.codecs import codec_for

    freeze_embeddings(model)
    E = model.get_input_embeddings().weight.detach().float().clone()
    codec = codec_for(cfg.boundary)
    H = E.shape[1]
    U = sub.make_basis(H, codec.width(H), seed=codec.seed, model=model if codec.basis == "fitted" else None)
    return {"E": E, "U": U}


class SubspaceRun:
    """One fast rank's part: ``project_grads()`` before clipping, ``after_update()`` after
    the optimizer step and after the DP outer step; ``projector`` for DiLoCo (None on an
    unconstrained replica)."""

    def __init__(self, cfg, mesh, stage, codec, init: dict):
        U = init["U"].to(torch.float32).contiguous()
        if dist.is_initialized() and dist.get_world_size(mesh.fast) > 1:  # one U, bit for bit, on every rank
            buf = U.to(mesh.device)
            dist.broadcast(buf, src=0, group=mesh.fast)
            U = buf.cpu()
        self.U, self.E = U, init["E"]
        self.stage, self.codec = stage, codec
        self.constrained = cfg.replica_codec(mesh.row) == "subspace"
        if hasattr(codec, "attach"):
            codec.attach(self.E, self.U)
        self.projector = sub.make_projector(self.U) if self.constrained else None
        if self.constrained:
            sub.constrain_(stage, self.U)

    def adopt_basis(self, U: torch.Tensor) -> None:
        """Takes a peer's basis in place (an elastic heal: the weights come from that peer,
        constrained to it); the projector and the codec's encode table follow."""
        self.U.copy_(U.to(self.U.dtype))
        if hasattr(self.codec, "attach"):
            self.codec.attach(self.E, self.U)

    def project_grads(self) -> None:
        """Before clipping and the optimizer step: project the output projections' gradients
        onto span(U). A stage upstream of a subspace boundary receives them already
        projected (the codec sends U^T g), the last stage and a full replica do not;
        AdamW's per-element scaling would turn that difference into different updates."""
        if not self.constrained:
            return
        for name, p in self.stage.named_parameters():
            if p.grad is not None and sub.is_constrained(name):
                p.grad = sub.project_tensor(name, p.grad, self.U)

    def after_update(self) -> None:
        if self.constrained:
            sub.constrain_(self.stage, self.U)
