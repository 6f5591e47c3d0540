"""Text sources -> a list of documents (``load_texts``), for orchestration.data.tokens.

Sources:
  - a text file (UTF-8; ``.gz`` files are decompressed), a directory (every regular,
    non-hidden file below it, in sorted path order),
  - a ``.jsonl`` file (one JSON object per line, text in ``text_field``),
  - Hugging Face ``datasets``: a ``Dataset``/``DatasetDict`` object, a directory written
    by ``save_to_disk``, or a local ``.json``/``.csv``/``.parquet``/``.arrow`` file
    loaded with ``datasets.load_dataset`` (never from the hub),
  - ``"corpus:<domain>"`` (an embedded corpus, see ``orchestration.data.corpora``) and
    ``"task:<name>"`` (a synthetic task, see ``orchestration.data.tasks``),
  - a list/tuple of strings (the documents themselves).
"""
from __future__ import annotations

import gzip
import json
import os
import sys
from pathlib import Path

# The hub must never be contacted: the machines this runs on have no network, and a
# default that silently downloads would behave differently on each one.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

_DATASETS_SUFFIXES = {".json": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
# on_decode_error values: "auto" skips undecodable files inside a directory (a source tree
# holds __pycache__/*.pyc, images, ...) but raises for a file named on its own.
DECODE_ERROR_CHOICES = ("auto", "raise", "skip")


def read_text_file(path: str | os.PathLike, *, on_decode_error: str = "raise") -> str | None:
    """Read one UTF-8 text file (``.gz`` transparently decompressed).

    ``on_decode_error="raise"`` (default) raises ValueError naming the file if it is not
    valid UTF-8 (a binary file, a Latin-1 file) or holds NUL bytes; ``"skip"`` returns
    None instead.
    """
    if on_decode_error not in ("raise", "skip"):
        raise ValueError(f"read_text_file: on_decode_error must be 'raise' or 'skip', got {on_decode_error!r}")
    path = Path(path)
    data = path.read_bytes()
    if path.suffix == ".gz":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as e:
            if on_decode_error == "skip":
                return None
            raise ValueError(f"{path}: not a valid gzip file ({e}); --data.on-decode-error skip "
                             "leaves such files out") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        if on_decode_error == "skip":
            return None
        raise ValueError(
            f"{path}: not valid UTF-8 text (byte {e.start}: {e.reason}); convert it to UTF-8, "
            "or pass --data.on-decode-error skip to leave undecodable files out") from None
    if "\x00" in text:  # valid UTF-8 but binary (NUL bytes never occur in text)
        if on_decode_error == "skip":
            return None
        raise ValueError(f"{path}: contains NUL bytes, looks like a binary file; "
                         "--data.on-decode-error skip leaves such files out")
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
                             "choose one with --data.text-field")
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
                         "choose one with --data.text-field")
    docs = ds[text_field]
    docs = list(docs) if not isinstance(docs, list) else docs
    bad = next((i for i, d in enumerate(docs) if not isinstance(d, str)), None)
    if bad is not None:
        raise ValueError(f"{where}: row {bad} of column {text_field!r} is "
                         f"{type(docs[bad]).__name__}, not a string")
    return docs


def load_texts(source, *, text_field: str = "text", split: str | None = None,
               on_decode_error: str = "auto", cache_dir: str | None = None) -> list[str]:
    """Documents (a list of str, deterministic order) from any supported source.

    See the module docstring for the sources. ``on_decode_error`` (``--data.on-decode-error``)
    decides what happens to a file that is not UTF-8 text (invalid UTF-8, NUL bytes, bad gzip):

      - ``"auto"`` (default): inside a directory the file is left out, with ONE warning line
        on stderr for the whole directory (count + first paths); a file named on its own
        raises ValueError;
      - ``"raise"``: ValueError naming the first such file, directory or not;
      - ``"skip"``: always left out (a single undecodable file then leaves no text: ValueError).

    Raises FileNotFoundError for a path that does not exist, ValueError for an empty source
    (no documents, or only blank ones) and for undecodable/malformed input, TypeError for an
    unsupported source type.
    """
    if on_decode_error not in DECODE_ERROR_CHOICES:
        raise ValueError(f"--data.on-decode-error must be one of {', '.join(DECODE_ERROR_CHOICES)}, "
                         f"got {on_decode_error!r}")
    where = repr(source) if not isinstance(source, (list, tuple)) else "list of texts"
    if isinstance(source, (list, tuple)):
        bad = next((i for i, d in enumerate(source) if not isinstance(d, str)), None)
        if bad is not None:
            raise TypeError(f"document {bad} of the list is {type(source[bad]).__name__}, not str")
        docs = list(source)
    elif _is_hf_dataset(source):
        docs = _texts_from_hf(source, text_field, split, "dataset object")
    elif isinstance(source, str) and source.startswith("corpus:"):
        from orchestration.data import corpora
        docs = corpora.load_corpus(source[len("corpus:"):])
    elif isinstance(source, str) and source.startswith("task:"):
        from orchestration.data import tasks
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
        files = _source_files(path)
        if not files:
            raise ValueError(f"{path}: directory holds no files")
        policy = "raise" if on_decode_error == "raise" else "skip"
        docs, skipped = [], []
        for f in files:
            text = read_text_file(f, on_decode_error=policy)
            (docs if text is not None else skipped).append(text if text is not None else f)
        if skipped:
            shown = ", ".join(str(f.relative_to(path)) for f in skipped[:3])
            more = f" and {len(skipped) - 3} more" if len(skipped) > 3 else ""
            print(f"warning: {path}: left out {len(skipped)} of {len(files)} files that are not UTF-8 "
                  f"text ({shown}{more}); --data.on-decode-error raise stops at them instead",
                  file=sys.stderr, flush=True)
        return docs
    if path.suffix == ".jsonl" or path.name.endswith(".jsonl.gz"):
        return read_jsonl(path, text_field)
    if path.suffix in _DATASETS_SUFFIXES:
        datasets = _datasets(f"a {path.suffix} file")
        ds = datasets.load_dataset(_DATASETS_SUFFIXES[path.suffix], data_files=str(path),
                                   split=split or "train", cache_dir=cache_dir)
        return _texts_from_hf(ds, text_field, None, str(path))
    text = read_text_file(path, on_decode_error="skip" if on_decode_error == "skip" else "raise")
    if text is None:
        raise ValueError(f"{path}: not decodable as UTF-8 text (skipped by --data.on-decode-error skip, "
                         "which leaves no text)")
    return [text]


def _source_files(path: Path) -> list[Path]:
    """The files a directory source reads: every regular file below it whose relative
    path has no hidden (dot) component, sorted by path."""
    return sorted(p for p in path.rglob("*") if p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(path).parts))
