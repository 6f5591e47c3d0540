"""Pipeline schedules: valid, runnable, and 1F1B's memory bound."""
import pytest

from orchestration.distributed.schedule import Action, check_schedule, make_schedule, max_in_flight


def _str(acts):
    return " ".join(map(repr, acts))


def test_known_small_schedules():
    assert [_str(a) for a in make_schedule("gpipe", 2, 2)] == ["F0 F1 B0 B1"] * 2
    one = make_schedule("1f1b", 3, 4)
    assert _str(one[0]) == "F0 F1 F2 B0 F3 B1 B2 B3"
    assert _str(one[1]) == "F0 F1 B0 F2 B1 F3 B2 B3"
    assert _str(one[2]) == "F0 B0 F1 B1 F2 B2 F3 B3"


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("S,M", [(1, 1), (1, 3), (2, 1), (2, 4), (3, 2), (4, 4), (4, 9), (5, 3)])
def test_every_F_before_its_B_and_dependencies_satisfiable(kind, S, M):
    sched = make_schedule(kind, S, M)
    assert len(sched) == S
    for acts in sched:
        for m in range(M):
            assert acts.index(Action("F", m)) < acts.index(Action("B", m))
    order = check_schedule(sched)  # raises on deadlock
    assert len(order) == 2 * S * M
    pos = {(s, a.kind, a.microbatch): i for i, (s, a) in enumerate(order)}
    for s in range(S):
        for m in range(M):
            if s:
                assert pos[(s - 1, "F", m)] < pos[(s, "F", m)]
            if s < S - 1:
                assert pos[(s + 1, "B", m)] < pos[(s, "B", m)]


@pytest.mark.parametrize("S,M", [(2, 8), (4, 4), (4, 16), (3, 2)])
def test_1f1b_memory_bound(S, M):
    for s, acts in enumerate(make_schedule("1f1b", S, M)):
        assert max_in_flight(acts) == min(S - s, M)
    assert all(max_in_flight(a) == M for a in make_schedule("gpipe", S, M))


def test_check_schedule_catches_deadlock_and_bad_lists():
    bad = [[Action("F", 0), Action("B", 0)], [Action("B", 0), Action("F", 0)]]
    with pytest.raises(ValueError, match="exactly once|deadlock"):
        check_schedule(bad)
    # stage 1 waits for F1 while stage 0 waits for B0 from stage 1
    crossed = [[Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)],
               [Action("F", 1), Action("F", 0), Action("B", 0), Action("B", 1)]]
    with pytest.raises(ValueError, match="deadlock"):
        check_schedule(crossed)
    with pytest.raises(ValueError, match="exactly once"):
        check_schedule([[Action("F", 0)]])


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        make_schedule("zb", 2, 2)
    with pytest.raises(ValueError, match="num_microbatches"):
        make_schedule("1f1b", 2, 0)
    with pytest.raises(ValueError, match="num_stages"):
        make_schedule("gpipe", True, 2)
    with pytest.raises(ValueError, match="kind"):
        Action("X", 0)
