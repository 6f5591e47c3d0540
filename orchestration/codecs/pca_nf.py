"""``pca`` / ``pca:quant=nf`` (the default pca codec): a calibrated per-boundary PCA basis
(orchestration.components.calibration fits it; the shared parts are
orchestration.codecs.pca_base's) whose coordinates each get a code width of their own on a
Gaussian code book, packed into one bit stream per token (meshkern.pca_nf's ops). The
int4/int8 layout (quant=absmax) is orchestration.codecs.pca's PCACodec."""
from __future__ import annotations

from meshkern import pca_nf as meshkern_pca_nf
from orchestration.codecs.base import NonFiniteWire
from orchestration.codecs.pca_base import PCABaseCodec, sink_bytes

__all__ = ["PCANFCodec", "nf_code_bytes"]


def nf_code_bytes(H: int, budget: float = 15, sink: bool = True, seq_len: int = 128) -> int:
    """Bytes of one token's code stream within B = floor(4H / budget) bytes per token per
    direction: B less the fp16 scale and the amortized sink row. ValueError if nothing fits."""
    n = int(4 * H // budget) - sink_bytes(H, sink, seq_len) - 2
    if n < 1:
        raise ValueError(f"pca: budget={budget} leaves no room for a code at H={H}")
    return n


class PCANFCodec(PCABaseCodec):
    """Calibrated PCA basis, every coordinate its own code width (``pca:quant=nf``; the
    options it shares with the absmax layout: PCABaseCodec).

    The widths (1-8 bits, meshkern.pca_nf) are chosen at calibration by reverse
    water-filling on the coordinates' variances within ``nf_code_bytes(H, budget)`` bytes
    per token, and the basis keeps every coordinate that gets a bit (k <= H); the backward
    allocates the same bytes over the same k coordinates by the gradient std gsd. One fp16
    scale per token. ``calib_rows`` defaults to 64: the widths follow the calibrated
    variances, and a 16-row basis overfits them (results/NOTEBOOK.md).
    Wire per direction, for a boundary tensor [..., T, H] (T' = T - 1 with sink, else T):
        codes [..., T', nbytes] uint8 and scales [..., T', 1] fp16, nbytes = nf_code_bytes;
        with sink first position 0: [..., H] int8 + [..., 1] fp32 scale.
    ``alloc``: how the forward's widths are allocated at calibration: ``var`` (default) by
    each coordinate's variance, ``loss`` by its variance times the calibration gradient's
    mean square along it (orchestration.components.calibration.fit_basis); the same bytes.
    ``bwd_budget``: the backward's bytes per token as 1/bwd_budget of dense fp32 (default
    ``budget``: the same each way), for splitting the default's bytes unevenly between the
    directions (e.g. budget=10,bwd_budget=30 sends 230 B forward and 76 B back at H = 576,
    the 153 + 153 of budget=15 in all); with bwd=span only.
    ``k``, ``bits``, ``adapt`` (and bwd=gbasis) belong to quant=absmax: this class takes
    them only to refuse any value but their defaults with the fix in the message (a spec
    such as pca:adapt=true means the int4 layout, and says so).
    """

    quant = "nf"
    CALIB_ROWS = 64

    def __init__(self, budget: float | None = None, sink: bool = True, seq_len: int = 128, bases: dict | None = None,
                 calib_rows: int | None = None, grad_rows: int = 8, bwd: str = "span", quant: str = "nf",
                 basis_dtype: str = "float32", k: int | None = None, bits: int = 4, adapt: bool = False,
                 alloc: str = "var", bwd_budget: float | None = None):
        if k is not None or bits != 4 or adapt or bwd == "gbasis":
            given = ", ".join(n for n, v in (("k", k is not None), (f"bits={bits}", bits != 4), ("adapt", adapt),
                                             ("bwd=gbasis", bwd == "gbasis")) if v)
            raise ValueError(f"pca: {given}: only with quant=absmax (int4/int8 codes on the top k coordinates); "
                             "the default quant=nf chooses every coordinate's width from budget: add quant=absmax "
                             "(e.g. --boundary.codec pca:quant=absmax,adapt=true)")
        super().__init__(budget, sink, seq_len, bases, calib_rows, grad_rows, bwd, basis_dtype, quant)
        if alloc not in ("var", "loss"):
            raise ValueError(f"pca: alloc must be var or loss, got {alloc!r}")
        if alloc == "loss" and self.grad_rows < 1:
            raise ValueError("pca: alloc=loss weighs the code widths by calibration gradients: grad_rows must be >= 1")
        self.alloc = alloc
        if bwd_budget is not None and (bwd != "span" or float(bwd_budget) <= 0):
            raise ValueError(f"pca: bwd_budget must be > 0 and comes with bwd=span (the backward's coordinates), "
                             f"got bwd_budget={bwd_budget}, bwd={bwd}")
        self.bwd_budget = self.budget if bwd_budget is None else float(bwd_budget)

    def __repr__(self) -> str:
        return (f"PCANFCodec(budget={self.budget}, sink={self.sink}, seq_len={self.seq_len}, bwd={self.bwd}, "
                f"basis_dtype={self.basis_dtype}, alloc={self.alloc}, bwd_budget={self.bwd_budget}, "
                f"boundaries={sorted(self.bases)})")

    def width(self, H: int) -> int:
        """The coordinates calibration starts from: all H (the allocation then keeps those
        that get a bit, ``basis(b).k``)."""
        return H

    def code_bytes(self, H: int, direction: str = "fwd") -> int:
        """Bytes of one token's code stream in ``direction`` (nf_code_bytes at ``budget``
        forward, ``bwd_budget`` backward)."""
        return nf_code_bytes(H, self.budget if direction == "fwd" else self.bwd_budget, self.sink, self.seq_len)

    def fit_options(self, H: int) -> dict:
        return {**super().fit_options(H), "nf_bits": 8 * self.code_bytes(H), "gnf_bits": 8 * self.code_bytes(H, "bwd"),
                "alloc": self.alloc}

    def _check_basis(self, boundary, b, H):
        if b.hidden_size != H or b.bits is None or int(b.bits.sum()) > 8 * self.code_bytes(H) \
                or int(b.gbits.sum()) > 8 * self.code_bytes(H, "bwd"):
            raise ValueError(f"pca: boundary {boundary}'s basis is not a quant=nf basis for H={H} within "
                             f"{self.code_bytes(H)} / {self.code_bytes(H, 'bwd')} code bytes per token forward / "
                             "backward (calibrate with this codec)")

    def _wire_specs(self, shape, direction):
        return meshkern_pca_nf.wire_shapes(shape, self.code_bytes(shape[-1], direction), self.sink)

    def _encode(self, x, basis, norm, center):
        return meshkern_pca_nf.encode(x, basis.U, norm, basis.bits if center else basis.gbits,
                                      self.code_bytes(x.shape[-1], "fwd" if center else "bwd"),
                                      mean=basis.mean if center else None, sink=self.sink)

    def _decode(self, wire, basis, norm, center, shape, dtype):
        if any(bool((t <= 0).any()) for t in wire if t.dtype.is_floating_point):  # (finite: validate_wire)
            raise NonFiniteWire("pca decode: received non-positive scales")
        return meshkern_pca_nf.decode(wire, basis.U, norm, basis.bits if center else basis.gbits, shape, dtype,
                                      mean=basis.mean if center else None, sink=self.sink)
