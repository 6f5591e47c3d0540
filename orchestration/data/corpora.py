"""Embedded corpora: text that every machine already has, in three domains.

The default task must run offline anywhere, and it must be a real *adaptation* task:
the base model is pretrained on domain A and then adapted to domain B, whose text it
has not seen.

  - ``prose`` (domain A, English prose): Python's own reference topics
    (``pydoc_data.topics``, shipped with every CPython, so the domain is never empty),
    plus, where installed, plain-text package docs under /usr/share/doc (README, NEWS,
    *.txt, *.md; .gz decompressed; license ``copyright`` files and changelogs left out
    because they are thousands of near-identical boilerplate files), English man pages
    (sections 1, 5, 7, 8; roff markup stripped in Python, so no groff is needed) and
    Vim's help files.
  - ``python`` (domain B, source code): the Python standard library's ``.py`` files,
    without its test suites, ``encodings`` tables, ``site-packages`` or ``pydoc_data``.
  - ``locales`` (a far domain, issue #43): glibc's locale definitions
    (/usr/share/i18n/locales: month and day names, formats and character classes of ~300
    locales, the text mostly as <Uxxxx> code points), where the system has them; else
    CPython's single-byte code page tables (``encodings/*.py``). Structured data the base
    model knows much less than code or prose: the largest dense gain of the candidates
    measured (docs/far-domain.md).

Selection is deterministic for a given set of installed files: candidates are ordered
by a SHA-1 of their source-relative name (which spreads the picks over all packages
instead of taking the alphabetically first ones), each file is cut to
``max_file_bytes`` at a line boundary, and files are taken until ``max_bytes``.
Machines with different packages installed get different (but still deterministic)
text; :func:`corpus_fingerprint` identifies exactly what was used.
"""
from __future__ import annotations

import functools
import glob
import gzip
import hashlib
import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

# 4 MB of text is ~1.1M tokens with the 2k BPE: more than the default pretraining run
# consumes (so it never repeats), yet it loads and tokenizes in ~2 s.
DEFAULT_MAX_BYTES = 4_000_000
# 32 KB per file keeps one big manual from dominating a domain.
DEFAULT_MAX_FILE_BYTES = 32_000
# Shorter documents are mostly stubs ("See /usr/share/common-licenses").
MIN_DOC_CHARS = 200

_DOC_NAMES = re.compile(r"^(readme|news|changes|todo|faq|authors|thanks|usage|bugs)", re.I)
_DOC_SUFFIXES = (".txt", ".md", ".rst", ".text")
_PY_SKIP = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
            "encodings", "pydoc_data", "lib2to3"}


@dataclass(frozen=True)
class _Doc:
    key: str                       # "<source>/<relative name>": stable across machines
    load: Callable[[], str | None]  # returns the text, or None if unreadable


@dataclass(frozen=True)
class Domain:
    name: str
    description: str
    sources: tuple[Callable[[], list[_Doc]], ...]  # taken round-robin, see corpus_documents


# ------------------------------------------------------------------ file readers
def _read(path: Path) -> str | None:
    """UTF-8 text of a (possibly gzipped) file, or None if binary/undecodable: corpora
    are best-effort over whatever the system holds."""
    try:
        data = path.read_bytes()
        if path.suffix == ".gz":
            data = gzip.decompress(data)
        text = data.decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError):
        return None
    return None if "\x00" in text else text


_ROFF_ESCAPES = [
    (re.compile(r"\\[hvwlLxNbDoZ]'[^']*'"), ""),     # motions/measures \h'2m'
    (re.compile(r"\\f(\[[^\]]*\]|\(..|.)"), ""),      # font changes \fB \f(CW \f[I]
    (re.compile(r"\\s[+-]?\d"), ""),                  # size changes
    (re.compile(r"\\\(em|\\\[em\]"), "--"),
    (re.compile(r"\\\(aq|\\\[aq\]"), "'"),
    (re.compile(r"\\\((lq|rq|dq)|\\\[(lq|rq|dq)\]"), '"'),
    (re.compile(r"\\\(bu|\\\[bu\]"), "*"),
    (re.compile(r"\\[-]"), "-"),
    (re.compile(r"\\[&|^%]"), ""),
    (re.compile(r"\\e"), "\\\\"),
    (re.compile(r"\\ "), " "),
    (re.compile(r"\\\*(\[[^\]]*\]|\(..|.)"), ""),     # string registers
    (re.compile(r"\\\((..)"), ""),                    # other special characters
    (re.compile(r"\\\[[^\]]*\]"), ""),
    (re.compile(r"\\[a-zA-Z]"), ""),
]
_TEXT_MACROS = {"SH", "SS", "B", "I", "BR", "RB", "BI", "IB", "IR", "RI", "SM", "SB", "TP",
                "IP", "Nm", "Nd", "Sh", "Ss", "Fl", "Ar", "Op", "Xr", "Pa", "Em", "Dv", "Ev",
                "Cm", "It"}


def roff_to_text(src: str) -> str:
    """Plain text of a man page's roff source, good enough for language modelling:
    keeps running text (refilled into paragraphs, as roff would) and the arguments of
    font/section macros; drops other requests and escapes; keeps no-fill blocks
    (.nf/.EX) line by line."""
    out: list[str] = []
    para: list[str] = []
    fill = True

    def flush():
        if para:
            out.append(" ".join(para))
            para.clear()

    for line in src.splitlines():
        if line.startswith((".\\\"", "'\\\"")) or line.strip() in (".", "'"):
            continue
        if line.startswith((".", "'")):
            parts = line[1:].split(None, 1)
            req = parts[0] if parts else ""
            if req in ("nf", "EX"):
                flush()
                fill = False
            elif req in ("fi", "EE"):
                fill = True
            if req not in _TEXT_MACROS or len(parts) == 1:
                if req in ("PP", "LP", "P", "SH", "SS", "TP", "IP", "sp", "Pp", "br"):
                    flush()
                    out.append("")
                continue
            line = parts[1].replace('"', "")
            if req in ("SH", "SS", "Sh", "Ss"):
                flush()
                out.append("")
                out.append(line)
                continue
        for pat, rep in _ROFF_ESCAPES:
            line = pat.sub(rep, line)
        if fill and line.strip():
            para.append(line.strip())
        else:
            flush()
            out.append(line)
    flush()
    return "\n".join(out)


def _normalize(text: str, max_file_bytes: int) -> str:
    text = re.sub(r"[ \t]+\n", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text).strip()
    if len(text.encode("utf-8")) > max_file_bytes:
        cut = text.encode("utf-8")[:max_file_bytes].decode("utf-8", "ignore")
        nl = cut.rfind("\n")
        text = cut[:nl] if nl > 0 else cut
    return text


# ------------------------------------------------------------------ candidates
def _files(root: str, suffixes: tuple[str, ...] | None = None, skip_dirs=frozenset()) -> list[Path]:
    """Regular files below ``root`` (no symlinks, no hidden entries, no directory named
    in ``skip_dirs``), optionally only those ending in one of ``suffixes``; sorted."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in skip_dirs]
        for f in filenames:
            p = Path(dirpath, f)
            if not f.startswith(".") and (suffixes is None or f.endswith(suffixes)) \
                    and p.is_file() and not p.is_symlink():
                out.append(p)
    return sorted(out)


@functools.lru_cache(maxsize=None)  # the installed files do not change within a run
def _pydoc_topics() -> list[_Doc]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # pragma: no cover - stripped-down Pythons
        return []
    return [_Doc(f"pydoc/{k}", (lambda v=v: v)) for k, v in sorted(topics.items())]


@functools.lru_cache(maxsize=None)  # the installed files do not change within a run
def _share_doc() -> list[_Doc]:
    docs = []
    for p in _files("/usr/share/doc"):
        name = p.name[:-3] if p.name.endswith(".gz") else p.name
        if name.startswith(("copyright", "changelog")):
            continue
        if _DOC_NAMES.match(name) or name.lower().endswith(_DOC_SUFFIXES):
            docs.append(_Doc(f"doc/{p.relative_to('/usr/share/doc')}", (lambda p=p: _read(p))))
    return docs


# At most this many man pages per family (name up to the first "_", "-" or "."): some
# tools install thousands of near-identical pages (gcloud_*, git-*, perl modules).
MAN_PAGES_PER_FAMILY = 8


@functools.lru_cache(maxsize=None)  # the installed files do not change within a run
def _man_pages() -> list[_Doc]:
    docs, per_family = [], {}
    pages = [p for section in ("man1", "man5", "man7", "man8")  # commands, formats, overviews, admin
             for p in _files(f"/usr/share/man/{section}")]
    for p in sorted(pages, key=lambda p: (_order(p.name), str(p))):
        family = re.split(r"[_.\-]", p.name, maxsplit=1)[0]
        per_family[family] = per_family.get(family, 0) + 1
        if per_family[family] > MAN_PAGES_PER_FAMILY:
            continue

        def load(p=p):
            src = _read(p)
            # ".so other.1" pages are one-line aliases
            return None if src is None or src.lstrip().startswith(".so ") else roff_to_text(src)
        docs.append(_Doc(f"man/{p.parent.name}/{p.name}", load))
    return docs


@functools.lru_cache(maxsize=None)  # the installed files do not change within a run
def _vim_help() -> list[_Doc]:
    docs = []
    for d in sorted(glob.glob("/usr/share/vim/vim*/doc")):
        for p in _files(d, (".txt",)):
            docs.append(_Doc(f"vim/{p.name}", (lambda p=p: _read(p))))
    return docs


@functools.lru_cache(maxsize=None)  # the installed files do not change within a run
def _stdlib_sources() -> list[_Doc]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for p in _files(str(root), (".py",), skip_dirs=_PY_SKIP):
        rel = p.relative_to(root)
        docs.append(_Doc(f"py/{rel.as_posix()}", (lambda p=p: _read(p))))
    return docs


# Per-language definitions of glibc (month and day names, date and number formats, collation
# and character classes, the text mostly written as <Uxxxx> code points): the domain issue #43's
# probe measured farthest from SmolLM2-135M among local text (the largest dense gain, 0.50 in
# 25 steps against python's 0.14; docs/far-domain.md).
LOCALE_DIR = "/usr/share/i18n/locales"


@functools.lru_cache(maxsize=None)  # the installed files do not change within a run
def _locale_definitions() -> list[_Doc]:
    return [_Doc(f"locale/{p.name}", (lambda p=p: _read(p))) for p in _files(LOCALE_DIR)]


@functools.lru_cache(maxsize=None)  # the installed files do not change within a run
def _charmap_tables() -> list[_Doc]:
    """CPython's single-byte codec tables (``encodings/*.py`` with a ``decoding_table``:
    every character of a code page with its Unicode name): the same kind of data as the
    locale definitions, shipped with every CPython. Only where the system has no glibc
    locale sources, so a machine that has them gets the domain the probe measured."""
    if _locale_definitions():
        return []
    root = Path(sysconfig.get_paths()["stdlib"]) / "encodings"
    docs = []
    for p in _files(str(root), (".py",)):
        text = _read(p)
        if text and "decoding_table = (" in text:
            docs.append(_Doc(f"charmap/{p.name}", (lambda p=p: _read(p))))
    return docs


DOMAINS: dict[str, Domain] = {
    "prose": Domain("prose", "English prose: Python reference topics, /usr/share/doc, man pages, Vim help",
                    (_pydoc_topics, _share_doc, _man_pages, _vim_help)),
    "python": Domain("python", "Python source code: the standard library (no tests)",
                     (_stdlib_sources,)),
    "locales": Domain("locales", "locale data: glibc's locale definitions (CPython's code page tables where the "
                      "system has none)", (_locale_definitions, _charmap_tables)),
}


def _order(key: str) -> str:
    return hashlib.sha1(key.encode("utf-8")).hexdigest()


def corpus_documents(name: str, *, max_bytes: int | None = None,
                     max_file_bytes: int | None = None) -> list[tuple[str, str]]:
    """``(key, text)`` of the documents of domain ``name``, deterministic order, total
    UTF-8 size at most ``max_bytes`` (the last document that would overflow is cut).
    Defaults: DEFAULT_MAX_BYTES, DEFAULT_MAX_FILE_BYTES. Cached per process (a fresh
    list each call)."""
    return list(_corpus_documents(name, DEFAULT_MAX_BYTES if max_bytes is None else max_bytes,
                                  DEFAULT_MAX_FILE_BYTES if max_file_bytes is None else max_file_bytes))


@functools.lru_cache(maxsize=16)
def _corpus_documents(name: str, max_bytes: int, max_file_bytes: int) -> tuple[tuple[str, str], ...]:
    if name not in DOMAINS:
        raise ValueError(f"unknown corpus {name!r}; choose from {sorted(DOMAINS)}")
    if max_bytes < MIN_DOC_CHARS or max_file_bytes < MIN_DOC_CHARS:
        raise ValueError(f"max_bytes and max_file_bytes must be >= {MIN_DOC_CHARS}")
    # Round-robin over the domain's sources (each in hash order) so that no source
    # crowds out the others: a machine with 20 MB of man pages still gets prose from
    # Python's reference topics and the package docs.
    queues = [sorted(src(), key=lambda d: _order(d.key)) for src in DOMAINS[name].sources]
    out, total = [], 0
    for doc in _round_robin(queues):
        text = doc.load()
        if text is None:
            continue
        text = _normalize(text, min(max_file_bytes, max_bytes - total))
        if len(text) < MIN_DOC_CHARS:
            continue
        out.append((doc.key, text))
        total += len(text.encode("utf-8"))
        if max_bytes - total < MIN_DOC_CHARS:
            break
    if not out:
        raise ValueError(f"corpus {name!r}: no readable documents on this machine")
    return tuple(out)


def _round_robin(queues: list[list[_Doc]]) -> Iterator[_Doc]:
    for i in range(max((len(q) for q in queues), default=0)):
        for q in queues:
            if i < len(q):
                yield q[i]


def load_corpus(name: str, **kw) -> list[str]:
    """The documents (texts only) of domain ``name``; see :func:`corpus_documents`."""
    return [t for _, t in corpus_documents(name, **kw)]


def corpus_fingerprint(name: str, **kw) -> str:
    """SHA-256 over the keys and texts selected: equal fingerprints mean equal corpora."""
    h = hashlib.sha256()
    for key, text in corpus_documents(name, **kw):
        h.update(key.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()
