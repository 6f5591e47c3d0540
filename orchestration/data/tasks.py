"""Synthetic tasks that generate their own data, scored by exact match.

Each example is a ``prompt`` and an ``answer``; its training text is
``prompt + " " + answer + "\\n"`` (the space makes the answer's first word a
space-prefixed word, as it is inside the prompt, so a byte-level BPE splits a copied
word into the same tokens) and a model answers by greedy generation after the prompt
until a newline (``orchestration.evaluate.exact_match``). Tasks:

  - ``add``: multi-digit addition, ``"483+27="`` -> ``"510"`` (operands of 1 to
    ``max_digits`` digits, default 3);
  - ``reverse``: ``"reverse abcde:"`` -> ``"edcba"`` (3-7 lowercase letters);
  - ``upper``: ``"upper abcde:"`` -> ``"ABCDE"`` (3-7 lowercase letters);
  - ``copy``: ``"copy abcde:"`` -> ``"abcde"`` (3-7 lowercase letters): the easiest,
    it needs only attention back to the word (an induction pattern), so a small model
    scores above zero after a short adaptation where the others may not.

Generation is deterministic: ``examples(task, n, seed)`` depends only on its
arguments (a private ``random.Random(seed)`` per call). Use different seeds for
training text (``task_texts``, seed 0) and evaluation (seed 1); with 10^6 operand
pairs / 26^3..26^7 strings, the chance overlap is negligible.
"""
from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import Callable, Sequence

TRAIN_SEED = 0
EVAL_SEED = 1


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str

    @property
    def text(self) -> str:
        """The training text: prompt, space, answer, newline (the answer's terminator)."""
        return f"{self.prompt} {self.answer}\n"


@dataclass(frozen=True)
class Task:
    name: str
    description: str
    make: Callable[[random.Random], Example]


def _add(rng: random.Random, max_digits: int = 3) -> Example:
    a = rng.randrange(10 ** rng.randint(1, max_digits))
    b = rng.randrange(10 ** rng.randint(1, max_digits))
    return Example(f"{a}+{b}=", str(a + b))


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 7)))


def _reverse(rng: random.Random) -> Example:
    w = _word(rng)
    return Example(f"reverse {w}:", w[::-1])


def _copy(rng: random.Random) -> Example:
    w = _word(rng)
    return Example(f"copy {w}:", w)


def _upper(rng: random.Random) -> Example:
    w = _word(rng)
    return Example(f"upper {w}:", w.upper())


TASKS: dict[str, Task] = {
    "add": Task("add", "multi-digit addition (1-3 digit operands)", _add),
    "reverse": Task("reverse", "reverse a lowercase word", _reverse),
    "upper": Task("upper", "uppercase a lowercase word", _upper),
    "copy": Task("copy", "repeat a lowercase word", _copy),
}


def get_task(name: str | Task) -> Task:
    if isinstance(name, Task):
        return name
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose from {sorted(TASKS)}")
    return TASKS[name]


def examples(task: str | Task, n: int, *, seed: int = EVAL_SEED) -> list[Example]:
    """``n`` examples of ``task``, a pure function of (task, n, seed)."""
    t = get_task(task)
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"n must be a positive int, got {n!r}")
    rng = random.Random(f"{t.name}:{seed}")
    return [t.make(rng) for _ in range(n)]


def task_texts(spec: str, n: int = 4000, *, seed: int = TRAIN_SEED) -> list[str]:
    """Training documents for ``spec``: a task name, a comma list or ``"all"``; ``n``
    examples per task, interleaved (one example per document)."""
    names = sorted(TASKS) if spec == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise ValueError(f"no task named in {spec!r}")
    per_task = [examples(name, n, seed=seed) for name in names]
    return [ex.text for group in zip(*per_task) for ex in group]


def extract_answer(generated: str) -> str:
    """The answer part of a generation: up to the first newline, outer spaces removed."""
    return generated.split("\n", 1)[0].strip()


def exact_match(predictions: Sequence[str], answers: Sequence[str]) -> float:
    """Fraction of predictions equal to their answer after :func:`extract_answer`
    (case-sensitive: ``upper`` must really uppercase)."""
    if len(predictions) != len(answers):
        raise ValueError(f"{len(predictions)} predictions for {len(answers)} answers")
    if not answers:
        raise ValueError("exact_match of zero examples is undefined")
    return sum(extract_answer(p) == a.strip() for p, a in zip(predictions, answers)) / len(answers)
