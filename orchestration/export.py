"""``python -m orchestration.export CHECKPOINT``: a LoRA run's checkpoint as a PEFT folder
or as a merged Hugging Face model.

    python -m orchestration.export runs/NAME/checkpoints/step_00000060 --out my-adapter
    python -m orchestration.export runs/NAME/checkpoints/latest --merged --out my-model

A LoRA checkpoint (orchestration.components.checkpoint) already holds the adapters of every
stage assembled under the unsplit model's PEFT names (across hosts: the leader's copy, the
host of global rank 0, assembled from what the stages sent; the other hosts' parts hold only
their ranks' state and are refused here with that said, as is a leader's checkpoint whose
adapters are still on their way: orchestration.components.checkpoint_export); ``export_adapter`` verifies it and
copies the PEFT files (plus the tokenizer), so ``PeftModel.from_pretrained(base, out)``
loads them. ``export_merged`` loads the base model, merges the adapters into its weights
(peft's ``merge_and_unload``) and saves a plain HF checkpoint. A LoRA run does the first
at its end into RUN_DIR/adapter, and the second into RUN_DIR/merged with --adapter.export
merged. Both write into OUT.tmp and rename it into place: an interrupted export never
leaves a half folder.

A checkpoint of a run whose codec sends position 0 as a sink row (pca, sink=true) holds
meshkern_boundary.json, the boundary transform the model is deployed with
(orchestration.models.boundary_transform, docs/codecs.md); both exports copy it, and
``orchestration.models.loading.load_causal_lm(OUT)`` applies it. ``--plain`` (``boundary=False``)
leaves it out: the folder then holds the plain model only.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

from orchestration.components import checkpoint as ckpt

def _resolve(path: str) -> str:
    """A verified LoRA checkpoint directory (``latest`` under a checkpoint root is followed)."""
    if os.path.basename(os.path.normpath(path)) == ckpt.LATEST:
        path = ckpt.resolve("latest", os.path.dirname(os.path.normpath(path)))
    problem = ckpt.model_problem(path, ckpt.verify(path))  # another host's part, or a model still on its way
    if problem:
        raise ValueError(f"cannot export it: {problem}")
    if not os.path.isfile(os.path.join(path, ckpt.ADAPTER_CONFIG)):
        raise ValueError(f"{path} is not a LoRA checkpoint (no {ckpt.ADAPTER_CONFIG}): a full fine-tuning "
                         "checkpoint is already a Hugging Face model, load it as it is")
    return path


def _publish(tmp: str, out: str) -> str:
    if os.path.exists(out):
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def _fresh(out: str) -> str:
    tmp = os.path.normpath(out) + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def _copy_tokenizer(src: str, dst: str) -> None:
    for name in ckpt.TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), os.path.join(dst, name))


def _copy_boundary(src: str, dst: str, boundary: bool) -> None:
    """The checkpoint's boundary transform record, if it has one and ``boundary``."""
    from orchestration.components import boundary_record
    from orchestration.models import boundary_transform

    rec = boundary_transform.read(src) if boundary else None  # (checked: a record this version applies)
    if rec is not None:
        boundary_record.write(dst, rec)


def export_adapter(checkpoint: str, out: str, *, base: str | None = None, boundary: bool = True) -> str:
    """Writes the PEFT folder of LoRA checkpoint ``checkpoint`` to ``out`` (adapter_config.json,
    adapter_model.safetensors, tokenizer files, and the checkpoint's meshkern_boundary.json
    unless ``boundary`` is False); ``base`` replaces the base model path it names. Returns ``out``."""
    src = _resolve(checkpoint)
    tmp = _fresh(out)
    shutil.copy2(os.path.join(src, ckpt.ADAPTER_WEIGHTS), os.path.join(tmp, ckpt.ADAPTER_WEIGHTS))
    with open(os.path.join(src, ckpt.ADAPTER_CONFIG)) as f:
        conf = json.load(f)
    if base:
        conf["base_model_name_or_path"] = os.path.abspath(base)
    with open(os.path.join(tmp, ckpt.ADAPTER_CONFIG), "w") as f:
        json.dump(conf, f, indent=2, sort_keys=True)
    _copy_tokenizer(src, tmp)
    _copy_boundary(src, tmp, boundary)
    return _publish(tmp, out)


def export_merged(checkpoint: str, out: str, *, base: str | None = None, dtype: str = "float32",
                  boundary: bool = True) -> str:
    """Writes the base model with LoRA checkpoint ``checkpoint``'s adapters merged in to
    ``out`` as an HF checkpoint (safetensors, config, tokenizer, and the checkpoint's
    meshkern_boundary.json unless ``boundary`` is False: the weights are the plain model's
    either way). Returns ``out``."""
    import torch

    from orchestration.models.loading import load_adapter_folder

    src = _resolve(checkpoint)
    model, tok = load_adapter_folder(src, dtype=getattr(torch, dtype), base=base, boundary=False)
    tmp = _fresh(out)
    model.save_pretrained(tmp)
    _copy_tokenizer(tok or src, tmp)
    _copy_boundary(src, tmp, boundary)
    return _publish(tmp, out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m orchestration.export", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a LoRA run's checkpoint directory (RUN_DIR/checkpoints/step_N, or .../latest)")
    ap.add_argument("--out", required=True, help="the folder to write (replaced if it exists)")
    ap.add_argument("--merged", action="store_true", help="write the merged HF model instead of the PEFT folder")
    ap.add_argument("--base", default=None, help="base model directory (default: the one the adapter config names)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="--merged: weight dtype")
    ap.add_argument("--plain", action="store_true", help="leave out the checkpoint's meshkern_boundary.json (position "
                    "0's int8 round trip at the boundary layers, which a model trained through a pca codec with a "
                    "sink row is deployed with; docs/codecs.md): the folder loads as the plain model everywhere")
    ns = ap.parse_args(argv)
    try:
        if ns.merged:
            out = export_merged(ns.checkpoint, ns.out, base=ns.base, dtype=ns.dtype, boundary=not ns.plain)
        else:
            out = export_adapter(ns.checkpoint, ns.out, base=ns.base, boundary=not ns.plain)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
