"""Checkpoints across hosts: which fast ranks share a disk, and the files sent to the leader.

Every rank writes the files it owns (its rank_XXXXX.pt; replica 0's ranks their stage's
shard). On one machine, or hosts sharing a filesystem, they all land in one directory and
rank 0 publishes it (orchestration.components.checkpoint). Hosts in different homes have
disks of their own, so at every save ``disk_view`` finds out from the files themselves who
shares a disk with whom: each fast rank creates an empty probe file, named by a nonce the
leader broadcasts, in the step's .tmp directory; after a barrier each looks for everyone's,
and the gathered visibility matrix groups the ranks by disk. It must be an equivalence
(a directory seen one way only, e.g. a stale network-filesystem cache, is refused naming
the ranks) and it is the same on every rank, so all ranks decide alike.

What goes where:
  * every disk keeps its own ranks' rank files; the first rank of each disk group publishes
    the checkpoint there (meta.json over the files on that disk, verified by sha256 as
    always, the atomic rename, ``latest``, --checkpoint.keep), so a resume on the same hosts
    reads each host's own disk;
  * the leader's disk (fast rank 0's; the elastic leader's stage 0) also holds the
    user-facing model (HF shards + index, or the PEFT folder): a stage of replica 0 on
    another disk sends its shard to the leader instead of writing it: the safetensors file's
    bytes (exactly what it would have written) and their sha256, as uint8 tensors with
    torch.distributed send/recv on the fast group, in chunks of ``CHUNK`` bytes (no pickle:
    the leader writes the bytes and checks the hash; safetensors parses them later). The
    sender counts them on the LinkCounter's "export" axis. With a shared disk nothing is
    sent (0 export bytes);
  * with --checkpoint.leader-copy (a fixed mesh; the default) every rank on another disk
    also sends its rank file the same way, so the leader's checkpoint holds every rank's
    state; a host whose disk is empty at a resume gets its file back from it
    (``resume_state``, ``heal_from_leader``), sha256-checked and read with
    torch.load(weights_only=True) like any rank file: tensors and plain values only.

When it is sent: at every checkpoint; in the background on a fixed mesh
(orchestration.components.checkpoint_export: the training does not wait for it), during the
save on an elastic replica (training waits): LoRA adapters are a few MB, a full model's
stage is not. Measured on orchestration.hosts (tbf-shaped links, no
latency or loss: no netem), one sender: 2 MiB at 5 Mbit/s in 3.5 s (4.8 Mbit/s, raw TCP
4.9), 8 MiB at 20 Mbit/s in 3.6 s (18.7 vs 19.3), 32 MiB at 200 Mbit/s in 1.9 s (144 vs
179-191: hashing and copies on a busy 2-core box). Limits of the synchronous path (elastic):
each chunk must arrive within --mesh.timeout-s, and so must the whole assembly for the
ranks that wait on it (a second sender's first chunk waits for the first sender's shard;
the other ranks wait at the save's barrier). The background path has a group of its own
with a timeout sized for the whole model at a slow rate (checkpoint_export).
"""
from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from orchestration.components.checkpoint_read import (CheckpointError, complete_checkpoints, load_rank_state, newest_model,
                                                       read_meta, replica_stages, step_dir, verify)

CHUNK = 4 << 20  # bytes per send: one op stays short on a slow link (the gloo timeout is per op)
HEAD_BYTES = 40  # what send_file adds to a file's bytes: its size (8) and sha256 (32)
_PROBE = ".probe-"


@dataclass
class DiskView:
    """Who shares a disk with whom at one save (group ranks of the fast group)."""

    me: int                  # this rank in the fast group
    sees: list[list[bool]]   # sees[r][s]: group rank r found group rank s's probe
    shard: list[int]         # the stage whose model shard group rank r writes, or -1

    @property
    def disks(self) -> int:
        return len({tuple(row) for row in self.sees})

    def same_disk(self, r: int, s: int) -> bool:
        return self.sees[r][s]

    def members(self, r: int) -> list[int]:
        """The group ranks on group rank ``r``'s disk."""
        return [s for s, v in enumerate(self.sees[r]) if v]

    @property
    def publisher(self) -> bool:
        """This rank publishes the checkpoint on its disk (the first rank there)."""
        return self.members(self.me)[0] == self.me

    @property
    def on_leader_disk(self) -> bool:
        return self.sees[self.me][0]


def _tensor(values, device, dtype=torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device)


def disk_view(tmp: str, group, device, shard_stage: int) -> DiskView:
    """Collective on ``group`` (every fast rank, after each created ``tmp``): which ranks
    see each other's files in ``tmp`` (module doc). ``shard_stage``: the stage whose model
    shard this rank writes (-1: none)."""
    me, n = dist.get_rank(group), dist.get_world_size(group)
    nonce = _tensor([int.from_bytes(os.urandom(7), "little") if me == 0 else 0], device)
    dist.broadcast(nonce, group=group, group_src=0)
    tag = f"{_PROBE}{int(nonce.item()):x}-"
    mine = os.path.join(tmp, f"{tag}{me}")
    open(mine, "w").close()
    dist.barrier(group=group)
    row = [int(os.path.exists(os.path.join(tmp, f"{tag}{s}"))) for s in range(n)] + [shard_stage]
    rows = [torch.zeros(n + 1, dtype=torch.int64, device=device) for _ in range(n)]
    dist.all_gather(rows, _tensor(row, device), group=group)
    dist.barrier(group=group)  # everyone looked before anyone removes its probe
    os.remove(mine)
    table = [[int(v) for v in r.tolist()] for r in rows]
    view = DiskView(me, [[bool(v) for v in r[:n]] for r in table], [r[n] for r in table])
    check_disks(view.sees, tmp)
    return view


def check_disks(sees: list[list[bool]], where: str) -> None:
    """CheckpointError unless ``sees`` (rank r finds rank s's file) is an equivalence: every
    rank sees its own files, visibility is mutual and transitive (one disk, one group)."""
    n = len(sees)
    for r in range(n):
        for s in range(n):
            via = next((t for t in range(n) if sees[r][t] and sees[t][s]), None)
            if not sees[r][r] or sees[r][s] != sees[s][r] or (via is not None and not sees[r][s]):
                raise CheckpointError(f"checkpoint directory {where}: ranks {r} and {s} (of the fast group) disagree on "
                                      "whether they share a disk (one sees the other's files, not the reverse): a "
                                      "network filesystem with a stale cache? Give every host a --checkpoint.dir of "
                                      "its own, or one that all see alike")


def remove_probes(tmp: str) -> None:
    """Probe files a crashed save left in ``tmp`` (never published)."""
    for name in os.listdir(tmp):
        if name.startswith(_PROBE):
            os.remove(os.path.join(tmp, name))


def send_file(data: bytes, dst: int, group, device, *, chunk: int = 0, rate_bps: float = 0.0) -> int:
    """Sends ``data`` (a file's bytes) to group rank ``dst`` (``recv_file``, with the same
    ``chunk``: default CHUNK) in pieces of ``chunk`` bytes; ``rate_bps``: at most that
    many bits per second on average (paced: the access link keeps room for the training's
    own traffic); the bytes sent."""
    chunk = chunk or CHUNK
    head = len(data).to_bytes(8, "little") + hashlib.sha256(data).digest()
    dist.send(torch.frombuffer(bytearray(head), dtype=torch.uint8).to(device), group=group, group_dst=dst)
    view, t0 = memoryview(data), time.monotonic()
    for off in range(0, len(data), chunk):
        piece = torch.frombuffer(bytearray(view[off:off + chunk]), dtype=torch.uint8).to(device)
        dist.send(piece, group=group, group_dst=dst)
        if rate_bps:  # rate limiting, not synchronisation: the next piece leaves when the average allows it
            ahead = t0 + 8 * (off + len(piece)) / rate_bps - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
    return len(head) + len(data)


def paced_chunk(rate_bps: float) -> int:
    """The piece size of a transfer paced at ``rate_bps``: 1/16 s of it (4 KiB to CHUNK),
    so the link's queue never holds much of it ahead of the training's packets."""
    return int(min(CHUNK, max(4096, rate_bps / 8 / 16)))


def recv_file(path: str, src: int, group, device, *, chunk: int = 0) -> int:
    """Receives a file from group rank ``src`` (``send_file``, the same ``chunk``) into
    ``path`` (written as ``path.part``, checked against the sender's sha256, fsynced,
    renamed); the bytes."""
    chunk = chunk or CHUNK
    head = torch.empty(HEAD_BYTES, dtype=torch.uint8, device=device)
    dist.recv(head, group=group, group_src=src)
    head = bytes(head.cpu().tolist())
    size, want = int.from_bytes(head[:8], "little"), head[8:]
    h, part = hashlib.sha256(), path + ".part"
    def post(off: int):  # the next chunk's receive, posted before this one is hashed and written
        if off >= size:
            return None
        buf = torch.empty(min(chunk, size - off), dtype=torch.uint8, device=device)
        return buf, dist.irecv(buf, group=group, group_src=src)

    with open(part, "wb") as f:
        nxt = post(0)
        for off in range(0, size, chunk):
            buf, work = nxt
            work.wait()
            nxt = post(off + chunk)
            b = buf.cpu().numpy().tobytes()
            h.update(b)
            f.write(b)
        f.flush()
        os.fsync(f.fileno())
    if h.digest() != want:
        os.remove(part)
        raise CheckpointError(f"{os.path.basename(path)} from rank {src} of the fast group arrived corrupt "
                        f"(sha256 differs from the sender's)")
    os.replace(part, path)
    return len(head) + size


def gather_ints(value: int, group, device) -> list[int]:
    """Every rank's ``value`` on ``group``, by group rank (every rank calls it)."""
    out = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, _tensor([value], device), group=group)
    return [int(t.item()) for t in out]


def reduce_int(value: int, group, device, op) -> int:
    """``value`` reduced with ``op`` over ``group`` (every rank calls it)."""
    t = _tensor([value], device)
    dist.all_reduce(t, op=op, group=group)
    return int(t.item())


def recv_shards(view: DiskView, tmp: str, name_of, num_stages: int, mesh) -> None:
    """The leader: every shard of a stage on another disk, into ``tmp`` as ``name_of(stage, num_stages)``."""
    for r, s in enumerate(view.shard):
        if s >= 0 and not view.same_disk(0, r):
            recv_file(os.path.join(tmp, name_of(s, num_stages)), r, mesh.fast, mesh.device)


def agree_step(path: str, st: dict, mesh, state_rank: int) -> dict:
    """Collective on the fast group at a resume: the rank state of the step every rank can
    load. Each host read ``path`` (its own ``latest``) with its state ``st``; if the steps
    differ (a host died between the disks' publications, or a divergence rolled back only
    the leader's ``latest``) every rank takes the oldest, verified, from its own disk (if
    that step is gone there, e.g. pruned, every rank fails with the reason)."""
    step = int(st["step"])
    lo, hi = reduce_int(step, mesh.fast, mesh.device, dist.ReduceOp.MIN), -reduce_int(
        -step, mesh.fast, mesh.device, dist.ReduceOp.MIN)
    if lo == hi:
        return st
    alt, problem = step_dir(os.path.dirname(os.path.normpath(path)), lo), ""
    if step != lo:
        try:
            verify(alt)
            st = load_rank_state(alt, state_rank)
        except (CheckpointError, OSError) as e:
            problem = str(e)
    if reduce_int(int(bool(problem)), mesh.fast, mesh.device, dist.ReduceOp.MAX):
        raise CheckpointError(f"the hosts' checkpoints to resume differ (steps {lo} to {hi}) and step {lo} is not on every "
                        "disk" + (f": {problem}" if problem else " (the reason is in another rank's error)"))
    if mesh.rank == 0:
        print(f"warning: the hosts' latest checkpoints differ (steps {lo} to {hi}): every rank resumes from step "
              f"{lo}, the newest all of them hold", flush=True)
    return st


_NAME = 48  # bytes of a host name gathered for resume_state


def resume_state(st: dict | None, path: str, mesh, ckpt_dir: str, state_rank: int, timeout_s: float) -> dict:
    """Collective on the fast group at a resume, before anything is loaded: the rank state
    every rank loads. Each host read its own ``latest`` (``path``; ``st`` None: a replaced
    host with an empty disk, orchestration.launch.prepare). If every rank has one, the
    step they agree on (``agree_step``). If some have none, the leader's disk holds every
    rank's state where --checkpoint.leader-copy sent it (checkpoint_export): every rank
    resumes from the newest such step, and the ranks that lack it on their own disk get
    their file from the leader (``heal_from_leader``). Otherwise CheckpointError on every
    rank (within seconds of the rendezvous, never a wait until a timeout) naming each rank
    without a checkpoint, its host (torchrun's node rank and host name) and what to copy
    there; or where the leader's disk has the newest whole model, to start a new run from
    when that host's disk is gone."""
    import socket

    leader = mesh.rank == 0 and st is not None
    newest, copied = (newest_model_step(ckpt_dir), newest_copy_step(ckpt_dir)) if leader else (-1, -1)
    name = socket.gethostname().encode()[:_NAME].ljust(_NAME, b"\0")
    row = [int(st is None), -1 if st is None else int(st["step"]), int(os.environ.get("GROUP_RANK", "-1")),
           newest, copied, state_rank, *name]
    n = dist.get_world_size(mesh.fast)
    rows = [torch.zeros(len(row), dtype=torch.int64, device=mesh.device) for _ in range(n)]
    dist.all_gather(rows, _tensor(row, mesh.device), group=mesh.fast)
    table = [[int(v) for v in r.tolist()] for r in rows]
    missing = [r for r in range(n) if table[r][0]]
    if not missing:
        return agree_step(path, st, mesh, state_rank)
    if len(missing) == n:
        raise CheckpointError(f"--checkpoint.resume latest: no host has a checkpoint in {ckpt_dir} (check --run.name "
                              "/ --checkpoint.dir, or start the run without --checkpoint.resume)")
    if 0 not in missing and table[0][4] >= 0:
        return heal_from_leader(st, table[0][4], [table[r][5] for r in range(n)], missing, mesh, ckpt_dir,
                                state_rank, timeout_s)
    steps = sorted({table[r][1] for r in range(n) if r not in missing})
    who = []
    for r in missing:
        g = dist.get_global_rank(mesh.fast, r)
        host = bytes(table[r][6:]).rstrip(b"\0").decode(errors="replace")
        node = f"torchrun --node-rank {table[r][2]}, " if table[r][2] >= 0 else ""
        who.append(f"{mesh.describe(g)} on the host of {node}hostname {host!r} (it needs rank_{table[r][5]:05d}.pt)")
    step = steps[0]
    msg = (f"cannot resume: {'; '.join(who)}: no checkpoint in {ckpt_dir} on that host (an empty disk: a replaced "
           f"machine?), while the other hosts resume from step {'/'.join(map(str, steps))}, and the leader's disk "
           "holds no copy of every rank's state (--checkpoint.leader-copy was off, or no copy had landed yet). A "
           "rank's training state (its stage's weights, optimizer and counters) is then kept only on the disk of the "
           f"host that ran it: copy {ckpt_dir}/{os.path.basename(step_dir(ckpt_dir, step))}/ and {ckpt_dir}/latest "
           "from that machine's old disk to the same place on the new one and start it again")
    if 0 not in missing and table[0][3] >= 0:
        msg += (f". If that disk is lost: the leader's disk (global rank 0's host) holds the whole model of step "
                f"{table[0][3]} ({step_dir(ckpt_dir, table[0][3])}); start a new run from it with --model.path "
                "pointing there (every rank's optimizer state starts afresh)")
    raise CheckpointError(msg)


def heal_from_leader(st: dict | None, step: int, state_ranks: list[int], missing: list[int], mesh, ckpt_dir: str,
                     state_rank: int, timeout_s: float) -> dict:
    """Collective on the fast group (``resume_state``): every rank resumes from ``step``,
    the newest checkpoint whose copy of every rank's state is on the leader's disk. A rank
    loads it from its own disk if that holds it (verified), else the leader sends the
    file (``send_file``: sha256-checked, loaded with weights_only) over a gloo group of
    the fast ranks whose timeout allows 1 Mbit/s for every byte, so that ranks waiting
    for another's transfer do not time out. Returns this rank's state of ``step``."""
    me = dist.get_rank(mesh.fast)
    src = step_dir(ckpt_dir, step)
    mine = None
    if st is not None and int(st["step"]) == step:
        mine = st
    elif me not in missing:
        try:
            verify(src)
            mine = load_rank_state(src, state_rank)
        except (CheckpointError, OSError):
            mine = None  # pruned here (or corrupt): the leader's copy instead
    need = gather_ints(int(mine is None), mesh.fast, mesh.device)
    takers = [r for r in range(len(need)) if need[r]]
    files = [os.path.join(src, f"rank_{state_ranks[r]:05d}.pt") for r in takers]
    sizes = [os.path.getsize(f) for f in files] if me == 0 else [0] * len(takers)
    total = reduce_int(sum(sizes), mesh.fast, mesh.device, dist.ReduceOp.SUM)
    members = [dist.get_global_rank(mesh.fast, r) for r in range(len(need))]
    group = dist.new_group(members, timeout=timedelta(seconds=timeout_s + 8.0 * total / 1e6), backend="gloo")
    cpu, t0, moved = torch.device("cpu"), time.monotonic(), 0  # (the leader verified src: newest_copy_step)
    for r, f in zip(takers, files):
        if me == 0:
            with open(f, "rb") as fh:
                moved += send_file(fh.read(), dist.get_group_rank(group, members[r]), group, cpu)
        elif me == r:
            part = os.path.join(ckpt_dir, f".from-leader-{os.path.basename(f)}")
            os.makedirs(ckpt_dir, exist_ok=True)
            recv_file(part, dist.get_group_rank(group, members[0]), group, cpu)
            mine = torch.load(part, weights_only=True, map_location="cpu")
            mine["_file_bytes"] = os.path.getsize(part)
            os.remove(part)
    dist.barrier(group=group)
    dist.destroy_process_group(group)
    if int(mine["step"]) != step:
        raise CheckpointError(f"the leader's copy of rank {state_rank}'s state in {src} holds step {mine['step']}, "
                              f"not {step}")
    if me == 0:
        lost = [dist.get_global_rank(mesh.fast, r) for r in missing]
        print(f"warning: ranks {lost} had no checkpoint on their host's disk (a replaced machine?): every rank "
              f"resumes from step {step}, the newest whose state the leader holds for all; the leader sent "
              f"{len(takers)} rank file(s) ({moved / 2**20:.2f} MiB) in {time.monotonic() - t0:.1f} s", flush=True)
    return mine


def newest_copy_step(root: str) -> int:
    """The step of the newest checkpoint under ``root`` (the leader's disk) that holds the
    whole model and every fast rank's state (checkpoint_export's leader copy, or one
    disk for all), verified; or -1."""
    for step, d in reversed(complete_checkpoints(root)):
        try:
            meta = read_meta(d)
        except (OSError, ValueError):
            continue
        disk = meta.get("disk")
        if disk and not (disk.get("model") and len(disk.get("ranks", ())) == sum(replica_stages(meta))):
            continue
        try:
            verify(d)
        except CheckpointError:
            continue
        return step
    return -1


def newest_model_step(root: str) -> int:
    """The step of the newest checkpoint under ``root`` holding the whole model, or -1."""
    d = newest_model(root)
    return -1 if d is None else int(os.path.basename(d)[5:])
