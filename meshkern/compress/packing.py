"""Bit packing and chunking shared by the sparse/quantized compressors.

Everything here is a pure function of its inputs (deterministic, any device).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor


def pack_bits(values: Tensor, bits: int) -> Tensor:
    """Pack non-negative integers < 2**bits (any integer dtype, any shape) into a 1-D
    uint8 tensor of ceil(numel*bits/8) bytes, little-endian bit order."""
    if not 1 <= bits <= 31:
        raise ValueError(f"bits must be in [1, 31], got {bits}")
    v = values.reshape(-1).to(torch.int64)
    if v.numel() and (int(v.min()) < 0 or int(v.max()) >= 1 << bits):
        raise ValueError(f"values out of range for {bits} bits")
    shifts = torch.arange(bits, device=v.device, dtype=torch.int64)
    stream = ((v[:, None] >> shifts) & 1).to(torch.uint8).reshape(-1)
    pad = (-stream.numel()) % 8
    if pad:
        stream = torch.cat([stream, stream.new_zeros(pad)])
    weights = (1 << torch.arange(8, device=v.device, dtype=torch.int32))
    return (stream.view(-1, 8).to(torch.int32) * weights).sum(1).to(torch.uint8)


def unpack_bits(packed: Tensor, bits: int, count: int) -> Tensor:
    """Inverse of :func:`pack_bits`: the first ``count`` values as int64 [count]."""
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise TypeError(f"packed must be a 1-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    if packed.numel() != packed_nbytes(count, bits):
        raise ValueError(f"{packed.numel()} bytes cannot hold exactly {count} values of {bits} bits")
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32)
    stream = ((packed.to(torch.int32)[:, None] >> shifts) & 1).reshape(-1)[:count * bits]
    weights = (1 << torch.arange(bits, device=packed.device, dtype=torch.int64))
    return (stream.view(count, bits).to(torch.int64) * weights).sum(1)


def packed_nbytes(count: int, bits: int) -> int:
    return (count * bits + 7) // 8


def index_bits(chunk: int) -> int:
    """Bits needed for an index into a chunk of ``chunk`` elements."""
    return max(1, math.ceil(math.log2(chunk)))


def to_chunks(tensors, chunk: int) -> tuple[Tensor, int]:
    """Concatenate ``tensors`` as fp32 and zero-pad to [num_chunks, chunk]; return
    (chunks, total numel)."""
    flat = torch.cat([t.reshape(-1).to(torch.float32) for t in tensors])
    n = flat.numel()
    pad = (-n) % chunk
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, chunk), n


def from_chunks(chunks: Tensor, like) -> list[Tensor]:
    """Split chunked fp32 data back into tensors shaped and typed like ``like``."""
    flat = chunks.reshape(-1)
    out, i = [], 0
    for t in like:
        out.append(flat[i:i + t.numel()].view(t.shape).to(t.dtype).clone())
        i += t.numel()
    return out


def num_chunks(numel: int, chunk: int) -> int:
    return -(-numel // chunk)
