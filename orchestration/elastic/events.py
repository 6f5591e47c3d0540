"""An elastic run's records on disk (RUN_DIR/elastic/): each replica stage's event lines
(written by orchestration.elastic.replica), the launch markers its replicas wait on before
the first quorum, and the run summary read back from the event lines."""
from __future__ import annotations

import json
import os


def events_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "elastic")


def announce_up(run_dir: str, replica: int, lighthouse: str) -> None:
    """This replica's manager is up (heartbeating): a marker for ``wait_for_launch``."""
    path = os.path.join(events_dir(run_dir), f"up-replica{replica}")
    with open(path + ".part", "w") as f:
        f.write(lighthouse)
    os.replace(path + ".part", path)


def wait_for_launch(run_dir: str, replicas: tuple, lighthouse: str, timeout_s: float) -> None:
    """Waits until every replica of the launch announced itself to this lighthouse (or
    ``timeout_s``): the lighthouse forms a first quorum from the replicas it has heard of,
    so without this the ones whose processes started first would train alone for a step or
    two and the rest would heal into the run."""
    import time

    deadline = time.monotonic() + timeout_s
    for r in replicas:
        path = os.path.join(events_dir(run_dir), f"up-replica{r}")
        while time.monotonic() < deadline:
            try:
                with open(path) as f:
                    if f.read() == lighthouse:
                        break
            except OSError:
                pass
            time.sleep(0.05)


def read_events(run_dir: str) -> dict[tuple[int, int], list[dict]]:
    """The event records of an elastic run, {(replica, stage): records in file order}
    (RUN_DIR/elastic/replica{R}_stage{S}.jsonl; a line torn by a kill is left out)."""
    out: dict[tuple[int, int], list[dict]] = {}
    d = events_dir(run_dir)
    for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        if not (name.startswith("replica") and name.endswith(".jsonl") and "_stage" in name):
            continue
        r, s = name[len("replica"):-len(".jsonl")].split("_stage")
        recs = []
        with open(os.path.join(d, name)) as f:
            for line in f:
                try:
                    recs.append(json.loads(line))
                except ValueError:
                    pass
        out[(int(r), int(s))] = recs
    return out


def summarize_events(run_dir: str, restarts: list[int] | None = None) -> dict:
    """The elastic part of the run summary, from the replicas' event files: replicas per
    step, drops (a quorum smaller than the one before), heals (count, bytes, seconds)."""
    recs = [r for rs in read_events(run_dir).values() for r in rs]
    quorums = sorted((r for r in recs if r.get("quorum")), key=lambda r: r["wall"])
    per_step: dict[int, int] = {}
    for r in quorums:
        per_step[r["step"]] = max(per_step.get(r["step"], 0), r["participants"])
    drops, prev = 0, None
    for step in sorted(per_step):
        if prev is not None and per_step[step] < prev:
            drops += 1
        prev = per_step[step]
    healed = [r for r in quorums if r.get("healed_to") is not None]
    first = [r for r in healed if r.get("stage", 0) == 0]  # one record per heal; stages heal at once
    out = {"replicas_per_step": per_step, "min_replicas_seen": min(per_step.values(), default=0),
           "max_replicas_seen": max(per_step.values(), default=0), "drops": drops, "heals": len(first),
           "heal_bytes": sum(r["heal_bytes"] for r in healed), "heal_s": sum(r["heal_s"] for r in first),
           "failed_commits": sum(1 for r in recs if not r.get("committed", True) and r.get("stage", 0) == 0),
           "restarts": list(restarts or [])}
    return out


def summary_line(s: dict) -> str:
    heal = (f"{s['heals']} heal(s) ({s['heal_bytes'] / 1e6:.2f} MB, {s['heal_s']:.2f} s)" if s["heals"] else "no heals")
    return (f"elastic: {s['min_replicas_seen']}-{s['max_replicas_seen']} replicas per step, {s['drops']} drop(s), "
            f"{heal}, {len(s['restarts'])} restart(s), {s['failed_commits']} uncommitted step(s)")
