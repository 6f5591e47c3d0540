"""Whether and how a run can continue from a checkpoint (--checkpoint.resume): the error
of a ``latest`` without a run to continue, the settings a checkpoint's state depends on,
and what a stopped mesh prints (the checkpoint to continue from)."""
from __future__ import annotations

import os
import sys

from orchestration.components import checkpoint as ckpt
from orchestration.config import Config, flag_name


def resume_needs_a_run(out_dir: str) -> str:
    """The error of ``--checkpoint.resume latest`` without a run to continue: which runs
    under ``out_dir`` have a checkpoint, and how to name one."""
    runs = []
    if os.path.isdir(out_dir):
        for name in sorted(os.listdir(out_dir)):
            d = os.path.join(out_dir, name)
            if os.path.isfile(os.path.join(d, "checkpoints", ckpt.LATEST)):
                runs.append(name)
    how = "name the run: --run.name NAME, or --config RUN_DIR/config.yaml (it holds the run's name and settings)"
    if not runs:
        return f"--checkpoint.resume latest: which run? {how}; no run under {out_dir}/ has a checkpoint"
    shown = ", ".join(runs[-8:]) + (f" (and {len(runs) - 8} more)" if len(runs) > 8 else "")
    return (f"--checkpoint.resume latest: which run? {how}; runs under {out_dir}/ with a checkpoint: {shown} "
            f"(e.g. --config {os.path.join(out_dir, runs[-1], 'config.yaml')} --checkpoint.resume latest)")


def check_resumable(cfg: Config, path: str, meta: dict, hf_cfg) -> None:
    """ValueError naming the difference if the checkpoint at ``path`` was written by a run
    whose state this one cannot load: another optimizer or anchor setting, another layer
    split, another model shape."""
    from orchestration.distributed.stages import replica_split

    old = meta.get("config", {})
    n = hf_cfg.num_hidden_layers
    split = lambda lps: replica_split(n, cfg.mesh.stages, lps)  # noqa: E731
    # What the ranks' saved state depends on (DiLoCo / compressor state, the subspace projector):
    # a mismatch found by one rank's load would leave the others waiting for it.
    keys = (("train", "optimizer"), ("anchor", "enabled"), ("model", "tied_embeddings"), ("mesh", "layers_per_stage"), ("dp", "mode"),
            ("dp", "compressor"), ("dp", "projection"), ("boundary", "compress"),
            ("adapter", "kind"), ("adapter", "rank"), ("adapter", "targets"))
    was_sub = old.get("boundary", {}).get("codec") == "subspace"
    if was_sub != (cfg.boundary.codec == "subspace") and old.get("boundary"):
        raise ValueError(f"--checkpoint.resume {path} was written with --boundary.codec {old['boundary']['codec']}, this "
                         f"run has {cfg.boundary.codec}: the subspace codec changes what each rank trains and saves")
    for section, key in keys:
        was, now = old.get(section, {}).get(key), getattr(getattr(cfg, section), key)
        if key == "layers_per_stage" and was is not None:
            was, now = split(was), split(now)
        if was is not None and was != now:
            raise ValueError(f"--checkpoint.resume {path} was written with {flag_name(section, key)} {was}, this run has {now} "
                             f"(resume with the run's own config: --config RUN_DIR/config.yaml)")
    try:
        from transformers import AutoConfig

        saved = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        return  # no config.json copied (model dir had none): nothing more to compare
    for key in ("hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size", "num_key_value_heads"):
        was, now = getattr(saved, key, None), getattr(hf_cfg, key, None)
        if was != now:
            raise ValueError(f"--checkpoint.resume {path} holds a model with {key}={was}, --model.path has {now}")


def mesh_stopped(e, plan) -> int:
    """Reports a stopped mesh and the checkpoint to continue from; exit code 1."""
    print(f"\nerror: the mesh stopped: {e}", file=sys.stderr)
    if e.details:
        print(e.details, file=sys.stderr)
    try:
        last = ckpt.resolve("latest", plan.ckpt_dir, quiet=True)
    except ValueError:
        last = None  # none, or `latest` names a checkpoint that is gone
    if last:
        print(f"last complete checkpoint: {last} (continue with: {ckpt.continue_command(plan)})", file=sys.stderr)
    return 1
