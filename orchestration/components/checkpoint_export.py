"""The user-facing model, and the leader's copy of every rank's state, assembled on the
leader in the background (issue 40).

A fixed mesh whose replica-0 stages are on other disks than the leader's (global rank 0)
sends those stages' model shards (or LoRA adapters) to the leader at every checkpoint
(orchestration.components.checkpoint_hosts). With --checkpoint.leader-copy (the default)
every rank on another disk also sends its rank file (its weights, optimizer and counters:
for Adam about three times its stage's weights; LoRA's are small), after its shard, so the
leader's checkpoint holds every rank's state and a host replaced with an empty disk resumes
from it (checkpoint_hosts.resume_state). A full model's stage over a home uplink takes
minutes; the training must not wait for it. So, when the disks differ:

  * at init, every fast rank probes the checkpoint directory (``disk_view``) and, if some
    replica-0 shard must travel, enters one more process group (``ModelExport.create``):
    gloo, the leader and the sending ranks only, CPU tensors, with a timeout long enough
    for the whole model at a slow rate (``export_timeout_s``), so its transfers never
    share a timeout (or a connection) with the training's collectives;
  * each save stays synchronous and atomic for the training state: every disk publishes its
    ranks' files as before. The leader's checkpoint is published with its own files and
    its local stages' shards, ``meta["disk"]["model"]`` False and ``"pending"`` True;
  * a sending rank copies its shard's bytes (the weights of that step) and a thread sends
    them on the export group; a thread on the leader receives them into the published
    directory (each file written as .part, sha256-checked, renamed), then writes the index
    (LoRA: the PEFT folder's weights, then its adapter_config.json) and finally replaces
    meta.json with one that lists every file, ``"model": True`` and the transfer's bytes and
    seconds. The model appears atomically for HF (the index, or PEFT's adapter_config.json,
    lands last, after every shard) and for ``verify`` (meta.json is replaced last);
  * one assembly at a time: a checkpoint taken while the previous model is still on its
    way saves the state only (the leader's meta says ``"skipped"``, and names the step
    whose model is in flight); the newest complete model is never pruned
    (checkpoint.finalize);
  * the final checkpoint (step == --train.steps) waits for the previous assembly, sends
    its model and waits until it landed, so a run's end always leaves a complete model;
    ``Checkpointer.close`` waits for one in flight (a stop between checkpoints);
  * a transfer that fails (a peer gone, the export group's timeout) is said at once in the
    log and stops the run with the reason at its next checkpoint (every rank agrees).

Each step's send and landing are said in the log ("[checkpoint] step N: ... sending",
"... landed"). Training and the export share the sender's access link: the export is
paced at EXPORT_SHARE of --run.bandwidth-bps, in pieces of 1/16 s, so that the link's
queue holds little of it ahead of the pipeline's packets (set --run.bandwidth-bps to the
uplink's rate: at the default 200 Mbit/s a slower link is saturated by the export and
the steps meanwhile crawl: measured on orchestration.hosts at 2 Mbit/s, a 1.3 MB shard,
the step after the checkpoint took 4.9 s instead of 0.1 s, unpaced).
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from orchestration.components import checkpoint_hosts as hosts
from orchestration.components.checkpoint_files import (adapter_shard_name, assemble_adapters, fsync_dir, fsync_file,
                                                       write_index, write_json_atomic)
from orchestration.components.checkpoint_read import CheckpointError, sha256_file

EXPORT_FLOOR_BPS = 1e6  # the slowest uplink the export's timeout allows for (1 Mbit/s)
EXPORT_SHARE = 0.5  # of --run.bandwidth-bps: the export's pace (the training keeps the rest of the link)
CPU = torch.device("cpu")


def export_timeout_s(nbytes: int, cfg) -> float:
    """How long an export transfer may wait: --mesh.timeout-s plus the time the whole
    model's travelling shards take at a quarter of --run.bandwidth-bps, and at most
    1 Mbit/s (a link the run's flags do not describe). Long on purpose: a dead peer is
    found by the training's own collectives first."""
    rate = min(cfg.run.bandwidth_bps / 4, EXPORT_FLOOR_BPS)
    return float(cfg.mesh.timeout_s) + 8.0 * nbytes / rate


def _say(msg: str) -> None:
    print(f"[checkpoint] {msg}", flush=True)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


class ModelExport:
    """One fast rank's part of the background assembly (module doc): the leader receives,
    a sending rank sends, every fast rank takes part in the collective decisions."""

    def __init__(self, group, leader: bool, senders: list[tuple[int, int, int]], timeout_s: float, rate_bps: float = 0.0):
        self.group, self.leader, self.senders, self.timeout_s = group, leader, senders, timeout_s
        self.rate_bps = rate_bps  # the senders' pace (EXPORT_SHARE of --run.bandwidth-bps)
        self.chunk = hosts.paced_chunk(rate_bps) if rate_bps else hosts.CHUNK
        self.thread: threading.Thread | None = None
        self.step: int | None = None   # the step whose model is on its way (this rank's part of it)
        self.path = ""                 # leader: the directory it completes
        self.error = ""
        self.state_ranks: list[int] = []  # leader, --checkpoint.leader-copy: every fast rank's state file it completes

    @classmethod
    def create(cls, cfg, plan, mesh, shard_stage: int, shard_bytes: int, state_rank: int,
               state_bytes: int) -> "ModelExport | None":
        """Collective on mesh.fast at init: the export of a fixed mesh whose files cross
        disks (replica 0's model shards; with --checkpoint.leader-copy every rank's state
        file too), else None (one disk, or nothing off the leader's disk to send).
        ``state_bytes``: an estimate of this rank's rank file (the export's timeout)."""
        os.makedirs(plan.ckpt_dir, exist_ok=True)
        view = hosts.disk_view(plan.ckpt_dir, mesh.fast, mesh.device, shard_stage)
        copy = bool(cfg.checkpoint.leader_copy)
        state_ranks = hosts.gather_ints(state_rank, mesh.fast, mesh.device)
        remote = [r for r, s in enumerate(view.shard) if not view.same_disk(0, r) and (s >= 0 or copy)]
        if not remote:
            return None
        mine = (shard_bytes if shard_stage >= 0 else 0) + (state_bytes if copy else 0)
        nbytes = hosts.reduce_int(mine if view.me in remote else 0, mesh.fast, mesh.device, dist.ReduceOp.SUM)
        tmo = export_timeout_s(nbytes, cfg)
        members = [dist.get_global_rank(mesh.fast, r) for r in [0] + remote]
        group = dist.new_group(members, timeout=timedelta(seconds=tmo), backend="gloo")  # every fast rank enters it
        if view.me not in [0] + remote:
            return cls(None, False, [], tmo)
        senders = [(dist.get_group_rank(group, dist.get_global_rank(mesh.fast, r)), view.shard[r],
                    state_ranks[r] if copy else -1) for r in remote]
        if view.me == 0:
            shards = [s for _, s, _ in senders if s >= 0]
            what = [f"the model's shards of stages {shards}"] if shards else []
            if copy:
                what.append(f"the training state of ranks {[g for _, _, g in senders]} (--checkpoint.leader-copy: a "
                            "host replaced with an empty disk resumes from it)")
            _say(f"{' and '.join(what)} ({_mib(nbytes)}, estimated) reach the leader in the background at every "
                 f"checkpoint (their disks are not the leader's), paced at "
                 f"{EXPORT_SHARE * cfg.run.bandwidth_bps / 1e6:g} Mbit/s ({EXPORT_SHARE:g} x --run.bandwidth-bps); "
                 f"transfer timeout {tmo:.0f} s")
        ex = cls(group, view.me == 0, senders, tmo, EXPORT_SHARE * cfg.run.bandwidth_bps)
        ex.state_ranks = sorted(state_ranks) if copy else []
        return ex

    @property
    def member(self) -> bool:
        return self.group is not None

    @property
    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def wait(self) -> None:
        """Until this rank's part of the assembly in flight is done (sent, or landed)."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def _run(self, what, *args) -> None:
        self.thread = threading.Thread(target=self._guarded, args=(what, *args), daemon=True,
                                       name=f"meshkern-export-{self.step}")
        self.thread.start()

    def _guarded(self, what, *args) -> None:
        try:
            what(*args)
        except Exception as e:  # said now; the next checkpoint stops the run with it (Checkpointer.save)
            self.error = f"the model of step {self.step} did not reach the leader: {type(e).__name__}: {e}"
            print(f"error: [checkpoint] {self.error}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ a sending rank
    def send(self, step: int, stage: int, shard: bytes | None, state: bytes | None) -> None:
        """Sends this rank's files of ``step`` to the leader, in the background: ``shard``
        (stage ``stage``'s model shard; None when this rank writes none) then ``state``
        (its rank file, with --checkpoint.leader-copy), in the order ``receive`` expects."""
        self.step = step
        what = ([f"stage {stage}'s model shard ({_mib(len(shard))})"] if shard is not None else []) + (
            [f"its training state ({_mib(len(state))})"] if state is not None else [])
        _say(f"step {step}: sending {' and '.join(what)} to the leader in the background")
        self._run(self._send, step, [d for d in (shard, state) if d is not None], " and ".join(what))

    def _send(self, step: int, files: list[bytes], what: str) -> None:
        t0 = time.perf_counter()
        for data in files:
            hosts.send_file(data, 0, self.group, CPU, chunk=self.chunk, rate_bps=self.rate_bps)
        _say(f"step {step}: sent {what} in {time.perf_counter() - t0:.1f} s")

    # ------------------------------------------------------------------ the leader
    def receive(self, step: int, path: str, name_of, num_stages: int) -> None:
        """Receives every travelling shard into the published checkpoint ``path`` and
        completes its model (``complete_model``), in the background."""
        self.step, self.path = step, path
        shards, states = [s for _, s, _ in self.senders if s >= 0], [g for _, _, g in self.senders if g >= 0]
        what = ([f"the model's shards of stages {shards}"] if shards else []) + (
            [f"the state of ranks {states}"] if states else [])
        _say(f"step {step}: state published; {' and '.join(what)} are on their way (training goes on)")
        self._run(self._receive, step, path, name_of, num_stages)

    def _receive(self, step: int, path: str, name_of, num_stages: int) -> None:
        t0, n = time.perf_counter(), 0
        for src, stage, state_rank in self.senders:
            if stage >= 0:
                n += hosts.recv_file(os.path.join(path, name_of(stage, num_stages)), src, self.group, CPU,
                                     chunk=self.chunk)
            if state_rank >= 0:
                n += hosts.recv_file(os.path.join(path, f"rank_{state_rank:05d}.pt"), src, self.group, CPU,
                                     chunk=self.chunk)
        dt = time.perf_counter() - t0
        complete_model(path, num_stages, {"bytes": n, "seconds": round(dt, 3)}, self.state_ranks)
        _say(f"step {step}: the model landed ({_mib(n)} in {dt:.1f} s, {8 * n / max(dt, 1e-9) / 1e6:.2f} Mbit/s) and "
             f"is published in {path}")


def complete_model(path: str, num_stages: int, transfer: dict, state_ranks: list[int] = ()) -> None:
    """The leader, once every shard of published checkpoint ``path`` is there: the index
    (LoRA: the PEFT folder), then meta.json listing every file with ``"model": True``
    and, with the leader's copy, ``"ranks"``: ``state_ranks`` (every rank's state file is
    there: checkpoint_hosts.newest_copy) (replaced atomically, last); LoRA's per-stage
    shards go after that."""
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    gone = []
    if meta.get("peft_config"):
        assemble_adapters(path, num_stages, meta["peft_config"], remove=False)
        gone = [adapter_shard_name(s, num_stages) for s in range(num_stages)]
    else:
        write_index(path, num_stages)
    files = {k: v for k, v in meta["files"].items() if k not in gone}
    for name in sorted(os.listdir(path)):
        p = os.path.join(path, name)
        if name in files or name in gone or name == "meta.json" or name.endswith(".part") or not os.path.isfile(p):
            continue
        fsync_file(p)
        files[name] = {"sha256": sha256_file(p), "size": os.path.getsize(p)}
    disk = {k: v for k, v in meta["disk"].items() if k not in ("pending", "skipped")}
    if state_ranks:
        disk["ranks"] = sorted(set(disk["ranks"]) | set(state_ranks))
    meta.update(files=files, disk=dict(disk, model=True, export=transfer))
    write_json_atomic(os.path.join(path, "meta.json"), meta)
    fsync_dir(path)
    for name in gone:
        os.remove(os.path.join(path, name))


def check_failures(export: "ModelExport | None", mesh) -> None:
    """Collective on mesh.fast: CheckpointError on every rank if any rank's export failed."""
    mine = 1 if export is not None and export.error else 0
    if hosts.reduce_int(mine, mesh.fast, mesh.device, dist.ReduceOp.MAX):
        raise CheckpointError(export.error if mine else "the model did not reach the leader (the reason is in "
                              "another rank's log: its '[checkpoint]' error)")
