"""Gradient measurements at a boundary: the dense boundary gradient of calibration rows
(for the gradient PCA), and, for any transform on one held-out batch, how far the
gradients it produces are from the dense boundary's.

``GradProbe.compare`` reports cosine, relative norm error and norm ratio (``metrics_from_sums``)
of the parameter gradients of everything before the boundary (all, decoder layers only,
and per stage of each Y-split), of the boundary activation gradient the sender gets
back, and of the parameters after the boundary. No ``.grad`` of the model is touched.
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch

from orchestration.diagnose.model import LayerSplit
from orchestration.diagnose.transforms import Fn
from orchestration.distributed.stages import causal_lm_loss


def boundary_gradients(split: LayerSplit, h: torch.Tensor, L: int, ids: torch.Tensor, chunk: int = 4) -> torch.Tensor:
    """Dense gradient of the loss w.r.t. the boundary hidden state h [B, T, H] (rows in chunks;
    each chunk's loss is its own mean, as a micro-batch's)."""
    out = []
    for i in range(0, ids.shape[0], chunk):
        with torch.enable_grad():
            x = h[i:i + chunk].detach().requires_grad_(True)
            loss = causal_lm_loss(split.suffix(x, L), ids[i:i + chunk])
            out.append(torch.autograd.grad(loss, x)[0])
    return torch.cat(out)


def _group(name: str) -> str:
    if name.startswith("model.layers."):
        return name.split(".")[2]
    return "embed" if "embed_tokens" in name else "head"


class GradStats:
    """Per parameter group ('embed', layer index as str, 'head'): sums of a.b, |a|^2, |b|^2,
    |a-b|^2 between a transform's gradient a and the dense one b."""

    def __init__(self):
        self.s: dict[str, list[float]] = {}

    def add(self, name: str, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        v = self.s.setdefault(_group(name), [0.0, 0.0, 0.0, 0.0])
        for i, x in enumerate(pair_sums(a, b)):
            v[i] += x

    def summary(self, groups: Sequence[str] | None = None) -> dict:
        keys = [g for g in (self.s if groups is None else groups) if g in self.s]
        d, aa, bb, ee = (sum(self.s[g][i] for g in keys) for i in range(4))
        return metrics_from_sums(d, aa, bb, ee)


def metrics_from_sums(dot: float, aa: float, bb: float, ee: float) -> dict:
    """cos(a, b), ||a - b|| / ||b||, ||a|| / ||b|| from the sums."""
    na, nb = math.sqrt(aa), math.sqrt(bb)
    return {"cos": dot / (na * nb) if na > 0 and nb > 0 else None,
            "rel_err": math.sqrt(ee) / nb if nb > 0 else None,
            "norm_ratio": na / nb if nb > 0 else None}


def pair_sums(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, float, float]:
    """a.b, |a|^2, |b|^2, |a-b|^2 in float64: the sums every gradient comparison adds up."""
    a, b = a.double(), b.double()
    return float((a * b).sum()), float(a.pow(2).sum()), float(b.pow(2).sum()), float((a - b).pow(2).sum())


def tensor_metrics(a: torch.Tensor, b: torch.Tensor) -> dict:
    return metrics_from_sums(*pair_sums(a, b))


def pairs_metrics(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """metrics_from_sums over several tensors taken as one vector (e.g. every parameter)."""
    tot = [0.0, 0.0, 0.0, 0.0]
    for a, b in pairs:
        for i, x in enumerate(pair_sums(a, b)):
            tot[i] += x
    return metrics_from_sums(*tot)


class GradProbe:
    """Gradients at boundary L on one batch, for any transform, against the dense boundary.

    The prefix (stages before L) runs once with its graph kept; per transform the suffix
    runs forward and backward from fn(h), and the boundary gradient that comes back through
    fn's backward is pulled through the prefix (torch.autograd.grad, so no .grad is touched).
    """

    def __init__(self, split: LayerSplit, ids: torch.Tensor, L: int):
        self.split, self.ids, self.L = split, ids, L
        self.pre = list(split.named_params(0, L))
        self.post = list(split.named_params(L, split.n))
        with torch.enable_grad():
            self.h = split.prefix(ids, L)
        self.ref = self.grads(None)

    def grads(self, fn: Fn | None):
        with torch.enable_grad():
            hh = self.h.detach().requires_grad_(True)
            logits = self.split.suffix(hh if fn is None else fn(hh, self.ids), self.L)
            loss = causal_lm_loss(logits, self.ids)
            g = torch.autograd.grad(loss, [hh] + [p for _, p in self.post], allow_unused=True)
            g_pre = torch.autograd.grad(self.h, [p for _, p in self.pre], grad_outputs=g[0], retain_graph=True,
                                        allow_unused=True)
        return float(loss.detach()), g[0], list(g_pre), list(g[1:])

    def compare(self, fn: Fn, stage_groups: dict[str, list[str]] | None = None) -> dict:
        loss, g_h, g_pre, g_post = self.grads(fn)
        _, r_h, r_pre, r_post = self.ref
        pre, post = GradStats(), GradStats()
        for (n, _), a, b in zip(self.pre, g_pre, r_pre):
            pre.add(n, a, b)
        for (n, _), a, b in zip(self.post, g_post, r_post):
            post.add(n, a, b)
        layers = [str(i) for i in range(self.L)]
        out = {"loss": loss, "boundary": tensor_metrics(g_h, r_h), "prefix": pre.summary(),
               "prefix_layers": pre.summary(layers), "suffix": post.summary()}
        if stage_groups:
            out["prefix_by_stage"] = {s: pre.summary(gr) for s, gr in stage_groups.items()}
        return out
