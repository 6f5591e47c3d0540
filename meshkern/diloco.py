"""Streaming DiLoCo (Douillard et al. 2025): infrequent, fragmented, overlapped outer syncs.

Usable with any model: construct it over the parameters a rank trains and call
:meth:`StreamingDiLoCo.step` after every inner optimizer step::

    diloco = StreamingDiLoCo(model.named_parameters(), group, sync_every=H, num_fragments=F,
                             overlap_steps=tau, compressor=PowerSGD(rank=4))
    for batch in data:
        loss(model, batch).backward(); inner_opt.step(); inner_opt.zero_grad()
        diloco.step()
    diloco.finish()

Algorithm. Parameters are cut into F contiguous fragments of about equal size. Each
fragment keeps a global copy theta_g (the last synced value, fp32 for half-precision
parameters) and outer Nesterov-SGD momentum. Fragment f starts a sync after inner steps
t with t mod H == floor((f+1) H / F) mod H (staggered, so at most one fragment's
traffic starts per step; the last fragment syncs at multiples of H):

    delta = theta_g - theta_local          pseudo-gradient (snapshot at start)
    avg = compressor.all_reduce_mean(delta, group)        runs in a background thread
    ... tau = overlap_steps more inner steps run meanwhile ...
    theta_g = OuterSGD(theta_g, grad=avg)  (lr outer_lr, momentum, Nesterov)
    theta_local = mix * theta_g + (1 - mix) * theta_local

Defaults follow the DiLoCo papers: outer_lr 0.7, outer_momentum 0.9 with Nesterov
(0 when the compressor's error feedback replaces the momentum, e.g. SparseLoCo),
mix 1.0 without overlap (replace) and 0.5 with overlap (Streaming DiLoCo's alpha).

Failure guarantees. A sync that fails (peer died, timeout: ``timeout_s`` per
collective) raises :class:`meshkern.compress.SyncError` from :meth:`step` or
:meth:`finish`; nothing is merged unless every sync due at that step completed, so
parameters are never half-merged, and the instance then refuses further use. A sync
whose average is not finite (garbage from a peer) is skipped on every rank alike
(counted in ``syncs_skipped``) and leaves the parameters and outer state untouched.

Byte accounting: ``bytes_sent`` / ``bytes_received`` are the compressor's exact counters
(see meshkern.compress.base); ``history`` has one record per completed sync.

Subspace-constrained parameters (docs/subspace_sync.md). When some weights must keep
their columns in a shared subspace (W = U U^T W, e.g. the output projections of a model
trained through subspace-projected pipeline boundaries), pass ``projector(name, tensor)
-> tensor`` (the projection of a tensor of parameter ``name``; the tensor itself for an
unconstrained parameter) and ``projection``, "none" or "+"-joined steps of:

    "outer"      avg <- P(avg)            before the outer optimizer (momentum included)
    "error"      e <- P(e), delta <- P(delta) before compression: the compressor's
                 error-feedback buffer (SparseLoCo) and its input stay in the subspace
    "reproject"  theta_g <- P(theta_g), theta_local <- P(theta_local) after the merge

A sparse pseudo-gradient (top-k, quantized) is not in the subspace even when every
replica's delta is, so "error" alone does not keep the constraint; "outer" keeps it when
the parameters start in the subspace; "reproject" keeps it from any start.
"""
from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
import warnings
from typing import Callable, Iterable

import torch
from torch import Tensor

from meshkern.compress import Compressor, NoCompression, SyncError


class SyncWorker:
    """One daemon thread running sync jobs in submission order, so every rank issues
    its collectives in the same order; daemon so a peer stuck in a collective cannot
    keep the process alive at exit. Several StreamingDiLoCo instances of one rank (one
    per process group, e.g. a heterogeneous mesh's full replica) share one (``worker=``),
    so their collectives, too, run one at a time in the order they were started (NCCL
    does not order collectives of different communicators issued from several threads)."""

    def __init__(self, device: torch.device):
        self._device = device
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="diloco-sync", daemon=True)
        self._thread.start()

    def _run(self):
        if self._device.type == "cuda":  # the current CUDA device is per thread
            torch.cuda.set_device(self._device)
        while True:
            fn, fut = self._jobs.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # reported to the caller by fut.result()
                fut.set_exception(e)

    def submit(self, fn) -> cf.Future:
        fut: cf.Future = cf.Future()
        self._jobs.put((fn, fut))
        return fut


def _split_fragments(numels: list[int], num_fragments: int) -> list[list[int]]:
    """Contiguous, non-empty index ranges with about equal total numel."""
    total = sum(numels)
    frags, cur, acc = [], [], 0
    for i, n in enumerate(numels):
        cur.append(i)
        acc += n
        left_params = len(numels) - i - 1
        left_frags = num_fragments - len(frags) - 1
        if left_frags > 0 and (acc >= total * (len(frags) + 1) / num_fragments or left_params == left_frags):
            frags.append(cur)
            cur = []
    frags.append(cur)
    return frags


PROJECTION_STEPS = ("outer", "error", "reproject")


def parse_projection(projection: str) -> tuple[str, ...]:
    """``"none"`` -> (); ``"error+outer"`` -> ("outer", "error") (canonical order).
    Raises ValueError for an unknown, repeated or empty step."""
    if not isinstance(projection, str):
        raise TypeError(f"projection must be a str, got {type(projection).__name__}")
    if projection == "none":
        return ()
    parts = projection.split("+")
    bad = [p for p in parts if p not in PROJECTION_STEPS]
    if bad or len(set(parts)) != len(parts):
        raise ValueError(f"projection must be 'none' or '+'-joined distinct steps of {PROJECTION_STEPS} "
                         f"(e.g. 'outer+error'), got {projection!r}")
    return tuple(p for p in PROJECTION_STEPS if p in parts)


class StreamingDiLoCo:
    """Outer loop of Streaming DiLoCo over ``params`` (a list of tensors or of (name,
    tensor) pairs, e.g. ``model.named_parameters()``); see the module docstring.

    ``projector(name, tensor) -> tensor`` and ``projection`` (see "Subspace-constrained
    parameters" above): ``name`` is the parameter's name as given in ``params``
    (``param{i}`` for bare tensors), ``tensor`` a detached tensor of that parameter's
    shape (fp32 for half-precision parameters; with "error" also the compressor's fp32
    buffer); the projector returns a tensor of the same shape (the input itself for an
    unconstrained parameter) and must be a pure function (with overlap_steps > 0 the
    "error" step calls it from the sync thread). It is checked once on every parameter
    at construction. With ``projector=None`` (or ``projection="none"``) nothing changes.

    ``worker``: a :class:`SyncWorker` shared with the rank's other instances (default: its
    own, started at the first sync).
    """

    def __init__(self, params: Iterable, group=None, *, sync_every: int = 100, num_fragments: int = 1,
                 outer_lr: float = 0.7, outer_momentum: float | None = None, nesterov: bool = True,
                 overlap_steps: int = 0, mix: float | None = None, compressor: Compressor | None = None,
                 timeout_s: float = 300.0, projector: Callable[[str, Tensor], Tensor] | None = None,
                 projection: str = "none", worker: "SyncWorker | None" = None):
        named = []
        for i, item in enumerate(params):
            name, p = item if isinstance(item, tuple) else (f"param{i}", item)
            if not isinstance(p, Tensor):
                raise TypeError(f"params[{i}] ({name}) is a {type(p).__name__}, expected a torch.Tensor")
            if not p.is_floating_point():
                raise TypeError(f"params[{i}] ({name}) has dtype {p.dtype}; DiLoCo syncs floating-point tensors")
            named.append((name, p))
        if not named:
            raise ValueError("StreamingDiLoCo needs at least one parameter")
        if len({id(p) for _, p in named}) != len(named):
            raise ValueError("the same tensor appears twice in params")
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every must be an int >= 1, got {sync_every!r}")
        if not isinstance(num_fragments, int) or not 1 <= num_fragments <= min(sync_every, len(named)):
            raise ValueError(f"num_fragments must be an int in [1, min(sync_every={sync_every}, "
                             f"#params={len(named)})], got {num_fragments!r}")
        if not isinstance(overlap_steps, int) or not 0 <= overlap_steps < sync_every:
            raise ValueError(f"overlap_steps must be an int in [0, sync_every={sync_every}), got {overlap_steps!r}")
        if mix is None:
            mix = 1.0 if overlap_steps == 0 else 0.5
        if not 0 < mix <= 1:
            raise ValueError(f"mix must be in (0, 1], got {mix}")
        if not outer_lr > 0:
            raise ValueError(f"outer_lr must be > 0, got {outer_lr}")
        self.compressor = compressor if compressor is not None else NoCompression(timeout_s=timeout_s)
        if not isinstance(self.compressor, Compressor):
            raise TypeError(f"compressor must be a meshkern.compress.Compressor, got {type(self.compressor).__name__}")
        if outer_momentum is None:
            outer_momentum = 0.0 if self.compressor.replaces_outer_momentum else 0.9
        if not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum}")
        steps = parse_projection(projection)
        if projector is not None and not callable(projector):
            raise TypeError(f"projector must be a callable (name, tensor) -> tensor, got {type(projector).__name__}")
        if steps and projector is None:
            raise ValueError(f"projection={projection!r} needs a projector(name, tensor) -> tensor")
        if "error" in steps and type(self.compressor).project_error is Compressor.project_error:
            raise ValueError(f"projection={projection!r}: the 'error' step projects the compressor's error-feedback "
                             f"buffer, which {type(self.compressor).__name__} does not expose (SparseLoCo does); "
                             f"use 'outer' or 'reproject'")

        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.group = group
        self.sync_every = sync_every
        self.num_fragments = num_fragments
        self.overlap_steps = overlap_steps
        self.mix = float(mix)
        self.timeout_s = float(timeout_s)
        self.projector = projector if steps else None
        self.projection = "+".join(steps) if steps else "none"
        self._steps = steps
        self.fragments = _split_fragments([p.numel() for p in self.params], num_fragments)
        self.offsets = [((f + 1) * sync_every // num_fragments) % sync_every for f in range(num_fragments)]
        with torch.no_grad():
            self._global = [p.detach().to(torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype,
                                          copy=True) for p in self.params]
        self._outer = torch.optim.SGD(self._global, lr=outer_lr, momentum=outer_momentum,
                                      nesterov=nesterov and outer_momentum > 0)
        if self.projector is not None:  # fail here, not in a sync thread, on a projector that does not fit
            with torch.no_grad():
                for i, g in enumerate(self._global):
                    self._project(i, g.clone())
        self.step_count = 0
        self.syncs_done = 0
        self.syncs_skipped = 0
        self.history: list[dict] = []
        self._pending: list[tuple[int, int, int, cf.Future]] = []  # (due step, fragment, start step, future)
        self._worker: SyncWorker | None = worker
        self._failed: str | None = None
        self._adopted: dict[int, Tensor] = {}  # adopt_peer_parameters: param index -> the peer's unsynced progress

    # ---- counters -----------------------------------------------------------------------
    @property
    def bytes_sent(self) -> int:
        return self.compressor.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.compressor.bytes_received

    # ---- the loop -----------------------------------------------------------------------
    def step(self) -> None:
        """Call after every inner optimizer step: starts the syncs due after this step and
        merges the ones whose overlap window ends now. Raises SyncError on a failed sync."""
        self._check_usable()
        self.step_count += 1
        t = self.step_count
        for f, off in enumerate(self.offsets):
            if t % self.sync_every == off:
                self._start(f, t)
        due = [job for job in self._pending if job[0] <= t]
        if due:
            self._complete(due)

    def finish(self) -> None:
        """Wait for every in-flight sync and merge it (end of training, before a checkpoint)."""
        self._check_usable()
        if self._pending:
            self._complete(list(self._pending))

    def recover(self) -> list[int]:
        """After a failed sync (a peer died inside it): drop every sync in flight without
        merging it, forget those fragments' compressor streams (their state may be
        half-updated: each restarts from zero error and the shared seed, as on every other
        rank whose sync failed alike) and make the instance usable again. Parameters and
        global copies are untouched: the next sync of each fragment carries the progress.
        Returns the fragments dropped. Elastic replicas (orchestration.elastic) call it."""
        dropped = []
        for _, f, _, fut in self._pending:
            try:
                fut.result(timeout=4 * self.timeout_s)
            except BaseException:  # the failure is what we recover from
                pass
            self.compressor.reset_stream(f"fragment{f}")
            dropped.append(f)
        self._pending.clear()
        self._failed = None
        return dropped

    @property
    def global_copies(self) -> list[Tensor]:
        """The global copies (the last synced values), alike on every replica; read only."""
        return self._global

    @property
    def in_flight(self) -> bool:
        """True while a sync started at an earlier step has not been merged."""
        return bool(self._pending)

    def adopt_peer_parameters(self) -> None:
        """A replica that just took a peer's state (``load_state_dict``) and the peer's
        parameters: from now on it counts only its own work. The peer's unsynced progress
        (its parameters minus the global copies) is the peer's to send; this instance
        subtracts it from its next pseudo-gradient of each fragment (once), so it is not
        averaged in twice. The compressor's error feedback is zeroed for the same reason
        (the warm-start factors, alike on every replica, stay).

        Why not restart from the global copies instead: with overlap (mix < 1) a replica's
        parameters keep half of their unsynced progress at every merge, so the global copy
        lags them; restarting there lost +0.009-0.012 held-out loss after one heal at 40
        steps of the default model (3 seeds), taking the peer's parameters +0.003."""
        with torch.no_grad():
            self._adopted = {i: self._global[i] - p.detach().to(self._global[i].dtype)
                             for i, p in enumerate(self.params)}
        self.compressor.clear_error_feedback()

    def _project(self, i: int, t: Tensor) -> Tensor:
        """projector(name_i, t), checked: a tensor of t's shape, cast to t's dtype/device."""
        out = self.projector(self.names[i], t)
        if not isinstance(out, Tensor) or out.shape != t.shape:
            got = f"shape {tuple(out.shape)}" if isinstance(out, Tensor) else f"a {type(out).__name__}"
            raise ValueError(f"projector returned {got} for parameter {self.names[i]!r} of shape {tuple(t.shape)}; "
                             f"it must return a tensor of the input's shape")
        if not out.is_floating_point():
            raise ValueError(f"projector returned dtype {out.dtype} for parameter {self.names[i]!r}; "
                             f"it must return a floating-point tensor")
        return out.to(device=t.device, dtype=t.dtype)

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise SyncError(f"StreamingDiLoCo is unusable after a failed sync: {self._failed}")

    def _start(self, f: int, t: int) -> None:
        idx = self.fragments[f]
        with torch.no_grad():
            delta = [self._global[i] - self.params[i].detach().to(self._global[i].dtype) for i in idx]
            if self._adopted:  # a healed replica's first sync of f: its own work since the heal only
                delta = [d - self._adopted.pop(i) if i in self._adopted else d for i, d in zip(idx, delta)]
        comp, group, key = self.compressor, self.group, f"fragment{f}"
        project_error = "error" in self._steps

        def job():
            nonlocal delta
            s0, r0 = comp.bytes_sent, comp.bytes_received
            if project_error:  # in the sync thread: it owns the compressor's state
                with torch.no_grad():
                    comp.project_error(key, [tuple(d.shape) for d in delta], lambda j, e: self._project(idx[j], e))
                    delta = [self._project(i, d) for i, d in zip(idx, delta)]
            avg = comp.all_reduce_mean(delta, group, key=key)
            return avg, comp.bytes_sent - s0, comp.bytes_received - r0

        if self.overlap_steps == 0:
            fut: cf.Future = cf.Future()
            try:
                fut.set_result(job())
            except BaseException as e:
                fut.set_exception(e)
        else:
            if self._worker is None:
                self._worker = SyncWorker(self.params[0].device)
            fut = self._worker.submit(job)
        self._pending.append((t + self.overlap_steps, f, t, fut))

    def _complete(self, due) -> None:
        """Wait for all ``due`` syncs; merge them only if every one succeeded."""
        results = []
        for due_step, f, start, fut in due:
            try:
                # the compressor times out each collective; this bounds the whole job
                results.append((f, start, fut.result(timeout=4 * self.timeout_s)))
            except BaseException as e:
                self._failed = f"sync of fragment {f} started at step {start} failed: {e}"
                if isinstance(e, cf.TimeoutError):
                    raise SyncError(self._failed) from e
                if isinstance(e, SyncError):
                    raise SyncError(self._failed) from e
                raise
        for job in due:
            self._pending.remove(job)
        for f, start, (avg, sent, received) in results:
            merged = self._merge(f, avg)
            self.history.append({"fragment": f, "start_step": start, "merge_step": self.step_count,
                                 "bytes_sent": sent, "bytes_received": received, "merged": merged})

    def _merge(self, f: int, avg: list[Tensor]) -> bool:
        idx = self.fragments[f]
        if not all(bool(torch.isfinite(a).all()) for a in avg):
            self.syncs_skipped += 1
            warnings.warn(f"StreamingDiLoCo: non-finite average for fragment {f} at step {self.step_count}; "
                          f"sync skipped, parameters unchanged", RuntimeWarning, stacklevel=3)
            return False
        outer, reproject = "outer" in self._steps, "reproject" in self._steps
        with torch.no_grad():
            for i, a in zip(idx, avg):
                a = a.to(self._global[i].dtype)
                self._global[i].grad = self._project(i, a) if outer else a
            self._outer.step()
            for i in idx:
                self._global[i].grad = None
                if reproject:
                    self._global[i].copy_(self._project(i, self._global[i].clone()))
                p = self.params[i]
                if self.mix == 1.0:
                    p.copy_(self._global[i])
                else:
                    new = torch.lerp(p.detach().to(self._global[i].dtype), self._global[i], self.mix)
                    p.copy_(self._project(i, new) if reproject else new)
        self.syncs_done += 1
        return True

    # ---- checkpoint ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Global copies, outer optimizer (momentum), compressor state (error feedback,
        warm-start factors), step and sync counters, and the syncs in flight: tensors and
        plain values only (loadable with ``torch.load(weights_only=True)``), all copies
        (later steps never change a returned state).

        A sync in flight is waited for (its all-reduce ran in the background) but NOT
        merged: its averaged delta is saved with its due step, and a loaded instance
        merges it at that step, so a checkpoint never changes the trajectory and a resume
        continues it exactly (call :meth:`finish` first only to merge early, e.g. at the
        end of training)."""
        pending = []
        for due, f, start, fut in self._pending:
            try:
                avg, sent, received = fut.result(timeout=4 * self.timeout_s)
            except BaseException as e:
                self._failed = f"sync of fragment {f} started at step {start} failed: {e}"
                raise SyncError(self._failed) from e
            pending.append({"due": due, "fragment": f, "start": start, "sent": sent, "received": received,
                            "avg": [a.detach().clone() for a in avg]})
        return {
            "names": list(self.names), "shapes": [list(p.shape) for p in self.params],
            "sync_every": self.sync_every, "num_fragments": self.num_fragments, "projection": self.projection,
            "step_count": self.step_count, "syncs_done": self.syncs_done, "syncs_skipped": self.syncs_skipped,
            "global": [g.detach().clone() for g in self._global],
            "outer": _clone_state(self._outer.state_dict()), "compressor": _clone_state(self.compressor.state_dict()),
            "pending": pending,
            "adopted": {int(i): t.detach().clone() for i, t in self._adopted.items()},
        }

    def load_state_dict(self, sd: dict) -> None:
        """Restore a :meth:`state_dict` taken with the same parameters and schedule
        (including its syncs in flight, merged at their due steps)."""
        if self._pending:
            raise RuntimeError("cannot load state while syncs are in flight")
        if list(sd["names"]) != self.names or [list(s) for s in sd["shapes"]] != [list(p.shape) for p in self.params]:
            raise ValueError("state_dict was saved for different parameters (names or shapes differ)")
        if sd["sync_every"] != self.sync_every or sd["num_fragments"] != self.num_fragments:
            raise ValueError(f"state_dict schedule (H={sd['sync_every']}, F={sd['num_fragments']}) differs from "
                             f"this instance (H={self.sync_every}, F={self.num_fragments})")
        saved = sd.get("projection", "none")
        if saved != self.projection:
            raise ValueError(f"state_dict was saved with projection={saved!r}, this instance has "
                             f"projection={self.projection!r} (its global copies and error feedback may not "
                             f"satisfy this instance's constraint)")
        with torch.no_grad():
            for g, s in zip(self._global, sd["global"]):
                g.copy_(s)
        self._outer.load_state_dict(sd["outer"])
        self.compressor.load_state_dict(sd["compressor"])
        self.step_count = int(sd["step_count"])
        self.syncs_done = int(sd["syncs_done"])
        self.syncs_skipped = int(sd["syncs_skipped"])
        self._adopted = {int(i): t.to(self._global[int(i)].device).clone() for i, t in sd.get("adopted", {}).items()}
        for job in sd.get("pending", []):
            fut: cf.Future = cf.Future()
            fut.set_result(([a.to(self.params[0].device).clone() for a in job["avg"]], int(job["sent"]),
                            int(job["received"])))
            self._pending.append((int(job["due"]), int(job["fragment"]), int(job["start"]), fut))


def _clone_state(x):
    """A deep copy of a state dict's tensors (nested dicts / lists / tuples)."""
    if isinstance(x, Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _clone_state(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_clone_state(v) for v in x)
    return x
