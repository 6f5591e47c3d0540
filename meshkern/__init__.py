"""meshkern: kernels for LLM adaptation over low-bandwidth GPU meshes.

Public pieces (each a torch op with a pure-torch reference that defines it):
- masked stage boundaries: Philox mask indices, fused pack / unpack
- spectral correction: batched truncated SVD, two-sided Tikhonov projection,
  ``meshkern.optim.SpectralAdamW``
- data-parallel compression: PowerSGD, SparseLoCo, Streaming DiLoCo

Backend choice (C++, CUDA, Triton, reference) is described in ``meshkern._backend``.
"""
__version__ = "0.1.0"

from meshkern._backend import BACKENDS, resolve as resolve_backend  # noqa: F401
from meshkern.mask import MaskKey, kept_dims, mask_indices, pack, unpack  # noqa: F401,E402
