"""An elastic replica's step gate (the protocol: orchestration.components.gate): the
quorum before a step, the heal of a replica that is behind, the commit after it, and the
retry of a step whose update a dead peer broke, all on this rank's ElasticReplica.

What a healing replica's rank receives from a live peer of its stage (``_heal_state``):
the trainable parameters, the inner optimizer's state and the DP sync's state. On a
heterogeneous mesh the peer may be split otherwise: it receives per sync segment (one
torchft group rank each) that segment's parameters and their optimizer state by parameter
name, and the segment group's DP sync state.
"""
from __future__ import annotations

import hashlib
import sys
import time

import torch

from meshkern.compress import SyncError
from orchestration.components.gate import StepGate
from orchestration.elastic.calibrated import CodecMismatch, CodecState


class ElasticGate(StepGate):
    """Wraps ``replica`` (orchestration.elastic.replica.ElasticReplica); the stage's DP
    group becomes the replica's torchft group (reconfigured per quorum)."""

    def __init__(self, replica, mesh, run_dir: str = ""):
        self.replica, self.mesh = replica, mesh
        self.codec = CodecState(replica.cfg, run_dir, mesh.stage, mesh.describe())
        if replica.segments:  # a heterogeneous mesh: the DP sync runs over the segment groups (dp_sync)
            mesh.segments = replica.segment_groups()
        else:
            mesh.dp = replica.group
        self.incarnation = replica.incarnation
        self.committed = True  # whether the last step's update was committed
        self.retried = 0  # allreduce mode: steps run again because a peer died inside them
        self._quorum = False  # the step about to run (or running) began with a quorum
        self._must_heal_to: int | None = None  # resumed without this rank's state: the step its first quorum heals to
        self.params = self.optimizer = self._sync = None

    @property
    def leader(self) -> bool:
        return self.replica.leader

    def attach(self, *, params, optimizer, sync, save, facts=None, subspace=None, stop=None) -> None:
        self.params, self.optimizer, self._sync = params, optimizer, sync
        if subspace is not None:
            self.codec.attach_subspace(subspace)
        self.replica.attach(self._heal_state, self._load_heal, self._synced_digest, save_fn=save,
                            codec_digest_fn=lambda: self.codec.digest, facts_fn=facts, stop_fn=stop)

    # ------------------------------------------------------------------ heal state
    def _heal_state(self, group_rank: int) -> dict:
        """What a healing replica's rank takes from this one for torchft group rank
        ``group_rank`` (torchft serializes it at once: no copies needed)."""
        if self.replica.segments:
            return self._segment_state(self._segment_at(group_rank))
        return {"params": [p.detach() for p in self.params], "optimizer": self.optimizer.state_dict(),
                "sync": self._sync.heal_state(), "codec": self.codec.state()}

    def _segment_at(self, group_rank: int) -> int:
        """The position in ``mesh.segments`` (and in the DP sync's groups) of sync segment ``group_rank``."""
        return [s.index for s in self.replica.managers.slots].index(group_rank)

    def _segment_state(self, j: int) -> dict:
        """Segment ``j``'s heal state, by parameter name: what a peer of any split can apply."""
        named = self._sync.groups[j][1]
        state, opt = self.optimizer.state, self.optimizer
        out = {"params": {n: p.detach() for n, p in named},
               "optimizer": {n: dict(state[p]) for n, p in named if p in state},
               "sync": self._sync.segment_heal_state(j), "codec": self.codec.state()}
        if hasattr(opt, "param_anchor_state"):  # SpectralAdamW: the anchor momentum and prior, by name
            out["anchor"] = {n: opt.param_anchor_state(p) for n, p in named}
        return out

    def _load_segment(self, j: int, sd: dict) -> None:
        named = self._sync.groups[j][1]
        got = sd["params"]
        bad = [n for n, p in named if n not in got or got[n].shape != p.shape]
        if bad or len(got) != len(named):
            raise ValueError(f"{self.mesh.describe()}: the heal state of sync segment {j} does not hold this "
                             f"segment's parameters (first mismatch: {(bad or sorted(set(got) - {n for n, _ in named}))[0]})")
        state = self.optimizer.state
        d = self.optimizer.defaults
        cpu_step = not (d.get("fused") or d.get("capturable"))  # where torch's load_state_dict puts AdamW's step
        with torch.no_grad():
            for n, p in named:
                p.copy_(got[n])
                if n in sd["optimizer"]:
                    state[p] = {k: v.to("cpu" if k == "step" and cpu_step else p.device, copy=True)
                                if torch.is_tensor(v) else v for k, v in sd["optimizer"][n].items()}
                else:
                    state.pop(p, None)
                if hasattr(self.optimizer, "load_param_anchor_state"):
                    # a peer of another split than the anchor's has none: this replica's prior
                    # for the segment then waits for the anchor's next update
                    self.optimizer.load_param_anchor_state(p, sd.get("anchor", {}).get(n, {}))
        self._sync.load_segment_heal_state(j, sd["sync"])
        self.codec.load(sd.get("codec", {}), "a live peer's heal")

    def _load_heal(self, group_rank: int, sd: dict) -> None:
        if self.replica.segments:
            return self._load_segment(self._segment_at(group_rank), sd)
        if len(sd["params"]) != len(self.params) or any(a.shape != p.shape for a, p in zip(sd["params"], self.params)):
            raise ValueError(f"{self.mesh.describe()}: the heal state's parameters do not match this stage's")
        with torch.no_grad():
            for p, v in zip(self.params, sd["params"]):
                p.copy_(v)
        self.optimizer.load_state_dict(sd["optimizer"])
        self._sync.load_heal_state(sd["sync"])
        self.codec.load(sd.get("codec", {}), "a live peer's heal")

    def _synced_digest(self) -> str | dict:
        """A hash of what every replica holds alike after a commit: the parameters
        (allreduce mode) or DiLoCo's global copies; on a heterogeneous mesh one per sync
        segment this rank holds ({"seg<i>": hash}: what the segment's holders share)."""
        sync = self._sync
        if self.replica.segments:
            out = {}
            for j, s in enumerate(self.replica.managers.slots):
                out[f"seg{s.index}"] = _digest(sync.diloco[j].global_copies if sync.diloco
                                               else [p for _, p in sync.groups[j][1]])
            return out
        return _digest([g for d in sync.diloco for g in d.global_copies] if sync.diloco else self.params)

    # ------------------------------------------------------------------ the step protocol
    def resumed(self, step: int, with_state: bool) -> None:
        """A heterogeneous mesh: a replica that loaded the checkpoint's state starts torchft's
        commit count at 1, one of another split than the checkpoint's (it loaded nothing)
        at 0, so torchft heals it from one that did (it heals a replica whose count is not
        the quorum's highest). 1, not the step: live peers count commits since their start,
        and a restarted replica must never look ahead of them. (Replicas alike all load it.)"""
        if with_state and self.replica.segments:
            self.replica.count_steps_from(1)
        elif not with_state:
            self._must_heal_to = step

    def start(self, step: int) -> int | None:
        """The first quorum: a replica that joins late heals here."""
        return self._begin(step)

    def before_step(self, step: int, sync) -> int | None:
        if not self._quorum and self.replica.quorum_due(sync):
            return self._begin(step)
        return step

    def _begin(self, step: int) -> int | None:
        step = self.replica.begin(step)
        if step is None:  # stopped while waiting for a quorum
            return None
        if self._must_heal_to is not None and (step := self._heal_after_resume(step)) is None:
            return None
        self._quorum = True
        r = self.replica
        if r.healed_to is None and r.manager.current_step() == 0 and r.manager.num_participants() > 1:
            try:  # nobody has committed, so nobody heals: the members agree on the codec's bases here
                for slot in r.managers.slots:  # every DP group this rank is in (a segment's holders wait in it)
                    self.codec.agree(slot.group, r.leader)
            except CodecMismatch:
                raise  # this replica cannot train with the others (calibrated.py): it stops, saying why
            except Exception as e:  # a peer died in it: this step does not commit, the next quorum agrees again
                r.failed(e)
        return step

    def _heal_after_resume(self, step: int) -> int | None:
        """Resumed without this replica's state (another split than the checkpoint's): until
        a quorum heals it from a replica that loaded it, it runs no step and asks again
        (ElasticReplica.requorum), for --mesh.rejoin-timeout-s (the replicas of the
        checkpoint's split may start later); then RuntimeError. Every stage decides alike
        (the replica's own world)."""
        r, target = self.replica, self._must_heal_to
        m, t0, asked = r.cfg.mesh, time.monotonic(), 0
        while r.replica_max(r.healed_to is None or r.healed_to < target):
            if r.replica_max(time.monotonic() - t0 if self.mesh.stage == 0 else 0.0) > m.rejoin_timeout_s:
                raise RuntimeError(
                    f"{self.mesh.describe()}: resumed from a checkpoint whose rank state is of another split than "
                    f"this replica's, so it heals from a live replica that loaded it, and no quorum in "
                    f"{m.rejoin_timeout_s:g} s (--mesh.rejoin-timeout-s) had one at step {target}: start a replica "
                    "of the checkpoint's split with it")
            if asked < 2 or asked % 15 == 0:  # (one ask per --mesh.heartbeat-s: every 30 s at its default 2)
                print(f"[elastic] {self.mesh.describe()}: resumed without its state, it waits for a replica of the "
                      f"checkpoint's split ({r.manager.num_participants()} replica(s) in the quorum, none at step "
                      f"{target}; {time.monotonic() - t0:.0f} s so far); asking the lighthouse again",
                      file=sys.stderr, flush=True)
            asked += 1
            step = r.requorum(step)
            if step is None:
                return None
        self._must_heal_to = None
        return step

    def sync(self, fn, sync) -> None:
        """A failed collective (a peer died inside it) is reported to torchft and the sync
        state recovered, instead of ending the rank."""
        try:
            fn()
        except SyncError as e:
            self.replica.failed(e)
            sync.recover()
            self.committed = False  # (diloco: the steps until the next commit are recorded uncommitted)

    def commit_grads(self, sync) -> bool:
        self.committed = self.replica.commit()
        if not self.committed:  # a peer died inside this step: it runs again, without this update
            sync.recover()
        return self.committed

    def end_step(self, step: int, sync) -> bool:
        if sync.allreduce is None:  # diloco: a commit closes each quorum; a step without one keeps its outcome
            # (a replica whose quorum did not commit, e.g. one back from an outage whose first quorum
            # failed, is not in step with its peers until a quorum commits: its steps until then are
            # recorded uncommitted; so are a step whose sync failed, on this rank, and the steps after it:
            # a sibling stage whose part of the same sync went through holds another state until the
            # next quorum's commit, which the failure refuses, or a heal)
            self.committed = self.replica.commit() if self._quorum else self.committed
        self.replica.record(step, self.committed, self._quorum)
        self._quorum = False
        if sync.allreduce is not None and not self.committed:
            self.retried += 1  # the same step again, on the next quorum's replicas
            return False
        return True

    def settle(self, sync) -> None:
        if sync.diloco:  # every replica completes its syncs in flight, not just the one that saves
            self.sync(sync.finish, sync)

    def summary(self, steps_done: int) -> dict:
        return {"elastic": {**self.replica.stats, "retried_steps": self.retried, "replica": self.replica.replica_id,
                            "steps_done": steps_done}}

    def close(self) -> None:
        self.replica.close()


def _digest(tensors) -> str:
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
