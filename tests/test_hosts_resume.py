"""Across hosts (issue 40): a replaced host with an empty disk, resuming with the others.
It joins (it used to fail alone in its own `prepare` while the other hosts waited at the
rendezvous); with the leader's copy of every rank's state (--checkpoint.leader-copy, the
default) it gets its rank file from the leader and the run goes on; without one every
host stops within seconds with one message naming that host, the file it lacks and what
to copy (or the leader's whole model to start a new run from), and copying what it names
lets the same command resume. Skipped without root / network namespaces / tbf."""
from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from orchestration.hosts import Hosts, available
from test_hosts import _train_args

pytestmark = pytest.mark.skipif(available() is not None, reason=f"orchestration.hosts: {available()}")

ENV = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}


def _start(h: Hosts, args: list[str], port: int):
    return [h.popen(i, h.torchrun(i, args, port=port), env=ENV, log=f"torchrun{port}.log") for i in range(h.n)]


def _meta(h: Hosts, i: int, step: int) -> dict:
    with open(os.path.join(h.dirs[i], "runs", "t", "checkpoints", f"step_{step:08d}", "meta.json")) as f:
        return json.load(f)


@pytest.mark.slow
def test_a_host_with_an_empty_disk_resumes_from_the_leaders_copy_or_is_named_at_once(tiny, tmp_path):
    with Hosts(2, "50mbit", root=str(tmp_path)) as h:
        ckpts = os.path.join(h.dirs[1], "runs", "t", "checkpoints")
        # 1. Without the leader's copy: host 1 replaced, every host names it and what to copy, within seconds
        procs = _start(h, _train_args(tiny, "--train.steps", "2", "--checkpoint.leader-copy", "false"), 29520)
        assert h.wait_all(procs, timeout=900) == [0, 0], procs[0].tail(40) + procs[1].tail(40)
        assert "rank_00001.pt" not in _meta(h, 0, 2)["files"]
        saved = str(tmp_path / "host1-old-disk")
        shutil.move(ckpts, saved)  # a new machine, nothing on its disk
        resume = _train_args(tiny, "--train.steps", "4", "--checkpoint.resume", "latest")
        t0 = time.monotonic()
        procs = _start(h, resume, 29521)
        codes = h.wait_all(procs, timeout=600, fail_fast=False)
        took = time.monotonic() - t0
        assert codes[0] != 0 and codes[1] != 0
        assert "no checkpoint in runs/t/checkpoints on this host" in procs[1].tail(200)
        for p in procs:  # every host says it, the same way
            m = p.wait_line(r"cannot resume: (.*)", 1)
            text = m.group(1)
            assert "rank 1 (replica 0, stage 1) on the host of torchrun --node-rank 1, hostname" in text
            assert "it needs rank_00001.pt" in text and "resume from step 2" in text
            assert "holds no copy of every rank's state (--checkpoint.leader-copy was off" in text
            assert "copy runs/t/checkpoints/step_00000002/ and runs/t/checkpoints/latest" in text
            assert "whole model of step 2 (runs/t/checkpoints/step_00000002)" in text
        assert took < 120, took  # --mesh.timeout-s 120: an answer, not a timeout
        # 2. Copying what it names heals it; this run (the default) leaves the leader a copy of host 1's state
        shutil.copytree(saved, ckpts, dirs_exist_ok=True)
        procs = _start(h, resume, 29522)
        assert h.wait_all(procs, timeout=900) == [0, 0], procs[0].tail(40) + procs[1].tail(40)
        assert "resumed from runs/t/checkpoints/step_00000002 at step 2" in "".join(procs[0].lines)
        own = _meta(h, 1, 4)["files"]["rank_00001.pt"]
        assert _meta(h, 0, 4)["files"]["rank_00001.pt"] == own  # the leader's copy: host 1's file, byte for byte
        # 3. Host 1 replaced again: it gets that file from the leader (sha256-checked) and the run goes on
        shutil.rmtree(ckpts)
        procs = _start(h, _train_args(tiny, "--train.steps", "6", "--checkpoint.resume", "latest"), 29523)
        assert h.wait_all(procs, timeout=900) == [0, 0], procs[0].tail(40) + procs[1].tail(40)
        out0 = "".join(procs[0].lines)
        assert "resumed from runs/t/checkpoints/step_00000004 at step 4" in out0
        assert "warning: ranks [1] had no checkpoint on their host's disk" in out0
        assert "every rank resumes from step 4" in out0 and "the leader sent 1 rank file(s)" in out0
        assert [_meta(h, i, 6)["step"] for i in (0, 1)] == [6, 6]  # both disks hold the run's end again
        assert not [f for f in os.listdir(ckpts) if f.startswith(".from-leader")]
