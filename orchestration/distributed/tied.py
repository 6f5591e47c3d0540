"""The gradient sync of a tied embedding whose two copies sit on different ranks (or twice
in one full replica): every step the two copies' gradients are summed, so a split model
trains exactly like the unsplit one (--model.tied-embeddings sync)."""
from __future__ import annotations

import torch.distributed as dist


class TiedGradSync:
    """``param`` is this rank's copy of the tied weight (None when it holds none, the
    copies are untied, or the weight is frozen); ``sync()`` sums the copies' gradients and
    counts the bytes on the "tied" axis; ``twin`` is the copy a global gradient norm must
    skip (the last stage's: the unsplit model counts the weight once)."""

    def __init__(self, stage, mesh, counter, untie: bool):
        self.stage, self.mesh, self.counter = stage, mesh, counter
        tied = stage.tied_lm_head or stage.tied_embed  # split_model / _untie decided, from the weights themselves
        param = (stage.lm_head.weight if stage.is_last else stage.embed_tokens.weight) if tied and not untie else None
        self.param = param if param is not None and param.requires_grad else None  # frozen (subspace codec): nothing to sum
        self.twin = self.param if self.param is not None and stage.tied_lm_head else None

    def sync(self) -> None:
        stage, mesh = self.stage, self.mesh
        if self.param is None:
            return
        if stage.is_first and stage.is_last:  # a full replica holding both copies (builders._untie)
            g = stage.embed_tokens.weight.grad + stage.lm_head.weight.grad
            stage.embed_tokens.weight.grad, stage.lm_head.weight.grad = g, g.clone()
            return
        grad = self.param.grad
        dist.all_reduce(grad, group=mesh.groups[f"ends{mesh.row}"])
        # An all-reduce of two ranks sends the tensor's size from each (reduce-scatter
        # and all-gather of halves): not small, and no boundary codec compresses it.
        lay = mesh.layout
        ends = (lay.rank_of(mesh.row, 0), lay.rank_of(mesh.row, lay.stages_of(mesh.row) - 1))
        self.counter.add("tied", mesh.rank, ends[1] if mesh.rank == ends[0] else ends[0],
                         grad.numel() * grad.element_size())
