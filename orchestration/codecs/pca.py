"""``pca``: a calibrated per-boundary PCA basis (orchestration.components.calibration fits it) with
per-token coordinates, each on a Gaussian code book of its own width (quant=nf, the default) or
int4/int8 on the top k (quant=absmax); ``PCA_BASES`` is the process-wide basis table."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from meshkern import pca as meshkern_pca
from meshkern import pca_nf as meshkern_pca_nf
from meshkern._checks import boundary_shape
from orchestration.codecs.base import BoundaryCodec, NonFiniteWire, check_direction, optional_width, validate_wire, width


@dataclass
class PCABasis:
    """One boundary's fixed PCA basis, identical on both sides of the boundary.

    mean [H], U [H, k] (orthonormal columns), sd [k] (calibration std of each forward
    coordinate, > 0), gsd [k] (calibration std of each gradient coordinate, > 0; ones if
    not calibrated): of Ug^T g when the basis has a gradient basis Ug [H, k] (orthonormal
    columns: the top-k eigenvectors of the boundary gradients' second moment, for
    ``bwd=gbasis``), else of U^T g. All float32. With ``quant=nf`` also bits / gbits [k]
    int64: the code width of every forward / backward coordinate (meshkern.pca_nf). ``elem``:
    bytes per value when the basis is sent (4, or 2 when its values were rounded to fp16)."""

    mean: torch.Tensor
    U: torch.Tensor
    sd: torch.Tensor
    gsd: torch.Tensor
    Ug: torch.Tensor | None = None
    bits: torch.Tensor | None = None
    gbits: torch.Tensor | None = None
    elem: int = 4

    def __post_init__(self):
        self.mean, self.U = self.mean.detach().float().contiguous(), self.U.detach().float().contiguous()
        self.sd, self.gsd = self.sd.detach().float().contiguous(), self.gsd.detach().float().contiguous()
        if self.Ug is not None:
            self.Ug = self.Ug.detach().float().contiguous()
        H, k = self.U.shape if self.U.dim() == 2 else (0, 0)
        if self.U.dim() != 2 or tuple(self.mean.shape) != (H,) or tuple(self.sd.shape) != (k,) \
                or tuple(self.gsd.shape) != (k,) or (self.Ug is not None and tuple(self.Ug.shape) != (H, k)):
            raise ValueError(f"PCABasis: mean [H], U [H, k], sd [k], gsd [k] (and Ug [H, k]) expected, got "
                             f"{tuple(self.mean.shape)}, {tuple(self.U.shape)}, {tuple(self.sd.shape)}, "
                             f"{tuple(self.gsd.shape)}" + ("" if self.Ug is None else f", {tuple(self.Ug.shape)}"))
        for name in ("mean", "U", "sd", "gsd") + (("Ug",) if self.Ug is not None else ()):
            if not bool(torch.isfinite(getattr(self, name)).all()):
                raise ValueError(f"PCABasis: {name} holds non-finite values")
        if bool((self.sd <= 0).any()) or bool((self.gsd <= 0).any()):
            raise ValueError("PCABasis: sd and gsd must be > 0")
        if (self.bits is None) != (self.gbits is None):
            raise ValueError("PCABasis: bits and gbits come together (quant=nf)")
        if self.bits is not None:
            self.bits, self.gbits = (t.detach().long().cpu().contiguous() for t in (self.bits, self.gbits))
            for name in ("bits", "gbits"):
                t = getattr(self, name)
                if tuple(t.shape) != (k,) or bool((t < 0).any()) or bool((t > meshkern_pca_nf.MAX_BITS).any()):
                    raise ValueError(f"PCABasis: {name} must be [k={k}] code widths in 0..{meshkern_pca_nf.MAX_BITS}, "
                                     f"got {tuple(t.shape)}")
        self.elem = int(self.elem)
        if self.elem not in (2, 4):
            raise ValueError(f"PCABasis: elem (bytes per basis value) must be 2 or 4, got {self.elem}")

    @property
    def k(self) -> int:
        return self.U.shape[1]

    @property
    def hidden_size(self) -> int:
        return self.U.shape[0]

    @property
    def grad_basis(self) -> torch.Tensor:
        """The basis the backward's coordinates are taken in: Ug if fitted, else U."""
        return self.U if self.Ug is None else self.Ug

    def nbytes(self) -> int:
        """Bytes to send this basis once: H + H*k + 2k values of ``elem`` bytes, plus H*k with
        Ug, plus one byte per code width (2k) with quant=nf."""
        return self.elem * (self.mean.numel() + self.U.numel() + self.sd.numel() + self.gsd.numel()
                            + (0 if self.Ug is None else self.Ug.numel())) \
            + (0 if self.bits is None else 2 * self.k)

    def to(self, device) -> "PCABasis":
        return PCABasis(self.mean.to(device), self.U.to(device), self.sd.to(device), self.gsd.to(device),
                        None if self.Ug is None else self.Ug.to(device), self.bits, self.gbits, self.elem)

    def state_dict(self) -> dict:
        sd = {"mean": self.mean, "U": self.U, "sd": self.sd, "gsd": self.gsd}
        if self.Ug is not None:
            sd["Ug"] = self.Ug
        if self.bits is not None:
            sd.update(bits=self.bits, gbits=self.gbits)
        if self.elem != 4:
            sd["elem"] = torch.tensor(self.elem)  # (a tensor: the file loads with weights_only)
        return sd


BACKWARDS = ("span", "gbasis", "dense")  # PCACodec's bwd option
QUANTS = ("absmax", "nf")  # PCACodec's quant option
BASIS_DTYPES = ("float32", "float16")  # PCACodec's basis_dtype option
PCA_BASES: dict[int, PCABasis] = {}  # boundary index -> basis; what a PCACodec uses unless given its own


def _sink_bytes(H: int, sink: bool, seq_len: int) -> int:
    """The position-0 row (H int8 codes + an fp32 scale) amortized over ``seq_len`` tokens."""
    return -(-(H + 4) // int(seq_len)) if sink else 0


def nf_code_bytes(H: int, budget: float = 15, sink: bool = True, seq_len: int = 128) -> int:
    """quant=nf: bytes of one token's code stream within B = floor(4H / budget) bytes per
    token per direction: B less the fp16 scale and the amortized sink row. ValueError if
    nothing fits."""
    n = int(4 * H // budget) - _sink_bytes(H, sink, seq_len) - 2
    if n < 1:
        raise ValueError(f"pca: budget={budget} leaves no room for a code at H={H}")
    return n


def pca_width(H: int, bits: int = 4, budget: float = 15, sink: bool = True, seq_len: int = 128) -> int:
    """Coordinates k per token that fit B = floor(4H / budget) bytes per token per direction
    (1/budget of dense fp32): k codes of ``bits`` bits plus one fp32 scale, and with
    ``sink`` the position-0 row (H int8 codes + fp32 scale) amortized over ``seq_len``
    tokens: ceil((H + 4) / seq_len) bytes. At most H. ValueError if nothing fits."""
    room = int(4 * H // budget) - _sink_bytes(H, sink, seq_len) - 4
    k = min(H, room if bits == 8 else 2 * room)
    if k < 1:
        raise ValueError(f"pca: budget={budget} leaves no room for a coordinate at H={H}")
    return k


class PCACodec(BoundaryCodec):
    """Calibrated PCA subspace + per-token quantization (see the module doc, ``pca``).

    ``k`` coordinates per token, explicit or from ``budget`` (``pca_width``; default 1/15
    of dense fp32 bytes). The basis of boundary b is ``bases[b]`` (default: the module's
    PCA_BASES, which orchestration.components.calibration fills); ``k`` must equal its width.
    ``calib_rows`` / ``grad_rows``: how many training rows calibration fits the basis on
    (default 64 with quant=nf, 16 with absmax) and of those, how many give the gradient std gsd.
    Wire per direction, for a boundary tensor [..., T, H]:
        sink=False: codes [..., T, ceil(k/2)] uint8 (int4, low nibble = even coordinate) or
                    [..., T, k] int8; scales [..., T, 1] fp32.
        sink=True:  position 0: [..., H] int8 + [..., 1] fp32 scale; positions 1..T-1 as
                    above, [..., T-1, .] codes and [..., T-1, 1] scales.
        bwd:        what the backward sends. span (default): U^T g, the exact adjoint of the
                    forward's projection (d h_hat / d h = U U^T). gbasis: Ug^T g in a basis of
                    the gradient's own (top-k eigenvectors of the calibration gradients'
                    second moment; the receiver gets Ug Ug^T g): the same bytes, more of the
                    gradient (on SmolLM2-135M the activations' span keeps ~49% of the
                    boundary gradient's energy, k = 288 of 576), but no longer the adjoint of
                    the forward: it approximates the dense model's gradient instead. dense:
                    g as it is, in the boundary dtype (an upper bound for experiments).
        adapt=True: forward only, one more tensor [2, k] fp32 per micro-batch: the mean and
                    std of every coordinate over the micro-batch's tokens (positions >= 1
                    with sink). The codes quantize (c - mean) / std instead of c: the
                    normalization follows the model as it trains, where the calibrated
                    mean and sd go stale (orchestration.diagnose.drift measures it: on the
                    default model after 60 steps, the stale normalization alone made the
                    forward error 0.59 of the activation energy, 0.013 with fresh mean and
                    sd and the same U). The backward is unchanged.
        quant:      nf (default): every coordinate its own
                    code width on a Gaussian code book (meshkern.pca_nf; 1-8 bits, chosen at
                    calibration by reverse water-filling on the coordinates' variances, so
                    the basis keeps every coordinate that gets a bit, k <= H), one fp16 scale
                    per token: codes [..., T', nbytes] uint8 and scales [..., T', 1] fp16
                    with nbytes = nf_code_bytes(H, budget); the backward allocates the same
                    bytes over the same k coordinates by the gradient std gsd. Not with k,
                    bits, adapt or bwd=gbasis. absmax: the int4/int8 layout above (the
                    default before issue #28's measurements: nf loses less at its bytes).
        basis_dtype: float32 (default) or float16: the basis is rounded to fp16 values at
                    calibration and counted at 2 bytes per value (both ends use the rounded
                    basis).
    """

    name = "pca"

    def __init__(self, bits: int = 4, k: int | None = None, budget: float | None = None, sink: bool = True,
                 seq_len: int = 128, bases: dict | None = None, calib_rows: int | None = None, grad_rows: int = 8,
                 adapt: bool = False, bwd: str = "span", quant: str = "nf", basis_dtype: str = "float32"):
        if quant not in QUANTS:
            raise ValueError(f"pca: quant must be one of {', '.join(QUANTS)}, got {quant!r}")
        if basis_dtype not in BASIS_DTYPES:
            raise ValueError(f"pca: basis_dtype must be one of {', '.join(BASIS_DTYPES)}, got {basis_dtype!r}")
        if quant == "nf" and (k is not None or bits != 4 or adapt or bwd == "gbasis"):
            given = ", ".join(n for n, v in (("k", k is not None), (f"bits={bits}", bits != 4), ("adapt", adapt),
                                             ("bwd=gbasis", bwd == "gbasis")) if v)
            raise ValueError(f"pca: {given}: only with quant=absmax (int4/int8 codes on the top k coordinates); "
                             "the default quant=nf chooses every coordinate's width from budget: add quant=absmax "
                             "(e.g. --boundary.codec pca:quant=absmax,adapt=true)")
        if calib_rows is None:  # nf's widths follow the calibrated variances: a 16-row basis overfits them
            calib_rows = 64 if quant == "nf" else 16
        self.quant, self.basis_dtype = quant, basis_dtype
        if bits not in (4, 8):
            raise ValueError(f"pca: bits must be 4 or 8, got {bits}")
        if k is not None and budget is not None:
            raise ValueError("pca: give k or budget, not both")
        if budget is not None and float(budget) <= 0:
            raise ValueError(f"pca: budget must be > 0, got {budget}")
        if int(seq_len) < 1:
            raise ValueError(f"pca: seq_len must be >= 1, got {seq_len}")
        self.bits, self.k = int(bits), optional_width("pca: k", k)
        self.budget = None if k is not None else float(15 if budget is None else budget)
        self.sink, self.seq_len = bool(sink), int(seq_len)
        if int(calib_rows) < 1 or int(grad_rows) < 0:
            raise ValueError(f"pca: calib_rows must be >= 1 and grad_rows >= 0, got {calib_rows}, {grad_rows}")
        self.calib_rows, self.grad_rows = int(calib_rows), int(grad_rows)  # orchestration.components.calibration's
        if not isinstance(adapt, bool):
            raise ValueError(f"pca: adapt must be true or false, got {adapt!r}")
        self.adapt = adapt
        if bwd not in BACKWARDS:
            raise ValueError(f"pca: bwd must be one of {', '.join(BACKWARDS)}, got {bwd!r}")
        if bwd == "gbasis" and self.grad_rows < 1:
            raise ValueError("pca: bwd=gbasis fits the gradient basis on calibration gradients: grad_rows must be >= 1")
        self.bwd = bwd
        self.bases = PCA_BASES if bases is None else bases
        self._dev: dict = {}

    def __repr__(self) -> str:
        return (f"PCACodec(bits={self.bits}, k={self.k}, budget={self.budget}, sink={self.sink}, "
                f"seq_len={self.seq_len}, adapt={self.adapt}, bwd={self.bwd}, quant={self.quant}, "
                f"basis_dtype={self.basis_dtype}, boundaries={sorted(self.bases)})")

    def width(self, H: int) -> int:
        """Coordinates per token; with quant=nf the basis calibration starts from (all H: the
        allocation then keeps those that get a bit, ``basis(b).k``)."""
        if self.quant == "nf":
            return H
        return width("pca: k", self.k, H, lambda: pca_width(H, self.bits, self.budget, self.sink, self.seq_len))

    def code_bytes(self, H: int) -> int:
        """quant=nf: bytes of one token's code stream (nf_code_bytes)."""
        return nf_code_bytes(H, self.budget, self.sink, self.seq_len)

    def fit_options(self, H: int) -> dict:
        """What orchestration.components.calibration.fit_basis needs beyond k and sink."""
        return {"gbasis": self.bwd == "gbasis", "half": self.basis_dtype == "float16",
                "nf_bits": 8 * self.code_bytes(H) if self.quant == "nf" else None}

    def basis(self, boundary: int, H: int, device) -> PCABasis:
        b = self.bases.get(int(boundary))
        if b is None:
            raise ValueError(f"pca: no basis for boundary {boundary} (calibrate first: "
                             f"orchestration.components.calibration); have {sorted(self.bases)}")
        if self.quant == "nf":
            if b.hidden_size != H or b.bits is None or int(b.bits.sum()) > 8 * self.code_bytes(H) \
                    or int(b.gbits.sum()) > 8 * self.code_bytes(H):
                raise ValueError(f"pca: boundary {boundary}'s basis is not a quant=nf basis for H={H} within "
                                 f"{self.code_bytes(H)} code bytes per token (calibrate with this codec)")
        elif (b.hidden_size, b.k) != (H, self.width(H)) or b.bits is not None:
            raise ValueError(f"pca: boundary {boundary}'s basis is [{b.hidden_size}, {b.k}]"
                             f"{' (quant=nf)' if b.bits is not None else ''}, this codec needs [{H}, {self.width(H)}]")
        if self.bwd == "gbasis" and b.Ug is None:
            raise ValueError(f"pca: bwd=gbasis, and boundary {boundary}'s basis has no gradient basis "
                             "(calibrate with bwd=gbasis)")
        ck = (int(boundary), str(device), id(b))
        if ck not in self._dev:
            self._dev[ck] = b.to(device)
        return self._dev[ck]

    def wire_specs(self, shape, dtype, direction):
        check_direction(direction)
        shape = boundary_shape(shape, dtype)
        H, k = shape[-1], self.width(shape[-1])
        cw = (k + 1) // 2 if self.bits == 4 else k
        cdt = torch.uint8 if self.bits == 4 else torch.int8
        if direction == "bwd" and self.bwd == "dense":
            return [(shape, dtype)]
        if self.quant == "nf":
            return meshkern_pca_nf.wire_shapes(shape, self.code_bytes(H), self.sink)
        stats = [((2, k), torch.float32)] if self.adapt and direction == "fwd" else []
        if not self.sink:
            return [(shape[:-1] + (cw,), cdt), (shape[:-1] + (1,), torch.float32)] + stats
        lead, T = shape[:-2], shape[-2]
        return [(lead + (H,), torch.int8), (lead + (1,), torch.float32),
                (lead + (T - 1, cw), cdt), (lead + (T - 1, 1), torch.float32)] + stats

    def _encode(self, x, basis: PCABasis, norm: torch.Tensor, center: bool) -> list[torch.Tensor]:
        if self.quant == "nf":
            return meshkern_pca_nf.encode(
                x, basis.U, norm, basis.bits if center else basis.gbits, self.code_bytes(x.shape[-1]),
                mean=basis.mean if center else None, sink=self.sink)
        if self.adapt and center:
            return self._encode_adapted(x, basis)
        mean = basis.mean if center else None  # the fused op (C++ / Triton kernels; its reference is this math)
        U = basis.U if center else basis.grad_basis
        return meshkern_pca.encode(x.detach(), U, norm, mean=mean, bits=self.bits, sink=self.sink)

    def _encode_adapted(self, x, basis: PCABasis) -> list[torch.Tensor]:
        """adapt's forward: the coordinates re-centred and re-scaled by this micro-batch's own
        mean and std per coordinate, which travel last as [2, k]; quantized as the op does."""
        x = x.detach().float()
        head, body = (x[..., 0, :], x[..., 1:, :]) if self.sink else (None, x)
        c = (body - basis.mean) @ basis.U / basis.sd
        flat = c.reshape(-1, c.shape[-1])
        mu = flat.mean(0)
        sd = (flat - mu).pow(2).mean(0).sqrt().clamp_min(1e-20)
        wire = meshkern_pca.quantize_reference((c - mu) / sd, self.bits)
        if self.sink:
            wire = meshkern_pca.quantize_reference(head, 8) + wire
        return wire + [torch.stack([mu, sd])]

    def _decode(self, wire, basis: PCABasis, norm: torch.Tensor, center: bool, shape, dtype) -> torch.Tensor:
        mean = basis.mean if center else None
        if self.quant == "nf":
            if any(bool((t <= 0).any()) for t in wire if t.dtype.is_floating_point):  # (finite: validate_wire)
                raise NonFiniteWire("pca decode: received non-positive scales")
            return meshkern_pca_nf.decode(wire, basis.U, norm, basis.bits if center else basis.gbits,
                                                    shape, dtype, mean=mean, sink=self.sink)
        if self.adapt and center:
            # c = (q * scale * sd_mb + mu_mb) * sd, so the op decodes with norm sd * sd_mb and
            # the micro-batch mean folded into the mean: mean + U (sd * mu_mb).
            wire, (mu, sd) = wire[:-1], wire[-1]
            if not bool((sd > 0).all()):
                raise NonFiniteWire("pca decode_fwd: the micro-batch's coordinate stds must be > 0")
            norm, mean = norm * sd, mean + basis.U @ (norm * mu)
        return meshkern_pca.decode(wire, basis.U if center else basis.grad_basis, norm, shape=shape, dtype=dtype,
                                   mean=mean, bits=self.bits, sink=self.sink)

    def encode_fwd(self, h, key):
        b = self.basis(key.boundary, h.shape[-1], h.device)
        return self._encode(h, b, b.sd, True), (tuple(h.shape), h.dtype, int(key.boundary))

    def decode_fwd(self, wire, key, shape, dtype):
        shape = tuple(shape)
        validate_wire(wire, self.wire_specs(shape, dtype, "fwd"), "pca decode_fwd")
        b = self.basis(key.boundary, shape[-1], wire[0].device)
        return self._decode(wire, b, b.sd, True, shape, dtype)

    def encode_bwd(self, grad, key, meta):
        # span: d h_hat / d h = U U^T (straight-through quantizer): the sender needs U^T g, k
        # per token; gbasis: Ug^T g; dense: g itself (class doc, bwd).
        if self.bwd == "dense":
            return [grad.detach().contiguous()]
        b = self.basis(key.boundary, grad.shape[-1], grad.device)
        return self._encode(grad, b, b.gsd, False)

    def decode_bwd(self, wire, key, ctx):
        shape, dtype, boundary = ctx
        validate_wire(wire, self.wire_specs(shape, dtype, "bwd"), "pca decode_bwd")
        if self.bwd == "dense":
            return wire[0]
        b = self.basis(boundary, shape[-1], wire[0].device)
        return self._decode(wire, b, b.gsd, False, shape, dtype)

