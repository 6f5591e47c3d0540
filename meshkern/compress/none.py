"""NoCompression: the exact average (one all_reduce per dtype), the reference point."""
from __future__ import annotations

import torch

from meshkern.compress.base import Compressor, flatten, unflatten


class NoCompression(Compressor):
    """Exact mean over the group: tensors of one dtype travel as one flat SUM all-reduce
    in their own dtype, then are divided by the world size. Stateless."""

    def _all_reduce_mean(self, tensors, group, world, key):
        out: list[torch.Tensor | None] = [None] * len(tensors)
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            idx = [i for i, t in enumerate(tensors) if t.dtype == dtype]
            flat = self._all_reduce(flatten([tensors[i] for i in idx]), group, f"all_reduce ({dtype})")
            flat.div_(world)
            for i, t in zip(idx, unflatten(flat, [tensors[i] for i in idx])):
                out[i] = t
        return out

    def payload_bytes_for(self, shapes, dtype=torch.float32):
        return sum(int(torch.Size(s).numel()) for s in shapes) * dtype.itemsize
