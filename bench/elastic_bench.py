"""Elastic replicas under a kill: what an outage costs (docs/elastic.md's figures).

    python -m bench.elastic_bench --out runs/elastic-bench/default            # default model, 3x2
    python -m bench.elastic_bench --out runs/elastic-bench/smollm2 --rows 2 --stages 2 \\
        --steps 30 --kill-step 10 -- --model.path smollm2-135m --data.max-sequences 2000

Runs the same elastic run twice through ``python -m orchestration.train``: uninterrupted,
then with one replica's stage-0 process SIGKILLed (from here, the moment its event record
shows ``--kill-step``) and restarted by the launcher. From the replicas' event records
(RUN_DIR/elastic/*.jsonl) it prints:

- kill -> next quorum without it: from the SIGKILL to the survivors' first quorum that
  lacks the replica (what the lighthouse's heartbeat timeout and join timeout cost);
- kill -> healed: from the SIGKILL to the end of the restarted replica's first quorum, the
  one that healed it (process start, stage build, quorum, transfer), and the heal itself
  (seconds, bytes over all stages);
- steps/s of a survivor before the kill, from the kill to the heal, and after the heal;
- held-out loss of both runs (the cost of the replica's missing batches).

The figure that limits recovery is printed last: on one machine, the restart's process
start and model build, not torchft's quorum (compare torchft's own ~1 s at a 1 s heartbeat).
Every rank is pinned to one thread (the launcher's --mesh.threads-per-rank 1).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

from orchestration.elastic.events import read_events


def held_out(log: str) -> float | None:
    for line in log.splitlines():
        if line.startswith("held-out loss base -> final"):
            return float(line.split("->")[-1])
    return None


def run(args, name: str, kill: bool, restarts: int = 2) -> dict:
    run_dir = os.path.join(args.out, name)
    cmd = [sys.executable, "-m", "orchestration.train", "--mesh.elastic", "--mesh.rows", str(args.rows),
           "--mesh.stages", str(args.stages), "--train.steps", str(args.steps), "--mesh.heartbeat-s",
           str(args.heartbeat_s), "--run.out-dir", args.out, "--run.name", name, "--run.progress", "false",
           "--checkpoint.every", "0", "--mesh.replica-restarts", str(restarts), *args.extra]
    log_path = os.path.join(args.out, name + ".log")
    t0 = time.time()
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    killed_at, victim = None, args.rows - 1
    try:
        while p.poll() is None:
            if kill and killed_at is None:
                recs = read_events(run_dir).get((victim, 0), [])
                if recs and recs[-1]["step"] >= args.kill_step:
                    killed_at = time.time()
                    os.kill(recs[-1]["pid"], signal.SIGKILL)
                    print(f"[{name}] SIGKILL replica {victim} stage 0 after its step {recs[-1]['step']}", flush=True)
            time.sleep(0.05)
    finally:
        if p.poll() is None:
            p.kill()
    out = {"name": name, "rc": p.returncode, "wall_s": time.time() - t0, "held_out": held_out(open(log_path).read()),
           "killed_at": killed_at}
    if not kill:
        return out
    recs = read_events(run_dir)
    surv = [r for r in recs[(0, 0)]]
    # a record is written when its step ends; its quorum ended at quorum_wall, before the step ran
    before_n = max(x["participants"] for x in surv if x.get("quorum") and x["quorum_wall"] < killed_at)
    drop = next((x for x in surv if x.get("quorum") and x["quorum_wall"] > killed_at and x["participants"] < before_n),
                None)
    healed = [x for x in recs[(victim, 0)] if x.get("healed_to") is not None and x["quorum_wall"] > killed_at]
    heal_all = [x for s in range(args.stages) for x in recs.get((victim, s), [])
                if x.get("healed_to") is not None and x["quorum_wall"] > killed_at]
    heal_wall = healed[0]["quorum_wall"] if healed else None

    def rate(lo, hi):
        xs = [x for x in surv if lo <= x["wall"] < hi]
        return (len(xs) - 1) / (xs[-1]["wall"] - xs[0]["wall"]) if len(xs) > 1 else None

    out.update(
        kill_to_quorum_without_s=drop["quorum_wall"] - killed_at if drop else None,
        quorum_s_at_drop=drop.get("quorum_s") if drop else None,
        kill_to_heal_s=heal_wall - killed_at if heal_wall else None,
        heal_s=healed[0]["heal_s"] if healed else None,
        heal_bytes=sum(x["heal_bytes"] for x in heal_all),
        steps_per_s_before=rate(0, killed_at), steps_per_s_outage=rate(killed_at, heal_wall or 1e18),
        steps_per_s_after=rate(heal_wall, 1e18) if heal_wall else None,
        summary=json.load(open(os.path.join(run_dir, "elastic", "summary.json"))))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for the two runs and result.json")
    ap.add_argument("--rows", type=int, default=3)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kill-step", type=int, default=12, help="SIGKILL once the victim recorded this step")
    ap.add_argument("--heartbeat-s", type=float, default=1.0)
    ap.add_argument("extra", nargs="*", help="more flags for orchestration.train (after --)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    plain = run(args, "plain", kill=False)
    killed = run(args, "killed", kill=True)
    # without a restart the survivors' quorum must drop the replica: the lighthouse's part alone
    dropped = run(args, "dropped", kill=True, restarts=0)
    res = {"plain": plain, "killed": killed, "dropped": dropped, "args": vars(args)}
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump(res, f, indent=1)
    k = killed

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    print(f"mesh {args.rows}x{args.stages}, heartbeat {args.heartbeat_s:g} s, {args.steps} steps, "
          f"replica {args.rows - 1} killed after step {args.kill_step}")
    d = dropped
    print(f"kill -> quorum without it   {fmt(d['kill_to_quorum_without_s'], '.2f')} s without a restart "
          f"({fmt(k['kill_to_quorum_without_s'], '.2f')} s with one: '-' = it was back before the quorum dropped it)")
    print(f"kill -> healed              {fmt(k['kill_to_heal_s'], '.2f')} s (heal {fmt(k['heal_s'], '.3f')} s, "
          f"{k['heal_bytes'] / 1e6:.1f} MB over {args.stages} stages)")
    print(f"survivor steps/s            before {fmt(k['steps_per_s_before'], '.3f')}, outage "
          f"{fmt(k['steps_per_s_outage'], '.3f')}, after {fmt(k['steps_per_s_after'], '.3f')}")
    print(f"survivor steps/s, no restart before {fmt(d['steps_per_s_before'], '.3f')}, after the kill "
          f"{fmt(d['steps_per_s_outage'], '.3f')}")
    print(f"held-out loss               uninterrupted {fmt(plain['held_out'], '.4f')}, killed + healed "
          f"{fmt(k['held_out'], '.4f')}, killed for good {fmt(d['held_out'], '.4f')}")
    print(f"limit: the restart (process start + model build + quorum) is {fmt(k['kill_to_heal_s'], '.1f')} s of the "
          f"outage; the lighthouse drops a dead replica in {fmt(d['kill_to_quorum_without_s'], '.2f')} s")
    return 0 if plain["rc"] == 0 and k["rc"] == 0 and d["rc"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
