"""Models: the default small Llama and loading any local HF checkpoint.

- :func:`default_config` is the small Llama the embedded default uses. Sizes were
  chosen by timing forward+backward+AdamW on 2 CPU cores (see ``pretrain.py``): hidden
  192 / 4 layers / 6 heads / vocab 2048 runs ~6-8k tokens/s, so the default pretraining
  (0.82M tokens, ~205 CPU-seconds) takes about 2 minutes and a 3x2 mesh of one-thread
  processes still trains in minutes (hidden 256 was ~2-3x slower per token). Embeddings are untied so the first and last pipeline stages own
  disjoint parameters.
- :func:`load_causal_lm` loads a local checkpoint (never the hub).
- What ``--model`` means (the cached default base model, built-in names, ``.gguf``
  files) is orchestration.models.paths (``default_base_model``, ``resolve_model``).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local checkpoints only, never the hub

# Bump when the default model, tokenizer or pretraining recipe changes: the cache keeps
# one directory per version, so an old base model is never silently reused.
BASE_MODEL_VERSION = "base-v1"
CACHE_ENV = "MESHKERN_CACHE"
METADATA_FILE = "meshkern_pretrain.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def default_config(vocab_size: int = 2048, **overrides):
    """The default small ``LlamaConfig`` (about 2.6M parameters at vocab 2048)."""
    from transformers import LlamaConfig

    kw = dict(vocab_size=vocab_size, hidden_size=192, intermediate_size=512,
              num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=6,
              max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False,
              bos_token_id=0, eos_token_id=0, pad_token_id=0)
    kw.update(overrides)
    return LlamaConfig(**kw)


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir``, else ``$MESHKERN_CACHE``, else ``~/.cache/meshkern``."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "meshkern"


def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    """True if ``path`` holds a config, safetensors weights and a tokenizer."""
    p = Path(path)
    return ((p / "config.json").is_file() and any(p.glob("*.safetensors"))
            and (p / "tokenizer.json").is_file())


def load_causal_lm(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32, base: str | None = None,
                   boundary: bool = True):
    """Load a local Hugging Face causal LM: returns ``(model, tokenizer_path)``.

    ``model`` is in eval mode on CPU in ``dtype``. ``tokenizer_path`` is ``str(path)``
    if the directory holds tokenizer files, else None (then pass a tokenizer yourself).
    Raises FileNotFoundError for a missing path or config.json, ValueError for an
    architecture transformers cannot build as a causal LM. Only local files are read.
    A PEFT adapter folder (a LoRA run's checkpoint or export) loads as its base model with
    the adapters merged in (``load_adapter_folder``; ``base`` replaces the base it names).
    ``boundary``: a folder with a boundary transform record (meshkern_boundary.json, written
    for a model trained through a codec with a sink row) loads with that transform on its
    boundary layers, as it is meant to be deployed (orchestration.models.boundary_transform);
    False: the plain model (what training, calibration and the diagnostics load).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model path {str(p)!r} does not exist")
    if is_adapter_folder(p):
        return load_adapter_folder(p, dtype=dtype, base=base, boundary=boundary)
    if not p.is_dir() or not (p / "config.json").is_file():
        raise FileNotFoundError(f"{str(p)!r} is not a Hugging Face checkpoint directory "
                                "(no config.json)")
    try:
        config = AutoConfig.from_pretrained(str(p), local_files_only=True)
    except (ValueError, KeyError) as e:
        raise ValueError(f"{p}: unknown model architecture in config.json ({e})") from None
    try:
        model = AutoModelForCausalLM.from_pretrained(str(p), config=config, dtype=dtype,
                                                     local_files_only=True)
    except ValueError as e:
        raise ValueError(f"{p}: model type {getattr(config, 'model_type', '?')!r} is not "
                         f"a causal LM transformers can build ({e})") from None
    except OSError as e:  # e.g. config.json but no *.safetensors / *.bin weights
        raise FileNotFoundError(f"{p}: cannot load the model weights ({str(e).splitlines()[0][:200]})") from None
    model.eval()
    if boundary:
        from orchestration.models import boundary_transform

        boundary_transform.apply_from(model, p)
    has_tok = any((p / f).is_file() for f in _TOKENIZER_FILES)
    return model, (str(p) if has_tok else None)


def meta_model(hf_config):
    """The causal LM ``hf_config`` describes, built on the meta device: its modules and
    parameter shapes without any memory, so an 8B config costs nothing (LoRA target checks,
    the per-stage memory table)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config)


def read_metadata(path: str | os.PathLike) -> dict:
    """The pretraining record written next to a base model (empty if none)."""
    f = Path(path) / METADATA_FILE
    return json.loads(f.read_text()) if f.is_file() else {}


def is_adapter_folder(path: str | os.PathLike) -> bool:
    """True if ``path`` is a PEFT adapter folder (adapter_config.json + adapter weights)."""
    p = Path(path)
    return (p / "adapter_config.json").is_file() and (p / "adapter_model.safetensors").is_file()


def load_adapter_folder(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32, base: str | None = None,
                        boundary: bool = True):
    """``(model, tokenizer_path)`` of PEFT folder ``path``: its base model (``base``, else the
    folder's ``base_model_name_or_path``) in ``dtype`` with the adapters merged into the
    weights (peft's ``merge_and_unload``), so the result is a plain HF model that scores,
    generates and saves like any other. FileNotFoundError names a base that is not on disk.
    ``boundary``: the adapter folder's boundary transform record, if any, is installed on the
    merged model (the base's own record is not: the adapters were trained on the plain base)."""
    from peft import PeftModel

    p = Path(path)
    base = base or json.loads((p / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base or not Path(base).is_dir():
        raise FileNotFoundError(f"adapter folder {str(p)!r} names base model {base!r}, which is not a local directory; "
                                "give the base model's path (--model.path / --base)")
    model, tok = load_causal_lm(base, dtype=dtype, boundary=False)
    model = PeftModel.from_pretrained(model, str(p), is_trainable=False).merge_and_unload()
    model.eval()
    if boundary:
        from orchestration.models import boundary_transform

        boundary_transform.apply_from(model, p)
    return model, tok
