"""Synthetic tasks: generators give correct, deterministic examples; the scorer."""
import re

import pytest

from orchestration.data import tasks


def test_addition_answers_are_sums():
    exs = tasks.examples("add", 200, seed=5)
    for e in exs:
        m = re.fullmatch(r"(\d{1,3})\+(\d{1,3})=", e.prompt)
        assert m, e.prompt
        assert e.answer == str(int(m.group(1)) + int(m.group(2)))
    assert max(len(e.answer) for e in exs) == 4  # multi-digit with carries occur
    assert tasks.examples("add", 1)[0].text.endswith("\n")


def test_string_transforms():
    for e in tasks.examples("reverse", 50):
        word = re.fullmatch(r"reverse ([a-z]{3,7}):", e.prompt).group(1)
        assert e.answer == word[::-1]
    for e in tasks.examples("upper", 50):
        word = re.fullmatch(r"upper ([a-z]{3,7}):", e.prompt).group(1)
        assert e.answer == word.upper()
    for e in tasks.examples("copy", 50):
        assert e.prompt == f"copy {e.answer}:" and re.fullmatch(r"[a-z]{3,7}", e.answer)
    assert tasks.Example("reverse abc:", "cba").text == "reverse abc: cba\n"


def test_deterministic_and_seed_dependent():
    assert tasks.examples("add", 20, seed=3) == tasks.examples("add", 20, seed=3)
    assert tasks.examples("add", 20, seed=3) != tasks.examples("add", 20, seed=4)
    train = set(e.prompt for e in tasks.examples("reverse", 500, seed=tasks.TRAIN_SEED))
    held = [e.prompt for e in tasks.examples("reverse", 500, seed=tasks.EVAL_SEED)]
    assert sum(p in train for p in held) < 5  # evaluation is on (nearly all) unseen prompts


def test_task_texts_interleave():
    texts = tasks.task_texts("add,upper", 3)
    assert len(texts) == 6 and texts[0].count("+") == 1 and texts[1].startswith("upper ")
    assert len(tasks.task_texts("all", 2)) == 2 * len(tasks.TASKS)
    with pytest.raises(ValueError, match="unknown task 'mul'"):
        tasks.task_texts("mul")
    with pytest.raises(ValueError, match="no task"):
        tasks.task_texts(" , ")


def test_exact_match_scorer_known_answers():
    assert tasks.exact_match(["579\nnext", " 12 ", "ABC"], ["579", "12", "abc"]) == pytest.approx(2 / 3)
    assert tasks.exact_match(["5790"], ["579"]) == 0.0
    assert tasks.extract_answer("  olleh\n123+4=127") == "olleh"
    with pytest.raises(ValueError, match="2 predictions for 1 answers"):
        tasks.exact_match(["a", "b"], ["a"])
    with pytest.raises(ValueError, match="zero examples"):
        tasks.exact_match([], [])
    with pytest.raises(ValueError, match="positive int"):
        tasks.examples("add", 0)
