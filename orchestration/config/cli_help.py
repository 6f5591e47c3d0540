"""The trainer's command line as a newcomer meets it: ``--help`` (a short usage line,
worked examples, the built-in data sources and models, then the flags grouped by
section, test-only flags hidden) and the one-line error of a mistyped flag, with the
closest known flag (difflib). orchestration.config builds the parser with these.
"""
from __future__ import annotations

import argparse
import difflib
import textwrap

PROG = "python -m orchestration.train"
USAGE = f"{PROG} [--preset NAME] [--config FILE] [--SECTION.FIELD VALUE ...]"

EXAMPLES = f"""\
examples:
  {PROG}                                   # the embedded default: a few minutes on 2 CPU cores
  {PROG} --preset m95-ap --steps 200       # a published row of the paper's table
  {PROG} --data corpus:prose --steps 100 --boundary.codec mask --boundary.p 0.9   # the paper's mask, p=0.9
  {PROG} --model smollm2-135m --data.seq-len 64 --train.batch-size 2 --train.microbatches 2
  {PROG} --model smollm2-135m --adapter lora --train.lr 1e-3   # LoRA on every stage (docs/lora.md)
  {PROG} --model DIR --adapter lora --model.dtype bfloat16 --dry-run   # memory per stage, nothing started
  {PROG} --config runs/NAME/config.yaml --checkpoint.resume latest   # continue a run
  {PROG} --print-config > run.yaml         # the resolved config, to edit and pass to --config
"""

SECTIONS_HELP = {
    "mesh": "the X x Y process grid (rows: data-parallel replicas, columns: pipeline stages)",
    "model": "the model to adapt",
    "data": "the training text and its packing",
    "train": "steps, batch, optimizer and its schedule",
    "boundary": "what crosses a pipeline-stage boundary (the fast circuit's codec)",
    "dp": "how replicas sync (data parallelism)",
    "anchor": "the slow anchor circuit (SpectralAdamW; presets m95-ap, m90-ap)",
    "adapter": "LoRA adapters instead of full fine-tuning (--adapter lora; docs/lora.md)",
    "checkpoint": "saving and resuming",
    "run": "run folder, logging, progress and the link model of the summary",
}


def builtin_sources() -> list[tuple[str, str]]:
    """(``--data`` value, what it is) of every built-in data source (orchestration.data.texts)."""
    from orchestration.data.tasks import TASKS

    out = [("corpus:python", "the Python standard library's .py files (domain B; the default --data)"),
           ("corpus:prose", "English prose: Python's reference topics, local package docs and man pages "
                            "(domain A; the base model's pretraining text)"),
           ("corpus:locales", "locale data: glibc's locale definitions, CPython's code page tables where the system "
                              "has none (a domain far from pretrained models, issue #43)")]
    out.append(("task:all", "synthetic exact-match tasks: " + ", ".join(sorted(TASKS))))
    out += [(f"task:{n}", t.description) for n, t in sorted(TASKS.items())]
    return out


def builtin_models() -> list[tuple[str, str]]:
    from orchestration.models.gguf_convert import BUILTIN_MODELS

    out = [("(empty)", "the default base model: a small Llama pretrained on corpus:prose, built on first use")]
    return out + [(n, m.description) for n, m in sorted(BUILTIN_MODELS.items())]


def families_help() -> str:
    """The model families the stage splitter takes, from its own table (orchestration.models.families)."""
    from orchestration.models.families import supported_families

    return ", ".join(supported_families())


def epilog_builtins() -> str:
    def block(title, rows):
        w = max(len(k) for k, _ in rows)
        return "\n".join([title] + [textwrap.fill(v, 98, initial_indent=f"  {k:<{w}}  ", subsequent_indent=" " * (w + 4))
                                     for k, v in rows])

    return (block("built-in data sources (--data; or a text file/dir, .jsonl, saved HF dataset):", builtin_sources())
            + "\n\n" + block("built-in models (--model; or a HF checkpoint directory, a .gguf file):", builtin_models())
            + "\n\n" + textwrap.fill(families_help(), 98, initial_indent="  ", subsequent_indent="  ").join(
                ["model families that split into pipeline stages (--model DIR of one of these):\n", ""]))


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the examples' layout; one flag per line, its help on the next."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=32, width=100)


class TrainParser(argparse.ArgumentParser):
    """An ArgumentParser whose mistakes are one line (a ValueError, which the entry point
    prints as ``error: ...`` with exit code 2), never the usage block."""

    def error(self, message: str):
        raise ValueError(f"{message} (see --help)")

    def parse_args(self, args=None, namespace=None):
        ns, rest = self.parse_known_args(args, namespace)
        if rest:
            raise ValueError(unknown_flag_message(rest, self.known_flags()))
        return ns

    def known_flags(self) -> list[str]:
        """Every listed flag (not the hidden spellings)."""
        return [s for a in self._actions if a.help != argparse.SUPPRESS for s in a.option_strings
                if s.startswith("--")]


def closest_flag(flag: str, known: list[str]) -> str | None:
    """The known flag a mistyped ``flag`` most likely meant: the same field in another
    section (--mask.p -> --boundary.p, --lr -> --train.lr), else difflib's closest."""
    name = flag.split("=", 1)[0]
    field = name.lstrip("-").split(".")[-1].replace("_", "-")
    same_field = [k for k in known if "." in k and k.split(".", 1)[1] == field]
    if len(same_field) == 1:
        return same_field[0]
    close = difflib.get_close_matches(name.replace("_", "-"), same_field or known, n=1, cutoff=0.6)
    return close[0] if close else None


def unknown_flag_message(rest: list[str], known: list[str]) -> str:
    flags = [r for r in rest if r.startswith("-")]
    if not flags:
        return f"unexpected argument {rest[0]!r}: every value follows its flag, e.g. --steps 100 (see --help)"
    bad = flags[0].split("=", 1)[0]
    hint = closest_flag(bad, known)
    return f"unknown flag {bad}" + (f"; did you mean {hint}?" if hint else " (see --help)")
