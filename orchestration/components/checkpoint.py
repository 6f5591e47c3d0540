"""Checkpoints: an HF-format model (sharded per stage) plus every rank's training state.

Layout of one checkpoint, ``<dir>/step_00000020/``:

    config.json, generation_config.json?, tokenizer files     (copied from the base model)
    model-00001-of-00002.safetensors ...  one shard per pipeline stage, written by that
                                          stage's rank of replica 0, tensors under the
                                          unsplit model's names (Stage.hf_state_dict)
    model.safetensors.index.json          weight name -> shard: a standard sharded HF
                                          checkpoint, so AutoModelForCausalLM.from_pretrained
                                          (and models.load_causal_lm) read the directory as is
    rank_00003.pt                         that rank's stage parameters (its own replica),
                                          optimizer, DiLoCo/compressor state, byte counters
                                          and step; tensors and plain numbers only, loaded
                                          with torch.load(weights_only=True)
    meshkern_boundary.json                a run whose codec sends position 0 as a sink row
                                          (pca, sink=true): the boundary transform the model
                                          is deployed with (orchestration.models.
                                          boundary_transform; --checkpoint.boundary-transform)
    meta.json                             step, mesh shape, config and the sha256 and size
                                          of every other file ("files"; written last)

A LoRA run (--adapter lora) writes no model shards: each stage's rank of replica 0 writes
its adapters under their PEFT keys, rank 0 assembles them into ``adapter_model.safetensors``
+ ``adapter_config.json``, so the checkpoint is itself a standard PEFT folder for the
unsplit model (``PeftModel.from_pretrained(base, dir)``; models.loading.load_causal_lm
reads it as the merged model), a few MB; rank_XXXXX.pt then holds the adapters, not the
stage's weights.

Why per-stage shards and not one merged file: each stage's weights live on a different
process; merging would only copy them, while HF already reads sharded checkpoints. The
exported model is replica 0's current weights (with DiLoCo, replicas agree only right
after an outer sync).

Across hosts (orchestration.components.checkpoint_hosts): every save finds out which ranks
share a disk. Each disk keeps its own ranks' rank files, published there by its first rank
as a checkpoint of its own (meta.json over those files, with "disk": its ranks, whether it
holds the model); the model shards (or adapters) of stages on other disks travel to the
leader over the fast group (counted as "export" bytes) and the leader's disk holds the
whole model as above, and (--checkpoint.leader-copy) a copy of every other disk's rank
files, from which a host replaced with an empty disk resumes (checkpoint_hosts.resume_state).
A resume on the same hosts reads each host's own disk. With one disk
for all (one machine, a shared filesystem) nothing travels and nothing changes. On a fixed
mesh the model's shards travel in the background (checkpoint_export): every disk's state
is published during the save as always, the leader's model lands later and is published
in place (meta.json's "disk" says "pending" until then); the final checkpoint waits for it.

Atomicity: ranks write into ``step_XXXXXXXX.tmp`` and fsync their files; after a barrier
rank 0 writes meta.json, fsyncs it and the directory, renames the directory into place
and updates ``latest`` (os.replace, fsync of the checkpoint root). A rank dying mid-save
leaves only a .tmp directory, which is never read: the previous checkpoint stays intact
and loadable.

Verification: ``verify`` checks every file against meta.json's sha256 and size.
``resolve`` (resume, in orchestration.launch.prepare, before any process starts) and
orchestration.evaluate run it; a corrupt checkpoint is a CheckpointError naming the
file. ``--checkpoint.resume latest`` whose ``latest`` is corrupt falls back to the
newest valid checkpoint and says so. Weights that are not finite are never saved
(``Checkpointer.save``).
"""
from __future__ import annotations

import json
import os
import shutil
import sys

import torch
import torch.distributed as dist

from orchestration.components import checkpoint_hosts as hosts
from orchestration.components.checkpoint_export import ModelExport, check_failures
from orchestration.components.checkpoint_files import (  # noqa: F401  (re-exported)
    ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_shard_name, assemble_adapters, fsync_dir, fsync_file, shard_name,
    write_bytes, write_index)
from orchestration.components.checkpoint_read import (  # noqa: F401  (their home is here for the callers)
    LATEST, CheckpointError, complete_checkpoints, disk_is_empty, is_no_local, load_rank_state, model_problem, newest_model,
    newest_valid, no_local_checkpoint, read_meta, replica_stages, resolve, sha256_file, step_dir, verify)

# What travels beside the weights: the tokenizer and generation settings (a LoRA export
# copies these; a checkpoint the model's config.json too).
TOKENIZER_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt")
_COPY = ("config.json",) + TOKENIZER_FILES


def stage_shard(stage, num_stages: int, untied: bool = False) -> tuple[str, bytes]:
    """This stage's weights (HF names) as one safetensors shard: (file name, its bytes).
    ``untied``: a tied model trained with --model.tied-embeddings untie keeps its head copy."""
    from safetensors.torch import save

    sd = {k: v.detach().cpu().contiguous().clone() for k, v in stage.hf_state_dict().items()}
    if getattr(stage, "tied_lm_head", False) and not untied:
        sd.pop("lm_head.weight", None)  # the copy of the tied embedding: stage 0 holds it
    return shard_name(stage.index, num_stages), save(sd, metadata={"format": "pt"})


def write_stage_shard(tmp: str, stage, num_stages: int, untied: bool = False) -> dict[str, str]:
    """Writes this stage's shard (``stage_shard``) into ``tmp``; returns weight name -> file."""
    from safetensors import safe_open

    fname, data = stage_shard(stage, num_stages, untied)
    write_bytes(os.path.join(tmp, fname), data)
    with safe_open(os.path.join(tmp, fname), "pt") as f:
        return {k: fname for k in f.keys()}


def adapter_shard(tensors: dict, stage: int, num_stages: int) -> tuple[str, bytes]:
    """One stage's adapters (PEFT keys) for ``finalize`` to assemble: (file name, bytes)."""
    from safetensors.torch import save

    return adapter_shard_name(stage, num_stages), save(tensors, metadata={"format": "pt"})


def write_adapter_shard(tmp: str, tensors: dict, stage: int, num_stages: int) -> None:
    fname, data = adapter_shard(tensors, stage, num_stages)
    write_bytes(os.path.join(tmp, fname), data)


def state_bytes_estimate(stage) -> int:
    """About the bytes of a rank file: its stage's weights and, for Adam, two fp32 moments
    of each trainable one (DiLoCo's outer copy and momentum adds up to two more): sizes the
    export's timeout only."""
    weights = sum(p.numel() * p.element_size() for p in stage.parameters())
    trainable = sum(p.numel() for p in stage.parameters() if p.requires_grad)
    return weights + 4 * 4 * trainable + (1 << 20)


def write_rank_state(tmp: str, rank: int, state: dict, *, want_bytes: bool = False) -> bytes | None:
    """Writes ``state`` as ``tmp``/rank_XXXXX.pt (as .part, fsynced, renamed). ``want_bytes``:
    serialized in memory and returned too (what the leader's copy sends: once, not read
    back from disk); otherwise streamed to the file."""
    import io

    path = os.path.join(tmp, f"rank_{rank:05d}.pt")
    data = None
    if want_bytes:
        buf = io.BytesIO()
        torch.save(state, buf)
        data = buf.getvalue()
        write_bytes(path + ".part", data)
    else:
        torch.save(state, path + ".part")
        fsync_file(path + ".part")
    os.replace(path + ".part", path)
    return data


def finalize(root: str, tmp: str, step: int, meta: dict, model_dir: str | None, num_stages: int,
             keep: int, model: bool = True, protect: tuple = ()) -> str:
    """Rank 0 (each disk's first rank), after every rank wrote its files: index (or, LoRA,
    the PEFT folder: meta holds its "peft_config"; not without ``model``: a host's part of
    a checkpoint, checkpoint_hosts, or the leader's whose model is still on its way,
    checkpoint_export), metadata, atomic rename, pruning (never ``protect``, the
    checkpoint being completed, nor the newest one whose model is complete)."""
    hosts.remove_probes(tmp)
    if model and meta.get("peft_config"):
        assemble_adapters(tmp, num_stages, meta["peft_config"])
    elif model:
        write_index(tmp, num_stages)
    if model_dir:
        for name in _COPY:
            src = os.path.join(model_dir, name)
            if os.path.isfile(src):
                shutil.copy2(src, os.path.join(tmp, name))
    if meta.get("untied_embeddings"):  # the head copy trained apart: the export is an untied model
        path = os.path.join(tmp, "config.json")
        with open(path) as f:
            hf = json.load(f)
        hf["tie_word_embeddings"] = False
        with open(path, "w") as f:
            json.dump(hf, f, indent=2)
    files = {}
    for name in sorted(os.listdir(tmp)):
        p = os.path.join(tmp, name)
        if name == "meta.json" or not os.path.isfile(p) or name.endswith(".part"):
            continue
        fsync_file(p)  # the ranks fsynced theirs; this covers the index and the copied files
        files[name] = {"sha256": sha256_file(p), "size": os.path.getsize(p)}
    meta = dict(meta, files=files)
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    final = step_dir(root, step)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(root)
    set_latest(root, final)
    newest = newest_model(root) if meta.get("disk") else None
    _prune(root, keep, {os.path.basename(final)}, {*protect, *([os.path.basename(newest)] if newest else [])})
    return final


def set_latest(root: str, path: str) -> None:
    """Points ``root/latest`` at checkpoint ``path`` (atomic, fsynced)."""
    part = os.path.join(root, LATEST + ".part")
    with open(part, "w") as f:
        f.write(os.path.basename(os.path.normpath(path)) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, os.path.join(root, LATEST))
    fsync_dir(root)


def _prune(root: str, keep: int, protect: set, extra=()) -> None:
    """Deletes all but the ``keep`` newest complete checkpoints (by step), never those
    named in ``protect`` (the one just written, which ``latest`` names: it counts among the
    ``keep``) nor in ``extra`` (the newest whose model landed, one whose model is on its
    way), which are kept besides them: an older checkpoint kept for its model must not cost
    a newer one its place (a resume from it on every disk)."""
    done = [d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".tmp") and d[5:].isdigit()]
    done.sort(key=lambda d: int(d[5:]))
    counted = [d for d in done if d not in set(extra) - set(protect)]
    for d in [d for d in counted if d not in protect][:max(0, len(counted) - keep)]:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def existing_run(run_dir: str, ckpt_dir: str) -> str:
    """What a previous run left in ``run_dir`` / ``ckpt_dir`` that a new run would clobber
    ("" if nothing): checkpoints or a metrics file."""
    if os.path.isdir(ckpt_dir) and any(d.startswith("step_") or d == LATEST for d in os.listdir(ckpt_dir)):
        return f"checkpoints in {ckpt_dir}"
    if os.path.isfile(os.path.join(run_dir, "metrics.jsonl")):
        return f"{os.path.join(run_dir, 'metrics.jsonl')}"
    return ""


def continue_command(plan) -> str:
    """The command that continues the run of ``plan`` from its latest checkpoint."""
    return (f"python -m orchestration.train --config {os.path.join(plan.run_dir, 'config.yaml')} "
            "--checkpoint.resume latest")


class Checkpointer:
    """Saves and loads one fast rank's part of the checkpoints (``save`` / ``load``).

    ``parts``: name -> an object with ``state_dict`` / ``load_state_dict`` (or None when
    the run has no such part), saved in rank_XXXXX.pt under that name. The trainer's parts:
    stage, optimizer, diloco, compressor, counter. Replica 0 also writes its stage's
    weights as the HF shard; rank 0 publishes the checkpoint (``finalize``)."""

    def __init__(self, cfg, plan, mesh, stage, parts: dict):
        self.cfg, self.plan, self.mesh, self.stage, self.parts = cfg, plan, mesh, stage, parts
        # a tied model split over stages and trained untied: the export keeps the head copy, untied
        # (LoRA freezes both copies: they stay equal)
        self.untied_embeddings = cfg.model.tied_embeddings == "untie" and cfg.adapter.kind == "none" and bool(
            getattr(stage, "tied_lm_head", False) or getattr(stage, "tied_embed", False))
        self.export = None  # the model's shards that cross disks travel in the background (checkpoint_export)
        self.loaded_state = False  # load() found this rank's state (elastic replicas of another split do not)
        if not mesh.elastic and dist.get_world_size(mesh.fast) > 1:
            shard = mesh.row == 0
            tensors = (self._adapters.tensors() if self._adapters is not None else stage.hf_state_dict()) if shard else {}
            self.export = ModelExport.create(cfg, plan, mesh, stage.index if shard else -1,
                                             sum(t.numel() * t.element_size() for t in tensors.values()),
                                             self.state_rank, state_bytes_estimate(stage))

    @property
    def _adapters(self):
        """LoRA's AdapterState (the stage part of an adapter run), else None."""
        return self.parts["stage"] if hasattr(self.parts.get("stage"), "peft_config") else None

    @property
    def state_rank(self) -> int:
        """The rank_XXXXX.pt this rank writes and loads. Elastic runs save one replica (the
        leader: replicas come and go, their state is alike after a sync) under the stage
        index, which every replica loads, as replica 0's files of a fixed mesh."""
        return self.mesh.stage if self.mesh.elastic else self.mesh.rank

    @property
    def publisher(self) -> bool:
        """The rank that finalizes the checkpoint: rank 0, or the elastic leader's stage 0."""
        return self.mesh.stage == 0 if self.mesh.elastic else self.mesh.rank == 0

    def save(self, step: int) -> str | None:
        """Every fast rank (elastic: of the leader replica) calls it at the same step; returns the checkpoint directory, or
        None (nothing written) if any fast rank's weights are not finite. Each disk gets the
        files of its own ranks; the leader's also the model (checkpoint_hosts), which, from
        stages on other disks, lands in the background (checkpoint_export); the final
        checkpoint (step == --train.steps) returns once its model landed."""
        cfg, plan, mesh, exp = self.cfg, self.plan, self.mesh, self.export
        root, last = plan.ckpt_dir, step >= cfg.train.steps
        if exp is not None and last:
            exp.wait()  # the previous model lands first: this one travels whatever the time
        finite = all(bool(torch.isfinite(p).all()) for p in self.stage.parameters())
        free = exp is None or not exp.busy  # one model on its way at a time
        ok = torch.tensor([float(finite), float(free), float(exp is None or not exp.error)],
                          dtype=torch.float64).to(mesh.device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=mesh.fast)
        if ok[2].item() < 1:
            check_failures(exp, mesh)
        if ok[0].item() < 1:
            if self.publisher:
                print(f"warning: no checkpoint at step {step}: the weights are not finite", file=sys.stderr, flush=True)
            return None
        send_model = ok[1].item() >= 1
        tmp = step_dir(root, step) + ".tmp"
        os.makedirs(tmp, exist_ok=True)
        dist.barrier(group=mesh.fast)  # the directory exists before anyone writes (rank 0 may have removed an old one)
        # replica 0's stages write the HF checkpoint (elastic: the leader's, of whatever split)
        y0 = mesh.layout.stages_of(mesh.row) if mesh.elastic else cfg.replica_stages[0]
        adapters = self._adapters
        shard = mesh.row == 0 or mesh.elastic  # elastic: only the leader replica saves, all of it
        view = hosts.disk_view(tmp, mesh.fast, mesh.device, self.stage.index if shard else -1)
        data = None  # this rank's shard, when it travels to the leader
        if shard and view.on_leader_disk and send_model:
            if adapters is not None:
                write_adapter_shard(tmp, adapters.tensors(), self.stage.index, y0)
            else:
                write_stage_shard(tmp, self.stage, y0, untied=self.untied_embeddings)
        elif shard and send_model:  # the leader's disk is not ours: the shard travels (counted as "export")
            fname, data = (adapter_shard(adapters.tensors(), self.stage.index, y0) if adapters is not None
                           else stage_shard(self.stage, y0, untied=self.untied_embeddings))
            # counted now, so that this step's rank file holds it (the background path's too)
            self._count_export(hosts.send_file(data, 0, mesh.fast, mesh.device) if exp is None
                               else len(data) + hosts.HEAD_BYTES)
        name_of = adapter_shard_name if adapters is not None else shard_name
        if view.me == 0 and exp is None:
            hosts.recv_shards(view, tmp, name_of, y0, mesh)
        sending = exp is not None and exp.member and not exp.leader and send_model  # in the background
        copying = sending and cfg.checkpoint.leader_copy
        # the rank file cannot hold its own size: its copy's bytes are counted after it is written, and again
        # at a resume from it ("export_copy", load)
        state = {"step": step, "export_copy": copying}
        state.update({k: None if v is None else v.state_dict() for k, v in self.parts.items()})
        copy = write_rank_state(tmp, self.state_rank, state, want_bytes=copying)
        if copying:
            self._count_export(len(copy) + hosts.HEAD_BYTES)
        if sending:
            exp.send(step, self.stage.index, data, copy)
        dist.barrier(group=mesh.fast)
        final = step_dir(root, step)
        if view.publisher:  # the leader (rank 0 / elastic stage 0), and the first rank of every other disk
            meta = {"step": step, "rows": cfg.mesh.rows, "stages": cfg.mesh.stages, "anchor": cfg.anchor.enabled,
                    "replicas": cfg.replica_stages, "model_path": plan.model_path, "config": cfg.to_dict(),
                    "untied_embeddings": self.untied_embeddings}
            if mesh.elastic:  # the split of the replica whose rank state this is (the leader's)
                meta["state_stages"] = y0
            if adapters is not None:
                meta["peft_config"] = adapters.peft_config
            model = view.on_leader_disk and exp is None
            if view.disks > 1:  # what this disk holds: its ranks' files, the model only on the leader's
                meta["disk"] = {"ranks": [dist.get_global_rank(mesh.fast, r) for r in view.members(view.me)],
                                "model": model, "disks": view.disks}
                if view.me == 0 and exp is not None:  # the model lands later, or (one on its way) not at all
                    meta["disk"].update({"pending": True} if send_model else {"skipped": exp.step})
            if view.me == 0:  # the leader's disk, where the model is (or lands): how it is deployed
                self._write_boundary(tmp)
            inflight = (os.path.basename(exp.path),) if view.me == 0 and exp is not None and exp.busy else ()
            finalize(root, tmp, step, meta, plan.model_path, y0, cfg.checkpoint.keep, model=model, protect=inflight)
            if view.me == 0 and exp is not None:
                if send_model:
                    exp.receive(step, final, name_of, y0)
                else:
                    print(f"[checkpoint] step {step}: state saved; its model is not sent (the model of step {exp.step} "
                          "is still on its way to the leader)", flush=True)
        dist.barrier(group=mesh.fast)
        if exp is not None and last:
            exp.wait()  # the run's end: its model is complete on the leader's disk when this returns
            check_failures(exp, mesh)
        return final

    def _write_boundary(self, tmp: str) -> None:
        """meshkern_boundary.json into the checkpoint being written, for a run whose codec has a
        sink row (orchestration.models.boundary_transform; finalize then lists it in meta.json).
        Not without the model's layer count (a plan that names none: no model to deploy)."""
        from orchestration.components import boundary_record

        num_layers = getattr(self.plan, "num_layers", 0)
        writer = self.mesh.row if self.mesh.elastic else 0  # whose weights the model is
        rec = boundary_record.record_for(self.cfg, num_layers, writer) if num_layers else None
        if rec is not None:
            boundary_record.write(tmp, rec)

    def _count_export(self, n: int) -> None:
        if self.parts.get("counter") is not None:
            self.parts["counter"].add("export", self.mesh.rank, dist.get_global_rank(self.mesh.fast, 0), n)

    def close(self) -> None:
        """Waits until this rank's part of a model on its way is done (a run that stops
        between checkpoints leaves a complete model: call before the process group goes)."""
        if self.export is not None:
            self.export.wait()

    def load(self, path: str) -> int:
        """Loads this rank's parts from checkpoint ``path``; returns its step. Across hosts
        each reads its own disk: hosts whose ``latest`` differ (one died between the disks'
        publications, or a divergence rolled back only the leader's) all load the oldest
        of their steps, which every disk must still hold."""
        if self._of_another_split(path):  # an elastic replica of another split: it heals from a peer instead
            return int(read_meta(path)["step"])
        st = None if is_no_local(path) else load_rank_state(path, self.state_rank)
        if not self.mesh.elastic:  # a host with an empty disk gets its state from the leader's copy
            st = hosts.resume_state(st, path, self.mesh, self.plan.ckpt_dir, self.state_rank, self.cfg.mesh.timeout_s)
        for name, part in self.parts.items():
            if part is not None and st.get(name) is not None:
                part.load_state_dict(st[name])
        if st.get("export_copy"):  # that save's copy of this rank file went to the leader (save)
            self._count_export(st["_file_bytes"] + hosts.HEAD_BYTES)
        self.loaded_state = True
        return int(st["step"])

    def _of_another_split(self, path: str) -> bool:
        """Whether ``path``'s rank state is of another split than this elastic replica's (a
        heterogeneous elastic run saves the leader's replica only): this rank then loads
        nothing and its replica heals by parameter name from a peer that loaded it."""
        mesh = self.mesh
        if not (mesh.elastic and mesh.layout.heterogeneous) or is_no_local(path):
            return False
        meta = read_meta(path)
        if "state_stages" not in meta:
            raise CheckpointError(f"{path} does not say which split its rank state is of (written before "
                                  "meta.json named it): a heterogeneous elastic run cannot resume from it")
        return int(meta["state_stages"]) != mesh.layout.stages_of(mesh.row)
