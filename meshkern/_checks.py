"""Argument checks shared by meshkern's ops and optimizers (one copy of each rule).

``as_int`` / ``as_float`` accept plain numbers (Python, numpy scalars, SymInt) and refuse
bools, tensors and strings; ``backend_arg`` is the op-schema form of a ``backend=``
argument; ``float_tensor`` checks a tensor argument's type, dtype and rank.
"""
from __future__ import annotations

import numbers
import operator

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def as_int(value) -> int | None:
    """``value`` as a Python int if it is a plain integer (int, numpy integer, SymInt),
    else None. Bools, floats, strings and tensors are not integers here."""
    if isinstance(value, (bool, Tensor)):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def as_float(value) -> float | None:
    """``value`` as a Python float if it is a plain real number (int, float, numpy scalar),
    else None (bools, tensors, strings)."""
    if isinstance(value, (bool, Tensor)) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def backend_arg(backend) -> str:
    """The op-schema form of a ``backend=`` argument: None means "auto" (as in
    meshkern._backend.resolve); anything but None or a str is a TypeError."""
    if backend is None:
        return "auto"
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str ('auto', 'cpp', 'cuda', 'triton', 'reference') or None, "
                        f"got {type(backend).__name__}")
    return backend


def float_tensor(name: str, t, allowed=FLOAT_DTYPES, *, min_dim: int = 0) -> None:
    """TypeError unless ``t`` is a tensor of a dtype in ``allowed``; ValueError if it has
    fewer than ``min_dim`` dims."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in allowed:
        names = "/".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"{name} must have dtype {names}, got {t.dtype}")
    if t.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dim(s) ([..., dims]), got a {t.dim()}-d tensor")


def fraction(name: str, value) -> float:
    """``value`` as a float in [0, 1) (a drop fraction, a momentum); ValueError otherwise."""
    v = as_float(value)
    if v is None or not 0.0 <= v < 1.0:
        raise ValueError(f"{name} must be a float in [0, 1), got {value!r}")
    return v


def boundary_shape(shape, dtype) -> tuple[int, ...]:
    """A stage-boundary tensor's shape as a tuple: [..., T, H] with every dim >= 1 and a
    floating-point ``dtype`` (ValueError / TypeError otherwise). What a codec checks before
    it sizes a wire."""
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2 or min(shape) < 1:
        raise ValueError(f"boundary tensors are [..., T, H] with every dim >= 1, got shape {shape}")
    if not dtype.is_floating_point:
        raise TypeError(f"boundary tensors must be floating point, got {dtype}")
    return shape
