"""Across hosts (issue 40): a replaced host with an empty disk, resuming with the others.
It used to fail alone in its own `prepare` (no checkpoint) while the other hosts waited at
the rendezvous until their timeout; now it joins, and every host stops within seconds
with one message naming that host, the file it lacks and what to copy (or, when its disk
is gone, the leader's whole model to start a new run from). Copying what the message
names lets the same command resume. Skipped without root / network namespaces / tbf."""
from __future__ import annotations

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


@pytest.mark.slow
def test_a_host_with_an_empty_disk_is_named_at_once_and_a_copy_heals_it(tiny, tmp_path):
    with Hosts(2, "50mbit", root=str(tmp_path)) as h:
        procs = _start(h, _train_args(tiny, "--train.steps", "2"), 29520)
        assert h.wait_all(procs, timeout=900) == [0, 0], procs[0].tail(40) + procs[1].tail(40)
        ckpts = os.path.join(h.dirs[1], "runs", "t", "checkpoints")
        saved = str(tmp_path / "host1-old-disk")
        shutil.move(ckpts, saved)  # host 1 replaced: a new machine, nothing on its disk
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
            assert "copy runs/t/checkpoints/step_00000002/ and runs/t/checkpoints/latest" in text
            assert "whole model of step 2 (runs/t/checkpoints/step_00000002)" in text
        assert took < 120, took  # --mesh.timeout-s 120: an answer, not a timeout
        shutil.copytree(saved, ckpts, dirs_exist_ok=True)  # what the message says to copy
        procs = _start(h, resume, 29522)
        assert h.wait_all(procs, timeout=900) == [0, 0], procs[0].tail(40) + procs[1].tail(40)
        assert "resumed from runs/t/checkpoints/step_00000002 at step 2" in "".join(procs[0].lines)
