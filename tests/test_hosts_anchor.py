"""Across hosts (issue 40): the anchor row on a host of its own, killed and rejoined.
The fast circuit is a 1x2 torchrun over hosts 0 and 1 (--anchor.enabled, spectral
optimizer); the anchor row is a torchrun of its 2 stages on host 2 (its own local
rendezvous, ``--anchor.join --anchor.store <host 0>:<port>``), every process given the
run's secret in MESHKERN_ANCHOR_SECRET (under torchrun no process creates it). Host 2
dies (every process in its namespace killed); the fast circuit says it lost the anchor
and trains on; the same command on host 2 starts generation 2, which joins, and the fast
circuit applies its updates. While generation 1 runs, no process of the run listens
beyond its host's address or loopback, torchrun's store included (orchestration.torchrun).
Skipped without root / network namespaces / tbf."""
from __future__ import annotations

import json
import os
import secrets

import pytest

from orchestration.hosts import Hosts, available
from test_hosts_export import foreign_listeners, listening

pytestmark = pytest.mark.skipif(available() is not None, reason=f"orchestration.hosts: {available()}")

FAST_PORT = 29540


def _args(tiny, *extra):
    return ["-m", "orchestration.train", "--model", str(tiny / "model"), "--data", str(tiny / "data.txt"),
            "--data.seq-len", "32", "--data.max-sequences", "200", "--train.batch-size", "4",
            "--train.microbatches", "2", "--run.name", "t", "--run.progress", "true", "--run.progress-every-s",
            "0.001", "--run.eval-sequences", "0", "--mesh.rows", "2", "--mesh.stages", "2", "--mesh.timeout-s", "60",
            "--anchor.enabled", "--train.optimizer", "spectral", "--train.spectral-rank", "8",
            "--anchor.microbatches", "2", "--anchor.snapshot-every", "1", "--anchor.max-staleness", "40",
            "--train.steps", "1000000", "--checkpoint.every", "0", *extra]  # stopped by a signal, never by the count


def _records(h: Hosts) -> list[dict]:
    path = os.path.join(h.dirs[0], "runs", "t", "metrics.jsonl")
    if not os.path.exists(path):
        return []
    lines = open(path).read().splitlines()
    return [json.loads(x) for x in (lines if not lines or lines[-1].endswith("}") else lines[:-1])]


def _wait_record(h: Hosts, pred, procs, what: str, budget: float = 600.0) -> dict:
    """The first record of host 0's metrics.jsonl that ``pred`` accepts (fails if a process
    in ``procs`` ends first)."""
    return h.wait_until(lambda: next((r for r in _records(h) if pred(r)), None), procs, what, budget)


@pytest.mark.slow
def test_an_anchor_row_on_its_own_host_dies_and_rejoins(tiny, tmp_path):
    env = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1",
           "MESHKERN_ANCHOR_SECRET": secrets.token_hex(32)}
    with Hosts(3, "50mbit", root=str(tmp_path)) as h:
        fast = [h.popen(i, h.torchrun(i, _args(tiny), port=FAST_PORT, nnodes=2), env=env, log="fast.log")
                for i in (0, 1)]
        join = _args(tiny, "--anchor.join", "--anchor.store", f"{h.addr(0)}:{FAST_PORT}")

        def anchor_row(port: int):  # what a user runs on host 2: one process per stage, its own rendezvous
            return h.popen(2, h.torchrun(2, join, port=port, nproc=2, nnodes=1, node_rank=0, master="127.0.0.1"),
                           env=env, log=f"anchor{port}.log")

        first = anchor_row(29541)
        lead = fast[0]
        first.wait_line(r"\[anchor\] row generation 1 linked with 1 fast replicas", 600)
        mark = len(lead.lines)
        lead.wait_line(r"^train step \d+/", 120, start=mark)  # the row linked and the fast circuit stepped on
        foreign = {i: foreign_listeners(h, i) for i in range(3)}
        assert all(listening(h, i) for i in range(3)) and foreign == {0: [], 1: [], 2: []}, foreign
        h.kill_host(2)  # the anchor's machine dies
        lost = lead.wait_line(r"\[anchor\] stage 0: step (\d+): lost the anchor", 300)
        mark = len(lead.lines)
        anchor_row(29542)
        back = lead.wait_line(r"\[anchor\] stage 0: step (\d+): anchor row generation 2 joined", 600, start=mark)
        assert int(back.group(1)) >= int(lost.group(1))
        gen1_max = max(r["anchor_applied"] for r in _records(h) if r["anchor_generation"] == 1)
        _wait_record(h, lambda r: r["anchor_generation"] == 2 and r["anchor_applied"] > gen1_max, fast,
                     "generation 2's updates are applied")
        assert h.stop_training(0)  # a clean stop, agreed by every rank at the next step
        assert h.wait_all(fast, timeout=900) == [0, 0], fast[0].tail(40) + fast[1].tail(40)
        assert h.procs[-1].wait(300) == 0, h.procs[-1].tail(40)  # generation 2 ends with the fast circuit
        recs = _records(h)
        gen1 = [r["anchor_applied"] for r in recs if r["anchor_generation"] == 1]
        last = recs[-1]
        print(f"\nanchor updates applied: generation 1 {max(gen1)}, by the end {last['anchor_applied']}; "
              f"lost at step {lost.group(1)}, generation 2 joined at step {back.group(1)}")
        assert last["anchor_generation"] == 2 and last["anchor_joins"] == 2 and last["anchor_link"] == "up"
        assert last["anchor_applied"] > max(gen1)  # generation 2 delivered
