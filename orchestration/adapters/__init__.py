"""Adapters instead of full fine-tuning: LoRA on every pipeline stage, built with peft
(``lora``). The checkpoints assemble all stages' adapters into one PEFT folder
(orchestration.components.checkpoint); ``python -m orchestration.export`` writes it, or the
merged model, from any checkpoint."""
from orchestration.adapters.lora import (ADAPTER_NAME, AdapterState, apply_lora, check_targets,
                                         layer_linear_names, lora_config, peft_config_dict, peft_key, resolve_targets,
                                         trainable_summary)

__all__ = ["ADAPTER_NAME", "AdapterState", "apply_lora", "check_targets", "layer_linear_names",
           "lora_config", "peft_config_dict", "peft_key", "resolve_targets", "trainable_summary"]
