"""Which backend runs an op: loading the compiled extensions and choosing per call.

Backends, by name:
    "cpp"        C++/OpenMP kernels in meshkern._<group>_C (CPU tensors)
    "cuda"       CUDA kernels in the same extension (CUDA tensors; built only when
                 torch has CUDA and CUDA_HOME was set at install time)
    "triton"     Triton kernels in meshkern/triton_kernels/ (CUDA tensors; CPU tensors only
                 under TRITON_INTERPRET=1, which is how the CPU test suite runs them)
    "reference"  the pure-torch reference implementation: the spec, any device

Choice, first match wins: the op's ``backend=`` argument; the environment variable
``MESHKERN_BACKEND`` (one of the names above, or "auto"); else "auto", which picks
cpp for CPU tensors and cuda > triton for CUDA tensors, falling back to reference.
A forced backend that cannot run raises a RuntimeError that says why.

Extensions are loaded once, at first use. An extension that is missing or was built
against another torch version is skipped with one warning line naming the fallback.
"""
from __future__ import annotations

import importlib
import json
import os
import warnings
from functools import lru_cache

import torch

BACKENDS = ("cpp", "cuda", "triton", "reference")
GROUPS = {"mask": "_mask_C", "spectral": "_spectral_C", "dp": "_dp_C", "subspace": "_subspace_C", "pca": "_pca_C"}
ENV_VAR = "MESHKERN_BACKEND"

_problems: dict[str, str] = {}
_warned = False


def _build_info() -> dict | None:
    path = os.path.join(os.path.dirname(__file__), "_build_info.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


@lru_cache(maxsize=None)
def extension(group: str):
    """The loaded extension module of ``group`` ("mask", "spectral", "dp"), or None.

    Loading registers the group's ``torch.ops.meshkern_C.*`` kernels. Never raises:
    the reason an extension is unusable is recorded and reported in one warning line.
    """
    if group not in GROUPS:
        raise ValueError(f"unknown extension group {group!r}; known: {sorted(GROUPS)}")
    info = _build_info()
    if info is None:
        _problems[group] = "not built"
    elif info.get("torch") != torch.__version__:
        _problems[group] = f"built for torch {info.get('torch')}, running {torch.__version__}"
    else:
        try:
            return importlib.import_module(f"meshkern.{GROUPS[group]}")
        except ImportError as e:  # not built, or ABI mismatch
            _problems[group] = "not built" if isinstance(e, ModuleNotFoundError) else f"failed to load ({e})"
    _warn_once()
    return None


def _warn_once() -> None:
    global _warned
    if _warned or not _problems:
        return
    _warned = True
    what = ", ".join(f"meshkern.{GROUPS[g]} {why}" for g, why in sorted(_problems.items()))
    warnings.warn(f"meshkern: C++/CUDA extension unavailable ({what}); "
                  f"falling back to Triton/pure-torch reference kernels", RuntimeWarning, stacklevel=3)


def load_all() -> dict[str, bool]:
    """Try every extension group; return {group: loaded}."""
    return {g: extension(g) is not None for g in GROUPS}


@lru_cache(maxsize=None)
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
        return True
    except Exception:
        return False


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def has_cuda_kernels(group: str) -> bool:
    info = _build_info() or {}
    return group in info.get("cuda_groups", []) and extension(group) is not None


def why_unavailable(backend: str, group: str, device: torch.device) -> str | None:
    """None if ``backend`` can run group ``group`` on ``device``, else the reason."""
    if backend == "reference":
        return None
    if backend == "cpp":
        if device.type != "cpu":
            return f"the cpp backend runs CPU tensors, got a {device.type} tensor"
        if extension(group) is None:
            return f"meshkern.{GROUPS[group]} is unavailable ({_problems.get(group, 'not built')})"
        return None
    if backend == "cuda":
        if device.type != "cuda":
            return f"the cuda backend runs CUDA tensors, got a {device.type} tensor"
        if not has_cuda_kernels(group):
            return "meshkern was built without CUDA kernels (needs a CUDA torch and CUDA_HOME at install time)"
        return None
    if backend == "triton":
        if not triton_importable():
            return "triton is not installed"
        if device.type == "cpu" and not triton_interpreted():
            return "Triton runs CPU tensors only under TRITON_INTERPRET=1"
        if device.type not in ("cpu", "cuda"):
            return f"Triton does not run {device.type} tensors"
        return None
    raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS} or 'auto'")


def requested_name(requested: str | None, source: str = "backend=") -> str:
    """A backend name as given (``backend=`` argument or MESHKERN_BACKEND), normalized:
    "auto" for None / "" / "auto" (any case, spaces trimmed), else a name in BACKENDS.
    ValueError naming ``source`` for an unknown name. Availability is not checked."""
    name = (requested or "").strip().lower() or "auto"
    if name != "auto" and name not in BACKENDS:
        raise ValueError(f"unknown backend {requested!r} (from {source}); choose one of {BACKENDS} or 'auto'")
    return name


def resolve(group: str, device: torch.device, requested: str | None = None) -> str:
    """The backend that runs op group ``group`` for tensors on ``device``.

    ``requested`` (an op's ``backend=`` argument) overrides ``MESHKERN_BACKEND``;
    ``None`` or "auto" defers to it.
    Raises ValueError for an unknown name, RuntimeError for a forced backend that
    cannot run here.
    """
    name = requested_name(requested)
    if name == "auto":
        name = requested_name(os.environ.get(ENV_VAR), ENV_VAR)
    if name != "auto":
        why = why_unavailable(name, group, device)
        if why is not None:
            raise RuntimeError(f"backend {name!r} cannot run meshkern {group} ops here: {why}")
        return name
    order = ("cpp",) if device.type == "cpu" else ("cuda", "triton") if device.type == "cuda" else ()
    for candidate in order:
        if why_unavailable(candidate, group, device) is None:
            return candidate
    return "reference"
