"""Low-bit building blocks shared by the aqsgd and tahquant codecs: a bit packer for any
width 1..8, per-token symmetric absmax quantization at 2..8 bits, and ``GradWire`` (the
gradient's trip back: quantized per token, or a bf16 cast)."""
from __future__ import annotations

import torch

from orchestration.codecs.base import validate_wire


def packed_bytes(n: int, bits: int) -> int:
    """Bytes that ``n`` values of ``bits`` bits take packed: ceil(n * bits / 8)."""
    return -(-int(n) * int(bits) // 8)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes [..., n] (values in [0, 2**bits)) -> uint8 [..., packed_bytes(n, bits)].

    A little-endian bit stream per row: value j occupies stream bits j*bits .. j*bits+bits-1
    (least significant bit first), and stream bit i is bit (i % 8) of byte i // 8; the last
    byte is zero-padded. One layout for every width, so 3-bit codes cost 3 bits."""
    n = codes.shape[-1]
    shifts = torch.arange(bits, device=codes.device, dtype=torch.int32)
    stream = ((codes.to(torch.int32).unsqueeze(-1) >> shifts) & 1).reshape(*codes.shape[:-1], n * bits)
    pad = packed_bytes(n, bits) * 8 - n * bits
    if pad:
        stream = torch.nn.functional.pad(stream, (0, pad))
    weights = (1 << torch.arange(8, device=codes.device, dtype=torch.int32))
    out = (stream.reshape(*codes.shape[:-1], -1, 8) * weights).sum(-1)
    return out.to(torch.uint8).contiguous()


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The inverse of ``pack_bits``: uint8 [..., packed_bytes(n, bits)] -> int32 codes [..., n]."""
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32)
    stream = ((packed.to(torch.int32).unsqueeze(-1) >> shifts) & 1).reshape(*packed.shape[:-1], -1)
    stream = stream[..., :n * bits].reshape(*packed.shape[:-1], n, bits)
    weights = (1 << torch.arange(bits, device=packed.device, dtype=torch.int32))
    return (stream * weights).sum(-1, dtype=torch.int32)


def check_bits(what: str, bits, allowed=range(2, 9)) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in allowed:
        raise ValueError(f"{what} must be an int in {list(allowed)}, got {bits!r}")
    return bits


class SymQuant:
    """Per-token symmetric absmax quantization to ``bits`` (2..8) bits: levels
    -qmax..qmax with qmax = 2**(bits-1) - 1, round to nearest (error <= scale/2 =
    absmax / (2 qmax) per element), one fp32 scale per token, codes packed as
    unsigned (q + qmax) with ``pack_bits``. Wire: codes [..., ceil(H*bits/8)] uint8,
    scales [..., 1] fp32."""

    def __init__(self, bits: int):
        self.bits = check_bits("bits", bits)
        self.qmax = 2 ** (self.bits - 1) - 1

    def specs(self, shape):
        return [(shape[:-1] + (packed_bytes(shape[-1], self.bits),), torch.uint8), (shape[:-1] + (1,), torch.float32)]

    def quantize(self, x: torch.Tensor) -> list[torch.Tensor]:
        x = x.detach().float()
        scale = x.abs().amax(dim=-1, keepdim=True) / self.qmax
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero token: codes 0
        q = torch.round(x / scale).clamp_(-self.qmax, self.qmax)
        return [pack_bits((q + self.qmax).to(torch.int32), self.bits), scale.contiguous()]

    def dequantize(self, wire, shape) -> torch.Tensor:
        codes, scale = wire
        if bool((scale <= 0).any()):
            raise ValueError(f"{self.bits}-bit quantizer: received non-positive scales")
        q = unpack_bits(codes, self.bits, shape[-1]).float() - self.qmax
        return q * scale


class GradWire:
    """How a codec's gradient travels back: ``gbits`` in 2..8 = per-token symmetric
    quantization (SymQuant), ``gbits=16`` = a bfloat16 cast (2 bytes per value, half of
    fp32; bf16 keeps fp32's exponent range, so small gradients do not flush to zero as
    they would in fp16)."""

    def __init__(self, gbits: int):
        self.gbits = check_bits("gbits", gbits, (2, 3, 4, 5, 6, 7, 8, 16))
        self.q = None if self.gbits == 16 else SymQuant(self.gbits)

    def specs(self, shape):
        return [(shape, torch.bfloat16)] if self.q is None else self.q.specs(shape)

    def encode(self, grad: torch.Tensor) -> list[torch.Tensor]:
        if self.q is None:
            return [grad.detach().to(torch.bfloat16).contiguous()]
        return self.q.quantize(grad)

    def decode(self, wire, shape, dtype, what: str) -> torch.Tensor:
        validate_wire(wire, self.specs(shape), what)
        out = wire[0].float() if self.q is None else self.q.dequantize(wire, shape)
        return out.to(dtype)
