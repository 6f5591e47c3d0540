"""Reading checkpoints: verification against meta.json, ``latest`` and its fallback, the
published checkpoints of a directory, a rank's state (orchestration.components.checkpoint
re-exports all of it; its doc describes the layout)."""
from __future__ import annotations

import hashlib
import json
import os
import sys

import torch

LATEST = "latest"


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or corrupt (the message names the file)."""


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def verify(path: str) -> dict:
    """Checks checkpoint ``path`` against its meta.json (every file present, with the
    recorded size and sha256); returns the metadata. Raises CheckpointError naming the
    first bad file. A checkpoint written before meta.json had "files" is only checked
    for meta.json."""
    mp = os.path.join(path, "meta.json")
    if not os.path.isfile(mp):
        raise CheckpointError(f"{path} is not a complete checkpoint (no meta.json)")
    try:
        with open(mp) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: meta.json is unreadable ({e})") from None
    for name, want in (meta.get("files") or {}).items():
        p = os.path.join(path, name)
        if not os.path.isfile(p):
            raise CheckpointError(f"checkpoint {path} is corrupt: {name} is missing")
        size = os.path.getsize(p)
        if size != want["size"]:
            raise CheckpointError(f"checkpoint {path} is corrupt: {name} has {size} bytes, meta.json says "
                                  f"{want['size']} (truncated or overwritten)")
        if sha256_file(p) != want["sha256"]:
            raise CheckpointError(f"checkpoint {path} is corrupt: {name} does not match its sha256 in meta.json")
    return meta


def _step_dirs(root: str) -> list[str]:
    """Complete-looking checkpoint directories under ``root``, newest step first (.tmp never)."""
    if not os.path.isdir(root):
        return []
    done = [d for d in os.listdir(root) if d.startswith("step_") and d[5:].isdigit()
            and os.path.isdir(os.path.join(root, d))]
    return [os.path.join(root, d) for d in sorted(done, key=lambda d: -int(d[5:]))]


def complete_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, directory) of every published checkpoint under ``root`` (its meta.json
    written), oldest first; not verified (``verify`` does that)."""
    return [(int(os.path.basename(d)[5:]), d) for d in reversed(_step_dirs(root))
            if os.path.isfile(os.path.join(d, "meta.json"))]


def newest_valid(root: str, *, max_step: int | None = None, exclude: str = "") -> str | None:
    """The newest checkpoint under ``root`` that passes ``verify`` (and whose step is at
    most ``max_step``), or None."""
    for d in _step_dirs(root):
        if max_step is not None and int(os.path.basename(d)[5:]) > max_step:
            continue
        if exclude and os.path.abspath(d) == os.path.abspath(exclude):
            continue
        try:
            verify(d)
        except CheckpointError:
            continue
        return d
    return None


NO_LOCAL = "no-local-checkpoint:"  # a resume_from naming a checkpoint directory that is empty on this host


def disk_is_empty(root: str) -> bool:
    """``root`` holds no checkpoint at all: no ``latest``, no published step (a new disk)."""
    return not os.path.isfile(os.path.join(root, LATEST)) and not complete_checkpoints(root)


def no_local_checkpoint(root: str) -> str:
    """The ``resume_from`` of a host whose ``root`` is empty (``is_no_local``)."""
    return NO_LOCAL + root


def is_no_local(resume_from: str) -> bool:
    return resume_from.startswith(NO_LOCAL)


def resolve(resume: str, root: str, *, quiet: bool = False) -> str:
    """The verified checkpoint directory named by ``--checkpoint.resume`` ('latest' or a path).

    Raises CheckpointError (a ValueError) if there is none, or it is incomplete or
    corrupt. 'latest' naming a corrupt or missing checkpoint falls back to the newest
    valid one under ``root`` and says so on stderr (unless ``quiet``)."""
    if resume != "latest":
        try:
            verify(resume)
        except CheckpointError as e:
            raise CheckpointError(f"--checkpoint.resume {resume}: {e}") from None
        return resume
    p = os.path.join(root, LATEST)
    if not os.path.isfile(p):
        raise CheckpointError(f"--checkpoint.resume latest: no checkpoint in {root}")
    with open(p) as f:
        path = os.path.join(root, f.read().strip())
    try:
        verify(path)
        return path
    except CheckpointError as e:
        problem = str(e)
    fallback = newest_valid(root, exclude=path)
    if fallback is None:
        raise CheckpointError(f"--checkpoint.resume latest: {problem}; no other valid checkpoint in {root}")
    if not quiet:
        print(f"warning: `latest` is unusable ({problem}); falling back to the newest valid checkpoint {fallback}",
              file=sys.stderr, flush=True)
    return fallback


def read_meta(path: str) -> dict:
    with open(os.path.join(path, "meta.json")) as f:
        return json.load(f)


def replica_stages(meta: dict) -> list[int]:
    """The stages of each fast replica of the mesh that wrote the checkpoint of ``meta``."""
    if meta.get("replicas") is not None:
        return [int(y) for y in meta["replicas"]]
    # a checkpoint from before heterogeneous meshes: rows (the anchor row included) x stages
    return [meta["stages"]] * (meta["rows"] - bool(meta.get("anchor")))


def load_rank_state(path: str, rank: int) -> dict:
    f = os.path.join(path, f"rank_{rank:05d}.pt")
    if not os.path.isfile(f):
        raise CheckpointError(f"checkpoint {path} has no state for rank {rank} ({os.path.basename(f)} is missing)")
    st = torch.load(f, weights_only=True, map_location="cpu")
    st["_file_bytes"] = os.path.getsize(f)  # what its copy to the leader cost (Checkpointer.load)
    return st


def _has_model(meta: dict) -> bool:
    disk = meta.get("disk") or {}
    return not disk or bool(disk.get("model"))


def newest_model(root: str) -> str | None:
    """The newest published checkpoint under ``root`` that holds the whole model (a
    multi-host checkpoint's leader copy once its model landed; any single-disk one)."""
    for d in _step_dirs(root):
        try:
            if _has_model(read_meta(d)):
                return d
        except (OSError, ValueError):
            continue
    return None


def model_problem(path: str, meta: dict) -> str:
    """Why checkpoint ``path`` (its ``meta``) holds no loadable model, or "" if it does:
    one host's part of a multi-host checkpoint, or the leader's copy whose model is still
    on its way (or never came: the run stopped first) or was skipped; with the newest
    checkpoint beside it that has one."""
    if _has_model(meta):
        return ""
    disk = meta["disk"]
    root = os.path.dirname(os.path.normpath(path))
    newest = newest_model(root)
    there = f"; the newest complete model here: {newest}" if newest else ""
    if disk.get("pending"):
        return (f"{path}: its model was still on its way to the leader when this was read (it lands in the background "
                f"and is published in place), or the run stopped before it landed{there}")
    if disk.get("skipped"):
        return (f"{path}: the model of this step was not assembled (the model of step {disk['skipped']} was still on "
                f"its way to the leader); this checkpoint holds the training state only{there}")
    return (f"{path} is one host's part of a multi-host checkpoint (the state of ranks {disk['ranks']}); the model is "
            "assembled on the leader's disk (the host of global rank 0)")
