"""Across hosts, as users run it (issue 40): hosts as network namespaces with shaped links
and their own disks (orchestration.hosts), and a torchrun mesh spread over them that trains,
checkpoints (each host's state on its own disk, the model assembled on the leader), stops
and resumes. Skipped without root / network namespaces / tbf (the reason is printed)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from orchestration.hosts import Hosts, available

pytestmark = pytest.mark.skipif(available() is not None, reason=f"orchestration.hosts: {available()}")


def _namespaces() -> set[str]:
    return set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())


def _mine(h: Hosts) -> set[str]:
    return {ns for ns in _namespaces() if ns.startswith(h.tag)}


def test_hosts_shape_their_links_and_go_away(tmp_path):
    """Namespaces and tbf qdiscs at the set rates exist while the harness does and are gone
    after; one bulk transfer runs at the shaped rate (within a generous band)."""
    with Hosts(2, "8mbit", down_rate="4mbit", root=str(tmp_path)) as h:
        assert _mine(h) == {h.hub, *h.names}
        up, down = h.qdiscs(1)
        assert "tbf" in up and "rate 8Mbit" in up, up
        assert "tbf" in down and "rate 4Mbit" in down, down
        assert all(os.path.isdir(d) and d.startswith(str(tmp_path)) for d in h.dirs)
        bps = h.transfer(0, 1, 1 << 20)  # host 0's 8 Mbit/s uplink, then host 1's 4 Mbit/s downlink
        assert 0.6 * 4e6 < bps < 1.05 * 4e6, bps
        tag = h.tag
    assert not {ns for ns in _namespaces() if ns.startswith(tag)}


def test_link_down_is_silence_and_up_restores_it(tmp_path):
    """A downed link: a peer's connection attempt times out (no route error from the hub);
    back up, traffic flows at the shaped rate again."""
    probe = ("import socket,sys\ntry:\n socket.create_connection((sys.argv[1], 9), timeout=2)\n"
             "except OSError as e: print('ERR', type(e).__name__)\n")
    with Hosts(2, "8mbit", root=str(tmp_path)) as h:
        h.link(1, False)
        p = h.popen(0, [sys.executable, "-c", probe, h.addr(1)])
        assert p.wait(60) == 0
        assert p.wait_line(r"^ERR ", 1).group(0) == "ERR " and "TimeoutError" in p.tail()
        h.link(1, True)
        assert "rate 8Mbit" in h.qdiscs(1)[0]
        assert h.transfer(1, 0, 1 << 19) > 0.6 * 8e6


def test_rate_bps_reads_rates_as_tc_writes_them():
    from orchestration.hosts import rate_bps

    assert [rate_bps(r) for r in ("500kbit", "2mbit", "200Mbit", "1gbit", "9600bit")] == [5e5, 2e6, 2e8, 1e9, 9600.0]
    with pytest.raises(ValueError, match="like 500kbit"):
        rate_bps("5mb")


def test_a_failed_build_leaves_nothing(tmp_path, monkeypatch):
    """A harness whose topology fails half way deletes what it made."""
    from orchestration.hosts import netns

    real, calls = netns._sh, []

    def failing(*cmd, check=True):
        calls.append(cmd)
        if "tc" in cmd and "qdisc" in cmd and "add" in cmd:
            raise netns.HostsError("injected")
        return real(*cmd, check=check)

    before = _namespaces()
    monkeypatch.setattr(netns, "_sh", failing)
    with pytest.raises(netns.HostsError, match="injected"):
        Hosts(2, "8mbit", root=str(tmp_path))
    monkeypatch.setattr(netns, "_sh", real)
    assert any(c[:3] == ("ip", "netns", "add") for c in calls)
    assert _namespaces() == before


def test_cli_check_runs_and_cleans(tmp_path):
    p = subprocess.Popen([sys.executable, "-m", "orchestration.hosts", "-n", "2", "--rate", "16mbit", "--check",
                          "--dir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert "Mbit/s payload" in out and "no netem" in out and "host 1: 10.213.1.2" in out
    assert sorted(os.listdir(tmp_path)) == ["host0", "host1"]  # --dir: kept
    assert not {ns for ns in _namespaces() if ns.startswith(f"mkh{p.pid}x")}


# ---------------------------------------------------------------- a torchrun mesh across hosts
def _train_args(tiny, *extra):
    return ["-m", "orchestration.train", "--model", str(tiny / "model"), "--data", str(tiny / "data.txt"),
            "--data.seq-len", "32", "--data.max-sequences", "200", "--train.batch-size", "4",
            "--train.microbatches", "2", "--run.name", "t", "--run.progress", "false", "--run.eval-sequences", "4",
            "--mesh.rows", "1", "--mesh.stages", "2", "--mesh.timeout-s", "120", "--checkpoint.every", "2", *extra]


def _torchrun(h: Hosts, args: list[str], port: int) -> list[str]:
    """Each host runs its torchrun line in its own directory (its own disk); all must succeed."""
    env = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}
    procs = [h.popen(i, h.torchrun(i, args, port=port), env=env, log=f"torchrun{port}.log") for i in range(h.n)]
    codes = h.wait_all(procs, timeout=900)
    assert codes == [0] * h.n, "\n".join(f"host {p.host} exit {p.returncode}:\n{p.tail(40)}" for p in procs)
    return ["".join(p.lines) for p in procs]


def _ckpt(h: Hosts, i: int) -> str:
    from orchestration.components import checkpoint as ckpt

    return ckpt.resolve("latest", os.path.join(h.dirs[i], "runs", "t", "checkpoints"))


@pytest.mark.slow
def test_two_hosts_pipeline_trains_checkpoints_and_resumes_on_their_own_disks(tiny, tmp_path):
    """A 1x2 pipeline, one stage per host, separate disks, torchrun per host as the README
    says: the checkpoints at steps 2 and 3 publish on both disks (host 1: its rank's state;
    host 0: its rank's, the whole model and the leader's copy of host 1's state, stage 1's
    shard and rank file sent over the link); a second
    torchrun per host resumes from each disk's `latest` to step 5; the model on host 0
    loads with from_pretrained and holds host 1's trained stage."""
    from transformers import AutoModelForCausalLM

    from orchestration.components import checkpoint as ckpt

    with Hosts(2, "50mbit", root=str(tmp_path)) as h:
        _torchrun(h, _train_args(tiny, "--train.steps", "3"), 29500)
        assert [os.path.basename(_ckpt(h, i)) for i in (0, 1)] == ["step_00000003"] * 2
        out = _torchrun(h, _train_args(tiny, "--train.steps", "5", "--checkpoint.resume", "latest"), 29501)
        assert "resumed from runs/t/checkpoints/step_00000003 at step 3" in out[0]
        p0, p1 = _ckpt(h, 0), _ckpt(h, 1)
        assert os.path.basename(p0) == os.path.basename(p1) == "step_00000005"
        m0, m1 = ckpt.verify(p0), ckpt.verify(p1)
        # stage 1's shard and (--checkpoint.leader-copy, the default) host 1's rank file came in the background
        shard, state = m0["files"]["model-00002-of-00002.safetensors"]["size"], m1["files"]["rank_00001.pt"]["size"]
        assert m0["disk"]["export"]["bytes"] == shard + state + 2 * 40
        assert {k: v for k, v in m0["disk"].items() if k != "export"} == {"ranks": [0, 1], "model": True, "disks": 2}
        assert m1["disk"] == {"ranks": [1], "model": False, "disks": 2}
        assert m0["files"]["rank_00001.pt"] == m1["files"]["rank_00001.pt"]  # the leader's copy: the same bytes
        assert "model-00002-of-00002.safetensors" not in m1["files"]
        model = AutoModelForCausalLM.from_pretrained(p0)
        st1 = ckpt.load_rank_state(p1, 1)["stage"]  # on host 1's disk only
        assert ckpt.load_rank_state(p1, 1)["step"] == 5
        assert torch.equal(model.lm_head.weight, st1["lm_head.weight"])
        assert torch.equal(model.model.norm.weight, st1["norm.weight"])
        links = json.load(open(os.path.join(h.dirs[0], "runs", "t", "link_bytes.json")))["links"]
        # saves at steps 2, 3, 4, 5 (counters resumed), each with the shard and the rank file (its size may differ
        # by a few bytes between steps: the counters it holds)
        assert abs(links["export:1->0"] - 4 * (shard + state + 80)) < 4 * 1024, links["export:1->0"]


@pytest.mark.slow
def test_a_2x2_mesh_over_four_hosts_resumes_bit_identical_from_its_disks(tiny, tmp_path):
    """Two replicas of two stages, one rank per host (pipeline links and DiLoCo's sync over
    the shaped links, the default codec): a run of 6 steps checkpointing every 2, then the
    same command resumed from step 4 on every host's own disk, steps 5 and 6 again: their
    losses and the held-out loss equal the uninterrupted run's, bit for bit."""
    from orchestration.components.metrics import read_jsonl

    args = _train_args(tiny, "--mesh.rows", "2", "--train.steps", "6", "--dp.sync-every", "2")
    metrics = os.path.join("runs", "t", "metrics.jsonl")
    with Hosts(4, "50mbit", root=str(tmp_path)) as h:
        first = _torchrun(h, args, 29520)
        straight = {r["step"]: r["loss"] for r in read_jsonl(os.path.join(h.dirs[0], metrics))}
        assert [os.path.basename(_ckpt(h, i)) for i in range(4)] == ["step_00000006"] * 4
        again = _torchrun(h, args + ["--checkpoint.resume", os.path.join("runs", "t", "checkpoints", "step_00000004")],
                          29521)
        assert "resumed from runs/t/checkpoints/step_00000004 at step 4" in again[0]
        resumed = {r["step"]: r["loss"] for r in read_jsonl(os.path.join(h.dirs[0], metrics))}
    assert sorted(straight) == sorted(resumed) == list(range(1, 7))
    assert [resumed[s] for s in (5, 6)] == [straight[s] for s in (5, 6)]

    def held_out(out: str) -> list[str]:  # [base, final] as printed
        line = next(x for x in out.splitlines() if x.startswith("held-out loss base -> final"))
        return line.split("final", 1)[1].split("->")

    assert [x.strip() for x in held_out(first[0])] == [x.strip() for x in held_out(again[0])]


@pytest.mark.slow
def test_two_hosts_lora_run_assembles_the_peft_folder_on_the_leader(tiny, tmp_path):
    import peft
    from transformers import AutoModelForCausalLM

    from orchestration.components import checkpoint as ckpt

    lora = ("--adapter", "lora", "--adapter.rank", "2", "--adapter.alpha", "4", "--train.lr", "1e-2")
    with Hosts(2, "50mbit", root=str(tmp_path)) as h:
        _torchrun(h, _train_args(tiny, "--train.steps", "2", *lora), 29510)
        out = _torchrun(h, _train_args(tiny, "--train.steps", "4", "--checkpoint.resume", "latest", *lora), 29511)
        assert "resumed from runs/t/checkpoints/step_00000002 at step 2" in out[0]
        p0, p1 = _ckpt(h, 0), _ckpt(h, 1)
        assert ckpt.verify(p1)["disk"]["model"] is False and not os.path.exists(os.path.join(p1, ckpt.ADAPTER_WEIGHTS))
        adapter = os.path.join(h.dirs[0], "runs", "t", "adapter")  # the run's end exports the leader's copy
        base = AutoModelForCausalLM.from_pretrained(str(tiny / "model"))
        model = peft.PeftModel.from_pretrained(base, adapter)
        st1 = ckpt.load_rank_state(p1, 1)["stage"]  # stage 1's adapters (layers 2, 3), on host 1's disk only
        from safetensors.torch import load_file

        sent = load_file(os.path.join(p0, ckpt.ADAPTER_WEIGHTS))  # assembled on host 0 from both stages
        assert {int(k.split(".layers.")[1].split(".")[0]) for k in sent} == {0, 1, 2, 3}
        stage1 = {k: v for k, v in sent.items() if int(k.split(".layers.")[1].split(".")[0]) >= 2}
        sig = lambda d: sorted((tuple(v.shape), float(v.double().sum())) for v in d.values())  # noqa: E731
        assert len(st1) == len(stage1) > 0 and sig(st1) == sig(stage1)
        loaded = {n: p for n, p in model.named_parameters() if "lora_" in n}
        assert len(loaded) == len(sent)  # peft found every adapter of the folder
