"""What the two ``pca`` codecs share: ``PCABasis`` (one boundary's calibrated basis),
``PCA_BASES`` (the process-wide basis table) and ``PCABaseCodec``, their base class: the
options both take, the basis lookup, the four encode/decode steps around the layout's own
``_encode`` / ``_decode``, and what calibration and byte counting ask of a codec.

The layouts: ``pca`` / ``pca:quant=nf`` (the default) is orchestration.codecs.pca_nf's
PCANFCodec, ``pca:quant=absmax`` (int4/int8 on the top k coordinates) is
orchestration.codecs.pca's PCACodec; orchestration.codecs.registry picks one by ``quant``."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from meshkern._checks import boundary_shape
from meshkern.pca import dequantize_reference, quantize_reference
from meshkern.pca_nf import MAX_BITS
from orchestration.codecs.base import BoundaryCodec, check_direction, validate_wire


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
                if tuple(t.shape) != (k,) or bool((t < 0).any()) or bool((t > MAX_BITS).any()):
                    raise ValueError(f"PCABasis: {name} must be [k={k}] code widths in 0..{MAX_BITS}, "
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



BACKWARDS = ("span", "gbasis", "dense")  # the bwd option
QUANTS = ("absmax", "nf")  # the quant option: which layout (class) a pca spec means
BASIS_DTYPES = ("float32", "float16")  # the basis_dtype option
# What a pca codec uses unless given its own bases, looked up by the MaskKey's boundary. In a
# run, orchestration.components.calibration installs the run's bases here keyed by the decoder
# layer each boundary sits after, and gives every trainer's codec its replica's view instead
# ({stage boundary: basis}; replicas of different depths cut after different layers).
PCA_BASES: dict[int, PCABasis] = {}


SINK_BITS = 8  # the sink row's codes: int8 over all H dims, one fp32 absmax scale per row


def sink_encode(row: torch.Tensor) -> list[torch.Tensor]:
    """The sink row's wire: ``row`` [..., H] (read as fp32) as [int8 codes [..., H], fp32
    absmax scale [..., 1]] (meshkern.pca.quantize_reference at 8 bits: the quantizer both
    layouts' ops use for position 0; the fused C++ / Triton head quantizer is bit-identical
    to it, tests/test_pca_ops.py)."""
    return quantize_reference(row, SINK_BITS)


def sink_decode(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 [..., H] from ``sink_encode``'s wire (as both layouts' decode rebuilds position 0)."""
    return dequantize_reference(codes, scale, codes.shape[-1], SINK_BITS)


def sink_round_trip(row: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``row`` [..., H] as a ``sink=True`` pca codec delivers position 0 to the next stage:
    ``sink_decode(sink_encode(row))`` cast to ``dtype`` (default row's, as the codec's decode
    casts to the boundary's dtype). What a model trained through such a codec keeps at its
    boundary layers when deployed (orchestration.models.boundary_transform)."""
    return sink_decode(*sink_encode(row)).to(row.dtype if dtype is None else dtype)


def sink_bytes(H: int, sink: bool, seq_len: int) -> int:
    """The position-0 row (H int8 codes + an fp32 scale) amortized over ``seq_len`` tokens."""
    return -(-(H + 4) // int(seq_len)) if sink else 0


class PCABaseCodec(BoundaryCodec):
    """A calibrated per-boundary PCA basis (``bases[b]``, default PCA_BASES, which
    orchestration.components.calibration fills) and per-token codes of its coordinates; a
    subclass is one layout of the codes (``quant``; its class doc has the wire).

    Options both layouts take: ``budget`` (the bytes per token per direction: 1/budget of
    dense fp32, default 15), ``sink`` (position 0 of every row travels as int8 over all H
    dims, both ways), ``seq_len`` (the row length the sink row's bytes are amortized over),
    ``calib_rows`` / ``grad_rows`` (how many training rows calibration fits the basis on,
    default the layout's ``CALIB_ROWS``, and of those how many give the gradient std gsd),
    ``bwd`` (what the backward sends: span, U^T g, the exact adjoint of the forward's
    projection; gbasis, Ug^T g in a basis of the gradient's own; dense, g as it is) and
    ``basis_dtype`` (float32, or float16: the basis rounded to fp16 values at calibration
    and counted at 2 bytes per value; both ends use the rounded basis)."""

    name = "pca"
    quant = ""  # the layout's value of the quant option
    CALIB_ROWS = 16  # calib_rows' default
    needs_calibration = True  # its bases are fitted on the model before training (BoundaryCodec)

    def __init__(self, budget: float | None = None, sink: bool = True, seq_len: int = 128, bases: dict | None = None,
                 calib_rows: int | None = None, grad_rows: int = 8, bwd: str = "span", basis_dtype: str = "float32",
                 quant: str | None = None):
        quant = self.quant if quant is None else quant
        if quant not in QUANTS:
            raise ValueError(f"pca: quant must be one of {', '.join(QUANTS)}, got {quant!r}")
        if quant != self.quant:  # a class is one layout: make_codec("pca:quant=...") picks the class
            raise ValueError(f"pca: {type(self).__name__} is the quant={self.quant} layout, not quant={quant} "
                             f"(make_codec('pca:quant={quant}') builds that one)")
        if basis_dtype not in BASIS_DTYPES:
            raise ValueError(f"pca: basis_dtype must be one of {', '.join(BASIS_DTYPES)}, got {basis_dtype!r}")
        self.basis_dtype = basis_dtype
        if budget is not None and float(budget) <= 0:
            raise ValueError(f"pca: budget must be > 0, got {budget}")
        if int(seq_len) < 1:
            raise ValueError(f"pca: seq_len must be >= 1, got {seq_len}")
        self.budget = float(15 if budget is None else budget)
        self.sink, self.seq_len = bool(sink), int(seq_len)
        calib_rows = self.CALIB_ROWS if calib_rows is None else calib_rows
        if int(calib_rows) < 1 or int(grad_rows) < 0:
            raise ValueError(f"pca: calib_rows must be >= 1 and grad_rows >= 0, got {calib_rows}, {grad_rows}")
        self.calib_rows, self.grad_rows = int(calib_rows), int(grad_rows)  # orchestration.components.calibration's
        if bwd not in BACKWARDS:
            raise ValueError(f"pca: bwd must be one of {', '.join(BACKWARDS)}, got {bwd!r}")
        if bwd == "gbasis" and self.grad_rows < 1:
            raise ValueError("pca: bwd=gbasis fits the gradient basis on calibration gradients: grad_rows must be >= 1")
        self.bwd = bwd
        self.bases = PCA_BASES if bases is None else bases
        self._dev: dict = {}

    # ------------------------------------------------------------ what a layout says
    def width(self, H: int) -> int:
        """Coordinates per token the basis is fitted with (orchestration.components.calibration)."""
        raise NotImplementedError

    def _check_basis(self, boundary: int, b: PCABasis, H: int) -> None:
        """ValueError unless ``b`` is a basis of this layout for hidden size H."""
        raise NotImplementedError

    def _wire_specs(self, shape: tuple[int, ...], direction: str) -> list:
        raise NotImplementedError

    def _encode(self, x, basis: PCABasis, norm: torch.Tensor, center: bool) -> list[torch.Tensor]:
        """The wire of x [..., T, H]: forward (``center``: mean subtracted, norm = sd) or backward."""
        raise NotImplementedError

    def _decode(self, wire, basis: PCABasis, norm: torch.Tensor, center: bool, shape, dtype) -> torch.Tensor:
        raise NotImplementedError

    # ------------------------------------------------------------ calibration, bytes
    def fit_options(self, H: int) -> dict:
        """What orchestration.components.calibration.fit_basis needs beyond k and sink."""
        return {"gbasis": self.bwd == "gbasis", "half": self.basis_dtype == "float16"}

    def one_off_bytes(self, boundary: int) -> int:
        """The basis of ``boundary``, sent once (PCABasis.nbytes)."""
        return self.bases[int(boundary)].nbytes()

    def token_bytes(self, H: int, dtype: torch.dtype, direction: str) -> int:
        """Per token over a row of ``seq_len`` (the sink row is per row), rounded up."""
        return -(-self.wire_bytes((1, self.seq_len, H), dtype, direction) // self.seq_len)

    # ------------------------------------------------------------ the codec steps
    def basis(self, boundary: int, H: int, device) -> PCABasis:
        b = self.bases.get(int(boundary))
        if b is None:
            raise ValueError(f"pca: no basis for boundary {boundary} (calibrate first: "
                             f"orchestration.components.calibration); have {sorted(self.bases)}")
        self._check_basis(boundary, b, H)
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
        if direction == "bwd" and self.bwd == "dense":
            return [(shape, dtype)]
        return self._wire_specs(shape, direction)

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
        # per token; gbasis: Ug^T g; dense: g itself (the class doc, bwd).
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
