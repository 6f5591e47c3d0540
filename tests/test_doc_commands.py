"""The commands the README, docs and the lab notebook show work as written: every ``python -m MODULE`` they
name is a module that exists (or the page says which commit holds its code), and every
command of the README's code blocks parses: the trainer's through its own parser and
checks (``orchestration.config.parse_args``, what ``--print-config`` and a real run do
first), any other module's flags against its ``--help``. Links are test_doc_links.py's."""
from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "results" / "NOTEBOOK.md"]

# "python -m x.y", "python3 -m x.y" and torchrun's "-m x.y" (after its own flags)
_MODULE = re.compile(r"(?:\bpython3? -m|\btorchrun\b[^\n`]*?\s-m)\s+([A-Za-z_][\w.]*\w)")
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def modules(text: str) -> list[str]:
    return _MODULE.findall(text)


def restorable(module: str, text: str) -> bool:
    """A module removed from the tree is fine where the page names the commit holding its
    file (``git show COMMIT:path/to/module.py``)."""
    path = module.replace(".", "/") + ".py"
    return re.search(r"git show [0-9a-f]{7,40}:" + re.escape(path), text) is not None


def shell_commands(markdown: str) -> list[str]:
    """The commands of a markdown text's bash/sh code blocks: continuation lines joined,
    comments removed, ``&&`` chains split."""
    out = []
    for lang, body in _FENCE.findall(markdown):
        if lang not in ("bash", "sh", "shell", ""):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*$", "", line).strip()
            out += [part.strip() for part in line.split("&&") if part.strip()]
    return out


def module_argv(command: str) -> tuple[str, list[str]] | None:
    """(module, its arguments) of a ``python -m`` or ``torchrun ... -m`` command (the module a
    launcher runs: its last ``-m``), else None; a shell redirection ends the arguments."""
    words = shlex.split(command)
    if "-m" not in words or not words or words[0] not in ("python", "python3", "torchrun"):
        return None
    i = len(words) - 1 - words[::-1].index("-m")  # a launcher's (python -m orchestration.torchrun ... -m X): X
    args = []
    for w in words[i + 2:]:
        if w in (">", ">>", "|", "2>&1"):
            break
        args.append(w)
    return words[i + 1], args


def test_command_parsers():
    md = ("text `python -m a.b --x`\n```bash\npython -m orchestration.train --steps 2 \\\n    --mesh.rows 1   # c\n"
          "pip install x && python -m y.z --k v > out.txt\ntorchrun --nnodes 2 -m orchestration.train --config r.yaml\n"
          "python -m orchestration.torchrun --nnodes 2 -m orchestration.train --steps 3\n```\n")
    assert modules(md) == ["a.b", "orchestration.train", "y.z", "orchestration.train", "orchestration.torchrun"]
    cmds = shell_commands(md)
    assert cmds == ["python -m orchestration.train --steps 2      --mesh.rows 1", "pip install x",
                    "python -m y.z --k v > out.txt", "torchrun --nnodes 2 -m orchestration.train --config r.yaml",
                    "python -m orchestration.torchrun --nnodes 2 -m orchestration.train --steps 3"]
    assert [module_argv(c) for c in cmds] == [("orchestration.train", ["--steps", "2", "--mesh.rows", "1"]), None,
                                              ("y.z", ["--k", "v"]),
                                              ("orchestration.train", ["--config", "r.yaml"]),
                                              ("orchestration.train", ["--steps", "3"])]
    assert restorable("bench.gone", "its code: `git show f332661:bench/gone.py`")
    assert not restorable("bench.gone", "python -m bench.gone")


def test_every_module_the_docs_name_exists():
    bad = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for m in sorted(set(modules(text))):
            if importlib.util.find_spec(m) is None and not restorable(m, text):
                bad.append(f"{page.relative_to(ROOT)}: python -m {m}")
    assert not bad, "modules that do not exist:\n" + "\n".join(bad)


def _readme_module_commands() -> list[tuple[str, list[str]]]:
    cmds = [module_argv(c) for c in shell_commands((ROOT / "README.md").read_text(encoding="utf-8"))]
    return [c for c in cmds if c is not None]


def test_readme_trainer_commands_parse(tmp_path):
    """Every trainer command of the README builds a valid Config. A ``--config FILE`` it
    names was written by an earlier step: ``runs/NAME/config.yaml`` by the README's run
    named NAME (--run.name), any other (``--print-config > run.yaml``) is the default config."""
    from orchestration.config import Config, parse_args, to_yaml

    default = tmp_path / "run.yaml"
    default.write_text(to_yaml(Config()))
    written: dict[str, Path] = {}  # runs/NAME/config.yaml -> the config that run wrote
    cmds = [args for m, args in _readme_module_commands() if m == "orchestration.train"]
    assert len(cmds) >= 8, cmds  # the quick starts are there to check
    for args in cmds:
        args = [str(written.get(a, default)) if i and args[i - 1] == "--config" else a for i, a in enumerate(args)]
        if "--help" in args:
            continue
        try:
            cfg, _ = parse_args(args)
        except SystemExit as e:  # argparse: an unknown flag or a bad value
            pytest.fail(f"README command does not parse: {' '.join(args)} (exit {e.code})")
        except ValueError as e:
            pytest.fail(f"README command is refused: {' '.join(args)}: {e}")
        if cfg.run.name:
            f = tmp_path / f"{cfg.run.name}.yaml"
            f.write_text(to_yaml(cfg))
            written[f"runs/{cfg.run.name}/config.yaml"] = f


def test_readme_other_commands_use_flags_their_module_has():
    others = [(m, args) for m, args in _readme_module_commands() if m != "orchestration.train"]
    assert others
    for module in sorted({m for m, _ in others}):
        p = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 0, f"python -m {module} --help: {p.stderr[-2000:]}"
        for m, args in others:
            if m == module:
                flags = [a.split("=", 1)[0] for a in args if a.startswith("--")]
                missing = [f for f in flags if f not in p.stdout]
                assert not missing, f"python -m {module}: README uses {missing}, not in its --help"
