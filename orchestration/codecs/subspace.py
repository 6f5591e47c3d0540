"""``subspace``: subspace-projected boundaries (Protocol Models, arXiv 2506.01260, as used
by arXiv 2601.02360). For a model whose output projections are kept in span(U)
(orchestration.subspace.constraint.constrain_), h - E[ids] lies in span(U), so the sender sends
c = (h - E[ids]) U (k values per token) and the receiver rebuilds h = E[ids] + c U^T
from the token ids it already holds: lossless forward at bits=32 (up to fp32 rounding).
Backward: the receiver sends U^T g, the sender uses U (U^T g), the exact adjoint of the
forward map h -> E[ids] + U U^T (h - E[ids]) (see docs/codecs.md for what that means
for each parameter's gradient)."""
from __future__ import annotations

import torch

from meshkern import subspace as ops
from meshkern._checks import boundary_shape
from orchestration.codecs.base import BoundaryCodec, check_direction, optional_width, validate_wire, width
from orchestration.codecs.lowbit import SymQuant, check_bits, packed_bytes

BITS = (2, 3, 4, 5, 6, 7, 8, 16, 32)


def subspace_width(H: int, bits: int = 32, budget: float = 16) -> int:
    """Coordinates k per token that fit B = floor(4H / budget) bytes per token per direction
    (1/budget of dense fp32): bits=32: B // 4; 16: B // 2; 2..8: k codes of ``bits`` bits
    plus one fp32 scale, floor((B - 4) * 8 / bits). At most H. ValueError if none fits."""
    B = int(4 * int(H) // float(budget))
    if bits == 32:
        k = B // 4
    elif bits == 16:
        k = B // 2
    else:
        k = (B - 4) * 8 // bits
    k = min(int(H), k)
    if k < 1:
        raise ValueError(f"subspace: budget={budget} leaves no room for a coordinate at H={H}, bits={bits}")
    return k


class SubspaceCodec(BoundaryCodec):
    """Token-embedding-relative subspace coordinates (module doc).

    ``k`` coordinates per token, explicit or from ``budget`` (``subspace_width``; default
    1/16 of dense fp32 bytes). ``bits``: 32 = fp32 coordinates (exact), 16 = bf16, 2..8 =
    per-token symmetric absmax codes (lowbit.SymQuant: packed codes + one fp32 scale per
    token); ``gbits`` the same for the gradient (default: ``bits``). ``seed`` and ``basis``
    (fitted: to the base model's output projections; random: seeded) are recorded for the
    trainer (orchestration.subspace.training makes U); the codec itself draws nothing.
    ``backend``: meshkern.subspace's kernel choice.

    Needs, before encode/decode: ``attach(embedding [V, H], U [H, k])`` (the frozen token
    embedding table and the basis, identical on both sides) and, every step,
    ``bind_inputs(input_ids per micro-batch)`` (the pipeline executor calls it); the key's
    ``microbatch`` picks the ids.

    Wire per direction, for a boundary tensor [..., T, H]: bits=32: [..., T, k] fp32;
    16: [..., T, k] bf16; b in 2..8: [..., T, ceil(k b / 8)] uint8 + [..., T, 1] fp32.
    """

    name = "subspace"

    def __init__(self, k: int | None = None, budget: float | None = None, bits: int = 32, gbits: int | None = None,
                 seed: int = 0, basis: str = "fitted", backend: str = "auto"):
        if k is not None and budget is not None:
            raise ValueError("subspace: give k or budget, not both")
        if budget is not None and float(budget) <= 0:
            raise ValueError(f"subspace: budget must be > 0, got {budget}")
        self.bits = check_bits("subspace: bits", bits, BITS)
        self.gbits = self.bits if gbits is None else check_bits("subspace: gbits", gbits, BITS)
        self.k = optional_width("subspace: k", k)
        self.budget = None if k is not None else float(16 if budget is None else budget)
        if basis not in ("fitted", "random"):
            raise ValueError(f"subspace: basis must be fitted or random, got {basis!r}")
        self.seed, self.basis, self.backend = int(seed), str(basis), str(backend)
        self._E: torch.Tensor | None = None
        self._U: torch.Tensor | None = None
        self._dev: dict = {}
        self._ids: list[torch.Tensor] | None = None

    def __repr__(self) -> str:
        return (f"SubspaceCodec(k={self.k}, budget={self.budget}, bits={self.bits}, gbits={self.gbits}, "
                f"seed={self.seed}, attached={self._E is not None})")

    # ------------------------------------------------------------------ setup
    def width(self, H: int) -> int:
        return width("subspace: k", self.k, H, lambda: subspace_width(H, self.bits, self.budget))

    def attach(self, embedding: torch.Tensor, U: torch.Tensor) -> None:
        """The frozen token-embedding table E [V, H] and the orthonormal basis U [H, k]
        (k = this codec's width at H), both identical on the two sides of every boundary.
        Kept as fp32 (no copy when already fp32), and the encode table E U is computed
        here once: E must stay frozen, and a new E or U needs a new ``attach``. ValueError
        for shapes that do not fit, non-finite values or a U whose columns are not
        orthonormal."""
        if not isinstance(embedding, torch.Tensor) or embedding.dim() != 2:
            raise ValueError(f"subspace: embedding must be a [V, H] tensor, got "
                             f"{tuple(embedding.shape) if isinstance(embedding, torch.Tensor) else embedding!r}")
        if not isinstance(U, torch.Tensor) or U.dim() != 2 or U.shape[0] != embedding.shape[1]:
            raise ValueError(f"subspace: U must be [H={embedding.shape[1]}, k], got "
                             f"{tuple(U.shape) if isinstance(U, torch.Tensor) else U!r}")
        H = embedding.shape[1]
        if U.shape[1] != self.width(H):
            raise ValueError(f"subspace: U has k={U.shape[1]} columns, this codec sends k={self.width(H)} "
                             f"coordinates at H={H} (k={self.k}, budget={self.budget}, bits={self.bits})")
        E = embedding.detach().to(torch.float32)
        U = U.detach().to(torch.float32).contiguous()
        for name, t in (("embedding", E), ("U", U)):
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"subspace: {name} holds non-finite values")
        gram = U.T.double() @ U.double()
        err = float((gram - torch.eye(U.shape[1], dtype=torch.float64, device=U.device)).abs().max())
        if err > 1e-4:
            raise ValueError(f"subspace: U's columns are not orthonormal (max |U^T U - I| = {err:.2e})")
        # E is frozen in this mode, so encode keeps T = E U [V, k] and computes
        # h U - T[ids] (k values gathered per token instead of H; bench/subspace_bench.py).
        self._E, self._U, self._dev = E, U, {}
        self._T = ops.projected_table(E, U)

    @property
    def attached(self) -> bool:
        return self._E is not None

    def bind_inputs(self, input_ids) -> None:
        """The step's input ids [B_m, T] per micro-batch (pipeline executor)."""
        self._ids = None if input_ids is None else [t.long() for t in input_ids]

    def _tables(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(E, U, T = E U) on ``device`` (moved once per device)."""
        if self._E is None:
            raise RuntimeError("subspace codec: no token embedding / basis attached: call "
                               "codec.attach(embedding [V, H], U [H, k]) before the first step")
        key = str(device)
        if key not in self._dev:
            self._dev[key] = (self._E.to(device), self._U.to(device), self._T.to(device))
        return self._dev[key]

    def _token_ids(self, key, shape, device) -> torch.Tensor:
        if self._ids is None:
            raise RuntimeError("subspace codec: no input ids bound: call codec.bind_inputs(input ids per "
                               "micro-batch) each step (the pipeline executor does)")
        m = int(key.microbatch)
        if not 0 <= m < len(self._ids):
            raise RuntimeError(f"subspace codec: micro-batch {m} has no bound input ids "
                               f"({len(self._ids)} bound this step)")
        ids = self._ids[m]
        if tuple(ids.shape) != tuple(shape[:-1]):
            raise ValueError(f"subspace codec: bound input ids of micro-batch {m} are {tuple(ids.shape)}, "
                             f"the boundary tensor is {tuple(shape)}")
        return ids.to(device)

    # ------------------------------------------------------------------- wire
    def _specs(self, lead: tuple, k: int, bits: int):
        if bits == 32:
            return [(lead + (k,), torch.float32)]
        if bits == 16:
            return [(lead + (k,), torch.bfloat16)]
        return [(lead + (packed_bytes(k, bits),), torch.uint8), (lead + (1,), torch.float32)]

    def wire_specs(self, shape, dtype, direction):
        check_direction(direction)
        shape = boundary_shape(shape, dtype)
        return self._specs(shape[:-1], self.width(shape[-1]), self.bits if direction == "fwd" else self.gbits)

    @staticmethod
    def _to_wire(c: torch.Tensor, bits: int) -> list[torch.Tensor]:
        if bits == 32:
            return [c.float().contiguous()]
        if bits == 16:
            return [c.to(torch.bfloat16).contiguous()]
        return SymQuant(bits).quantize(c)

    @staticmethod
    def _from_wire(wire, bits: int, shape) -> torch.Tensor:
        if bits in (16, 32):
            return wire[0].float()
        return SymQuant(bits).dequantize(wire, shape)

    # ------------------------------------------------------------ the 4 steps
    def encode_fwd(self, h, key):
        _, U, T = self._tables(h.device)
        ids = self._token_ids(key, h.shape, h.device)
        c = ops.encode(h.detach().float(), ids, None, U, table=T, backend=self.backend)
        return self._to_wire(c, self.bits), (tuple(h.shape), h.dtype)

    def decode_fwd(self, wire, key, shape, dtype):
        shape = tuple(shape)
        validate_wire(wire, self.wire_specs(shape, dtype, "fwd"), "subspace decode_fwd")
        E, U, _ = self._tables(wire[0].device)
        ids = self._token_ids(key, shape, wire[0].device)
        c = self._from_wire(wire, self.bits, shape[:-1] + (U.shape[1],))
        return ops.decode(c, ids, E, U, backend=self.backend).to(dtype)

    def encode_bwd(self, grad, key, meta):
        # d h_hat / d h = U U^T: the sender needs U (U^T g); k values per token travel.
        _, U, _ = self._tables(grad.device)
        return self._to_wire(ops.project(grad.detach().float(), U), self.gbits)

    def decode_bwd(self, wire, key, ctx):
        shape, dtype = ctx
        validate_wire(wire, self.wire_specs(shape, dtype, "bwd"), "subspace decode_bwd")
        _, U, _ = self._tables(wire[0].device)
        c = self._from_wire(wire, self.gbits, tuple(shape[:-1]) + (U.shape[1],))
        return ops.lift(c, U).to(dtype)
