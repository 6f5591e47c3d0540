"""The data-parallel sync of one fast rank: ``ReplicaSync`` runs the gradient all-reduce
(dp.mode allreduce) or Streaming DiLoCo (dp.mode diloco) over the groups this rank is in.

A homogeneous mesh has one group per rank, its stage column (``mesh.dp``), over the
stage's parameters as they are named locally (what the trainer always did; checkpoints
keep their layout). A heterogeneous mesh syncs by parameter name: the rank is in one group
per ``MeshLayout.sync_segments`` entry it holds (a full replica's rank is in several),
each over the parameters of that segment's units, named and ordered as in the unsplit
model, so every member of a group lists the same tensors in the same order whatever its
split. Each group gets its own DiLoCo instance and compressor state stream.
"""
from __future__ import annotations

from typing import Callable

import torch

from orchestration.distributed.mesh import param_unit


class ReplicaSync:
    """``all_reduce_grads(params)`` after backward (allreduce mode), ``step()`` after the
    inner optimizer step (diloco mode), ``finish()`` at the end; ``bytes_sent`` counts
    every group's exact bytes. ``parts()`` are the checkpoint parts (state_dict /
    load_state_dict): a homogeneous rank's are the DiLoCo instance / compressor
    themselves, as before heterogeneous meshes."""

    def __init__(self, cfg, mesh, stage, make_compressor: Callable[[], object], projector=None):
        self.mode, self.mesh = cfg.dp.mode, mesh
        self.groups: list[tuple[object, list[tuple[str, torch.Tensor]], str]] = []  # (group, named params, key)
        if (cfg.fast_rows > 1 or mesh.elastic) and cfg.dp.mode != "none":  # elastic: replicas may join
            if mesh.segments:
                # Trainable parameters only: a frozen one (the subspace codec's embedding) is
                # frozen on every replica, so every group member leaves out the same tensors.
                named = [(n, p) for n, p in stage.hf_named_parameters() if p.requires_grad]
                for seg, group in mesh.segments:
                    mine = [(n, p) for n, p in named if param_unit(n) in seg.units]
                    self.groups.append((group, mine, "seg" + "-".join(map(str, seg.ranks))))
            else:
                self.groups.append((mesh.dp, [(n, p) for n, p in stage.named_parameters() if p.requires_grad],
                                    f"stage{mesh.stage}"))
        self.allreduce = None
        self.diloco: list = []
        if self.groups and self.mode == "allreduce":
            self.allreduce = make_compressor()
        elif self.groups and self.mode == "diloco":
            from meshkern.diloco import StreamingDiLoCo, SyncWorker

            d = cfg.dp
            worker = SyncWorker(mesh.device)  # one thread: this rank's groups sync one at a time, in order
            for group, named, _ in self.groups:
                kw = {}
                if projector is not None:
                    kw = dict(projector=projector, projection=d.projection)
                self.diloco.append(StreamingDiLoCo(
                    named, group, sync_every=d.sync_every, num_fragments=min(d.fragments, len(named)),
                    outer_lr=d.outer_lr, outer_momentum=None if d.outer_momentum < 0 else d.outer_momentum,
                    overlap_steps=d.overlap_steps, compressor=make_compressor(), timeout_s=cfg.mesh.timeout_s, worker=worker, **kw))

    @property
    def bytes_sent(self) -> int:
        if self.allreduce is not None:
            return self.allreduce.bytes_sent
        return sum(d.bytes_sent for d in self.diloco)

    def all_reduce_grads(self) -> None:
        """allreduce mode: replace every synced parameter's gradient by the group mean (a
        missing gradient counts as zeros)."""
        if self.allreduce is None:
            return
        # Every group reduces the gradients as backward left them: a tensor in two groups (a
        # full replica's tied weight) must not send the first group's average to the second.
        local = {id(p): p.grad if p.grad is not None else torch.zeros_like(p)
                 for _, named, _ in self.groups for _, p in named}
        results = []
        for group, named, key in self.groups:
            params = [p for _, p in named]
            results.append((params, self.allreduce.all_reduce_mean([local[id(p)] for p in params], group, key=key)))
        for params, avg in results:
            for p, g in zip(params, avg):
                p.grad = g

    def step(self) -> None:
        for d in self.diloco:
            d.step()

    def finish(self) -> None:
        for d in self.diloco:
            d.finish()

    def recover(self) -> None:
        """After a DP collective failed (a peer died inside it; elastic runs): every
        compressor stream of this rank restarts from zero error and the shared seed, as it
        does on every other rank that saw the same failure; DiLoCo drops its syncs in flight."""
        if self.allreduce is not None:
            for _, _, key in self.groups:
                self.allreduce.reset_stream(key)
        for d in self.diloco:
            d.recover()

    def heal_state(self) -> dict:
        """What a replica that heals takes from this rank's peer: DiLoCo's state (global
        copies, outer momentum, counters, compressor) and the all-reduce compressor's."""
        return {k: None if v is None else v.state_dict() for k, v in self.parts().items()}

    def load_heal_state(self, sd: dict) -> None:
        """Applies a peer's ``heal_state`` (after the peer's parameters were copied in);
        then error feedback is zeroed and DiLoCo leaves the peer's unsynced progress out of
        this replica's next pseudo-gradients (both are the peer's to send, not twice)."""
        for k, v in self.parts().items():
            if v is not None and sd.get(k) is not None:
                v.load_state_dict(sd[k])
        if self.allreduce is not None:
            self.allreduce.clear_error_feedback()
        for d in self.diloco:
            d.adopt_peer_parameters()

    def segment_heal_state(self, j: int) -> dict:
        """A heterogeneous mesh's heal, per sync segment: group ``j``'s DiLoCo state, or its
        all-reduce compressor stream (keyed alike on every member of the group)."""
        _, _, key = self.groups[j]
        return {"diloco": self.diloco[j].state_dict() if self.diloco else None,
                "stream": self.allreduce.stream_state_dict(key) if self.allreduce is not None else None}

    def load_segment_heal_state(self, j: int, sd: dict) -> None:
        """Applies a peer's ``segment_heal_state(j)`` as ``load_heal_state`` applies a whole
        rank's (error feedback zeroed, the peer's unsynced progress left out)."""
        _, _, key = self.groups[j]
        if self.allreduce is not None:
            self.allreduce.load_stream_state_dict(key, sd["stream"])
            self.allreduce.clear_error_feedback()  # (every segment of this rank heals in the same quorum)
        if self.diloco:
            self.diloco[j].load_state_dict(sd["diloco"])
            self.diloco[j].adopt_peer_parameters()

    # ---- checkpoint parts ----------------------------------------------------------------
    def parts(self) -> dict:
        """{"diloco": ..., "compressor": ...} for the Checkpointer (None when unused)."""
        diloco = None
        if len(self.diloco) == 1 and not self.mesh.segments:
            diloco = self.diloco[0]
        elif self.diloco:
            diloco = _Several(self.diloco)
        return {"diloco": diloco, "compressor": self.allreduce}


class _Several:
    """Several DiLoCo instances saved as one checkpoint part."""

    def __init__(self, items: list):
        self.items = items

    def state_dict(self) -> dict:
        return {"groups": [d.state_dict() for d in self.items]}

    def load_state_dict(self, sd: dict) -> None:
        if len(sd["groups"]) != len(self.items):
            raise ValueError(f"the checkpoint holds {len(sd['groups'])} DiLoCo groups for this rank, "
                             f"the mesh gives it {len(self.items)}")
        for d, s in zip(self.items, sd["groups"]):
            d.load_state_dict(s)
