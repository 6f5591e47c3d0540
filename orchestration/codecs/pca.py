"""``pca:quant=absmax``: a calibrated per-boundary PCA basis (orchestration.components.calibration
fits it; the shared parts are orchestration.codecs.pca_base's) with int4 or int8 codes of the
top k coordinates per token and one fp32 absmax scale (meshkern.pca's fused ops). The default
``pca`` layout (quant=nf) is orchestration.codecs.pca_nf's PCANFCodec."""
from __future__ import annotations

import torch

from meshkern import pca as meshkern_pca
from orchestration.codecs.base import NonFiniteWire, optional_width, width
from orchestration.codecs.pca_base import PCA_BASES, PCABaseCodec, PCABasis, sink_bytes, sink_encode

__all__ = ["PCACodec", "PCABasis", "PCA_BASES", "pca_width"]


def pca_width(H: int, bits: int = 4, budget: float = 15, sink: bool = True, seq_len: int = 128) -> int:
    """Coordinates k per token that fit B = floor(4H / budget) bytes per token per direction
    (1/budget of dense fp32): k codes of ``bits`` bits plus one fp32 scale, and with
    ``sink`` the position-0 row (H int8 codes + fp32 scale) amortized over ``seq_len``
    tokens: ceil((H + 4) / seq_len) bytes. At most H. ValueError if nothing fits."""
    room = int(4 * H // budget) - sink_bytes(H, sink, seq_len) - 4
    k = min(H, room if bits == 8 else 2 * room)
    if k < 1:
        raise ValueError(f"pca: budget={budget} leaves no room for a coordinate at H={H}")
    return k


class PCACodec(PCABaseCodec):
    """Calibrated PCA subspace + per-token absmax quantization (``pca:quant=absmax``; the
    options it shares with the nf layout: PCABaseCodec).

    ``k`` coordinates per token, explicit or from ``budget`` (``pca_width``; default 1/15
    of dense fp32 bytes); ``k`` must equal the width of boundary b's basis ``bases[b]``.
    ``calib_rows`` defaults to 16.
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
    (The default layout before issue #28's measurements: quant=nf loses less at its bytes.)
    """

    quant = "absmax"
    CALIB_ROWS = 16

    def __init__(self, bits: int = 4, k: int | None = None, budget: float | None = None, sink: bool = True,
                 seq_len: int = 128, bases: dict | None = None, calib_rows: int | None = None, grad_rows: int = 8,
                 adapt: bool = False, bwd: str = "span", quant: str = "absmax", basis_dtype: str = "float32"):
        if k is not None and budget is not None:
            raise ValueError("pca: give k or budget, not both")
        super().__init__(budget, sink, seq_len, bases, calib_rows, grad_rows, bwd, basis_dtype, quant)
        if bits not in (4, 8):
            raise ValueError(f"pca: bits must be 4 or 8, got {bits}")
        self.bits, self.k = int(bits), optional_width("pca: k", k)
        if self.k is not None:
            self.budget = None
        if not isinstance(adapt, bool):
            raise ValueError(f"pca: adapt must be true or false, got {adapt!r}")
        self.adapt = adapt

    def __repr__(self) -> str:
        return (f"PCACodec(bits={self.bits}, k={self.k}, budget={self.budget}, sink={self.sink}, "
                f"seq_len={self.seq_len}, adapt={self.adapt}, bwd={self.bwd}, quant={self.quant}, "
                f"basis_dtype={self.basis_dtype}, boundaries={sorted(self.bases)})")

    def width(self, H: int) -> int:
        """Coordinates per token."""
        return width("pca: k", self.k, H, lambda: pca_width(H, self.bits, self.budget, self.sink, self.seq_len))

    def _check_basis(self, boundary, b, H):
        if (b.hidden_size, b.k) != (H, self.width(H)) or b.bits is not None:
            raise ValueError(f"pca: boundary {boundary}'s basis is [{b.hidden_size}, {b.k}]"
                             f"{' (quant=nf)' if b.bits is not None else ''}, this codec needs [{H}, {self.width(H)}]")

    def _wire_specs(self, shape, direction):
        H, k = shape[-1], self.width(shape[-1])
        cw = (k + 1) // 2 if self.bits == 4 else k
        cdt = torch.uint8 if self.bits == 4 else torch.int8
        stats = [((2, k), torch.float32)] if self.adapt and direction == "fwd" else []
        if not self.sink:
            return [(shape[:-1] + (cw,), cdt), (shape[:-1] + (1,), torch.float32)] + stats
        lead, T = shape[:-2], shape[-2]
        return [(lead + (H,), torch.int8), (lead + (1,), torch.float32),
                (lead + (T - 1, cw), cdt), (lead + (T - 1, 1), torch.float32)] + stats

    def _encode(self, x, basis, norm, center):
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
            wire = sink_encode(head) + wire
        return wire + [torch.stack([mu, sd])]

    def _decode(self, wire, basis, norm, center, shape, dtype):
        mean = basis.mean if center else None
        if self.adapt and center:
            # c = (q * scale * sd_mb + mu_mb) * sd, so the op decodes with norm sd * sd_mb and
            # the micro-batch mean folded into the mean: mean + U (sd * mu_mb).
            wire, (mu, sd) = wire[:-1], wire[-1]
            if not bool((sd > 0).all()):
                raise NonFiniteWire("pca decode_fwd: the micro-batch's coordinate stds must be > 0")
            norm, mean = norm * sd, mean + basis.U @ (norm * mu)
        return meshkern_pca.decode(wire, basis.U if center else basis.grad_basis, norm, shape=shape, dtype=dtype,
                                   mean=mean, bits=self.bits, sink=self.sink)
