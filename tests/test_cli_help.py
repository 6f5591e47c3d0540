"""The trainer's command line as a newcomer meets it (issue #17): ``--help`` opens with a
short usage line and worked examples, groups the flags by section, hides test-only
flags, lists the built-in data sources and models; a mistyped flag is one error line
naming the closest known flag, never the usage block; config files are recognised by
content, not by extension."""
import json
import subprocess
import sys

import pytest

from orchestration import train

from orchestration.config import cli_help
from orchestration.config import build_parser, load_file, parse_args


def _help() -> str:
    return build_parser().format_help()


def test_help_opens_with_a_short_usage_line_and_examples():
    lines = _help().splitlines()
    assert lines[0] == f"usage: {cli_help.USAGE}" and len(lines[0]) <= 100
    assert lines[1] == ""  # the usage is one line, not a block of every flag
    head = "\n".join(lines[:20])
    assert "examples:" in head
    assert head.count("python -m orchestration.train") >= 5  # usage + worked examples, before any flag
    assert head.index("examples:") < _help().index("--mesh.rows")


def test_help_groups_flags_by_section_and_hides_test_only_flags():
    text = _help()
    order = [text.index(f"--{sec}.*:") for sec in ("mesh", "model", "data", "train", "boundary", "dp", "anchor",
                                                   "checkpoint", "run")]
    assert order == sorted(order)
    assert "--run.fail-rank" not in text and "--run.fail-step" not in text and "fault injection" not in text
    assert "(default: None)" not in text and "(default: 3) (default" not in text  # each default once
    cfg, _ = parse_args(["--run.fail-rank", "1", "--run.fail-step", "2"])  # still accepted
    assert (cfg.run.fail_rank, cfg.run.fail_step) == (1, 2)


def test_help_lists_builtin_data_sources_and_models():
    text = _help()
    for name in ("corpus:python", "corpus:prose", "task:all", "task:add", "task:reverse", "smollm2-135m"):
        assert f"\n  {name} " in text, name


def test_help_is_printed_by_the_entry_point(capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {cli_help.USAGE}\n")


@pytest.mark.parametrize("argv, line", [
    (["--mask.p", "1.5"], "error: unknown flag --mask.p; did you mean --boundary.p?"),
    (["--lr", "1e-3"], "error: unknown flag --lr; did you mean --train.lr?"),
    (["--train.stpes", "3"], "error: unknown flag --train.stpes; did you mean --train.steps?"),
    (["--checkpoint.evry=5"], "error: unknown flag --checkpoint.evry; did you mean --checkpoint.every?"),
    (["--zzz"], "error: unknown flag --zzz (see --help)"),
    (["--steps"], "error: argument --train.steps/--steps: expected one argument (see --help)"),
    (["foo"], "error: unexpected argument 'foo': every value follows its flag, e.g. --steps 100 (see --help)"),
])
def test_a_mistyped_flag_is_one_line_with_the_closest_flag(argv, line, capsys):
    assert train.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [line]
    assert "usage:" not in captured.out + captured.err


def test_the_module_prints_one_line_for_an_unknown_flag():
    p = subprocess.run([sys.executable, "-m", "orchestration.train", "--mask.p", "1.5"], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == ["error: unknown flag --mask.p; did you mean --boundary.p?"]


@pytest.mark.parametrize("name", ["run.cfg", "config", "run.txt", "run.json", "run.yaml"])
def test_config_files_are_recognised_by_content(tmp_path, name):
    y, j = tmp_path / f"y-{name}", tmp_path / f"j-{name}"
    y.write_text("train:\n  steps: 7\nboundary: {p: 0.9}\n")
    j.write_text(json.dumps({"train": {"steps": 7}, "boundary": {"p": 0.9}}))
    for f in (y, j):
        cfg, _ = parse_args(["--config", str(f)])
        assert cfg.train.steps == 7 and cfg.boundary.p == 0.9


def test_a_config_file_that_is_neither_names_the_problem(tmp_path):
    f = tmp_path / "notes"
    f.write_text("just some words\n")
    with pytest.raises(ValueError, match=r"holds a str, not a mapping of sections"):
        load_file(str(f))
    f.write_text("train: {steps: [1, 2\n")
    with pytest.raises(ValueError, match=r"is neither valid YAML nor JSON"):
        load_file(str(f))


def test_checkpoints_are_periodic_by_default():
    cfg, _ = parse_args([])
    assert cfg.checkpoint.every == 50 and cfg.checkpoint.keep == 2
    assert "besides the end" in _help()
