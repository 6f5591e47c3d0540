"""The divergence guard: which steps are bad, and when a run has diverged."""
from __future__ import annotations

import math
import statistics
from collections import deque

DIVERGED = 3  # exit code of a run stopped by the divergence guard (DivergenceError)


class DivergenceError(RuntimeError):
    """The run diverged: ``--train.max-bad-steps`` consecutive bad steps (DivergenceGuard)."""


class DivergenceGuard:
    """Decides, from the step records (identical on every fast rank: they are all-reduced),
    whether a step is bad and whether the run has diverged.

    A step is bad when its loss is non-finite, when any replica skipped its update (a
    non-finite gradient: the record's cumulative ``skipped_steps`` grew), when its gradient
    norm (the mean over replicas) is exactly zero, or when its loss
    exceeds ``spike_factor`` times the median loss of the last ``WINDOW`` good steps (0:
    no spike rule). ``max_bad`` consecutive bad steps trip it (0: never). Bad steps never
    enter the median. Saved in every rank's checkpoint (part "guard"), with the trainer's
    count of skipped updates, so a resumed run judges steps exactly as an uninterrupted one.
    """

    WINDOW = 50

    def __init__(self, max_bad: int, spike_factor: float):
        self.max_bad, self.spike_factor = max_bad, spike_factor
        self.skipped = 0  # this rank's replica-steps whose update was skipped (non-finite gradient)
        self.good: deque = deque(maxlen=self.WINDOW)
        self.streak = 0
        self.first_bad = 0  # record step (1-based) of the streak's first bad step
        self.bad_total = 0
        self.skipped_seen = 0
        self.reason = ""

    def observe(self, rec: dict) -> str:
        """Judges one step record; returns why it is bad ("" if good)."""
        loss, skipped = rec["loss"], int(rec["skipped_steps"])
        new_skips, self.skipped_seen = skipped - self.skipped_seen, skipped
        reason = ""
        if not math.isfinite(loss):
            reason = f"non-finite loss {loss}"
        elif new_skips > 0:
            reason = f"non-finite gradient in {new_skips} replica(s), update skipped"
        elif rec.get("grad_norm") == 0.0:
            # A finite loss whose gradient is exactly zero in every replica: the model no
            # longer learns. Seen after a blow-up (--train.lr 1e3): the hidden state's square
            # overflows in RMSNorm, the norm outputs zeros, the logits are uniform (loss
            # ln(vocab), below the spike bound) and every gradient is 0.
            reason = "zero gradient norm with a finite loss (saturated activations: nothing learns)"
        elif self.spike_factor and self.good:
            med = statistics.median(self.good)
            if loss > self.spike_factor * med:
                reason = f"loss {loss:.4g} above {self.spike_factor:g} x the running median {med:.4g}"
        if reason:
            self.streak += 1
            self.bad_total += 1
            if self.streak == 1:
                self.first_bad = int(rec["step"])
            self.reason = reason
        else:
            self.streak = 0
            self.good.append(float(loss))
        return reason

    @property
    def tripped(self) -> bool:
        return self.max_bad > 0 and self.streak >= self.max_bad

    def state_dict(self) -> dict:
        return {"good": list(self.good), "streak": self.streak, "first_bad": self.first_bad,
                "bad_total": self.bad_total, "skipped_seen": self.skipped_seen,
                "skipped": self.skipped}

    def load_state_dict(self, sd: dict) -> None:
        self.good = deque((float(x) for x in sd["good"]), maxlen=self.WINDOW)
        self.streak, self.first_bad = int(sd["streak"]), int(sd["first_bad"])
        self.bad_total, self.skipped_seen = int(sd["bad_total"]), int(sd["skipped_seen"])
        self.skipped = int(sd["skipped"])


def divergence_report(guard: DivergenceGuard, cfg, plan, rank: int, step: int) -> str:
    """The DivergenceError message of a tripped guard at ``step``; rank 0 points ``latest``
    at the newest checkpoint that predates the bad stretch (weights after step
    first_bad - 2 produced the loss of step first_bad - 1, the last good one)."""
    from orchestration.components import checkpoint as ckpt

    g = guard
    good = ckpt.newest_valid(plan.ckpt_dir, max_step=g.first_bad - 2) if rank == 0 else None
    if good and rank == 0:
        ckpt.set_latest(plan.ckpt_dir, good)
    where = (f"the last good checkpoint is {good} (now `latest`)" if good else
             "no checkpoint predates the bad stretch")
    return (f"DivergenceError: the run diverged: {g.streak} consecutive bad steps "
            f"({g.first_bad}..{step + 1}, --train.max-bad-steps {cfg.train.max_bad_steps}); last: {g.reason}; "
            f"{g.skipped_seen} replica-steps skipped in all; nothing saved since step {g.first_bad}; {where}. "
            f"Lower --train.lr (now {cfg.train.lr:g}) or raise --train.clip-grad-norm / --train.warmup-steps")
