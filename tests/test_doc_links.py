"""Every relative markdown link in README.md, docs/**/*.md and results/**/*.md (the lab notebook,
the generated tables) points to a path that exists
(issue #38): a file that moved or was removed must take its links with it."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# [text](target) and ![alt](target); the target ends at whitespace or ")" (an optional
# "title" after it is ignored). Code spans are removed first: `[x](y)` there is not a link.
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)


def relative_links(text: str) -> list[str]:
    """The relative link targets of a markdown text, without their #anchor or ?query;
    external links (a scheme such as https:, mailto:) and pure #anchors are left out."""
    text = _CODE.sub("", _FENCE.sub("", text))
    out = []
    for target in _LINK.findall(text):
        if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0].split("?", 1)[0]
        if path:
            out.append(path)
    return out


def broken_links(md: Path, root: Path = ROOT) -> list[str]:
    """The relative links of ``md`` that name no existing file or folder (resolved from
    md's folder; a leading "/" from ``root``)."""
    bad = []
    for path in relative_links(md.read_text(encoding="utf-8")):
        base = root if path.startswith("/") else md.parent
        if not (base / path.lstrip("/")).exists():
            bad.append(path)
    return bad


def test_link_parser():
    text = ("See [a](docs/a.md#sec), ![fig](figures/x.png \"title\"), [web](https://x.org/y), "
            "[mail](mailto:a@b.c), [top](#top), [dir](../orchestration/codecs/) and "
            "`[not](a/link.md)`.\n```\n[nor](this.md)\n```\n")
    assert relative_links(text) == ["docs/a.md", "figures/x.png", "../orchestration/codecs/"]


def test_broken_link_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "there.md").write_text("x")
    md = tmp_path / "docs" / "page.md"
    md.write_text("[ok](there.md) [gone](../orchestration/config.py) [up](../docs/there.md#a)")
    assert broken_links(md, tmp_path) == ["../orchestration/config.py"]


def test_every_relative_doc_link_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "results").rglob("*.md"))]
    assert len(pages) > 5  # the docs are there to check
    bad = [f"{p.relative_to(ROOT)}: {link}" for p in pages for link in broken_links(p)]
    assert not bad, "broken relative links:\n" + "\n".join(bad)
