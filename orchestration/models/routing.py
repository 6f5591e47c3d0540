"""The router's load-balancing loss of MoE families, over layers split into stages.

An MoE causal LM whose config turns ``output_router_logits`` on adds
``router_aux_loss_coef * load_balancing_loss_func(router logits of every layer)`` to its
loss (transformers' Mixtral / Qwen-MoE ``ForCausalLM.forward``); with it off there is no
such term, and a split model adds none either.

The loss is not a sum of per-layer terms. transformers computes, over all layers' rows
(tokens, padding masked out):

    T = sum over layers of the top-k expert counts      [E]   (no gradient)
    R = sum over layers of the routing probabilities     [E]   (gradient)
    n = rows counted over all layers
    aux = E * sum(T * R) / n**2

so it is bilinear in what the stages hold: ``router_stats`` gives one stage's (T_s, R_s,
n_s); summed over stages they give the unsplit T, R, n (``aux_from_stats``). A runtime
that holds the stages on different processes gets the unsplit gradient exactly by
letting every stage add ``stage_aux_term(stats_s, T, n)`` = coef * E * sum(T * R_s) / n**2
to its loss once the totals T and n (small [E] vectors, no gradient) are known: the
gradient reaches R only through R_s, and T, n carry none. In one process
(``Stage.router_logits`` of every stage, in order) ``router_aux_loss`` calls
transformers' own function on all layers' logits, which is the unsplit value bit for bit.
"""
from __future__ import annotations

import importlib
from typing import Sequence

import torch


def _hf_module(config):
    return importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")


def router_class(decoder) -> tuple[type, int] | None:
    """(router module class, index of its logits in the module's output) from the
    backbone's ``_can_record_outputs["router_logits"]`` (how transformers itself collects
    them), or None for a model without a router."""
    rec = (getattr(decoder, "_can_record_outputs", None) or {}).get("router_logits")
    if rec is None:
        return None
    cls = getattr(rec, "target_class", rec)
    return cls, int(getattr(rec, "index", 0) or 0)


def num_experts(config) -> int:
    """E: the experts of each MoE layer of ``config``."""
    from orchestration.models.families import family_of

    return _num_experts(config, family_of(config))


def _num_experts(config, fam) -> int:
    return int(getattr(config, fam.experts))


def router_aux_loss(router_logits: Sequence[torch.Tensor], config, attention_mask=None) -> torch.Tensor:
    """``router_aux_loss_coef * load_balancing_loss_func(...)`` of the unsplit model, from the
    router logits of all layers in order (each [B*T, E]); ``attention_mask`` the 2-D padding mask."""
    from orchestration.models.families import family_of

    fam = family_of(config)
    fn = _hf_module(config).load_balancing_loss_func
    aux = fn(tuple(router_logits), _num_experts(config, fam), config.num_experts_per_tok, attention_mask)
    return config.router_aux_loss_coef * aux


def router_stats(router_logits: Sequence[torch.Tensor], config, attention_mask=None):
    """(T_s, R_s, n_s) of one stage's layers (module doc), computed as transformers' loop does."""
    from orchestration.models.families import family_of

    E, k = _num_experts(config, family_of(config)), config.num_experts_per_tok
    dev = router_logits[0].device
    T = torch.zeros(E, dtype=torch.float32, device=dev)
    R = torch.zeros(E, dtype=torch.float32, device=dev)
    n = torch.zeros((), dtype=torch.float32, device=dev)
    flat = None if attention_mask is None else attention_mask.reshape(-1).to(device=dev, dtype=torch.float32)
    for logits in router_logits:
        w = torch.softmax(logits, dim=-1)
        _, sel = torch.topk(w, k, dim=-1)
        ones = torch.ones(sel.numel(), device=dev) if flat is None else flat.repeat_interleave(k)
        T = T + torch.zeros(E, device=dev).scatter_add_(0, sel.reshape(-1), ones)
        R = R + (w.float() if flat is None else w.float() * flat.unsqueeze(-1)).sum(dim=0)
        n = n + (w.shape[0] if flat is None else flat.sum())
    return T, R, n


def aux_from_stats(T: torch.Tensor, R: torch.Tensor, n, config) -> torch.Tensor:
    """coef * E * sum(T * R) / n**2: the unsplit loss term from totals over all stages."""
    from orchestration.models.families import family_of

    E = _num_experts(config, family_of(config))
    return config.router_aux_loss_coef * torch.sum((T / n) * (R / n)) * E


def stage_aux_term(stats, T_total: torch.Tensor, n_total, config) -> torch.Tensor:
    """One stage's share of the aux loss given the totals over all stages: the shares add
    up to ``aux_from_stats`` of the totals, and their gradients to the unsplit gradient."""
    _, R_s, _ = stats
    return aux_from_stats(T_total.detach(), R_s, n_total.detach() if torch.is_tensor(n_total) else n_total, config)
