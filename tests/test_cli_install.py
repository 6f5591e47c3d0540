"""The newcomer's first two commands (issue #17): README line 1 installs with progress and
builds the base model alongside the C++ build, line 2 (what .ci/run runs) reuses that
install instead of building the extensions again, and the README states the measured
first-run time."""
import os
import re
import shutil
import stat
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme_commands() -> list[str]:
    """The two commands: the README's first code block, right under its title and the
    sentence that says what the project is (within its first 10 lines)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        lines = f.read().split("\n")
    fence = lines.index("```bash")
    assert fence < 10, "the two commands must open the README"
    return lines[fence + 1:fence + 3]


def test_readme_lines_use_the_install_script_and_ci_runs_line_2():
    first, second = _readme_commands()
    assert first.startswith("scripts/install.sh --base-model && ") and first.endswith("python -m orchestration.train")
    assert second.startswith("scripts/install.sh --test && ") and second.endswith(" && scripts/test.sh")
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        assert second in f.read().splitlines()  # CI runs exactly the README's test command
    with open(os.path.join(ROOT, "scripts", "test.sh")) as f:  # the suite, and beside it the two checks
        lines = [x.strip() for x in f.read().splitlines() if not x.lstrip().startswith("#")]
    assert 'pytest -q "$@"' in lines
    assert any("nice -n 10 scripts/ci_install_check.sh " in x and x.endswith("&") for x in lines)
    assert any("python -m bench.compile_check --triton " in x and x.endswith("&") for x in lines)


def test_readme_states_the_measured_first_run_time():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    assert "FIRST_RUN_TIME" not in text
    assert re.search(r"Measured from a\s+fresh clone .*?load average [\d-]+.*?\d+ min", text, re.S)


def _fake_clone(tmp_path):
    """The build inputs of the repo, and a .venv whose python logs every call."""
    for f in ("setup.py", "pyproject.toml"):
        shutil.copy(os.path.join(ROOT, f), tmp_path / f)
    shutil.copytree(os.path.join(ROOT, "csrc"), tmp_path / "csrc")
    (tmp_path / "scripts").mkdir()
    shutil.copy(os.path.join(ROOT, "scripts", "install.sh"), tmp_path / "scripts" / "install.sh")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    py = tmp_path / ".venv" / "bin" / "python"
    py.write_text(f'#!/bin/sh\necho "$@" >> "{tmp_path}/calls.log"\nexec "{sys.executable}" "$@"\n')
    py.chmod(py.stat().st_mode | stat.S_IEXEC)
    return tmp_path / "scripts" / "install.sh"


def _stamp(tmp_path) -> str:
    script = (tmp_path / "scripts" / "install.sh").read_text()
    fn = re.search(r"^stamp_now\(\) \{.*?^\}", script, re.S | re.M).group(0)
    return subprocess.run(["bash", "-c", fn + "\nstamp_now"], cwd=tmp_path, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_a_second_install_in_the_same_clone_rebuilds_nothing(tmp_path):
    script = _fake_clone(tmp_path)
    (tmp_path / ".venv" / ".meshkern-install-stamp").write_text(_stamp(tmp_path) + "\n")
    env = {**os.environ, "PYTHONPATH": ROOT}  # meshkern/orchestration importable as in the real .venv
    p = subprocess.run(["bash", str(script), "--test"], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "meshkern is already installed in .venv from this source (nothing to rebuild)" in p.stdout
    calls = (tmp_path / "calls.log").read_text().splitlines()
    pip = [c for c in calls if c.startswith("-m pip")]
    assert len(pip) == 1 and "-e" not in pip[0].split() and "--no-build-isolation" not in pip[0]  # no C++ build
    assert {"pytest", "triton==3.7.1", "datasets", "gguf>=0.10"} <= set(pip[0].split()[2:])  # the [test] extras


def test_a_changed_source_is_built_again(tmp_path):
    _fake_clone(tmp_path)
    before = _stamp(tmp_path)
    (tmp_path / "csrc" / "mask" / "module.cpp").write_text("// changed\n")
    assert _stamp(tmp_path) != before


def test_the_install_script_shows_progress_and_keeps_ci_s_steps():
    with open(os.path.join(ROOT, "scripts", "install.sh")) as f:
        script = f.read()
    assert "pip install -q" not in script and "still running" in script  # a line every 15 s, not silence
    assert '--no-build-isolation -e .' in script  # the editable install CI's pytest relies on
    assert "default_base_model" in script


def test_every_data_file_of_the_packages_is_installed():
    """A file inside orchestration/ or meshkern/ that is not Python (the presets) is only in a
    non-editable install if pyproject's package-data names it: moving it into a subpackage
    without updating the entry broke `pip install .` once (the presets under config/)."""
    import fnmatch
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        data = tomllib.load(f)["tool"]["setuptools"]["package-data"]
    tracked = subprocess.run(["git", "ls-files", "orchestration", "meshkern"], cwd=ROOT, capture_output=True,
                             text=True).stdout.split()
    if not tracked:
        import pytest
        pytest.skip("not a git checkout")
    for path in tracked:
        if path.endswith(".py"):
            continue
        pkg_dir = os.path.dirname(path)
        while pkg_dir and not os.path.isfile(os.path.join(ROOT, pkg_dir, "__init__.py")):
            pkg_dir = os.path.dirname(pkg_dir)
        covered = False
        d = pkg_dir
        while d:  # an entry of this package or of one above it, with the path below it
            globs = data.get(d.replace("/", "."), [])
            rel = os.path.relpath(path, d)
            covered = covered or any(fnmatch.fnmatch(rel, g) for g in globs)
            d = os.path.dirname(d)
        assert covered, f"{path} is not in pyproject's [tool.setuptools.package-data]: a non-editable install lacks it"
