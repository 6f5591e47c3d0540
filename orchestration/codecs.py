"""Pluggable stage-boundary codecs: what crosses a pipeline link, both directions.

A pipeline boundary sends the hidden state h [..., T, H] forward and its gradient back.
A codec says what travels instead:

    sender (stage i)                               receiver (stage i+1)
    wire, ctx = codec.encode_fwd(h, key)  ----->   h_hat = codec.decode_fwd(wire, key, shape, dtype)
    grad_h = codec.decode_bwd(wire_b, key, ctx) <-- wire_b = codec.encode_bwd(grad_h_hat, key, wire)

``key`` is the boundary's ``meshkern.MaskKey(seed, boundary, step, microbatch)``; both
sides hold it without communication. The receiver passes the forward ``wire`` it
decoded as ``meta`` to ``encode_bwd`` (top-k needs the indices it received).
``wire_specs(shape, dtype, direction)`` lists the (shape, dtype) of every wire tensor
(what a receiver preallocates for ``torch.distributed.recv``) and ``wire_bytes`` is
their exact byte count; encode always produces exactly these, and decode raises a
ValueError on anything else, or on non-finite values (a peer's garbage never reaches
the model).

Backward semantics (what gradient comes back), per codec:
    dense       identity both ways; H elements per token per direction.
    mask        ours: h_hat = unpack(pack(h)) with the Philox mask of ``key``
                (meshkern.pack/unpack); gradient = exact autograd of that, i.e. the same
                K dims per token travel back. K = round((1-p)H) values per token each way,
                no index travels. ``rescale`` scales by H/K on the receiver (unbiased).
    topk        the K largest-|h| dims per token, values + indices forward; gradient =
                autograd with those indices held fixed, so only K values travel back
                (the sender kept its indices).
    int8, int4  symmetric absmax quantization per token (or per ``group_size`` dims),
                float32 scales; gradient straight-through (identity) and then itself
                quantized the same way for the trip back.
    bottleneck  a fixed orthonormal basis P [H, r], r = round((1-p)H), seeded by
                (key.seed, key.boundary) and the same at every step: h_hat = h P P^T,
                gradient = autograd (grad P P^T): r values per token each way.
    pca         a calibrated per-boundary basis (mean [H], U [H, k], sd [k], gsd [k]; see
                orchestration.calibration): forward the k coordinates (h - mean) U / sd,
                int4 (or int8) per token with an fp32 absmax scale; receiver rebuilds
                mean + U (sd * codes). Backward: the exact adjoint of the projection
                (straight-through for the quantizer), U^T g / gsd quantized the same way,
                rebuilt as U (gsd * codes). ``sink``: position 0 of every row (the
                attention sink) travels as int8 over all H dims instead, both ways.

``make_codec(name, p=0.95, rescale=False, **options)`` builds one by name; ``apply_codec``
runs a round trip inside one process as an autograd function (the in-process reference
of a compressed pipeline).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence

import torch

Spec = tuple[tuple[int, ...], torch.dtype]
DIRECTIONS = ("fwd", "bwd")


def _check_direction(direction: str) -> None:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be 'fwd' or 'bwd', got {direction!r}")


def _check_float(shape: Sequence[int], dtype: torch.dtype) -> tuple[int, ...]:
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2 or min(shape) < 1:
        raise ValueError(f"boundary tensors are [..., T, H] with every dim >= 1, got shape {shape}")
    if not dtype.is_floating_point:
        raise TypeError(f"boundary tensors must be floating point, got {dtype}")
    return shape


def _check_p(p: float) -> float:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"p (fraction of hidden dims dropped) must be in [0, 1), got {p}")
    return float(p)


def kept_count(H: int, p: float) -> int:
    """K = round((1 - p) * H) dims kept per token: meshkern.kept_dims (ValueError if K < 1)."""
    from meshkern.mask import kept_dims
    return kept_dims(int(H), _check_p(p))


def _optional_width(what: str, value) -> int | None:
    """An explicit per-token width (topk k, bottleneck rank): None or an int >= 1."""
    if value is not None and int(value) < 1:
        raise ValueError(f"{what} must be >= 1, got {value}")
    return None if value is None else int(value)


def _width(what: str, explicit: int | None, p: float, H: int) -> int:
    """Values per token: ``explicit`` if given, else K = round((1-p)H); at most H."""
    k = explicit if explicit is not None else kept_count(H, p)
    if k > H:
        raise ValueError(f"{what}={k} exceeds the hidden size H={H}")
    return k


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
    """Base class; subclasses implement ``wire_specs`` and the four encode/decode steps."""

    name = "base"

    def wire_specs(self, shape: Sequence[int], dtype: torch.dtype, direction: str) -> list[Spec]:
        raise NotImplementedError

    def wire_bytes(self, shape: Sequence[int], dtype: torch.dtype, direction: str) -> int:
        """Exact bytes on the link for one boundary tensor of ``shape`` in ``direction``."""
        return sum(math.prod(s) * torch.empty((), dtype=d).element_size()
                   for s, d in self.wire_specs(shape, dtype, direction))

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


class DenseCodec(BoundaryCodec):
    """The uncompressed baseline: h forward, grad back, in the activation dtype."""

    name = "dense"

    def wire_specs(self, shape, dtype, direction):
        _check_direction(direction)
        return [(_check_float(shape, dtype), dtype)]

    def encode_fwd(self, h, key):
        return [h.detach().contiguous()], (tuple(h.shape), h.dtype)

    def decode_fwd(self, wire, key, shape, dtype):
        validate_wire(wire, self.wire_specs(shape, dtype, "fwd"), "dense decode_fwd")
        return wire[0]

    def encode_bwd(self, grad, key, meta):
        return [grad.detach().contiguous()]

    def decode_bwd(self, wire, key, ctx):
        shape, dtype = ctx
        validate_wire(wire, self.wire_specs(shape, dtype, "bwd"), "dense decode_bwd")
        return wire[0]


class MaskCodec(BoundaryCodec):
    """Ours: the K Philox-chosen dims per token travel, both ways (meshkern.pack/unpack)."""

    name = "mask"

    def __init__(self, p: float = 0.95, rescale: bool = False, backend: str = "auto"):
        self.p, self.rescale, self.backend = _check_p(p), bool(rescale), backend

    def wire_specs(self, shape, dtype, direction):
        _check_direction(direction)
        shape = _check_float(shape, dtype)
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
        self.p, self.k = _check_p(p), _optional_width("topk: k", k)

    def _k(self, H: int) -> int:
        return _width("topk: k", self.k, self.p, H)

    @staticmethod
    def index_dtype(H: int) -> torch.dtype:
        return torch.int16 if H <= 2 ** 15 else torch.int32

    def wire_specs(self, shape, dtype, direction):
        _check_direction(direction)
        shape = _check_float(shape, dtype)
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
        _check_direction(direction)
        shape = _check_float(shape, dtype)
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
        self.p, self.rank = _check_p(p), _optional_width("bottleneck: rank", rank)

    def _r(self, H: int) -> int:
        return _width("bottleneck: rank", self.rank, self.p, H)

    def basis(self, key, H: int, dtype: torch.dtype, device) -> torch.Tensor:
        """The boundary's fixed basis P [H, r] (orthonormal columns) in ``dtype``."""
        if key is None:
            raise ValueError("bottleneck needs a key (its seed and boundary choose the subspace)")
        return _basis(key.seed, key.boundary, H, self._r(H)).to(device=device, dtype=dtype)

    def wire_specs(self, shape, dtype, direction):
        _check_direction(direction)
        shape = _check_float(shape, dtype)
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


@dataclass
class PCABasis:
    """One boundary's fixed PCA basis, identical on both sides of the boundary.

    mean [H], U [H, k] (orthonormal columns), sd [k] (calibration std of each forward
    coordinate, > 0), gsd [k] (calibration std of each gradient coordinate U^T g, > 0;
    ones if not calibrated). All float32."""

    mean: torch.Tensor
    U: torch.Tensor
    sd: torch.Tensor
    gsd: torch.Tensor

    def __post_init__(self):
        self.mean, self.U = self.mean.detach().float().contiguous(), self.U.detach().float().contiguous()
        self.sd, self.gsd = self.sd.detach().float().contiguous(), self.gsd.detach().float().contiguous()
        H, k = self.U.shape if self.U.dim() == 2 else (0, 0)
        if self.U.dim() != 2 or tuple(self.mean.shape) != (H,) or tuple(self.sd.shape) != (k,) \
                or tuple(self.gsd.shape) != (k,):
            raise ValueError(f"PCABasis: mean [H], U [H, k], sd [k], gsd [k] expected, got {tuple(self.mean.shape)}, "
                             f"{tuple(self.U.shape)}, {tuple(self.sd.shape)}, {tuple(self.gsd.shape)}")
        for name in ("mean", "U", "sd", "gsd"):
            if not bool(torch.isfinite(getattr(self, name)).all()):
                raise ValueError(f"PCABasis: {name} holds non-finite values")
        if bool((self.sd <= 0).any()) or bool((self.gsd <= 0).any()):
            raise ValueError("PCABasis: sd and gsd must be > 0")

    @property
    def k(self) -> int:
        return self.U.shape[1]

    @property
    def hidden_size(self) -> int:
        return self.U.shape[0]

    def nbytes(self) -> int:
        """Bytes to send this basis once (fp32): H + H*k + 2k values."""
        return 4 * (self.mean.numel() + self.U.numel() + self.sd.numel() + self.gsd.numel())

    def to(self, device) -> "PCABasis":
        return PCABasis(self.mean.to(device), self.U.to(device), self.sd.to(device), self.gsd.to(device))

    def state_dict(self) -> dict:
        return {"mean": self.mean, "U": self.U, "sd": self.sd, "gsd": self.gsd}


PCA_BASES: dict[int, PCABasis] = {}  # boundary index -> basis; what a PCACodec uses unless given its own


def pca_width(H: int, bits: int = 4, budget: float = 15, sink: bool = True, seq_len: int = 128) -> int:
    """Coordinates k per token that fit B = floor(4H / budget) bytes per token per direction
    (1/budget of dense fp32): k codes of ``bits`` bits plus one fp32 scale, and with
    ``sink`` the position-0 row (H int8 codes + fp32 scale) amortized over ``seq_len``
    tokens: ceil((H + 4) / seq_len) bytes. At most H. ValueError if nothing fits."""
    B = int(4 * H // budget)
    pos0 = -(-(H + 4) // int(seq_len)) if sink else 0
    room = B - pos0 - 4
    k = min(H, room if bits == 8 else 2 * room)
    if k < 1:
        raise ValueError(f"pca: budget={budget} leaves no room for a coordinate at H={H}")
    return k


class PCACodec(BoundaryCodec):
    """Calibrated PCA subspace + per-token quantization (see the module doc, ``pca``).

    ``k`` coordinates per token, explicit or from ``budget`` (``pca_width``; default 1/15
    of dense fp32 bytes). The basis of boundary b is ``bases[b]`` (default: the module's
    PCA_BASES, which orchestration.calibration fills); ``k`` must equal its width.
    ``calib_rows`` / ``grad_rows``: how many training rows calibration fits the basis on
    (and of those, how many give the gradient std gsd).
    Wire per direction, for a boundary tensor [..., T, H]:
        sink=False: codes [..., T, ceil(k/2)] uint8 (int4, low nibble = even coordinate) or
                    [..., T, k] int8; scales [..., T, 1] fp32.
        sink=True:  position 0: [..., H] int8 + [..., 1] fp32 scale; positions 1..T-1 as
                    above, [..., T-1, .] codes and [..., T-1, 1] scales.
    """

    name = "pca"

    def __init__(self, bits: int = 4, k: int | None = None, budget: float | None = None, sink: bool = True,
                 seq_len: int = 128, bases: dict | None = None, calib_rows: int = 16, grad_rows: int = 8):
        if bits not in (4, 8):
            raise ValueError(f"pca: bits must be 4 or 8, got {bits}")
        if k is not None and budget is not None:
            raise ValueError("pca: give k or budget, not both")
        if budget is not None and float(budget) <= 0:
            raise ValueError(f"pca: budget must be > 0, got {budget}")
        if int(seq_len) < 1:
            raise ValueError(f"pca: seq_len must be >= 1, got {seq_len}")
        self.bits, self.k = int(bits), _optional_width("pca: k", k)
        self.budget = None if k is not None else float(15 if budget is None else budget)
        self.sink, self.seq_len = bool(sink), int(seq_len)
        if int(calib_rows) < 1 or int(grad_rows) < 0:
            raise ValueError(f"pca: calib_rows must be >= 1 and grad_rows >= 0, got {calib_rows}, {grad_rows}")
        self.calib_rows, self.grad_rows = int(calib_rows), int(grad_rows)  # orchestration.calibration's
        self.bases = PCA_BASES if bases is None else bases
        self._q, self._q8 = QuantCodec(self.bits), QuantCodec(8)
        self._dev: dict = {}

    def __repr__(self) -> str:
        return (f"PCACodec(bits={self.bits}, k={self.k}, budget={self.budget}, sink={self.sink}, "
                f"seq_len={self.seq_len}, boundaries={sorted(self.bases)})")

    def width(self, H: int) -> int:
        if self.k is not None:
            if self.k > H:
                raise ValueError(f"pca: k={self.k} exceeds the hidden size H={H}")
            return self.k
        return pca_width(H, self.bits, self.budget, self.sink, self.seq_len)

    def basis(self, boundary: int, H: int, device) -> PCABasis:
        b = self.bases.get(int(boundary))
        if b is None:
            raise ValueError(f"pca: no basis for boundary {boundary} (calibrate first: "
                             f"orchestration.calibration); have {sorted(self.bases)}")
        if (b.hidden_size, b.k) != (H, self.width(H)):
            raise ValueError(f"pca: boundary {boundary}'s basis is [{b.hidden_size}, {b.k}], "
                             f"this codec needs [{H}, {self.width(H)}]")
        ck = (int(boundary), str(device), id(b))
        if ck not in self._dev:
            self._dev[ck] = b.to(device)
        return self._dev[ck]

    def wire_specs(self, shape, dtype, direction):
        _check_direction(direction)
        shape = _check_float(shape, dtype)
        H, k = shape[-1], self.width(shape[-1])
        cw = (k + 1) // 2 if self.bits == 4 else k
        cdt = torch.uint8 if self.bits == 4 else torch.int8
        if not self.sink:
            return [(shape[:-1] + (cw,), cdt), (shape[:-1] + (1,), torch.float32)]
        lead, T = shape[:-2], shape[-2]
        return [(lead + (H,), torch.int8), (lead + (1,), torch.float32),
                (lead + (T - 1, cw), cdt), (lead + (T - 1, 1), torch.float32)]

    def _encode(self, x, basis: PCABasis, norm: torch.Tensor, center: bool) -> list[torch.Tensor]:
        x = x.detach().float()
        if self.sink:
            head, x = x[..., 0, :], x[..., 1:, :]
        c = ((x - basis.mean) if center else x) @ basis.U / norm
        wire = self._q.quantize(c)
        if self.sink:
            wire = self._q8.quantize(head) + wire
        return [t.contiguous() for t in wire]

    def _decode(self, wire, basis: PCABasis, norm: torch.Tensor, center: bool, shape, dtype) -> torch.Tensor:
        H, k = shape[-1], basis.k
        body_shape = shape[:-2] + ((shape[-2] - 1) if self.sink else shape[-2], k)
        body = wire[2:] if self.sink else wire
        c = self._q.dequantize(body, body_shape, torch.float32) * norm
        x = c @ basis.U.T
        if center:
            x = x + basis.mean
        if self.sink:
            head = self._q8.dequantize(wire[:2], shape[:-2] + (H,), torch.float32)
            x = torch.cat([head.unsqueeze(-2), x], dim=-2)
        return x.to(dtype)

    def encode_fwd(self, h, key):
        b = self.basis(key.boundary, h.shape[-1], h.device)
        return self._encode(h, b, b.sd, True), (tuple(h.shape), h.dtype, int(key.boundary))

    def decode_fwd(self, wire, key, shape, dtype):
        shape = tuple(shape)
        validate_wire(wire, self.wire_specs(shape, dtype, "fwd"), "pca decode_fwd")
        b = self.basis(key.boundary, shape[-1], wire[0].device)
        return self._decode(wire, b, b.sd, True, shape, dtype)

    def encode_bwd(self, grad, key, meta):
        # d h_hat / d h = U U^T (straight-through quantizer): the sender needs U^T g, k per token.
        b = self.basis(key.boundary, grad.shape[-1], grad.device)
        return self._encode(grad, b, b.gsd, False)

    def decode_bwd(self, wire, key, ctx):
        shape, dtype, boundary = ctx
        validate_wire(wire, self.wire_specs(shape, dtype, "bwd"), "pca decode_bwd")
        b = self.basis(boundary, shape[-1], wire[0].device)
        return self._decode(wire, b, b.gsd, False, shape, dtype)


CODECS = ("dense", "mask", "topk", "int8", "int4", "bottleneck", "pca")


def make_codec(name: str, p: float = 0.95, rescale: bool = False, **options) -> BoundaryCodec:
    """Build the codec ``name`` (one of CODECS).

    ``p`` (drop fraction) sizes mask, topk and bottleneck (K = round((1-p)H)) and is
    ignored by dense/int8/int4; ``rescale`` applies to mask only. ``options`` go to the
    codec's constructor (topk: k; int8/int4: group_size; bottleneck: rank; mask:
    backend; pca: bits, k or budget, sink, seq_len; p is ignored); an option the codec does not take is a TypeError.
    """
    builders = {
        "dense": lambda: DenseCodec(**options),
        "mask": lambda: MaskCodec(p=p, rescale=rescale, **options),
        "topk": lambda: TopKCodec(p=p, **options),
        "int8": lambda: QuantCodec(8, **options),
        "int4": lambda: QuantCodec(4, **options),
        "bottleneck": lambda: BottleneckCodec(p=p, **options),
        "pca": lambda: PCACodec(**options),
    }
    if name not in builders:
        raise ValueError(f"unknown boundary codec {name!r}; choose one of {', '.join(CODECS)}")
    try:
        return builders[name]()
    except TypeError as e:
        raise TypeError(f"codec {name!r} does not take options {sorted(options)}: {e}") from None


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
