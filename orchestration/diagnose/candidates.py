"""The diagnose-local candidate designs (``CANDIDATES``): boundary transforms that are not
(yet) codecs of ``orchestration.codecs``, each held to <= 1/``budget`` of the dense bytes
per token per direction, and the mean + top-k PCA sweep rows.

Bytes: a candidate counts every value it sends per token (fp32 values, int8/int4 codes,
per-token fp32 scales, 4 bytes for a token id where the receiver needs the ids); what is
fixed per boundary (a calibrated mean, PCA basis, dim set) is sent once and counts as free.
Masks use meshkern's Philox mask with ``MaskKey(seed, L, 0, 0)``, as the codecs do.

Backward: plain autograd of the transform (a projection's gradient is projected the same
way; a quantizer is straight-through, so its gradient is *not* quantized here, unlike the
int8/int4 codecs'), except the ``/gpca`` rows, whose backward is their own map.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from orchestration.components.calibration import PCA, fit_pca, inlier_tokens
from orchestration.codecs import QuantCodec
from orchestration.diagnose.common import UsageError
from orchestration.diagnose.transforms import Fn, Transform, dense_bytes

ID_BYTES = 4  # a token id (int32) where the receiver needs the ids
SCALE_BYTES = 4  # a per-token fp32 quantization scale


@dataclass
class Calibration:
    """What a candidate fixes per boundary from calibration rows (sent once, free per token)."""
    tokens: torch.Tensor  # calibration hidden states [N, H]
    pca: PCA  # of h
    pca_res: PCA  # of h - embed(ids)
    dim_order: torch.Tensor  # dims by calibration mean |h|, descending
    mean: torch.Tensor  # per-dim mean of h
    grad_pca: PCA | None = None  # of the dense boundary gradients of calibration rows (grad_calibration)
    pca_robust: PCA | None = None  # of h without the outlier tokens (norm >= 10x the median: attention sinks)


def calibrate(h_cal: torch.Tensor, e_cal: torch.Tensor, pca: PCA | None = None,
              grad_pca: PCA | None = None) -> Calibration:
    """The per-boundary fits of calibration hidden states h_cal [..., H] and their token
    embeddings e_cal; ``pca`` (of h_cal) and ``grad_pca`` are reused when given."""
    H = h_cal.shape[-1]
    x = h_cal.reshape(-1, H).float()
    inl = inlier_tokens(h_cal, sink=False)  # the pca codec's own outlier rule (calibration.py)
    pca = pca or fit_pca(x)
    return Calibration(x, pca, fit_pca(x - e_cal.reshape(-1, H).float()),
                       torch.argsort(x.abs().mean(0), descending=True), x.mean(0), grad_pca,
                       pca if inl.shape[0] == x.shape[0] else fit_pca(inl))


class _TwoWay(torch.autograd.Function):
    """fwd(h) forward, bwd(grad) backward: a codec whose two directions use different maps."""

    @staticmethod
    def forward(ctx, h, fwd, bwd):
        ctx.bwd = bwd
        with torch.no_grad():
            return fwd(h)

    @staticmethod
    def backward(ctx, g):
        with torch.no_grad():
            return ctx.bwd(g), None, None


def _ste(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """q in the forward, identity gradient (straight-through)."""
    return x + (q - x).detach()


def _quant(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Per-token absmax quantization with the codecs' own quantizer (QuantCodec), STE."""
    qc = QuantCodec(bits)
    return _ste(x, qc.dequantize(qc.quantize(x.detach()), tuple(x.shape), x.dtype))


def quant_bytes(n: int, bits: int) -> int:
    """Bytes per token of n codes of ``bits`` bits plus one fp32 scale."""
    return (n if bits == 8 else (n + 1) // 2) + SCALE_BYTES


def random_mask(x: torch.Tensor, K: int, key, fill: torch.Tensor | None = None,
                bits: int | None = None) -> torch.Tensor:
    """meshkern's Philox mask keeping K of the last-dim values of every token (autograd
    through meshkern.pack/unpack, the MaskCodec's ops); a dropped value becomes ``fill``
    (per dim) or 0; kept values (minus fill) optionally quantized to ``bits``."""
    import meshkern
    from meshkern.mask import kept_dims

    n = x.shape[-1]
    p = 1.0 - K / n
    if kept_dims(n, p) != K:
        raise AssertionError(f"mask p={p} keeps {kept_dims(n, p)} of {n}, wanted {K}")
    xc = x - fill if fill is not None else x
    v = meshkern.pack(xc, key, p)
    if bits is not None:
        v = _quant(v, bits)
    out = meshkern.unpack(v, key, n, p)
    return out + fill if fill is not None else out


def pca_project(x: torch.Tensor, pca: PCA, k: int, bits: int | None = None) -> torch.Tensor:
    """mean + top-k PCA reconstruction of x; with ``bits`` the k coordinates are divided by
    their calibration std and quantized per token (straight-through)."""
    U = pca.basis(k)
    c = (x - pca.mean) @ U
    if bits is not None:
        sd = pca.eigvals[:k].clamp_min(1e-30).sqrt().float()
        c = _quant(c / sd, bits) * sd
    return pca.mean + c @ U.T


CANDIDATES = {
    "pca": "mean + top-k PCA directions of h (fitted on calibration rows); k fp32 coordinates per token",
    "mean+mask": "Philox random mask of k dims; dropped dims get their calibration mean instead of 0",
    "massive+mask": "the m largest-|h| dims (a fixed set from calibration) exactly + Philox mask of k-m of "
                    "the other dims, zeros elsewhere",
    "massive+mean+mask": "as massive+mask, dropped dims get their calibration mean",
    "massive+pca": "the m largest-|h| dims exactly + mean + top-(k-m) PCA of the other dims",
    "emb+mask": "sends h - embed(ids) random-masked (k-1 values + the 4-byte id); receiver re-adds embed(ids)",
    "emb+mean+mask": "as emb+mask, dropped dims of h - embed(ids) get their calibration mean",
    "emb+pca": "mean + top-(k-1) PCA of h - embed(ids) + the id; receiver re-adds embed(ids)",
    "pca-int8": "PCA coordinates divided by their calibration std, int8 per token (fp32 absmax scale): "
                "B-4 directions",
    "pca-int4": "as pca-int8 with int4 codes: 2(B-4) directions",
    "emb+pca-int8": "pca-int8 of h - embed(ids) + the id (B-8 directions); receiver re-adds embed(ids)",
    "mean+mask-int8": "Philox random mask of B-4 dims sent as int8 (per-token scale), dropped dims get their mean",
    "pca-int8/gpca-int8": "forward as pca-int8; backward: the gradient's own PCA basis (fitted on dense boundary "
                          "gradients of calibration rows), B-4 int8 coordinates per token (needs the gradient pass)",
    "pca-int4/gpca-int4": "as pca-int8/gpca-int8 with int4 codes, 2(B-4) directions each way",
    "sink+pca": "PCA fitted without the outlier tokens (norm >= 10x median: attention sinks); position 0 of every "
                "row travels as int8 over all H dims ((H+4)/T bytes per token), the other tokens as pca",
    "sink+pca-int8": "as sink+pca with the pca-int8 coordinates",
    "sink+pca-int4": "as sink+pca with the pca-int4 coordinates",
    "sink+pca-int4/gpca-int4": "as sink+pca-int4 forward; backward in the gradient PCA basis, int4",
}


def candidate_transforms(cal: Calibration, embed, H: int, L: int, seed: int, budget: int,
                         names: Sequence[str] | None = None, massive_m: int = 8,
                         dtype=torch.float32, seq_len: int = 128) -> list[Transform]:
    """The diagnose-local candidate designs (CANDIDATES) at <= B = dense_bytes/budget bytes
    per token per direction: k = B // 4 fp32 values, m = min(massive_m, k // 2) massive
    dims; sink+* spend ceil((H+4)/seq_len) of B on position 0. A candidate that cannot fit
    this H at this budget is left out."""
    from meshkern.mask import MaskKey

    elem = torch.empty((), dtype=dtype).element_size()
    B = dense_bytes(H, dtype) // budget
    k = B // elem
    m = min(massive_m, k // 2)
    key = MaskKey(seed, L, 0, 0)
    mu = cal.mean
    massive = cal.dim_order[:m].sort().values
    keep = torch.ones(H, dtype=torch.bool)
    keep[massive] = False
    rest = keep.nonzero().squeeze(1)
    names = list(CANDIDATES) if names is None else list(names)
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        raise UsageError(f"unknown candidate {unknown[0]!r}; choose from {', '.join(CANDIDATES)}")

    def emb(ids):  # the receiver's copy of the embedding: a constant for the boundary's gradient
        return embed(ids).detach()

    def with_massive(h, r_hat):
        return torch.zeros_like(h).index_copy(-1, rest, r_hat).index_copy(-1, massive, h[..., massive])

    pca_rest = fit_pca(cal.tokens[:, rest]) if m and "massive+pca" in names else None
    n8, n4, n8e = min(H, B - SCALE_BYTES), min(H, 2 * (B - SCALE_BYTES)), min(H, B - SCALE_BYTES - ID_BYTES)
    pos0 = -(-(quant_bytes(H, 8)) // seq_len)  # position 0 as int8 (H codes + scale), amortized over the row
    Bs = B - pos0
    ks, ns8, ns4 = Bs // elem, min(H, Bs - SCALE_BYTES), min(H, 2 * (Bs - SCALE_BYTES))
    rp = cal.pca_robust or cal.pca

    def sink(f):
        def g(h, ids):
            return torch.cat([_quant(h[..., :1, :], 8), f(h[..., 1:, :], ids)], dim=-2)
        return g
    table: dict[str, tuple[bool, Fn, int]] = {
        "pca": (k >= 1, lambda h, ids: pca_project(h, cal.pca, k), k * elem),
        "mean+mask": (k >= 1, lambda h, ids: random_mask(h, k, key, mu), k * elem),
        "massive+mask": (m >= 1 and k - m >= 1,
                         lambda h, ids: with_massive(h, random_mask(h[..., rest], k - m, key)), k * elem),
        "massive+mean+mask": (m >= 1 and k - m >= 1,
                              lambda h, ids: with_massive(h, random_mask(h[..., rest], k - m, key, mu[rest])),
                              k * elem),
        "massive+pca": (m >= 1 and k - m >= 1,
                        lambda h, ids: with_massive(h, pca_project(h[..., rest], pca_rest, k - m)), k * elem),
        "emb+mask": (k - 1 >= 1, lambda h, ids: emb(ids) + random_mask(h - emb(ids), k - 1, key),
                     (k - 1) * elem + ID_BYTES),
        "emb+mean+mask": (k - 1 >= 1,
                          lambda h, ids: emb(ids) + random_mask(h - emb(ids), k - 1, key, cal.pca_res.mean),
                          (k - 1) * elem + ID_BYTES),
        "emb+pca": (k - 1 >= 1, lambda h, ids: emb(ids) + pca_project(h - emb(ids), cal.pca_res, k - 1),
                    (k - 1) * elem + ID_BYTES),
        "pca-int8": (n8 >= 1, lambda h, ids: pca_project(h, cal.pca, n8, bits=8), quant_bytes(n8, 8)),
        "pca-int4": (n4 >= 1, lambda h, ids: pca_project(h, cal.pca, n4, bits=4), quant_bytes(n4, 4)),
        "emb+pca-int8": (n8e >= 1, lambda h, ids: emb(ids) + pca_project(h - emb(ids), cal.pca_res, n8e, bits=8),
                         quant_bytes(n8e, 8) + ID_BYTES),
        "mean+mask-int8": (1 <= n8 < H, lambda h, ids: random_mask(h, n8, key, mu, bits=8), quant_bytes(n8, 8)),
        "pca-int8/gpca-int8": (n8 >= 1 and cal.grad_pca is not None,
                               lambda h, ids: _TwoWay.apply(h, lambda x: pca_project(x, cal.pca, n8, bits=8),
                                                            lambda g: pca_project(g, cal.grad_pca, n8, bits=8)),
                               quant_bytes(n8, 8)),
        "pca-int4/gpca-int4": (n4 >= 1 and cal.grad_pca is not None,
                               lambda h, ids: _TwoWay.apply(h, lambda x: pca_project(x, cal.pca, n4, bits=4),
                                                            lambda g: pca_project(g, cal.grad_pca, n4, bits=4)),
                               quant_bytes(n4, 4)),
        "sink+pca": (ks >= 1, sink(lambda h, ids: pca_project(h, rp, ks)), ks * elem + pos0),
        "sink+pca-int8": (ns8 >= 1, sink(lambda h, ids: pca_project(h, rp, ns8, bits=8)), quant_bytes(ns8, 8) + pos0),
        "sink+pca-int4": (ns4 >= 1, sink(lambda h, ids: pca_project(h, rp, ns4, bits=4)), quant_bytes(ns4, 4) + pos0),
        "sink+pca-int4/gpca-int4": (ns4 >= 1 and cal.grad_pca is not None,
                                    sink(lambda h, ids: _TwoWay.apply(h, lambda x: pca_project(x, rp, ns4, bits=4),
                                                                      lambda g: pca_project(g, cal.grad_pca, ns4,
                                                                                            bits=4))),
                                    quant_bytes(ns4, 4) + pos0),
    }
    out = []
    for name in names:
        ok, fn, nbytes = table[name]
        if not ok:
            continue
        assert nbytes <= B, (name, nbytes, B)
        out.append(Transform(name, fn, nbytes, nbytes, "candidate", name, CANDIDATES[name]))
    return out


def pca_sweep_transforms(pca: PCA, H: int, divisors=(30, 20, 15, 10, 5), elem: int = 4) -> list[Transform]:
    """mean + top-k PCA for k = round(H/d) (the method.md table), fp32 coordinates."""
    out = []
    for k in sorted({max(1, round(H / d)) for d in divisors}):
        out.append(Transform(f"pca k={k}", (lambda h, ids, k=k: pca_project(h, pca, k)), k * elem, k * elem,
                             "pca", f"pca:k={k}"))
    return out
