"""What an anchor sends comes from another machine: SpectralAdamW rejects (returns False,
one warning, counted) anchor gradients and factored priors that are out of bounds or
malformed, and a rejected arrival changes nothing: the next step is exactly AdamW's."""
import pytest
import torch

from meshkern.optim import FACTOR_ORTHO_TOL, SpectralAdamW


def _setup(seed=0):
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(16, 12, generator=g) * 0.1)
    b = torch.nn.Parameter(torch.zeros(16))
    x = torch.randn(32, 12, generator=g)
    return w, b, x


def _grads(w, b, x):
    for p in (w, b):
        p.grad = None
    ((x @ w.T + b).tanh().square().mean()).backward()


def _adamw_reference(seed=0):
    w, b, x = _setup(seed)
    opt = torch.optim.AdamW([w, b], lr=1e-2)
    _grads(w, b, x)
    opt.step()
    return w.detach().clone()


def _orthonormal(m, r, seed):
    return torch.linalg.qr(torch.randn(m, r, generator=torch.Generator().manual_seed(seed))).Q


def _bad_inputs():
    U, V, S = _orthonormal(16, 4, 1), _orthonormal(12, 4, 2), torch.tensor([1.0, 0.5, 0.1, 0.01])
    return {
        "gradient 1e20": ("dense", [torch.full((16, 12), 1e20), None]),
        "gradient 3e38": ("dense", [torch.full((16, 12), 3e38), None]),
        "factors scaled by 1e19": ("factored", [(U * 1e19, S, V * 1e19), None]),
        "U not orthonormal": ("factored", [(torch.randn(16, 4), S, V), None]),
        "S huge": ("factored", [(U, S * 1e10, V), None]),
    }


@pytest.mark.parametrize("case", list(_bad_inputs()))
def test_bad_anchor_input_is_rejected_and_changes_no_weight(case):
    kind, payload = _bad_inputs()[case]
    w, b, x = _setup()
    opt = SpectralAdamW([w, b], lr=1e-2, rank=4)
    _grads(w, b, x)
    with pytest.warns(RuntimeWarning, match="rejected"):
        ok = opt.observe_anchor_update(payload, staleness=1, factored=kind == "factored")
    assert ok is False and opt.anchor_stats()["rejected"] == 1 and opt.anchor_stats()["filtered"] == 0
    opt.step()  # never raises; exactly AdamW's step (no prior was taken)
    assert torch.equal(w.detach(), _adamw_reference())


def test_real_anchor_inputs_are_well_inside_the_bounds():
    """The gradient of the same model on another batch, and the SVD factors of it, pass."""
    w, b, x = _setup()
    w2, b2, x2 = _setup(seed=1)
    with torch.no_grad():
        w2.copy_(w)
    _grads(w2, b2, x2)
    opt = SpectralAdamW([w, b], lr=1e-2, rank=4)
    assert opt.observe_anchor([w2.grad.clone(), None], staleness=2)
    U, S, V = torch.linalg.svd(w2.grad, full_matrices=False)
    opt2 = SpectralAdamW([w, b], lr=1e-2, rank=4)
    assert opt2.observe_factored_prior([(U[:, :4], S[:4], V.T[:, :4]), None], staleness=2)
    _grads(w, b, x)
    opt.step()
    assert torch.isfinite(w).all() and opt.anchor_stats()["rejected"] == 0


def test_zero_columns_of_a_rank_deficient_prior_are_accepted():
    """randomized_svd gives zero columns for s ~ 0: a prior with them is valid."""
    w, b, x = _setup()
    U, V = _orthonormal(16, 4, 1), _orthonormal(12, 4, 2)
    U[:, 3], V[:, 3] = 0.0, 0.0
    opt = SpectralAdamW([w, b], lr=1e-2, rank=4)
    assert opt.observe_factored_prior([(U, torch.tensor([1.0, 0.5, 0.1, 0.0]), V), None], staleness=1)


def test_bf16_rounded_factors_are_still_orthonormal_enough():
    U, V = _orthonormal(64, 8, 3), _orthonormal(48, 8, 4)
    for Q in (U, V):
        Qb = Q.bfloat16().float()
        assert float((Qb.T @ Qb - torch.eye(8)).abs().max()) < FACTOR_ORTHO_TOL / 2


def test_max_anchor_ratio_is_checked():
    w, b, _ = _setup()
    for bad in (0, -1.0, float("inf"), "big"):
        with pytest.raises(ValueError, match="max_anchor_ratio"):
            SpectralAdamW([w, b], max_anchor_ratio=bad)


def _scaled(p_norm, g_norm):
    """w with ||w||_F = p_norm and a gradient of norm g_norm (b without a gradient)."""
    w, b, _ = _setup()
    with torch.no_grad():
        w.mul_(p_norm / w.norm())
    g = torch.randn(16, 12, generator=torch.Generator().manual_seed(5))
    w.grad = g * (g_norm / g.norm())
    return w, b


# bound = max_anchor_ratio (1e3) x max(1, ||p||, ||p.grad||): a norm <= 1e3 passes without
# reading p (the scale is at least 1); above, the largest of the terms decides.
@pytest.mark.parametrize("p_norm,g_norm,s_norm,ok", [
    (0.5, 0.1, 9e2, True), (0.5, 0.1, 2e3, False),     # scale 1
    (1e3, 0.1, 9e5, True), (1e3, 0.1, 2e6, False),     # scale ||p||
    (0.5, 50.0, 4e4, True), (0.5, 50.0, 6e4, False),   # scale ||p.grad||
])
def test_magnitude_bound_takes_the_largest_scale_term(p_norm, g_norm, s_norm, ok):
    from orchestration.anchor.bounds import check_entries
    from orchestration.anchor.wire import Layout, Rejected

    w, b = _scaled(p_norm, g_norm)
    U, V = _orthonormal(16, 4, 1), _orthonormal(12, 4, 2)
    S = torch.tensor([1.0, 0.0, 0.0, 0.0]) * s_norm
    opt = SpectralAdamW([w, b], lr=1e-2, rank=4)
    layout = Layout.build([("w", w)], "factored", 4, torch.float32)
    if ok:
        assert opt.observe_factored_prior([(U, S, V), None], staleness=1)
        check_entries(layout, [(U, S, V)], [w], opt.max_anchor_ratio)
    else:
        with pytest.warns(RuntimeWarning, match="max_anchor_ratio"):
            assert not opt.observe_factored_prior([(U, S, V), None], staleness=1)
        with pytest.raises(Rejected, match="norm"):
            check_entries(layout, [(U, S, V)], [w], opt.max_anchor_ratio)
