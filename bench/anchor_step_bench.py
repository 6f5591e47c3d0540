"""The fast node's optimizer cost with the factored anchor transport (issue #15 item 1).

    python -m bench.anchor_step_bench                  # default model + SmolLM2-135M-like layers
    python -m bench.anchor_step_bench --layers 30      # all 30 SmolLM2-135M-like layers
    python -m bench.anchor_step_bench --quick          # a smoke run
    python -m bench.anchor_step_bench --only svd       # the anchor node's SVD: randomized vs krylov

What a fast node's optimizer does per step with the AP presets: SpectralAdamW.step with a
factored prior present, and every ``--every`` steps (the presets' snapshot cadence, 5) a
factored arrival first (``observe_factored_prior``: its checks, then the factors are
copied in; the fast node runs no SVD). The cost is the time of a whole window of
``--window`` steps (20) that includes those arrivals, divided by the window. The floor it
is measured against: ``torch.optim.AdamW.step`` plus, per filtered matrix, the two m*n*r
GEMMs the projection cannot avoid (G V and W V^T, as ``bench.spectral_bench --only
proj``'s "limit"), timed as one unit on the same parameter shapes. Goal: <= 1.1x.

Also printed, in the same run: AdamW alone, SpectralAdamW without a prior (must be ~1x
AdamW), the factored window without arrivals, the same window with the checks split as in
the trainer (the FastHook's orchestration.anchor.bounds.check_entries, then
observe_factored_prior(bounds_checked=True)), and the dense-transport window (the fast node folds
a gradient into M_anc and refreshes the SVD at the next step: what the factored transport
removes from the fast node).

Timing as bench/spectral_bench.py: process CPU time (--clock cpu, default; robust on a
shared machine) with torch.set_num_threads(1); each contender's windows run round-robin
(one window of every contender per round) and the median over --repeats rounds is
reported; the load average is printed at the start and the end. Shapes: rank-16 factors
(the trainer's --train.spectral-rank default) of fp32 matrices; norms / biases get plain
AdamW in both optimizers. Parameter sets:
  default   the default model of orchestration.models.loading (hidden 192, ffn 512, 6 heads, 4 layers)
  smollm2   SmolLM2-135M-like layers (hidden 576, ffn 1536, 9 / 3 heads: q, o [576, 576],
            k, v [192, 576], gate, up [1536, 576], down [576, 1536], two norms), --layers of them
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from meshkern.optim import AnchorMomentum, SpectralAdamW

CLOCK = "cpu"


def layer_shapes(hidden: int, ffn: int, heads: int, kv_heads: int, layers: int) -> list[tuple[int, ...]]:
    hd = hidden // heads
    per = [(hidden, hidden), (kv_heads * hd, hidden), (kv_heads * hd, hidden), (hidden, hidden),
           (ffn, hidden), (ffn, hidden), (hidden, ffn), (hidden,), (hidden,)]
    return per * layers


def param_sets(layers: int, quick: bool) -> dict[str, list[tuple[int, ...]]]:
    if quick:
        return {"quick": layer_shapes(64, 128, 4, 4, 2)}
    return {"default": layer_shapes(192, 512, 6, 6, 4),
            f"smollm2 x{layers}": layer_shapes(576, 1536, 9, 3, layers)}


def _clock():
    return time.process_time() if CLOCK == "cpu" else time.perf_counter()


class Case:
    """Parameters, their (fixed) fast gradients and the anchor's factors for one shape set."""

    def __init__(self, shapes, rank: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.shapes, self.rank = shapes, rank
        self.base = [torch.randn(s, generator=g) * 0.02 for s in shapes]
        self.grads = [torch.randn(s, generator=g) * 1e-3 for s in shapes]
        # Anchor gradients of a realistic kind: a few strong directions plus noise, so the
        # factors have a decaying spectrum. Two rounds, so successive arrivals differ.
        self.anchor = []
        for _ in range(2):
            row = []
            for s in shapes:
                if len(s) != 2:
                    row.append(None)
                    continue
                m, n = s
                k = min(8, m, n)
                low = torch.randn(m, k, generator=g) @ (torch.randn(k, n, generator=g) / torch.arange(1, k + 1)[:, None])
                row.append((low + 0.1 * torch.randn(m, n, generator=g)) * 1e-3)
            self.anchor.append(row)
        # What the anchor node computes and sends (its SVD, off the fast node): factors of
        # its momentum after each round.
        mom = AnchorMomentum(shapes, 0.9, rank)
        self.factors = []
        for row in self.anchor:
            mom.update(row)
            self.factors.append([None if f is None else tuple(t.clone() for t in f) for f in mom.factors()])
        self.matrices = [i for i, s in enumerate(shapes) if len(s) == 2]
        self.nparams = sum(b.numel() for b in self.base)

    def params(self):
        ps = [torch.nn.Parameter(b.clone()) for b in self.base]
        for p, gr in zip(ps, self.grads):
            p.grad = gr.clone()
        return ps


def window_fn(case: Case, kind: str, window: int, every: int):
    """A function that runs one window of ``window`` steps of contender ``kind``."""
    ps = case.params()
    if kind == "floor":
        opt = torch.optim.AdamW(ps, lr=1e-4, foreach=False)
        Vs = [case.factors[0][i][2] for i in case.matrices]
        Ws = [torch.randn(case.shapes[i][0], V.shape[1]) for i, V in zip(case.matrices, Vs)]
        Gs = [ps[i].grad for i in case.matrices]
        Ys = [torch.empty(G.shape[0], V.shape[1]) for G, V in zip(Gs, Vs)]
        Os = [torch.empty_like(G) for G in Gs]  # kept, as SpectralAdamW keeps its G_proj buffers

        def step(_k):
            opt.step()
            for G, V, W, Y, O in zip(Gs, Vs, Ws, Ys, Os):
                torch.mm(G, V, out=Y)
                torch.mm(W, V.mT, out=O)
    elif kind == "adamw":
        opt = torch.optim.AdamW(ps, lr=1e-4, foreach=False)

        def step(_k):
            opt.step()
    else:
        opt = SpectralAdamW(ps, lr=1e-4, foreach=False, rank=case.rank)
        if kind != "no prior":
            opt.observe_factored_prior(case.factors[0], 5)
            opt.step()  # first-touch of the G_proj buffers outside the timing
        hook_check = None
        if kind == "factored + hook checks":
            from orchestration.anchor.bounds import check_entries
            from orchestration.anchor.wire import Layout

            named = [(f"w{i}", ps[i]) for i in case.matrices]
            layout = Layout.build(named, "factored", case.rank, torch.float32)
            eligible = [p for _, p in named]

            def hook_check(facs):
                check_entries(layout, [facs[i] for i in case.matrices], eligible, opt.max_anchor_ratio)
        if kind == "dense":
            opt.observe_anchor(case.anchor[0], 5)
            opt.step()  # the first refresh, outside the timing

        def step(k):
            if k % every == 0:
                r = (k // every) % 2
                if kind == "factored":
                    assert opt.observe_factored_prior(case.factors[r], 5)
                elif kind == "factored + hook checks":  # as the trainer's FastHook: its checks, then the optimizer's rest
                    hook_check(case.factors[r])
                    assert opt.observe_factored_prior(case.factors[r], 5, bounds_checked=True)
                elif kind == "dense":
                    assert opt.observe_anchor(case.anchor[r], 5)
            opt.step()

    def run():
        for k in range(window):
            step(k)
    return run, opt


CONTENDERS = ("floor", "adamw", "no prior", "factored, no arrival", "factored", "factored + hook checks", "dense")
LABELS = {
    "floor": "floor: AdamW.step + the two m*n*r GEMMs per matrix",
    "adamw": "torch.optim.AdamW(foreach=False).step",
    "no prior": "SpectralAdamW.step, no prior",
    "factored, no arrival": "SpectralAdamW, factored prior, no arrival",
    "factored": "SpectralAdamW, factored arrival every 5 (the goal)",
    "factored + hook checks": "  same, checks split as in the trainer (hook + optimizer)",
    "dense": "SpectralAdamW, dense arrival every 5 (SVD on the node)",
}


def bench(name: str, shapes, rank: int, window: int, every: int, repeats: int) -> dict:
    case = Case(shapes, rank)
    fns = {}
    for kind in CONTENDERS:
        fn, _ = window_fn(case, "factored" if kind == "factored, no arrival" else kind, window,
                          every if kind != "factored, no arrival" else window + 1)
        fns[kind] = fn
    for fn in fns.values():  # warmup
        fn()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = _clock()
            fn()
            times[k].append((_clock() - t0) / window)
    med = {k: statistics.median(v) for k, v in times.items()}
    floor = med["floor"]
    nmat = len(case.matrices)
    print(f"\n## {name}: {len(shapes)} tensors ({nmat} matrices), {case.nparams / 1e6:.2f}M params fp32, rank {rank}, "
          f"window {window} steps, arrival every {every}")
    print(f"{'contender':<58}{'ms/step':>10}{'vs floor':>10}{'vs AdamW':>10}")
    for k in CONTENDERS:
        print(f"{LABELS[k]:<58}{1e3 * med[k]:>10.3f}{med[k] / floor:>9.2f}x{med[k] / med['adamw']:>9.2f}x")
    r = med["factored"] / floor
    print(f"goal: factored window <= 1.1x the floor: {r:.2f}x {'PASS' if r <= 1.1 else 'FAIL'}")
    return med


# ------------------------------------------------------------------ the anchor node's SVD
def real_momentum(steps: int = 10, beta: float = 0.9, seq: int = 128, batch: int = 4):
    """M_anc of the default base model (orchestration.models.loading, built on first use) after
    ``steps`` anchor gradients on corpus:python (domain B), beta_anc 0.9: per matrix
    of the layers (name, [m, n] fp32). None when the base model is not available."""
    try:
        from transformers import AutoTokenizer

        from orchestration.models.paths import default_base_model
        from orchestration.models.loading import load_causal_lm
        from orchestration.data.texts import load_texts

        path = default_base_model()
        model = load_causal_lm(path)[0]
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # no cached model and no way to build one here
        print(f"(no default base model: {type(e).__name__}: {e})")
        return None
    ids = tok("\n".join(load_texts("corpus:python")[:200]), return_tensors="pt")["input_ids"][0]
    need = steps * batch * seq
    ids = ids[:need].view(steps, batch, seq)
    mats = {n: p for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n and "lm_head" not in n}
    mom = {n: torch.zeros(p.shape) for n, p in mats.items()}
    for k in range(steps):
        model.zero_grad(set_to_none=True)
        model(input_ids=ids[k], labels=ids[k]).loss.backward()
        for n, p in mats.items():
            mom[n].mul_(beta).add_(p.grad, alpha=1 - beta)
    return mom


def random_init_momentum(steps: int = 10, beta: float = 0.9):
    """M_anc of a randomly initialized model of the default geometry after ``steps``
    gradients on 4 x 64 random tokens (tests/test_optim.py's momentum)."""
    from transformers import LlamaForCausalLM

    from orchestration.models.loading import default_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(default_config())
    g = torch.Generator().manual_seed(0)
    mats = {n: p for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n and "lm_head" not in n}
    mom = {n: torch.zeros(p.shape) for n, p in mats.items()}
    for _ in range(steps):
        ids = torch.randint(0, 2048, (4, 64), generator=g)
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        for n, p in mats.items():
            mom[n].mul_(beta).add_(p.grad, alpha=1 - beta)
    return mom


def synthetic_momentum(shapes, steps: int = 10, beta: float = 0.9, seed: int = 0):
    """An EMA (beta 0.9) of ``steps`` gradients that share a slowly drifting low-rank part
    (rank 32, singular values ~ 1/(1+i)) plus fresh noise each step (as fine-tuning
    gradients do: method.md's "slowly drifting low-dimensional subspace")."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for j, (m, n) in enumerate(shapes):
        A = torch.linalg.qr(torch.randn(m, 32, generator=g)).Q
        B = torch.linalg.qr(torch.randn(n, 32, generator=g)).Q
        s = 1.0 / (1.0 + torch.arange(32.0))
        M = torch.zeros(m, n)
        for _ in range(steps):
            A = torch.linalg.qr(A + 0.05 * torch.randn(m, 32, generator=g) / m ** 0.5).Q
            G = (A * s) @ B.mT + 0.02 * torch.randn(m, n, generator=g) / (m * n) ** 0.25
            M.mul_(beta).add_(G, alpha=1 - beta)
        out[f"m{j} [{m},{n}]"] = M
    return out


def bench_anchor_svd(momenta: dict, rank: int, repeats: int) -> None:
    """AnchorMomentum's SVD of one momentum (every matrix, batched by shape as factors()
    does): method "randomized" (o=16, q=3) vs "krylov" (the meshkern.spectral default),
    process CPU time (median of ``repeats``) and the max relative error of the top-``rank``
    singular values against torch.linalg.svd."""
    from meshkern import spectral as sp

    by_shape: dict[tuple, list] = {}
    for M in momenta.values():
        by_shape.setdefault(tuple(M.shape), []).append(M)
    print(f"\n## the anchor node's SVD of M_anc, rank {rank}: {len(momenta)} matrices in {len(by_shape)} shapes")
    print(f"{'shape':<16}{'batch':>6}{'randomized ms':>15}{'err':>10}{'krylov ms':>12}{'err':>10}{'speedup':>9}")
    for shape, ms in by_shape.items():
        Mb = torch.stack(ms)
        exact = torch.linalg.svdvals(Mb.double())[:, :rank]
        row = {}
        for method in ("randomized", "krylov"):
            def run(method=method):
                return sp.randomized_svd(Mb, rank, method=method, seed=0)
            run()
            ts = []
            for _ in range(repeats):
                t0 = _clock()
                S = run()[1]
                ts.append(_clock() - t0)
            err = float(((S.double() - exact).abs() / exact.clamp_min(1e-30)).max())
            row[method] = (statistics.median(ts), err)
        (tr, er), (tk, ek) = row["randomized"], row["krylov"]
        print(f"{str(list(shape)):<16}{len(ms):>6}{1e3 * tr:>15.2f}{er:>10.1e}{1e3 * tk:>12.2f}{ek:>10.1e}{tr / tk:>8.2f}x")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8, help="SmolLM2-135M-like layers (the model has 30)")
    ap.add_argument("--rank", type=int, default=16, help="factor rank (the trainer's --train.spectral-rank default)")
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--every", type=int, default=5, help="steps between arrivals (the presets' snapshot cadence)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    ap.add_argument("--quick", action="store_true", help="small shapes, 2 repeats (smoke run)")
    ap.add_argument("--only", choices=["step", "svd"], action="append",
                    help="step: the optimizer windows; svd: the anchor node's SVD, randomized vs krylov")
    args = ap.parse_args(argv)
    global CLOCK
    CLOCK = args.clock
    torch.set_num_threads(args.threads)
    repeats = 2 if args.quick else args.repeats
    print(f"# anchor step bench: torch {torch.__version__}, threads={torch.get_num_threads()}, clock={args.clock}, "
          f"repeats={repeats} (medians, round-robin), OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
          f"load avg {os.getloadavg()[0]:.1f}")
    which = set(args.only or ["step", "svd"])
    out = {}
    if "step" in which:
        for name, shapes in param_sets(args.layers, args.quick).items():
            out[name] = bench(name, shapes, args.rank, args.window, args.every, repeats)
    if "svd" in which:
        real = None if args.quick else real_momentum()
        if real is not None:
            print("\nM_anc of the default base model: 10 anchor gradients on corpus:python (4 x 128 tokens each)")
            bench_anchor_svd(real, args.rank, repeats)
        if not args.quick:
            print("\nM_anc of a randomly initialized model of the default geometry: 10 gradients on random tokens")
            bench_anchor_svd(random_init_momentum(), args.rank, repeats)
        shapes = [(64, 128), (128, 64)] if args.quick else [(576, 576), (192, 576), (1536, 576), (576, 1536)] * 2
        print("\nsynthetic M_anc (drifting rank-32 signal + noise, 10 EMA steps) on SmolLM2-135M-like shapes, 2 layers")
        bench_anchor_svd(synthetic_momentum(shapes), args.rank, repeats)
    print(f"# load avg at the end {os.getloadavg()[0]:.1f}")
    return out


if __name__ == "__main__":
    main()
