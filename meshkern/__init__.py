"""meshkern: kernels for LLM adaptation over low-bandwidth GPU meshes.

Every op is a torch custom op (``torch.ops.meshkern.*``) with a pure-torch reference
that defines it; they work with autograd where stated and trace under
``torch.compile(fullgraph=True)``.

Public modules (``import meshkern`` loads only the mask ops; the others are imported on
first attribute access, e.g. ``meshkern.spectral``, or with ``import meshkern.spectral``):

- ``meshkern.mask`` (also re-exported here): masked stage boundaries.
    ``MaskKey(seed, boundary, step, microbatch)``, ``kept_dims(H, p)``,
    ``mask_indices(key, T, H, p)``, ``pack(h, key, p)`` [..., H] -> [..., K],
    ``unpack(v, key, H, p)`` [..., K] -> [..., H]. The spec: ``meshkern.reference_mask``.
- ``meshkern.spectral``: spectral correction.
    ``sym_eig(A)`` (batched symmetric eigen), ``randomized_svd(M, rank)`` (batched
    truncated SVD), ``project(G, U, S, V, tau, alpha)`` (two-sided Tikhonov filter),
    ``gains(S, tau)``, references ``sym_eig_reference`` / ``project_reference``.
- ``meshkern.optim``: ``SpectralAdamW`` (AdamW on anchor-filtered gradients),
  ``AnchorMomentum``, ``spectral_param_groups(model)``.
- ``meshkern.compress``: data-parallel compressors ``PowerSGD``, ``SparseLoCo``,
  ``Int8``, ``NoCompression`` (``all_reduce_mean``), ``SyncError``.
- ``meshkern.diloco``: ``StreamingDiLoCo`` (the outer, slow-sync loop).

Backends: every op takes ``backend="auto"`` (or None) | "cpp" | "cuda" | "triton" |
"reference"; the environment variable ``MESHKERN_BACKEND`` sets the default (details in
``meshkern._backend``). ``meshkern.resolve_backend(group, device)`` says which one "auto"
picks; ``meshkern.BACKENDS`` lists the names.
"""
import importlib as _importlib

__version__ = "0.1.0"

from meshkern._backend import BACKENDS, resolve as resolve_backend  # noqa: E402
from meshkern import mask  # noqa: E402
from meshkern.mask import MaskKey, kept_dims, mask_indices, pack, unpack  # noqa: E402

# Imported on first access (module __getattr__, PEP 562): spectral/optim/compress/diloco
# pull in more code (and compress/diloco torch.distributed), which `import meshkern` and
# the mask ops alone do not need.
_LAZY_MODULES = ("spectral", "optim", "compress", "diloco", "reference_mask")

__all__ = ["__version__", "BACKENDS", "resolve_backend", "MaskKey", "kept_dims", "mask_indices", "pack", "unpack",
           "mask", "spectral", "optim", "compress", "diloco"]


def __getattr__(name: str):
    if name in _LAZY_MODULES:
        module = _importlib.import_module(f"meshkern.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'meshkern' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY_MODULES))
