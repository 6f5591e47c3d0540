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
    dense       identity both ways; H elements per token per direction (``dtype``: in that
                dtype on the wire, e.g. dense:dtype=bfloat16, what a bf16 pipeline sends).
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
                orchestration.components.calibration): forward the k coordinates (h - mean) U / sd,
                each on a Gaussian code book of its own width with one fp16 scale per token
                (the default, quant=nf: PCANFCodec), or int4 (or int8) per token with an fp32
                absmax scale (quant=absmax: PCACodec); receiver rebuilds mean + U (sd * codes).
                Backward: the exact adjoint of the projection (straight-through for the
                quantizer), U^T g / gsd quantized the same way, rebuilt as U (gsd * codes).
                ``sink``: position 0 of every row (the attention sink) travels as int8 over
                all H dims instead, both ways.
    subspace    subspace-projected boundaries (Protocol Models): for a model whose
                o_proj/down_proj stay in span(U) (orchestration.subspace.constraint), the k
                coordinates (h - E[ids]) U forward, U^T g back; the receiver re-adds the
                frozen token embedding E[ids] from the ids it holds (``bind_inputs``).
                Lossless on a constrained model; needs ``attach(E, U)``
                (orchestration.subspace.training does it in the trainer).

``make_codec(name, p=0.95, rescale=False, **options)`` builds one by name or spec
(``parse_spec``: ``name:key=value,...``); ``codec_for(cfg.boundary)`` builds a run's codec
from its --boundary.* settings (the one rule every caller uses); ``apply_codec``
runs a round trip inside one process as an autograd function (the in-process reference
of a compressed pipeline).

Modules: base (protocol, validation, dense, apply_codec), sparse (mask, topk), quant
(int8/int4), bottleneck, pca_nf (pca, the default layout: a code width per coordinate),
pca (pca:quant=absmax, int4/int8), pca_base (what the two share: the basis, the options,
the steps), subspace, aqsgd, tahquant (paper baselines; lowbit: their bit packer and
quantizers), registry (CODECS, make_codec, codec_class, parse_spec).
"""
from orchestration.codecs.aqsgd import AQSGDCodec
from orchestration.codecs.base import (DIRECTIONS, WIRE_DTYPES, BoundaryCodec, DenseCodec, NonFiniteWire, Spec,
                                       apply_codec, dense_pp_bytes_per_token, kept_count, pp_ratios, validate_wire)
from orchestration.codecs.bottleneck import BottleneckCodec
from orchestration.codecs.pca import PCACodec, pca_width
from orchestration.codecs.pca_base import PCA_BASES, PCABaseCodec, PCABasis
from orchestration.codecs.pca_nf import PCANFCodec, nf_code_bytes
from orchestration.codecs.quant import QuantCodec
from orchestration.codecs.registry import CODECS, codec_class, codec_for, make_codec, parse_spec
from orchestration.codecs.sparse import MaskCodec, TopKCodec
from orchestration.codecs.subspace import SubspaceCodec
from orchestration.codecs.tahquant import TAHQuantCodec

__all__ = ["AQSGDCodec", "TAHQuantCodec", "CODECS", "DIRECTIONS", "PCA_BASES", "BottleneckCodec", "BoundaryCodec", "DenseCodec", "MaskCodec",
           "NonFiniteWire", "PCABaseCodec", "PCABasis", "PCACodec", "PCANFCodec", "QuantCodec", "Spec", "SubspaceCodec",
           "TopKCodec", "apply_codec", "kept_count", "codec_class", "codec_for", "nf_code_bytes", "dense_pp_bytes_per_token", "pp_ratios", "WIRE_DTYPES", "make_codec", "parse_spec", "pca_width", "validate_wire"]
