"""The model and the rows under diagnosis, and the forward measurement.

Rows are the trainer's (``orchestration.data.tokens.build_token_dataset`` and its held-out rule
``ds.split(eval_fraction, seed=split_seed)``); ``LayerSplit`` cuts the model after every
decoder layer so any boundary's hidden state can be taken, changed and run on, and
running all its stages reproduces the unsplit model's logits bit for bit.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from orchestration.diagnose.common import EVAL_FRACTION, SPLIT_SEED, UsageError
from orchestration.diagnose.transforms import Fn
from orchestration.distributed.stages import causal_lm_loss, split_model


def pick_rows(rows: torch.Tensor, n: int, seed: int, skip: int = 0) -> torch.Tensor:
    """Rows ``skip .. skip+n-1`` of a seeded permutation of ``rows`` (spread over the source)."""
    perm = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(seed))
    if skip + n > rows.shape[0]:
        raise UsageError(f"need {skip + n} rows but the split has only {rows.shape[0]}; use more data or fewer rows")
    return rows[perm[skip:skip + n]]


def load_data(model_path: str, source: str, seq_len: int, *, eval_fraction: float = EVAL_FRACTION,
              split_seed: int = SPLIT_SEED, max_sequences: int = 0, token_cache: str | None = "auto"):
    """(train_rows, held_out_rows) exactly as ``orchestration.launch.prepare`` builds them."""
    from orchestration.data import tokens as data_mod
    from orchestration.models import loading as models

    if not source.startswith(("corpus:", "task:")) and not os.path.exists(source):
        raise UsageError(f"--data {source!r} does not exist")
    if token_cache == "auto":
        token_cache = str(models.cache_root() / "tokens")
    ds = data_mod.build_token_dataset(source, model_path, seq_len,
                                      max_tokens=max_sequences * seq_len if max_sequences else None,
                                      token_cache=token_cache or None)
    train, held = ds.split(eval_fraction, seed=split_seed)
    return train.tokens, held.tokens


def resolve_and_load(spec: str | None):
    """(model in eval mode, fp32, checkpoint directory) for ``--model`` as the trainer reads it."""
    from orchestration.models import paths as model_paths
    from orchestration.models import loading as models

    path = model_paths.resolve_model(spec or None, progress=True)
    model, tok = models.load_causal_lm(path, boundary=False)  # split by layers: the plain model
    if tok is None:
        raise UsageError(f"--model {path}: the checkpoint holds no tokenizer")
    return model, str(path)


class LayerSplit:
    """The model cut after every decoder layer (``split_model`` with one layer per stage).

    Boundary L (1 <= L < n) is the hidden state entering decoder layer L, i.e. leaving
    stage L-1; ``prefix(ids, L)`` runs stages [0, L), ``suffix(h, L)`` stages [L, n) to
    logits. Running all stages reproduces the unsplit model's logits bit for bit
    (orchestration/distributed/stages.py). The stages share their modules with ``model``.
    """

    def __init__(self, model):
        self.model = model
        self.n = model.config.num_hidden_layers
        self.hidden_size = model.config.hidden_size
        self.stages = split_model(model, self.n, [1] * self.n)
        self.embed = self.stages[0].embed_tokens

    def check_boundary(self, L: int) -> int:
        if not 1 <= int(L) < self.n:
            raise UsageError(f"boundary {L} is not between two decoder layers (1..{self.n - 1})")
        return int(L)

    def prefix(self, ids: torch.Tensor, L: int) -> torch.Tensor:
        x = ids
        for st in self.stages[:L]:
            x = st(x)
        return x

    def suffix(self, h: torch.Tensor, L: int) -> torch.Tensor:
        for st in self.stages[L:]:
            h = st(h)
        return h

    def all_hidden(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """[h_1, ..., h_{n-1}] (index L-1 = boundary L), no grad."""
        out, x = [], ids
        with torch.no_grad():
            for st in self.stages[:-1]:
                x = st(x)
                out.append(x)
        return out

    def named_params(self, lo: int, hi: int):
        """(unsplit-model name, param) of stages [lo, hi)."""
        for st in self.stages[lo:hi]:
            yield from st.hf_named_parameters()


def row_losses(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of every row [B] (fp32)."""
    ce = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                         reduction="none")
    return ce.reshape(ids.shape[0], -1).mean(dim=1)


@torch.no_grad()
def forward_loss(split: LayerSplit, h: torch.Tensor, L: int, ids: torch.Tensor, fn: Fn | None = None
                 ) -> tuple[float, torch.Tensor]:
    """(held-out loss, per-row losses) with ``fn`` applied to the hidden state h at boundary L."""
    logits = split.suffix(h if fn is None else fn(h, ids), L)
    return float(causal_lm_loss(logits, ids)), row_losses(logits, ids)
