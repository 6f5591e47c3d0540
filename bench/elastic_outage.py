"""What an outage costs an elastic run across hosts: the same run (same seed, same steps)
with and without one replica's link down for a while, held-out loss and wall time.

    python -m bench.elastic_outage                     # root: orchestration.hosts
    python -m bench.elastic_outage --steps 200 --outage-s 60 --rate 200mbit
    python -m bench.elastic_outage --join-only --steps 6 -- --model.path smollm2-135m   # a heal's cost

Two hosts (network namespaces, tbf-shaped links, each its own disk), the recipe of
docs/elastic.md: the lighthouse on host 0, one ``torchrun --nproc-per-node 2`` per replica
with ``--mesh.join`` and ``--mesh.bind`` its host's address, the default model and codec,
Streaming DiLoCo. In the outage run host 1's link goes down once replica 0 has committed
a quarter of the steps, for ``--outage-s`` (it must exceed ``--quorum-timeout-s`` to be an
outage torchft notices), then comes back; replica 1 waits, rejoins and heals (the run must
be long enough for replica 0 to be still training then: it trains alone meanwhile). The
held-out loss is the one the run's summary prints (the leader's final weights).

``--join-only``: no outage and no baseline; replica 1 starts once replica 0 has committed 2
steps and heals over the shaped link (what a host that comes up late, or with an empty
disk, pays): the heal's bytes and seconds. Flags after ``--`` go to every replica (the
model, for one).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time

LIGHTHOUSE_PORT = 29510
SECRET = "be" * 32  # a throwaway secret for this bench's runs only


def _flags(a) -> list[str]:
    return ["--run.name", "eo", "--mesh.elastic", "--mesh.rows", "2", "--mesh.stages", "2",
            "--train.steps", str(a.steps), "--train.batch-size", "4", "--train.microbatches", "2",
            "--dp.sync-every", "4", "--checkpoint.every", "0", "--run.eval-sequences", str(a.eval_sequences),
            "--run.progress", "false", "--mesh.heartbeat-s", "1", "--mesh.quorum-timeout-s", str(a.quorum_timeout_s),
            "--mesh.timeout-s", "30", "--mesh.rejoin-timeout-s", str(10 * a.outage_s + 300),
            "--run.bandwidth-bps", str(a.rate_bps), "--train.seed", str(a.seed), *a.extra]


def _committed(run_dir: str, replica: int) -> int:
    from orchestration.elastic.events import read_events

    recs = read_events(run_dir).get((replica, 0), [])
    return max((r["step"] for r in recs if r["committed"]), default=0)


def run(a, outage: bool) -> dict:
    from orchestration.config import parse_args, to_yaml
    from orchestration.hosts import Hosts

    cfg, _ = parse_args(_flags(a))
    env = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}
    root = tempfile.mkdtemp(prefix="elastic_outage-", dir=a.work or None)
    with Hosts(2, a.rate, root=root, echo=a.verbose) as h:
        for d in h.dirs:
            with open(os.path.join(d, "run.yaml"), "w") as f:
                f.write(to_yaml(cfg))
            with open(os.path.join(d, "run.secret"), "w") as f:
                f.write(SECRET + "\n")
            os.chmod(os.path.join(d, "run.secret"), 0o600)
        lh = h.popen(0, [sys.executable, "-m", "orchestration.elastic.lighthouse", "--bind",
                         f"{{addr}}:{LIGHTHOUSE_PORT}", "--min-replicas", "1", "--heartbeat-ms", "1000",
                         "--join-timeout-ms", "2000"], env=env, log="lighthouse.log")
        lh.wait_line(r"^LIGHTHOUSE http://", 300)
        t0 = time.monotonic()

        def replica(i: int):
            return h.popen(i, [sys.executable, "-m", "orchestration.torchrun", "--nproc-per-node", "2", "--master-port",
                               "29600", "--max-restarts", "0", "-m", "orchestration.train", "--config", "run.yaml",
                               "--anchor.secret-file", "run.secret", "--mesh.bind", "{addr}", "--mesh.join",
                               f"http://{h.addr(0)}:{LIGHTHOUSE_PORT}", "--mesh.replica-id", str(i)],
                           env=env, log=f"replica{i}.log")

        run0 = os.path.join(h.dirs[0], "runs", "eo")
        if a.join_only:  # replica 1 comes up once replica 0 trains: it heals from it
            reps = [replica(0)]
            h.wait_until(lambda: _committed(run0, 0) >= 2, reps, "replica 0 trains before the join", a.timeout)
            reps.append(replica(1))
        else:
            reps = [replica(0), replica(1)]
        down_s = None
        if outage:
            h.wait_until(lambda: _committed(run0, 0) >= a.steps // 4, reps, "a quarter of the steps", a.timeout)
            t_down = time.monotonic()
            h.link(1, False)
            time.sleep(a.outage_s)  # the outage's length is what this bench sets
            h.link(1, True)
            down_s = time.monotonic() - t_down
        codes = h.wait_all(reps, a.timeout)
        wall = time.monotonic() - t0
        lh.signal()
        if codes != [0, 0]:
            raise RuntimeError(f"exit codes {codes}:\n" + "\n".join(p.tail(40) for p in reps))
        m = re.search(r"held-out loss base -> final\s+([0-9.]+) -> ([0-9.]+)", "".join(reps[0].lines))
        held = float(m.group(2)) if m else None
        from orchestration.elastic.events import read_events

        recs = {}
        for d in h.dirs:
            recs.update(read_events(os.path.join(d, "runs", "eo")))
        heals = [r for r in recs.get((1, 0), []) if r.get("healed_to")]
        return {"outage": outage, "down_s": down_s, "wall_s": wall, "held_out": held,
                "replica1_committed": sum(1 for r in recs.get((1, 0), []) if r["committed"]),
                "replica0_alone_steps": sum(1 for r in recs.get((0, 0), []) if r["committed"]
                                            and r.get("participants") == 1),
                "heal_bytes_stage0": sum(r["heal_bytes"] for r in heals), "heal_s_stage0": sum(r["heal_s"] for r in heals)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=400, help="training steps of each run")
    ap.add_argument("--outage-s", type=float, default=45.0, help="how long host 1's link is down")
    ap.add_argument("--quorum-timeout-s", type=float, default=20.0, help="--mesh.quorum-timeout-s of the runs")
    ap.add_argument("--rate", default="200mbit", help="every access link's rate, as tc writes it")
    ap.add_argument("--seed", type=int, default=0, help="--train.seed of both runs")
    ap.add_argument("--eval-sequences", type=int, default=32, help="held-out sequences of the final evaluation")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds a run may take")
    ap.add_argument("--work", default="", help="where the hosts' directories go (default: the temp dir)")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    ap.add_argument("--verbose", action="store_true", help="echo the hosts' output")
    ap.add_argument("--join-only", action="store_true", help="replica 1 joins late and heals; no outage, no baseline")
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    a = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    a.extra = extra
    from orchestration.hosts import available, rate_bps

    why = available()
    if why is not None:
        print(f"bench.elastic_outage: the multi-host harness cannot run here: {why}", file=sys.stderr)
        return 2
    if a.outage_s <= a.quorum_timeout_s:
        ap.error(f"--outage-s {a.outage_s:g} must exceed --quorum-timeout-s {a.quorum_timeout_s:g}")
    a.rate_bps = rate_bps(a.rate)
    rows = [run(a, outage=False)] if a.join_only else [run(a, outage=False), run(a, outage=True)]
    print(f"{a.steps} steps, seed {a.seed}, 2 replicas x 2 stages on 2 hosts at {a.rate}, DiLoCo every 4 steps")
    print("| run | link down s | wall s | held-out loss | replica 1 committed | replica 0 alone | heal (stage 0) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {'outage' if r['outage'] else 'no outage'} | {r['down_s'] or 0:.0f} | {r['wall_s']:.0f} | "
              f"{r['held_out']} | {r['replica1_committed']} | {r['replica0_alone_steps']} | "
              f"{r['heal_bytes_stage0'] / 1e6:.1f} MB, {r['heal_s_stage0']:.1f} s |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
