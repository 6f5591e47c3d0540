"""orchestration.diagnose.drift: the measures against known answers."""
import pytest
import torch

from orchestration.codecs import PCABasis, make_codec
from orchestration.diagnose import drift


def _case(H=16, k=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(H, H, generator=g, dtype=torch.float64))
    U, W = Q[:, :k].float(), Q[:, k:].float()  # the basis's span and its complement
    mean = torch.randn(H, generator=g)
    basis = PCABasis(mean, U, torch.ones(k), torch.ones(k))
    return g, U, W, mean, basis


def test_activations_in_the_span_and_gradients_outside_it():
    g, U, W, mean, basis = _case()
    h = mean + torch.randn(2, 9, 4, generator=g) @ U.T  # every token in mean + span(U)
    grad = torch.randn(2, 9, 12, generator=g) @ W.T  # every gradient orthogonal to span(U)
    codec = make_codec("pca:quant=absmax", k=4, bits=8, sink=False)
    d = drift.boundary_drift(codec, basis, h, grad, 0)
    assert d["act_kept"] == pytest.approx(1.0, abs=1e-6)
    assert d["grad_outside"] == pytest.approx(1.0, abs=1e-6)
    assert d["bwd_err"] == pytest.approx(1.0, abs=1e-6)  # the codec drops all of it
    assert 0 < d["fwd_err"] < 1e-3 and d["fwd_quant"] == pytest.approx(d["fwd_err"], abs=1e-6)  # int8 only


def test_activations_outside_the_span_are_lost():
    g, U, W, mean, basis = _case(seed=1)
    h = mean + torch.randn(2, 9, 12, generator=g) @ W.T
    d = drift.boundary_drift(make_codec("pca:quant=absmax", k=4), basis, h, torch.randn(2, 9, 4, generator=g) @ U.T, 0)
    assert d["act_kept"] == pytest.approx(0.0, abs=1e-6) and d["grad_outside"] == pytest.approx(0.0, abs=1e-6)
    # position 0 travels as int8 (sink), the rest is gone: the forward error is the lost energy
    assert d["fwd_err"] == pytest.approx(1.0, abs=0.15) and d["fwd_quant"] < 0.15


def test_cli_names_a_directory_that_is_no_run(tmp_path, capsys):
    assert drift.main([str(tmp_path)]) == 2
    assert "has no config.yaml" in capsys.readouterr().err
