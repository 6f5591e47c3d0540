"""Checkpoints across hosts with disks of their own (issue 40; components.checkpoint_hosts),
on spawned gloo ranks whose checkpoint directories stand for the hosts' disks: each disk
gets its own ranks' files, published and verified there; the leader's disk the whole model
(shards or the PEFT folder) from what the stages sent, counted as "export" bytes; a shared
directory behaves as before (nothing sent); a resume reads each disk and agrees on a step."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from orchestration.components import checkpoint as ckpt
from orchestration.components.checkpoint_hosts import check_disks

import dp_helpers

ROWS, STAGES = 2, 2  # ranks 0, 1 = replica 0's stages 0, 1; ranks 2, 3 = replica 1's


def _value(row: int, stage: int, step: int) -> float:
    return 100.0 * step + 10 * row + stage


class FakeStage:
    """A stage with one weight per layer, filled with a known value."""

    def __init__(self, stage: int, value: float):
        self.index = stage
        self.w = torch.nn.Parameter(torch.full((8, 4), value))

    def parameters(self):
        return [self.w]

    def hf_state_dict(self):
        return {f"model.layers.{self.index}.mlp.w": self.w}

    def state_dict(self):
        return {"w": self.w.detach().clone()}

    def load_state_dict(self, sd):
        with torch.no_grad():
            self.w.copy_(sd["w"])


class FakeAdapters(FakeStage):
    """LoRA's AdapterState, as the checkpointer sees it: PEFT-keyed tensors + a peft_config."""

    peft_config = {"peft_type": "LORA", "r": 2, "base_model_name_or_path": "base"}

    def tensors(self):
        return {f"base_model.model.model.layers.{self.index}.mlp.lora_A.weight": self.w.detach().clone()}


def _rank(rank, world, port, roots, kind, out):
    import torch.distributed as dist

    from orchestration.config import parse_args
    from orchestration.distributed.link_counter import LinkCounter
    from orchestration.distributed.mesh import MeshLayout

    from orchestration.components import checkpoint_hosts

    checkpoint_hosts.CHUNK = 64  # the shards travel in several pieces
    dp_helpers.init(rank, world, port)
    cfg, _ = parse_args(["--mesh.rows", str(ROWS), "--mesh.stages", str(STAGES), "--checkpoint.keep", "3",
                         "--train.steps", "5"] + (["--adapter", "lora"] if kind == "lora" else [])
                        + (["--checkpoint.leader-copy", "false"] if kind == "refuse" else []))
    row, stage = divmod(rank, STAGES)
    mesh = SimpleNamespace(rank=rank, row=row, stage=stage, elastic=False, fast=dist.group.WORLD,
                           device=torch.device("cpu"), layout=MeshLayout(ROWS, STAGES), describe=lambda g: f"rank {g}")
    plan = SimpleNamespace(ckpt_dir=roots[rank], model_path="")
    st = (FakeAdapters if kind == "lora" else FakeStage)(stage, 0.0)
    counter = LinkCounter()
    cp = ckpt.Checkpointer(cfg, plan, mesh, st, {"stage": st, "counter": counter})
    seen = {}
    if kind == "skip" and rank == 0:  # the leader receives step 3's model only after its step-4 save returned
        import threading

        release, receive = threading.Event(), cp.export._receive
        cp.export._receive = lambda *a: (release.wait(120), receive(*a))
    for step in ((3, 4, 5) if kind == "skip" else (3, 5)):
        st.load_state_dict({"w": torch.full((8, 4), _value(row, stage, step))})
        cp.save(step)
        if kind == "skip" and rank == 0 and step == 4:
            p3 = ckpt.step_dir(roots[0], 3)
            seen = {"pending": ckpt.verify(p3)["disk"], "problem": ckpt.model_problem(p3, ckpt.verify(p3)),
                    "shard_there": os.path.exists(os.path.join(p3, "model-00002-of-00002.safetensors"))}
            release.set()
    if kind == "diverged" and rank == 0:  # as divergence_report does: only the leader's `latest` goes back
        ckpt.set_latest(roots[0], ckpt.step_dir(roots[0], 3))
    dist.barrier()
    if kind in ("heal", "refuse") and rank == 1:  # host B replaced: a new machine, nothing on its disk
        import shutil

        shutil.rmtree(roots[1])
    dist.barrier()
    st.load_state_dict({"w": torch.zeros(8, 4)})
    empty = ckpt.disk_is_empty(roots[rank])  # as orchestration.launch.prepare decides
    try:
        got = cp.load(ckpt.no_local_checkpoint(roots[rank]) if empty else ckpt.resolve("latest", roots[rank]))
    except ckpt.CheckpointError as e:
        got, seen = -1, {"error": str(e)}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"step": got, "w": float(st.w.mean()), "export": counter.totals()["export"], "seen": seen}, f)
    dp_helpers.shutdown()


def _spawn(tmp_path, roots, kind="full"):
    out = tmp_path / "out"
    out.mkdir()
    assert dp_helpers.spawn(_rank, ROWS * STAGES, [str(r) for r in roots], kind, str(out), timeout=240) == [0] * 4
    return [json.load(open(out / f"rank{r}.json")) for r in range(ROWS * STAGES)]


def _two_disks(tmp_path):
    a, b = tmp_path / "hostA", tmp_path / "hostB"
    return a, b, [a, b, a, b]  # host A holds ranks 0 and 2 (stage 0 of each replica), host B ranks 1 and 3


@pytest.mark.slow
def test_each_disk_holds_its_ranks_and_the_leader_the_model(tmp_path):
    a, b, roots = _two_disks(tmp_path)
    res = _spawn(tmp_path, roots)
    pa, pb = ckpt.resolve("latest", str(a)), ckpt.resolve("latest", str(b))
    assert os.path.basename(pa) == os.path.basename(pb) == "step_00000005"
    ma, mb = ckpt.verify(pa), ckpt.verify(pb)  # every file of each disk, sha256-checked
    # it travelled in the background (checkpoint_export), with the leader's copy of host B's rank files
    size, s1, s3 = (ma["files"]["model-00002-of-00002.safetensors"]["size"], mb["files"]["rank_00001.pt"]["size"],
                    mb["files"]["rank_00003.pt"]["size"])
    assert ma["disk"]["export"]["bytes"] == size + s1 + s3 + 3 * 40
    assert {k: v for k, v in ma["disk"].items() if k != "export"} == {"ranks": [0, 1, 2, 3], "model": True, "disks": 2}
    assert mb["disk"] == {"ranks": [1, 3], "model": False, "disks": 2}
    assert set(ma["files"]) == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                "model.safetensors.index.json", "rank_00000.pt", "rank_00001.pt", "rank_00002.pt",
                                "rank_00003.pt"}
    assert {f: ma["files"][f] for f in mb["files"]} == mb["files"]  # the same bytes
    assert set(mb["files"]) == {"rank_00001.pt", "rank_00003.pt"}
    from safetensors.torch import load_file

    shard = load_file(os.path.join(pa, "model-00002-of-00002.safetensors"))  # stage 1's, sent from host B
    torch.testing.assert_close(shard["model.layers.1.mlp.w"], torch.full((8, 4), _value(0, 1, 5)))
    index = json.load(open(os.path.join(pa, "model.safetensors.index.json")))
    assert index["weight_map"] == {"model.layers.0.mlp.w": "model-00001-of-00002.safetensors",
                                   "model.layers.1.mlp.w": "model-00002-of-00002.safetensors"}
    # replica 0's stage 1 sends its shard file + a 40-byte header, and host B's ranks their rank files (+ 40), at
    # each of the 2 saves (a rank file of step 3 may differ from step 5's by the few bytes of the counts it holds)
    assert res[0]["export"] == res[2]["export"] == 0
    assert abs(res[1]["export"] - 2 * (size + 40 + s1 + 40)) < 256 and abs(res[3]["export"] - 2 * (s3 + 40)) < 256
    assert [r["step"] for r in res] == [5] * 4  # each resumed from its own disk
    assert [r["w"] for r in res] == [_value(r // 2, r % 2, 5) for r in range(4)]
    assert len(os.listdir(a)) == len(os.listdir(b)) == 3  # step_3, step_5, latest: no .tmp, no probe left


@pytest.mark.slow
def test_lora_adapters_are_assembled_into_one_peft_folder_on_the_leader(tmp_path):
    a, b, roots = _two_disks(tmp_path)
    res = _spawn(tmp_path, roots, "lora")
    pa, pb = ckpt.resolve("latest", str(a)), ckpt.resolve("latest", str(b))
    from safetensors.torch import load_file

    ad = load_file(os.path.join(pa, ckpt.ADAPTER_WEIGHTS))
    assert sorted(ad) == [f"base_model.model.model.layers.{s}.mlp.lora_A.weight" for s in range(2)]
    torch.testing.assert_close(ad["base_model.model.model.layers.1.mlp.lora_A.weight"],
                               torch.full((8, 4), _value(0, 1, 5)))
    assert json.load(open(os.path.join(pa, ckpt.ADAPTER_CONFIG)))["r"] == 2
    assert not os.path.exists(os.path.join(pb, ckpt.ADAPTER_WEIGHTS))
    assert res[1]["export"] > 0 and res[3]["export"] > 0 and res[0]["export"] == res[2]["export"] == 0
    from orchestration.export import export_adapter

    with pytest.raises(ValueError, match=r"host's part .* leader"):
        export_adapter(pb, str(tmp_path / "adapter"))
    assert export_adapter(pa, str(tmp_path / "adapter")) == str(tmp_path / "adapter")


@pytest.mark.slow
def test_a_shared_disk_sends_nothing_and_keeps_one_checkpoint(tmp_path):
    shared = tmp_path / "shared"
    res = _spawn(tmp_path, [shared] * 4)
    meta = ckpt.verify(ckpt.resolve("latest", str(shared)))
    assert "disk" not in meta
    assert {f"rank_{r:05d}.pt" for r in range(4)} | {"model-00002-of-00002.safetensors"} <= set(meta["files"])
    assert [r["export"] for r in res] == [0] * 4 and [r["step"] for r in res] == [5] * 4


@pytest.mark.slow
def test_hosts_whose_latest_differ_all_resume_from_the_older_step(tmp_path, capfd):
    a, b, roots = _two_disks(tmp_path)
    res = _spawn(tmp_path, roots, "diverged")
    assert [r["step"] for r in res] == [3] * 4
    assert [r["w"] for r in res] == [_value(r // 2, r % 2, 3) for r in range(4)]
    assert "every rank resumes from step 3" in capfd.readouterr().out


def test_disks_must_be_an_equivalence():
    check_disks([[True, False], [False, True]], "d")  # two disks
    check_disks([[True, True], [True, True]], "d")  # one
    with pytest.raises(ckpt.CheckpointError, match="ranks 0 and 1 .* disagree"):
        check_disks([[True, True], [False, True]], "d")  # seen one way only
    with pytest.raises(ckpt.CheckpointError, match="disagree"):  # 0~1, 1~2 but not 0~2
        check_disks([[True, True, False], [True, True, True], [False, True, True]], "d")


@pytest.mark.slow
def test_a_model_on_its_way_does_not_hold_the_next_checkpoint(tmp_path):
    """Step 3's model is held back on the leader until its step-4 save returned (a save
    that waited for it would deadlock the test): step 3 is published as state with its
    model pending, step 4 saves state only ("skipped": step 3's model was on its way),
    the final step 5 waits for step 3's model, then sends and lands its own."""
    a, b, roots = _two_disks(tmp_path)
    res = _spawn(tmp_path, roots, "skip")
    seen = res[0]["seen"]
    assert seen["pending"] == {"ranks": [0, 2], "model": False, "disks": 2, "pending": True}  # no copy yet
    assert "still on its way" in seen["problem"] and not seen["shard_there"]
    m3, m4, m5 = (ckpt.verify(ckpt.step_dir(str(a), s)) for s in (3, 4, 5))
    assert m3["disk"]["model"] is True and m5["disk"]["model"] is True
    assert m4["disk"] == {"ranks": [0, 2], "model": False, "disks": 2, "skipped": 3}
    assert "rank_00001.pt" in m3["files"] and "rank_00001.pt" not in m4["files"]  # no copy of a skipped step
    assert "model-00001-of-00002.safetensors" not in m4["files"]
    assert "step 3 was still on its way" in ckpt.model_problem(ckpt.step_dir(str(a), 4), m4)
    from safetensors.torch import load_file

    for step in (3, 5):  # each step's own weights, whole
        shard = load_file(os.path.join(ckpt.step_dir(str(a), step), "model-00002-of-00002.safetensors"))
        torch.testing.assert_close(shard["model.layers.1.mlp.w"], torch.full((8, 4), _value(0, 1, step)))
    size, s1 = m5["files"]["model-00002-of-00002.safetensors"]["size"], m5["files"]["rank_00001.pt"]["size"]
    assert abs(res[1]["export"] - 2 * (size + 40 + s1 + 40)) < 256  # steps 3 and 5 sent, step 4 not
    assert [r["step"] for r in res] == [5] * 4


@pytest.mark.slow
def test_a_disk_replaced_empty_resumes_from_the_leaders_copy(tmp_path, capfd):
    """Host B's disk is wiped after step 5 (a replaced machine): its ranks get their rank
    files from the leader's copy and every rank holds its own step-5 state again."""
    a, b, roots = _two_disks(tmp_path)
    res = _spawn(tmp_path, roots, "heal")
    assert [r["step"] for r in res] == [5] * 4
    assert [r["w"] for r in res] == [_value(r // 2, r % 2, 5) for r in range(4)]
    out = capfd.readouterr().out
    assert "ranks [1, 3] had no checkpoint on their host's disk" in out and "the leader sent 2 rank file(s)" in out


@pytest.mark.slow
def test_without_the_leaders_copy_an_empty_disk_is_refused_naming_what_to_copy(tmp_path):
    a, b, roots = _two_disks(tmp_path)
    res = _spawn(tmp_path, roots, "refuse")
    assert [r["step"] for r in res] == [-1] * 4
    for r in res:  # every rank says it, the same way
        assert "cannot resume: rank 1" in r["seen"]["error"] and "it needs rank_00003.pt" in r["seen"]["error"]
        assert "--checkpoint.leader-copy was off" in r["seen"]["error"]
