"""The codec protocol: ``BoundaryCodec`` (the base class), wire validation, the dense
baseline and ``apply_codec`` (the in-process round trip under autograd). The shared
argument rules (p, widths, boundary shapes) live here and in meshkern._checks."""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from meshkern._checks import boundary_shape, fraction

Spec = tuple[tuple[int, ...], torch.dtype]
DIRECTIONS = ("fwd", "bwd")


def check_direction(direction: str) -> None:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be 'fwd' or 'bwd', got {direction!r}")


def check_p(p: float) -> float:
    """The drop fraction p of mask / topk / bottleneck: a float in [0, 1)."""
    return fraction("p (fraction of hidden dims dropped)", p)


def kept_count(H: int, p: float) -> int:
    """K = round((1 - p) * H) dims kept per token: meshkern.kept_dims (ValueError if K < 1)."""
    from meshkern.mask import kept_dims
    return kept_dims(int(H), check_p(p))


def optional_width(what: str, value) -> int | None:
    """An explicit per-token width (topk k, bottleneck rank): None or an int >= 1."""
    if value is not None and int(value) < 1:
        raise ValueError(f"{what} must be >= 1, got {value}")
    return None if value is None else int(value)


def width(what: str, explicit: int | None, H: int, default) -> int:
    """Values per token of a codec: ``explicit`` (its k / rank option) if given, else
    ``default()`` (the codec's rule: K = round((1-p)H), or what fits a byte budget); an
    explicit width over H is a ValueError naming ``what``. Every codec's ``width`` is this."""
    if explicit is None:
        return default()
    if explicit > H:
        raise ValueError(f"{what}={explicit} exceeds the hidden size H={H}")
    return explicit


class NonFiniteWire(ValueError):
    """A received wire tensor holds NaN/Inf: the peer sent garbage (the pipeline skips
    the step instead of stopping the mesh; any other decode error is a bug or a
    protocol mismatch and propagates)."""


def validate_wire(wire: Sequence[torch.Tensor], specs: Sequence[Spec], what: str) -> None:
    """Raise ValueError unless ``wire`` matches ``specs`` tensor by tensor (shape and
    dtype) and every floating-point wire tensor is finite: a peer's NaN/Inf or a
    truncated message stops at the boundary with an error instead of entering the model
    (cost: one pass over the K or H values, negligible next to the transfer)."""
    if len(wire) != len(specs):
        raise ValueError(f"{what}: expected {len(specs)} wire tensors, got {len(wire)}")
    for i, (t, (shape, dtype)) in enumerate(zip(wire, specs)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{what}: wire tensor {i} should be {tuple(shape)} {dtype}, got {got}")
        if t.dtype.is_floating_point and not bool(torch.isfinite(t).all()):
            raise NonFiniteWire(f"{what}: wire tensor {i} holds non-finite values (NaN/Inf from the peer)")


class BoundaryCodec:
    """Base class; subclasses implement ``wire_specs`` and the four encode/decode steps.

    ``begin_step(step, sample_ids)`` is called by the pipeline executor on every stage at
    the start of each step with the step's per-micro-batch sample ids (every stage holds
    the batch, so both sides of a boundary know them without communication); stateless
    codecs ignore it, a per-sample codec (aqsgd) keys its stores by them."""

    name = "base"
    # True when the codec's state is fitted on the model before training and sent once
    # (the pca codecs' bases: orchestration.components.calibration fits, stores and counts
    # them; ``one_off_bytes`` is what each boundary's costs on its link).
    needs_calibration = False

    def one_off_bytes(self, boundary: int) -> int:
        """Bytes sent once on boundary ``boundary``'s forward link before the first step
        (a calibrated basis); 0 for a codec with no such state."""
        return 0

    def token_bytes(self, H: int, dtype: torch.dtype, direction: str) -> int:
        """Bytes per token in ``direction`` (what tables of codecs compare): the wire of one
        token. A codec with per-row parts on its wire (pca's sink row) amortizes them."""
        return self.wire_bytes((1, H), dtype, direction)

    def wire_specs(self, shape: Sequence[int], dtype: torch.dtype, direction: str) -> list[Spec]:
        raise NotImplementedError

    def wire_bytes(self, shape: Sequence[int], dtype: torch.dtype, direction: str) -> int:
        """Exact bytes on the link for one boundary tensor of ``shape`` in ``direction``."""
        return sum(math.prod(s) * torch.empty((), dtype=d).element_size()
                   for s, d in self.wire_specs(shape, dtype, direction))

    def begin_step(self, step: int, sample_ids: Sequence[torch.Tensor] | None) -> None:
        """Per-step hook (see the class doc); a no-op for stateless codecs."""

    def bind_inputs(self, input_ids: Sequence[torch.Tensor]) -> None:
        """Per-step hook after ``begin_step``: the step's input ids [B_m, T] per micro-batch
        (every stage holds the batch). A codec that rebuilds part of the activation from
        the tokens (subspace: re-adds the token embedding) reads them here; a no-op else."""

    def encode_fwd(self, h: torch.Tensor, key) -> tuple[list[torch.Tensor], Any]:
        raise NotImplementedError

    def decode_fwd(self, wire: Sequence[torch.Tensor], key, shape, dtype) -> torch.Tensor:
        raise NotImplementedError

    def encode_bwd(self, grad: torch.Tensor, key, meta) -> list[torch.Tensor]:
        raise NotImplementedError

    def decode_bwd(self, wire: Sequence[torch.Tensor], key, ctx) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DenseCodec(BoundaryCodec):
    """The uncompressed baseline: h forward, grad back, in the activation dtype, or with
    ``dtype`` (float32, bfloat16, float16) in that dtype on the wire: ``dtype="bfloat16"``
    is what a GPU pipeline in bf16 sends (2 bytes per value), the baseline a compression
    ratio is honestly counted against. The receiver casts back to the activation dtype;
    the gradient of the cast is straight-through, cast the same way for the trip back."""

    name = "dense"

    def __init__(self, dtype: str | None = None):
        if dtype is not None and dtype not in WIRE_DTYPES:
            raise ValueError(f"dense: dtype must be one of {', '.join(WIRE_DTYPES)} (or unset: the activation "
                             f"dtype), got {dtype!r}")
        self.dtype = dtype
        self._wire = None if dtype is None else WIRE_DTYPES[dtype]

    def __repr__(self) -> str:
        return f"DenseCodec(dtype={self.dtype})"

    def wire_specs(self, shape, dtype, direction):
        check_direction(direction)
        return [(boundary_shape(shape, dtype), self._wire or dtype)]

    def _send(self, t):
        return t.detach().to(self._wire or t.dtype).contiguous()

    def encode_fwd(self, h, key):
        return [self._send(h)], (tuple(h.shape), h.dtype)

    def decode_fwd(self, wire, key, shape, dtype):
        validate_wire(wire, self.wire_specs(shape, dtype, "fwd"), "dense decode_fwd")
        return wire[0].to(dtype)

    def encode_bwd(self, grad, key, meta):
        return [self._send(grad)]

    def decode_bwd(self, wire, key, ctx):
        shape, dtype = ctx
        validate_wire(wire, self.wire_specs(shape, dtype, "bwd"), "dense decode_bwd")
        return wire[0].to(dtype)


def dense_pp_bytes_per_token(hidden_size: int, replica_stages, dtype: str) -> float:
    """Bytes per trained token that a dense pipeline in ``dtype`` (float32 or bfloat16)
    sends on the two PP axes: H values each way at every stage boundary, averaged over the
    fast replicas (a replica of y stages has y - 1 boundaries; every replica trains the same
    tokens). What every compression ratio in summaries and tables is counted against."""
    stages = [int(y) for y in replica_stages]
    boundaries = sum(y - 1 for y in stages) / len(stages)
    return 2 * hidden_size * boundaries * WIRE_DTYPES[dtype].itemsize


def pp_ratios(pp_bytes_per_token: float, hidden_size: int, replica_stages) -> dict[str, float | None]:
    """{"float32": x, "bfloat16": y}: how many times fewer PP bytes than a dense fp32 / bf16
    pipeline (one-off bytes such as a pca basis are in ``pp_bytes_per_token``, so they are
    amortized over the run's tokens); None without pipeline traffic."""
    return {d: (dense_pp_bytes_per_token(hidden_size, replica_stages, d) / pp_bytes_per_token
                if pp_bytes_per_token > 0 else None) for d in ("float32", "bfloat16")}


class _RoundTrip(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, codec, key):
        wire, sctx = codec.encode_fwd(h, key)
        ctx.codec, ctx.key, ctx.sctx, ctx.wire = codec, key, sctx, wire
        return codec.decode_fwd(wire, key, tuple(h.shape), h.dtype)

    @staticmethod
    def backward(ctx, grad):
        wire_b = ctx.codec.encode_bwd(grad.contiguous(), ctx.key, ctx.wire)
        return ctx.codec.decode_bwd(wire_b, ctx.key, ctx.sctx), None, None


def apply_codec(codec: BoundaryCodec, h: torch.Tensor, key) -> torch.Tensor:
    """h_hat = what the receiver sees; its backward is what the sender gets back.

    Runs the four codec steps in one process, under autograd: the in-process reference
    of a pipeline whose boundaries use ``codec``.
    """
    return _RoundTrip.apply(h, codec, key)
