"""What the Triton launchers refuse (shapes a GPU's registers or shared memory cannot hold,
found by bench/compile_check.py) and how meshkern.spectral falls back: the auto backend
to the torch reference, a forced backend with a ValueError that names the limit."""
import pytest
import torch

from meshkern import _backend, spectral

pytestmark = pytest.mark.skipif(_backend.why_unavailable("triton", "spectral", torch.device("cpu")) is not None,
                                reason="Triton cannot run CPU tensors here")


def test_forced_triton_projection_refuses_rank_above_64():
    G = torch.randn(1, 80, 80)
    U, _ = torch.linalg.qr(torch.randn(1, 80, 65))
    S = torch.ones(1, 65)
    with pytest.raises(ValueError, match="rank r <= 64"):
        spectral.project(G, U, S, U, backend="triton")


def test_auto_projection_above_64_on_triton_takes_the_reference(monkeypatch):
    """auto resolves to triton (as on a GPU without the CUDA extension): r = 65 falls back."""
    monkeypatch.setattr(_backend, "resolve", lambda group, device, requested=None: "triton")
    G = torch.randn(1, 80, 80)
    U, _ = torch.linalg.qr(torch.randn(1, 80, 65))
    S = torch.rand(1, 65)
    got = spectral.project(G, U, S, U)
    want, _ = spectral.project_reference(G, U, S, U, 1e-3, 0.3)
    assert torch.equal(got, want)
