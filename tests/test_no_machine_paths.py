"""No tracked file names a path of one particular machine (issue #38).

Records, tables and docs are read on other machines: a path like the checkout, the home
directory or a scratch directory of the machine that wrote them means nothing there and
leaks how that machine is laid out. Write such paths run-relative (``runs/<name>``) or
generic (``~/.cache/meshkern/...``, ``<repo>/...``) instead.

What counts as such a path (``machine_paths``): the checkout root of this test run, the
home directory of this run, ``/work/...``, ``/root/...``, ``/home/<user>/...``, the Python
of a virtual environment, and ``/tmp/<name>`` for a name of three characters or more (a
session's scratch directory: ``/tmp/hxwork``, ``/tmp/pytest-of-root``); one- and
two-letter placeholders such as ``/tmp/x`` in usage examples are fine, and so are the
generic instruction paths in ``TMP_INSTRUCTIONS``. A path inside a URL or a relative path
(``runs/work/...``) is not one: the match must start a path.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()

# /tmp/<name> paths that are a generic instruction's output, not any machine's scratch
TMP_INSTRUCTIONS = {"mask_select_profile"}  # bench/mask_select_profile.cpp: a compile-and-run line

# a path starts here: not inside a word, a relative path, a URL or "~/..."/"$HOME/..."
_START = r"(?<![\w.~$/-])"
_FIXED = [
    _START + r"/work/[\w.-]",
    _START + r"/root/[\w.-]",
    _START + r"/home/[\w.-]+/",
    _START + r"/tmp/[\w.-]{3,}",
    r"/\.pyenv/",
    _START + r"/usr/local/lib/python\d",
]


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
            if tail.startswith("/tmp/") and tail[5:].split("/")[0] in TMP_INSTRUCTIONS:
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
    planted = {
        "--run.out-dir /work/meas/runs/real": "/work/meas/runs/real",
        '"model": "/root/.cache/meshkern/base-v1",': "/root/.cache/meshkern/base-v1",
        "see /home/alice/meshkern/README.md": "/home/alice/meshkern/README.md",
        "--work /tmp/long_runs": "/tmp/long_runs",
        "argv: ['/tmp/pytest-of-root/pytest-3/x']": "/tmp/pytest-of-root/pytest-3/x",
        "pip: /home/bob/.pyenv/versions/3.11/bin/pip": "/home/bob/.pyenv/versions/3.11/bin/pip",
        "at /usr/local/lib/python3.11/site-packages/torch": "/usr/local/lib/python3.11/site-packages/torch",
    }
    for line, path in planted.items():
        assert path in machine_paths(line), line
    # this run's own checkout, wherever it is
    assert machine_paths(f"trained in {ROOT}/runs/x", extra=[str(ROOT)]) == [f"{ROOT}/runs/x"]
    assert machine_paths("cd /srv/ci/meshkern && make", extra=["/srv/ci/meshkern"]) == ["/srv/ci/meshkern"]


def test_checker_leaves_generic_paths_alone():
    fine = [
        "--run.out-dir runs/real-prose --model ~/.cache/meshkern/base-v1",
        "$HOME/.cache/meshkern and <repo>/docs/results",
        "/usr/bin/time -v python -m orchestration.train",
        "text under /usr/share/doc and man pages",
        "https://github.com/someone/work/tree/main and runs/work/x",
        "python -m orchestration.experiments --quick --out /tmp/x",
        "c++ -O2 bench/mask_select_profile.cpp -o /tmp/mask_select_profile && /tmp/mask_select_profile",
        ". .venv/bin/activate",
    ]
    for line in fine:
        assert machine_paths(line, extra=["/srv/ci/meshkern"]) == [], line


def test_no_tracked_file_holds_a_machine_path():
    extra = _run_paths()
    bad = []
    for rel in _tracked_files():
        if rel == THIS:  # the planted examples above
            continue
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
