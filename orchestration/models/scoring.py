"""Held-out loss of a model or a chain of stages: the one scoring rule shared by the
trainer, the base-model pretraining and orchestration.evaluate (which builds exact match
and pruning robustness on it).

Every function accepts either a Hugging Face causal LM or a plain callable
``input_ids [B, T] int64 -> logits [B, T, V]`` (or a list of stages, called one after the
other on the previous one's output).
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

LogitsFn = Callable[[torch.Tensor], torch.Tensor]


def as_logits_fn(model_or_stages) -> LogitsFn:
    """A callable ``input_ids -> logits`` from a HF model, a callable, or a sequence
    of stages (first takes input_ids, last returns logits)."""
    if isinstance(model_or_stages, (list, tuple, torch.nn.ModuleList)):
        stages = list(model_or_stages)
        if not stages:
            raise ValueError("empty list of stages")

        def chained(x):
            for s in stages:
                x = s(x)
            return _logits_of(x)
        return chained
    if not callable(model_or_stages):
        raise TypeError(f"expected a model, a callable or a list of stages, got "
                        f"{type(model_or_stages).__name__}")
    if isinstance(model_or_stages, torch.nn.Module) and hasattr(model_or_stages, "config"):
        return lambda x: _logits_of(model_or_stages(input_ids=x, use_cache=False))
    return lambda x: _logits_of(model_or_stages(x))


def _logits_of(out) -> torch.Tensor:
    logits = getattr(out, "logits", out)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise TypeError(f"model must return logits [B, T, V], got {type(logits).__name__} "
                        f"{tuple(getattr(logits, 'shape', ()))}")
    return logits


def _rows(dataset) -> torch.Tensor:
    tokens = getattr(dataset, "tokens", dataset)
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype != torch.int64:
        raise TypeError("dataset must be a TokenDataset or an int64 tensor [N, T]")
    if tokens.shape[0] == 0 or tokens.shape[1] < 2:
        raise ValueError(f"dataset needs >= 1 row of >= 2 tokens, got {tuple(tokens.shape)}")
    return tokens


@torch.no_grad()
def eval_loss(model_or_stages, dataset, *, batch_size: int = 16,
              max_batches: int | None = None) -> dict:
    """Mean next-token cross-entropy over every predicted token of ``dataset`` (rows
    in order; the first ``max_batches`` batches if given), in float32.

    Returns ``{"loss", "perplexity", "tokens"}``; the loss is the exact token mean
    (sum over all tokens / count), not a mean of batch means. Puts an nn.Module in
    eval mode for the call and restores its previous mode.
    """
    fn = as_logits_fn(model_or_stages)
    tokens = _rows(dataset)
    modules = [m for m in (model_or_stages if isinstance(model_or_stages, (list, tuple))
                           else [model_or_stages]) if isinstance(m, torch.nn.Module)]
    was_training = [m.training for m in modules]
    for m in modules:
        m.eval()
    try:
        total, count = 0.0, 0
        for i, start in enumerate(range(0, tokens.shape[0], batch_size)):
            if max_batches is not None and i >= max_batches:
                break
            x = tokens[start:start + batch_size]
            logits = fn(x)[:, :-1].float()
            target = x[:, 1:]
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                     reduction="sum").item()
            count += target.numel()
    finally:
        for m, t in zip(modules, was_training):
            m.train(t)
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(min(loss, 80.0)), "tokens": count}


# ----------------------------------------------------------------- exact match


def checkpoint_loss(path: str, rows: torch.Tensor, *, dtype: torch.dtype = torch.float32,
                    boundary: bool = True) -> float:
    """Mean next-token loss of the checkpoint at ``path`` (loaded in ``dtype``) on ``rows``
    (int64 [N, T]): the run's held-out score of its exported checkpoint (and of the base),
    as deployed: with the folder's boundary transform, if it has one (``boundary`` False:
    the plain model; orchestration.models.boundary_transform)."""
    from orchestration.models.loading import load_causal_lm

    model, _ = load_causal_lm(path, dtype=dtype, boundary=boundary)
    return eval_loss(model, rows)["loss"]


def checkpoint_losses(path: str, rows: torch.Tensor, *, dtype: torch.dtype = torch.float32) -> tuple[float, float | None]:
    """(deployed, plain): ``checkpoint_loss`` of ``path`` as deployed and, when the folder has
    a boundary transform, of the plain model too (None without one): one load, two scores."""
    from orchestration.models import boundary_transform
    from orchestration.models.loading import load_causal_lm

    model, _ = load_causal_lm(path, dtype=dtype)
    deployed = eval_loss(model, rows)["loss"]
    if not boundary_transform.remove(model):
        return deployed, None
    return deployed, eval_loss(model, rows)["loss"]
