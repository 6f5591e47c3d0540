"""Pipeline schedules: the order in which each stage runs its forwards and backwards.

``make_schedule(kind, num_stages, num_microbatches) -> list[list[Action]]``: one list
per stage, in execution order. The runtime executes exactly these lists and the link
model (orchestration/distributed/linkmodel.py) replays the same lists, so the modeled timeline is
the executed one.

Dependencies (what ``check_schedule`` verifies by simulation):
    F(s, m) needs F(s-1, m)'s output (s > 0);
    B(s, m) needs F(s, m) on the same stage and B(s+1, m)'s gradient (s < S-1).

Kinds:
    "gpipe": every stage runs F0..F(M-1), then B0..B(M-1). Peak activation memory is
             M micro-batches on every stage.
    "1f1b":  stage s runs min(S-1-s, M) warm-up forwards, then alternates one forward,
             one backward, then drains the remaining backwards. At most S - s
             micro-batches are in flight (forwarded, not yet backwarded) on stage s:
             same bubble as GPipe, activation memory bounded by the depth instead of M.
"""
from __future__ import annotations

from dataclasses import dataclass

KINDS = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Action:
    """One unit of stage work: kind "F" (forward) or "B" (backward) of micro-batch ``microbatch``."""

    kind: str
    microbatch: int

    def __post_init__(self):
        if self.kind not in ("F", "B"):
            raise ValueError(f"Action kind must be 'F' or 'B', got {self.kind!r}")
        if self.microbatch < 0:
            raise ValueError(f"microbatch must be >= 0, got {self.microbatch}")

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}"


def make_schedule(kind: str, num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """Per-stage ordered actions for ``kind`` ("gpipe" or "1f1b"); ValueError on bad input."""
    if kind not in KINDS:
        raise ValueError(f"unknown pipeline schedule {kind!r}; choose one of {', '.join(KINDS)}")
    for name, v in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    S, M = num_stages, num_microbatches
    out = []
    for s in range(S):
        if kind == "gpipe":
            acts = [Action("F", m) for m in range(M)] + [Action("B", m) for m in range(M)]
        else:
            warm = min(S - 1 - s, M)
            acts = [Action("F", m) for m in range(warm)]
            nf, nb = warm, 0
            while nf < M:  # steady state: one forward, one backward
                acts += [Action("F", nf), Action("B", nb)]
                nf, nb = nf + 1, nb + 1
            acts += [Action("B", m) for m in range(nb, M)]
        out.append(acts)
    return out


def check_schedule(schedule: list[list[Action]]) -> list[tuple[int, Action]]:
    """Validate ``schedule`` and return one global order in which it can run.

    Each stage runs its list in order; an action runs once its dependencies (module doc)
    are done. Raises ValueError if a stage's list is not exactly one F and one B per
    micro-batch, or if the stages deadlock (no stage can make progress).
    """
    S = len(schedule)
    if S == 0:
        raise ValueError("empty schedule")
    M = sum(a.kind == "F" for a in schedule[0])
    for s, acts in enumerate(schedule):
        want = sorted([("B", m) for m in range(M)] + [("F", m) for m in range(M)])
        if sorted((a.kind, a.microbatch) for a in acts) != want:
            raise ValueError(f"stage {s} must run F and B of each micro-batch 0..{M - 1} exactly once")
    done, pos, order = set(), [0] * S, []
    while len(order) < 2 * M * S:
        progressed = False
        for s in range(S):
            if pos[s] == len(schedule[s]):
                continue
            a = schedule[s][pos[s]]
            if a.kind == "F":
                ready = s == 0 or ("F", s - 1, a.microbatch) in done
            else:
                ready = ("F", s, a.microbatch) in done and (s == S - 1 or ("B", s + 1, a.microbatch) in done)
            if ready:
                done.add((a.kind, s, a.microbatch))
                order.append((s, a))
                pos[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: schedule[s][pos[s]] for s in range(S) if pos[s] < len(schedule[s])}
            raise ValueError(f"schedule deadlocks: stages wait on {stuck}")
    return order


def max_in_flight(actions: list[Action]) -> int:
    """Most micro-batches forwarded but not yet backwarded at any point of one stage's list."""
    live = peak = 0
    for a in actions:
        live += 1 if a.kind == "F" else -1
        peak = max(peak, live)
    return peak
