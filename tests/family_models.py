"""Tiny random models of every family the stage splitter takes, built offline (the
transformers classes themselves, random weights): the references the family tests compare
the split against."""
import torch
import transformers

# Small enough for a CPU test, big enough for grouped-query attention (4 query heads, 2 kv)
# and a sliding window (4) shorter than the test sequences.
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=96, max_position_embeddings=64,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
ALT = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]

# model_type -> (config class, what makes the family's differences matter at this size)
SPECS = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", dict(sliding_window=4)),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=4, max_window_layers=2)),
    "qwen3": ("Qwen3Config", {}),
    # Gemma: sqrt(H) embedding scale, pre/post norms, local/global layers, logit soft-capping
    "gemma2": ("Gemma2Config", dict(head_dim=8, sliding_window=4, query_pre_attn_scalar=8, layer_types=ALT,
                                    final_logit_softcapping=3.0, attn_logit_softcapping=5.0)),
    # Gemma 3: local layers have their own rope base (10k vs 1M on global layers)
    "gemma3_text": ("Gemma3TextConfig", dict(head_dim=8, sliding_window=4, query_pre_attn_scalar=8,
                                             layer_types=ALT, final_logit_softcapping=3.0)),
    "phi3": ("Phi3Config", dict(sliding_window=4)),  # fused qkv / gate_up projections
    "olmo2": ("Olmo2Config", {}),  # post-norms, QK-norm
    "granite": ("GraniteConfig", dict(embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.22,
                                      attention_multiplier=0.5)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                         shared_expert_intermediate_size=32)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)),
}
FAMILIES = list(SPECS)
MOE = ["mixtral", "qwen2_moe", "qwen3_moe"]


def tiny_config(family: str, tied: bool = False, **extra):
    cls, kw = SPECS[family]
    cfg = getattr(transformers, cls)(**{**TINY, **kw, **extra}, tie_word_embeddings=tied)
    cfg.architectures = [transformers.AutoModelForCausalLM._model_mapping[type(cfg)].__name__]
    return cfg


def tiny_model(family: str, tied: bool = False, dtype=torch.float32, **extra):
    """A seeded tiny causal LM of ``family`` in eval mode (dropout off)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family, tied, **extra), dtype=dtype)
    with torch.no_grad():  # norms start at exactly 1 (or 0 for Gemma's 1 + w): perturb them so they matter
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()
