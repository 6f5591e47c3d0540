"""Text sources -> tokens -> packed fixed-length sequences, split and sharded.

One job: turn whatever text the user points at into a :class:`TokenDataset` (an int64
tensor ``[N, seq_len]``) that the trainer can split into train/held-out rows and shard
across the fast replicas and the anchor.

Sources (``load_texts``):
  - a text file (UTF-8; ``.gz`` files are decompressed), a directory (every regular,
    non-hidden file below it, in sorted path order),
  - a ``.jsonl`` file (one JSON object per line, text in ``text_field``),
  - Hugging Face ``datasets``: a ``Dataset``/``DatasetDict`` object, a directory written
    by ``save_to_disk``, or a local ``.json``/``.csv``/``.parquet``/``.arrow`` file
    loaded with ``datasets.load_dataset`` (never from the hub),
  - ``"corpus:<domain>"`` (an embedded corpus, see ``orchestration.corpora``) and
    ``"task:<name>"`` (a synthetic task, see ``orchestration.tasks``),
  - a list/tuple of strings (the documents themselves).

Tokenizers (``load_tokenizer``): the model's own tokenizer from its directory
(``AutoTokenizer`` with ``local_files_only=True``), a ``tokenizers.Tokenizer`` or a
byte-level BPE trained offline with :func:`train_bpe`.

Everything here is deterministic: same source + tokenizer + arguments -> same tensor.
"""
from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

# The hub must never be contacted: the machines this runs on have no network, and a
# default that silently downloads would behave differently on each one.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

_DATASETS_SUFFIXES = {".json": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
_SPECIAL = "<|endoftext|>"


# --------------------------------------------------------------------------- sources
def read_text_file(path: str | os.PathLike, *, on_decode_error: str = "raise") -> str | None:
    """Read one UTF-8 text file (``.gz`` transparently decompressed).

    ``on_decode_error="raise"`` (default) raises ValueError naming the file if it is not
    valid UTF-8 (a binary file, a Latin-1 file); ``"skip"`` returns None instead.
    """
    path = Path(path)
    data = path.read_bytes()
    if path.suffix == ".gz":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as e:
            if on_decode_error == "skip":
                return None
            raise ValueError(f"{path}: not a valid gzip file ({e})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        if on_decode_error == "skip":
            return None
        raise ValueError(
            f"{path}: not valid UTF-8 text (byte {e.start}: {e.reason}); pass "
            "on_decode_error='skip' to ignore undecodable files") from None
    if "\x00" in text:  # valid UTF-8 but binary (NUL bytes never occur in text)
        if on_decode_error == "skip":
            return None
        raise ValueError(f"{path}: contains NUL bytes, looks like a binary file")
    return text


def read_jsonl(path: str | os.PathLike, text_field: str = "text") -> list[str]:
    """Documents from a JSON-lines file: ``obj[text_field]`` of every non-blank line.

    Raises ValueError naming the line number for invalid JSON, a non-object line, a
    missing field (listing the keys that are there) or a non-string value.
    """
    path = Path(path)
    raw = read_text_file(path)
    docs = []
    for lineno, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
        if text_field not in obj:
            raise ValueError(f"{path}:{lineno}: no field {text_field!r} (fields: {sorted(obj)}); "
                             "choose one with text_field=")
        value = obj[text_field]
        if not isinstance(value, str):
            raise ValueError(f"{path}:{lineno}: field {text_field!r} is {type(value).__name__}, "
                             "not a string")
        docs.append(value)
    return docs


def _datasets(what: str):
    try:
        import datasets
    except ImportError:
        raise ImportError(f"reading {what} needs the Hugging Face `datasets` package "
                          "(pip install 'meshkern[data]')") from None
    return datasets


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and ((path / "dataset_info.json").exists() or (path / "state.json").exists()
                              or (path / "dataset_dict.json").exists())


def _texts_from_hf(ds, text_field: str, split: str | None, where: str) -> list[str]:
    datasets = _datasets(where)
    if isinstance(ds, (datasets.DatasetDict, dict)):
        if split is None:
            split = "train" if "train" in ds else sorted(ds)[0]
        if split not in ds:
            raise ValueError(f"{where}: no split {split!r} (splits: {sorted(ds)})")
        ds = ds[split]
    if text_field not in ds.column_names:
        raise ValueError(f"{where}: no column {text_field!r} (columns: {ds.column_names}); "
                         "choose one with text_field=")
    docs = ds[text_field]
    docs = list(docs) if not isinstance(docs, list) else docs
    bad = next((i for i, d in enumerate(docs) if not isinstance(d, str)), None)
    if bad is not None:
        raise ValueError(f"{where}: row {bad} of column {text_field!r} is "
                         f"{type(docs[bad]).__name__}, not a string")
    return docs


def load_texts(source, *, text_field: str = "text", split: str | None = None,
               on_decode_error: str = "raise", cache_dir: str | None = None) -> list[str]:
    """Documents (a list of str, deterministic order) from any supported source.

    See the module docstring for the sources. Raises FileNotFoundError for a path that
    does not exist, ValueError for an empty source (no documents, or only blank ones)
    and for undecodable/malformed input, TypeError for an unsupported source type.
    """
    if on_decode_error not in ("raise", "skip"):
        raise ValueError(f"on_decode_error must be 'raise' or 'skip', got {on_decode_error!r}")
    where = repr(source) if not isinstance(source, (list, tuple)) else "list of texts"
    if isinstance(source, (list, tuple)):
        bad = next((i for i, d in enumerate(source) if not isinstance(d, str)), None)
        if bad is not None:
            raise TypeError(f"document {bad} of the list is {type(source[bad]).__name__}, not str")
        docs = list(source)
    elif _is_hf_dataset(source):
        docs = _texts_from_hf(source, text_field, split, "dataset object")
    elif isinstance(source, str) and source.startswith("corpus:"):
        from orchestration import corpora
        docs = corpora.load_corpus(source[len("corpus:"):])
    elif isinstance(source, str) and source.startswith("task:"):
        from orchestration import tasks
        docs = tasks.task_texts(source[len("task:"):])
    elif isinstance(source, (str, os.PathLike)):
        docs = _texts_from_path(Path(source), text_field, split, on_decode_error, cache_dir)
    else:
        raise TypeError(f"unsupported text source of type {type(source).__name__}: pass a path, "
                        "'corpus:<domain>', 'task:<name>', a datasets.Dataset or a list of str")
    if not any(d.strip() for d in docs):
        raise ValueError(f"{where}: no text found (empty source)")
    return docs


def _is_hf_dataset(obj) -> bool:
    mod = type(obj).__module__ or ""
    return mod.startswith("datasets.")


def _texts_from_path(path: Path, text_field, split, on_decode_error, cache_dir) -> list[str]:
    if not path.exists():
        raise FileNotFoundError(f"text source {str(path)!r} does not exist")
    if _is_saved_dataset(path):
        datasets = _datasets(f"{path} (saved with save_to_disk)")
        return _texts_from_hf(datasets.load_from_disk(str(path)), text_field, split, str(path))
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise ValueError(f"{path}: directory holds no files")
        docs = [read_text_file(f, on_decode_error=on_decode_error) for f in files]
        return [d for d in docs if d is not None]
    if path.suffix == ".jsonl" or path.name.endswith(".jsonl.gz"):
        return read_jsonl(path, text_field)
    if path.suffix in _DATASETS_SUFFIXES:
        datasets = _datasets(f"a {path.suffix} file")
        ds = datasets.load_dataset(_DATASETS_SUFFIXES[path.suffix], data_files=str(path),
                                   split=split or "train", cache_dir=cache_dir)
        return _texts_from_hf(ds, text_field, None, str(path))
    text = read_text_file(path, on_decode_error=on_decode_error)
    if text is None:
        raise ValueError(f"{path}: not decodable as UTF-8 text")
    return [text]


# ------------------------------------------------------------------------ tokenizers
def train_bpe(texts: Sequence[str], vocab_size: int = 2048, *, min_frequency: int = 2):
    """Train a byte-level BPE offline; returns a transformers fast tokenizer.

    Byte-level: every string round-trips (no unknown token). ``<|endoftext|>`` (id 0)
    is the only special token and serves as bos, eos and pad. Deterministic for a fixed
    input (checked in tests/test_data.py). ``save_pretrained(dir)`` writes it next to a
    model so ``AutoTokenizer.from_pretrained(dir)`` loads it.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 257 + 1:
        raise ValueError(f"vocab_size must exceed the 256-byte alphabet + 1 special token, got {vocab_size}")
    texts = [t for t in texts if t]
    if not texts:
        raise ValueError("train_bpe: no text to train on")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=[_SPECIAL], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=_SPECIAL,
                                   eos_token=_SPECIAL, pad_token=_SPECIAL)


def load_tokenizer(tokenizer):
    """A transformers tokenizer from: a tokenizer object (returned as is), a
    ``tokenizers.Tokenizer``, a ``tokenizer.json`` file, or a model/tokenizer directory
    (``AutoTokenizer.from_pretrained(dir, local_files_only=True)``)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

    if isinstance(tokenizer, PreTrainedTokenizerBase):
        return tokenizer
    try:
        from tokenizers import Tokenizer
        if isinstance(tokenizer, Tokenizer):
            return PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    except ImportError:  # pragma: no cover - tokenizers is a hard dependency of transformers
        pass
    if not isinstance(tokenizer, (str, os.PathLike)):
        raise TypeError(f"tokenizer must be a path or a tokenizer object, got {type(tokenizer).__name__}")
    path = Path(tokenizer)
    if not path.exists():
        raise FileNotFoundError(f"tokenizer path {str(path)!r} does not exist")
    if path.is_file():
        if path.suffix != ".json":
            raise ValueError(f"{path}: expected a tokenizer.json file or a directory")
        return PreTrainedTokenizerFast(tokenizer_file=str(path))
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{path}: no usable tokenizer in this directory ({e})") from None


def separator_id(tokenizer) -> int | None:
    """The id appended after every document when packing: eos, else bos, else none."""
    for name in ("eos_token_id", "bos_token_id"):
        tid = getattr(tokenizer, name, None)
        if tid is not None:
            return int(tid)
    return None


def encode_documents(tokenizer, docs: Sequence[str]) -> list[list[int]]:
    """Token ids of each document, without special tokens (fast path: the Rust
    tokenizer's batch encoder, which also skips the max-length warning)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return [e.ids for e in backend.encode_batch(list(docs), add_special_tokens=False)]
    return [tokenizer.encode(d, add_special_tokens=False) for d in docs]


# --------------------------------------------------------------------- the dataset
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
        return TokenDataset(self.tokens[index::count])

    def batches(self, batch_size: int, *, seed: int = 0, epochs: int | None = None
                ) -> Iterator[torch.Tensor]:
        """Yield int64 ``[batch_size, seq_len]`` batches; each epoch visits the rows in a
        fresh permutation seeded by (seed, epoch) and drops the last partial batch.
        ``epochs=None`` repeats forever. Deterministic for a fixed seed."""
        if not (isinstance(batch_size, int) and 1 <= batch_size <= len(self)):
            raise ValueError(f"batch_size must be in [1, {len(self)}] (rows in this dataset), got {batch_size!r}")
        epoch = 0
        while epochs is None or epoch < epochs:
            g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
            perm = torch.randperm(len(self), generator=g)
            for start in range(0, len(self) - batch_size + 1, batch_size):
                yield self.tokens[perm[start:start + batch_size]]
            epoch += 1


def pack(token_lists: Sequence[Sequence[int]], seq_len: int, *, separator: int | None = None,
         max_tokens: int | None = None) -> torch.Tensor:
    """Concatenate documents (each followed by ``separator`` if given) and cut the
    stream into ``[N, seq_len]`` rows; the tail shorter than seq_len is dropped."""
    if not (isinstance(seq_len, int) and seq_len >= 2):
        raise ValueError(f"seq_len must be an int >= 2, got {seq_len!r}")
    parts = []
    for ids in token_lists:
        parts.append(np.asarray(ids, dtype=np.int64))
        if separator is not None:
            parts.append(np.asarray([separator], dtype=np.int64))
    stream = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if max_tokens is not None:
        stream = stream[:max_tokens]
    n = len(stream) // seq_len
    if n < 1:
        raise ValueError(f"source yields {len(stream)} tokens, fewer than one sequence of "
                         f"seq_len={seq_len}; use more text or a shorter seq_len")
    return torch.from_numpy(stream[: n * seq_len].reshape(n, seq_len).copy())


def build_token_dataset(source, tokenizer, seq_len: int, *, text_field: str = "text",
                        split: str | None = None, max_tokens: int | None = None,
                        on_decode_error: str = "raise", cache_dir: str | None = None) -> TokenDataset:
    """Load ``source`` (see :func:`load_texts`), tokenize with ``tokenizer`` (see
    :func:`load_tokenizer`), pack into ``[N, seq_len]`` int64 rows (documents separated
    by the tokenizer's eos). ``max_tokens`` caps the stream before packing."""
    tok = load_tokenizer(tokenizer)
    docs = load_texts(source, text_field=text_field, split=split,
                      on_decode_error=on_decode_error, cache_dir=cache_dir)
    ids = encode_documents(tok, docs)
    vocab = len(tok)
    top = max((max(x) for x in ids if x), default=-1)
    if top >= vocab:  # a tokenizer/model mismatch would index past the embedding table
        raise ValueError(f"tokenizer produced id {top} >= its vocabulary size {vocab}")
    return TokenDataset(pack(ids, seq_len, separator=separator_id(tok), max_tokens=max_tokens))
