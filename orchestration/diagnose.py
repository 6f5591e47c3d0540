"""Boundary diagnostics: what a stage-boundary codec does to a model, measured without training.

    python -m orchestration.diagnose --model M --data D [--stages 2,3] [--boundaries 10,15]
        [--codecs SPEC ...] [--every-layer] [--out DIR]

For a model and a data source (the trainer's: ``orchestration.data.build_token_dataset``
and its held-out split rule ``ds.split(eval_fraction, seed=split_seed)``) it reports, per
stage boundary (the boundaries of each ``--stages`` Y-split, plus ``--boundaries``):

- forward: the held-out loss with one transform applied to the hidden state at that
  boundary, unmasked elsewhere. Transforms are the codecs of ``orchestration.codecs``
  (built with ``make_codec``, run with ``apply_codec``, so exactly the trainer's forward
  and backward semantics) at several ratios, mean + top-k PCA at several k, and the
  diagnose-local *candidate* designs (``CANDIDATES``) at <= 1/``--budget`` of the dense
  bytes per token;
- backward: for each transform, the gradient error against the dense boundary on a
  held-out batch: cosine, relative norm error and norm ratio of the parameter gradients
  of everything before the boundary (all, decoder layers only, and per stage of each
  Y-split), of the boundary activation gradient the sender gets back, and of the
  parameters after the boundary;
- activation statistics of the residual stream at the boundary (calibration rows):
  per-dim mean |h| (massive dims: count at >= 10x / 100x the median, the largest values),
  per-token norms (outlier tokens, e.g. the attention-sink first token), the PCA spectrum
  (participation ratio, entropy rank; with and without outlier tokens), the variance the
  top H/20, H/15, H/10 directions keep, in-sample and on the held-out rows;
- the anchor (per Y-split): the masked circuit's gradient (``--anchor-codec`` at every
  stage boundary) and the dense gradient of one held-out batch, their cosine before and
  after SpectralAdamW's filter built from ``--anchor-batches`` dense gradients of other
  batches (``meshkern.optim.AnchorMomentum`` + ``meshkern.spectral.project``), the
  singular values of M_anc against tau and the energy the filter keeps, for a sweep of tau.

``--every-layer`` adds, at every layer boundary, the activation statistics and the loss of
the ``--scan`` transforms (a loss-vs-depth profile).

Outputs under ``--out``: ``report.json``, ``table.txt`` (also printed) and PNG plots.
Progress lines go to stderr.

Bytes: "dense" is H values of the activation dtype per token per direction. Codec rows use
the codec's exact ``wire_bytes``. Candidates count every value they send per token (fp32
values, int8/int4 codes, per-token fp32 scales, 4 bytes for a token id where the receiver
needs the ids); things fixed per boundary (a calibrated mean, PCA basis, dim set) are sent
once and count as free. Mask keys: ``MaskKey(seed, boundary=L, step=0, microbatch=0)`` for
the boundary before decoder layer L (token rows = the flattened [B*T] positions), and
``MaskKey(seed, i, 0, 0)`` between stages i and i+1 in the anchor's masked circuit, as the
pipeline does at step 0.

The candidates' backward is plain autograd of the transform (a projection's gradient is
projected the same way; a quantizer is straight-through, so its gradient is *not*
quantized here, unlike the int8/int4 codecs').
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from orchestration.calibration import PCA, fit_pca  # noqa: F401 (PCA, fit_pca: moved there, importable here)
from orchestration.codecs import CODECS, BoundaryCodec, PCACodec, QuantCodec, apply_codec, make_codec
from orchestration.stages import balanced_layers, causal_lm_loss, split_model

# The trainer's defaults (orchestration/config.py); read from there when present.
try:  # pragma: no cover - depends on the config module's current shape
    from orchestration.config import DataConfig as _DC, TrainConfig as _TC
    _EVAL_FRACTION, _SPLIT_SEED = float(_DC().eval_fraction), int(_DC().split_seed)
    _TAU, _ALPHA, _BETA_ANC, _RANK = float(_TC().tau), float(_TC().alpha), float(_TC().beta_anc), int(_TC().spectral_rank)
except Exception:  # pragma: no cover
    _EVAL_FRACTION, _SPLIT_SEED, _TAU, _ALPHA, _BETA_ANC, _RANK = 0.05, 0, 1e-3, 0.3, 0.9, 16

DEFAULT_DATA = "corpus:python"
MASSIVE_RATIOS = (10.0, 100.0)
OUTLIER_TOKEN_RATIO = 10.0  # a token whose norm is >= 10x the median token norm (attention sinks)
TAU_SWEEP = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1)
ID_BYTES = 4  # a token id (int32) where the receiver needs the ids
SCALE_BYTES = 4  # a per-token fp32 quantization scale


class UsageError(ValueError):
    """A bad command-line input: reported as one line, exit status 2."""


def log(msg: str) -> None:
    print(f"[diagnose {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- data
def pick_rows(rows: torch.Tensor, n: int, seed: int, skip: int = 0) -> torch.Tensor:
    """Rows ``skip .. skip+n-1`` of a seeded permutation of ``rows`` (spread over the source)."""
    perm = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(seed))
    if skip + n > rows.shape[0]:
        raise UsageError(f"need {skip + n} rows but the split has only {rows.shape[0]}; use more data or fewer rows")
    return rows[perm[skip:skip + n]]


def load_data(model_path: str, source: str, seq_len: int, *, eval_fraction: float = _EVAL_FRACTION,
              split_seed: int = _SPLIT_SEED, max_sequences: int = 0, token_cache: str | None = "auto"):
    """(train_rows, held_out_rows) exactly as ``orchestration.train.prepare`` builds them."""
    from orchestration import data as data_mod
    from orchestration import models

    if not source.startswith(("corpus:", "task:")) and not os.path.exists(source):
        raise UsageError(f"--data {source!r} does not exist")
    if token_cache == "auto":
        token_cache = str(models.cache_root() / "tokens")
    ds = data_mod.build_token_dataset(source, model_path, seq_len,
                                      max_tokens=max_sequences * seq_len if max_sequences else None,
                                      token_cache=token_cache or None)
    train, held = ds.split(eval_fraction, seed=split_seed)
    return train.tokens, held.tokens


def resolve_and_load(spec: str | None):
    """(model in eval mode, fp32, checkpoint directory) for ``--model`` as the trainer reads it."""
    from orchestration import model_paths, models

    path = model_paths.resolve_model(spec or None, progress=True)
    model, tok = models.load_causal_lm(path)
    if tok is None:
        raise UsageError(f"--model {path}: the checkpoint holds no tokenizer")
    return model, str(path)


# ----------------------------------------------------------------------- model split
class LayerSplit:
    """The model cut after every decoder layer (``split_model`` with one layer per stage).

    Boundary L (1 <= L < n) is the hidden state entering decoder layer L, i.e. leaving
    stage L-1; ``prefix(ids, L)`` runs stages [0, L), ``suffix(h, L)`` stages [L, n) to
    logits. Running all stages reproduces the unsplit model's logits bit for bit
    (orchestration/stages.py). The stages share their modules with ``model``.
    """

    def __init__(self, model):
        self.model = model
        self.n = model.config.num_hidden_layers
        self.hidden_size = model.config.hidden_size
        self.stages = split_model(model, self.n, [1] * self.n)
        self.embed = self.stages[0].embed_tokens

    def check_boundary(self, L: int) -> int:
        if not 1 <= int(L) < self.n:
            raise UsageError(f"boundary {L} is not between two decoder layers (1..{self.n - 1})")
        return int(L)

    def prefix(self, ids: torch.Tensor, L: int) -> torch.Tensor:
        x = ids
        for st in self.stages[:L]:
            x = st(x)
        return x

    def suffix(self, h: torch.Tensor, L: int) -> torch.Tensor:
        for st in self.stages[L:]:
            h = st(h)
        return h

    def all_hidden(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """[h_1, ..., h_{n-1}] (index L-1 = boundary L), no grad."""
        out, x = [], ids
        with torch.no_grad():
            for st in self.stages[:-1]:
                x = st(x)
                out.append(x)
        return out

    def named_params(self, lo: int, hi: int):
        """(unsplit-model name, param) of stages [lo, hi)."""
        for st in self.stages[lo:hi]:
            yield from st.hf_named_parameters()


def row_losses(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of every row [B] (fp32)."""
    ce = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                         reduction="none")
    return ce.reshape(ids.shape[0], -1).mean(dim=1)


# ------------------------------------------------------------------------ transforms
Fn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (h [B,T,H], ids [B,T]) -> h_hat


@dataclass
class Transform:
    """What the receiver sees instead of h, differentiable (its backward = what comes back).

    ``bytes_fwd`` / ``bytes_bwd``: per token per direction. ``kind``: codec | pca | candidate."""
    name: str
    fn: Fn
    bytes_fwd: int
    bytes_bwd: int
    kind: str
    spec: str = ""
    note: str = ""


def dense_bytes(H: int, dtype: torch.dtype = torch.float32) -> int:
    return H * torch.empty((), dtype=dtype).element_size()


def parse_codec_spec(spec: str) -> tuple[str, dict]:
    """``name`` or ``name:key=value,...`` -> (name, kwargs for make_codec). Values: ints,
    floats, true/false. UsageError for an unknown codec or option."""
    name, _, rest = spec.partition(":")
    name = name.strip()
    if name not in CODECS:
        raise UsageError(f"--codecs: unknown codec {name!r} in {spec!r}; choose from {', '.join(CODECS)}")
    kw: dict = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        k, eq, v = item.partition("=")
        if not eq or not k:
            raise UsageError(f"--codecs: {spec!r}: options are key=value, got {item!r}")
        low = v.strip().lower()
        if low in ("true", "false"):
            kw[k.strip()] = low == "true"
        else:
            try:
                kw[k.strip()] = int(v)
            except ValueError:
                try:
                    kw[k.strip()] = float(v)
                except ValueError:
                    kw[k.strip()] = v.strip()
    return name, kw


def build_codec(spec: str, H: int) -> BoundaryCodec:
    """``make_codec`` for a spec, checked against hidden size H (UsageError on any problem)."""
    name, kw = parse_codec_spec(spec)
    try:
        codec = make_codec(name, **kw)
        codec.wire_bytes((1, H), torch.float32, "fwd")
        codec.wire_bytes((1, H), torch.float32, "bwd")
    except (ValueError, TypeError) as e:
        raise UsageError(f"--codecs {spec!r}: {e}") from None
    return codec


def codec_label(spec: str) -> str:
    name, kw = parse_codec_spec(spec)
    return name + ("" if not kw else " " + " ".join(f"{k}={v}" for k, v in kw.items()))


def codec_transform(spec: str, H: int, L: int, seed: int, dtype=torch.float32,
                    h_cal: torch.Tensor | None = None, g_cal: torch.Tensor | None = None) -> Transform:
    """The codec of ``spec`` round-tripped at boundary L; a ``pca`` codec gets its basis
    from the calibration hidden states ``h_cal`` [B, T, H] (calibration.fit_basis, as the
    trainer fits it; gsd from the dense boundary gradients ``g_cal`` of the first rows of
    h_cal when given, else gsd = 1)."""
    from meshkern.mask import MaskKey

    codec = build_codec(spec, H)
    if isinstance(codec, PCACodec):
        if h_cal is None:
            raise UsageError(f"--codecs {spec!r}: the pca codec needs calibration rows")
        from orchestration.calibration import fit_basis

        codec.bases = {L: fit_basis(h_cal, codec.width(H), codec.sink, g_cal)}
    key = MaskKey(seed, L, 0, 0)
    if isinstance(codec, PCACodec):  # per token over a row of seq_len (position 0 is per row)
        T = codec.seq_len
        nb = [-(-codec.wire_bytes((1, T, H), dtype, d) // T) for d in ("fwd", "bwd")]
    else:
        nb = [codec.wire_bytes((1, H), dtype, d) for d in ("fwd", "bwd")]
    return Transform(codec_label(spec), lambda h, ids: apply_codec(codec, h, key), nb[0], nb[1], "codec", spec)


def default_codec_specs(H: int, budget: int, elem: int = 4, seq_len: int = 128) -> list[str]:
    """Every codec at a few ratios; topk / bottleneck also at the bytes of mask p=0.95 and of
    the 1/budget target (mask at the budget: K = the fp32 values that fit); pca (int4 and
    int8, sink) at the budget."""
    from meshkern.mask import kept_dims

    k95 = kept_dims(H, 0.95)
    k_budget = max(1, dense_bytes(H) // budget // elem)
    idx = 2 if H <= 2 ** 15 else 4
    specs = ["dense", "mask:p=0.5", "mask:p=0.9", "mask:p=0.95", "mask:p=0.95,rescale=true"]
    if k_budget != k95:
        specs.append(f"mask:p={1 - k_budget / H:.6f}")
    specs += [f"topk:k={max(1, k95 * elem // (elem + idx))}", f"topk:k={max(1, k_budget * elem // (elem + idx))}",
              "bottleneck:p=0.95", f"bottleneck:rank={k_budget}", "int8", "int4"]
    sl = "" if seq_len == 128 else f",seq_len={seq_len}"
    specs += [f"pca:budget={budget}{sl}", f"pca:bits=8,budget={budget}{sl}"]
    return list(dict.fromkeys(specs))


# --------------------------------------------------------------------- PCA and stats
def spectrum_stats(eigvals: torch.Tensor) -> dict:
    """Participation ratio (sum l)^2 / sum l^2 and entropy rank exp(H(l / sum l))."""
    lam = eigvals.double().clamp_min(0)
    tot = float(lam.sum())
    if tot <= 0:
        return {"participation_ratio": 0.0, "entropy_rank": 0.0}
    p = lam / tot
    p = p[p > 0]
    return {"participation_ratio": tot ** 2 / float(lam.pow(2).sum()),
            "entropy_rank": float(torch.exp(-(p * p.log()).sum()))}


def k_fractions(H: int) -> dict[str, int]:
    return {f"1/{d}": max(1, round(H / d)) for d in (20, 15, 10)}


def activation_stats(h_cal: torch.Tensor, h_eval: torch.Tensor | None = None, top: int = 12) -> tuple[dict, PCA]:
    """Statistics of the residual stream at a boundary from calibration tokens [..., H]
    (and held-out tokens for the out-of-sample energy); returns (stats, PCA fit)."""
    H = h_cal.shape[-1]
    x = h_cal.reshape(-1, H).float()
    mag = x.abs().mean(0)
    med = float(mag.median())
    order = torch.argsort(mag, descending=True)
    tn = x.norm(dim=1)
    tmed = float(tn.median())
    outliers = tn >= OUTLIER_TOKEN_RATIO * tmed
    pca = fit_pca(x)
    st = {"tokens": x.shape[0], "hidden": H,
          "dim_mean_abs_median": med,
          "massive_dims": {f">={int(r)}x_median": int((mag >= r * med).sum()) for r in MASSIVE_RATIOS},
          "top_dims": [int(i) for i in order[:top]],
          "top_dims_mean_abs": [float(mag[i]) for i in order[:top]],
          "top_dims_ratio_to_median": [float(mag[i]) / med if med > 0 else None for i in order[:top]],
          "token_norm_median": tmed, "token_norm_max": float(tn.max()),
          "outlier_tokens": int(outliers.sum()),
          "spectrum": spectrum_stats(pca.eigvals),
          "energy_in_sample": {f: pca.energy(k) for f, k in k_fractions(H).items()},
          "k": k_fractions(H)}
    if h_cal.dim() == 3:  # which positions the outlier tokens sit at
        pos = outliers.reshape(h_cal.shape[0], h_cal.shape[1]).nonzero()[:, 1]
        st["outlier_token_positions"] = sorted(set(int(p) for p in pos))[:16]
    if outliers.any() and (~outliers).sum() > 1:
        p2 = fit_pca(x[~outliers])
        st["spectrum_without_outlier_tokens"] = spectrum_stats(p2.eigvals)
        st["energy_in_sample_without_outlier_tokens"] = {f: p2.energy(k) for f, k in k_fractions(H).items()}
    if h_eval is not None:
        st["energy_held_out"] = {f: pca.energy_on(h_eval, k) for f, k in k_fractions(H).items()}
    st["eigvals"] = [float(v) for v in pca.eigvals]
    st["dim_mean_abs_sorted"] = [float(mag[i]) for i in order]
    return st, pca


# --------------------------------------------------------------------- candidates
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
    H = h_cal.shape[-1]
    x = h_cal.reshape(-1, H).float()
    tn = x.norm(dim=1)
    inl = tn < OUTLIER_TOKEN_RATIO * tn.median()
    pca = pca or fit_pca(x)
    return Calibration(x, pca, fit_pca(x - e_cal.reshape(-1, H).float()),
                       torch.argsort(x.abs().mean(0), descending=True), x.mean(0), grad_pca,
                       pca if bool(inl.all()) else fit_pca(x[inl]))


def boundary_gradients(split: "LayerSplit", h: torch.Tensor, L: int, ids: torch.Tensor, chunk: int = 4) -> torch.Tensor:
    """Dense gradient of the loss w.r.t. the boundary hidden state h [B, T, H] (rows in chunks;
    each chunk's loss is its own mean, as a micro-batch's)."""
    out = []
    for i in range(0, ids.shape[0], chunk):
        with torch.enable_grad():
            x = h[i:i + chunk].detach().requires_grad_(True)
            loss = causal_lm_loss(split.suffix(x, L), ids[i:i + chunk])
            out.append(torch.autograd.grad(loss, x)[0])
    return torch.cat(out)


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


# ------------------------------------------------------------------- measurements
@torch.no_grad()
def forward_loss(split: LayerSplit, h: torch.Tensor, L: int, ids: torch.Tensor, fn: Fn | None = None
                 ) -> tuple[float, torch.Tensor]:
    """(held-out loss, per-row losses) with ``fn`` applied to the hidden state h at boundary L."""
    logits = split.suffix(h if fn is None else fn(h, ids), L)
    return float(causal_lm_loss(logits, ids)), row_losses(logits, ids)


def _group(name: str) -> str:
    if name.startswith("model.layers."):
        return name.split(".")[2]
    return "embed" if "embed_tokens" in name else "head"


class GradStats:
    """Per parameter group ('embed', layer index as str, 'head'): sums of a.b, |a|^2, |b|^2,
    |a-b|^2 between a transform's gradient a and the dense one b."""

    def __init__(self):
        self.s: dict[str, list[float]] = {}

    def add(self, name: str, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        a64, b64 = a.double(), b.double()
        v = self.s.setdefault(_group(name), [0.0, 0.0, 0.0, 0.0])
        v[0] += float((a64 * b64).sum())
        v[1] += float(a64.pow(2).sum())
        v[2] += float(b64.pow(2).sum())
        v[3] += float((a64 - b64).pow(2).sum())

    def summary(self, groups: Sequence[str] | None = None) -> dict:
        keys = [g for g in (self.s if groups is None else groups) if g in self.s]
        d, aa, bb, ee = (sum(self.s[g][i] for g in keys) for i in range(4))
        return metrics_from_sums(d, aa, bb, ee)


def metrics_from_sums(dot: float, aa: float, bb: float, ee: float) -> dict:
    """cos(a, b), ||a - b|| / ||b||, ||a|| / ||b|| from the sums."""
    na, nb = math.sqrt(aa), math.sqrt(bb)
    return {"cos": dot / (na * nb) if na > 0 and nb > 0 else None,
            "rel_err": math.sqrt(ee) / nb if nb > 0 else None,
            "norm_ratio": na / nb if nb > 0 else None}


def tensor_metrics(a: torch.Tensor, b: torch.Tensor) -> dict:
    a, b = a.double(), b.double()
    return metrics_from_sums(float((a * b).sum()), float(a.pow(2).sum()), float(b.pow(2).sum()),
                             float((a - b).pow(2).sum()))


class GradProbe:
    """Gradients at boundary L on one batch, for any transform, against the dense boundary.

    The prefix (stages before L) runs once with its graph kept; per transform the suffix
    runs forward and backward from fn(h), and the boundary gradient that comes back through
    fn's backward is pulled through the prefix (torch.autograd.grad, so no .grad is touched).
    """

    def __init__(self, split: LayerSplit, ids: torch.Tensor, L: int):
        self.split, self.ids, self.L = split, ids, L
        self.pre = list(split.named_params(0, L))
        self.post = list(split.named_params(L, split.n))
        with torch.enable_grad():
            self.h = split.prefix(ids, L)
        self.ref = self.grads(None)

    def grads(self, fn: Fn | None):
        with torch.enable_grad():
            hh = self.h.detach().requires_grad_(True)
            logits = self.split.suffix(hh if fn is None else fn(hh, self.ids), self.L)
            loss = causal_lm_loss(logits, self.ids)
            g = torch.autograd.grad(loss, [hh] + [p for _, p in self.post], allow_unused=True)
            g_pre = torch.autograd.grad(self.h, [p for _, p in self.pre], grad_outputs=g[0], retain_graph=True,
                                        allow_unused=True)
        return float(loss.detach()), g[0], list(g_pre), list(g[1:])

    def compare(self, fn: Fn, stage_groups: dict[str, list[str]] | None = None) -> dict:
        loss, g_h, g_pre, g_post = self.grads(fn)
        _, r_h, r_pre, r_post = self.ref
        pre, post = GradStats(), GradStats()
        for (n, _), a, b in zip(self.pre, g_pre, r_pre):
            pre.add(n, a, b)
        for (n, _), a, b in zip(self.post, g_post, r_post):
            post.add(n, a, b)
        layers = [str(i) for i in range(self.L)]
        out = {"loss": loss, "boundary": tensor_metrics(g_h, r_h), "prefix": pre.summary(),
               "prefix_layers": pre.summary(layers), "suffix": post.summary()}
        if stage_groups:
            out["prefix_by_stage"] = {s: pre.summary(gr) for s, gr in stage_groups.items()}
        return out


# -------------------------------------------------------------------------- anchor
def anchor_diagnostics(model, num_stages: int, ids: torch.Tensor, anchor_batches: Sequence[torch.Tensor], *,
                       codec_spec: str = "mask:p=0.95", seed: int = 0, tau: float = _TAU, alpha: float = _ALPHA,
                       beta_anc: float = _BETA_ANC, rank: int = _RANK, taus: Sequence[float] = TAU_SWEEP,
                       progress: Callable[[str], None] = log) -> dict:
    """The anchor prior on one batch ``ids`` of a ``num_stages``-stage split.

    M_anc = AnchorMomentum over the dense gradients of ``anchor_batches`` (filtered
    parameters as SpectralAdamW's default groups: 2-D, no embedding / lm_head); G_m = the
    masked circuit's gradient (``codec_spec`` at every stage boundary, MaskKey(seed, i, 0, 0)),
    G_d = the dense gradient, both on ``ids``. Reports cos(G_m, G_d), cos(G_proj(G_m), G_d),
    cos(G_proj(G_d), G_d), the pure filter's (alpha=0) cosines, the energy
    ||G_filt||^2/||G||^2 the filter keeps, and the singular values of M_anc, for each tau.
    """
    from meshkern import spectral
    from meshkern.mask import MaskKey
    from meshkern.optim import AnchorMomentum, spectral_param_groups
    from orchestration.stages import run_stages

    stages = split_model(model, num_stages)
    codec = build_codec(codec_spec, model.config.hidden_size)
    named = []
    for st in stages:
        for name, p in spectral_param_groups(st, named=True)[0]["params"]:
            if p.dim() == 2:
                named.append((st.hf_name(name), p))
    params = [p for _, p in named]

    def grads(x, masked):
        bnd = (lambda i, h: apply_codec(codec, h, MaskKey(seed, i, 0, 0))) if masked else None
        with torch.enable_grad():
            loss = causal_lm_loss(run_stages(stages, x, boundary=bnd), x)
            return float(loss.detach()), list(torch.autograd.grad(loss, params))

    am = AnchorMomentum(params, beta_anc, rank, seed=seed)
    for j, b in enumerate(anchor_batches):
        progress(f"anchor {num_stages} stages: dense gradient {j + 1}/{len(anchor_batches)}")
        am.update(grads(b, False)[1])
    facs = am.factors()
    progress(f"anchor {num_stages} stages: masked and dense gradients of the probe batch")
    loss_m, Gm = grads(ids, True)
    loss_d, Gd = grads(ids, False)

    def agg(pairs):
        d = aa = bb = ee = 0.0
        for a, b in pairs:
            a, b = a.double(), b.double()
            d += float((a * b).sum())
            aa += float(a.pow(2).sum())
            bb += float(b.pow(2).sum())
            ee += float((a - b).pow(2).sum())
        return metrics_from_sums(d, aa, bb, ee)

    rep = {"stages": num_stages, "codec": codec_spec, "params_filtered": len(params), "rank": rank,
           "beta_anc": beta_anc, "alpha": alpha, "tau": tau, "anchor_batches": len(anchor_batches),
           "loss_masked": loss_m, "loss_dense": loss_d,
           "masked_vs_dense": agg(zip(Gm, Gd)),
           "momentum_vs_dense": agg((m, g) for m, g in zip(am.m, Gd)),
           "per_tau": {}}
    S = [f[1] for f in facs]
    rep["singular_values"] = {n: [float(v) for v in s] for (n, _), s in zip(named, S)}
    allS = torch.cat(S)
    rep["singular_values_summary"] = {"max": float(allS.max()), "median_top": float(torch.stack([s[0] for s in S]).median()),
                                      "median_all": float(allS.median()), "min": float(allS.min())}
    for t in sorted(set(list(taus) + [tau])):
        row = {}
        for a_ in (alpha, 0.0):
            pm, pd, fm, fd = [], [], 0.0, 0.0
            for (U, s, V), gm, gd in zip(facs, Gm, Gd):
                x, fsq = spectral.project(gm, U, s, V, t, a_, return_stats=True)
                y, fsq_d = spectral.project(gd, U, s, V, t, a_, return_stats=True)
                pm.append((x, gd))
                pd.append((y, gd))
                fm += float(fsq)
                fd += float(fsq_d)
            key = f"alpha={a_:g}"
            row[key] = {"filtered_masked_vs_dense": agg(pm), "filtered_dense_vs_dense": agg(pd)}
            if a_ == 0.0:
                row["energy_kept_masked"] = fm / sum(float(g.double().pow(2).sum()) for g in Gm)
                row["energy_kept_dense"] = fd / sum(float(g.double().pow(2).sum()) for g in Gd)
        d = torch.cat([spectral.gains(s, t) for s in S])
        row["gain_mean"] = float(d.mean())
        row["frac_singular_values_above_tau"] = float((allS > t).double().mean())
        rep["per_tau"][f"{t:g}"] = row
    return rep


# --------------------------------------------------------------------------- driver
@dataclass
class Settings:
    stages: list[int] = field(default_factory=lambda: [2])
    boundaries: list[int] = field(default_factory=list)
    codecs: list[str] | None = None  # None: default_codec_specs
    candidates: list[str] | None = None  # None: all CANDIDATES; []: none
    pca_sweep: bool = True
    every_layer: bool = False
    scan: list[str] = field(default_factory=lambda: ["mask:p=0.95", "massive+mask", "pca", "emb+pca", "pca-int8",
                                                     "sink+pca-int4"])
    budget: int = 15
    seq_len: int = 128
    eval_rows: int = 8
    calib_rows: int = 16
    grad_rows: int = 4
    grads: bool = True
    anchor: bool = True
    anchor_batches: int = 4
    anchor_codec: str = "mask:p=0.95"
    tau: float = _TAU
    alpha: float = _ALPHA
    beta_anc: float = _BETA_ANC
    rank: int = _RANK
    seed: int = 0
    massive_m: int = 8
    eval_fraction: float = _EVAL_FRACTION
    split_seed: int = _SPLIT_SEED
    max_sequences: int = 0


# What a saved partial report must share with this run to be continued (--resume).
_RESUME_KEYS = ("model", "layers", "hidden", "settings", "rows", "base_loss")


def check_settings(s: Settings) -> None:
    """UsageError for inputs that are wrong before any model is loaded."""
    if not s.stages and not s.boundaries and not s.every_layer:
        raise UsageError("nothing to measure: give --stages, --boundaries or --every-layer")
    for y in s.stages:
        if y < 2:
            raise UsageError(f"--stages {y}: a split needs at least 2 stages to have a boundary")
    for spec in (s.codecs or []) + [s.anchor_codec]:
        name, kw = parse_codec_spec(spec)
        try:
            make_codec(name, **kw)
        except (ValueError, TypeError) as e:
            raise UsageError(f"--codecs {spec!r}: {e}") from None
    for name in (s.candidates or []):
        if name not in CANDIDATES:
            raise UsageError(f"--candidates: unknown candidate {name!r}; choose from {', '.join(CANDIDATES)}")
    for name in s.scan:
        if name not in CANDIDATES:
            parse_codec_spec(name)
    if s.budget < 1:
        raise UsageError(f"--budget must be >= 1, got {s.budget}")
    for what in ("eval_rows", "calib_rows", "grad_rows"):
        if getattr(s, what) < 1:
            raise UsageError(f"--{what.replace('_', '-')} must be >= 1")
    if s.grad_rows > s.eval_rows:
        raise UsageError("--grad-rows must be <= --eval-rows (the gradient batch is the first eval rows)")


def _row(t: Transform, loss: float, rows: torch.Tensor, base: float, base_rows: torch.Tensor, dense: int) -> dict:
    diff = rows - base_rows
    se = float(diff.std() / math.sqrt(diff.numel())) if diff.numel() > 1 else None
    return {"name": t.name, "kind": t.kind, "spec": t.spec, "note": t.note, "bytes_fwd": t.bytes_fwd,
            "bytes_bwd": t.bytes_bwd, "fraction_of_dense_fwd": t.bytes_fwd / dense,
            "fraction_of_dense_bwd": t.bytes_bwd / dense, "loss": loss, "delta": loss - base, "delta_se": se}


def run_diagnostics(model, model_path: str, train_rows: torch.Tensor, eval_rows: torch.Tensor, s: Settings,
                    progress: Callable[[str], None] = log, partial: dict | None = None,
                    save: Callable[[dict], None] | None = None) -> dict:
    """Everything the module docstring lists; returns the report (a JSON-able dict).

    ``save(report)`` is called after every boundary, scan step and anchor split (the report
    so far); ``partial``, such a saved report of the same model, rows and settings, is
    continued: what it holds is not measured again (UsageError if it does not match)."""
    t0 = time.time()
    model.eval()
    cfg = model.config
    n, H = cfg.num_hidden_layers, cfg.hidden_size
    dtype = next(model.parameters()).dtype
    dense = dense_bytes(H, dtype)
    splits = {}
    for y in s.stages:
        if y > n:
            raise UsageError(f"--stages {y}: the model has only {n} decoder layers")
        sizes = balanced_layers(n, y)
        splits[y] = {"layers_per_stage": sizes, "boundaries": [sum(sizes[:i + 1]) for i in range(y - 1)]}
    split = LayerSplit(model)
    main_bs = sorted({b for sp in splits.values() for b in sp["boundaries"]} | {split.check_boundary(b) for b in s.boundaries})
    ev = pick_rows(eval_rows, s.eval_rows, s.seed)
    cal = pick_rows(train_rows, s.calib_rows, s.seed)
    anchor_b = [pick_rows(train_rows, s.grad_rows, s.seed, skip=s.calib_rows + j * s.grad_rows)
                for j in range(s.anchor_batches)] if s.anchor and s.stages else []
    gids = ev[:s.grad_rows]
    codec_specs = s.codecs if s.codecs is not None else default_codec_specs(H, s.budget, seq_len=s.seq_len)
    for spec in codec_specs:
        build_codec(spec, H)
    scan_bs = list(range(1, n)) if s.every_layer else []
    need = sorted(set(main_bs) | set(scan_bs))
    progress(f"model {model_path}: {n} layers, hidden {H}; eval {tuple(ev.shape)}, calibration {tuple(cal.shape)}; "
             f"boundaries {main_bs}" + (" + every layer" if s.every_layer else ""))

    with torch.no_grad():
        base_logits = split.suffix(split.prefix(ev, n), n)
        base, base_rows = float(causal_lm_loss(base_logits, ev)), row_losses(base_logits, ev)
        unsplit = float(model(input_ids=ev, labels=ev, use_cache=False).loss)
        del base_logits
        hs_ev = dict(zip(range(1, n), split.all_hidden(ev)))
        hs_cal = dict(zip(range(1, n), split.all_hidden(cal)))
        hs_ev = {L: hs_ev[L] for L in need}
        hs_cal = {L: hs_cal[L] for L in need}
        e_cal = split.embed(cal)
    progress(f"base held-out loss {base:.4f} (unsplit model {unsplit:.4f}) in {time.time() - t0:.0f} s")

    report = {"model": model_path, "architecture": type(model).__name__, "layers": n, "hidden": H,
              "vocab": cfg.vocab_size, "tied_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
              "dtype": str(dtype).replace("torch.", ""), "dense_bytes_per_token": dense,
              "budget": f"1/{s.budget}", "budget_bytes_per_token": dense // s.budget,
              "settings": {k: v for k, v in vars(s).items()}, "splits": {str(k): v for k, v in splits.items()},
              "rows": {"eval": list(ev.shape), "calibration": list(cal.shape), "grad": list(gids.shape),
                       "held_out_available": int(eval_rows.shape[0]), "train_available": int(train_rows.shape[0])},
              "base_loss": base, "base_loss_unsplit_model": unsplit, "boundaries": {}, "layer_scan": {},
              "anchor": {}}
    if partial is not None:
        mine = json.loads(json.dumps({k: report[k] for k in _RESUME_KEYS}, default=str))
        theirs = {k: partial.get(k) for k in _RESUME_KEYS}
        if mine != theirs:
            diff = [k for k in _RESUME_KEYS if mine[k] != theirs[k]]
            raise UsageError(f"cannot resume: the saved partial report differs in {', '.join(diff)}")
        for k in ("boundaries", "layer_scan", "anchor"):
            report[k] = dict(partial.get(k, {}))
        progress(f"resuming: {len(report['boundaries'])} boundaries, {len(report['layer_scan'])} scan steps, "
                 f"{len(report['anchor'])} anchor splits already measured")

    def checkpoint():
        if save is not None:
            save(report)

    def stage_groups(L):
        out = {}
        for y, sp in splits.items():
            if L in sp["boundaries"]:
                lo = 0
                for i, k in enumerate(sp["layers_per_stage"]):
                    if lo + k > L:
                        break
                    out[f"{y}-stage split, stage {i}"] = [str(j) for j in range(lo, lo + k)] + (["embed"] if i == 0 else [])
                    lo += k
        return out

    for bi, L in enumerate(main_bs):
        if str(L) in report["boundaries"]:
            continue
        tb = time.time()
        stats, pca = activation_stats(hs_cal[L], hs_ev[L])
        gpca = g_cal = None
        if s.grads:
            nb = min(s.calib_rows, 2 * s.grad_rows)
            progress(f"boundary {L}: dense boundary gradients of {nb} calibration rows (gradient PCA)")
            g_cal = boundary_gradients(split, hs_cal[L][:nb], L, cal[:nb], s.grad_rows)
            gpca = fit_pca(g_cal)
        calib = calibrate(hs_cal[L], e_cal, pca, gpca)
        ts = [codec_transform(sp, H, L, s.seed, dtype, hs_cal[L], g_cal) for sp in codec_specs]
        if s.pca_sweep:
            ts += pca_sweep_transforms(pca, H)
        if s.candidates != []:
            ts += candidate_transforms(calib, split.embed, H, L, s.seed, s.budget, s.candidates, s.massive_m, dtype,
                                       s.seq_len)
        rows = []
        for j, t in enumerate(ts):
            loss, lr = forward_loss(split, hs_ev[L], L, ev, t.fn)
            rows.append(_row(t, loss, lr, base, base_rows, dense))
            progress(f"boundary {L} ({bi + 1}/{len(main_bs)}) forward {j + 1}/{len(ts)}: {t.name:24s} "
                     f"bytes {t.bytes_fwd / dense:6.3f} of dense  loss {loss:.3f}")
        if s.grads:
            probe = GradProbe(split, gids, L)
            groups = stage_groups(L)
            g = probe.ref[1].reshape(-1, H).double()
            gg = float(g.pow(2).sum())
            ks = {**k_fractions(H), "int8 (B-4)": min(H, dense // s.budget - SCALE_BYTES)}
            stats["boundary_gradient_energy"] = {  # share of the held-out dense boundary gradient kept
                "activation_pca": {f: float((g @ pca.basis(k).double()).pow(2).sum()) / gg for f, k in ks.items()},
                "gradient_pca": {f: float((g @ gpca.basis(k).double()).pow(2).sum()) / gg for f, k in ks.items()},
                "k": ks}
            for j, (t, r) in enumerate(zip(ts, rows)):
                if t.kind == "pca":
                    continue
                r["grad"] = probe.compare(t.fn, groups)
                progress(f"boundary {L} gradient {j + 1}/{len(ts)}: {t.name:24s} prefix cos "
                         f"{_fmt(r['grad']['prefix']['cos'])}  boundary cos {_fmt(r['grad']['boundary']['cos'])}")
            del probe
        report["boundaries"][str(L)] = {"layer": L, "depth": L / n, "in_splits": [y for y, sp in splits.items()
                                                                                   if L in sp["boundaries"]],
                                        "stats": stats, "transforms": rows, "seconds": time.time() - tb}
        checkpoint()

    if scan_bs:
        for L in scan_bs:
            if str(L) in report["layer_scan"]:
                continue
            st, pca = activation_stats(hs_cal[L], hs_ev[L])
            calib = calibrate(hs_cal[L], e_cal, pca)
            losses = {}
            for name in s.scan:
                prev = report["boundaries"].get(str(L))
                t = (candidate_transforms(calib, split.embed, H, L, s.seed, s.budget, [name], s.massive_m, dtype,
                                          s.seq_len)
                     if name in CANDIDATES else [codec_transform(name, H, L, s.seed, dtype, hs_cal[L])])
                if not t:
                    continue
                t = t[0]
                hit = [r for r in prev["transforms"] if r["name"] == t.name] if prev else []
                losses[t.name] = hit[0]["loss"] if hit else forward_loss(split, hs_ev[L], L, ev, t.fn)[0]
            compact = {k: v for k, v in st.items() if k not in ("eigvals", "dim_mean_abs_sorted")}
            report["layer_scan"][str(L)] = {"stats": compact, "losses": losses}
            progress(f"layer scan {L}/{n - 1}: " + "  ".join(f"{k} {v:.3f}" for k, v in losses.items()))
            checkpoint()

    if s.anchor:
        for y in s.stages:
            if str(y) in report["anchor"]:
                continue
            report["anchor"][str(y)] = anchor_diagnostics(
                model, y, gids, anchor_b, codec_spec=s.anchor_codec, seed=s.seed, tau=s.tau, alpha=s.alpha,
                beta_anc=s.beta_anc, rank=s.rank, progress=progress)
            checkpoint()
    report["seconds"] = time.time() - t0
    return report


# -------------------------------------------------------------------------- output
def _fmt(x, nd=3) -> str:
    return "   -  " if x is None else f"{x:.{nd}f}"


def format_table(rep: dict) -> str:
    spec = rep.get("model_spec")
    lines = [f"model {spec + ' = ' if spec else ''}{rep['model']} ({rep['layers']} layers, hidden {rep['hidden']}); "
             f"data {rep.get('data', '?')}; "
             f"eval rows {rep['rows']['eval']}", f"base held-out loss {rep['base_loss']:.4f} "
             f"(unsplit model {rep['base_loss_unsplit_model']:.4f}); budget {rep['budget']} of dense = "
             f"{rep['budget_bytes_per_token']} bytes/token"]
    for L, b in rep["boundaries"].items():
        st = b["stats"]
        lines.append("")
        lines.append(f"boundary before layer {L} (depth {b['depth']:.2f}; splits {b['in_splits'] or '-'}): "
                     f"massive dims {st['massive_dims']}, top |h| {', '.join(f'{v:.0f}' for v in st['top_dims_mean_abs'][:4])}"
                     f" vs median {st['dim_mean_abs_median']:.2f}; outlier tokens {st['outlier_tokens']}; "
                     f"PR {st['spectrum']['participation_ratio']:.1f}, entropy rank {st['spectrum']['entropy_rank']:.1f}; "
                     "energy " + ", ".join(f"{f} {v:.4f}" for f, v in st["energy_held_out"].items()) + " (held out)")
        if "boundary_gradient_energy" in st:
            ge = st["boundary_gradient_energy"]
            lines.append("  held-out boundary gradient energy in the top-k directions: " + ", ".join(
                f"k={ge['k'][f]}: activation PCA {ge['activation_pca'][f]:.3f} / gradient PCA {ge['gradient_pca'][f]:.3f}"
                for f in ge["k"]))
        lines.append(f"  {'transform':26s} {'bytes':>6s} {'loss':>7s} {'delta':>7s} {'+-':>5s}  "
                     f"{'gcos pre':>8s} {'grelerr':>7s} {'gcos bnd':>8s} {'gcos post':>9s}")
        for r in b["transforms"]:
            g = r.get("grad") or {}
            lines.append(f"  {r['name']:26s} {r['fraction_of_dense_fwd']:6.3f} {r['loss']:7.3f} {r['delta']:+7.3f} "
                         f"{_fmt(r['delta_se'], 2):>5s}  {_fmt(g.get('prefix', {}).get('cos')):>8s} "
                         f"{_fmt(g.get('prefix', {}).get('rel_err'), 2):>7s} {_fmt(g.get('boundary', {}).get('cos')):>8s} "
                         f"{_fmt(g.get('suffix', {}).get('cos')):>9s}")
    for y, a in rep["anchor"].items():
        t = a["per_tau"][f"{a['tau']:g}"]
        k = f"alpha={a['alpha']:g}"
        lines.append("")
        lines.append(f"anchor, {y}-stage split ({a['codec']} at every boundary; M_anc from {a['anchor_batches']} dense "
                     f"gradients, rank {a['rank']}; tau {a['tau']:g}, alpha {a['alpha']:g}): masked loss "
                     f"{a['loss_masked']:.3f} vs dense {a['loss_dense']:.3f}")
        lines.append(f"  cos(G_masked, G_dense) {_fmt(a['masked_vs_dense']['cos'])} -> after filter "
                     f"{_fmt(t[k]['filtered_masked_vs_dense']['cos'])} (pure filter {_fmt(t['alpha=0']['filtered_masked_vs_dense']['cos'])}); "
                     f"cos(filter(G_dense), G_dense) {_fmt(t[k]['filtered_dense_vs_dense']['cos'])}; "
                     f"cos(M_anc, G_dense) {_fmt(a['momentum_vs_dense']['cos'])}")
        sv = a["singular_values_summary"]
        lines.append(f"  singular values of M_anc: max {sv['max']:.3g}, median top {sv['median_top']:.3g}, median "
                     f"{sv['median_all']:.3g}; share above tau {t['frac_singular_values_above_tau']:.2f}, mean gain "
                     f"{t['gain_mean']:.3f}; energy kept by the filter: masked {t['energy_kept_masked']:.3g}, dense "
                     f"{t['energy_kept_dense']:.3g}")
        lines.append("  tau sweep (cos after filter, alpha " + f"{a['alpha']:g}): " + ", ".join(
            f"{tt}: {_fmt(r[k]['filtered_masked_vs_dense']['cos'])}" for tt, r in a["per_tau"].items()))
    if rep["layer_scan"]:
        names = list(next(iter(rep["layer_scan"].values()))["losses"])
        lines.append("")
        lines.append("layer scan: " + " | ".join(names))
        for L, r in rep["layer_scan"].items():
            lines.append(f"  {int(L):3d} PR {r['stats']['spectrum']['participation_ratio']:7.1f}  "
                         + "  ".join(_fmt(r["losses"].get(nm)) for nm in names))
    return "\n".join(lines)


def candidate_table(reps: Sequence[dict]) -> str:
    """Markdown: loss of every candidate (and the mask baselines) per boundary, several reports."""
    out = []
    for rep in reps:
        bs = list(rep["boundaries"])
        names = []
        for b in rep["boundaries"].values():
            for r in b["transforms"]:
                if r["name"] not in names and (r["kind"] == "candidate" or r["name"] in ("dense",)
                                               or r["name"].startswith("mask")):
                    names.append(r["name"])
        out.append(f"{rep['model']} / {rep.get('data', '?')}: base {rep['base_loss']:.3f}")
        out.append("| transform | bytes | " + " | ".join(f"L={b}" for b in bs) + " |")
        out.append("|---|---|" + "---|" * len(bs))
        for nm in names:
            cells, frac = [], None
            for b in bs:
                hit = [r for r in rep["boundaries"][b]["transforms"] if r["name"] == nm]
                cells.append(f"{hit[0]['loss']:.3f}" if hit else "")
                frac = hit[0]["fraction_of_dense_fwd"] if hit else frac
            out.append(f"| {nm} | {frac:.3f} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def write_plots(rep: dict, out: str) -> list[str]:
    """PNG figures under ``out``; returns their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    spec = rep.get("model_spec", "")
    name = spec if spec and not spec.startswith("(") and os.sep not in spec else os.path.basename(rep["model"].rstrip("/"))
    title = f"{name} / {rep.get('data', '')}"
    bs = list(rep["boundaries"])
    H = rep["hidden"]

    def save(fig, name):
        p = os.path.join(out, name)
        fig.savefig(p, dpi=110, bbox_inches="tight")
        plt.close(fig)
        files.append(p)

    if bs:
        # 1. loss vs bytes, every transform, one panel per boundary
        fig, axs = plt.subplots(1, len(bs), figsize=(5.5 * len(bs), 4.6), squeeze=False)
        marks = {"codec": ("o", "tab:blue"), "pca": ("s", "tab:green"), "candidate": ("^", "tab:red")}
        for ax, L in zip(axs[0], bs):
            for r in rep["boundaries"][L]["transforms"]:
                mk, c = marks[r["kind"]]
                x = max(r["fraction_of_dense_fwd"], 1e-4)
                ax.scatter(x, r["loss"], marker=mk, color=c, s=22)
                ax.annotate(r["name"], (x, r["loss"]), fontsize=6, xytext=(3, 2), textcoords="offset points")
            ax.axhline(rep["base_loss"], color="k", lw=0.8, ls="--", label="base")
            ax.axvline(1 / int(rep["budget"].split("/")[1]), color="gray", lw=0.8, ls=":", label=f"budget {rep['budget']}")
            ax.set_xscale("log")
            ax.set_xlabel("bytes per token, fraction of dense (fwd)")
            ax.set_ylabel("held-out loss")
            ax.set_title(f"boundary before layer {L}")
            for kind, (mk, c) in marks.items():
                ax.scatter([], [], marker=mk, color=c, label=kind)
            ax.legend(fontsize=7)
        fig.suptitle(f"{title}: loss with one transform at one boundary")
        save(fig, "loss_vs_bytes.png")

        # 2. candidates at the budget vs the mask baselines
        names = []
        for L in bs:
            for r in rep["boundaries"][L]["transforms"]:
                if (r["kind"] == "candidate" or r["spec"].startswith("mask:p=0.95") or r["kind"] == "codec"
                        and r["name"].startswith("mask") and r["fraction_of_dense_fwd"] <= 1 / 14.5) and r["name"] not in names:
                    names.append(r["name"])
        if names:
            fig, ax = plt.subplots(figsize=(max(8, 0.75 * len(names) * len(bs) / 2), 4.6))
            w = 0.8 / len(bs)
            for i, L in enumerate(bs):
                lk = {r["name"]: r["loss"] for r in rep["boundaries"][L]["transforms"]}
                ax.bar([j + i * w for j in range(len(names))], [lk.get(nm, float("nan")) for nm in names], w,
                       label=f"layer {L}")
            ax.axhline(rep["base_loss"], color="k", lw=0.8, ls="--", label="base (dense)")
            ax.set_ylim(bottom=rep["base_loss"] - 0.05 * max(0.5, ax.get_ylim()[1] - rep["base_loss"]))
            ax.set_xticks([j + w * (len(bs) - 1) / 2 for j in range(len(names))])
            ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
            ax.set_ylabel("held-out loss")
            ax.set_title(f"{title}: candidates at <= {rep['budget']} of dense bytes (and the mask)")
            ax.legend(fontsize=8)
            save(fig, "candidates.png")

        # 3. activations: per-dim magnitude and PCA energy
        fig, axs = plt.subplots(1, 2, figsize=(11, 4.2))
        for L in bs:
            st = rep["boundaries"][L]["stats"]
            axs[0].plot(range(1, H + 1), st["dim_mean_abs_sorted"], label=f"layer {L} (median {st['dim_mean_abs_median']:.2f})")
            ev = torch.tensor(st["eigvals"]).clamp_min(0)
            line, = axs[1].plot(range(1, H + 1), (ev.cumsum(0) / ev.sum()).tolist(), label=f"layer {L}")
            if "energy_in_sample_without_outlier_tokens" in st:
                e2 = st["energy_in_sample_without_outlier_tokens"]
                axs[1].plot([st["k"][f] for f in e2], list(e2.values()), "x--", color=line.get_color(),
                            label=f"layer {L} without its {st['outlier_tokens']} outlier tokens")
        axs[0].set_xscale("log"), axs[0].set_yscale("log")
        axs[0].set_xlabel("dim (sorted by mean |h|)"), axs[0].set_ylabel("mean |h| over tokens")
        axs[0].legend(fontsize=7)
        for f, k in k_fractions(H).items():
            axs[1].axvline(k, color="gray", lw=0.6, ls=":")
            axs[1].text(k, 0.02, f"H{f[1:]}", fontsize=7, color="gray", rotation=90,
                        transform=axs[1].get_xaxis_transform())
        axs[1].set_xscale("log")
        axs[1].set_xlabel("top-k PCA directions (calibration rows)"), axs[1].set_ylabel("share of variance")
        axs[1].legend(fontsize=7)
        fig.suptitle(f"{title}: residual stream at the boundaries")
        save(fig, "activations.png")

        # 4. PCA loss vs k
        fig, ax = plt.subplots(figsize=(6, 4.2))
        for L in bs:
            pts = sorted((int(r["spec"].split("=")[1]), r["loss"]) for r in rep["boundaries"][L]["transforms"]
                         if r["kind"] == "pca")
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"PCA, layer {L}")
            m95 = [r["loss"] for r in rep["boundaries"][L]["transforms"] if r["spec"] == "mask:p=0.95"]
            if m95:
                ax.scatter([round(0.05 * H)], m95, marker="x", label=f"mask p=0.95, layer {L}")
        ax.axhline(rep["base_loss"], color="k", lw=0.8, ls="--", label="base")
        ax.set_xscale("log"), ax.set_xlabel("values per token (k)"), ax.set_ylabel("held-out loss")
        ax.set_title(f"{title}: mean + top-k PCA (fitted on calibration rows)")
        ax.legend(fontsize=7)
        save(fig, "pca_loss.png")

        # 5. gradient error
        if any("grad" in r for L in bs for r in rep["boundaries"][L]["transforms"]):
            fig, axs = plt.subplots(2, 1, figsize=(12, 7), sharex=True)
            names = [r["name"] for r in rep["boundaries"][bs[0]]["transforms"] if "grad" in r]
            w = 0.8 / len(bs)
            for i, L in enumerate(bs):
                g = {r["name"]: r["grad"] for r in rep["boundaries"][L]["transforms"] if "grad" in r}
                xs = [j + i * w for j in range(len(names))]
                axs[0].bar(xs, [(g[nm]["prefix_layers"]["cos"] or 0) if nm in g else 0 for nm in names], w, label=f"layer {L}")
                axs[1].bar(xs, [(g[nm]["boundary"]["cos"] or 0) if nm in g else 0 for nm in names], w, label=f"layer {L}")
            axs[0].set_ylabel("cos, grads of layers before")
            axs[1].set_ylabel("cos, boundary activation grad")
            axs[1].set_xticks([j + w * (len(bs) - 1) / 2 for j in range(len(names))])
            axs[1].set_xticklabels(names, rotation=40, ha="right", fontsize=7)
            axs[0].legend(fontsize=7)
            axs[0].set_title(f"{title}: gradient vs dense (one held-out batch)")
            save(fig, "grad_error.png")

    # 6. anchor
    if rep["anchor"]:
        fig, axs = plt.subplots(1, 2, figsize=(12, 4.2))
        first = next(iter(rep["anchor"].values()))  # M_anc is built from dense gradients: the same for every split
        for n_, s_ in first["singular_values"].items():
            axs[0].plot(range(1, len(s_) + 1), s_, color="tab:blue", lw=0.4, alpha=0.5)
        for t in TAU_SWEEP:
            tau = next(iter(rep["anchor"].values()))["tau"]
            axs[0].axhline(t, color="gray", lw=0.5, ls="--")
        axs[0].axhline(tau, color="red", lw=0.9, ls="--")
        axs[0].set_yscale("log"), axs[0].set_xlabel("index"), axs[0].set_ylabel("singular value of M_anc")
        axs[0].set_title("singular values of M_anc, one line per matrix\n(dashed: tau sweep; red: tau used)", fontsize=9)
        labels, vals = [], []
        for y, a in rep["anchor"].items():
            k = f"alpha={a['alpha']:g}"
            labels += [f"{y}st masked", f"{y}st masked+filter", f"{y}st masked+pure filter", f"{y}st dense+filter"]
            t = a["per_tau"][f"{a['tau']:g}"]
            vals += [a["masked_vs_dense"]["cos"], t[k]["filtered_masked_vs_dense"]["cos"],
                     t["alpha=0"]["filtered_masked_vs_dense"]["cos"], t[k]["filtered_dense_vs_dense"]["cos"]]
        labels.append("M_anc itself")
        vals.append(first["momentum_vs_dense"]["cos"])
        axs[1].bar(range(len(vals)), [v or 0 for v in vals],
                   color=["tab:gray", "tab:blue", "tab:cyan", "tab:green"] * len(rep["anchor"]) + ["tab:orange"])
        axs[1].set_xticks(range(len(vals)))
        axs[1].set_xticklabels(labels, rotation=35, ha="right", fontsize=7)
        axs[1].set_ylabel("cosine with the dense gradient")
        axs[1].set_title(f"{title}: cos with the dense gradient of the same batch (2-D weights),\n"
                         "masked circuit before / after the filter; the dense gradient filtered", fontsize=9)
        save(fig, "anchor.png")

    # 7. layer scan
    if rep["layer_scan"]:
        Ls = [int(L) for L in rep["layer_scan"]]
        names = list(next(iter(rep["layer_scan"].values()))["losses"])
        fig, axs = plt.subplots(1, 2, figsize=(12, 4.2))
        for nm in names:
            axs[0].plot(Ls, [rep["layer_scan"][str(L)]["losses"].get(nm, float("nan")) for L in Ls], "o-", ms=3, label=nm)
        axs[0].axhline(rep["base_loss"], color="k", lw=0.8, ls="--", label="base")
        axs[0].set_xlabel("boundary before layer L"), axs[0].set_ylabel("held-out loss"), axs[0].legend(fontsize=7)
        axs[1].plot(Ls, [rep["layer_scan"][str(L)]["stats"]["spectrum"]["participation_ratio"] for L in Ls], "o-", ms=3,
                    label="participation ratio")
        axs[1].plot(Ls, [rep["layer_scan"][str(L)]["stats"]["spectrum"]["entropy_rank"] for L in Ls], "s-", ms=3,
                    label="entropy rank")
        if "spectrum_without_outlier_tokens" in rep["layer_scan"][str(Ls[-1])]["stats"]:
            axs[1].plot(Ls, [rep["layer_scan"][str(L)]["stats"].get("spectrum_without_outlier_tokens", {})
                             .get("participation_ratio", float("nan")) for L in Ls], "^-", ms=3,
                        label="participation ratio, outlier tokens removed")
        axs[1].set_yscale("log"), axs[1].set_xlabel("boundary before layer L"), axs[1].legend(fontsize=7)
        fig.suptitle(f"{title}: every layer boundary")
        save(fig, "layer_scan.png")
    return files


# ----------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    d = Settings()
    ap = argparse.ArgumentParser(prog="python -m orchestration.diagnose",
                                 description="Boundary-codec diagnostics without training: loss and gradient error "
                                             "per boundary and codec, activation statistics, anchor filter.")
    ap.add_argument("--model", default="", help="checkpoint directory, .gguf file or built-in name (smollm2-135m); "
                    "default: the default base model")
    ap.add_argument("--data", default=DEFAULT_DATA, help="data source as the trainer takes it (path, corpus:python, "
                    "corpus:prose, task:...)")
    ap.add_argument("--stages", default="2", help="comma-separated stage counts Y; their balanced-split boundaries are "
                    "measured, and the anchor per Y (empty: none)")
    ap.add_argument("--boundaries", default="", help="comma-separated extra boundaries (layer index L: before layer L)")
    ap.add_argument("--codecs", nargs="+", default=None, metavar="SPEC",
                    help="codec specs name[:key=value,...], e.g. mask:p=0.9 topk:k=19 int4:group_size=32 "
                    "(default: every codec at several ratios)")
    ap.add_argument("--candidates", nargs="*", default=None, metavar="NAME",
                    help=f"candidate designs (default all; none with an empty list): {', '.join(CANDIDATES)}")
    ap.add_argument("--no-pca-sweep", action="store_true", help="skip the PCA k sweep rows")
    ap.add_argument("--every-layer", action="store_true", help="also scan every layer boundary (stats + --scan losses)")
    ap.add_argument("--scan", nargs="+", default=d.scan, metavar="NAME", help="codec specs / candidates for the layer scan")
    ap.add_argument("--budget", type=int, default=d.budget, help="candidates use <= 1/BUDGET of dense bytes per token")
    ap.add_argument("--seq-len", type=int, default=d.seq_len)
    ap.add_argument("--eval-rows", type=int, default=d.eval_rows, help="held-out rows for the losses")
    ap.add_argument("--calib-rows", type=int, default=d.calib_rows, help="training rows for statistics and fits")
    ap.add_argument("--grad-rows", type=int, default=d.grad_rows, help="rows of the gradient batch (first eval rows)")
    ap.add_argument("--no-grad", action="store_true", help="skip the gradient comparisons")
    ap.add_argument("--no-anchor", action="store_true", help="skip the anchor diagnostics")
    ap.add_argument("--anchor-batches", type=int, default=d.anchor_batches, help="dense gradients folded into M_anc")
    ap.add_argument("--anchor-codec", default=d.anchor_codec, help="the masked circuit's codec at every stage boundary")
    ap.add_argument("--tau", type=float, default=d.tau)
    ap.add_argument("--alpha", type=float, default=d.alpha)
    ap.add_argument("--beta-anc", type=float, default=d.beta_anc)
    ap.add_argument("--rank", type=int, default=d.rank, help="truncated SVD rank of M_anc")
    ap.add_argument("--massive-m", type=int, default=d.massive_m, help="massive dims the massive+* candidates keep")
    ap.add_argument("--seed", type=int, default=d.seed, help="row choice and mask seed")
    ap.add_argument("--eval-fraction", type=float, default=d.eval_fraction)
    ap.add_argument("--split-seed", type=int, default=d.split_seed)
    ap.add_argument("--max-sequences", type=int, default=0)
    ap.add_argument("--out", default="diagnostics", help="output directory (report.json, table.txt, *.png)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--resume", action="store_true", help="continue from OUT/report.partial.json (written after every "
                    "boundary, scan step and anchor split) if it matches this run")
    ap.add_argument("--replot", default=None, metavar="REPORT_JSON",
                    help="only redraw the plots and the table of an existing report.json into --out")
    return ap


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--{what} takes comma-separated integers, got {text!r}") from None


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.replot:
        try:
            with open(a.replot) as f:
                rep = json.load(f)
        except (OSError, ValueError) as e:
            print(f"error: --replot {a.replot}: {e}", file=sys.stderr)
            return 2
        os.makedirs(a.out, exist_ok=True)
        write_outputs(rep, a.out, plots=True)
        return 0
    try:
        s = Settings(stages=_ints(a.stages, "stages"), boundaries=_ints(a.boundaries, "boundaries"), codecs=a.codecs,
                     candidates=a.candidates, pca_sweep=not a.no_pca_sweep, every_layer=a.every_layer, scan=a.scan,
                     budget=a.budget, seq_len=a.seq_len, eval_rows=a.eval_rows, calib_rows=a.calib_rows,
                     grad_rows=a.grad_rows, grads=not a.no_grad, anchor=not a.no_anchor,
                     anchor_batches=a.anchor_batches, anchor_codec=a.anchor_codec, tau=a.tau, alpha=a.alpha,
                     beta_anc=a.beta_anc, rank=a.rank, seed=a.seed, massive_m=a.massive_m,
                     eval_fraction=a.eval_fraction, split_seed=a.split_seed, max_sequences=a.max_sequences)
        check_settings(s)
        torch.set_num_threads(a.threads)
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        model, path = resolve_and_load(a.model)
        train_rows, eval_rows = load_data(path, a.data, s.seq_len, eval_fraction=s.eval_fraction,
                                          split_seed=s.split_seed, max_sequences=s.max_sequences)
    except (UsageError, ValueError, FileNotFoundError, TypeError) as e:  # bad inputs: one line, status 2
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    try:
        os.makedirs(a.out, exist_ok=True)
        part_file = os.path.join(a.out, "report.partial.json")
        partial = None
        if a.resume and os.path.exists(part_file):
            with open(part_file) as f:
                partial = json.load(f)

        def save(r):
            tmp = part_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump(r, f, default=str)
            os.replace(tmp, part_file)

        rep = run_diagnostics(model, path, train_rows, eval_rows, s, partial=partial, save=save)
    except UsageError as e:  # e.g. a boundary or codec that does not fit this model
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    rep["model_spec"], rep["data"] = a.model or "(default base model)", a.data
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "report.json"), "w") as f:
        json.dump(rep, f, indent=1, default=str)
    if os.path.exists(part_file):
        os.remove(part_file)
    write_outputs(rep, a.out, plots=not a.no_plots)
    return 0


def write_outputs(rep: dict, out: str, plots: bool = True) -> None:
    """Print the table; write table.txt (+ the candidate table) and the plots under ``out``."""
    table = format_table(rep)
    print(table)
    with open(os.path.join(out, "table.txt"), "w") as f:
        f.write(table + "\n\n" + candidate_table([rep]))
    files = write_plots(rep, out) if plots else []
    log(f"wrote {out}: report.json, table.txt, {len(files)} plots")


if __name__ == "__main__":
    sys.exit(main())
