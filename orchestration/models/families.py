"""The model families the stage splitter knows, and what differs between them.

The splitter (orchestration.distributed.stages) finds a causal LM's backbone through
transformers' own conventions: ``get_input_embeddings``, the decoder's ``layers``, its final
``norm``, its ``rotary_emb`` and ``get_output_embeddings``. Everything a family's unsplit
forward does *outside* its decoder layers is what a stage must redo on its own, and that
is listed here per family, explicitly, rather than guessed: a family missing from
``FAMILIES`` is refused (a forward that, say, scales its embeddings in code we did not
read would split silently wrong). Adding one means reading its ``modeling_*.py`` forward,
filling in a ``Family`` and adding it to tests/test_model_families.py, which checks the
split against the unsplit model bit for bit.

What each field means (all read from transformers 5.x modeling code):

- ``mask``: which attention mask each layer gets. "causal": always the causal mask
  (Llama, OLMo 2, Granite); "window": the sliding-window mask for every layer when
  ``config.sliding_window`` is set, else causal (Mistral, Phi-3, Mixtral, Qwen3-MoE);
  "layer_types": per layer from ``config.layer_types`` (Qwen2/3, Qwen2-MoE, Gemma 2/3).
  Gemma's sqrt(H) embedding scale lives in its embedding module
  (``Gemma*TextScaledWordEmbedding``), so calling the module does it; Gemma 3's rotary
  module takes the layer type (local layers use their own rope base), which the stage
  detects from the module's signature.
- ``embedding_multiplier``: a config attribute the forward multiplies the embeddings by
  (Granite).
- ``logits``: what the causal LM does to ``lm_head``'s output: "softcap" (Gemma 2/3:
  ``tanh(x / c) * c`` with ``config.final_logit_softcapping``, when set) or "granite"
  (``x / config.logits_scaling``).
- ``experts``: the config attribute holding the number of experts of an MoE family (its
  router's load-balancing loss is added when ``config.output_router_logits`` is on).
- ``targets``: the default LoRA targets: linear layers every decoder layer of the family
  has. MoE experts are fused 3-D parameters in transformers 5.x (not ``nn.Linear``),
  so MoE families adapt the attention projections.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
ATTN_MLP = ATTN + ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Family:
    name: str                     # what users read (--help, README)
    model_type: str               # config.model_type
    causal_lm: str                # the transformers class the splitter takes
    mask: str = "causal"          # "causal" | "window" | "layer_types" (module doc)
    embedding_multiplier: str | None = None
    logits: str | None = None     # None | "softcap" | "granite"
    experts: str | None = None    # MoE: config attribute with the number of experts
    targets: tuple[str, ...] = ATTN_MLP


FAMILIES = {f.model_type: f for f in (
    Family("Llama", "llama", "LlamaForCausalLM"),
    Family("Mistral", "mistral", "MistralForCausalLM", mask="window"),
    Family("Qwen2", "qwen2", "Qwen2ForCausalLM", mask="layer_types"),
    Family("Qwen3", "qwen3", "Qwen3ForCausalLM", mask="layer_types"),
    Family("Gemma 2", "gemma2", "Gemma2ForCausalLM", mask="layer_types", logits="softcap"),
    Family("Gemma 3 (text)", "gemma3_text", "Gemma3ForCausalLM", mask="layer_types", logits="softcap"),
    Family("Phi-3/Phi-4", "phi3", "Phi3ForCausalLM", mask="window",
           targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
    Family("OLMo 2", "olmo2", "Olmo2ForCausalLM"),
    Family("Granite", "granite", "GraniteForCausalLM", embedding_multiplier="embedding_multiplier",
           logits="granite"),
    Family("Mixtral", "mixtral", "MixtralForCausalLM", mask="window", experts="num_local_experts", targets=ATTN),
    Family("Qwen2-MoE", "qwen2_moe", "Qwen2MoeForCausalLM", mask="layer_types", experts="num_experts",
           targets=ATTN),
    Family("Qwen3-MoE", "qwen3_moe", "Qwen3MoeForCausalLM", mask="window", experts="num_experts", targets=ATTN),
)}


def supported_families() -> list[str]:
    """The families the splitter takes, as users name them (--help and the README)."""
    return [f.name for f in FAMILIES.values()]


def supported_architectures() -> tuple[str, ...]:
    """The transformers causal-LM classes the splitter takes."""
    return tuple(f.causal_lm for f in FAMILIES.values())


def _families_line() -> str:
    return ", ".join(supported_families())


def check_splittable(hf_config) -> str:
    """The family name of the model ``hf_config`` describes, or ValueError with one line
    saying why it cannot be split into pipeline stages exactly."""
    mtype = getattr(hf_config, "model_type", None) or "?"
    archs = list(getattr(hf_config, "architectures", None) or [])
    if getattr(hf_config, "is_encoder_decoder", False):
        raise ValueError(f"model type {mtype!r} is an encoder-decoder model: every decoder layer attends to the "
                         "encoder's output, state other than the hidden state that would have to cross each stage "
                         "boundary; only decoder-only causal LMs split")
    if getattr(hf_config, "vision_config", None) is not None or any(
            k in hf_config.to_dict() for k in ("vision_config", "audio_config")):
        text = " (its text model, e.g. Gemma3ForCausalLM on the text config, does split)" if mtype == "gemma3" else ""
        raise ValueError(f"model type {mtype!r} has a vision/audio tower whose features enter the decoder beside "
                         f"the hidden state; only text-only causal LMs split{text}")
    fam = FAMILIES.get(mtype)
    if fam is None:
        raise ValueError(f"model type {mtype!r} is not a family the stage splitter has been checked on (its "
                         f"forward outside the decoder layers must be known to split it exactly); supported: "
                         f"{_families_line()}")
    wrong = [a for a in archs if a != fam.causal_lm]
    if wrong:  # e.g. a sequence-classification head on a supported backbone
        raise ValueError(f"architecture {wrong[0]} is not a causal LM the splitter takes; for {fam.name} it "
                         f"takes {fam.causal_lm}")
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise ValueError(f"{fam.name} with use_bidirectional_attention is an encoder (every token sees the "
                         "whole sequence), not a causal LM")
    return fam.name


def family_of(config) -> Family:
    """The Family of a model config (ValueError as ``check_splittable``)."""
    check_splittable(config)
    return FAMILIES[config.model_type]


def layer_attention_types(config, fam: Family) -> list[str]:
    """The attention kind of every decoder layer, as the family's unsplit forward picks it."""
    n = config.num_hidden_layers
    if fam.mask == "layer_types":
        return list(config.layer_types)[:n]
    if fam.mask == "window" and getattr(config, "sliding_window", None) is not None:
        return ["sliding_attention"] * n
    return ["full_attention"] * n


def scale_embeddings(fam: Family, config, hidden: torch.Tensor) -> torch.Tensor:
    """What the family's backbone does to the embedding module's output."""
    if fam.embedding_multiplier:
        hidden = hidden * getattr(config, fam.embedding_multiplier)
    return hidden


def finalize_logits(fam: Family, config, logits: torch.Tensor) -> torch.Tensor:
    """What the family's causal LM does to ``lm_head``'s output (same ops, same order)."""
    if fam.logits == "softcap" and getattr(config, "final_logit_softcapping", None) is not None:
        cap = config.final_logit_softcapping
        logits = logits / cap
        logits = torch.tanh(logits)
        logits = logits * cap
    elif fam.logits == "granite":
        logits = logits / config.logits_scaling
    return logits


def default_targets(config) -> list[str]:
    """The default LoRA targets of the family ``config`` describes."""
    return list(family_of(config).targets)


def uses_router_loss(config) -> bool:
    """True when the unsplit model adds its router's load-balancing loss to the loss: an MoE
    family whose config turns ``output_router_logits`` on."""
    return bool(family_of(config).experts) and bool(getattr(config, "output_router_logits", False))


def active_intermediate(config) -> int:
    """The MLP width one token computes through per layer: ``intermediate_size`` for a dense
    family; for MoE the top-k experts' widths plus a shared expert's, if any (all experts are
    held, only these compute)."""
    fam = family_of(config)
    if not fam.experts:
        return config.intermediate_size
    width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
    return config.num_experts_per_tok * width + shared

