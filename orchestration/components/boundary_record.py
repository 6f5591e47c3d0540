"""The boundary-transform record of a run (orchestration.models.boundary_transform, issue
#43): what the checkpoint writes as meshkern_boundary.json, from the run's config; None for
a run whose deployed model keeps no transform."""
from __future__ import annotations

import os

from orchestration import codecs
from orchestration.codecs.pca_base import PCABaseCodec
from orchestration.components.calibration import boundary_layers
from orchestration.components.checkpoint_files import write_json_atomic
from orchestration.models.boundary_transform import FILE, FORMAT, KIND, WHY


def codec_has_sink(boundary, name: str | None = None) -> bool:
    """Whether the codec ``name`` (default --boundary.codec) of a run's --boundary settings
    sends position 0 as a sink row (a pca codec with sink=True)."""
    codec = codecs.codec_for(boundary, name)
    return isinstance(codec, PCABaseCodec) and bool(codec.sink)


def record_for(cfg, num_layers: int, row: int = 0) -> dict | None:
    """The record of run ``cfg`` for a model of ``num_layers`` decoder layers: the codec and
    split of replica ``row``, whose weights the exported model is (replica 0's; an elastic
    run's leader's); None when that codec has no sink row (dense and every other codec), the
    replica has one stage, or --checkpoint.boundary-transform is off."""
    if not getattr(cfg.checkpoint, "boundary_transform", True):
        return None
    name, stages = cfg.replica_codec(row), cfg.replica_stages[row]
    if stages < 2 or not codec_has_sink(cfg.boundary, name):
        return None
    after = boundary_layers(int(num_layers), stages, cfg.mesh.layers_per_stage)
    return {"format": FORMAT, "kind": KIND, "layers": [int(L) + 1 for L in after], "position": 0, "bits": 8,
            "num_hidden_layers": int(num_layers), "codec": name,
            "codec_options": dict(cfg.boundary.options) if name == cfg.boundary.codec else {},
            "why": WHY,
            "load": "orchestration.models.loading.load_causal_lm(folder) applies it; boundary=False (or "
                    "AutoModelForCausalLM.from_pretrained(folder)) gives the plain model"}


def write(folder: str | os.PathLike, record: dict) -> str:
    """``record`` as ``folder``/FILE (written as .part, fsynced, renamed); returns the path."""
    path = os.path.join(folder, FILE)
    write_json_atomic(path, record, indent=1, sort_keys=True)
    return path
