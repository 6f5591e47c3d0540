"""The divergence guard (issue #14 item 4): a run whose loss blows up stops with a named
error and a non-zero exit code, never publishes non-finite weights, and leaves the last
good checkpoint as ``latest``, loadable and finite."""
import math
import os
import re

import pytest

from orchestration.components import checkpoint_read as ckpt_read
import torch

from orchestration.components import checkpoint as ckpt
from orchestration.components.metrics import read_jsonl
from orchestration.train import DIVERGED, main
from orchestration.components.divergence import DivergenceGuard

from test_train import _args


def _finite_checkpoint(path):
    from orchestration.models.loading import load_causal_lm

    ckpt.verify(path)
    model, _ = load_causal_lm(path)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    for r in range(2):
        st = ckpt.load_rank_state(path, r)["stage"]
        assert all(torch.isfinite(v).all() for v in st.values())


@pytest.mark.slow
def test_lr_1e3_stops_with_divergence_error_and_keeps_the_last_good_checkpoint(tiny, tmp_path, capfd):
    base = _args(tiny, tmp_path, "--mesh.rows", "1", "--mesh.stages", "2", "--checkpoint.every", "1",
                 "--checkpoint.keep", "2")
    assert main([*base, "--train.steps", "2"]) == 0  # a healthy start: step_1, step_2
    capfd.readouterr()
    rc = main([*base, "--train.steps", "40", "--train.lr", "1e3", "--checkpoint.resume", "latest"])
    out, err = capfd.readouterr()
    assert rc == DIVERGED != 0, err
    m = re.search(r"error: DivergenceError: the run diverged: 5 consecutive bad steps \((\d+)\.\.(\d+), "
                  r"--train.max-bad-steps 5\)", err)
    assert m, err
    first_bad, last = int(m.group(1)), int(m.group(2))
    assert last == first_bad + 4 and last < 40
    assert "skipped / bad steps" in out and "diverged" in out  # the summary says so
    root = str(tmp_path / "t" / "checkpoints")
    latest = ckpt.resolve("latest", root)
    assert ckpt.read_meta(latest)["step"] <= first_bad - 2  # predates the weights that produced the bad loss
    assert f"the last good checkpoint is {latest}" in err
    # Every checkpoint left is complete and finite: nothing of the bad stretch was published.
    for d in ckpt_read._step_dirs(root):
        assert ckpt.read_meta(d)["step"] < first_bad
        _finite_checkpoint(d)
    recs = read_jsonl(str(tmp_path / "t" / "metrics.jsonl"))
    assert [r["step"] for r in recs] == list(range(1, last + 1))


def test_guard_rules():
    g = DivergenceGuard(max_bad=3, spike_factor=3.0)
    rec = lambda step, loss, skipped=0: {"step": step, "loss": loss, "skipped_steps": skipped}  # noqa: E731
    assert g.observe(rec(1, 2.0)) == "" and g.observe(rec(2, 1.8)) == ""
    assert "above 3 x the running median" in g.observe(rec(3, 9.0))
    assert g.observe(rec(4, 1.7)) == "" and g.streak == 0  # one spike is not a divergence
    assert "non-finite loss" in g.observe(rec(5, math.nan))
    assert "non-finite gradient in 2 replica(s)" in g.observe(rec(6, 1.9, skipped=2))
    assert not g.tripped
    assert g.observe(rec(7, math.inf, skipped=2)) and g.tripped and g.first_bad == 5 and g.bad_total == 4
    off = DivergenceGuard(max_bad=0, spike_factor=0)
    for s in range(1, 20):
        off.observe(rec(s, math.nan))
    assert not off.tripped
    g2 = DivergenceGuard(max_bad=3, spike_factor=3.0)
    g2.load_state_dict(g.state_dict())
    assert (list(g2.good), g2.streak, g2.first_bad, g2.skipped_seen) == (list(g.good), 3, 5, 2)


def test_a_zero_gradient_with_a_finite_loss_is_a_bad_step():
    # After a blow-up the hidden state's square overflows in RMSNorm: uniform logits (a loss
    # no spike rule can see) and a gradient of exactly zero. Any non-zero norm is good.
    g = DivergenceGuard(max_bad=2, spike_factor=3.0)
    rec = lambda step, loss, gn: {"step": step, "loss": loss, "skipped_steps": 0, "grad_norm": gn}  # noqa: E731
    assert g.observe(rec(1, 5.7, 1.3)) == "" and g.observe(rec(2, 5.6, 1e-30)) == ""
    assert "zero gradient norm" in g.observe(rec(3, 5.7038, 0.0)) and not g.tripped
    assert "zero gradient norm" in g.observe(rec(4, 5.7038, 0.0)) and g.tripped and g.first_bad == 3
    assert list(g.good) == [5.7, 5.6]  # the dead model's loss never enters the median
