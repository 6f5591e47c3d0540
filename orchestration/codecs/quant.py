"""Symmetric absmax integer quantization (``int8`` / ``int4``), per token or per group;
also the quantizer the pca codec uses for its coordinates."""
from __future__ import annotations

import torch

from meshkern._checks import boundary_shape
from orchestration.codecs.base import BoundaryCodec, check_direction, validate_wire


class QuantCodec(BoundaryCodec):
    """Symmetric absmax integer quantization (int8: levels -127..127; int4: -7..7).

    Scales (float32) per token, or per ``group_size`` consecutive dims (must divide H).
    Round to nearest, so every element's error is at most scale/2 = absmax/(2*qmax).
    int4 packs two values per byte (low nibble = even dim), H padded to even.
    Backward: straight-through estimator, the gradient quantized the same way.
    """

    def __init__(self, bits: int, group_size: int | None = None):
        if bits not in (4, 8):
            raise ValueError(f"quantization bits must be 4 or 8, got {bits}")
        if group_size is not None and int(group_size) < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.bits, self.group_size = bits, (None if group_size is None else int(group_size))
        self.qmax = 127 if bits == 8 else 7
        self.name = f"int{bits}"

    def _groups(self, H: int) -> int:
        g = self.group_size or H
        if H % g:
            raise ValueError(f"{self.name}: group_size={g} does not divide H={H}")
        return H // g

    def wire_specs(self, shape, dtype, direction):
        check_direction(direction)
        shape = boundary_shape(shape, dtype)
        H = shape[-1]
        qshape = shape if self.bits == 8 else shape[:-1] + ((H + 1) // 2,)
        return [(qshape, torch.int8 if self.bits == 8 else torch.uint8),
                (shape[:-1] + (self._groups(H),), torch.float32)]

    def quantize(self, x: torch.Tensor) -> list[torch.Tensor]:
        H = x.shape[-1]
        G = self._groups(H)
        xg = x.detach().float().reshape(*x.shape[:-1], G, H // G)
        scale = xg.abs().amax(dim=-1) / self.qmax
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero group: q = 0
        q = torch.round(xg / scale.unsqueeze(-1)).clamp_(-self.qmax, self.qmax).reshape(x.shape)
        if self.bits == 8:
            return [q.to(torch.int8).contiguous(), scale.contiguous()]
        u = (q + 8).to(torch.uint8)  # nibbles 1..15
        if H % 2:
            u = torch.nn.functional.pad(u, (0, 1), value=8)
        return [(u[..., 0::2] | (u[..., 1::2] << 4)).contiguous(), scale.contiguous()]

    def dequantize(self, wire, shape, dtype) -> torch.Tensor:
        q, scale = wire
        H = shape[-1]
        if self.bits == 8:
            qf = q.float()
        else:
            qf = torch.stack((q & 0xF, q >> 4), dim=-1).reshape(*q.shape[:-1], -1)[..., :H].float() - 8
        if not torch.isfinite(scale).all() or (scale <= 0).any():
            raise ValueError(f"{self.name}: received non-finite or non-positive scales")
        G = scale.shape[-1]
        out = qf.reshape(*shape[:-1], G, H // G) * scale.unsqueeze(-1)
        return out.reshape(shape).to(dtype)

    def encode_fwd(self, h, key):
        return self.quantize(h), (tuple(h.shape), h.dtype)

    def decode_fwd(self, wire, key, shape, dtype):
        validate_wire(wire, self.wire_specs(shape, dtype, "fwd"), f"{self.name} decode_fwd")
        return self.dequantize(wire, tuple(shape), dtype)

    def encode_bwd(self, grad, key, meta):
        return self.quantize(grad)

    def decode_bwd(self, wire, key, ctx):
        shape, dtype = ctx
        validate_wire(wire, self.wire_specs(shape, dtype, "bwd"), f"{self.name} decode_bwd")
        return self.dequantize(wire, shape, dtype)

