"""Embedded corpora: three real domains, bounded, deterministic; the roff stripper."""
import re

import pytest

from orchestration.data import corpora

from orchestration.data import tokens as data

SMALL = 60_000


def test_domains_exist_bounded_and_deterministic():
    for name in ("prose", "python", "locales"):
        docs = corpora.corpus_documents(name, max_bytes=SMALL, max_file_bytes=8_000)
        total = sum(len(t.encode()) for _, t in docs)
        assert SMALL // 2 <= total <= SMALL and all(len(t.encode()) <= 8_000 for _, t in docs)
        assert len({k for k, _ in docs}) == len(docs)
        corpora._corpus_documents.cache_clear()  # a second, uncached selection is identical
        assert corpora.corpus_documents(name, max_bytes=SMALL, max_file_bytes=8_000) == docs
    assert corpora.corpus_fingerprint("prose", max_bytes=SMALL) != corpora.corpus_fingerprint(
        "python", max_bytes=SMALL)


def test_domains_differ_in_kind():
    prose = "\n".join(corpora.load_corpus("prose", max_bytes=SMALL))
    code = "\n".join(corpora.load_corpus("python", max_bytes=SMALL))
    def code_share(t):  # lines that look like Python statements
        lines = [ln.strip() for ln in t.splitlines() if ln.strip()]
        return sum(ln.startswith(("def ", "import ", "from ", "return ", "class ", "self.")) for ln in lines) / len(lines)
    assert code_share(code) > 0.1 > code_share(prose) * 2
    assert all(k.startswith("py/") and k.endswith(".py") and "/test/" not in k
               for k, _ in corpora.corpus_documents("python", max_bytes=SMALL))


def test_prose_always_has_python_reference_topics():
    keys = [k for k, _ in corpora.corpus_documents("prose", max_bytes=SMALL)]
    assert any(k.startswith("pydoc/") for k in keys)  # present with every CPython


def test_corpus_as_data_source(monkeypatch):
    monkeypatch.setattr(corpora, "DEFAULT_MAX_BYTES", SMALL)
    tok = data.train_bpe(corpora.load_corpus("python", max_bytes=SMALL), vocab_size=400)
    ds = data.build_token_dataset("corpus:python", tok, 64)
    assert len(ds) > 100


def test_unknown_and_bad_bounds():
    with pytest.raises(ValueError, match="unknown corpus 'klingon'"):
        corpora.load_corpus("klingon")
    with pytest.raises(ValueError, match="max_bytes"):
        corpora.load_corpus("prose", max_bytes=10)


def test_roff_to_text():
    src = "\n".join([
        '.\\" a comment', ".TH GZIP 1 local", ".SH NAME", "gzip \\- compress files",
        ".SH DESCRIPTION", "The", ".B gzip", "command reduces", "the size \\fBof\\fR files.",
        ".PP", "Second \\(aqparagraph\\(aq.", ".nf", "line one", "line two", ".fi"])
    assert corpora.roff_to_text(src) == (
        "\nNAME\ngzip - compress files\n\nDESCRIPTION\nThe gzip command reduces the size of files."
        "\n\nSecond 'paragraph'.\nline one\nline two")


def test_prose_without_system_docs_falls_back_to_python_topics(monkeypatch):
    """A slim image has no /usr/share/doc, man pages or Vim: prose is still there."""
    bare = corpora.Domain("prose", "test", (corpora._pydoc_topics, lambda: [], lambda: []))
    monkeypatch.setitem(corpora.DOMAINS, "prose", bare)
    corpora._corpus_documents.cache_clear()
    try:
        docs = corpora.corpus_documents("prose", max_bytes=SMALL)
        assert docs and all(k.startswith("pydoc/") for k, _ in docs)
    finally:
        corpora._corpus_documents.cache_clear()


def test_man_page_families_are_capped():
    pages = [d.key for d in corpora._man_pages()]
    fams = {}
    for k in pages:
        f = re.split(r"[_.\-]", k.rsplit("/", 1)[1], maxsplit=1)[0]
        fams[f] = fams.get(f, 0) + 1
    assert not fams or max(fams.values()) <= corpora.MAN_PAGES_PER_FAMILY


def _locales_from(monkeypatch, locale_dir):
    monkeypatch.setattr(corpora, "LOCALE_DIR", str(locale_dir))
    for f in (corpora._locale_definitions, corpora._charmap_tables, corpora._corpus_documents):
        f.cache_clear()


def test_locales_is_glibc_locale_data_where_the_system_has_it(monkeypatch, tmp_path):
    """The far domain (issue #43): the system's locale definitions, each file one document
    keyed by its name only (no machine path), in the same hash order everywhere."""
    src = tmp_path / "locales"
    src.mkdir()
    body = 'LC_TIME\nabday "<U0053><U006F><U006E>";"<U004D><U006F><U006E>"\n' * 20
    for name in ("de_DE", "fr_FR", "ja_JP", "i18n_ctype"):
        (src / name).write_text(f"comment_char %\n% {name}\n" + body)
    (src / ".hidden").write_text(body)
    try:
        _locales_from(monkeypatch, src)
        docs = corpora.corpus_documents("locales", max_bytes=SMALL)
        assert sorted(k for k, _ in docs) == ["locale/de_DE", "locale/fr_FR", "locale/i18n_ctype", "locale/ja_JP"]
        assert [k for k, _ in docs] == sorted((k for k, _ in docs), key=corpora._order)
        assert all("<U004D>" in t for _, t in docs)
    finally:
        _locales_from(monkeypatch, corpora.LOCALE_DIR)


def test_locales_without_glibc_sources_falls_back_to_cpython_code_pages(monkeypatch, tmp_path):
    """A slim image has no /usr/share/i18n: the domain is CPython's code page tables (every
    CPython ships them), character tables like the locale data."""
    try:
        _locales_from(monkeypatch, tmp_path / "absent")
        docs = corpora.corpus_documents("locales", max_bytes=SMALL)
        assert docs and all(k.startswith("charmap/") and k.endswith(".py") for k, _ in docs)
        assert all("decoding_table = (" in t or len(t.encode()) >= 8_000 for _, t in docs)
        assert "charmap/cp1252.py" in {d.key for d in corpora._charmap_tables()}
    finally:
        _locales_from(monkeypatch, corpora.LOCALE_DIR)


def test_locales_is_locale_data_not_code_or_prose():
    text = "\n".join(corpora.load_corpus("locales", max_bytes=SMALL))
    codes = len(re.findall(r"<U[0-9A-F]{4,5}>|0x[0-9A-F]{2}", text))
    assert codes > 500  # code points (locale data) or code page bytes (the fallback)
    prose = "\n".join(corpora.load_corpus("prose", max_bytes=SMALL))
    assert len(re.findall(r"<U[0-9A-F]{4,5}>", prose)) < codes / 50
