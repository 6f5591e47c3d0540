"""Text sources -> tokens -> packed fixed-length sequences, split and sharded.

One job: turn whatever text the user points at into a :class:`TokenDataset` (an int64
tensor ``[N, seq_len]``, orchestration/data/sampling.py, with the split, shard and sampling
rules) that the trainer splits into train/held-out rows and shards across the fast
replicas.

Sources: whatever ``load_texts`` (orchestration/data/texts.py) accepts; its docstring lists them.

Tokenizers (``load_tokenizer``): the model's own tokenizer from its directory
(``AutoTokenizer`` with ``local_files_only=True``), a ``tokenizers.Tokenizer`` or a
byte-level BPE trained offline with :func:`train_bpe`.

Everything here is deterministic: same source + tokenizer + arguments -> same tensor.
Large texts are encoded in ~1 MB pieces cut at line breaks (identical ids, see
:func:`encode_stream`), and ``build_token_dataset(..., token_cache=DIR)`` keeps the packed
tensor on disk so a relaunch or resume does not tokenize again.

Error messages name the trainer's flags (``--data.text-field``, ``--data.on-decode-error``),
which map one to one onto the ``text_field`` / ``on_decode_error`` parameters here.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from orchestration.data.sampling import (BatchSampler, TokenDataset, _rows, epoch_permutation, pack,  # noqa: F401
                                    shard_rows)
from orchestration.data.texts import (DECODE_ERROR_CHOICES, _is_hf_dataset, _is_saved_dataset,  # noqa: F401
                                  _source_files, load_texts, read_jsonl, read_text_file)

_SPECIAL = "<|endoftext|>"


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


# Files a tokenizer can be built from (fast tokenizer.json, SentencePiece/tiktoken models,
# WordPiece/BPE vocabularies). transformers 5 builds an EMPTY tokenizer (len 1, every text ->
# id 0) for a directory with none of them, and training would silently run on zeros.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
                    "vocab.json", "vocab.txt", "merges.txt", "*.tiktoken")
_PROBE = "Hello world 123"


def load_tokenizer(tokenizer):
    """A transformers tokenizer from: a tokenizer object, a ``tokenizers.Tokenizer``, a
    ``tokenizer.json`` file, or a model/tokenizer directory
    (``AutoTokenizer.from_pretrained(dir, local_files_only=True)``).

    Guarantees a usable tokenizer: raises ValueError for a directory holding no tokenizer
    file and for a degenerate tokenizer (fewer than 2 entries, or ``"Hello world 123"``
    encoding to nothing or to one repeated id)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

    if isinstance(tokenizer, PreTrainedTokenizerBase):
        return _check_tokenizer(tokenizer, "the tokenizer object")
    try:
        from tokenizers import Tokenizer
        if isinstance(tokenizer, Tokenizer):
            return _check_tokenizer(PreTrainedTokenizerFast(tokenizer_object=tokenizer), "the tokenizers.Tokenizer")
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
        return _check_tokenizer(PreTrainedTokenizerFast(tokenizer_file=str(path)), str(path))
    if not any(any(path.glob(pattern)) for pattern in _TOKENIZER_FILES):
        raise ValueError(f"no tokenizer (tokenizer.json / tokenizer.model / vocab files) in {path}")
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{path}: no usable tokenizer in this directory ({e})") from None
    return _check_tokenizer(tok, str(path))


def _check_tokenizer(tok, where: str):
    n = len(tok)
    ids = _encode_one(tok, _PROBE)
    if n < 2 or len(set(ids)) < 2:
        raise ValueError(f"{where}: degenerate tokenizer ({n} entries; {_PROBE!r} -> {ids}); "
                         "its files are missing or broken, so every text would become the same id")
    return tok


def _encode_one(tok, text: str) -> list[int]:
    return encode_documents(tok, [text])[0]


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


# Why pieces: one encode() of a 17 MB string holds every token's Encoding record (ids,
# offsets, token strings) at once -- 3.5 GB peak, 20 s, Ctrl-C ignored until the end.
# Pieces of 256 K characters in batches of ~1 M: 17 MB file -> 0.6 GB peak (0.33 GB of it
# is the interpreter + torch + transformers), against 0.7 GB for 1 M pieces in 1 M batches
# and 1.0 GB for 1 M pieces in 4 M batches (same ids in all three). A batch of 4 pieces
# lets the Rust encoder use 4 threads; Python takes KeyboardInterrupt between batches.
_PIECE_CHARS = 1 << 18
_BATCH_CHARS = 1 << 20
_BATCH_DOCS = 4096  # many small documents (jsonl rows): bound the per-call list as well
# Cut only at "x\ny" (a line break between two non-space characters): the pre-tokenizers of
# byte-level BPEs (GPT-2, Llama-3, Qwen regexes) never join a token across such a break, so
# encoding the pieces separately gives the same ids. Each cut is still checked on its
# neighbourhood (_WINDOW chars each side) and moved to the next line break if it fails.
_CUT = re.compile(r"(?<=\S)\n(?=\S)")
_WINDOW = 64
_CUT_TRIES = 32
# Lines start and end with a non-space character, like the cuts _CUT makes.
_CUT_PROBE = ["Hello world.", "The quick 123, 's fox;", "def f(x):", "return x  # ü ✓", "日本語 text"]


def _cuts_are_exact(tok) -> bool:
    """Whether encoding line-separated pieces apart gives the ids of the whole (False for
    e.g. SentencePiece/Metaspace tokenizers, which prefix every piece with a space mark)."""
    lines = [line + "\n" for line in _CUT_PROBE[:-1]] + _CUT_PROBE[-1:]
    return _encode_one(tok, "".join(lines)) == [i for line in lines for i in _encode_one(tok, line)]


def _pieces(tok, text: str, exact: bool) -> list[str]:
    """``text`` cut at checked line breaks into pieces of about _PIECE_CHARS (one piece if
    the tokenizer or the text allows no exact cut); ``"".join(pieces) == text``."""
    if not exact or len(text) <= _PIECE_CHARS:
        return [text]
    pieces, start = [], 0
    while len(text) - start > _PIECE_CHARS:
        pos, cut = start + _PIECE_CHARS, None
        for _ in range(_CUT_TRIES):
            m = _CUT.search(text, pos)
            if m is None:
                break
            left, right = text[max(start, m.end() - _WINDOW):m.end()], text[m.end():m.end() + _WINDOW]
            if _encode_one(tok, left + right) == _encode_one(tok, left) + _encode_one(tok, right):
                cut = m.end()
                break
            pos = m.end()
        if cut is None:
            break
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def encode_stream(tokenizer, docs: Sequence[str], *, separator: int | None = None,
                  max_tokens: int | None = None) -> np.ndarray:
    """The packing stream: each document's ids (no special tokens) followed by
    ``separator`` if given, as one int32 array, cut to ``max_tokens`` (encoding stops
    once that many are reached).

    Same ids as encoding each document whole (``encode_documents``): long documents are
    encoded in pieces only where that is exact (see _pieces). Memory: the int32 stream
    plus the transient of one ~1 M-character batch; KeyboardInterrupt is taken between batches."""
    exact = _cuts_are_exact(tokenizer)
    parts: list[np.ndarray] = []
    total = 0
    sep = None if separator is None else np.array([separator], dtype=np.int32)
    batch: list[str] = []
    ends: list[bool] = []  # ends[i]: batch[i] is the last piece of its document

    def flush() -> int:
        n = 0
        for piece_ids, end in zip(encode_documents(tokenizer, batch), ends):
            parts.append(np.asarray(piece_ids, dtype=np.int32))
            n += len(piece_ids)
            if end and sep is not None:
                parts.append(sep)
                n += 1
        batch.clear()
        ends.clear()
        return n

    chars = 0
    for doc in docs:
        pieces = _pieces(tokenizer, doc, exact)
        for k, piece in enumerate(pieces):
            batch.append(piece)
            ends.append(k == len(pieces) - 1)
            chars += len(piece)
            if chars >= _BATCH_CHARS or len(batch) >= _BATCH_DOCS:
                total += flush()
                chars = 0
                if max_tokens is not None and total >= max_tokens:
                    break
        if max_tokens is not None and total >= max_tokens:
            break
    if batch and (max_tokens is None or total < max_tokens):
        total += flush()
    stream = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    return stream[:max_tokens] if max_tokens is not None else stream


def build_token_dataset(source, tokenizer, seq_len: int, *, text_field: str = "text",
                        split: str | None = None, max_tokens: int | None = None,
                        on_decode_error: str = "auto", cache_dir: str | None = None,
                        token_cache: str | os.PathLike | None = None) -> TokenDataset:
    """Load ``source`` (see :func:`load_texts`), tokenize with ``tokenizer`` (see
    :func:`load_tokenizer`), pack into ``[N, seq_len]`` int64 rows (documents separated
    by the tokenizer's eos). ``max_tokens`` caps the stream before packing.

    ``token_cache``: a directory (``~`` expanded, created on first write); the packed rows are stored there (``tokens-<key>.safetensors``,
    written atomically) under a key of everything that decides them -- the source (path and
    the (relative path, size, mtime_ns) of every file; a datasets object's fingerprint; the
    text itself for lists and ``corpus:``/``task:`` sources), the tokenizer's serialized
    content and separator, seq_len, max_tokens, text_field, split, on_decode_error -- and
    reused while that key holds. An unreadable or invalid cache file is ignored (one warning
    line) and rebuilt. ``cache_dir`` is the ``datasets`` library's cache, a different thing.

    Raises ValueError if the tokens reach past the tokenizer's vocabulary or the stream has
    fewer than 2 distinct ids (a broken tokenizer or a source of one repeated character)."""
    tok = load_tokenizer(tokenizer)
    load = dict(text_field=text_field, split=split, on_decode_error=on_decode_error, cache_dir=cache_dir)
    docs, cache_file = None, None
    if token_cache is not None:
        key = _source_key(source)
        if key is None:  # no cheap stamp: the documents themselves are the key
            docs = load_texts(source, **load)
            key = {"texts": _hash_texts(docs)}
        cache_file = _cache_path(token_cache, key, tok, seq_len, max_tokens, text_field, split, on_decode_error)
        cached = _read_cache(cache_file, seq_len, len(tok)) if cache_file is not None else None
        if cached is not None:
            return TokenDataset(cached)
    if docs is None:
        docs = load_texts(source, **load)
    stream = encode_stream(tok, docs, separator=separator_id(tok), max_tokens=max_tokens)
    del docs
    rows = _rows(stream, seq_len)
    top = int(stream.max())
    if top >= len(tok):  # a tokenizer/model mismatch would index past the embedding table
        raise ValueError(f"tokenizer produced id {top} >= its vocabulary size {len(tok)}")
    if not (stream != stream[0]).any():
        raise ValueError(f"{_describe(source)}: every one of its {len(stream)} tokens is id {int(stream[0])} "
                         "(fewer than 2 distinct ids): the tokenizer does not fit this text, "
                         "or the text is one repeated character")
    if cache_file is not None:
        _write_cache(cache_file, rows)
    return TokenDataset(rows)


# ------------------------------------------------------------------ the token cache
_CACHE_FORMAT = 1  # bump when the packing rule changes: old files then stop matching


def _describe(source) -> str:
    return "list of texts" if isinstance(source, (list, tuple)) else str(source)


def _hash_texts(docs: Sequence[str]) -> str:
    h = hashlib.sha256()
    for d in docs:
        b = d.encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(8, "little") + b)
    return h.hexdigest()


def _source_key(source) -> dict | None:
    """A stamp that changes whenever the documents of ``source`` may change, without
    reading them: path + (relative path, size, mtime_ns) of every file for paths (saved
    datasets included: save_to_disk rewrites its files), the fingerprint for datasets
    objects; None where only the text itself can say (lists, corpus:, task:, missing paths)."""
    if _is_hf_dataset(source):
        fp = getattr(source, "_fingerprint", None)
        if fp is None and isinstance(source, dict):
            fps = {k: getattr(v, "_fingerprint", None) for k, v in source.items()}
            fp = None if None in fps.values() else fps
        return None if fp is None else {"dataset": fp}
    if isinstance(source, os.PathLike) or (isinstance(source, str) and not source.startswith(("corpus:", "task:"))):
        path = Path(source).resolve()
        if not path.exists():
            return None
        files = ([p for p in sorted(path.rglob("*")) if p.is_file()] if _is_saved_dataset(path)
                 else _source_files(path) if path.is_dir() else [path])
        stats = []
        for f in files:
            st = f.stat()
            stats.append([str(f.relative_to(path)) if f != path else f.name, st.st_size, st.st_mtime_ns])
        return {"path": str(path), "files": stats}
    return None


def _cache_path(cache_dir, source_key, tok, seq_len, max_tokens, text_field, split,
                on_decode_error) -> Path | None:
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:  # a slow tokenizer has no full serialization to key on
        print("warning: --data token cache off: this tokenizer has no tokenizer.json form to key the cache on",
              file=sys.stderr, flush=True)
        return None
    key = {"format": _CACHE_FORMAT, "source": source_key,
           "tokenizer": hashlib.sha256(backend.to_str().encode()).hexdigest(),
           "separator": separator_id(tok), "seq_len": seq_len, "max_tokens": max_tokens,
           "text_field": text_field, "split": split, "on_decode_error": on_decode_error}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return Path(cache_dir).expanduser() / f"tokens-{digest}.safetensors"


def _read_cache(path: Path, seq_len: int, vocab: int) -> torch.Tensor | None:
    """The cached int64 rows, or None if there is no usable file (missing: silently;
    corrupt, truncated or not the expected shape/range: one warning line)."""
    from safetensors.torch import load_file

    if not path.is_file():
        return None
    try:
        t = load_file(str(path))["tokens"]
        ok = (t.dtype == torch.int32 and t.dim() == 2 and t.shape[0] >= 1 and t.shape[1] == seq_len
              and int(t.min()) >= 0 and int(t.max()) < vocab)
        if not ok:
            raise ValueError(f"holds {t.dtype} {tuple(t.shape)}, expected int32 [N, {seq_len}] ids < {vocab}")
    except Exception as e:  # any damage (safetensors raises its own error types): rebuild, never crash
        print(f"warning: ignoring unusable token cache {path} ({type(e).__name__}: {e}); tokenizing again",
              file=sys.stderr, flush=True)
        return None
    return t.to(torch.int64)


def _write_cache(path: Path, rows: torch.Tensor) -> None:
    """Store ``rows`` as int32 (half the disk; ids < 2**31) via tmp file + os.replace, so a
    reader never sees a partial file. A failure to write only warns: the run goes on."""
    from safetensors.torch import save_file

    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        os.close(fd)
        save_file({"tokens": rows.to(torch.int32).contiguous()}, tmp)
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        print(f"warning: could not write the token cache {path} ({e}); the run goes on without it",
              file=sys.stderr, flush=True)
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
