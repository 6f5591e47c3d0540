"""The subspace constraint of subspace-projected stage boundaries (the ``subspace`` codec).

After "Protocol Models" (arXiv 2506.01260), as used by "Heterogeneous Low-Bandwidth
Pre-Training of LLMs" (arXiv 2601.02360): every decoder block adds to the residual
stream only through its output projections, attention ``o_proj`` and MLP ``down_proj``
(weight [H, in], bias [H] if any). If all of them keep their columns in span(U) for one
orthonormal U [H, k], the residual stream after any layer is

    h = E[ids] + (a vector in span(U))        (Llama: rotary, no positional embedding)

so a boundary only has to carry the k coordinates (h - E[ids]) U, and the receiver
rebuilds h exactly from the token ids it already holds and the same frozen table E
(orchestration.codecs.subspace, meshkern.subspace).

    make_basis(H, k, seed=0, model=None)  U [H, k]: seeded random orthonormal, or fitted to
                                          the model's output projections (top-k left
                                          singular vectors of all of them side by side)
    constrain_(module, U)                 W <- U (U^T W) in place for every o_proj/down_proj
                                          weight (and bias); a Stage or a whole HF model
    violation(module, U)                  max ||W - U U^T W||_F / ||W||_F over those
    constrained_names(module)             their parameter names in ``module``
    is_constrained(name)                  does a parameter name denote one of them
    project_tensor(name, t, U)            U (U^T t) for a constrained name, else t unchanged
    make_projector(U)                     projector(name, tensor) -> tensor (the callable
                                          form that DP code takes; unsplit-model names such
                                          as ``model.layers.3.self_attn.o_proj.weight``)

Trainer integration (one way; see docs/codecs.md, "subspace"): freeze the token
embedding (both sides must hold the same E), ``constrain_`` every stage once before the
first step and again after every optimizer step (the optimizer's update, AdamW's
element-wise normalization in particular, leaves the subspace), and
``codec.attach(E, U)`` on every rank with the same E and U.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

# Module-name suffixes of the output projections (HF Llama / Qwen2 / Qwen3 / Mistral).
OUTPUT_PROJECTIONS = ("self_attn.o_proj", "mlp.down_proj")


def is_constrained(name: str) -> bool:
    """True for the weight or bias of an output projection: a parameter name ending in
    ``self_attn.o_proj.weight`` / ``.bias`` or ``mlp.down_proj.weight`` / ``.bias``
    (a Stage's own names and the unsplit model's both qualify)."""
    if not isinstance(name, str):
        return False
    module, _, leaf = name.rpartition(".")
    return leaf in ("weight", "bias") and any(module == s or module.endswith("." + s) for s in OUTPUT_PROJECTIONS)


def constrained_names(module: nn.Module) -> list[str]:
    """Names (as ``module.named_parameters()`` gives them) of every parameter that the
    constraint acts on, in order."""
    return [n for n, _ in module.named_parameters() if is_constrained(n)]


def _check_basis(U: torch.Tensor, H: int | None = None) -> None:
    if not isinstance(U, torch.Tensor) or U.dim() != 2 or not U.dtype.is_floating_point:
        raise ValueError(f"U must be a float [H, k] tensor, got "
                         f"{tuple(U.shape) if isinstance(U, torch.Tensor) else type(U).__name__}")
    if H is not None and U.shape[0] != H:
        raise ValueError(f"U is [{U.shape[0]}, {U.shape[1]}] but the hidden size is {H}")


def _project(t: torch.Tensor, U: torch.Tensor) -> torch.Tensor:
    """U (U^T t) for t [H, ...], computed in fp32 (fp64 for fp64), in t's dtype/device."""
    acc = torch.float64 if t.dtype == torch.float64 else torch.float32
    Ua = U.to(device=t.device, dtype=acc)
    x = t.to(acc)
    flat = x.reshape(x.shape[0], -1)
    return (Ua @ (Ua.T @ flat)).reshape(t.shape).to(t.dtype)


def project_tensor(name: str, t: torch.Tensor, U: torch.Tensor) -> torch.Tensor:
    """``U (U^T t)`` if ``name`` is an output projection's weight [H, in] or bias [H]
    (``is_constrained``), else ``t`` itself (unchanged, same object). A new tensor; ``t``
    is not modified. ValueError if a constrained tensor's first dim is not U's H."""
    if not is_constrained(name):
        return t
    _check_basis(U)
    if t.dim() < 1 or t.shape[0] != U.shape[0]:
        raise ValueError(f"{name}: shape {tuple(t.shape)} does not start with U's H={U.shape[0]}")
    return _project(t, U)


def make_projector(U: torch.Tensor):
    """``projector(name, tensor) -> tensor``: project_tensor with this U (identity for
    names that are not output projections)."""
    _check_basis(U)
    U = U.detach()

    def projector(name: str, tensor: torch.Tensor) -> torch.Tensor:
        return project_tensor(name, tensor, U)

    return projector


@torch.no_grad()
def constrain_(module: nn.Module, U: torch.Tensor) -> list[str]:
    """W <- U (U^T W) in place for every output-projection weight and bias of ``module``
    (a Stage, a whole HF model, or any module holding such layers). Returns the names
    projected. ValueError if there is none or a shape does not match U."""
    _check_basis(U)
    names = []
    for name, p in module.named_parameters():
        if is_constrained(name):
            p.copy_(project_tensor(name, p.detach(), U))
            names.append(name)
    if not names:
        raise ValueError(f"{type(module).__name__} holds no o_proj/down_proj parameters to constrain")
    return names


@torch.no_grad()
def violation(module: nn.Module, U: torch.Tensor) -> float:
    """max over the output-projection weights/biases of ||W - U U^T W||_F / ||W||_F (a zero
    tensor counts 0): 0 for a model that satisfies the constraint, up to fp rounding
    (~1e-7 in fp32). Computed in the weights' precision (fp32 for fp32/bf16/fp16, fp64 for
    fp64), two thin GEMMs per weight: 4 H k (in) flops each (SmolLM2-135M at k=36, all 60
    weights: ~5 GFLOP, 0.2-0.6 s on one core of this loaded machine vs 0.4-0.9 s with fp64
    copies; each stage only checks its own layers)."""
    _check_basis(U)
    worst, seen = 0.0, False
    bases: dict = {}
    for name, p in module.named_parameters():
        if not is_constrained(name):
            continue
        seen = True
        acc = torch.float64 if p.dtype == torch.float64 else torch.float32
        w = p.detach().to(acc).reshape(p.shape[0], -1)
        if w.shape[0] != U.shape[0]:
            raise ValueError(f"{name}: shape {tuple(p.shape)} does not start with U's H={U.shape[0]}")
        key = (w.device, acc)
        if key not in bases:
            bases[key] = U.detach().to(device=w.device, dtype=acc)
        Ua = bases[key]
        norm = float(torch.linalg.vector_norm(w))
        if norm > 0:
            worst = max(worst, float(torch.linalg.vector_norm(w - Ua @ (Ua.T @ w))) / norm)
    if not seen:
        raise ValueError(f"{type(module).__name__} holds no o_proj/down_proj parameters")
    return worst


def _random_basis(H: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(seed))
    q, r = torch.linalg.qr(torch.randn(H, k, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(k, dtype=torch.float64))


def _fitted_basis(modules: Iterable[nn.Module], H: int, k: int) -> torch.Tensor:
    """Top-k left singular vectors of [W_1 | W_2 | ...] (all output-projection weights and
    biases side by side), from the eigenvectors of sum_i W_i W_i^T [H, H] in fp64: the
    k-dim subspace that minimizes sum_i ||W_i - U U^T W_i||_F^2, i.e. the one that changes
    the model least when the constraint is first applied."""
    G = torch.zeros(H, H, dtype=torch.float64)
    seen = False
    for m in modules:
        for name, p in m.named_parameters():
            if not is_constrained(name):
                continue
            w = p.detach().to("cpu", torch.float64).reshape(p.shape[0], -1)
            if w.shape[0] != H:
                raise ValueError(f"{name}: shape {tuple(p.shape)} does not start with H={H}")
            G += w @ w.T
            seen = True
    if not seen:
        raise ValueError("model holds no o_proj/down_proj parameters to fit a basis to")
    evals, evecs = torch.linalg.eigh(G)
    U = evecs[:, torch.argsort(evals, descending=True)[:k]]
    # Deterministic signs: the largest-|.| entry of each column positive.
    idx = U.abs().argmax(dim=0)
    s = torch.sign(U[idx, torch.arange(k)])
    return U * torch.where(s == 0, torch.ones_like(s), s)


def make_basis(H: int, k: int, seed: int = 0, model: nn.Module | Iterable[nn.Module] | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An orthonormal U [H, k] (columns orthonormal to fp rounding), on the CPU.

    ``model=None``: a seeded Gaussian matrix orthonormalized by QR (signs fixed, so the
    same seed gives the same U on every rank and machine): the paper's predefined random
    subspace, for training from scratch. ``model`` (a module or a list of modules, e.g.
    every Stage of a split model): fitted to the model's output projections (see
    ``_fitted_basis``); for adapting a pretrained model, whose output projections are far
    from any random k-dim subspace. ValueError unless 1 <= k <= H."""
    H, k = int(H), int(k)
    if H < 1 or not 1 <= k <= H:
        raise ValueError(f"need 1 <= k <= H, got H={H}, k={k}")
    if model is None:
        U = _random_basis(H, k, seed)
    else:
        modules = [model] if isinstance(model, nn.Module) else list(model)
        U = _fitted_basis(modules, H, k)
    return U.to(dtype).contiguous()
