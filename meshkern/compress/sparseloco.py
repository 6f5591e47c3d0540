"""SparseLoCo (arXiv 2508.15706): error feedback + chunked top-k + 2-bit values.

Per call (state kept per ``key``), on the fp32 concatenation of the tensors, zero-padded
and cut into chunks of ``chunk`` elements:

    e = decay * e + x                         error-feedback accumulator (the "momentum")
    idx = top-k of |e| in every chunk          k = max(1, round(density * chunk))
    v = e[idx];  codes, scales = quantize_2bit(v);  v_hat = dequantize_2bit(codes, scales)
    e[idx] -= v_hat                            keep what was not sent
    message = packed idx | packed 2-bit codes | fp32 scales     (fixed size per call)
    all_gather(message);  out = sum over ranks (in rank order) of scatter(v_hat) / world

2-bit quantization, per chunk: a value's code is sign (1 bit) and magnitude level
(1 bit: |v| above the chunk's mean |v| or not); level values are the mean |v| of the
values mapped to each level (two fp32 scales per chunk, 0 for an empty level), so the
quantizer keeps each level's mean magnitude. Indices use ceil(log2(chunk)) bits each.
Chunks are cut from the concatenation, so a chunk may straddle two tensors (weights of
LLMs are multiples of 4096 elements, so in practice they do not).

Defaults: density 1/64 (~1.6%, one value per 64), chunk 4096, decay 0.95. The
accumulator plays the outer momentum's role, so Streaming DiLoCo uses momentum 0
with this compressor by default. Every rank decodes the same messages in the same
order: results are bitwise identical across ranks.
"""
from __future__ import annotations

import torch
from torch import Tensor

from meshkern.compress.base import Compressor
from meshkern.compress.packing import (from_chunks, index_bits, num_chunks, pack_bits, packed_nbytes,
                                       to_chunks, unpack_bits)


def quantize_2bit(vals: Tensor, valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """vals [nc, k] fp32 -> (codes [nc, k] int64 in 0..3, scales [nc, 2] fp32 (lo, hi)).

    code = 2*(v < 0) + (|v| > mean |v| of the chunk). ``valid`` [nc, k] bool excludes
    entries (padding) from the statistics.
    """
    mag = vals.abs()
    w = torch.ones_like(mag) if valid is None else valid.to(mag.dtype)
    thr = (mag * w).sum(1) / w.sum(1).clamp_min(1)
    big = (mag > thr[:, None]).to(mag.dtype) * w
    small = w - big
    hi = (mag * big).sum(1) / big.sum(1).clamp_min(1)
    lo = (mag * small).sum(1) / small.sum(1).clamp_min(1)
    codes = (vals < 0).to(torch.int64) * 2 + (big > 0).to(torch.int64)
    return codes, torch.stack([lo, hi], 1)


def dequantize_2bit(codes: Tensor, scales: Tensor) -> Tensor:
    """Inverse map of :func:`quantize_2bit`: [nc, k] fp32 values."""
    mag = torch.where((codes & 1).bool(), scales[:, 1:2], scales[:, 0:1])
    return torch.where((codes & 2).bool(), -mag, mag)


class SparseLoCo(Compressor):
    """Top-k + 2-bit SparseLoCo compressor with decayed error feedback (see module doc)."""

    replaces_outer_momentum = True

    def __init__(self, density: float = 1 / 64, *, chunk: int = 4096, decay: float = 0.95,
                 timeout_s: float = 300.0):
        super().__init__(timeout_s=timeout_s)
        if not 0 < density <= 1:
            raise ValueError(f"density must be in (0, 1], got {density}")
        if not isinstance(chunk, int) or not 2 <= chunk <= 1 << 24:
            raise ValueError(f"chunk must be an int in [2, 2**24], got {chunk!r}")
        if not 0 <= decay <= 1:
            raise ValueError(f"decay must be in [0, 1], got {decay}")
        self.density = density
        self.chunk = chunk
        self.decay = decay
        self.k = max(1, round(density * chunk))
        self._state: dict[str, Tensor] = {}  # key -> error accumulator [nc, chunk] fp32

    def _layout(self, nc: int) -> tuple[int, int, int]:
        """Byte sizes of (indices, codes, scales) in one rank's message."""
        count = nc * self.k
        return packed_nbytes(count, index_bits(self.chunk)), packed_nbytes(count, 2), nc * 2 * 4

    def payload_bytes_for(self, shapes, dtype=torch.float32):
        numel = sum(int(torch.Size(s).numel()) for s in shapes)
        return sum(self._layout(num_chunks(numel, self.chunk)))

    def encode(self, x: Tensor, key: str = "default") -> tuple[Tensor, Tensor, Tensor, int]:
        """Update the accumulator of ``key`` with chunked x [nc, chunk] and return
        (message uint8, idx [nc,k], v_hat [nc,k], nc). Exposed for tests."""
        nc = x.shape[0]
        e = self._state.get(key)
        if e is None:
            e = torch.zeros_like(x)
        elif e.shape != x.shape:
            raise ValueError(f"SparseLoCo key {key!r}: accumulator has {e.numel()} elements, input {x.numel()}; "
                             f"use a different key for a different tensor list")
        e.mul_(self.decay).add_(x)
        idx = torch.topk(e.abs(), self.k, dim=1, sorted=False).indices.sort(1).values
        vals = torch.gather(e, 1, idx)
        codes, scales = quantize_2bit(vals)
        v_hat = dequantize_2bit(codes, scales)
        e.scatter_add_(1, idx, -v_hat)
        self._state[key] = e
        msg = torch.cat([pack_bits(idx, index_bits(self.chunk)), pack_bits(codes, 2),
                         scales.reshape(-1).contiguous().view(torch.uint8)])
        return msg, idx, v_hat, nc

    def decode(self, msg: Tensor, nc: int) -> tuple[Tensor, Tensor]:
        """One rank's message -> (idx [nc,k] int64, v_hat [nc,k] fp32)."""
        ni, nq, ns = self._layout(nc)
        count = nc * self.k
        idx = unpack_bits(msg[:ni], index_bits(self.chunk), count).view(nc, self.k)
        if int(idx.max()) >= self.chunk:
            raise ValueError("SparseLoCo: a peer sent an index outside its chunk")
        codes = unpack_bits(msg[ni:ni + nq], 2, count).view(nc, self.k)
        scales = msg[ni + nq:ni + nq + ns].clone().view(torch.float32).view(nc, 2)
        return idx, dequantize_2bit(codes, scales)

    def _all_reduce_mean(self, tensors, group, world, key):
        x, n = to_chunks(tensors, self.chunk)
        e_pad_start = n
        msg, _, _, nc = self.encode(x, key)
        self._state[key].view(-1)[e_pad_start:] = 0  # padding never accumulates anything
        gathered = self._all_gather(msg, group, "all_gather of sparse 2-bit messages")
        total = torch.zeros_like(x)
        for w in range(world):
            idx, v_hat = self.decode(gathered[w], nc)
            total.scatter_add_(1, idx, v_hat)
        return from_chunks(total.div_(world), tensors)

    def project_error(self, key, shapes, fn):
        """See :meth:`Compressor.project_error`: the accumulator of ``key`` is the fp32
        concatenation of the tensors (then zero padding), so tensor i's part is a
        contiguous slice; padding stays zero. A chunk that straddles two tensors mixes
        them in its top-k and 2-bit scales, so changing one tensor's part can change
        what is sent for the other (tensor sizes that are multiples of ``chunk`` avoid it)."""
        e = self._state.get(key)
        if e is None:
            return
        sizes = [int(torch.Size(s).numel()) for s in shapes]
        if num_chunks(sum(sizes), self.chunk) != e.shape[0]:
            raise ValueError(f"SparseLoCo key {key!r}: shapes hold {sum(sizes)} elements, the accumulator "
                             f"{e.shape[0]} chunks of {self.chunk}")
        flat, i = e.view(-1), 0
        for j, (s, n) in enumerate(zip(shapes, sizes)):
            part = flat[i:i + n].view(torch.Size(s))
            out = fn(j, part.clone())
            if not isinstance(out, Tensor) or out.shape != part.shape:
                got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
                raise ValueError(f"SparseLoCo.project_error: fn returned {got} for tensor {j} of shape "
                                 f"{tuple(part.shape)}; it must return a tensor of the same shape")
            part.copy_(out)
            i += n

    def _state_dict(self):
        return {k: v.detach().clone() for k, v in self._state.items()}  # copies: later calls update in place

    def _load_state_dict(self, sd):
        self._state = {k: v.clone() for k, v in sd.items()}
