"""No tracked file names a path of one particular machine (issue #38).

Records, tables and docs are read on other machines: a path like the checkout, the home
directory or a scratch directory of the machine that wrote them means nothing there and
leaks how that machine is laid out. Write such paths run-relative (``runs/<name>``) or
generic (``~/.cache/meshkern/...``, ``<repo>/...``) instead.

What counts as such a path (``machine_paths``): the checkout root of this test run, the
home directory of this run, anything under the top-level ``work`` or ``root`` directories or
under a user's directory in ``home``, the Python of a virtual environment, and a name of
three characters or more directly under the top-level ``tmp`` (a session's scratch
directory); one- and two-letter placeholders under ``tmp`` in usage examples are fine, and so
are the generic instruction paths in ``TMP_INSTRUCTIONS``. A path inside a URL or a relative
path (``runs/work/...``) is not one: the match must start a path.

This file writes the paths it looks for, and the ones it plants to test itself, from their
parts (``_abs``), so that it holds none of them literally.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# names under the top-level tmp that are a generic instruction's output, not any machine's scratch
TMP_INSTRUCTIONS = {"mask_select_profile"}  # bench/mask_select_profile.cpp: a compile-and-run line

def _abs(*parts: str) -> str:
    """An absolute path from its parts (see the module docstring: none is written whole)."""
    return "/" + "/".join(parts)


# a path starts here: not inside a word, a relative path, a URL or "~/..."/"$HOME/..."
_START = r"(?<![\w.~$/-])"
_FIXED = [
    _START + _abs("work", r"[\w.-]"),
    _START + _abs("root", r"[\w.-]"),
    _START + _abs("home", r"[\w.-]+/"),
    _START + _abs("tmp", r"[\w.-]{3,}"),
    r"/\.pyenv/",
    _START + _abs("usr", "local", "lib", r"python\d"),
]
_TMP = _abs("tmp") + "/"


def _run_paths() -> list[str]:
    """The paths of the machine running this test: its checkout, home and venv."""
    out = [str(ROOT)]
    home = os.path.expanduser("~")
    if home not in ("", "/"):
        out.append(home.rstrip("/") + "/")
    if sys.prefix != sys.base_prefix:  # a virtual environment
        out.append(sys.prefix)
    return [p for p in out if len(p) > 1]


def machine_paths(text: str, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Every path of a particular machine in ``text`` (see the module docstring); ``extra``:
    literal paths to look for as well (this run's checkout, home, venv)."""
    hits = {}  # start -> the whole path from there (one hit per path, however many rules match)
    for pat in _FIXED + [_START + re.escape(p) for p in extra]:
        for m in re.finditer(pat, text):
            tail = re.match(r"[\w./-]*", text[m.start():]).group(0)
            if tail.startswith(_TMP) and tail[len(_TMP):].split("/")[0] in TMP_INSTRUCTIONS:
                continue
            hits[m.start()] = tail
    return [hits[k] for k in sorted(hits)]


def _tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: nothing tracked to scan")
    return [f for f in out.stdout.decode().split("\0") if f]


def test_checker_finds_planted_paths():
    meas, cache = _abs("work", "meas", "runs", "real"), _abs("root", ".cache", "meshkern", "base-v1")
    readme, scratch = _abs("home", "alice", "meshkern", "README.md"), _abs("tmp", "long_runs")
    pytest_tmp = _abs("tmp", "pytest-of-root", "pytest-3", "x")
    pip = _abs("home", "bob", ".pyenv", "versions", "3.11", "bin", "pip")
    torch_dir = _abs("usr", "local", "lib", "python3.11", "site-packages", "torch")
    planted = {
        f"--run.out-dir {meas}": meas,
        f'"model": "{cache}",': cache,
        f"see {readme}": readme,
        f"--work {scratch}": scratch,
        f"argv: ['{pytest_tmp}']": pytest_tmp,
        f"pip: {pip}": pip,
        f"at {torch_dir}": torch_dir,
    }
    for line, path in planted.items():
        assert path in machine_paths(line), line
    # this run's own checkout, wherever it is
    assert machine_paths(f"trained in {ROOT}/runs/x", extra=[str(ROOT)]) == [f"{ROOT}/runs/x"]
    assert machine_paths("cd /srv/ci/meshkern && make", extra=["/srv/ci/meshkern"]) == ["/srv/ci/meshkern"]


def test_checker_leaves_generic_paths_alone():
    fine = [
        "--run.out-dir runs/real-prose --model ~/.cache/meshkern/base-v1",
        "$HOME/.cache/meshkern and <repo>/results",
        "/usr/bin/time -v python -m orchestration.train",
        "text under /usr/share/doc and man pages",
        "https://github.com/someone/work/tree/main and runs/work/x",
        f"python -m orchestration.experiments --quick --out {_abs('tmp', 'x')}",
        f"c++ -O2 bench/mask_select_profile.cpp -o {_TMP}mask_select_profile && {_TMP}mask_select_profile",
        ". .venv/bin/activate",
    ]
    for line in fine:
        assert machine_paths(line, extra=["/srv/ci/meshkern"]) == [], line


def test_no_tracked_file_holds_a_machine_path():
    extra = _run_paths()
    bad = []
    for rel in _tracked_files():
        p = ROOT / rel
        try:
            data = p.read_bytes()
        except (FileNotFoundError, IsADirectoryError):  # deleted in the work tree; a submodule
            continue
        if b"\0" in data[:8192]:  # binary (images)
            continue
        text = data.decode("utf-8", errors="replace")
        for n, line in enumerate(text.splitlines(), 1):
            for hit in machine_paths(line, extra):
                bad.append(f"{rel}:{n}: {hit}")
    assert not bad, "paths of a particular machine in tracked files:\n" + "\n".join(bad[:50])
