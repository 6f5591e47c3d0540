"""Cut a Hugging Face causal LM into pipeline stages by decoder layers.

``split_model(model, num_stages, layers_per_stage=None) -> list[Stage]``

Each ``Stage`` is an ``nn.Module`` that runs a contiguous slice of the decoder layers
and rebuilds, locally, everything the unsplit model computes once at the bottom of the
stack and hands to every layer: the rotary position embeddings (cos, sin) and the
attention mask (``transformers.masking_utils.create_causal_mask``, or the sliding-window
variant for layers the config marks as sliding). Nothing but the hidden state has to
cross a stage boundary, which is what makes the boundary compressible.

    Stage.forward(x, position_ids=None, attention_mask=None) -> Tensor
        x: first stage: input_ids [B, T] (integer); other stages: hidden [B, T, H].
        returns: last stage: logits [B, T, V]; other stages: hidden [B, T, H]
        (a single-stage split takes input_ids and returns logits).
        position_ids [B or 1, T] defaults to arange(T), as in the unsplit model;
        attention_mask is the optional 2-D padding mask [B, T] (1 = real token).
    causal_lm_loss(logits, labels, num_items_in_batch=None) -> scalar loss
        the unsplit model's loss (``model(input_ids, labels=labels).loss``).

The backbone is found through transformers' conventions (``get_input_embeddings``, the
decoder's ``layers`` / ``norm`` / ``rotary_emb``, ``get_output_embeddings``); what a
family's forward does outside its layers (Gemma's logit soft-capping, Granite's
multipliers, which mask and which rope each layer gets, an MoE router's loss) is stated per
family in orchestration.models.families, and a family not listed there is refused in one
line (``check_splittable``). Guarantees (tests/test_stages.py, tests/test_model_families.py):
running the stages one after the other gives bit-identical logits to the unsplit model, and
the same gradients, for every family of ``supported_families()``, including grouped-query
attention, sliding-window and local/global layers. The stages share their modules (hence
their parameters) with ``model``; ``copy.deepcopy(model)`` first if you need an independent
original.

MoE families with ``config.output_router_logits`` on: each stage records its layers'
router logits during ``forward`` (``Stage.router_logits``); the unsplit model's auxiliary
loss over all of them is orchestration.models.routing (``router_aux_loss`` in one process,
``router_stats`` / ``stage_aux_term`` across processes, which the pipeline executor
adds: orchestration.distributed.pipeline). With it off nothing is recorded.

Tied embeddings (``lm_head.weight is embed_tokens.weight``): with one stage nothing
changes. With several stages the input embedding lives on the first stage and the
output projection on the last, on different processes, so one tensor cannot serve both.
We do what Megatron-LM does: the last stage gets its own *copy* of the weight (same
values, a separate Parameter; ``Stage.tied_lm_head`` is True there). The unsplit
model's gradient of the tied weight is the *sum* of the two copies' gradients; a runtime
that wants the unsplit model's training exactly all-reduces (sums) the two gradients
between the first and last stage before the optimizer step, which keeps the copies
equal (``tied_weight_pairs`` names them). Without that sync the copies train apart as
an untied model would. An error would have been the alternative, but most small
checkpoints (Llama-3.2-1B, Qwen2-0.5B) tie their embeddings, so refusing them would
block the main use case.
"""
from __future__ import annotations

import copy
import inspect
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from orchestration.models.families import (Family, check_splittable, family_of, finalize_logits,
                                          layer_attention_types, scale_embeddings,
                                          supported_families, uses_router_loss)
from orchestration.models.routing import router_class

_SLIDING = "sliding_attention"
__all__ = ["Stage", "split_model", "run_stages", "causal_lm_loss", "balanced_layers", "replica_split",
           "tied_weight_pairs", "hf_name", "check_splittable", "supported_families"]


def replica_split(num_layers: int, num_stages: int, layers_per_stage=None) -> list[int]:
    """Layers per stage of a replica of ``num_stages`` stages: ``layers_per_stage``
    (--mesh.layers-per-stage) when it has that many entries, else ``balanced_layers``. The
    one rule the trainer, the sync segments, the resume check and the experiment tools use
    (in a heterogeneous mesh a split given for one depth does not apply to the others)."""
    if layers_per_stage and len(layers_per_stage) == num_stages:
        return [int(k) for k in layers_per_stage]
    return balanced_layers(num_layers, num_stages)


def balanced_layers(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage, as even as possible; earlier stages get the extra layers.

    (The first stage also holds the embedding and the last the LM head; at small vocab
    that is cheap, and at large vocab users pass an explicit ``layers_per_stage``.)
    """
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_stages > num_layers:
        raise ValueError(f"cannot split {num_layers} decoder layers into {num_stages} stages: "
                         f"more stages than layers (every stage needs at least one layer)")
    q, r = divmod(num_layers, num_stages)
    return [q + (1 if i < r else 0) for i in range(num_stages)]


class Stage(nn.Module):
    """One pipeline stage: [embedding] -> decoder layers [lo, hi) -> [final norm -> LM head].

    Attributes: ``index``, ``num_stages``, ``layer_range`` (lo, hi), ``is_first``,
    ``is_last``, ``hidden_size``, ``vocab_size``, ``tied_lm_head`` (see module doc),
    ``tied_embed`` (the first stage of a tied model split over stages: its embedding has a
    copy on the last stage).
    Parameter names follow the HF checkpoint (``model.layers.<i>.``, ``model.embed_tokens.``,
    ``model.norm.``, ``lm_head.``) via ``hf_state_dict()``, so stages can be written back
    into one HF-format checkpoint.
    """

    def __init__(self, index: int, num_stages: int, config, layers: Sequence[nn.Module],
                 layer_range: tuple[int, int], rotary_emb: nn.Module,
                 embed_tokens: nn.Module | None = None, norm: nn.Module | None = None,
                 lm_head: nn.Module | None = None, tied_lm_head: bool = False,
                 family: Family | None = None, router: tuple[type, int] | None = None):
        super().__init__()
        self.index, self.num_stages = index, num_stages
        self.config = config
        self.family = family or family_of(config)
        self.tied_embed = False  # set by split_model
        self.layer_range = layer_range
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.hidden_size, self.vocab_size = config.hidden_size, config.vocab_size
        self.tied_lm_head = tied_lm_head
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = lm_head
        self.rotary_emb = rotary_emb
        self._attn_types = layer_attention_types(config, self.family)[layer_range[0]:layer_range[1]]
        # Gemma 3: one rotary module, a rope per layer type (local layers use their own base)
        self._rope_per_type = "layer_type" in inspect.signature(rotary_emb.forward).parameters
        self._router = router if uses_router_loss(config) else None
        self.router_logits: list[torch.Tensor] = []  # this stage's layers', from the last forward (MoE only)

    def _masks(self, hidden: torch.Tensor, attention_mask, position_ids) -> dict:
        kw = dict(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask,
                  cache=None, position_ids=position_ids)
        out = {}
        for kind in set(self._attn_types):
            out[kind] = (create_sliding_window_causal_mask if kind == _SLIDING else create_causal_mask)(**kw)
        return out

    def _rope(self, hidden: torch.Tensor, position_ids) -> dict:
        if self._rope_per_type:
            return {kind: self.rotary_emb(hidden, position_ids, kind) for kind in set(self._attn_types)}
        pe = self.rotary_emb(hidden, position_ids=position_ids)
        return {kind: pe for kind in set(self._attn_types)}

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run this stage. See the module docstring for shapes; raises on wrong input kind."""
        if self.is_first:
            if x.dtype.is_floating_point or x.dim() != 2:
                raise TypeError(f"stage 0 takes input_ids [B, T] of an integer dtype, "
                                f"got {x.dtype} of shape {tuple(x.shape)}")
            hidden = scale_embeddings(self.family, self.config, self.embed_tokens(x))
        else:
            if not x.dtype.is_floating_point or x.dim() != 3 or x.shape[-1] != self.hidden_size:
                raise TypeError(f"stage {self.index} takes hidden states [B, T, {self.hidden_size}] "
                                f"of a floating dtype, got {x.dtype} of shape {tuple(x.shape)}")
            hidden = x
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        masks = self._masks(hidden, attention_mask, position_ids)
        rope = self._rope(hidden, position_ids)
        hooks = self._record_routers() if self._router is not None else []
        try:
            for layer, kind in zip(self.layers, self._attn_types):
                hidden = layer(hidden, attention_mask=masks[kind], position_ids=position_ids,
                               position_embeddings=rope[kind])
                if not isinstance(hidden, torch.Tensor):  # the contract: a layer passes on its hidden state only
                    raise TypeError(f"{type(layer).__name__} returned {type(hidden).__name__}, not the hidden "
                                    "state: this transformers version's layers do not fit the splitter")
        finally:
            for h in hooks:
                h.remove()
        if self.is_last:
            hidden = finalize_logits(self.family, self.config, self.lm_head(self.norm(hidden)))
        return hidden

    def _record_routers(self) -> list:
        """Forward hooks that collect this stage's router logits in layer order (what
        transformers' OutputRecorder collects for the unsplit model); removed after the forward."""
        cls, idx = self._router
        self.router_logits = []

        def keep(_mod, _inp, out):
            self.router_logits.append(out[idx] if isinstance(out, tuple) else out)

        return [m.register_forward_hook(keep) for layer in self.layers for m in layer.modules() if isinstance(m, cls)]

    def hf_name(self, name: str) -> str:
        """The unsplit model's name of this stage's parameter/buffer ``name``."""
        return hf_name(name, self.layer_range[0])

    def hf_named_parameters(self):
        """(unsplit-model name, parameter) for every parameter of this stage."""
        for name, p in self.named_parameters():
            yield self.hf_name(name), p

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's parameters and persistent buffers under the unsplit model's names."""
        return {self.hf_name(k): t for k, t in self.state_dict().items() if not k.startswith("rotary_emb.")}


def hf_name(name: str, first_layer: int) -> str:
    """The unsplit model's name of a stage's parameter/buffer ``name`` (as the Stage names
    it: ``layers.<local i>.``, ``embed_tokens.``, ``norm.``, ``lm_head.``), for a stage
    whose first decoder layer is ``first_layer``."""
    if name.startswith("layers."):
        i, rest = name[len("layers."):].split(".", 1)
        return f"model.layers.{int(i) + first_layer}.{rest}"
    if name.startswith(("embed_tokens.", "norm.")):
        return "model." + name
    return name


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                   num_items_in_batch: int | torch.Tensor | None = None) -> torch.Tensor:
    """Next-token cross entropy, as ``model(input_ids, labels=labels).loss`` computes it.

    logits [B, T, V], labels [B, T] (labels are shifted here: position t predicts
    labels[t+1]; ``ignore_index`` positions are skipped). Computed in fp32. Mean over
    the counted targets, or their sum divided by ``num_items_in_batch`` when given (use
    that to make micro-batch losses add up to the full-batch loss).
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(f"logits must be [B, T, V] and labels [B, T]; got {tuple(logits.shape)} "
                         f"and {tuple(labels.shape)}")
    shift = F.pad(labels, (0, 1), value=ignore_index)[:, 1:]
    flat = logits.float().reshape(-1, logits.shape[-1])
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(flat, shift.reshape(-1).to(flat.device), ignore_index=ignore_index,
                           reduction=reduction)
    if num_items_in_batch is not None:
        loss = loss / num_items_in_batch
    return loss


def split_model(model: nn.Module, num_stages: int,
                layers_per_stage: Sequence[int] | None = None) -> list[Stage]:
    """Split ``model`` (a causal LM of a family in ``supported_families()``) into ``num_stages`` stages.

    layers_per_stage: decoder layers per stage (positive ints summing to
    ``config.num_hidden_layers``); default ``balanced_layers``. Raises ValueError (one line)
    for a model that cannot be split exactly (``check_splittable``), more stages than
    layers, or a bad ``layers_per_stage``; all before touching the model.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "get_decoder"):
        raise ValueError(f"cannot split {type(model).__name__}: not a Hugging Face causal LM; supported "
                         f"families: {', '.join(supported_families())}")
    check_splittable(config)
    fam = family_of(config)
    if type(model).__name__ != fam.causal_lm:
        raise ValueError(f"cannot split {type(model).__name__}: the {fam.name} causal LM is {fam.causal_lm}")
    backbone, embed, head = _backbone(model)
    n = config.num_hidden_layers
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")
    if num_stages > n:
        raise ValueError(f"cannot split {n} decoder layers into {num_stages} stages: more stages than layers")
    if layers_per_stage is None:
        layers_per_stage = balanced_layers(n, num_stages)
    else:
        layers_per_stage = [int(k) for k in layers_per_stage]
        if len(layers_per_stage) != num_stages:
            raise ValueError(f"layers_per_stage has {len(layers_per_stage)} entries for {num_stages} stages")
        if any(k < 1 for k in layers_per_stage) or sum(layers_per_stage) != n:
            raise ValueError(f"layers_per_stage {layers_per_stage} must be positive and sum to the "
                             f"model's {n} decoder layers")
    tied = head.weight is embed.weight
    router = router_class(backbone)
    stages, lo = [], 0
    for i, k in enumerate(layers_per_stage):
        first, last = i == 0, i == num_stages - 1
        lm_head = None
        if last:
            lm_head = head
            if tied and not first:  # untie: a separate copy on the last stage (module doc)
                lm_head = copy.deepcopy(head)
                lm_head.weight = nn.Parameter(embed.weight.detach().clone(), requires_grad=embed.weight.requires_grad)
        stages.append(Stage(
            i, num_stages, config, list(backbone.layers[lo:lo + k]), (lo, lo + k),
            rotary_emb=copy.deepcopy(backbone.rotary_emb),
            embed_tokens=embed if first else None,
            norm=backbone.norm if last else None, lm_head=lm_head,
            tied_lm_head=tied and last and not first, family=fam, router=router))
        lo += k
    stages[0].tied_embed = tied and num_stages > 1
    return stages


def _backbone(model) -> tuple[nn.Module, nn.Module, nn.Module]:
    """(decoder, input embedding, output head) of a causal LM, found through transformers'
    accessors, checked to sit where the unsplit checkpoint names them (``model.embed_tokens``,
    ``model.layers``, ``model.norm``, ``lm_head``): stage parameter names, checkpoints and
    PEFT folders rely on those names."""
    decoder, embed, head = model.get_decoder(), model.get_input_embeddings(), model.get_output_embeddings()
    names = {id(m): n for n, m in model.named_modules()}
    want = {"model": decoder, "model.embed_tokens": embed, "lm_head": head,
            "model.layers": getattr(decoder, "layers", None), "model.norm": getattr(decoder, "norm", None),
            "model.rotary_emb": getattr(decoder, "rotary_emb", None)}
    off = [f"{k} (found {names.get(id(m), 'none')})" for k, m in want.items() if m is None or names.get(id(m)) != k]
    if off:
        raise ValueError(f"cannot split {type(model).__name__}: its backbone is not laid out as the splitter "
                         f"expects: {', '.join(off)}")
    return decoder, embed, head


def tied_weight_pairs(stages: Sequence[Stage]) -> list[tuple[int, str, int, str]]:
    """(stage, param name, stage, param name) pairs that are copies of one tied weight.

    Empty unless the embeddings were tied and split across stages; then
    [(0, "embed_tokens.weight", last, "lm_head.weight")]: sum these two gradients
    (e.g. an all-reduce between the two stage ranks) to train as the unsplit model does.
    """
    last = stages[-1]
    if last.tied_lm_head:
        return [(0, "embed_tokens.weight", last.index, "lm_head.weight")]
    return []


def run_stages(stages: Sequence[Stage], input_ids: torch.Tensor, position_ids=None,
               attention_mask=None, boundary=None) -> torch.Tensor:
    """Run all stages in one process (reference path and tests): logits [B, T, V].

    ``boundary(i, h) -> h`` if given is applied to the hidden state leaving stage i
    (e.g. a codec round trip), for an in-process reference of a compressed pipeline.
    """
    x = input_ids
    for i, st in enumerate(stages):
        x = st(x, position_ids=position_ids, attention_mask=attention_mask)
        if boundary is not None and i < len(stages) - 1:
            x = boundary(i, x)
    return x
