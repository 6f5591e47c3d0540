"""The fast rank's side of the anchor circuit, on the trainer's thread (docs/anchor.md).

``FastHook`` turns what the link thread (orchestration.anchor.fastlink) delivered into
optimizer input: ``poll(step)`` once per step, after the backward and before the
optimizer step, drains the link's events, checks staleness (and in delay mode waits for
the update that is due), hands an accepted update to the optimizer, and watches for a
stalled or lost anchor (prior off until a fresh update arrives). It never blocks on the
anchor except in the deterministic delay mode.
"""
from __future__ import annotations

import os
import queue
import sys
import time
import warnings

import torch

from orchestration.distributed.secret import SECRET_ENV, secret_path
from orchestration.anchor.bounds import check_entries
from orchestration.anchor.fastlink import Arrival, FastLink
from orchestration.anchor.links import store_address
from orchestration.anchor.wire import Layout, Rejected, eligible_params


class FastHook:
    """The trainer's anchor hook on a fast rank (the contract orchestration.components.builders.NullAnchor
    documents, with the anchor on).

    ``poll(step)``: apply what arrived (the optimizer's ``observe_anchor_update``, both
    transports); ``after_step(step)``: offer a snapshot (replica 0); ``bytes_sent``
    (axis "anchor"); ``stats()`` (JSON-ready); ``close()``."""

    def __init__(self, ctx):
        cfg, mesh = ctx.cfg, ctx.mesh
        opt = ctx.optimizer
        if not hasattr(opt, "observe_anchor_update"):
            raise ValueError("--anchor.enabled needs --train.optimizer spectral (an optimizer that takes anchor updates)")
        self.cfg, self.ctx, self.opt = cfg, ctx, opt
        a = cfg.anchor
        self.every, self.delay, self.max_stale = a.snapshot_every, a.delay, a.max_staleness
        self.steps, self.timeout_s = cfg.train.steps, cfg.mesh.timeout_s
        self.stage_index, self.row = mesh.stage, mesh.row
        self.params = ctx.params
        named = eligible_params(ctx.stage, opt.param_groups)
        self.layout = Layout.build(named, a.transport, cfg.train.spectral_rank, self.params[0].dtype)
        flat = opt.param_order()
        where = {id(p): i for i, p in enumerate(flat)}
        self.slots = [where[id(p)] for _, p in named]  # wire entry -> optimizer flat index
        self.n_opt = len(flat)
        # Elastic: every replica serves snapshots (the anchor pulls from the lowest one linked,
        # whichever replicas are alive); each keeps its newest one, a copy of its stage (CPU).
        # Fixed: the lowest replica of the anchor's split (replica 0 on a homogeneous mesh).
        self.speaks = mesh.row == min(mesh.layout.anchor_rows())  # the lowest replica the anchor serves: it logs
        self.serves = self.speaks or cfg.mesh.elastic
        # Delay mode waits for a due update at most this long. With replicas the anchor does
        # not serve (a heterogeneous mesh), those wait meanwhile in the step's collectives,
        # bounded by --mesh.timeout-s: half of it leaves them room for the step itself.
        self.delay_wait_s = self.timeout_s / 2 if mesh.layout.anchor_scope() else self.timeout_s
        self.generation = 0  # of the anchor row linked now (0: none yet)
        self.pending: list[Arrival] = []
        self.refused: set[int] = set()  # versions whose update the link thread refused
        self.base_bytes = None
        self.c = {"arrivals": 0, "applied": 0, "rejected": 0, "rejected_stale": 0, "rejected_nonfinite": 0,
                  "rejected_shape": 0, "rejected_negative": 0, "rejected_magnitude": 0, "rejected_ortho": 0,
                  "rejected_optimizer": 0, "rejected_auth": 0, "joins": 0}
        self.said: set[str] = set()  # rejection reasons already logged
        self.eligible = [p for _, p in named]  # wire entry -> parameter (bounds.check_entries)
        self.max_ratio = float(getattr(opt, "max_anchor_ratio", 1e3))
        self.hist: dict[int, int] = {}
        self.last_staleness = None
        self.last_round_ms = None
        self.start = None
        self.steps_seen = 0
        self.last_applied_step = None
        self.joined_step = None
        self.link_state = "up"    # up | lost
        self.stalled = False
        self.degraded = False     # delay mode fell back to the asynchronous rule
        self.blocked_s = 0.0
        # Delay mode, replica 0: the snapshots whose update is not yet due (v + delay >= the
        # current version), kept for the checkpoint so that a resumed run re-serves them
        # (state_dict); and the versions a resumed run still waits for although v < start.
        self.kept: dict[int, torch.Tensor] = {}
        self.resumed_versions: set[int] = set()
        self.version = None  # of the parameters after the last step (after_step)
        secret = ctx.plan.secret  # the run's (orchestration.distributed.secret), resolved before the ranks started
        if secret is None:
            raise ValueError("--anchor.enabled: the plan holds no run secret (orchestration.launch.prepare resolves it)")
        if self.speaks and mesh.stage == 0 and not os.environ.get(SECRET_ENV):
            print(f"[anchor] anchor rows authenticate with this run's secret {secret_path(cfg, ctx.plan.run_dir)} (mode 0600); "
                  f"an anchor row on another machine needs a copy: --anchor.secret-file PATH (or {SECRET_ENV})",
                  file=sys.stderr, flush=True)
        self.link = FastLink(stage=mesh.stage, row=mesh.row, layout=self.layout,
                             numel=sum(p.numel() for p in self.params), snapshot_codec=a.snapshot_codec,
                             serves=self.serves, newest_first=not self.delay, timeout_s=self.timeout_s,
                             secret=secret, store=store_address(cfg) if a.store else None,
                             relink=cfg.mesh.elastic, max_bps=cfg.anchor_pace_bps)

    # ------------------------------------------------------------------ helpers
    def _store_snapshot(self, version: int) -> None:
        if version + self.delay >= self.steps:
            return  # its update would come after the last step
        flat = torch.cat([p.detach().reshape(-1) for p in self.params]).cpu()  # fresh, never mutated
        if self.delay:
            self.kept[version] = flat
        self.link.offer(version, flat, keep_older=bool(self.delay))

    def _log(self, msg: str) -> None:
        if self.speaks:  # one line per stage column, not one per replica
            print(f"[anchor] stage {self.stage_index}: {msg}", file=sys.stderr, flush=True)

    @property
    def prior_on(self) -> bool:
        return self.opt.prior_enabled

    def _set_prior(self, on: bool, step: int, why: str) -> None:
        if on == self.opt.prior_enabled:
            return
        self.opt.set_prior_enabled(on)
        self._log(f"step {step}: {why}")

    def _drain(self, step: int, block_s: float = 0.0) -> None:
        """Moves what the link delivered into ``pending`` / the counters; waits up to
        ``block_s`` for the first event if there is none. Raises the link thread's
        programming error, if it had one."""
        first = True
        while True:
            try:
                ev = self.link.events.get(timeout=block_s) if (first and block_s > 0) else self.link.events.get_nowait()
            except queue.Empty:
                return
            first = False
            if ev[0] == "error":
                raise RuntimeError(f"the anchor link thread of stage {self.stage_index} failed "
                                   f"(a bug, not a lost anchor): {type(ev[1]).__name__}: {ev[1]}") from ev[1]
            if ev[0] == "update":
                self.c["arrivals"] += 1
                self.pending.append(ev[1])
            elif ev[0] == "rejected":  # refused by the link thread (wrong size / layout)
                self.c["arrivals"] += 1
                self.refused.add(ev[2])
                self._reject(ev[1])
            elif ev[0] == "refused":  # a peer at the pair link without the run's secret: got nothing
                self._reject("auth", ev[1], step)
            elif ev[0] == "joined":
                self.generation = ev[1]
                self.c["joins"] += 1
                if self.link_state != "up" or ev[1] > 1:  # a rejoin (the first join counts from the start)
                    self.joined_step = step
                    self.link_state = "up"
                    self._log(f"step {step}: anchor row generation {ev[1]} joined; its updates are applied "
                              "as they arrive")
            elif ev[0] == "lost" and self.link_state == "up":
                self.link_state = "lost"
                self._log(f"step {step}: lost the anchor ({ev[1]}); the fast circuit continues as plain masked "
                          "AdamW (after the updates already received)")

    def _reject(self, reason: str, why: str = "", step: int | None = None) -> None:
        self.c["rejected"] += 1
        self.c[f"rejected_{reason}"] = self.c.get(f"rejected_{reason}", 0) + 1
        if why and reason not in self.said:  # one line per reason and column
            self.said.add(reason)
            at = "" if step is None else f"step {step}: "
            self._log(f"{at}rejected an anchor update ({reason}: {why}); it changes nothing (counted in "
                      f"anchor_rejected_{reason})")

    def _due(self, step: int) -> int | None:
        """Delay mode: the snapshot version whose update is due at ``step``, if any."""
        v = step - self.delay
        return v if (v >= self.start or v in self.resumed_versions) and v % self.every == 0 else None

    def _applied_before(self, version: int) -> int | None:
        """Delay mode: the newest snapshot version whose update was applied before the
        parameters reached ``version`` (v + delay < version), None if none was."""
        last = version - self.delay - 1
        return None if last < 0 else last - last % self.every

    # ------------------------------------------------------------------ the contract
    def poll(self, step: int) -> None:
        if self.start is None:
            self.start = step
            self.base_bytes = self.ctx.counter.extra.get("anchor", 0)  # restored on resume
            if self.serves and (not self.delay or step % self.every == 0):
                self._store_snapshot(step)
        self.steps_seen += 1
        self._drain(step)
        pick = None
        if self.delay and not self.degraded:
            due = self._due(step)
            if due is not None:
                t0 = time.perf_counter()
                while (self.link_state == "up" and due not in self.refused
                       and not any(x.version == due for x in self.pending)):
                    if time.perf_counter() - t0 > self.delay_wait_s:
                        self.degraded = True
                        self._log(f"step {step}: the update of snapshot {due} did not arrive within "
                                  f"{self.delay_wait_s:.0f} s; delay mode off, updates are applied when they arrive")
                        break
                    self._drain(step, block_s=0.5)
                self.blocked_s += time.perf_counter() - t0
            for x in list(self.pending):
                if x.version + self.delay < step:  # late: can no longer apply exactly delay steps on
                    self.pending.remove(x)
                    self._reject("stale")
                elif x.version == due:
                    self.pending.remove(x)
                    pick = x
        if pick is None and (not self.delay or self.degraded):
            while self.pending:
                x = self.pending.pop(0)
                if not 0 <= step - x.version <= self.max_stale:
                    self._reject("stale")
                    continue
                pick = x
                break
        if pick is not None:
            self._apply(pick, step)
        if self.link_state != "up" and not self.pending:
            self._set_prior(False, step, "anchor prior off (anchor lost)")
        self._watch(step)

    def _apply(self, x: Arrival, step: int) -> None:
        """Checks an update completely (layout, finiteness, magnitude, orthonormal factors)
        and hands it to the optimizer; a bad one is rejected and counted and changes
        nothing: no weight, no optimizer state, not the prior switch. Never raises."""
        staleness = step - x.version
        try:
            entries = self.layout.decode(x.payload)
            check_entries(self.layout, entries, self.eligible, self.max_ratio)
        except Rejected as r:
            self._reject(r.reason, str(r), step)
            return
        aligned = [None] * self.n_opt
        for slot, e in zip(self.slots, entries):
            aligned[slot] = e
        try:
            with warnings.catch_warnings():  # the hook counts and logs a rejection itself
                warnings.simplefilter("ignore", RuntimeWarning)
                factored = self.layout.transport == "factored"  # check_entries above: the same bounds, stricter
                ok = (self.opt.observe_anchor_update(aligned, staleness, factored=True, bounds_checked=True) if factored
                      else self.opt.observe_anchor_update(aligned, staleness))
        except (ValueError, RuntimeError, ArithmeticError) as e:  # a bad update must never stop the fast step
            ok, why = False, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        else:
            why = "the optimizer refused it (out of its bounds)"
        if not ok:
            self._reject("optimizer", why, step)
            return
        self._applied(x, entries, staleness)
        self.last_applied_step = step
        if self.stalled:
            self.stalled = False
            self._log(f"step {step}: anchor updates resumed (staleness {staleness})")
        if self.link_state == "up":
            self._set_prior(True, step, "fresh anchor update: anchor prior back on")

    def _applied(self, x: Arrival, entries, staleness: int) -> None:
        """Bookkeeping of one update handed to the optimizer (tests wrap this to inspect it)."""
        self.c["applied"] += 1
        self.hist[staleness] = self.hist.get(staleness, 0) + 1
        self.last_staleness = staleness
        self.last_round_ms = x.round_ms

    def _watch(self, step: int) -> None:
        """Stall detection: no update applied for more than max_staleness fast steps."""
        ref = [v for v in (self.last_applied_step, self.start, self.joined_step) if v is not None]
        since = step - max(ref)  # a newly joined anchor row gets max_staleness steps of its own
        if self.link_state == "up" and not self.stalled and since > self.max_stale:
            self.stalled = True
            self._log(f"step {step}: no anchor update for {since} fast steps (anchor stalled or too slow); "
                      "continuing as plain masked AdamW until one arrives")
            self._set_prior(False, step, "anchor prior off (stale)")

    def after_step(self, step: int) -> None:
        v = self.version = step + 1  # the parameters now hold version step + 1
        if self.serves and v % self.every == 0:
            self._store_snapshot(v)
        if self.delay and self.serves:  # forget what a checkpoint at version v no longer needs
            for old in [x for x in self.kept if x + self.delay < v]:
                del self.kept[old]
            prev = self._applied_before(v)
            if prev is not None:
                self.link.drop_views_before(prev)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The hook's part of a fast rank's checkpoint (tensors and plain values): its
        counters, and in delay mode on replica 0 what makes a resume exact: the snapshots
        whose update is not yet due and, with the int8 snapshot codec, the coder's view
        after the last version whose update was applied (the anchor's view then)."""
        sd = {"c": dict(self.c), "hist": {int(k): int(v) for k, v in self.hist.items()},
              "steps_seen": self.steps_seen, "last_staleness": self.last_staleness, "kept": {}, "view": None}
        if self.delay and self.serves:
            sd["kept"] = dict(self.kept)
            prev = None if self.version is None else self._applied_before(self.version)
            view = None if prev is None else self.link.view_after(prev)
            if view is not None:
                sd["view"] = {"version": prev, "view": view}
        return sd

    def load_state_dict(self, sd: dict) -> None:
        self.c.update(sd.get("c", {}))
        self.hist = {int(k): int(v) for k, v in sd.get("hist", {}).items()}
        self.steps_seen = int(sd.get("steps_seen", 0))
        self.last_staleness = sd.get("last_staleness")
        if not (self.delay and self.serves):
            return
        if sd.get("view") is not None and self.link.keep_views:
            self.link.resume_view = sd["view"]["view"]  # before any snapshot is offered
        for v, flat in sorted(sd.get("kept", {}).items()):
            v = int(v)
            if v + self.delay < self.steps:
                self.kept[v] = flat
                self.resumed_versions.add(v)
                self.link.offer(v, flat, keep_older=True)

    @property
    def bytes_sent(self) -> int:
        return (self.base_bytes or 0) + self.link.wire_bytes

    def stats(self) -> dict:
        n = sum(self.hist.values())
        return {**self.c, "snapshots_sent": self.link.snapshots_sent, "link": self.link_state,
                "generation": self.generation, "stalled": self.stalled, "prior_on": self.prior_on,
                "last_staleness": self.last_staleness,
                "mean_staleness": (sum(s * c for s, c in self.hist.items()) / n) if n else None,
                "staleness_hist": {str(s): c for s, c in sorted(self.hist.items())},
                "arrival_rate": self.c["arrivals"] / max(1, self.steps_seen),
                "snapshot_bytes": self.link.snapshot_bytes, "update_bytes": self.link.update_bytes,
                "update_payload_bytes": self.layout.nbytes, "last_round_ms": self.last_round_ms,
                "blocked_s": round(self.blocked_s, 4), "in_flight_s": round(self.link.in_flight_s, 4), "delay_mode": bool(self.delay) and not self.degraded}

    def close(self) -> None:
        self.link.close()
