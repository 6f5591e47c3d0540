"""The common base of meshkern's data-parallel compressors.

A compressor averages a list of tensors across the ranks of a torch.distributed process
group, possibly lossily, possibly keeping error-feedback state between calls:

    out = compressor.all_reduce_mean(tensors, group, key="fragment0")

Guarantees every subclass keeps:
- every rank returns the same ``out`` (same values, shapes and dtypes as ``tensors``);
- only tensor collectives go on the wire (all_reduce / all_gather of plain tensors,
  never pickled objects);
- every collective is awaited with ``timeout_s``: a dead or hung peer raises
  :class:`SyncError` (a RuntimeError) naming the collective, never a hang;
- state (error feedback, warm-start factors) is kept per ``key``, so one compressor
  can serve several independent streams (e.g. Streaming DiLoCo's fragments), and is
  saved/restored by ``state_dict`` / ``load_state_dict`` (tensors only, safe to load
  with ``weights_only=True``);
- byte counters are exact and per rank (see "Byte accounting");
- a non-finite input on ANY rank (NaN/Inf: a diverged replica or garbage) never reaches
  the compressed exchange nor the state: the ranks first agree on a one-element flag
  (a SUM all-reduce), and if any rank raised it every rank returns all-NaN tensors (so
  the caller skips the round alike everywhere, as StreamingDiLoCo does) and keeps its
  error feedback / warm-start state exactly as before the call (``skipped`` counts
  these calls). Without this, one bad value folded into the error feedback would make
  every later result NaN on every rank.

Byte accounting. ``payload_bytes`` is the exact size of what this rank hands to
collectives (the compressed message). The one-float non-finite flag of every call is
counted apart, in ``control_bytes_sent`` / ``control_bytes_received`` (at most 8 bytes
per call and rank: negligible next to any message, kept out so the counters below stay
the ring model of the payload). ``bytes_sent`` / ``bytes_received`` are the bytes
this rank puts on / takes off its links when each collective runs as a ring, the
bandwidth-optimal algorithm gloo and NCCL use for large messages: an all_reduce of N
elements is split into ``world`` chunks (sizes as ``torch.tensor_split``), and each rank
sends every chunk but two (reduce-scatter, then all-gather) and receives every chunk
but two; an all_gather of equal blocks of b bytes sends and receives (world-1)*b.
The counts are exact integers under that model and are what the link model uses.
"""
from __future__ import annotations

import datetime
from typing import Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions as _AllgatherOptions

DEFAULT_TIMEOUT_S = 300.0


class SyncError(RuntimeError):
    """A collective failed or did not complete within the timeout (peer died or hung)."""


def ring_all_reduce_bytes(numel: int, itemsize: int, world: int, rank: int) -> tuple[int, int]:
    """(sent, received) bytes of ``rank`` for a ring all-reduce of ``numel`` elements.

    Chunks are sized as ``torch.tensor_split`` would (the first ``numel % world`` chunks
    one element longer). Reduce-scatter step s: rank r sends chunk r-s, receives r-s-1;
    all-gather step s: sends r+1-s, receives r-s (indices mod world, s = 0..world-2).
    So rank r sends all chunks but r+1 and r+2, and receives all but r and r+1.
    """
    if world <= 1 or numel == 0:
        return 0, 0
    base, extra = divmod(numel, world)

    def chunk(i: int) -> int:
        return base + (1 if i % world < extra else 0)

    sent = 2 * numel - chunk(rank + 1) - chunk(rank + 2)
    received = 2 * numel - chunk(rank) - chunk(rank + 1)
    return sent * itemsize, received * itemsize


def ring_all_gather_bytes(block_bytes: int, world: int) -> tuple[int, int]:
    """(sent, received) bytes of one rank for a ring all_gather of equal blocks."""
    return (world - 1) * block_bytes, (world - 1) * block_bytes


def _group_size_rank(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call init_process_group first")
    # A group torch.distributed does not register (torchft's reconfigurable process groups,
    # orchestration.elastic) cannot answer dist.get_rank: it carries its own rank.
    own_rank = getattr(group, "meshkern_rank", None)
    if own_rank is None:
        return dist.get_world_size(group), dist.get_rank(group)
    try:
        return dist.get_world_size(group), own_rank()
    except Exception as e:  # torn down after a peer failed, not rebuilt yet
        raise SyncError(f"the process group is not usable until it is rebuilt (a peer failed): {e}") from e


class Compressor:
    """Base class: collectives with timeouts, exact byte counters, per-key state.

    Subclasses implement :meth:`_all_reduce_mean` (and :meth:`payload_bytes_for`) using
    :meth:`_all_reduce` / :meth:`_all_gather`, which count bytes and enforce timeouts.
    """

    #: True when the compressor's error feedback plays the role of the outer momentum
    #: (SparseLoCo): Streaming DiLoCo then defaults its outer momentum to 0.
    replaces_outer_momentum = False

    def __init__(self, *, timeout_s: float = DEFAULT_TIMEOUT_S):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.payload_bytes = 0
        self.calls = 0
        self.skipped = 0  # calls where some rank's input was non-finite (all-NaN result, state untouched)
        self.control_bytes_sent = 0  # the per-call non-finite flag (see "Byte accounting")
        self.control_bytes_received = 0

    # ---- public API -------------------------------------------------------------------
    def all_reduce_mean(self, tensors: Sequence[torch.Tensor], group=None, *, key: str = "default") -> list[torch.Tensor]:
        """Average ``tensors`` over the ranks of ``group``; every rank gets the same result.

        ``tensors``: floating-point tensors, the same shapes/dtypes/order on every rank.
        Returns new tensors (inputs are not modified). ``key`` selects the state stream.
        Raises TypeError/ValueError for bad input, SyncError when a peer fails.
        """
        if isinstance(tensors, torch.Tensor):
            raise TypeError("tensors must be a list of tensors, got one tensor (wrap it: [t])")
        tensors = list(tensors)
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensors[{i}] is a {type(t).__name__}, expected a torch.Tensor")
            if not t.is_floating_point():
                raise TypeError(f"tensors[{i}] has dtype {t.dtype}; compressors average floating-point tensors")
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, got {type(key).__name__}")
        world, _ = _group_size_rank(group)
        if not tensors:
            return []
        devices = {t.device for t in tensors}
        if len(devices) > 1:
            raise ValueError(f"tensors are on several devices {sorted(map(str, devices))}; put them on one")
        self.calls += 1
        with torch.no_grad():
            if self._any_rank_nonfinite(tensors, group):
                self.skipped += 1
                return [torch.full_like(t, float("nan")) for t in tensors]
            return self._all_reduce_mean([t.detach() for t in tensors], group, world, key)

    def _any_rank_nonfinite(self, tensors, group) -> bool:
        """True on every rank if some rank's ``tensors`` hold NaN/Inf (one-element fp32 SUM
        all-reduce on the tensors' device)."""
        # Built on the tensors' device without a host sync per tensor: one sync, at .item().
        finite = torch.stack([torch.isfinite(t).all() for t in tensors]).all()
        flag = (~finite).to(torch.float32).reshape(1)
        world, rank = _group_size_rank(group)
        s, r = ring_all_reduce_bytes(1, 4, world, rank)
        self.control_bytes_sent += s
        self.control_bytes_received += r
        if world > 1:
            self._wait(lambda: dist.all_reduce(flag, group=group, async_op=True), "all_reduce of the non-finite flag")
        return bool(flag.item() > 0)

    def payload_bytes_for(self, shapes: Sequence[Sequence[int]], dtype: torch.dtype = torch.float32) -> int:
        """Exact bytes this compressor hands to collectives for tensors of ``shapes``
        (one call, any rank), without running it: for tables of a full model."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """Counters plus subclass state (tensors and plain numbers only)."""
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "payload_bytes": self.payload_bytes, "calls": self.calls, "state": self._state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        for k in ("bytes_sent", "bytes_received", "payload_bytes", "calls"):
            setattr(self, k, int(sd[k]))
        self._load_state_dict(sd["state"])

    def reset_stream(self, key: str) -> None:
        """Forget stream ``key``'s state (error feedback, warm-start factors): its next call
        starts as its first did, from zero error and the shared seed, identically on every
        rank that reset it. For a round that failed midway (a peer died inside it), which
        may have left the state half-updated."""
        getattr(self, "_state", {}).pop(key, None)

    def stream_state_dict(self, key: str):
        """Stream ``key``'s state alone (a copy; None while it has none): what a peer in
        only that stream's group needs (an elastic heal by sync segment)."""
        return self._state_dict().get(key)

    def load_stream_state_dict(self, key: str, state) -> None:
        """Sets stream ``key``'s state (``stream_state_dict`` of a peer; None: no state
        yet) and keeps every other stream's."""
        sd = self._state_dict()
        if state is None:
            sd.pop(key, None)
        else:
            sd[key] = state
        self._load_state_dict(sd)

    def clear_error_feedback(self) -> None:
        """Zero every stream's error feedback and keep what all ranks share (PowerSGD's
        warm-start Q). A replica that copies a peer's state (elastic healing) must not copy
        the peer's residual: that residual would then be sent twice. Here the whole state
        is error feedback (SparseLoCo, int8); PowerSGD overrides it."""
        getattr(self, "_state", {}).clear()

    def project_error(self, key: str, shapes: Sequence[Sequence[int]], fn) -> None:
        """Replace the error-feedback buffer of stream ``key`` tensor by tensor:
        ``e_i <- fn(i, e_i)``, where ``e_i`` (a copy, fp32, shaped ``shapes[i]``) is the part
        of the buffer that belongs to the i-th tensor of the lists this stream averages
        (``shapes``: their shapes, in :meth:`all_reduce_mean`'s order) and ``fn`` returns a
        tensor of that shape. A no-op while the stream has no state yet.

        Used by Streaming DiLoCo's ``projection="error"`` to keep what a compressor with
        error feedback sends inside a subspace (see docs/subspace_sync.md). Compressors
        without an error-feedback buffer that can be cut per tensor do not implement it."""
        raise NotImplementedError(f"{type(self).__name__} does not expose an error-feedback buffer to project")

    # ---- for subclasses ---------------------------------------------------------------
    def _all_reduce_mean(self, tensors, group, world, key):
        raise NotImplementedError

    def _state_dict(self) -> dict:
        return {}

    def _load_state_dict(self, sd: dict) -> None:
        pass

    def _wait(self, start, what: str) -> None:
        """Starts a collective (``start()`` returns its work) and waits for it; any failure,
        at the start too (a group that was torn down after a peer died), is a SyncError."""
        try:
            ok = start().wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except Exception as e:  # gloo raises on a reset connection or a timeout
            raise SyncError(f"{type(self).__name__}: {what} failed or timed out after "
                            f"{self.timeout_s:g} s (a peer died or hung): {e}") from e
        if ok is False:
            raise SyncError(f"{type(self).__name__}: {what} did not complete within {self.timeout_s:g} s")

    def _all_reduce(self, flat: torch.Tensor, group, what: str) -> torch.Tensor:
        """In-place SUM all-reduce of a contiguous 1-D tensor, counted and timed out."""
        world, rank = _group_size_rank(group)
        self.payload_bytes += flat.numel() * flat.element_size()
        s, r = ring_all_reduce_bytes(flat.numel(), flat.element_size(), world, rank)
        self.bytes_sent += s
        self.bytes_received += r
        if world > 1:
            self._wait(lambda: dist.all_reduce(flat, group=group, async_op=True), what)
        return flat

    def _all_gather(self, block: torch.Tensor, group, what: str) -> torch.Tensor:
        """All-gather of a contiguous 1-D block: returns [world, numel], counted, timed out."""
        world, _ = _group_size_rank(group)
        nbytes = block.numel() * block.element_size()
        self.payload_bytes += nbytes
        s, r = ring_all_gather_bytes(nbytes, world)
        self.bytes_sent += s
        self.bytes_received += r
        backend = _registered_backend(group)  # None: a group torch.distributed does not register
        registered = backend is not None
        via_cpu = world > 1 and needs_cpu_staging(block.device, backend or group.getBackendName())
        src = block.cpu() if via_cpu else block
        out = torch.empty(world * block.numel(), dtype=block.dtype, device=src.device)
        if world > 1:
            self._wait(lambda: _start_all_gather(out, src, group, world, registered), what)
        else:
            out.copy_(block)
        return (out.to(block.device) if via_cpu else out).view(world, block.numel())


def _start_all_gather(out: torch.Tensor, src: torch.Tensor, group, world: int, registered: bool):
    """Starts the all-gather of ``src`` into ``out`` ([world * numel]); its work. A group
    torch.distributed does not register (torchft's, reconfigured per quorum) is asked
    itself: torch's all-gather looks the group up and refuses it."""
    if not registered:
        return group.allgather([list(out.view(world, -1).unbind(0))], [src], _AllgatherOptions())
    return _all_gather_single(out, src, group=group, async_op=True)


def needs_cpu_staging(device, backend: str) -> bool:
    """True when tensors on ``device`` must cross ``backend``'s point-to-point and all-gather
    calls as CPU copies: gloo all-reduces and broadcasts CUDA tensors but moves them no other
    way (ranks that share a GPU talk over gloo: orchestration.distributed.devices; torchft's
    reconfigurable gloo group is "torchft-gloo")."""
    return torch.device(device).type == "cuda" and backend in ("gloo", "torchft-gloo")


def _registered_backend(group) -> str | None:
    """``group``'s backend name if torch.distributed made it (None: the default group),
    else None: torchft's reconfigurable groups, which ``dist.get_backend`` refuses."""
    try:
        return dist.get_backend(group)
    except ValueError:
        return None


# torch 2.13 deprecates all_gather_into_tensor (a FutureWarning per call) for
# all_gather_single, the same collective; older torch has only the former.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def flatten(tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """One contiguous 1-D buffer holding ``tensors`` back to back (cast to ``dtype``)."""
    dtype = dtype or tensors[0].dtype
    return torch.cat([t.reshape(-1).to(dtype) for t in tensors])


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Inverse of :func:`flatten`: new tensors with the shapes and dtypes of ``like``."""
    out, i = [], 0
    for t in like:
        out.append(flat[i:i + t.numel()].view(t.shape).to(t.dtype).clone())
        i += t.numel()
    return out
