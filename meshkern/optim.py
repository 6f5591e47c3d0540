"""Anchor-prior optimizers: SpectralAdamW (fast nodes) and AnchorMomentum (anchor node).

Method (arXiv 2609.14339, sections 2-3): per 2-D weight, an anchor momentum
M_anc <- beta_anc * M_anc + (1 - beta_anc) * G_anc (zero-initialised, no bias correction)
is updated whenever a delayed anchor gradient arrives. Its top-r SVD U S V^T filters
the fast node's own gradient G before AdamW sees it:

    G_proj = alpha * G + (1 - alpha) * U diag(d) (U^T G V) diag(d) V^T,  d = s / (s + tau)

(meshkern.spectral.project). The SVD is refreshed lazily, at the first step after an
arrival, batched over all parameters of one shape (meshkern.spectral.randomized_svd).

Which parameters are filtered: 2-D tensors in param groups whose ``"spectral"`` entry
is true (default true). 1-D parameters (norms, biases) always get plain AdamW. For
embeddings / lm_head, build the groups with ``spectral_param_groups(model,
filter_embeddings=...)``; the default leaves them unfiltered (plain AdamW): their
anchor rows only cover the tokens of the anchor's batches (row-sparse, unrelated to the
fast node's tokens), and filtering one is expensive and did not help in a proxy run
(docs/benchmarks.md, "filtering embeddings").
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from meshkern import spectral
from meshkern._checks import as_float as _as_float, as_int as _as_int
from meshkern.linalg import orthonormality_error

Factors = tuple[Tensor, Tensor, Tensor]
# A factored prior's U and V must be orthonormal to this tolerance (max |Q^T Q - I|): fp32
# SVD factors are within ~1e-6, bf16-rounded ones within ~1e-2; a scaled or garbage
# factor is far outside.
FACTOR_ORTHO_TOL = 0.05


def _check_prob(name: str, val: float, hi_open: bool = False) -> float:
    v = _as_float(val)  # numpy scalars are plain numbers; bools and tensors are not
    if v is None or not (0.0 <= v and (v < 1.0 if hi_open else v <= 1.0)):
        raise ValueError(f"{name} must lie in [0, 1{')' if hi_open else ']'}, got {val!r}")
    return v


def _check_staleness(staleness) -> int:
    v = _as_int(staleness)
    if v is None or v < 0:
        raise ValueError(f"staleness must be an int >= 0 (fast steps since the anchor's snapshot), got {staleness!r}")
    return v


def _check_svd_kwargs(rank, oversample, power_iters, seed, ortho, svd_method, backend, devices) -> dict:
    """The SVD options of AnchorMomentum / SpectralAdamW, checked at construction (not at
    the first refresh, possibly hours later): ValueError / TypeError naming the argument."""
    if svd_method not in spectral.METHODS:
        raise ValueError(f"svd_method must be one of {spectral.METHODS}, got {svd_method!r}")
    rank, oversample, power_iters, seed = spectral._check_svd_options(rank, oversample, power_iters, seed, ortho,
                                                                     svd_method)
    backend = spectral._check_backend(backend, devices)
    return dict(rank=rank, oversample=oversample, power_iters=power_iters, seed=seed, ortho=ortho,
                method=svd_method, backend=backend)


class AnchorMomentum:
    """EMA of anchor gradients per 2-D matrix, with cached batched truncated-SVD factors.

    Used on the anchor node (``factors()`` is the factored transport: r*(m+n+1) numbers
    per matrix instead of m*n) and inside SpectralAdamW. Entries are aligned with
    ``params_or_shapes`` (tensors or shapes); only 2-D entries with ``enabled`` true keep
    a momentum, the others ignore what they receive. Deterministic: the SVD seed is
    ``seed + refresh counter``, stored in the state dict.

    Every argument is checked here (ValueError / TypeError naming it): beta_anc in
    [0, 1), rank >= 1, oversample >= 0, power_iters >= 0, seed an int64, ortho "qr" /
    "cholqr2", svd_method "randomized" (default) / "krylov" / "exact"
    (meshkern.spectral.randomized_svd's methods; oversample and power_iters are
    "randomized"'s), backend "auto" (or None) or a backend name that can run on the
    parameters' devices.

    Why not "krylov" (meshkern.spectral's default) here: at the trainer's rank 16 its
    defaults (7 blocks of 8 columns) were less accurate on an anchor momentum of the
    default model's geometry (worst top-16 error over 28 matrices 3.3e-2 vs 1.2e-2) though
    more accurate on the pretrained base model's (5.9e-7 vs 7.3e-3), and faster only on
    larger matrices; docs/benchmarks.md, "the anchor node's SVD".
    """

    # Appended to rejection warnings (SpectralAdamW says how its lists are ordered).
    _order_hint = ""

    def __init__(self, params_or_shapes: Iterable, beta_anc: float = 0.9, rank: int = 32, *,
                 oversample: int = 16, power_iters: int = 3, ortho: str = "qr", svd_method: str = "randomized",
                 seed: int = 0, backend: str = "auto", enabled: Sequence[bool] | None = None):
        beta_anc = _check_prob("beta_anc", beta_anc, hi_open=True)
        self.shapes: list[tuple[int, ...]] = []
        self.devices: list[torch.device] = []
        for x in params_or_shapes:
            if isinstance(x, Tensor):
                self.shapes.append(tuple(x.shape))
                self.devices.append(x.device)
            else:
                self.shapes.append(tuple(int(d) for d in x))
                self.devices.append(torch.device("cpu"))
        n = len(self.shapes)
        enabled = [True] * n if enabled is None else list(enabled)
        if len(enabled) != n:
            raise ValueError(f"enabled has {len(enabled)} entries for {n} parameters")
        self.enabled = [bool(e) and len(s) == 2 for e, s in zip(enabled, self.shapes)]
        kw = _check_svd_kwargs(rank, oversample, power_iters, seed, ortho, svd_method, backend, self.devices)
        self.beta_anc, self.rank, self.seed = beta_anc, kw.pop("rank"), kw.pop("seed")
        self.svd_kw = kw
        self.m: list[Tensor | None] = [None] * n
        self._factors: list[Factors | None] = [None] * n
        self._stale: set[int] = set()
        self.updates = 0
        self.rejected = 0
        self.refreshes = 0

    def __len__(self) -> int:
        return len(self.shapes)

    def validate(self, grads: Sequence[Tensor | None]) -> list[str]:
        """Problems that make ``grads`` unusable (empty list: usable)."""
        if not isinstance(grads, (list, tuple)):
            return [f"anchor gradients must be a list aligned with the parameters, got {type(grads).__name__}"]
        if len(grads) != len(self.shapes):
            return [f"got {len(grads)} anchor gradients for {len(self.shapes)} parameters"]
        problems = []
        for i, g in enumerate(grads):
            if g is None or not self.enabled[i]:
                continue
            if not isinstance(g, Tensor) or not g.is_floating_point():
                problems.append(f"entry {i}: not a floating-point tensor")
            elif tuple(g.shape) != self.shapes[i]:
                problems.append(f"entry {i}: shape {tuple(g.shape)} != parameter shape {self.shapes[i]}")
            elif not bool(torch.isfinite(g).all()):
                problems.append(f"entry {i}: non-finite values")
        return problems

    def update(self, grads: Sequence[Tensor | None]) -> bool:
        """Fold one anchor gradient per entry (None: none) into M_anc; all or nothing.

        Non-finite or wrong-shape input is rejected: one warning, ``rejected`` += 1, no
        momentum changes, returns False.
        """
        problems = self.validate(grads)
        if problems:
            warnings.warn("meshkern: rejected anchor gradients (" + "; ".join(problems[:4])
                          + (f"; +{len(problems) - 4} more" if len(problems) > 4 else "") + "); kept old M_anc"
                          + self._order_hint,
                          RuntimeWarning, stacklevel=3)
            self.rejected += 1
            return False
        b = self.beta_anc
        for i, g in enumerate(grads):
            if g is None or not self.enabled[i]:
                continue
            g32 = g.detach().to(device=self.devices[i], dtype=torch.float32)
            if self.m[i] is None:
                self.m[i] = torch.zeros(self.shapes[i], dtype=torch.float32, device=self.devices[i])
            self.m[i].mul_(b).add_(g32, alpha=1 - b)
            self._stale.add(i)
        self.updates += 1
        return True

    def factors(self) -> list[Factors | None]:
        """(U[m,r], S[r], V[n,r]) per entry with a momentum (None otherwise), refreshed lazily:
        every stale entry's SVD is recomputed, batched over entries of one shape and device."""
        if self._stale:
            buckets: dict[tuple, list[int]] = {}
            for i in sorted(self._stale):
                buckets.setdefault((self.shapes[i], str(self.devices[i])), []).append(i)
            for idx in buckets.values():
                M = torch.stack([self.m[i] for i in idx])
                U, S, V = spectral.randomized_svd(M, self.rank, seed=self.seed + self.refreshes, **self.svd_kw)
                for j, i in enumerate(idx):
                    self._factors[i] = (U[j], S[j], V[j])
            self.refreshes += 1
            self._stale.clear()
        return list(self._factors)

    def state_dict(self) -> dict:
        return {"m": {i: t for i, t in enumerate(self.m) if t is not None},
                "factors": {i: list(f) for i, f in enumerate(self._factors) if f is not None},
                "stale": sorted(self._stale), "updates": self.updates, "rejected": self.rejected,
                "refreshes": self.refreshes, "seed": self.seed, "beta_anc": self.beta_anc, "rank": self.rank}

    def load_state_dict(self, sd: dict) -> None:
        n = len(self.shapes)
        self.m = [None] * n
        self._factors = [None] * n
        for i, t in sd["m"].items():
            i = int(i)
            if tuple(t.shape) != self.shapes[i]:
                raise ValueError(f"state entry {i}: momentum shape {tuple(t.shape)} != {self.shapes[i]}")
            self.m[i] = t.detach().to(self.devices[i], torch.float32).clone()
        for i, f in sd["factors"].items():
            i = int(i)
            self._factors[i] = tuple(x.detach().to(self.devices[i]).clone() for x in f)
        self._stale = {int(i) for i in sd["stale"]}
        self.updates, self.rejected, self.refreshes = int(sd["updates"]), int(sd["rejected"]), int(sd["refreshes"])
        self.seed, self.beta_anc, self.rank = int(sd["seed"]), float(sd["beta_anc"]), int(sd["rank"])


def warmup_cosine_lr(step: int, *, lr: float, steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """The learning rate of step ``step`` (0-based): linear warmup to ``lr`` over
    ``warmup_steps`` steps, then cosine decay to ``lr * min_lr_ratio`` at step ``steps``
    (held there after). The trainer's and the base-model pretraining's schedule."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    frac = min(1.0, (step - warmup_steps) / max(1, steps - warmup_steps))
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def spectral_param_groups(model: torch.nn.Module, *, filter_embeddings: bool = False,
                          named: bool = False) -> list[dict]:
    """Param groups for SpectralAdamW: embedding / lm_head weights (nn.Embedding modules and
    any parameter named like ``lm_head``/``embed``) get ``spectral=filter_embeddings``.
    Parameters without requires_grad are left out; tied weights appear once.

    Order: group 0 holds every other trainable parameter in ``model.named_parameters()``
    order, group 1 (present only if there are any) the embedding / lm_head weights in that
    order. So the optimizer's parameter order -- the order of the lists that
    ``SpectralAdamW.observe_anchor`` takes, see ``SpectralAdamW.param_order()`` -- puts the
    embeddings LAST and is in general not ``model.parameters()`` order. ``named=True``
    gives ``(name, param)`` pairs instead of params (torch then keeps each group's
    ``param_names``), so observe_anchor also takes a ``{name: grad}`` dict."""
    emb_ids = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    main, emb = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        entry = (name, p) if named else p
        if id(p) in emb_ids or "lm_head" in name or "embed" in name:
            emb.append(entry)
        else:
            main.append(entry)
    groups = [{"params": main}]
    if emb:
        groups.append({"params": emb, "spectral": filter_embeddings})
    return groups


class SpectralAdamW(torch.optim.AdamW):
    """AdamW on anchor-filtered gradients (see the module docstring).

    Cost: about one AdamW step without a prior; with one, the projection per filtered
    matrix (two skinny GEMMs on G, plus two m*r*r ones), an SVD refresh at the first step
    after each dense arrival (none for a factored one: the anchor node ran it), and at
    that first step one more read of G (the energy statistic). On CPU with backend "auto"
    and fp32 gradients every filtered matrix of a step goes to one
    meshkern.spectral.project_prepared call, with the prior prepared once per arrival
    (``_direct``). A reused G_proj buffer per filtered parameter avoids
    re-faulting a gradient-sized tensor every step on CPU (``reuse_proj_buffer``).
    Measured ratios: docs/benchmarks.md ("SpectralAdamW: cost of a step" and "the fast
    node's optimizer with the factored transport").

    Until a prior is present for a parameter, its update is exactly torch.optim.AdamW's
    (this class *is* an AdamW; ``step`` swaps in G_proj for the filtered parameters,
    calls AdamW.step with the same foreach/fused choice, and restores the caller's
    gradients). Per-group keys: ``tau``, ``alpha`` (filter), ``spectral`` (filter this
    group's 2-D params). Global: ``beta_anc``, ``rank`` and the SVD knobs.

    ``reuse_proj_buffer``: keep one G_proj buffer per filtered parameter between steps
    (same shape/dtype/device as its gradient, re-created if those change, not in the
    state dict) and have meshkern.spectral.project write into it. None (default): on CPU
    only; True / False: always / never. Bit-identical results either way; the cost is one
    gradient-sized tensor per filtered parameter kept allocated.

    Bounds on what an anchor sends (it comes from another machine): an anchor gradient
    (Frobenius norm) or a factored prior (||S||_2, the norm of the matrix it factors) more
    than ``max_anchor_ratio`` (default 1e3) times the receiver's own scale of that
    parameter, max(1, ||p||_F, ||p.grad||_F, ||M_anc||_F), is rejected; so is a factored
    prior whose U or V does not have orthonormal columns (max |U^T U - I| >
    FACTOR_ORTHO_TOL; all-zero columns, which randomized_svd returns for s ~ 0, allowed). Real
    gradients sit orders of magnitude inside the bound (weights are far larger than
    their gradients); it stops garbage (1e10, 3e38, factors scaled by 1e19) from
    reaching the weights or the SVD, not a subtly wrong gradient.

    Anchor inputs are lists aligned with ``param_order()``, the flattened parameter order
    ``[p for g in param_groups for p in g["params"]]`` (with ``spectral_param_groups`` the
    embeddings come last: not ``model.parameters()`` order), or dicts ``{param: value}``
    (also ``{name: value}`` when the optimizer was given named parameters, e.g.
    ``spectral_param_groups(model, named=True)`` or ``model.named_parameters()``); None or
    a missing key means nothing for that parameter. A bad arrival (non-finite, wrong
    shape, wrong length, unknown key) is rejected as a whole: one warning, counted, no
    state changes, the call returns False.

    Constructor arguments are all checked here (ValueError naming the argument), the SVD
    options and ``backend`` included, so a typo does not wait for the first refresh.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, tau: float = 1e-3, alpha: float = 0.3, beta_anc: float = 0.9,
                 rank: int = 32, oversample: int = 16, power_iters: int = 3, ortho: str = "qr",
                 svd_method: str = "randomized", seed: int = 0, backend: str = "auto",
                 reuse_proj_buffer: bool | None = None, max_anchor_ratio: float = 1e3, **adamw_kwargs):
        tau, alpha = spectral._check_tau(tau), _check_prob("alpha", alpha)
        ratio = _as_float(max_anchor_ratio)
        if ratio is None or not (ratio > 0 and math.isfinite(ratio)):
            raise ValueError(f"max_anchor_ratio must be a finite float > 0, got {max_anchor_ratio!r}")
        self.max_anchor_ratio = ratio
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **adamw_kwargs)
        extra = {"tau": float(tau), "alpha": float(alpha), "spectral": True}
        self.defaults.update(extra)
        for g in self.param_groups:
            for k, v in extra.items():
                g.setdefault(k, v)
            g["tau"], g["alpha"] = spectral._check_tau(g["tau"]), _check_prob("alpha", g["alpha"])
        if reuse_proj_buffer not in (None, True, False):
            raise ValueError(f"reuse_proj_buffer must be None, True or False, got {reuse_proj_buffer!r}")
        self.reuse_proj_buffer = reuse_proj_buffer
        params = self._flat_params()
        self._anchor = AnchorMomentum(params, beta_anc, rank, oversample=oversample, power_iters=power_iters,
                                      ortho=ortho, svd_method=svd_method, seed=seed, backend=backend,
                                      enabled=[self._eligible(g, p) for g, p in self._flat_groups()])
        self._anchor._order_hint = ("; anchor lists follow SpectralAdamW.param_order() (or pass a dict "
                                    "{param: grad})")
        self.backend = self._anchor.svd_kw["backend"]
        self._prior: list[Factors | None] = [None] * len(params)  # factored priors received
        self._counters = {"arrivals": 0, "factored_arrivals": 0, "rejected": 0, "last_staleness": None,
                          "filtered_steps": 0}
        self._energy: tuple[Tensor, Tensor] | None = None  # (sum ||G_filt||^2, sum ||G||^2), last measured
        self._energy_due = True  # measure at the next filtered step (the first with a new prior)
        self._proj_buf: dict[int, Tensor] = {}  # G_proj buffer per flat parameter index (not state)
        self._prep: dict[int, tuple] = {}  # prior prepared for the direct projection (_direct; not state)
        self._prior_enabled = True  # False: every update is plain AdamW (set_prior_enabled)

    # ------------------------------------------------------------------ bookkeeping
    def _flat_groups(self):
        return [(g, p) for g in self.param_groups for p in g["params"]]

    def _flat_params(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def param_order(self) -> list[Tensor]:
        """The parameters in the order of the lists observe_anchor / observe_factored_prior
        take: ``[p for g in self.param_groups for p in g["params"]]``. With
        ``spectral_param_groups`` this is not ``model.parameters()`` order (embeddings
        last), so build anchor lists from it: ``[p.grad for p in opt.param_order()]``."""
        return self._flat_params()

    def _as_list(self, entries, what: str) -> tuple[list | None, str | None]:
        """Lists and tuples pass through; a dict {param or name: value} becomes a list in
        param_order() (missing keys: None). Returns (list, None) or (None, problem)."""
        if not isinstance(entries, dict):
            return entries, None
        params = self._flat_params()
        slot = {id(p): i for i, p in enumerate(params)}
        for g in self.param_groups:
            for name, p in zip(g.get("param_names", ()), g["params"]):
                slot[name] = slot[id(p)]
        out: list = [None] * len(params)
        unknown = []
        for k, v in entries.items():
            i = slot.get(id(k) if isinstance(k, Tensor) else k) if isinstance(k, (Tensor, str)) else None
            if i is None:
                unknown.append(f"{type(k).__name__} {tuple(k.shape)}" if isinstance(k, Tensor) else repr(k))
            else:
                out[i] = v
        if unknown:
            names = "" if any("param_names" in g for g in self.param_groups) else \
                " (name keys need named parameters, e.g. spectral_param_groups(model, named=True))"
            return None, (f"{what} dict has {len(unknown)} key(s) that are not parameters of this optimizer: "
                          + ", ".join(unknown[:4]) + names)
        return out, None

    def _reject(self, what: str, problems: list[str]) -> bool:
        warnings.warn(f"meshkern: rejected {what} (" + "; ".join(problems[:4]) + ")" + self._anchor._order_hint,
                      RuntimeWarning, stacklevel=3)
        self._counters["rejected"] += 1
        return False

    @staticmethod
    def _eligible(group: dict, p: Tensor) -> bool:
        return bool(group.get("spectral", True)) and p.dim() == 2

    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "_anchor"):
            raise RuntimeError("SpectralAdamW: add all param groups at construction (anchor lists are aligned "
                               "with the parameter order)")
        super().add_param_group(param_group)

    def _current_factors(self) -> list[Factors | None]:
        """Per parameter: the newest prior (a factored prior, or the SVD of M_anc)."""
        from_m = self._anchor.factors()
        return [p if p is not None else f for p, f in zip(self._prior, from_m)]

    # ---------------------------------------------------------------- anchor inputs
    def observe_anchor_update(self, update, staleness: int, *, factored: bool = False,
                              bounds_checked: bool = False) -> bool:
        """The one entry point for what an anchor sends, whatever its transport: anchor
        gradients (``factored=False``: ``observe_anchor``) or the anchor's own top-r
        factors (``factored=True``: ``observe_factored_prior``). Same input forms, same
        return value (False: rejected, with a warning, nothing changed).
        ``bounds_checked`` (factored only): see ``observe_factored_prior``."""
        if factored:
            return self.observe_factored_prior(update, staleness, bounds_checked=bounds_checked)
        return self.observe_anchor(update, staleness)

    @property
    def prior_enabled(self) -> bool:
        """Whether the anchor prior filters the gradients (see ``set_prior_enabled``)."""
        return self._prior_enabled

    def set_prior_enabled(self, on: bool) -> None:
        """Switches the anchor prior off (every step is then exactly AdamW's, as with
        alpha = 1, and skips the projection) or back on. The anchor momentum and the
        priors received are kept, and so are the groups' ``alpha``. Saved in the state
        dict. A trainer switches it off while its anchor is stalled or lost."""
        if not isinstance(on, bool):
            raise TypeError(f"set_prior_enabled takes a bool, got {type(on).__name__}")
        self._prior_enabled = on

    def observe_anchor(self, grads: Sequence[Tensor | None], staleness: int) -> bool:
        """Fold a delayed anchor gradient into M_anc: a list aligned with ``param_order()``
        or a dict {param (or name): grad}. The SVD is refreshed at the next step. Returns
        False if rejected (one RuntimeWarning)."""
        staleness = _check_staleness(staleness)
        grads, problem = self._as_list(grads, "anchor gradients")
        if problem is not None:
            return self._reject("anchor gradients", [problem])
        if not self._anchor.validate(grads):  # invalid input: AnchorMomentum.update below warns and counts
            problems = self._out_of_bounds([None if g is None else torch.linalg.vector_norm(g.detach().float())
                                            for g in grads])
            if problems:
                return self._reject("anchor gradients", problems)
            for i, g in enumerate(grads):
                if g is not None and self._anchor.enabled[i]:
                    self._prior[i] = None  # the momentum is now newer than any factored prior
        if not self._anchor.update(grads):
            self._counters["rejected"] += 1
            return False
        self._counters["arrivals"] += 1
        self._counters["last_staleness"] = staleness
        self._energy_due = True
        return True

    def observe_factored_prior(self, factors: Sequence[Factors | None], staleness: int, *,
                               bounds_checked: bool = False) -> bool:
        """Use (U[m,r], S[r], V[n,r]) computed elsewhere (AnchorMomentum.factors() on the
        anchor node) as the prior of each parameter; None keeps the current one.
        Returns False, with a warning and no change, for non-finite, negative-S or
        wrong-shape input, U or V without orthonormal columns, or ||S|| over the bound
        (class docstring). A list aligned with ``param_order()`` or a dict {param (or
        name): (U, S, V)}.

        ``bounds_checked=True``: the caller has already checked orthonormality and the
        magnitude bound with a bound at least as strict (orchestration.anchor.bounds
        .check_entries, as the trainer's anchor hook does before every update); both are
        then skipped here (they read every parameter and its gradient once, at every
        arrival). Shapes, finiteness and the sign of S are checked either way."""
        staleness = _check_staleness(staleness)
        params = self._flat_params()
        factors, problem = self._as_list(factors, "factored anchor prior")
        if problem is not None:
            return self._reject("factored anchor prior", [problem])
        problems, stacks = [], []
        if not isinstance(factors, (list, tuple)) or len(factors) != len(params):
            n = len(factors) if isinstance(factors, (list, tuple)) else type(factors).__name__
            problems.append(f"got {n} factored priors for {len(params)} parameters")
        else:
            fitting = []  # entries whose shapes fit: their values are checked next
            for i, f in enumerate(factors):
                if f is None or not self._anchor.enabled[i]:
                    continue
                try:
                    U, S, V = f
                except (TypeError, ValueError):
                    problems.append(f"entry {i}: expected a (U, S, V) triple")
                    continue
                m, n = params[i].shape
                if not all(isinstance(t, Tensor) and t.is_floating_point() for t in (U, S, V)):
                    problems.append(f"entry {i}: U, S, V must be floating-point tensors")
                elif U.dim() != 2 or U.shape[0] != m or tuple(S.shape) != (U.shape[1],) \
                        or tuple(V.shape) != (n, U.shape[1]) or U.shape[1] > min(m, n):
                    problems.append(f"entry {i}: shapes U{tuple(U.shape)} S{tuple(S.shape)} V{tuple(V.shape)} "
                                    f"do not fit a [{m}, {n}] parameter")
                else:
                    fitting.append(i)
            if not problems:
                stacks = self._stack_factors(factors, fitting)
                if not self._factors_ok(stacks, check_ortho=not bounds_checked):
                    problems = self._factor_problems(factors, fitting, check_ortho=not bounds_checked)
            if not problems and not bounds_checked:
                norms: list = [None] * len(params)
                for members, _, Ss, _ in stacks:  # one norm op and one host read per shape
                    for i, n in zip(members, torch.linalg.vector_norm(Ss.float(), dim=1).tolist()):
                        norms[i] = n
                problems = self._out_of_bounds(norms)
        if problems:
            return self._reject("factored anchor prior", problems)
        self._take_priors(stacks)
        self._counters["factored_arrivals"] += 1
        self._counters["last_staleness"] = staleness
        self._energy_due = True
        return True

    def _stack_factors(self, factors, idx: list[int]) -> list[tuple[list[int], Tensor, Tensor, Tensor]]:
        """Entries ``idx`` of ``factors`` grouped by shapes, dtypes, devices, their
        parameter's device and tau, as (members, U, S, V stacked along a new dim 0, detached):
        stacked once per arrival, then checked (``_factors_ok``) and taken (``_take_priors``)
        from the same stacks."""
        groups: dict[tuple, list[int]] = {}
        flat = self._flat_groups()
        for i in idx:
            U, S, V = factors[i]
            g, p = flat[i]
            groups.setdefault((tuple(U.shape), tuple(V.shape), U.dtype, S.dtype, V.dtype, U.device, S.device,
                               V.device, p.device, g["tau"]), []).append(i)
        return [(members, *(torch.stack([factors[i][k].detach() for i in members]) for k in range(3)))
                for members in groups.values()]

    def _take_priors(self, stacks) -> None:
        """Stores accepted factors (``_stack_factors``'s groups) as the priors (fp32 copies on
        each parameter's device): one copy of each of U, S, V per group, and the direct
        projection's (U d)^T, V d and V^T prepared here for each group (``_direct`` then
        finds them) instead of a dozen small tensor ops per matrix at the next step."""
        params = self._flat_params()
        flat = self._flat_groups()
        for members, Us, Ss, Vs in stacks:
            dev, tau = params[members[0]].device, flat[members[0]][0]["tau"]
            Us, Ss, Vs = (t.to(dev, torch.float32) for t in (Us, Ss, Vs))
            direct = self.backend == "auto" and dev.type == "cpu"
            if direct:
                d = spectral.gains(Ss, tau)[:, None, :]
                prep = zip(*((Us * d).mT.contiguous().unbind(), (Vs * d).unbind(), Vs.mT.contiguous().unbind()))
            for i, u, s, v in zip(members, Us.unbind(), Ss.unbind(), Vs.unbind()):
                prior = self._prior[i] = (u, s, v)
                if direct:
                    self._prep[i] = (prior, tau, u, *next(prep))

    @staticmethod
    def _factors_ok(stacks, check_ortho: bool) -> bool:
        """Whether every entry of ``stacks`` (``_stack_factors``) is finite, has S >= 0 and
        (with ``check_ortho``) orthonormal U and V (FACTOR_ORTHO_TOL, all-zero columns
        allowed): batched per group, one host sync in all (the per-entry checks cost ~40
        tensor ops per matrix at every arrival). False sends the caller to
        ``_factor_problems`` for the messages."""
        bad = []
        for _, Us, Ss, Vs in stacks:
            # Finite iff the sums are (a NaN or inf propagates; an overflowing sum of finite
            # values only sends the caller to the exact per-entry checks): three reductions
            # instead of three bool tensors of the factors' size.
            bad.append(~torch.isfinite(torch.stack([Us.sum(), Ss.sum(), Vs.sum()])).all())
            bad.append((Ss < 0).any())
            if check_ortho:
                for Q in (Us, Vs):
                    Q = Q.float()
                    gram = Q.mT @ Q
                    target = torch.diag_embed((gram.diagonal(dim1=1, dim2=2) > 0.5).float())
                    bad.append(~((gram - target).abs().amax() <= FACTOR_ORTHO_TOL))
        return not bad or not bool(torch.stack([b.to("cpu") for b in bad]).any())

    @staticmethod
    def _factor_problems(factors, idx: list[int], check_ortho: bool) -> list[str]:
        """The per-entry value checks of observe_factored_prior, with their messages."""
        problems = []
        for i in idx:
            U, S, V = factors[i]
            if not all(bool(torch.isfinite(t).all()) for t in (U, S, V)) or bool((S < 0).any()):
                problems.append(f"entry {i}: non-finite values or negative singular values")
            elif check_ortho:
                for name, Q in (("U", U), ("V", V)):
                    err = float(orthonormality_error(Q))
                    if not err <= FACTOR_ORTHO_TOL:
                        problems.append(f"entry {i}: {name} does not have orthonormal columns (max |{name}^T "
                                        f"{name} - I| = {err:.3g} > {FACTOR_ORTHO_TOL})")
        return problems

    def _out_of_bounds(self, norms: list) -> list[str]:
        """Problems for entries whose norm exceeds max_anchor_ratio x the receiver's own
        scale of that parameter (see the class docstring). ``norms``: per parameter a float,
        a 0-dim tensor (read with one host sync each) or None (not checked). The
        scale is at least 1, so a norm <= max_anchor_ratio passes without reading the
        parameter, its gradient or its momentum (real priors always do: the norms below
        cost two passes over every parameter at every arrival); above that the scale's
        terms are read one by one until one admits the entry, the same decision."""
        problems = []
        for i, ((_, p), n) in enumerate(zip(self._flat_groups(), norms)):
            if n is None or not self._anchor.enabled[i]:
                continue
            got = float(n)
            if got <= self.max_anchor_ratio:
                continue
            terms = [lambda p=p: torch.linalg.vector_norm(p.detach().float())]  # ||p||: 1 if zero-initialized
            if p.grad is not None and not p.grad.is_sparse:
                terms.append(lambda p=p: torch.linalg.vector_norm(p.grad.detach().float()))
            if self._anchor.m[i] is not None:
                terms.append(lambda i=i: torch.linalg.vector_norm(self._anchor.m[i]))
            scale = 1.0
            for term in terms:
                if got <= self.max_anchor_ratio * scale:
                    break
                scale = max(scale, float(term()))
            if not got <= self.max_anchor_ratio * scale:
                problems.append(f"entry {i}: norm {got:.3g} > max_anchor_ratio {self.max_anchor_ratio:g} x this "
                                f"parameter's scale {scale:.3g}")
        return problems

    def anchor_stats(self) -> dict:
        """Counters for the trainer's log: arrivals, factored_arrivals, rejected,
        last_staleness, refreshes, filtered (params with a prior), mean_gain (mean d over
        all filtered params, with each group's tau), energy_kept (||G_filt||^2 / ||G||^2
        summed over the params filtered, measured at the first filtered step after each
        new prior, i.e. after each arrival or refresh, and held until the next: measuring
        it every step cost a pass over every gradient, ~10% of the fast node's optimizer
        step on CPU; None before any)."""
        facs = self._current_factors()
        d_sum, d_cnt = 0.0, 0
        for (g, _), f in zip(self._flat_groups(), facs):
            if f is not None:
                d = spectral.gains(f[1], g["tau"])
                d_sum += float(d.sum())
                d_cnt += d.numel()
        energy = None
        if self._energy is not None:
            kept, total = (float(x) for x in self._energy)
            energy = kept / total if total > 0 else 0.0
        return {**self._counters, "refreshes": self._anchor.refreshes,
                "filtered": sum(f is not None for f in facs),
                "mean_gain": d_sum / d_cnt if d_cnt else None, "energy_kept": energy}

    # ------------------------------------------------------------------------ step
    def _proj_buffer(self, i: int, g: Tensor) -> Tensor | None:
        """The reused G_proj buffer of parameter ``i`` (None: let project allocate).

        Default (reuse_proj_buffer=None): CPU only. On CPU a fresh G_proj is ~1 GB of
        first-touch page faults per step on 4 Llama-1B layers (docs/benchmarks.md);
        CUDA's caching allocator already recycles the block, and a buffer kept there
        would hold one gradient's worth of memory through forward and backward.
        Re-created when the gradient's shape, dtype or device changes."""
        use = g.device.type == "cpu" if self.reuse_proj_buffer is None else self.reuse_proj_buffer
        if not use:
            return None
        buf = self._proj_buf.get(i)
        if buf is None or buf.shape != g.shape or buf.dtype != g.dtype or buf.device != g.device:
            buf = self._proj_buf[i] = torch.empty_like(g, memory_format=torch.contiguous_format)
        return buf

    def _direct(self, i: int, f: Factors, tau: float, g: Tensor):
        """The prior of parameter ``i`` prepared for the direct projection
        (meshkern.spectral.project_prepared): (U, (U diag(d))^T, V diag(d), V^T) in fp32 on g's
        device, contiguous, cached until the prior or tau changes; None where the direct
        path does not apply (then meshkern.spectral.project runs). Direct: backend "auto",
        a contiguous fp32 matrix gradient on CPU. Why a path of its own: the custom op's
        checks and dispatch cost more than the GEMMs on small matrices, and all of a step's
        matrices go to the kernel in one call (docs/benchmarks.md, "The fast node's
        optimizer with the factored transport")."""
        if self.backend != "auto" or g.dtype != torch.float32 or g.device.type != "cpu" or g.dim() != 2 \
                or not g.is_contiguous():
            return None
        c = self._prep.get(i)
        if c is None or c[0] is not f or c[1] != tau:
            U, S, V = (t.detach().to(g.device, torch.float32).contiguous() for t in f)
            d = spectral.gains(S, tau)
            c = self._prep[i] = (f, tau, U, (U * d).mT.contiguous(), (V * d).contiguous(), V.mT.contiguous())
        return c[2:]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        facs = self._current_factors()
        swapped = []
        measure = self._energy_due  # the energy statistic: at the first step with a new prior only
        kept, total = [], []  # per filtered parameter: ||G_filt||^2, ||G||^2 (summed once, below)
        direct = []  # (param, G, prepared prior, alpha, G_proj buffer): one project_prepared call
        try:
            for i, ((group, p), f) in enumerate(zip(self._flat_groups(), facs)):
                if not self._prior_enabled or f is None or p.grad is None or p.grad.is_sparse \
                        or group["alpha"] == 1.0:
                    continue  # prior off or alpha = 1: G_proj = G exactly, skip the work
                g = p.grad
                prep = self._direct(i, f, group["tau"], g)
                if prep is not None:
                    buf = self._proj_buffer(i, g)
                    direct.append((p, g, prep, group["alpha"], torch.empty_like(g) if buf is None else buf))
                    continue
                U, S, V = f
                gp, fsq = spectral.project(g, U, S, V, group["tau"], group["alpha"], backend=self.backend,
                                           return_stats=True, out=self._proj_buffer(i, g))
                if measure:
                    kept.append(fsq.float())
                    total.append(torch.linalg.vector_norm(g, dtype=torch.float32).square())
                swapped.append((p, g))
                p.grad = gp
            if direct:
                Us, Udts, Vds, Vts = (list(t) for t in zip(*(e[2] for e in direct)))
                xfs = spectral.project_prepared([e[1] for e in direct], Us, Udts, Vds, Vts,
                                                [e[3] for e in direct], [e[4] for e in direct])
                for (p, g, _, _, gp), xf in zip(direct, xfs):
                    if measure:  # ||G_filt||^2 = ||X_f||^2 (U, V orthonormal); ||G||^2 is a pass over G
                        xv, gv = xf.view(-1), g.view(-1)
                        kept.append(torch.dot(xv, xv))
                        total.append(torch.dot(gv, gv))
                    swapped.append((p, g))
                    p.grad = gp
            if swapped:
                self._counters["filtered_steps"] += 1
                if measure:
                    self._energy = (torch.stack(kept).sum(), torch.stack(total).sum())
                    self._energy_due = False
            super().step()
        finally:
            for p, g in swapped:
                p.grad = g
        return loss

    # ------------------------------------------------------------------ checkpoints
    def param_anchor_state(self, p: Tensor) -> dict:
        """Parameter ``p``'s own anchor state, copies: its anchor momentum ``m``, that
        momentum's current SVD ``factors`` and its prior (the factors its updates are
        filtered by), each only where it has one. What a copy of one parameter needs beside
        ``self.state[p]`` (an elastic heal by parameter name, from a peer whose other
        parameters differ); the counters stay this optimizer's."""
        i = self._index_of(p)
        a = self._anchor
        out = {}
        if a.m[i] is not None:
            out["m"] = a.m[i].clone()
        if a._factors[i] is not None and i not in a._stale:
            out["factors"] = [t.clone() for t in a._factors[i]]
        if self._prior[i] is not None:
            out["prior"] = [t.clone() for t in self._prior[i]]
        return out

    def load_param_anchor_state(self, p: Tensor, st: dict) -> None:
        """Sets ``p``'s anchor state from ``param_anchor_state`` of a peer's copy of it ({}:
        none). Without the peer's factors, its momentum's are recomputed at the next refresh."""
        i = self._index_of(p)
        a = self._anchor
        m = st.get("m")
        if m is not None and tuple(m.shape) != a.shapes[i]:
            raise ValueError(f"anchor momentum of shape {tuple(m.shape)} for a parameter of shape {a.shapes[i]}")
        a.m[i] = None if m is None else m.detach().to(a.devices[i], torch.float32).clone()
        f = st.get("factors") if m is not None else None
        a._factors[i] = None if f is None else tuple(t.detach().to(a.devices[i]).clone() for t in f)
        (a._stale.add if m is not None and f is None else a._stale.discard)(i)
        prior = st.get("prior")
        self._prior[i] = None if prior is None else tuple(t.detach().to(p.device).clone() for t in prior)

    def _index_of(self, p: Tensor) -> int:
        for i, q in enumerate(self._flat_params()):
            if q is p:
                return i
        raise ValueError("the parameter is not one this optimizer updates")

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["spectral"] = {"anchor": self._anchor.state_dict(),
                          "prior": {i: list(f) for i, f in enumerate(self._prior) if f is not None},
                          "counters": dict(self._counters), "prior_enabled": self._prior_enabled,
                          "energy": None if self._energy is None else [t.clone() for t in self._energy],
                          "energy_due": self._energy_due}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        spec = state_dict.pop("spectral", None)
        super().load_state_dict(state_dict)
        if spec is None:
            return
        params = self._flat_params()
        self._anchor.load_state_dict(spec["anchor"])
        self._prior = [None] * len(params)
        for i, f in spec["prior"].items():
            i = int(i)
            self._prior[i] = tuple(t.detach().to(params[i].device).clone() for t in f)
        self._counters = dict(spec["counters"])
        self._prior_enabled = bool(spec.get("prior_enabled", True))
        self._energy = None if spec["energy"] is None else tuple(t.clone() for t in spec["energy"])
        self._energy_due = bool(spec.get("energy_due", True))


__all__ = ["SpectralAdamW", "AnchorMomentum", "spectral_param_groups", "warmup_cosine_lr"]
