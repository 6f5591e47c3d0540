"""The codec list, ``make_codec`` (build one by name), ``codec_class`` (the class it builds,
without building it), ``codec_for`` (the one rule that builds a run's codec from its
--boundary.* settings) and ``parse_spec`` (the ``name:key=value,...`` spec syntax of
``--boundary.codec`` and diagnose's ``--codecs``)."""
from __future__ import annotations

from orchestration.codecs.aqsgd import AQSGDCodec
from orchestration.codecs.base import BoundaryCodec, DenseCodec
from orchestration.codecs.bottleneck import BottleneckCodec
from orchestration.codecs.pca import PCACodec
from orchestration.codecs.pca_base import QUANTS
from orchestration.codecs.pca_nf import PCANFCodec
from orchestration.codecs.quant import QuantCodec
from orchestration.codecs.sparse import MaskCodec, TopKCodec
from orchestration.codecs.subspace import SubspaceCodec
from orchestration.codecs.tahquant import TAHQuantCodec

CODECS = ("dense", "mask", "topk", "int8", "int4", "bottleneck", "pca", "aqsgd", "tahquant", "subspace")
CLASSES = {"dense": DenseCodec, "mask": MaskCodec, "topk": TopKCodec, "int8": QuantCodec, "int4": QuantCodec,
           "bottleneck": BottleneckCodec, "aqsgd": AQSGDCodec, "tahquant": TAHQuantCodec, "subspace": SubspaceCodec}
# pca is one name for two layouts, a class each: its quant option picks (nf when not given)
PCA_CLASSES = {"nf": PCANFCodec, "absmax": PCACodec}


def parse_spec(spec: str) -> tuple[str, dict]:
    """``name`` or ``name:key=value,...`` -> (name, options for make_codec). Values are
    parsed as int, then float, then true/false, else kept as a string. ValueError for an
    unknown codec name or an item that is not key=value."""
    if not isinstance(spec, str):
        raise TypeError(f"a codec spec is a str like 'int4' or 'aqsgd:bits=4', got {type(spec).__name__}")
    name, _, rest = spec.partition(":")
    name = name.strip()
    if name not in CODECS:
        raise ValueError(f"unknown boundary codec {name!r} in {spec!r}; choose one of {', '.join(CODECS)}")
    options: dict = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        k, eq, v = item.partition("=")
        if not eq or not k.strip():
            raise ValueError(f"codec spec {spec!r}: options are key=value, got {item!r}")
        v = v.strip()
        if v.lower() in ("true", "false"):
            options[k.strip()] = v.lower() == "true"
            continue
        for conv in (int, float):
            try:
                options[k.strip()] = conv(v)
                break
            except ValueError:
                pass
        else:
            options[k.strip()] = v
    return name, options


def codec_class(name: str, options: dict | None = None) -> type[BoundaryCodec]:
    """The class ``make_codec(name, **options)`` builds, without building it (what a config
    check asks of a codec before any rank starts): ``name`` is a codec name or spec, as
    make_codec's. pca: PCANFCodec, or PCACodec with quant=absmax (ValueError for another quant)."""
    name, spec_options = parse_spec(name)
    if name != "pca":
        return CLASSES[name]
    quant = {**spec_options, **(options or {})}.get("quant", "nf")
    if quant not in QUANTS:  # (a tuple: an unhashable JSON value gets this error too)
        raise ValueError(f"pca: quant must be one of {', '.join(QUANTS)}, got {quant!r}")
    return PCA_CLASSES[quant]


def make_codec(name: str, p: float = 0.95, rescale: bool = False, **options) -> BoundaryCodec:
    """Build the codec ``name`` (one of CODECS, or a spec ``name:key=value,...`` whose
    options are merged under ``options``, which win).

    ``p`` (drop fraction) sizes mask, topk and bottleneck (K = round((1-p)H)) and is
    ignored by dense/int8/int4; ``rescale`` applies to mask only. ``options`` go to the
    codec's constructor (topk: k; int8/int4: group_size; bottleneck: rank; mask:
    backend; pca: quant (nf, the default: PCANFCodec; absmax: PCACodec), budget, sink,
    seq_len, calib_rows, grad_rows, bwd, basis_dtype, and with quant=absmax bits, k (instead of
    budget), adapt; aqsgd: bits, gbits, store_dtype, store_device;
    tahquant: bits, low_bits, high_fraction, tile, meta, gbits; subspace: k or budget, bits,
    gbits, seed, basis, backend; p is ignored by pca, aqsgd, tahquant and subspace); an option the
    codec does not take is a TypeError.
    """
    name, spec_options = parse_spec(name)
    options = {**spec_options, **options}
    builders = {
        "dense": lambda: DenseCodec(**options),
        "mask": lambda: MaskCodec(p=p, rescale=rescale, **options),
        "topk": lambda: TopKCodec(p=p, **options),
        "int8": lambda: QuantCodec(8, **options),
        "int4": lambda: QuantCodec(4, **options),
        "bottleneck": lambda: BottleneckCodec(p=p, **options),
        "pca": lambda: codec_class(name, options)(**options),
        "aqsgd": lambda: AQSGDCodec(**options),
        "tahquant": lambda: TAHQuantCodec(**options),
        "subspace": lambda: SubspaceCodec(**options),
    }
    try:
        return builders[name]()
    except TypeError as e:
        raise TypeError(f"codec {name!r} does not take options {sorted(options)}: {e}") from None


def codec_for(boundary, name: str | None = None) -> BoundaryCodec:
    """The codec a run's --boundary.* settings describe (``boundary``: a config's
    BoundaryConfig): ``name`` (default --boundary.codec; a replica's own codec, e.g. dense
    for a full replica under --boundary.compress selective) with --boundary.p and
    --boundary.rescale, and --boundary.options only when ``name`` is --boundary.codec
    itself (the options belong to that codec). Every part of the trainer, its tools and
    benches builds a run's codec here."""
    name = boundary.codec if name is None else name
    options = boundary.options if name == boundary.codec else {}
    return make_codec(name, p=boundary.p, rescale=boundary.rescale, **options)
