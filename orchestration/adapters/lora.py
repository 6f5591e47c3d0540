"""LoRA on the model before it is split into stages, with peft's own layers.

Why before the split: every rank loads the whole model and seeds torch identically
(``builders.build_stage``), so injecting the adapters into the unsplit model gives every
stage, every replica and the anchor row the same initial A factors whatever the split,
and the stages share peft's ``lora.Linear`` modules with the model exactly as they share
the plain layers (orchestration.distributed.stages). peft freezes every base weight; the
adapters are cast to fp32 whatever ``--model.dtype`` the base is held in (peft's layers
cast their input to the adapter's dtype and the result back).

Names. A stage names an adapter weight ``layers.<local i>.self_attn.q_proj.lora_A.default.weight``;
``Stage.hf_name`` makes that the unsplit model's ``model.layers.<i>....lora_A.default.weight``
and ``peft_key`` the key PEFT's ``save_pretrained`` writes for the unsplit model
(``base_model.model.model.layers.<i>.self_attn.q_proj.lora_A.weight``), so the adapters of
all stages assemble into one standard PEFT folder (orchestration.components.checkpoint).
"""
from __future__ import annotations

import torch

ADAPTER_NAME = "default"  # peft's name of the one adapter we train
_PEFT_PREFIX = "base_model.model."  # what PeftModel.save_pretrained puts before the unsplit model's names


def lora_config(acfg, base_path: str = ""):
    """The ``peft.LoraConfig`` of the --adapter.* flags (``base_path``: the base model a
    PEFT folder names in ``base_model_name_or_path``)."""
    from peft import LoraConfig

    return LoraConfig(r=int(acfg.rank), lora_alpha=float(acfg.alpha), lora_dropout=float(acfg.dropout),
                      target_modules=acfg.target_list(), bias="none", task_type="CAUSAL_LM",
                      base_model_name_or_path=base_path or None)


def layer_linear_names(hf_config) -> list[str]:
    """Names of the linear layers of the decoder layers of the model ``hf_config`` describes
    (q_proj, ..., down_proj for Llama; qkv_proj, o_proj, gate_up_proj, down_proj for Phi-3),
    over all layers (a Qwen3-MoE's dense layers have an MLP the sparse ones lack), read from a
    copy built on the meta device: no weights are allocated, so an 8B config costs nothing."""
    return _meta_model_layers(hf_config)[1]


def _meta_model_layers(hf_config) -> tuple[str, list[str]]:
    """(architecture, linear layer names of the decoder layers) of a meta-device copy."""
    from orchestration.models.loading import meta_model

    model = meta_model(hf_config)
    return type(model).__name__, sorted({n.rsplit(".", 1)[-1] for layer in model.get_decoder().layers
                                         for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)})


def _flag_default_targets() -> str:
    from orchestration.config.job_config import AdapterConfig

    return AdapterConfig.targets


def resolve_targets(acfg, hf_config) -> list[str]:
    """The targets a run adapts: --adapter.targets as given, or, when the flag keeps its
    default, the model family's default targets (orchestration.models.families: Phi-3's
    fused qkv_proj / gate_up_proj, the attention projections of MoE families whose experts
    are fused 3-D parameters, not linear layers). Writes them into ``acfg.targets`` so every
    later reader (apply_lora, the PEFT config, the memory table, the resume check) sees one
    list; returns it."""
    from orchestration.models.families import default_targets

    if acfg.targets == _flag_default_targets():
        acfg.targets = ",".join(default_targets(hf_config))
    return acfg.target_list()


def check_targets(acfg, hf_config) -> None:
    """ValueError (one line) if --adapter.targets names a layer the model's decoder layers
    do not have. Every stage holds whole decoder layers, so a target the layers have is on
    every stage. Resolves the family's default targets first (``resolve_targets``)."""
    resolve_targets(acfg, hf_config)
    arch, known = _meta_model_layers(hf_config)
    unknown = [t for t in acfg.target_list() if t not in known]
    if unknown:
        raise ValueError(f"--adapter.targets: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not a linear "
                         f"layer of {arch}'s decoder layers; they have {', '.join(known)}")


def apply_lora(model: torch.nn.Module, acfg) -> torch.nn.Module:
    """Injects LoRA adapters (peft) into ``model`` in place and returns it: base weights
    frozen, adapter weights fp32 and trainable. Seed torch first (the A factors are random,
    the B factors zero, so the adapted model starts as the base model)."""
    from peft import inject_adapter_in_model

    model = inject_adapter_in_model(lora_config(acfg), model, adapter_name=ADAPTER_NAME)
    n = 0
    for name, p in model.named_parameters():
        if _is_adapter(name):
            p.data = p.data.float()
            p.requires_grad_(True)
            n += 1
        else:
            p.requires_grad_(False)
    if n == 0:  # check_targets ran before: this is a peft/transformers mismatch, not a user error
        raise RuntimeError(f"peft injected no adapter for targets {acfg.targets!r}")
    return model


def _is_adapter(name: str) -> bool:
    return f".{ADAPTER_NAME}." in name and (".lora_A." in name or ".lora_B." in name)


def peft_key(hf_name: str) -> str:
    """The PEFT-folder key of an adapter weight named ``hf_name`` in the unsplit model
    (``model.layers.3.mlp.up_proj.lora_B.default.weight`` ->
    ``base_model.model.model.layers.3.mlp.up_proj.lora_B.weight``)."""
    return _PEFT_PREFIX + hf_name.replace(f".{ADAPTER_NAME}.", ".")


def trainable_summary(stage) -> dict:
    """Trainable and total parameter counts of ``stage`` (tied copies counted once)."""
    seen, total, trainable = set(), 0, 0
    for p in stage.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return {"trainable": trainable, "total": total}


def peft_config_dict(acfg, base_path: str) -> dict:
    """adapter_config.json of a PEFT folder for the --adapter.* flags and base model
    ``base_path`` (what ``LoraConfig.save_pretrained`` writes; sets as sorted lists)."""
    d = lora_config(acfg, base_path).to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in d.items()}


class AdapterState:
    """The checkpoint part of a LoRA stage: its adapter weights only (what trains), by the
    stage's own parameter names. ``load_state_dict`` refuses a state whose names differ
    (another rank, target set or split) rather than load part of it. ``tensors()`` and
    ``peft_config`` are what the checkpoint's PEFT folder is assembled from
    (orchestration.components.checkpoint)."""

    def __init__(self, stage, acfg, base_path: str):
        self.stage = stage
        self.params = {n: p for n, p in stage.named_parameters() if p.requires_grad}
        self.peft_config = peft_config_dict(acfg, base_path)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The adapters under their PEFT-folder keys (detached CPU copies)."""
        return {peft_key(self.stage.hf_name(n)): p.detach().cpu().contiguous().clone() for n, p in self.params.items()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.params.items()}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != set(self.params):
            missing, extra = sorted(set(self.params) - set(state)), sorted(set(state) - set(self.params))
            raise ValueError(f"adapter checkpoint does not match this stage's adapters (missing {missing[:3]}, "
                             f"unexpected {extra[:3]}): resume with the run's own --adapter.* flags")
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(state[n])
