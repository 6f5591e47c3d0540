"""``aqsgd``: AQ-SGD (Wang et al., "Fine-tuning Language Models over Slow Networks using
Activation Compression with Guarantees", arXiv 2206.01299), written from the paper.

Both sides of a boundary keep, per training sample, the last activation they agreed on,
m(sample) [T, H]. Forward, the sender quantizes the change delta = h - m (per token,
symmetric, ``bits`` bits) and both sides set m <- m + dequant(codes): the sender updates
its store with the *dequantized* delta, never with h, so sender and receiver stores stay
bit-identical (same ops on the same wire tensors). The receiver's activation is the new m.
As a sample is revisited (epoch after epoch) and the model drifts slowly, delta shrinks
and so does its quantization error: the compression error vanishes with training instead
of staying at the quantizer's noise floor (the paper's guarantee).

First visit: the store starts at zero, so delta = h and the first visit is plain
``bits``-bit quantization of h (the paper sends full precision in a warm-up epoch; our
wire shape must not depend on the step, receivers preallocate it). Samples are keyed by
the ids the pipeline executor hands ``begin_step`` (the replica's row index in its data
shard, orchestration.data.sampling.BatchSampler.indices); every stage holds the batch, so both
sides know them without communication. With no ids bound for a key (a one-off round trip:
apply_codec in orchestration.diagnose or the held-out scoring) every row is a first visit
and nothing is stored.

Backward: the gradient is straight-through (d m_new / d h = identity) and travels
quantized directly, not as a delta (gradients do not repeat across visits), per
``GradWire``: ``gbits`` 2..8 per-token quantized, 16 = bf16.

Memory: each side keeps N_samples x T x H values (``store_dtype``, default float32, on
``store_device``, default cpu) per boundary: the price of the method (``store_bytes``).
The stores are not checkpointed: a resumed run restarts them empty on both sides (still
in lockstep; the first visit after a resume is plain quantization again).
"""
from __future__ import annotations

import torch

from meshkern._checks import boundary_shape
from orchestration.codecs.base import BoundaryCodec, check_direction, validate_wire
from orchestration.codecs.lowbit import GradWire, SymQuant

_STORE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class AQSGDCodec(BoundaryCodec):
    """Delta quantization against a per-sample store (see the module doc).

    Wire, boundary tensor [B, T, H]: fwd codes [B, T, ceil(H*bits/8)] uint8 + scales
    [B, T, 1] fp32; bwd per ``gbits`` (GradWire)."""

    name = "aqsgd"

    def __init__(self, bits: int = 4, gbits: int = 8, store_dtype: str = "float32", store_device: str = "cpu"):
        self.q, self.grad = SymQuant(bits), GradWire(gbits)
        self.bits, self.gbits = self.q.bits, self.grad.gbits
        if store_dtype not in _STORE_DTYPES:
            raise ValueError(f"aqsgd: store_dtype must be one of {', '.join(_STORE_DTYPES)}, got {store_dtype!r}")
        self.store_dtype, self.store_device = store_dtype, torch.device(store_device)
        # (side, boundary) -> {sample id: m [T, H]}; side "send" on the sender, "recv" on the
        # receiver (one codec object plays both in an in-process round trip).
        self.stores: dict[tuple[str, int], dict[int, torch.Tensor]] = {}
        self._step, self._ids = None, {}

    def __repr__(self) -> str:
        return (f"AQSGDCodec(bits={self.bits}, gbits={self.gbits}, store_dtype={self.store_dtype!r}, "
                f"store_device={str(self.store_device)!r})")

    # ------------------------------------------------------------------ samples
    def begin_step(self, step, sample_ids):
        if sample_ids is None:
            raise ValueError("aqsgd needs each step's sample ids (PipelineExecutor.step(sample_ids=...)): "
                             "its stores are keyed by sample")
        self._step = int(step)
        self._ids = {m: [int(i) for i in ids.reshape(-1).tolist()] for m, ids in enumerate(sample_ids)}
        for ids in self._ids.values():
            if len(set(ids)) != len(ids):
                raise ValueError(f"aqsgd: a micro-batch holds the same sample twice: {ids}")

    def _sample_ids(self, key, shape) -> list[int] | None:
        if key is None or self._step is None or int(key.step) != self._step or int(key.microbatch) not in self._ids:
            return None
        ids = self._ids[int(key.microbatch)]
        if len(shape) != 3 or shape[0] != len(ids):
            raise ValueError(f"aqsgd: micro-batch {key.microbatch} of step {key.step} has {len(ids)} sample ids "
                             f"but its boundary tensor is {tuple(shape)} ([samples, T, H] expected)")
        return ids

    def store_bytes(self) -> int:
        """Bytes held in this process's stores (both sides if it plays both)."""
        return sum(t.numel() * t.element_size() for s in self.stores.values() for t in s.values())

    def _previous(self, side: str, boundary: int, ids, shape, device) -> torch.Tensor:
        """m of each row [B, T, H] fp32 (zeros for a first visit)."""
        store = self.stores.setdefault((side, int(boundary)), {})
        prev = torch.zeros(shape, dtype=torch.float32, device=device)
        for r, i in enumerate(ids):
            m = store.get(i)
            if m is not None:
                if tuple(m.shape) != tuple(shape[1:]):
                    raise ValueError(f"aqsgd: sample {i} was stored as {tuple(m.shape)}, now {tuple(shape[1:])}")
                prev[r] = m.to(device=device, dtype=torch.float32)
        return prev

    def _update(self, side: str, boundary: int, ids, prev: torch.Tensor, wire) -> torch.Tensor:
        """m <- m + dequant(wire), stored in store_dtype; returns the stored values (fp32)."""
        new = prev + self.q.dequantize(wire, tuple(prev.shape))
        if ids is None:
            return new
        new = new.to(_STORE_DTYPES[self.store_dtype])
        store = self.stores[(side, int(boundary))]
        for r, i in enumerate(ids):
            store[i] = new[r].to(self.store_device, copy=True)
        return new.float()

    # ------------------------------------------------------------------ wire
    def wire_specs(self, shape, dtype, direction):
        check_direction(direction)
        shape = boundary_shape(shape, dtype)
        return self.q.specs(shape) if direction == "fwd" else self.grad.specs(shape)

    def encode_fwd(self, h, key):
        shape = tuple(h.shape)
        ids = self._sample_ids(key, shape)
        prev = self._previous("send", key.boundary, ids, shape, h.device) if ids else torch.zeros_like(h, dtype=torch.float32)
        wire = self.q.quantize(h.detach().float() - prev)
        self._update("send", key.boundary, ids, prev, wire)
        return wire, (shape, h.dtype)

    def decode_fwd(self, wire, key, shape, dtype):
        shape = tuple(shape)
        validate_wire(wire, self.wire_specs(shape, dtype, "fwd"), "aqsgd decode_fwd")
        ids = self._sample_ids(key, shape)
        prev = (self._previous("recv", key.boundary, ids, shape, wire[0].device) if ids
                else torch.zeros(shape, dtype=torch.float32, device=wire[0].device))
        return self._update("recv", key.boundary, ids, prev, wire).to(dtype)

    def encode_bwd(self, grad, key, meta):
        return self.grad.encode(grad)

    def decode_bwd(self, wire, key, ctx):
        shape, dtype = ctx
        return self.grad.decode(wire, shape, dtype, "aqsgd decode_bwd")
