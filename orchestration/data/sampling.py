"""Packed token rows: ``pack`` (token lists -> int64 [N, seq_len]), ``TokenDataset``
(split, shard, batches) and the trainer's rules on rows: ``shard_rows`` (which rows a
data-parallel replica owns), ``epoch_permutation`` (the seeded order of one epoch) and
``BatchSampler`` (the batch of step s, stateless). orchestration.data.tokens builds the rows."""
from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np
import torch


def shard_rows(rows: torch.Tensor, index: int, count: int) -> torch.Tensor:
    """The sharding rule: rows ``index, index + count, ...`` (``count`` disjoint strided
    shards covering every row). TokenDataset.shard and the trainer's data-parallel
    replicas both use it."""
    return rows[index::count]


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The order in which epoch ``epoch`` visits ``n`` rows: a permutation seeded by
    (seed, epoch) alone. TokenDataset.batches and BatchSampler both use it."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


class BatchSampler:
    """Stateless: the batch of step s is a pure function of (rows, seed, s), so a resumed
    run sees exactly the batches the uninterrupted run would have seen. Each epoch
    visits ``rows`` in ``epoch_permutation(len(rows), seed, epoch)`` and drops the last
    partial batch (TokenDataset.batches' order, addressable by step)."""

    def __init__(self, rows: torch.Tensor, batch_size: int, seed: int):
        self.rows, self.B, self.seed = rows, batch_size, seed
        self.per_epoch = len(rows) // batch_size
        self._perm_epoch, self._perm = -1, None

    def indices(self, step: int) -> torch.Tensor:
        """int64 [batch_size]: which of ``rows`` make up the batch of step s. A row's index
        is the sample's stable id for the run (what per-sample codecs such as aqsgd key
        their stores by: the same row gets the same id in every epoch)."""
        epoch, i = divmod(step, self.per_epoch)
        if epoch != self._perm_epoch:
            self._perm, self._perm_epoch = epoch_permutation(len(self.rows), self.seed, epoch), epoch
        return self._perm[i * self.B:(i + 1) * self.B]

    def __call__(self, step: int) -> torch.Tensor:
        return self.rows[self.indices(step)]


class TokenDataset(torch.utils.data.Dataset):
    """Packed token sequences: ``tokens`` is int64 ``[N, seq_len]``, N >= 1.

    Rows are independent training examples (labels = inputs; the model shifts).
    ``split`` and ``shard`` return new datasets that share no rows; both are pure
    functions of their arguments.
    """

    def __init__(self, tokens: torch.Tensor):
        if not isinstance(tokens, torch.Tensor):
            raise TypeError(f"tokens must be a torch.Tensor, got {type(tokens).__name__}")
        if tokens.dim() != 2 or tokens.dtype != torch.int64:
            raise ValueError(f"tokens must be int64 [N, seq_len], got {tokens.dtype} {tuple(tokens.shape)}")
        if tokens.shape[0] < 1 or tokens.shape[1] < 1:
            raise ValueError(f"tokens must be non-empty, got shape {tuple(tokens.shape)}")
        self.tokens = tokens.contiguous()

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i):
        return self.tokens[i]

    def __repr__(self) -> str:
        return f"TokenDataset(rows={len(self)}, seq_len={self.seq_len})"

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()

    def split(self, eval_fraction: float, *, seed: int = 0) -> tuple["TokenDataset", "TokenDataset"]:
        """(train, held_out): a seeded random choice of ``max(1, round(f*N))`` rows is
        held out, spread over the whole source (not its tail, which for a sorted corpus
        would be one package or module); both keep the original row order."""
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        n = len(self)
        n_eval = max(1, round(eval_fraction * n))
        if n_eval >= n:
            raise ValueError(f"cannot hold out {n_eval} of {n} rows and keep any for training; "
                             "use more data, a shorter seq_len or a smaller eval_fraction")
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        held = perm[:n_eval].sort().values
        keep = perm[n_eval:].sort().values
        return TokenDataset(self.tokens[keep]), TokenDataset(self.tokens[held])

    def shard(self, index: int, count: int) -> "TokenDataset":
        """Rows ``index, index+count, ...``: the ``count`` shards are disjoint and cover
        every row; each holds ``N // count`` or ``N // count + 1`` rows. Give each fast
        replica and the anchor its own index (e.g. replicas 0..X-2, anchor X-1)."""
        if not (isinstance(count, int) and count >= 1):
            raise ValueError(f"shard count must be a positive int, got {count!r}")
        if not (isinstance(index, int) and 0 <= index < count):
            raise ValueError(f"shard index must be in [0, {count}), got {index!r}")
        if len(self) < count:
            raise ValueError(f"cannot shard {len(self)} rows {count} ways (a shard would be empty); "
                             "use more data or a shorter seq_len")
        return TokenDataset(shard_rows(self.tokens, index, count))

    def batches(self, batch_size: int, *, seed: int = 0, epochs: int | None = None
                ) -> Iterator[torch.Tensor]:
        """Yield int64 ``[batch_size, seq_len]`` batches; each epoch visits the rows in a
        fresh permutation seeded by (seed, epoch) and drops the last partial batch.
        ``epochs=None`` repeats forever. Deterministic for a fixed seed."""
        if not (isinstance(batch_size, int) and 1 <= batch_size <= len(self)):
            raise ValueError(f"batch_size must be in [1, {len(self)}] (rows in this dataset), got {batch_size!r}")
        epoch = 0
        while epochs is None or epoch < epochs:
            perm = epoch_permutation(len(self), seed, epoch)
            for start in range(0, len(self) - batch_size + 1, batch_size):
                yield self.tokens[perm[start:start + batch_size]]
            epoch += 1


def pack(token_lists: Sequence[Sequence[int]], seq_len: int, *, separator: int | None = None,
         max_tokens: int | None = None) -> torch.Tensor:
    """Concatenate documents (each followed by ``separator`` if given) and cut the
    stream into ``[N, seq_len]`` rows; the tail shorter than seq_len is dropped."""
    parts = []
    for ids in token_lists:
        parts.append(np.asarray(ids, dtype=np.int64))
        if separator is not None:
            parts.append(np.asarray([separator], dtype=np.int64))
    stream = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return _rows(stream[:max_tokens] if max_tokens is not None else stream, seq_len)


def _rows(stream: np.ndarray, seq_len: int) -> torch.Tensor:
    """int64 ``[len(stream) // seq_len, seq_len]``: the stream cut into rows, tail dropped."""
    if not (isinstance(seq_len, int) and seq_len >= 2):
        raise ValueError(f"seq_len must be an int >= 2, got {seq_len!r}")
    n = len(stream) // seq_len
    if n < 1:
        raise ValueError(f"source yields {len(stream)} tokens, fewer than one sequence of "
                         f"seq_len={seq_len}; use more text or a shorter seq_len")
    return torch.from_numpy(stream[: n * seq_len].astype(np.int64).reshape(n, seq_len))
