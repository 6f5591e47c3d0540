"""Smoke test of bench/anchor_step_bench.py (issue #15 item 1): the --quick run measures
every contender and the anchor SVD table runs; no timing is asserted (the numbers are the
bench's output, docs/benchmarks.md)."""
import pytest
import torch

from bench import anchor_step_bench as asb


@pytest.mark.slow
def test_quick_run_measures_every_contender():
    threads = torch.get_num_threads()
    try:
        out = asb.main(["--quick", "--window", "5", "--every", "5", "--repeats", "1"])
    finally:
        torch.set_num_threads(threads)
    (med,) = out.values()
    assert set(med) == set(asb.CONTENDERS) and all(t > 0 for t in med.values())


def test_factored_window_keeps_the_prior_and_the_callers_gradients():
    case = asb.Case(asb.layer_shapes(64, 128, 4, 4, 1), 8)
    run, opt = asb.window_fn(case, "factored + hook checks", 5, 5)
    run()
    st = opt.anchor_stats()
    assert st["factored_arrivals"] == 2 and st["rejected"] == 0 and st["filtered"] == len(case.matrices)
    assert 0 < st["energy_kept"] < 1
