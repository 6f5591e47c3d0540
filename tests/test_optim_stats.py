"""SpectralAdamW.anchor_stats() against values computed independently in the test:
mean_gain is the mean of d = s / (s + tau) over every filtered parameter (each with its
group's tau), energy_kept is sum ||G_filt||^2 / sum ||G||^2 over the parameters filtered
in the last step, G_filt = U diag(d) U^T G V diag(d) V^T (plain matmuls here)."""
import torch

from meshkern.optim import SpectralAdamW


def _orthonormal(m, r, g):
    return torch.linalg.qr(torch.randn(m, r, generator=g, dtype=torch.float64)).Q.float()


def test_mean_gain_and_energy_kept_are_exact():
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    shapes = [(12, 8), (10, 6), (9, 5)]
    taus = [1e-2, 1e-2, 0.5]
    params = [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]
    bias = torch.nn.Parameter(torch.zeros(7))  # 1-D: never filtered, never counted
    opt = SpectralAdamW([{"params": params[:2] + [bias], "tau": taus[0]}, {"params": [params[2]], "tau": taus[2]}],
                        lr=1e-3, alpha=0.3, rank=4)
    order = opt.param_order()
    assert order[:2] == params[:2] and order[2] is bias and order[3] is params[2]
    priors = {}
    for p, tau in zip(params, taus):
        m, n = p.shape
        r = 3
        priors[p] = (_orthonormal(m, r, g), torch.tensor([2.0, 0.05, 1e-3]), _orthonormal(n, r, g))
    assert opt.observe_factored_prior([priors[p] if p is not bias else None for p in order], staleness=1)
    grads = {p: torch.randn(p.shape, generator=g) for p in params}
    for p in params:
        p.grad = grads[p].clone()
    bias.grad = torch.randn(7, generator=g)
    opt.step()
    stats = opt.anchor_stats()

    kept = total = 0.0
    gains = []
    for p, tau in zip(params, taus):
        U, S, V = (t.double() for t in priors[p])
        d = S / (S + tau)
        gains += d.tolist()
        G = grads[p].double()
        G_filt = U @ torch.diag(d) @ U.T @ G @ V @ torch.diag(d) @ V.T
        kept += float((G_filt ** 2).sum())
        total += float((G ** 2).sum())
    assert stats["filtered"] == 3
    assert abs(stats["mean_gain"] - sum(gains) / len(gains)) <= 1e-6 * abs(stats["mean_gain"])
    assert abs(stats["energy_kept"] - kept / total) <= 1e-4 * (kept / total)
    # the last parameter alone (the mutation the issue names) is far off: the check can tell
    U, S, V = (t.double() for t in priors[params[2]])
    d = S / (S + taus[2])
    G = grads[params[2]].double()
    last_only = float(((U @ torch.diag(d) @ U.T @ G @ V @ torch.diag(d) @ V.T) ** 2).sum() / (G ** 2).sum())
    assert abs(last_only - kept / total) > 10 * 1e-4 * (kept / total)
