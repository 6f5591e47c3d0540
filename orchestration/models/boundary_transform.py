"""The boundary transform a model trained through a codec with a sink row keeps when deployed
(issue #43).

A ``pca`` codec with ``sink=True`` (the default ``pca`` / ``pcanf`` and ``pca:quant=absmax``)
sends position 0 of every row at every stage boundary as int8 over all H dims with one fp32
absmax scale (``orchestration.codecs.pca_base.sink_round_trip``), and the stage after it
trains on that rounded row. The deployed model scores better with the same round trip kept
at the input of each boundary layer (the first decoder layer of every stage but the first):
share of dense's gain 90.0% -> 96.3% (python), 94.9% -> 99.4% (prose), 96.3% -> 97.9%
(locales), docs/far-domain.md, "The sink's round trip on python and prose". A dense-trained
model loses with it (+0.017), so it belongs to a codec-trained model only.

    (the record of a run: orchestration.components.boundary_record.record_for)
    (written, atomically, by orchestration.components.boundary_record.write)
    read(folder)                 the folder's record, or None
    install(model, record)       forward pre-hooks on the record's layers; returns the handles
    remove(model)                takes them off (the plain model again)

``orchestration.models.loading.load_causal_lm`` installs it when the folder has the file
(``boundary=False``: the plain model). ``AutoModelForCausalLM.from_pretrained(folder)``
ignores the file and gives the plain model.

What the hook does: on a layer's input hidden states [B, T, H] (positional or the
``hidden_states`` keyword), every token at position 0 gets ``sink_round_trip``; the others
are untouched. Position 0 is read from the layer's ``position_ids`` keyword (what
transformers' decoders pass their layers), so a generation step with a KV cache, whose
input starts past position 0, is left alone; without ``position_ids``, the row's first
token when the layer's cache holds nothing yet (no cache: always). In training the codec
rounds index 0 of every row; with positions 0..T-1, as the trainer's rows have, the two agree.
"""
from __future__ import annotations

import json
import os

import torch

FILE = "meshkern_boundary.json"
KIND = "sink_int8_round_trip"
FORMAT = 1
WHY = ("trained through a codec that sends position 0 of every row at each stage boundary as int8 over all H "
       "dims (one fp32 absmax scale); the deployed model keeps that round trip at the input of each boundary "
       "layer: share of dense's gain 90.0%->96.3% (python), 94.9%->99.4% (prose), 96.3%->97.9% (locales), "
       "docs/far-domain.md (issue #43)")
_HANDLES = "_meshkern_boundary_handles"


def read(folder: str | os.PathLike) -> dict | None:
    """``folder``/FILE's record, or None without one. ValueError for a record this version
    cannot apply (another kind or format, no layers)."""
    path = os.path.join(folder, FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        rec = json.load(f)
    if not isinstance(rec, dict) or rec.get("kind") != KIND or rec.get("format") != FORMAT \
            or not isinstance(rec.get("layers"), list) or not all(isinstance(i, int) for i in rec["layers"]):
        raise ValueError(f"{path}: not a boundary transform this version applies (kind {KIND!r}, format {FORMAT}, "
                         f"layers a list of ints expected); load with boundary=False for the plain model")
    return rec


def _decoder_layers(model):
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (model.get_decoder().layers) to put the "
                         "boundary transform on")
    return layers


def _position0(h: torch.Tensor, kwargs: dict, layer_idx: int) -> torch.Tensor | None:
    """[B, T] bool: the tokens of ``h`` at position 0 (module doc), or None if none is."""
    B, T = h.shape[0], h.shape[1]
    pos = kwargs.get("position_ids")
    if torch.is_tensor(pos):
        if pos.dim() == 3:  # multimodal rope: [sections, B, T], the first is the text position
            pos = pos[0]
        if pos.dim() == 1:
            pos = pos.unsqueeze(0)
        if pos.dim() == 2 and pos.shape[-1] == T and pos.shape[0] in (1, B):
            sel = (pos == 0).expand(B, T)
            return sel if bool(sel.any()) else None
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is not None:
        try:
            past = int(cache.get_seq_length(layer_idx))
        except TypeError:
            past = int(cache.get_seq_length())
        if past > 0:
            return None
    sel = torch.zeros(B, T, dtype=torch.bool, device=h.device)
    sel[:, 0] = True
    return sel


def _hook(layer_idx: int):
    from orchestration.codecs.pca_base import sink_round_trip

    def pre(module, args, kwargs):
        positional = len(args) > 0
        h = args[0] if positional else kwargs.get("hidden_states")
        if not torch.is_tensor(h) or h.dim() != 3 or h.shape[1] == 0:
            return None
        sel = _position0(h, kwargs, layer_idx)
        if sel is None:
            return None
        out = h.clone()
        out[sel] = sink_round_trip(h[sel])
        if positional:
            return (out,) + tuple(args[1:]), kwargs
        return args, {**kwargs, "hidden_states": out}

    return pre


def install(model, record: dict) -> list:
    """Puts ``record``'s transform on ``model`` (replacing one installed before): a forward
    pre-hook on each of its layers. Returns the hook handles (``remove`` takes them off).
    ValueError if the model's decoder layer count is not the record's."""
    if record.get("kind") != KIND:
        raise ValueError(f"boundary transform {record.get('kind')!r}: only {KIND!r} is known")
    layers = _decoder_layers(model)
    n = record.get("num_hidden_layers", len(layers))
    if n != len(layers) or any(not 0 < i < len(layers) for i in record["layers"]):
        raise ValueError(f"boundary transform for {n} decoder layers at layers {record['layers']}, the model has "
                         f"{len(layers)}")
    remove(model)
    handles = [layers[i].register_forward_pre_hook(_hook(i), with_kwargs=True) for i in record["layers"]]
    setattr(model, _HANDLES, handles)
    model.meshkern_boundary = dict(record)
    return handles


def remove(model) -> bool:
    """Takes an installed transform off ``model``; True if there was one."""
    handles = getattr(model, _HANDLES, None)
    if not handles:
        return False
    for h in handles:
        h.remove()
    setattr(model, _HANDLES, [])
    model.meshkern_boundary = None
    return True


def installed(model) -> dict | None:
    """The record of the transform on ``model``, or None."""
    return getattr(model, "meshkern_boundary", None) if getattr(model, _HANDLES, None) else None


def apply_from(model, folder: str | os.PathLike) -> dict | None:
    """Installs ``folder``'s record on ``model`` if it has one; returns it (None: nothing done)."""
    rec = read(folder)
    if rec is not None:
        install(model, rec)
    return rec
