"""Masked stage boundaries: a Philox-keyed mask that keeps K of H dims per token, and
the fused pack ([..., H] -> [..., K]) / unpack ([..., K] -> [..., H]) ops.

The mask is a deterministic function of (MaskKey, token row, H, p), specified in
``meshkern.reference_mask`` (Philox4x32-10 counters + Floyd's sampling; kept dims
ascending; each dim kept with probability exactly K/H). Sender and receiver evaluate
it locally, so only the K values per token travel: ``pack`` output is exactly
``rows * K * element_size`` bytes and ``unpack`` needs nothing else.

Token rows: ``h`` of shape ``[..., T, H]`` is viewed as ``[N, H]``; the token position in
the Philox counter is the row index in that flattened view (for ``[B, T, H]`` token t of
sequence b is row ``b * T + t``). ``pack`` and ``unpack`` on identically shaped leading
dims with the same key therefore use the same dims, and
``mask_indices(key, N, H, p)`` lists them for all N rows.

Autograd: pack and unpack with the same (key, H, p, rescale) are adjoint linear maps,
so the gradient of pack is unpack of the incoming gradient and vice versa (both
directions move only K values per token). ``rescale=True`` multiplies the moved values
by H/K (= 1/(1-p) when (1-p)*H is an integer; the exact inverse keep probability, so
``unpack(pack(h, rescale=True))`` is unbiased, dropout-style). Apply it in ONE of the
pair (e.g. the receiver's unpack); the backward of that op carries the same factor.

Backends: ``backend="auto"|"cpp"|"cuda"|"triton"|"reference"`` or the
``MESHKERN_BACKEND`` environment variable; None means "auto". All backends
return bit-identical results. Supported dtypes: float16, bfloat16, float32, float64.
Non-contiguous inputs are copied to contiguous first.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
from torch import Tensor

from meshkern import _backend
from meshkern._checks import as_float as _as_float, as_int as _as_int, backend_arg as _backend_arg  # noqa: F401
from meshkern._checks import float_tensor, fraction
from meshkern import reference_mask as _ref

__all__ = ["MaskKey", "WIRE_FORMAT_VERSION", "kept_dims", "mask_indices", "pack", "unpack"]

# The mask specification (meshkern.reference_mask: Philox counter layout, draw order,
# Floyd selection, ascending order) is a wire format: both ends of a boundary must run
# the same one, or the receiver scatters the values into the wrong dims. A deliberate
# change of it must bump this number and the golden vectors in tests/test_mask_golden.py.
WIRE_FORMAT_VERSION = 1

_MAX_H = 2**31 - 1  # draw_below needs j + 1 <= 2**31
_MAX_ROWS = 2**32  # the token row is one 32-bit Philox counter word


@dataclasses.dataclass(frozen=True)
class MaskKey:
    """What a stage boundary's mask depends on, besides the token row.

    seed < 2**64 (Philox key), boundary < 2**16 (stage-boundary / layer index),
    step < 2**32 (optimizer step), microbatch < 2**16 (micro-batch id); all >= 0.
    Raises ValueError("malformed key: ...") naming the bad field.
    """
    seed: int
    boundary: int
    step: int
    microbatch: int

    _LIMITS = {"seed": 64, "boundary": 16, "step": 32, "microbatch": 16}

    def __post_init__(self):
        for name, bits in self._LIMITS.items():
            value = getattr(self, name)
            try:  # ints and numpy ints pass; floats, bools and strings do not
                if isinstance(value, bool):
                    raise TypeError
                value = operator.index(value)
            except TypeError:
                raise ValueError(f"malformed key: {name} must be an int, got {type(value).__name__} {value!r}") from None
            if not 0 <= value < 2**bits:
                raise ValueError(f"malformed key: {name}={value} outside [0, 2**{bits})")
            object.__setattr__(self, name, value)

    def words(self) -> tuple[int, int, int, int, int]:
        """(seed_lo, seed_hi, boundary, step, microbatch): the op-schema form of the key."""
        return (self.seed & 0xFFFFFFFF, self.seed >> 32, self.boundary, self.step, self.microbatch)


def kept_dims(H: int, p: float) -> int:
    """K = round((1 - p) * H): dims kept per token. ValueError if p is outside [0, 1),
    H < 1, or K < 1 (p too close to 1 for this H)."""
    if isinstance(H, torch.SymInt):  # under torch.compile: K is a function of H, specialize
        H = int(H)
    Hi = _as_int(H)  # numpy scalars count as plain numbers
    if Hi is None or not 1 <= Hi <= _MAX_H:
        raise ValueError(f"hidden size H must be an int in [1, {_MAX_H}], got {H!r}")
    H, p = Hi, fraction("drop probability p", p)
    K = round((1.0 - p) * H)
    if K < 1:
        raise ValueError(f"p={p} keeps K=round((1-p)*H)={K} < 1 of H={H} dims; lower p")
    return K


# ----------------------------------------------------------------------------------
# Internal torch ops (namespace meshkern). The key travels as five ints because a
# 64-bit unsigned seed does not fit one schema int.
# ----------------------------------------------------------------------------------

def _key_words(seed_lo, seed_hi, boundary, step, microbatch):
    """Validated (k0, k1, step, tag) Philox key/counter words; ValueError for a malformed key."""
    for name, value in (("seed_lo", seed_lo), ("seed_hi", seed_hi)):
        if not 0 <= value < 2**32:
            raise ValueError(f"malformed key: {name}={value} outside [0, 2**32)")
    MaskKey(seed=(seed_hi << 32) | seed_lo, boundary=boundary, step=step, microbatch=microbatch)
    return seed_lo, seed_hi, step, (boundary << 16) | microbatch


def _rows(x: Tensor) -> int:
    n = x.shape[:-1].numel()
    if n > _MAX_ROWS:
        raise ValueError(f"{n} token rows exceed the mask's 2**32 row counter")
    return n


def _scale(H: int, K: int, rescale: bool) -> float | None:
    return H / K if rescale else None


def _impl(op: str, device: torch.device, backend: str):
    """The kernel function of ``op`` on the chosen backend."""
    name = _backend.resolve("mask", device, None if backend == "auto" else backend)
    if name == "reference":
        return name, None
    if name in ("cpp", "cuda"):
        _backend.extension("mask")
        fn = getattr(torch.ops.meshkern_C, f"mask_{op}", None)
        if fn is None:  # an extension built from older sources
            if backend != "auto":
                raise RuntimeError("meshkern._mask_C has no mask kernels (stale build): rebuild the extension")
            return "reference", None
        return name, fn
    from meshkern.triton_kernels import mask as tk  # noqa: PLC0415 (triton is optional)
    return name, getattr(tk, op)


@torch.library.custom_op("meshkern::mask_indices", mutates_args=())
def _indices_op(seed_lo: int, seed_hi: int, boundary: int, step: int, microbatch: int,
                T: int, H: int, p: float, device: torch.device, backend: str) -> Tensor:
    words = _key_words(seed_lo, seed_hi, boundary, step, microbatch)
    K = kept_dims(H, p)
    if not 0 <= T <= _MAX_ROWS:
        raise ValueError(f"T={T} token rows must be in [0, 2**32]")
    device = torch.device(device)
    name, fn = _impl("indices", device, backend)
    if fn is None:
        return _ref.indices(words, T, H, K).to(device)
    out = torch.empty(T, K, dtype=torch.int64, device=device)
    if name == "triton":
        fn(out, words, H)
    else:
        fn(out, *words, H)
    return out


@_indices_op.register_fake
def _(seed_lo, seed_hi, boundary, step, microbatch, T, H, p, device, backend):
    K = kept_dims(H, p)
    return torch.empty(T, K, dtype=torch.int64, device=device)


@torch.library.custom_op("meshkern::mask_pack", mutates_args=())
def _pack_op(h: Tensor, seed_lo: int, seed_hi: int, boundary: int, step: int, microbatch: int,
             p: float, rescale: bool, backend: str) -> Tensor:
    float_tensor("h", h, min_dim=1)
    words = _key_words(seed_lo, seed_hi, boundary, step, microbatch)
    H = h.shape[-1]
    K = kept_dims(H, p)
    _rows(h)
    h = h.contiguous()
    name, fn = _impl("pack", h.device, backend)
    if fn is None:
        return _ref.pack(h, words, K, _scale(H, K, rescale))
    if name == "triton":
        return fn(h, words, K, _scale(H, K, rescale))
    out = fn(h.reshape(h.shape[:-1].numel(), H), *words, K, H / K, rescale)
    return out.reshape(*h.shape[:-1], K)


@_pack_op.register_fake
def _(h, seed_lo, seed_hi, boundary, step, microbatch, p, rescale, backend):
    float_tensor("h", h, min_dim=1)
    K = kept_dims(h.shape[-1], p)
    return h.new_empty(*h.shape[:-1], K)


@torch.library.custom_op("meshkern::mask_unpack", mutates_args=())
def _unpack_op(v: Tensor, seed_lo: int, seed_hi: int, boundary: int, step: int, microbatch: int,
               H: int, p: float, rescale: bool, backend: str) -> Tensor:
    _check_unpack(v, H, p)
    words = _key_words(seed_lo, seed_hi, boundary, step, microbatch)
    K = v.shape[-1]
    v = v.contiguous()
    name, fn = _impl("unpack", v.device, backend)
    if fn is None:
        return _ref.unpack(v, words, H, _scale(H, K, rescale))
    if name == "triton":
        return fn(v, words, H, _scale(H, K, rescale))
    out = fn(v.reshape(v.shape[:-1].numel(), K), *words, H, H / K, rescale)
    return out.reshape(*v.shape[:-1], H)


def _check_unpack(v: Tensor, H: int, p: float) -> int:
    float_tensor("v", v, min_dim=1)
    K = kept_dims(H, p)
    if v.shape[-1] != K:
        raise ValueError(f"v has {v.shape[-1]} values per token but H={H}, p={p} keeps K={K}: "
                         f"H or p does not match the pack that produced v")
    _rows(v)
    return K


@_unpack_op.register_fake
def _(v, seed_lo, seed_hi, boundary, step, microbatch, H, p, rescale, backend):
    _check_unpack(v, H, p)
    return v.new_empty(*v.shape[:-1], H)


# Autograd: pack and unpack (same key, H, p, rescale) are adjoint, so each one's
# backward is the other applied to the incoming gradient.

def _setup_pack(ctx, inputs, output):
    h, *key, p, rescale, backend = inputs
    ctx.args = (key, h.shape[-1], p, rescale, backend)


def _backward_pack(ctx, grad):
    key, H, p, rescale, backend = ctx.args
    g = _unpack_op(grad.contiguous(), *key, H, p, rescale, backend)
    return (g,) + (None,) * 8


def _setup_unpack(ctx, inputs, output):
    v, *key, H, p, rescale, backend = inputs
    ctx.args = (key, p, rescale, backend)


def _backward_unpack(ctx, grad):
    key, p, rescale, backend = ctx.args
    g = _pack_op(grad.contiguous(), *key, p, rescale, backend)
    return (g,) + (None,) * 9


_pack_op.register_autograd(_backward_pack, setup_context=_setup_pack)
_unpack_op.register_autograd(_backward_unpack, setup_context=_setup_unpack)


# ----------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------

def _check_key(key) -> MaskKey:
    if not isinstance(key, MaskKey):
        raise TypeError(f"key must be a meshkern.MaskKey, got {type(key).__name__}")
    return key


def _check_device(device) -> torch.device:
    """``device`` as a torch.device that this torch build can allocate on; else ValueError
    naming it (instead of torch's AssertionError "Torch not compiled with CUDA enabled")."""
    device = torch.device(device)
    if device.type not in ("cpu", "meta") and not torch.compiler.is_compiling():
        try:
            torch.empty(0, device=device)
        except (RuntimeError, AssertionError) as e:
            raise ValueError(f"device={str(device)!r} is not usable with this torch build "
                             f"({torch.__version__}): {e}") from None
    return device


def mask_indices(key: MaskKey, T: int, H: int, p: float, *, device="cpu", backend: str | None = "auto") -> Tensor:
    """int64 [T, K]: the dims kept for token rows 0..T-1 (ascending, distinct), K = kept_dims(H, p).

    Row r is what ``pack``/``unpack`` keep for flattened row r. Deterministic in
    (key, T, H, p): identical on every backend and device. T, H: ints (numpy ints too);
    p: a real number. ValueError for a device this torch build cannot use.
    """
    _check_key(key)
    Ti = _as_int(T)
    if Ti is None or Ti < 0:
        raise ValueError(f"T must be a non-negative int, got {T!r}")
    kept_dims(H, p)
    return _indices_op(*key.words(), Ti, _as_int(H), _as_float(p), _check_device(device), _backend_arg(backend))


def pack(h: Tensor, key: MaskKey, p: float, *, rescale: bool = False, backend: str | None = "auto") -> Tensor:
    """[..., T, H] -> [..., T, K]: each token's kept values, in ascending dim order.

    Differentiable (backward = unpack of the gradient). Index generation is fused
    with the gather: no index tensor is written. The result is exactly
    ``h.numel() // H * K`` elements of h's dtype, all that ``unpack`` needs.
    ``rescale=True`` multiplies by H/K (see module docstring).
    """
    _check_key(key)
    float_tensor("h", h, min_dim=1)
    kept_dims(h.shape[-1], p)
    return _pack_op(h, *key.words(), float(p), bool(rescale), _backend_arg(backend))


def unpack(v: Tensor, key: MaskKey, H: int, p: float, *, rescale: bool = False,
           backend: str | None = "auto") -> Tensor:
    """[..., T, K] -> [..., T, H]: values put back at the kept dims, zeros elsewhere.

    Differentiable (backward = pack of the gradient). ValueError if v's last dim is
    not kept_dims(H, p) (H or p differ from the pack side). ``rescale=True``
    multiplies the placed values by H/K.
    """
    _check_key(key)
    _check_unpack(v, H, p)
    return _unpack_op(v, *key.words(), int(H), float(p), bool(rescale), _backend_arg(backend))
