"""``tahquant``: TAH-Quant (He et al., "TAH-Quant: Effective Activation Quantization in
Pipeline Parallelism over Slow Network", arXiv 2506.01352), written from the paper.

Forward, per boundary tensor [..., T, H] (H cut into tiles of ``tile`` dims, a power of 2):
  1. Token bit allocation by entropy: each token's entropy of p = |x| / sum|x| over its H
     dims; in every row of T tokens the floor(T * (1 - high_fraction)) lowest-entropy
     tokens get ``low_bits``, the rest ``bits`` (defaults 3 and 4 on 80 % of tokens: 3.8
     bits on average). A 1-bit-per-token map tells the receiver which.
  2. Pivot swap + Hadamard on outlier tiles: a tile whose largest |x| is at least twice its
     second largest gets its largest element swapped to position 0 and is then rotated by
     the normalized Walsh-Hadamard matrix. Row 0 of that matrix is constant, so the outlier
     becomes a same-sign offset over the whole tile, which step 3's zero point absorbs,
     while the other values are spread evenly (no single element sets the range). One flag
     bit per tile and a log2(tile)-bit pivot index per tile travel (pivot 0 when unflagged:
     fixed wire size).
  3. Asymmetric (min/max) quantization per tile: zero = min, scale = (max - min) / (2^b - 1),
     codes round((y - zero) / scale) in [0, 2^b - 1]; zero and scale travel as ``meta``
     (float16, the paper's choice, or float32). With float16 the zero is rounded down and
     the scale up, so no code clips: per element error <= scale / 2 in the tile's
     (rotated) domain, and the Hadamard is orthonormal, so a tile's L2 error is
     <= sqrt(tile) * scale / 2.
Codes are bit-packed per row: the high-bit tokens' codes in position order, then the
low-bit tokens' (orchestration.codecs.lowbit.pack_bits; 3 bits cost 3 bits).

Backward: straight-through; the gradient travels per ``GradWire`` (default ``gbits=16``:
bf16, half of fp32; 2..8: per-token symmetric quantization).
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch

from meshkern._checks import boundary_shape
from orchestration.codecs.base import BoundaryCodec, check_direction, validate_wire
from orchestration.codecs.lowbit import GradWire, check_bits, pack_bits, packed_bytes, unpack_bits

_META = {"float16": torch.float16, "float32": torch.float32}


@lru_cache(maxsize=16)
def _hadamard_cpu(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:  # Sylvester: H_2k = [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).float()


def hadamard_matrix(n: int, device=None) -> torch.Tensor:
    """The normalized Walsh-Hadamard matrix [n, n] (n a power of 2): symmetric and
    orthonormal, so it is its own inverse."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"the Hadamard size must be a power of 2, got {n}")
    return _hadamard_cpu(int(n)).to(device)


def token_entropy(x: torch.Tensor) -> torch.Tensor:
    """Entropy of p = |x| / sum |x| over the last dim (0 for an all-zero token)."""
    a = x.abs().float()
    p = a / a.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return -(p * torch.log(torch.where(p > 0, p, torch.ones_like(p)))).sum(-1)


class TAHQuantCodec(BoundaryCodec):
    """Tile-wise asymmetric quantization with pivot swap + Hadamard on outlier tiles and
    entropy-guided per-token bit widths (see the module doc).

    Wire per direction, boundary tensor [..., T, H], G = H / tile, n_lo = floor(T (1 - hf)):
      fwd: codes_hi [..., ceil((T - n_lo) H bits / 8)] uint8; codes_lo [..., ceil(n_lo H
           low_bits / 8)] uint8 (absent when n_lo = 0); token map [..., ceil(T / 8)] uint8;
           tile flags [..., ceil(T G / 8)] uint8; pivots [..., ceil(T G log2(tile) / 8)]
           uint8; zero and scale [..., T, G] in ``meta`` each.
      bwd: GradWire(gbits).
    """

    name = "tahquant"

    def __init__(self, bits: int = 4, low_bits: int | None = None, high_fraction: float = 0.8, tile: int = 64,
                 meta: str = "float16", gbits: int = 16):
        self.bits = check_bits("tahquant: bits", bits)
        self.low_bits = check_bits("tahquant: low_bits", self.bits - 1 if low_bits is None else low_bits, range(1, 9))
        if self.low_bits > self.bits:
            raise ValueError(f"tahquant: low_bits={self.low_bits} exceeds bits={self.bits}")
        if not 0.0 <= float(high_fraction) <= 1.0:
            raise ValueError(f"tahquant: high_fraction must be in [0, 1], got {high_fraction}")
        if isinstance(tile, bool) or not isinstance(tile, int) or tile < 2 or tile & (tile - 1):
            raise ValueError(f"tahquant: tile must be a power of 2 >= 2, got {tile!r}")
        if meta not in _META:
            raise ValueError(f"tahquant: meta must be one of {', '.join(_META)}, got {meta!r}")
        self.high_fraction, self.tile, self.meta = float(high_fraction), tile, meta
        self.grad = GradWire(gbits)
        self.gbits = self.grad.gbits
        self.pivot_bits = int(math.log2(tile))

    def __repr__(self) -> str:
        return (f"TAHQuantCodec(bits={self.bits}, low_bits={self.low_bits}, high_fraction={self.high_fraction}, "
                f"tile={self.tile}, meta={self.meta!r}, gbits={self.gbits})")

    def n_low(self, T: int) -> int:
        """Tokens per row of T that get low_bits."""
        return int(math.floor(T * (1.0 - self.high_fraction) + 1e-9))

    def _geometry(self, shape):
        lead, T, H = shape[:-2], shape[-2], shape[-1]
        if H % self.tile:
            raise ValueError(f"tahquant: tile={self.tile} does not divide H={H}")
        return lead, T, H, H // self.tile, self.n_low(T)

    def wire_specs(self, shape, dtype, direction):
        check_direction(direction)
        shape = boundary_shape(shape, dtype)
        if direction == "bwd":
            return self.grad.specs(shape)
        lead, T, H, G, n_lo = self._geometry(shape)
        u8, md = torch.uint8, _META[self.meta]
        specs = [(lead + (packed_bytes((T - n_lo) * H, self.bits),), u8)]
        if n_lo:
            specs.append((lead + (packed_bytes(n_lo * H, self.low_bits),), u8))
        return specs + [(lead + (packed_bytes(T, 1),), u8), (lead + (packed_bytes(T * G, 1),), u8),
                        (lead + (packed_bytes(T * G, self.pivot_bits),), u8), (lead + (T, G), md), (lead + (T, G), md)]

    # ------------------------------------------------------------------ steps
    def _swap(self, y: torch.Tensor, flags: torch.Tensor, pivots: torch.Tensor) -> torch.Tensor:
        """Swap element 0 and element ``pivot`` of every flagged tile (its own inverse)."""
        idx = torch.arange(self.tile, device=y.device).expand(y.shape).clone()
        p = torch.where(flags, pivots, torch.zeros_like(pivots)).unsqueeze(-1)
        idx.scatter_(-1, p, torch.zeros_like(p))
        idx[..., 0:1] = p
        return y.gather(-1, idx)

    def _rotate(self, y: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
        return torch.where(flags.unsqueeze(-1), y @ hadamard_matrix(self.tile, y.device), y)

    def _meta(self, lo: torch.Tensor, hi: torch.Tensor, levels: torch.Tensor):
        """(zero, scale) in the meta dtype: zero <= lo and zero + scale * levels >= hi."""
        md = _META[self.meta]
        zero = lo.to(md)
        zero = torch.where(zero.float() > lo, torch.nextafter(zero, torch.full_like(zero, -math.inf)), zero)
        need = (hi - zero.float()) / levels
        scale = need.to(md)
        scale = torch.where(scale.float() * levels < hi - zero.float(),
                            torch.nextafter(scale, torch.full_like(scale, math.inf)), scale)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        if not (bool(torch.isfinite(zero).all()) and bool(torch.isfinite(scale).all())):
            raise ValueError(f"tahquant: a tile's range does not fit {self.meta} metadata; use meta=float32")
        return zero, scale

    def encode_fwd(self, h, key):
        shape = tuple(h.shape)
        lead, T, H, G, n_lo = self._geometry(boundary_shape(shape, h.dtype))
        x = h.detach().float().reshape(-1, T, H)
        R = x.shape[0]
        low = torch.zeros(R, T, dtype=torch.bool, device=x.device)
        if n_lo:
            order = torch.sort(token_entropy(x), dim=-1, stable=True).indices[:, :n_lo]
            low.scatter_(1, order, True)
        tiles = x.reshape(R, T, G, self.tile)
        top = tiles.abs().topk(2, dim=-1).values
        flags = (top[..., 0] >= 2 * top[..., 1]) & (top[..., 0] > 0)
        pivots = tiles.abs().argmax(dim=-1)
        pivots = torch.where(flags, pivots, torch.zeros_like(pivots))
        y = self._rotate(self._swap(tiles, flags, pivots), flags)
        levels = torch.where(low, 2.0 ** self.low_bits - 1, 2.0 ** self.bits - 1).unsqueeze(-1)  # [R, T, 1]
        zero, scale = self._meta(y.amin(-1), y.amax(-1), levels)
        codes = torch.round((y - zero.float().unsqueeze(-1)) / scale.float().unsqueeze(-1))
        codes = torch.minimum(codes.clamp_(min=0), levels.unsqueeze(-1)).to(torch.int32).reshape(R, T, H)
        wire = [pack_bits(codes[~low].reshape(R, -1), self.bits)]
        if n_lo:
            wire.append(pack_bits(codes[low].reshape(R, -1), self.low_bits))
        wire += [pack_bits(low.to(torch.int32), 1), pack_bits(flags.reshape(R, -1).to(torch.int32), 1),
                 pack_bits(pivots.reshape(R, -1).to(torch.int32), self.pivot_bits), zero, scale]
        return [t.reshape(lead + t.shape[1:]).contiguous() for t in wire], (shape, h.dtype)

    def decode_fwd(self, wire, key, shape, dtype):
        shape = tuple(shape)
        validate_wire(wire, self.wire_specs(shape, dtype, "fwd"), "tahquant decode_fwd")
        lead, T, H, G, n_lo = self._geometry(shape)
        w = [t.reshape((-1,) + t.shape[len(lead):]) for t in wire]
        codes_hi, rest = w[0], w[1:]
        codes_lo, rest = (rest[0], rest[1:]) if n_lo else (None, rest)
        tmap, fmap, pmap, zero, scale = rest
        R = codes_hi.shape[0]
        low = unpack_bits(tmap, 1, T).bool()
        if bool((low.sum(-1) != n_lo).any()):
            raise ValueError(f"tahquant decode_fwd: the token map must mark exactly {n_lo} low-bit tokens per row")
        if bool((scale <= 0).any()):
            raise ValueError("tahquant decode_fwd: received non-positive scales")
        flags = unpack_bits(fmap, 1, T * G).bool().reshape(R, T, G)
        pivots = unpack_bits(pmap, self.pivot_bits, T * G).long().reshape(R, T, G)
        codes = torch.empty(R, T, H, dtype=torch.int32, device=codes_hi.device)
        codes[~low] = unpack_bits(codes_hi, self.bits, (T - n_lo) * H).reshape(-1, H)
        if n_lo:
            codes[low] = unpack_bits(codes_lo, self.low_bits, n_lo * H).reshape(-1, H)
        y = zero.float().unsqueeze(-1) + codes.reshape(R, T, G, self.tile).float() * scale.float().unsqueeze(-1)
        x = self._swap(self._rotate(y, flags), flags, pivots)
        return x.reshape(shape).to(dtype)

    def encode_bwd(self, grad, key, meta):
        return self.grad.encode(grad)

    def decode_bwd(self, wire, key, ctx):
        shape, dtype = ctx
        return self.grad.decode(wire, shape, dtype, "tahquant decode_bwd")
