"""Elastic replicas across hosts (issue 44), as docs/elastic.md tells a user to run them: the
lighthouse on host 0, one ``torchrun --nproc-per-node 2`` per replica on its own host (its own
working directory as its own disk, a 200 Mbit/s shaped link), ``--config run.yaml`` and the
run's secret file copied to every host, the default model and the default (pca) codec.

Checked against independent facts: the replicas' digests of the synced state (DiLoCo's global
copies, MESHKERN_ELASTIC_DIGESTS=1) agree at every committed step, a healed replica's
included; every replica's pca bases have one digest, also the one whose host fitted others.
Every wait is on an event (a record in a host's RUN_DIR/elastic/*.jsonl, a line in a log, a
process exit) with a generous bound. Skipped without root / network namespaces / tbf.
"""
from __future__ import annotations

import os
import re
import signal
import sys
import time

import pytest

pytest.importorskip("torchft", reason="torchft (pip install meshkern[elastic]) runs elastic replicas")

from orchestration.hosts import Hosts, available  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(available() is not None, reason=f"orchestration.hosts: {available()}")]

BUDGET_S = 900  # per wait: 2 loaded cores run these several times slower than idle
QUORUM_TIMEOUT_S = 12  # well above a step of this tiny model on a loaded box (below it quorums miss each other)
REJOIN_S = 240
LIGHTHOUSE_PORT = 29510
SECRET = "5e" * 32
ENV = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", "MESHKERN_ELASTIC_DIGESTS": "1",
       "PYTHONFAULTHANDLER": "1",
       "TRITON_INTERPRET": "1"}

RUN = ["--run.name", "eh", "--mesh.elastic", "--mesh.rows", "3", "--mesh.stages", "2", "--train.steps", "2000",
       "--train.batch-size", "4", "--train.microbatches", "2", "--data.max-sequences", "400", "--dp.sync-every", "4",
       "--checkpoint.every", "0", "--run.eval-sequences", "4", "--run.progress", "false",
       "--mesh.heartbeat-s", "1", "--mesh.quorum-timeout-s", str(QUORUM_TIMEOUT_S), "--mesh.timeout-s", "30",
       "--mesh.rejoin-timeout-s", str(REJOIN_S), "--run.bandwidth-bps", "200e6"]


def _setup(h: Hosts, hosts, argv=RUN) -> None:
    """run.yaml (of ``argv``) and the secret file on each host's disk, nothing else (the
    recipe's copies)."""
    from orchestration.config import parse_args, to_yaml

    cfg, _ = parse_args(argv)
    for i in hosts:
        with open(os.path.join(h.dirs[i], "run.yaml"), "w") as f:
            f.write(to_yaml(cfg))
        path = os.path.join(h.dirs[i], "run.secret")
        with open(path, "w") as f:
            f.write(SECRET + "\n")
        os.chmod(path, 0o600)


def _lighthouse(h: Hosts):
    p = h.popen(0, [sys.executable, "-m", "orchestration.elastic.lighthouse", "--bind", f"{{addr}}:{LIGHTHOUSE_PORT}",
                    "--min-replicas", "1", "--heartbeat-ms", "1000", "--join-timeout-ms", "2000"],
                env=ENV, log="lighthouse.log")
    p.wait_line(r"^LIGHTHOUSE http://", BUDGET_S)
    return p


def _replica(h: Hosts, i: int, replica: int, *extra: str):
    """The recipe's torchrun line on host ``i`` (master address: torchrun's default, loopback)."""
    argv = [sys.executable, "-m", "orchestration.torchrun", "--nproc-per-node", "2", "--master-port", "29600",
            "--max-restarts", "0", "-m", "orchestration.train", "--config", "run.yaml", "--anchor.secret-file",
            "run.secret", "--mesh.bind", "{addr}", "--mesh.join", f"http://{h.addr(0)}:{LIGHTHOUSE_PORT}",
            "--mesh.replica-id", str(replica), *extra]
    return h.popen(i, argv, env=ENV, log=f"replica{replica}.log")


def _records(h: Hosts) -> dict:
    """{(replica, stage): records} merged over every host's own run folder."""
    from orchestration.elastic.events import read_events

    out = {}
    for d in h.dirs:
        out.update(read_events(os.path.join(d, "runs", "eh")))
    return out


def _wait(pred, procs, what: str, budget: float = BUDGET_S):
    """``pred()``'s first true value; fails naming ``what`` if a process in ``procs`` ends first."""
    return Hosts.wait_until(pred, procs, what, budget)


def _committed(recs, replica, stage=0, **match):
    return [x for x in recs.get((replica, stage), []) if x["committed"] and all(x.get(k) == v for k, v in match.items())]


def _digests_agree(recs) -> int:
    """Every committed step's synced-state digest, per stage, is the same on every replica
    that ran it; returns the number of (stage, step) pairs seen on 2+ replicas."""
    by: dict = {}
    for (r, s), rs in recs.items():
        for rec in rs:
            if rec["committed"]:
                by.setdefault((s, rec["step"]), {}).setdefault(rec["digest"], []).append(r)
    bad = {k: v for k, v in by.items() if len(v) > 1}
    assert not bad, f"replicas disagree on the synced state at (stage, step): {bad}"
    return sum(1 for v in by.values() if sum(len(x) for x in v.values()) > 1)


def _skewed_bases(h: Hosts, i: int) -> None:
    """Host ``i``'s disk gets pca bases unlike the run's (as a host whose fit came out
    differently): its replica must take the run's at its first quorum."""
    import torch

    from orchestration.components import calibration
    from orchestration.config import parse_args
    from orchestration.launch.prepare import prepare

    cfg, _ = parse_args(RUN)
    plan = prepare(cfg, load_model=True)
    bases = calibration.bases_for_run(cfg, plan.model, plan.train_rows)
    for b in bases.values():
        b.mean.add_(torch.full_like(b.mean, 1e-3))
    calibration.save(bases, os.path.join(h.dirs[i], "runs", "eh"))


def test_replicas_on_hosts_survive_an_outage_and_a_new_disk_joins(tmp_path):
    """Two replicas on two hosts train together with the default codec (host 1's disk holds
    skewed pca bases: it takes the run's); host 1's link goes down for longer than the quorum
    timeout: hosts 0 and 2 train on, host 1 waits (saying so) and, when the link is back,
    rejoins and heals bit-exact; a third host with an empty disk (run.yaml and the secret
    alone) joins mid-run and heals over its shaped link."""
    with Hosts(3, "200mbit", root=str(tmp_path)) as h:
        _setup(h, (0, 1, 2))
        _skewed_bases(h, 1)
        lh = _lighthouse(h)
        r0, r1 = _replica(h, 0, 0), _replica(h, 1, 1)
        procs = [lh, r0, r1]
        # ---- together, with one set of pca bases
        both = _wait(lambda: [x for x in _committed(_records(h), 0) if x.get("participants") == 2 and x["step"] >= 4],
                     procs, "replicas 0 and 1 train together")
        # host 1's skewed bases meet host 0's: at a step-0 quorum the leader's win, and a
        # replica that started late takes its healer's (whichever replica came up first)
        _wait(lambda: any("took the run's pca bases from" in x for p in (r0, r1) for x in p.lines), procs,
              "one replica takes the other's pca bases")
        recs = _records(h)
        codecs = {x["codec"] for rs in recs.values() for x in rs if x["committed"]}
        assert len(codecs) == 1 and None not in codecs, codecs
        # ---- a host with an empty disk joins and heals over its link
        assert sorted(os.listdir(h.dirs[2])) == ["run.secret", "run.yaml"]
        r2 = _replica(h, 2, 2)
        procs.append(r2)
        joined = _wait(lambda: [x for x in _records(h).get((2, 0), []) if x.get("healed_to")], procs,
                       "host 2's replica heals")[0]
        _wait(lambda: [x for x in _committed(_records(h), 0) if x.get("participants") == 3 and x["step"] > joined["step"]],
              procs, "three replicas train together")

        r2.wait_line(r"healing from http://10\.213\.\d+\.2:\d+: [\d.]+ MB", 10)
        assert _digests_agree(_records(h)) >= 4  # host 2 healed bit-exact: its synced state is its peers'
        # ---- host 1's link goes down for longer than the quorum timeout
        at = _committed(_records(h), 0)[-1]["step"]
        t_down = time.time()
        h.link(1, False)
        alone = _wait(lambda: [x for x in _committed(_records(h), 0) if x.get("participants") == 2
                               and x["quorum_wall"] > t_down], procs, "replicas 0 and 2 train on without host 1")
        dropped_s = alone[0]["quorum_wall"] - t_down
        print(f"\nFIGURES link down -> quorum without it {dropped_s:.2f} s; new-disk heal {joined['heal_s']:.2f} s, "
              f"{joined['heal_bytes'] / 1e6:.1f} MB (stage 0)")

        def waited_long():  # host 1 said twice what it waits for, the second time past a quorum timeout
            lines = [m for m in (re.search(r"no quorum at step \d+ .*for up to (\d+) s more", x) for x in r1.lines) if m]
            return len(lines) >= 2 and REJOIN_S - int(lines[-1].group(1)) > QUORUM_TIMEOUT_S

        _wait(waited_long, procs, "host 1's replica waits for the lighthouse")
        assert "--mesh.rejoin-timeout-s" in r1.tail(60)
        t_up = time.time()
        h.link(1, True)
        assert t_up - t_down > QUORUM_TIMEOUT_S
        # ---- it comes back: heals from replica 0, then trains with it again
        healed = _wait(lambda: [x for x in _records(h).get((1, 0), []) if x.get("healed_to") and x["wall"] > t_up],
                       procs, "host 1's replica rejoins and heals", budget=6 * QUORUM_TIMEOUT_S + 120)
        back = healed[0]
        _wait(lambda: [x for x in _committed(_records(h), 1) if x.get("participants") == 3 and x["step"] > back["step"] + 2],
              procs, "the three train together again")
        r1.wait_line(r"back in a quorum after", 10)
        for i in range(3):
            assert h.stop_training(i)  # each replica stops cleanly at its next step boundary
        codes = [p.wait(BUDGET_S) for p in (r0, r1, r2)]
        lh.signal(signal.SIGTERM)
        assert codes == [0, 0, 0], "\n".join(p.tail(30) for p in (r0, r1, r2))
        recs = _records(h)
        assert _digests_agree(recs) >= 10
        codecs = {x["codec"] for rs in recs.values() for x in rs if x["committed"]}
        assert len(codecs) == 1, codecs
        for r in (1, 2):  # the healed replicas hold the survivors' synced state at the very next commit
            after = [x for x in recs[(r, 0)] if x["step"] > (back if r == 1 else joined)["step"] and x["committed"]]
            assert after, r
        # while host 1 was cut off, replicas 0 and 2 committed without it
        alone_steps = [x for x in _committed(recs, 0) if x.get("participants") == 2 and t_down < x["quorum_wall"] < t_up]
        assert alone_steps and alone_steps[-1]["step"] > at
        print(f"\nFIGURES link down -> quorum without it {dropped_s:.2f} s; rejoin heal {back['heal_s']:.2f} s, "
              f"{back['heal_bytes'] / 1e6:.1f} MB (stage 0); new disk heal {joined['heal_s']:.2f} s, "
              f"{joined['heal_bytes'] / 1e6:.1f} MB (stage 0); outage {t_up - t_down:.1f} s")


def test_loopback_advertise_address_is_refused_at_start(tmp_path):
    """--mesh.bind 127.0.0.1 with a lighthouse on another host: an error at start that names
    the flag, not a quorum that times out every step."""
    with Hosts(2, "200mbit", root=str(tmp_path)) as h:
        _setup(h, (1,))
        p = h.popen(1, [sys.executable, "-m", "orchestration.torchrun", "--nproc-per-node", "2", "--max-restarts", "0",
                        "-m", "orchestration.train", "--config", "run.yaml", "--anchor.secret-file", "run.secret",
                        "--mesh.bind", "127.0.0.1", "--mesh.join", f"http://{h.addr(0)}:{LIGHTHOUSE_PORT}",
                        "--mesh.replica-id", "1"], env=ENV, log="loopback.log")
        assert p.wait(BUDGET_S) != 0
        out = "".join(p.lines)
        assert "--mesh.bind 127.0.0.1 is loopback but the lighthouse" in out and "set --mesh.bind" in out, out[-2000:]
        # an address of another host: refused where the replica runs, naming the flag
        q = h.popen(1, [sys.executable, "-m", "orchestration.torchrun", "--nproc-per-node", "2", "--max-restarts", "0",
                        "-m", "orchestration.train", "--config", "run.yaml", "--anchor.secret-file", "run.secret",
                        "--mesh.bind", h.addr(0), "--mesh.join", f"http://{h.addr(0)}:{LIGHTHOUSE_PORT}",
                        "--mesh.replica-id", "1"], env=ENV, log="other.log")
        assert q.wait(BUDGET_S) != 0
        assert f"--mesh.bind {h.addr(0)} is not an address of this host" in "".join(q.lines), q.tail(40)


ANCHOR_STORE_PORT = 29511
ANCHOR_RUN = ["--preset", "m95-ap", "--boundary.codec", "pca", "--anchor.snapshot-every", "2",
              "--anchor.store", f"{{addr0}}:{ANCHOR_STORE_PORT}"]


def test_elastic_replicas_on_hosts_with_the_anchor_row_on_its_own_host(tmp_path):
    """The recipe of docs/deploy.md section 4 with elastic replicas: the lighthouse on host 0
    also hosts the anchor store (--anchor-store), a replica on each of hosts 0 and 1 and the
    anchor row (a torchrun of its 2 stages, --anchor.join) on host 2, all given
    --anchor.store <host 0>:PORT. Both replicas apply the anchor's updates and stop cleanly.
    (An anchor row killed and started again: tests/test_elastic_anchor.py for elastic
    replicas, tests/test_hosts_anchor.py across hosts.)"""
    with Hosts(3, "200mbit", root=str(tmp_path)) as h:
        _setup(h, (0, 1, 2), RUN + [a.replace("{addr0}", h.addr(0)) for a in ANCHOR_RUN])
        lh = h.popen(0, [sys.executable, "-m", "orchestration.elastic.lighthouse", "--bind",
                         f"{{addr}}:{LIGHTHOUSE_PORT}", "--anchor-store", str(ANCHOR_STORE_PORT), "--min-replicas",
                         "1", "--heartbeat-ms", "1000", "--join-timeout-ms", "2000"], env=ENV, log="lighthouse.log")
        lh.wait_line(rf"^ANCHOR_STORE {re.escape(h.addr(0))}:{ANCHOR_STORE_PORT}$", BUDGET_S)
        r0, r1 = _replica(h, 0, 0), _replica(h, 1, 1)
        join = ["-m", "orchestration.train", "--config", "run.yaml", "--anchor.secret-file", "run.secret",
                "--anchor.join"]

        def anchor_row(port: int):  # what a user runs on host 2: one process per stage, its own rendezvous
            return h.popen(2, h.torchrun(2, join, port=port, nproc=2, nnodes=1, node_rank=0, master="127.0.0.1"),
                           env=ENV, log=f"anchor{port}.log")

        anchor_row(29541)
        procs = [lh, r0, r1]

        def applied(gen: int, more_than: dict) -> bool:
            recs = _records(h)
            last = {r: (recs.get((r, 0)) or [{}])[-1] for r in (0, 1)}
            return all(last[r].get("anchor_generation") == gen and last[r].get("anchor_applied", 0) > more_than[r]
                       for r in (0, 1))

        _wait(lambda: applied(1, {0: 1, 1: 1}), procs, "both replicas apply the anchor's updates")
        recs = _records(h)
        assert all(x["incarnation"] == 0 for r in (0, 1) for x in recs[(r, 0)])  # no replica stopped
        for i in (0, 1):
            assert h.stop_training(i)
        codes = [p.wait(BUDGET_S) for p in (r0, r1)]
        lh.signal(signal.SIGTERM)
        assert codes == [0, 0], "\n".join(p.tail(30) for p in (r0, r1))
        assert _digests_agree(_records(h)) >= 2
