"""Writing a checkpoint's files: fsync helpers, the stages' shard names and bytes, the
model index and the PEFT folder assembled from the stages' adapters (orchestration.
components.checkpoint re-exports these; checkpoint_export completes a model with them).
Every file that a reader may take as whole (the index, the PEFT folder's two files) is
written under a .part name and renamed into place."""
from __future__ import annotations

import json
import os

from orchestration.components.checkpoint_read import CheckpointError

ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"  # PEFT's file names
INDEX = "model.safetensors.index.json"


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # a platform without directory fds
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_json_atomic(path: str, obj, indent: int = 1, sort_keys: bool = False) -> None:
    """``obj`` as ``path`` (written as path.part, fsynced, renamed: a reader sees all or nothing)."""
    part = path + ".part"
    with open(part, "w") as f:
        json.dump(obj, f, indent=indent, sort_keys=sort_keys)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def shard_name(stage: int, num_stages: int) -> str:
    return f"model-{stage + 1:05d}-of-{num_stages:05d}.safetensors"


def adapter_shard_name(stage: int, num_stages: int) -> str:
    return f"adapter-{stage + 1:05d}-of-{num_stages:05d}.safetensors"


def write_index(path: str, num_stages: int) -> None:
    """model.safetensors.index.json over the stages' model shards in ``path``."""
    from safetensors import safe_open

    weight_map = {}
    for s in range(num_stages):
        fname = shard_name(s, num_stages)
        with safe_open(os.path.join(path, fname), "pt") as f:
            weight_map.update({k: fname for k in f.keys()})
    total = sum(os.path.getsize(os.path.join(path, shard_name(s, num_stages))) for s in range(num_stages))
    write_json_atomic(os.path.join(path, INDEX),
                      {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})


def assemble_adapters(path: str, num_stages: int, peft_config: dict, *, remove: bool = True) -> None:
    """The leader: the stages' adapter shards in ``path`` -> one PEFT folder (weights, then
    config: PEFT sees the folder once both are there); ``remove``: the shards go."""
    from safetensors.torch import load_file, save

    merged = {}
    for s in range(num_stages):
        part = load_file(os.path.join(path, adapter_shard_name(s, num_stages)))
        overlap = set(part) & set(merged)
        if overlap:  # two stages claiming one layer's adapter: a wrong split, never silently merged
            raise CheckpointError(f"stage {s}'s adapters repeat {sorted(overlap)[:2]} from an earlier stage")
        merged.update(part)
    weights = os.path.join(path, ADAPTER_WEIGHTS)
    write_bytes(weights + ".part", save(dict(sorted(merged.items())), metadata={"format": "pt"}))
    os.replace(weights + ".part", weights)
    write_json_atomic(os.path.join(path, ADAPTER_CONFIG), peft_config, indent=2, sort_keys=True)
    if remove:
        for s in range(num_stages):
            os.remove(os.path.join(path, adapter_shard_name(s, num_stages)))
