"""``bottleneck``: a fixed, seeded orthonormal subspace per boundary (r coordinates per
token each way)."""
from __future__ import annotations

from functools import lru_cache

import torch

from meshkern._checks import boundary_shape
from orchestration.codecs.base import (BoundaryCodec, check_direction, check_p, kept_count, optional_width, validate_wire,
                                       width)


@lru_cache(maxsize=64)
def _basis(seed: int, boundary: int, H: int, r: int) -> torch.Tensor:
    """[H, r] float64 with orthonormal columns, a pure function of (seed, boundary, H, r)."""
    g = torch.Generator().manual_seed((int(seed) * 1_000_003 + int(boundary)) % (2 ** 63))
    q, rr = torch.linalg.qr(torch.randn(H, r, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(rr)).unsqueeze(0)  # unique QR: sign-fix columns


class BottleneckCodec(BoundaryCodec):
    """Fixed seeded subspace projection: r = round((1-p)H) coordinates per token each way."""

    name = "bottleneck"

    def __init__(self, p: float = 0.95, rank: int | None = None):
        self.p, self.rank = check_p(p), optional_width("bottleneck: rank", rank)

    def _r(self, H: int) -> int:
        return width("bottleneck: rank", self.rank, H, lambda: kept_count(H, self.p))

    def basis(self, key, H: int, dtype: torch.dtype, device) -> torch.Tensor:
        """The boundary's fixed basis P [H, r] (orthonormal columns) in ``dtype``."""
        if key is None:
            raise ValueError("bottleneck needs a key (its seed and boundary choose the subspace)")
        return _basis(key.seed, key.boundary, H, self._r(H)).to(device=device, dtype=dtype)

    def wire_specs(self, shape, dtype, direction):
        check_direction(direction)
        shape = boundary_shape(shape, dtype)
        return [(shape[:-1] + (self._r(shape[-1]),), dtype)]

    def encode_fwd(self, h, key):
        P = self.basis(key, h.shape[-1], h.dtype, h.device)
        return [(h.detach() @ P).contiguous()], (tuple(h.shape), h.dtype)

    def decode_fwd(self, wire, key, shape, dtype):
        validate_wire(wire, self.wire_specs(shape, dtype, "fwd"), "bottleneck decode_fwd")
        return wire[0] @ self.basis(key, shape[-1], dtype, wire[0].device).T

    def encode_bwd(self, grad, key, meta):
        return [(grad.detach() @ self.basis(key, grad.shape[-1], grad.dtype, grad.device)).contiguous()]

    def decode_bwd(self, wire, key, ctx):
        shape, dtype = ctx
        validate_wire(wire, self.wire_specs(shape, dtype, "bwd"), "bottleneck decode_bwd")
        return wire[0] @ self.basis(key, shape[-1], dtype, wire[0].device).T

