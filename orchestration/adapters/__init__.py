"""Adapters instead of full fine-tuning: LoRA on every pipeline stage, built with peft
(``lora``), and the standard PEFT folder (and a merged model) assembled from all stages
(``export``; ``python -m orchestration.adapters.export CHECKPOINT``)."""
from orchestration.adapters.lora import (ADAPTER_NAME, AdapterState, adapter_tensors, apply_lora, check_targets,
                                         layer_linear_names, lora_config, peft_config_dict, peft_key,
                                         trainable_summary)

__all__ = ["ADAPTER_NAME", "AdapterState", "adapter_tensors", "apply_lora", "check_targets", "layer_linear_names",
           "lora_config", "peft_config_dict", "peft_key", "trainable_summary"]
