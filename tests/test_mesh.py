"""Mesh layout and process groups on spawned gloo meshes; launcher fault handling."""
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from orchestration.launch.processes import MeshFailure, run_local
from orchestration.distributed.anchor_world import init_anchor_row, set_collective_timeout
from orchestration.distributed.mesh import MeshLayout, destroy_mesh, init_mesh


def test_layout_arithmetic():
    lay = MeshLayout(3, 2, anchor=True)
    assert lay.world_size == 6 and lay.fast_rows == 2 and lay.fast_world_size == 4
    assert MeshLayout(3, 2).fast_world_size == 6
    assert [lay.coords(r) for r in range(6)] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert lay.dp_ranks(1) == [1, 3] and lay.fast_ranks() == [0, 1, 2, 3]
    assert lay.is_anchor(4) and not lay.is_anchor(3)
    assert "anchor replica" in lay.describe(5)
    with pytest.raises(ValueError, match="outside"):
        lay.coords(6)
    with pytest.raises(ValueError, match="anchor"):
        MeshLayout(1, 2, anchor=True)


def _groups_worker(rank, world, anchor):
    lay = MeshLayout(3, 2, anchor=anchor)
    if lay.is_anchor(rank):  # the anchor row: a world of its own, met through the fast world's store
        from orchestration.anchor import side_store, store_address

        store = side_store(store_address(), 20)
        m = init_anchor_row(lay, lay.coords(rank)[1], store, 1, timeout_s=20)
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)
        out = {"anchor_world": t.item(), "world": dist.get_world_size(), "prev": m.prev_rank, "next": m.next_rank}
        destroy_mesh()
        store.set(f"test/anchor_done/{rank}", "1")
        return out
    m = init_mesh(lay, timeout_s=20)
    out = {"world": dist.get_world_size()}
    for name, g in (("pp", m.pp), ("dp", m.dp), ("fast", m.fast)):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=g)
        out[name] = t.item()
    destroy_mesh()
    if rank == 0 and anchor:  # rank 0 holds the store the anchor row meets on: it stays until the row is done
        from orchestration.anchor import side_store, store_address

        side_store(store_address(), 60).wait([f"test/anchor_done/{r}" for r in lay.pp_ranks(lay.rows - 1)])
    return out


def _row_worker(rank, world, late_s, join):
    """Anchor stage ``rank`` of a 2x2 mesh's anchor row, met on a store rank 0 hosts: joins
    with a 2 s bound, then waits 120 s in its collectives; stage 1 comes ``late_s`` late to
    the all-reduce (as one busy on a fast replica's link), or with ``join`` False never joins."""
    from datetime import timedelta

    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), 2, rank == 0, timedelta(seconds=30))
    lay = MeshLayout(3, 2, anchor=True)
    if rank == 1 and not join:
        store.wait(["test/stage0_done"])
        return "absent"
    try:
        init_anchor_row(lay, rank, store, 1, timeout_s=2)
    except Exception as e:
        store.set("test/stage0_done", "1")
        return f"join failed: {type(e).__name__}"
    set_collective_timeout(120)
    if rank == 1:
        time.sleep(late_s)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    destroy_mesh()
    store.set(f"test/done/{rank}", "1")
    store.wait(["test/done/0", "test/done/1"])  # rank 0 hosts the store: it stays until both are done
    return t.item()


@pytest.mark.slow
def test_anchor_row_collectives_outwait_the_join_bound_which_still_holds():
    """The anchor row's collectives wait what set_collective_timeout says (one stage may be
    busy longer than --mesh.timeout-s on a fast replica's link; a row that timed out on it
    ended for good), while a stage that never comes still fails the join within its bound."""
    assert run_local(_row_worker, 2, (5.0, True), timeout_s=100) == [3.0, 3.0]  # 5 s late, 2 s join bound
    res = run_local(_row_worker, 2, (0.0, False), timeout_s=100)
    assert res[1] == "absent" and res[0].startswith("join failed"), res

@pytest.mark.slow
@pytest.mark.parametrize("anchor", [False, True])
def test_groups_sum_the_right_ranks(anchor):
    """The fast world holds the fast ranks only; the anchor row forms its own world."""
    res = run_local(_groups_worker, 6, (anchor,), timeout_s=60)
    lay = MeshLayout(3, 2, anchor=anchor)
    for rank, out in enumerate(res):
        row, stage = lay.coords(rank)
        if lay.is_anchor(rank):
            assert out == {"anchor_world": sum(lay.pp_ranks(row)), "world": 2,
                           "prev": None if stage == 0 else 0, "next": 1 if stage == 0 else None}
        else:
            assert out["world"] == lay.fast_world_size
            assert out["pp"] == sum(lay.pp_ranks(row))
            assert out["dp"] == sum(lay.dp_ranks(stage))
            assert out["fast"] == sum(lay.fast_ranks())


def _anchor_in_init_mesh(rank, world):
    m = init_mesh(MeshLayout(2, 1, anchor=True), timeout_s=5)  # rank 0: a fast world of one
    destroy_mesh()
    return m.rank


@pytest.mark.slow
def test_init_mesh_refuses_an_anchor_rank():
    with pytest.raises(MeshFailure, match=r"rank 1 failed: ValueError: rank 1 \(anchor replica, stage 0\) is in "
                                          "the anchor row: it joins with init_anchor_row"):
        run_local(_anchor_in_init_mesh, 2, timeout_s=30)


def _dies_worker(rank, world):
    m = init_mesh(MeshLayout(2, 2), timeout_s=30)
    t = torch.ones(4)
    for step in range(1000):
        if rank == 3 and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(t, group=m.fast)
        time.sleep(0.01)
    return "finished"


@pytest.mark.slow
def test_killed_rank_is_named_and_nobody_hangs():
    lay = MeshLayout(2, 2)
    # a hang would end in run_local's TimeoutError after 60 s, not in this MeshFailure
    with pytest.raises(MeshFailure, match=r"rank 3 \(replica 1, stage 1\) died: killed by signal SIGKILL") as ei:
        run_local(_dies_worker, 4, timeout_s=60, describe=lay.describe)
    assert ei.value.rank == 3


def _raises_worker(rank, world):
    if rank == 1:
        raise ValueError("bad thing on purpose")
    time.sleep(600)  # outlives run_local's timeout (TimeoutError) unless the launcher terminates it
    return "late"


@pytest.mark.slow
def test_raising_rank_is_named_and_others_terminated():
    with pytest.raises(MeshFailure, match="rank 1 failed: ValueError: bad thing on purpose"):
        run_local(_raises_worker, 3, timeout_s=60, grace_s=1.0)


def _optional_dies_worker(rank, world):
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1.0)
    return rank


@pytest.mark.slow
def test_optional_rank_may_die_without_stopping_the_others(capsys):
    res = run_local(_optional_dies_worker, 3, timeout_s=60, optional={2})
    assert res == [0, 1, None]
    assert "rank 2 exited with code -9; the rest of the mesh continues" in capsys.readouterr().err


def _restart_worker(rank, world, marker):
    """Optional ranks 2 and 3 form a group; rank 3's first incarnation dies, rank 2's
    first incarnation would run long (it must be terminated and started again with 3)."""
    first = not os.path.exists(f"{marker}.{rank}")
    open(f"{marker}.{rank}", "a").close()
    if rank == 3 and first:
        for _ in range(600):  # die only once rank 2's first incarnation has left its marker
            if os.path.exists(f"{marker}.2"):
                break
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 2 and first:
        time.sleep(600)  # outlives run_local's timeout unless the restart terminates it
    if rank < 2:  # required ranks outlive the restart: they wait for both second incarnations
        for _ in range(600):  # a bound (60 s), not a timing
            if os.path.exists(f"{marker}.again.2") and os.path.exists(f"{marker}.again.3"):
                break
            time.sleep(0.1)
    else:
        open(f"{marker}.again.{rank}", "a").close()
    return (rank, "again" if not first else "first")


@pytest.mark.slow
def test_dead_optional_group_is_restarted_while_required_ranks_run(tmp_path, capsys):
    # rank 2's first incarnation sleeps past run_local's timeout: it must be terminated, not waited for
    res = run_local(_restart_worker, 4, (str(tmp_path / "m"),), timeout_s=60, optional={2, 3}, restarts=1)
    assert res == [(0, "first"), (1, "first"), (2, "again"), (3, "again")]
    assert "rank 3 exited with code -9; restarting ranks [2, 3] (restart 1 of 1)" in capsys.readouterr().err


def _unreachable_worker(rank, world):
    if rank == 1:
        raise ConnectionError("cannot reach the fast circuit's store")
    time.sleep(1.0)
    return rank


@pytest.mark.slow
def test_connection_error_is_not_restarted(capsys):
    res = run_local(_unreachable_worker, 2, timeout_s=60, optional={1}, restarts=3)
    assert res == [0, None]
    err = capsys.readouterr().err
    assert "restarting" not in err and "ConnectionError: cannot reach" in err


def _stalls_worker(rank, world):
    m = init_mesh(MeshLayout(1, 2), timeout_s=4)
    t = torch.ones(2)
    dist.all_reduce(t, group=m.pp)
    if rank == 1:
        time.sleep(120)  # alive but stuck: never joins the next collective
    dist.all_reduce(t, group=m.pp)
    return "done"


@pytest.mark.slow
def test_stalled_rank_is_named_after_the_timeout():
    lay = MeshLayout(1, 2)
    # the mesh's own 4 s collective timeout names the stalled rank before run_local's 60 s
    with pytest.raises(MeshFailure, match=r"rank 1 \(replica 0, stage 1\) stalled"):
        run_local(_stalls_worker, 2, timeout_s=60, describe=lay.describe)
