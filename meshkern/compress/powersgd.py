"""PowerSGD low-rank compression (Vogels et al. 2019) as a :class:`Compressor`.

For each matrix-shaped tensor G (viewed as [shape[0], -1], like torch's DDP hook),
with error feedback E and warm-started Q (one power-iteration step per call):

    M = G + E;  P = M Q;  all_reduce(P);  P = orth(P);  Q = M^T P;
    all_reduce(Q) / world;  M_hat = P Q^T;  E = M - M_hat;  return M_hat

which is exactly the math of ``torch.distributed.algorithms.ddp_comm_hooks.
powerSGD_hook`` (P is summed, not averaged, since orthogonalization ignores scale).
Same-shape matrices are stacked and processed with one batched matmul per shape.
Tensors for which rank r does not pay (``(n+m)*r*min_compression_rate >= n*m``) and
1-D tensors travel uncompressed, exactly averaged, in the same all_reduce as the Ps.
The initial Q of every (key, shape group) comes from a generator seeded by ``seed``,
the key and the shapes, so all replicas start from the same Q without sending it.
Half-precision inputs are compressed in fp32 (``compute_dtype``) and cast back.
A non-finite input on any rank never gets here (meshkern.compress.base: all ranks get
all-NaN, the state is untouched). Non-finite all-reduced factors that arise anyway
(overflow in the sums; every rank sees the same sums) give a non-finite result for that
shape group, which callers skip (StreamingDiLoCo does), while the error feedback keeps
the whole unsent M and Q restarts from the seed: the state is never poisoned.
"""
from __future__ import annotations

import zlib
from collections import OrderedDict

import torch
from torch import Tensor

from meshkern.compress.base import Compressor
from meshkern.linalg import cholesky_qr2
from meshkern.compress.powersgd_ops import powersgd_ef_project, powersgd_reconstruct

ORTHOGONALIZATIONS = ("auto", "gram_schmidt", "qr", "cholesky_qr2")


def orthogonalize(mats: Tensor, method: str = "auto", eps: float = 0.0) -> Tensor:
    """Orthonormalize the columns of each matrix of ``mats`` [B, n, r] (n >= r) in place.

    "auto" follows torch's PowerSGD hook: Gram-Schmidt for r <= 2 or half precision
    (QR has no half kernel), Householder QR otherwise. "cholesky_qr2" (two rounds of
    Cholesky-QR, fast on GPUs for tall-skinny blocks; meshkern.linalg.cholesky_qr2) falls
    back to QR for every matrix it cannot make orthonormal (ill-conditioned or
    rank-deficient), so the result is orthonormal whatever the method. ``eps`` is added to column norms in Gram-Schmidt
    to survive all-zero columns. Returns ``mats``.
    """
    if mats.dim() != 3 or mats.shape[2] > mats.shape[1]:
        raise ValueError(f"orthogonalize expects [B, n, r] with r <= n, got {tuple(mats.shape)}")
    if method not in ORTHOGONALIZATIONS:
        raise ValueError(f"unknown orthogonalization {method!r}; choose one of {ORTHOGONALIZATIONS}")
    r = mats.shape[2]
    if method == "auto":
        method = "gram_schmidt" if r <= 2 or mats.dtype in (torch.float16, torch.bfloat16) else "qr"
    if method == "gram_schmidt":
        for i in range(r):
            col = mats[:, :, i:i + 1]
            col /= torch.linalg.vector_norm(col, dim=1, keepdim=True) + eps
            if i + 1 < r:
                rest = mats[:, :, i + 1:]
                rest -= torch.sum(col * rest, dim=1, keepdim=True) * col
        return mats
    if method == "cholesky_qr2":
        mats.copy_(cholesky_qr2(mats))
        return mats
    q, _ = torch.linalg.qr(mats)
    mats.copy_(q)
    return mats


def should_compress(n: int, m: int, rank: int, min_compression_rate: float) -> bool:
    """Whether an [n, m] matrix is worth sending as rank-``rank`` factors (torch's rule)."""
    return (n + m) * rank * min_compression_rate < n * m


def _seed_for(seed: int, key: str, shape: tuple) -> int:
    return (int(seed) * 1_000_003 + zlib.crc32(f"{key}|{shape}".encode())) % (2**63 - 1)


class PowerSGD(Compressor):
    """Rank-``rank`` PowerSGD with error feedback and warm start (see module docstring).

    Args:
        rank: target rank r (per matrix: min(r, n, m)).
        min_compression_rate: compress a matrix only if n*m > rate*(n+m)*r.
        error_feedback, warm_start: as in torch's hook (both on by default).
        seed: seed of the shared initial Q (must match on all replicas).
        orthogonalization: "auto" | "gram_schmidt" | "qr" | "cholesky_qr2".
        eps: Gram-Schmidt norm epsilon.
        compute_dtype: dtype of the factors for half-precision inputs.
        backend: backend of the fused ops (see meshkern.compress.powersgd_ops).
    """

    def __init__(self, rank: int = 4, *, min_compression_rate: float = 2.0, error_feedback: bool = True,
                 warm_start: bool = True, seed: int = 0, orthogonalization: str = "auto", eps: float = 0.0,
                 compute_dtype: torch.dtype = torch.float32, backend: str = "auto", timeout_s: float = 300.0):
        super().__init__(timeout_s=timeout_s)
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be a positive int, got {rank!r}")
        if orthogonalization not in ORTHOGONALIZATIONS:
            raise ValueError(f"unknown orthogonalization {orthogonalization!r}; choose one of {ORTHOGONALIZATIONS}")
        if min_compression_rate < 0:
            raise ValueError(f"min_compression_rate must be >= 0, got {min_compression_rate}")
        if compute_dtype not in (torch.float32, torch.float64):
            raise TypeError(f"compute_dtype must be torch.float32 or torch.float64, got {compute_dtype}")
        from meshkern._backend import requested_name

        requested_name(backend)  # the name only: availability is checked per call (device-dependent)
        self.rank = rank
        self.min_compression_rate = float(min_compression_rate)
        self.error_feedback = error_feedback
        self.warm_start = warm_start
        self.seed = seed
        self.orthogonalization = orthogonalization
        self.eps = eps
        self.compute_dtype = compute_dtype
        self.backend = backend
        # key -> "n x m" -> {"q": [B,m,r], "err": [B,n,m]}
        self._state: dict[str, dict[str, dict[str, Tensor]]] = {}

    # ---- planning -----------------------------------------------------------------------
    def _plan(self, shapes):
        """(groups: OrderedDict[(n,m,r) -> [indices]], uncompressed: [indices])."""
        groups: OrderedDict = OrderedDict()
        unc = []
        for i, shape in enumerate(shapes):
            shape = tuple(shape)
            numel = int(torch.Size(shape).numel())
            if len(shape) < 2 or numel == 0:
                unc.append(i)
                continue
            n = shape[0]
            m = numel // n
            r = min(n, m, self.rank)
            if should_compress(n, m, r, self.min_compression_rate):
                groups.setdefault((n, m, r), []).append(i)
            else:
                unc.append(i)
        return groups, unc

    def payload_bytes_for(self, shapes, dtype=torch.float32):
        groups, unc = self._plan(shapes)
        wire = self.compute_dtype if dtype in (torch.float16, torch.bfloat16) else dtype
        n_unc = sum(int(torch.Size(shapes[i]).numel()) for i in unc) * dtype.itemsize
        n_pq = sum(len(ix) * (n + m) * r for (n, m, r), ix in groups.items()) * wire.itemsize
        return n_unc + n_pq

    def initial_q(self, key: str, n: int, m: int, r: int, batch: int) -> Tensor:
        """The shared initial Q [batch, m, r] (fp64 normal samples, before
        orthogonalization) of shape group (n, m, r) under ``key``: a pure function of
        (seed, key, shapes), identical on every replica."""
        g = torch.Generator().manual_seed(_seed_for(self.seed, key, (batch, n, m, r)))
        return torch.randn(batch, m, r, generator=g, dtype=torch.float64)

    # ---- the algorithm --------------------------------------------------------------------
    def _all_reduce_mean(self, tensors, group, world, key):
        groups, unc = self._plan([t.shape for t in tensors])
        state = self._state.setdefault(key, {})
        out: list[Tensor | None] = [None] * len(tensors)
        dev = tensors[0].device

        work = []  # per group: (indices, M-or-error buffer, P, Q, compute dtype)
        for (n, m, r), idx in groups.items():
            dt = tensors[idx[0]].dtype
            cd = self.compute_dtype if dt in (torch.float16, torch.bfloat16) else dt
            gkey = f"{n}x{m}x{r}"
            st = state.get(gkey, {})
            prev_q, prev_err = st.get("q"), st.get("err")
            had = [t.shape[0] for t in (prev_q, prev_err) if t is not None and t.numel()]
            if had and had[0] != len(idx):
                raise ValueError(f"PowerSGD key {key!r}: shape group {gkey} had {had[0]} matrices, "
                                 f"now {len(idx)}; use a different key for a different tensor list")
            grads = torch.stack([tensors[i].reshape(n, m).to(cd) for i in idx])
            if prev_q is None or not self.warm_start:
                q = self.initial_q(key, n, m, r, len(idx)).to(device=dev, dtype=cd)
            else:
                q = prev_q
            orthogonalize(q, self.orthogonalization, self.eps)
            if self.error_feedback:
                err = prev_err if prev_err is not None and prev_err.numel() else torch.zeros_like(grads)
                p = powersgd_ef_project(grads, err, q, backend=self.backend)
            else:
                err = grads
                p = torch.bmm(err, q)
            work.append((idx, err, p, q, cd))

        # One all_reduce carries the uncompressed tensors (exact mean) and all the Ps.
        # (Mixed dtypes: one buffer per dtype; the usual case is a single fp32 buffer.)
        reduced = self._reduce_parts([tensors[i].reshape(-1) for i in unc] + [w[2].reshape(-1) for w in work],
                                     group, "all_reduce of P (+ uncompressed tensors)")
        for j, i in enumerate(unc):
            out[i] = reduced[j].view(tensors[i].shape).div_(world).to(tensors[i].dtype)

        for (idx, err, p, q, cd), p_sum in zip(work, reduced[len(unc):]):
            p.copy_(p_sum.view(p.shape))
            orthogonalize(p, self.orthogonalization, self.eps)
            torch.bmm(err.transpose(1, 2), p, out=q)
        q_sums = self._reduce_parts([w[3].reshape(-1) for w in work], group, "all_reduce of Q") if work else []

        for (n, m, r), (idx, err, p, q, cd), q_sum in zip(groups, work, q_sums):
            q.copy_(q_sum.view(q.shape)).div_(world)
            keep_err = err if self.error_feedback else torch.zeros(0)
            if bool(torch.isfinite(p).all() & torch.isfinite(q).all()):  # one host sync
                mhat = powersgd_reconstruct(p, q, err, backend=self.backend)
                state[f"{n}x{m}x{r}"] = {"q": q, "err": keep_err}
            else:
                # Garbage from a peer (every rank sees the same sums): return non-finite
                # so the caller skips this round, keep err = M (nothing was applied, so
                # everything carries over) and drop Q so the next round restarts from
                # the shared seed on every rank.
                mhat = torch.full_like(err, float("nan"))
                state[f"{n}x{m}x{r}"] = {"err": keep_err}
            for b, i in enumerate(idx):
                out[i] = mhat[b].view(tensors[i].shape).to(tensors[i].dtype)
        return out

    def _reduce_parts(self, parts: list[Tensor], group, what: str) -> list[Tensor]:
        """SUM all-reduce of 1-D ``parts`` (one buffer per dtype); returns the reduced
        slices in the order of ``parts`` (the inputs are not modified)."""
        result: list[Tensor | None] = [None] * len(parts)
        for dtype in dict.fromkeys(p.dtype for p in parts):
            idx = [j for j, p in enumerate(parts) if p.dtype == dtype]
            flat = torch.cat([parts[j] for j in idx])
            self._all_reduce(flat, group, f"{what} ({dtype})")
            o = 0
            for j in idx:
                result[j] = flat[o:o + parts[j].numel()]
                o += parts[j].numel()
        return result

    # ---- state ------------------------------------------------------------------------
    def clear_error_feedback(self) -> None:
        """Drops every shape group's error buffer (the next round starts it at zero) and
        keeps its warm-start Q, which every replica holds alike."""
        for streams in self._state.values():
            for st in streams.values():
                st.pop("err", None)

    def _state_dict(self):
        # copies: later calls update the error feedback / warm-start factors in place
        return {k: {g: {n: t.detach().clone() for n, t in v.items()} for g, v in d.items()} for k, d in self._state.items()}

    def _load_state_dict(self, sd):
        self._state = {k: {g: {n: t.clone() for n, t in v.items()} for g, v in d.items()} for k, d in sd.items()}
