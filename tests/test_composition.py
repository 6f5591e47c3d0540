"""The composition matrix (orchestration.config.composition): the validator refuses each
refused pair with the matrix's reason and accepts every pair the matrix says works, and
docs/composition.md is the matrix's own text."""
import os
import re

import pytest

from orchestration.config import composition as comp
from orchestration.config import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The flags that give a run one feature (and what that feature needs on its own).
FEATURE_ARGV = {
    "resume": ["--checkpoint.resume", "latest", "--run.name", "r"],
    "elastic": ["--mesh.elastic"],
    "heterogeneous": ["--mesh.replicas", "1,2,2"],
    "anchor": ["--anchor.enabled", "true", "--train.optimizer", "spectral"],
    "lora": ["--adapter", "lora"],
    "bf16": ["--model.dtype", "bfloat16"],
    **{f.name: ["--dp.mode", f.name.split(":")[1]] for f in comp.FEATURES if f.axis == "dp mode"},
    **{f.name: ["--dp.compressor", f.name.split(":")[1]] for f in comp.FEATURES if f.axis == "dp compressor"},
    **{f.name: ["--boundary.codec", f.name.split(":")[1]] for f in comp.FEATURES if f.axis == "boundary codec"},
}
CONFIG_PAIRS = [(a, b) for a, b in comp.pairs() if a in FEATURE_ARGV and b in FEATURE_ARGV]


def test_every_feature_the_config_decides_has_flags_that_turn_it_on():
    assert set(FEATURE_ARGV) == {f.name for f in comp.FEATURES if f.active is not None}
    for name, argv in FEATURE_ARGV.items():
        assert name in comp.active(parse_args(argv)[0]), name


@pytest.mark.parametrize("a,b", [p for p in CONFIG_PAIRS if comp.rule(*p).kind != comp.WORKS])
def test_the_validator_refuses_a_refused_pair_with_the_matrixs_reason(a, b):
    rule = comp.rule(a, b)
    words = "is not supported yet" if rule.kind == comp.NOT_BUILT else "cannot work"
    for argv in (FEATURE_ARGV[a] + FEATURE_ARGV[b], FEATURE_ARGV[b] + FEATURE_ARGV[a]):
        with pytest.raises(ValueError, match=f"{words}: {re.escape(rule.reason)}"):
            parse_args(argv)


def test_the_validator_accepts_every_pair_the_matrix_says_works():
    """Each pair on its own (the defaults for everything else): nothing else in the validator
    refuses it, so the matrix is the one list of pair refusals."""
    refused = []
    for a, b in CONFIG_PAIRS:
        if comp.rule(a, b).kind == comp.WORKS:
            try:
                parse_args(FEATURE_ARGV[a] + FEATURE_ARGV[b])
            except ValueError as e:
                refused.append(f"{a} + {b}: {e}")
    assert refused == []


def test_known_refusals_and_what_is_not_built_yet():
    assert comp.rule("elastic", "anchor").kind == comp.WORKS  # issue #41 item 1
    assert comp.rule("heterogeneous", "elastic").kind == comp.WORKS  # issue #41 item 2: one Manager per segment
    # every pair now works or is refused for a reason inherent to the method
    assert [(a, b) for a, b in comp.pairs() if comp.rule(a, b).kind == comp.NOT_BUILT] == []
    assert comp.rule("heterogeneous", "anchor").kind == comp.WORKS  # the anchor serves the replicas of its split
    assert comp.rule("lora", "codec:subspace").kind == comp.INHERENT
    assert comp.rule("heterogeneous", "codec:pca").kind == comp.WORKS  # issue #41 item 3
    with pytest.raises(ValueError, match="alternatives"):
        comp.rule("codec:pca", "codec:mask")


def test_coverage_names_real_tests_and_features():
    for test, feats in comp.COVERAGE.items():
        path, _, name = test.partition("::")
        assert re.search(rf"def {re.escape(name.split('[')[0])}\(", open(os.path.join(ROOT, path)).read()), test
        assert set(feats) <= set(comp.BY_NAME), test
        for a, b in ((a, b) for i, a in enumerate(feats) for b in feats[i + 1:]):
            assert comp.rule(a, b).kind == comp.WORKS, (test, a, b)  # a test never claims a refused pair


def test_the_doc_is_the_matrix():
    with open(os.path.join(ROOT, "docs", "composition.md")) as f:
        assert f.read() == comp.markdown(), "regenerate: python -m orchestration.config.composition --markdown"
