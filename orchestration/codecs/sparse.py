"""Sparse codecs that send a subset of the hidden dims per token: ``mask`` (ours: the K
Philox-chosen dims, no index travels) and ``topk`` (the K largest-|h| dims + indices)."""
from __future__ import annotations

import torch

from meshkern._checks import boundary_shape
from orchestration.codecs.base import (BoundaryCodec, check_direction, check_p, kept_count, optional_width,
                                       validate_wire, width)


class MaskCodec(BoundaryCodec):
    """Ours: the K Philox-chosen dims per token travel, both ways (meshkern.pack/unpack)."""

    name = "mask"

    def __init__(self, p: float = 0.95, rescale: bool = False, backend: str = "auto"):
        self.p, self.rescale, self.backend = check_p(p), bool(rescale), backend

    def wire_specs(self, shape, dtype, direction):
        check_direction(direction)
        shape = boundary_shape(shape, dtype)
        return [(shape[:-1] + (kept_count(shape[-1], self.p),), dtype)]

    def encode_fwd(self, h, key):
        import meshkern
        v = meshkern.pack(h.detach(), key, self.p, rescale=False, backend=self.backend)
        return [v.contiguous()], (tuple(h.shape), h.dtype)

    def decode_fwd(self, wire, key, shape, dtype):
        import meshkern
        validate_wire(wire, self.wire_specs(shape, dtype, "fwd"), "mask decode_fwd")
        return meshkern.unpack(wire[0], key, shape[-1], self.p, rescale=self.rescale, backend=self.backend)

    def encode_bwd(self, grad, key, meta):
        # d unpack(v; rescale)/dv applied to grad is pack(grad; rescale): same dims, same scale.
        import meshkern
        return [meshkern.pack(grad.detach().contiguous(), key, self.p, rescale=self.rescale,
                              backend=self.backend).contiguous()]

    def decode_bwd(self, wire, key, ctx):
        # d pack(h)/dh applied to the packed gradient is unpack of it (zeros at dropped dims).
        import meshkern
        shape, dtype = ctx
        validate_wire(wire, self.wire_specs(shape, dtype, "bwd"), "mask decode_bwd")
        return meshkern.unpack(wire[0], key, shape[-1], self.p, rescale=False, backend=self.backend)


class TopKCodec(BoundaryCodec):
    """Top-k baseline: the K largest-magnitude dims per token, values and indices sent.

    Indices travel as int16 when H <= 32768, else int32. The backward sends the K
    gradient values at the receiver's indices only (the sender kept them in ctx).
    """

    name = "topk"

    def __init__(self, p: float = 0.95, k: int | None = None):
        self.p, self.k = check_p(p), optional_width("topk: k", k)

    def _k(self, H: int) -> int:
        return width("topk: k", self.k, H, lambda: kept_count(H, self.p))

    @staticmethod
    def index_dtype(H: int) -> torch.dtype:
        return torch.int16 if H <= 2 ** 15 else torch.int32

    def wire_specs(self, shape, dtype, direction):
        check_direction(direction)
        shape = boundary_shape(shape, dtype)
        kshape = shape[:-1] + (self._k(shape[-1]),)
        if direction == "fwd":
            return [(kshape, dtype), (kshape, self.index_dtype(shape[-1]))]
        return [(kshape, dtype)]

    def encode_fwd(self, h, key):
        H = h.shape[-1]
        h = h.detach()
        idx = h.abs().topk(self._k(H), dim=-1, sorted=False).indices
        idx = idx.sort(dim=-1).values  # ascending: deterministic wire layout
        vals = h.gather(-1, idx)
        return [vals.contiguous(), idx.to(self.index_dtype(H)).contiguous()], (tuple(h.shape), h.dtype, idx)

    def _indices(self, wire_idx: torch.Tensor, H: int) -> torch.Tensor:
        idx = wire_idx.long()
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= H):
            raise ValueError(f"topk: received indices outside [0, {H})")
        return idx

    def decode_fwd(self, wire, key, shape, dtype):
        validate_wire(wire, self.wire_specs(shape, dtype, "fwd"), "topk decode_fwd")
        idx = self._indices(wire[1], shape[-1])
        return torch.zeros(shape, dtype=dtype, device=wire[0].device).scatter_(-1, idx, wire[0])

    def encode_bwd(self, grad, key, meta):
        idx = self._indices(meta[1], grad.shape[-1])
        return [grad.detach().gather(-1, idx).contiguous()]

    def decode_bwd(self, wire, key, ctx):
        shape, dtype, idx = ctx
        validate_wire(wire, self.wire_specs(shape, dtype, "bwd"), "topk decode_bwd")
        return torch.zeros(shape, dtype=dtype, device=wire[0].device).scatter_(-1, idx, wire[0])

