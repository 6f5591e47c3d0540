"""The composition matrix (issue #41 item 4): for every pair of the trainer's features, it
works, or it is refused for a reason inherent to the method, or it is refused because it
is not built yet; the one source of orchestration.config.validate's pair refusals and of
docs/composition.md (``python -m orchestration.config.composition --markdown``).

A feature is a setting a run has or not (``FEATURES``: its flag and the test of a config
for it; the launch features, local and torchrun, are not in the config and are never
refused). Features of one ``axis`` (one boundary codec, one DP mode, one DP compressor,
one launcher per run) are alternatives, not pairs. Every other pair works unless ``RULES``
says otherwise. ``COVERAGE`` lists the tests that run features together: a pair that works
and appears in none of them is accepted but not run as a pair (the doc marks it).
"""
from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass
from typing import Callable

WORKS, INHERENT, NOT_BUILT = "works", "inherent", "not built"


@dataclass(frozen=True)
class Feature:
    name: str
    flag: str  # how a run turns it on
    axis: str = ""  # features of one axis are alternatives (one per run)
    active: Callable | None = None  # cfg -> bool; None: not decided by the config (the launcher)


@dataclass(frozen=True)
class Rule:
    kind: str  # INHERENT or NOT_BUILT (a refusal), WORKS with a note
    reason: str


def _codecs_used(cfg) -> set[str]:
    return {cfg.replica_codec(r) for r in range(cfg.fast_rows)}


def _features() -> list[Feature]:
    from orchestration.codecs import CODECS
    from orchestration.config.job_config import COMPRESSORS

    out = [Feature("local", "python -m orchestration.train (the local launcher)", "launch"),
           Feature("torchrun", "python -m orchestration.torchrun ... -m orchestration.train", "launch"),
           Feature("resume", "--checkpoint.resume", active=lambda c: bool(c.checkpoint.resume)),
           Feature("elastic", "--mesh.elastic", active=lambda c: c.mesh.elastic),
           Feature("heterogeneous", "--mesh.replicas", active=lambda c: bool(c.mesh.replicas)),
           Feature("anchor", "--anchor.enabled", active=lambda c: c.anchor.enabled),
           Feature("lora", "--adapter lora", active=lambda c: c.adapter.kind == "lora"),
           Feature("bf16", "--model.dtype bfloat16", active=lambda c: c.model.dtype == "bfloat16")]
    out += [Feature(f"dp:{m}", f"--dp.mode {m}", "dp mode", lambda c, m=m: c.dp.mode == m)
            for m in ("allreduce", "diloco", "none")]
    out += [Feature(f"compressor:{k}", f"--dp.compressor {k}", "dp compressor", lambda c, k=k: c.dp.compressor == k)
            for k in COMPRESSORS if k != "none"]
    # a codec is on when a fast replica uses it (the dense boundaries of a full replica left
    # uncompressed by --boundary.compress selective are not --boundary.codec dense)
    out += [Feature(f"codec:{n}", f"--boundary.codec {n}", "boundary codec",
                    lambda c, n=n: c.boundary.codec == n and n in _codecs_used(c))
            for n in CODECS]
    return out


FEATURES: list[Feature] = _features()
BY_NAME = {f.name: f for f in FEATURES}

_SUBSPACE_FROZEN = "the subspace codec constrains the full weights (and freezes the embedding), which LoRA freezes"
RULES: dict[frozenset, Rule] = {frozenset(k): v for k, v in {
    ("elastic", "anchor"): Rule(WORKS, "the anchor row meets the replicas in a store the lighthouse hosts and pulls "
                                       "snapshots from the lowest replica linked; asynchronous mode only "
                                       "(--anchor.delay 0; docs/anchor.md)"),
    ("elastic", "heterogeneous"): Rule(WORKS, "a replica's torchft group ranks are the sync segments, not its stages: "
                                              "one Manager and DP group per segment a rank holds (a full replica's "
                                              "rank holds all), so each group follows every quorum; a replica heals "
                                              "segment by segment, by parameter name, from peers of any split (on a "
                                              "resume too: the checkpoint holds the leader's split); with the anchor, "
                                              "which serves the replicas of its split, the anchor momentum and prior "
                                              "heal by name too"),
    ("elastic", "codec:subspace"): Rule(WORKS, "each replica computes the basis from the base model; the replicas "
                                               "compare it at step 0 (a replica whose basis differs stops) and a "
                                               "heal carries it with the weights"),
    ("elastic", "dp:none"): Rule(INHERENT, "an elastic replica drops out of and heals into the DP sync; with no DP "
                                           "sync there is nothing to drop out of or heal from"),
    ("anchor", "heterogeneous"): Rule(WORKS, "the anchor row takes the deepest replicas' split and serves the "
                                             "replicas of that split (snapshots from the lowest of them); a replica "
                                             "of another depth trains without its prior: a full replica has no stage "
                                             "boundary, so nothing masked to correct"),
    ("anchor", "codec:subspace"): Rule(WORKS, "the anchor computes its gradient on a snapshot of the constrained "
                                              "weights (the embedding frozen on every rank); the fast replica applies "
                                              "the prior, then puts its weights back into the subspace"),
    ("lora", "codec:subspace"): Rule(INHERENT, _SUBSPACE_FROZEN),
    **{("dp:none", f"compressor:{k}"): Rule(WORKS, "accepted; with no DP sync the compressor is unused")
       for k in ("powersgd", "sparseloco", "int8")},
}.items()}


def rule(a: str, b: str) -> Rule:
    """The matrix's entry for features ``a`` and ``b`` (distinct, of different axes)."""
    if a == b or (BY_NAME[a].axis and BY_NAME[a].axis == BY_NAME[b].axis):
        raise ValueError(f"{a} and {b} are alternatives ({BY_NAME[a].axis or a}), not a pair")
    return RULES.get(frozenset((a, b)), Rule(WORKS, ""))


def active(cfg) -> list[str]:
    """The features a config turns on, in FEATURES order (the launch ones are not in it)."""
    return [f.name for f in FEATURES if f.active is not None and f.active(cfg)]


def refusal(cfg) -> str | None:
    """The first refused pair of ``cfg``'s features as the validator's message, else None."""
    for a, b in itertools.combinations(active(cfg), 2):
        r = rule(a, b)
        if r.kind == NOT_BUILT:
            return f"{BY_NAME[a].flag} with {BY_NAME[b].flag} is not supported yet: {r.reason} (docs/composition.md)"
        if r.kind == INHERENT:
            return f"{BY_NAME[a].flag} with {BY_NAME[b].flag} cannot work: {r.reason} (docs/composition.md)"
    return None


# Tests that run features together (every pair of a tuple is run as a pair); the stacks of
# tests/test_composition_runs.py are STACKS, the others' tuples are read off their flags.
STACKS: dict[str, tuple[str, ...]] = {
    "hetero-pca-lora-bf16-resume": ("local", "heterogeneous", "codec:pca", "lora", "bf16", "resume", "dp:diloco",
                                    "compressor:sparseloco"),
    "anchor-pca-lora-bf16-resume": ("local", "anchor", "codec:pca", "lora", "bf16", "resume", "dp:allreduce",
                                       "compressor:int8"),
    "hetero-aqsgd-allreduce-int8-resume": ("local", "heterogeneous", "codec:aqsgd", "dp:allreduce", "compressor:int8",
                                           "resume", "bf16"),
    "anchor-tahquant-diloco-powersgd": ("local", "anchor", "codec:tahquant", "dp:diloco", "compressor:powersgd",
                                        "bf16", "resume"),
    "hetero-subspace-none": ("local", "heterogeneous", "codec:subspace", "dp:none", "bf16", "resume"),
    "hetero-anchor-pca-diloco-powersgd": ("local", "heterogeneous", "anchor", "codec:pca", "dp:diloco",
                                          "compressor:powersgd", "resume"),
    "anchor-subspace-diloco-powersgd": ("local", "anchor", "codec:subspace", "dp:diloco", "compressor:powersgd"),
    "bottleneck-lora-none": ("local", "codec:bottleneck", "lora", "dp:none", "bf16", "resume"),
    # every other pair the matrix says works, a codec at a time (a run has one codec and one DP mode)
    "dense-hetero-anchor-lora-bf16-diloco-sparseloco-resume": (
        "local", "codec:dense", "heterogeneous", "anchor", "lora", "bf16", "dp:diloco", "compressor:sparseloco", "resume"),
    "dense-allreduce-powersgd": ("local", "codec:dense", "dp:allreduce", "compressor:powersgd"),
    "dense-none-int8": ("local", "codec:dense", "dp:none", "compressor:int8"),
    "int8-hetero-anchor-lora-bf16-allreduce-int8-resume": (
        "local", "codec:int8", "heterogeneous", "anchor", "lora", "bf16", "dp:allreduce", "compressor:int8", "resume"),
    "int8-diloco-powersgd": ("local", "codec:int8", "dp:diloco", "compressor:powersgd"),
    "int8-none-sparseloco": ("local", "codec:int8", "dp:none", "compressor:sparseloco"),
    "topk-hetero-anchor-bf16-diloco-sparseloco-resume": (
        "local", "codec:topk", "heterogeneous", "anchor", "bf16", "dp:diloco", "compressor:sparseloco", "resume"),
    "topk-none-powersgd": ("local", "codec:topk", "dp:none", "compressor:powersgd"),
    "int4-anchor-bf16-allreduce-int8-resume": ("local", "codec:int4", "anchor", "bf16", "dp:allreduce", "compressor:int8",
                                               "resume"),
    "int4-none-powersgd": ("local", "codec:int4", "dp:none", "compressor:powersgd"),
    "mask-hetero-bf16-allreduce-sparseloco": ("local", "codec:mask", "heterogeneous", "bf16", "dp:allreduce",
                                              "compressor:sparseloco"),
    "mask-diloco-int8": ("local", "codec:mask", "dp:diloco", "compressor:int8"),
    "bottleneck-hetero-anchor-allreduce-int8": ("local", "codec:bottleneck", "heterogeneous", "anchor", "dp:allreduce",
                                                "compressor:int8"),
    "bottleneck-diloco-powersgd": ("local", "codec:bottleneck", "dp:diloco", "compressor:powersgd"),
    "bottleneck-none-sparseloco": ("local", "codec:bottleneck", "dp:none", "compressor:sparseloco"),
    "aqsgd-anchor-diloco-powersgd": ("local", "codec:aqsgd", "anchor", "dp:diloco", "compressor:powersgd"),
    "aqsgd-none-sparseloco": ("local", "codec:aqsgd", "dp:none", "compressor:sparseloco"),
    "tahquant-hetero-allreduce-sparseloco": ("local", "codec:tahquant", "heterogeneous", "dp:allreduce",
                                             "compressor:sparseloco"),
    "tahquant-none-int8": ("local", "codec:tahquant", "dp:none", "compressor:int8"),
    "subspace-allreduce-int8": ("local", "codec:subspace", "dp:allreduce", "compressor:int8"),
    "subspace-diloco-sparseloco": ("local", "codec:subspace", "dp:diloco", "compressor:sparseloco"),
    "pca-none-sparseloco": ("local", "codec:pca", "dp:none", "compressor:sparseloco"),
}
COVERAGE: dict[str, tuple[str, ...]] = {
    **{f"tests/test_composition_runs.py::test_stack[{k}]": v for k, v in STACKS.items()},
    **{f"tests/test_lora_runs.py::test_lora_composes_with_every_circuit[{k}]": ("local", "lora", *v) for k, v in {
        "pca": ("codec:pca",), "m95": ("codec:mask",), "int4": ("codec:int4",), "topk": ("codec:topk",),
        "aqsgd": ("codec:aqsgd",), "tahquant": ("codec:tahquant",),
        "sparseloco": ("codec:pca", "dp:diloco", "compressor:sparseloco"),
        "int8-allreduce": ("codec:pca", "dp:allreduce", "compressor:int8"),
        "m95-ap": ("codec:mask", "anchor", "dp:none", "compressor:powersgd"),
        "replicas-1,2": ("heterogeneous", "codec:int4", "dp:diloco", "compressor:sparseloco"),
        "bf16-base": ("codec:pca", "bf16", "dp:diloco", "compressor:powersgd")}.items()},
    "tests/test_heterogeneous_pca.py::test_pca_trains_a_heterogeneous_mesh_and_counts_each_basis_once_per_sender":
        ("local", "heterogeneous", "codec:pca", "dp:diloco", "compressor:sparseloco"),
    "tests/test_elastic.py::test_killed_replica_is_restarted_heals_exactly_and_the_run_matches_an_uninterrupted_one":
        ("local", "elastic", "codec:pca", "dp:allreduce", "compressor:powersgd"),
    "tests/test_elastic_anchor.py::test_elastic_replicas_and_the_anchor_row_die_and_come_back_while_the_other_side_trains":
        ("local", "elastic", "anchor", "codec:pca", "dp:diloco", "compressor:powersgd"),
    "tests/test_elastic_hosts.py::test_elastic_replicas_on_hosts_with_the_anchor_row_on_its_own_host":
        ("torchrun", "elastic", "anchor", "codec:pca", "dp:diloco", "compressor:powersgd"),
    "tests/test_elastic_heterogeneous.py::test_a_killed_replica_heals_each_segment_from_peers_of_another_split"
    "[full-replica-killed-allreduce]": ("local", "elastic", "heterogeneous", "codec:pca", "dp:allreduce",
                                        "compressor:sparseloco"),
    "tests/test_elastic_heterogeneous.py::test_the_anchor_serves_its_split_while_a_served_replica_dies_and_heals":
        ("local", "elastic", "heterogeneous", "anchor", "codec:pca", "dp:diloco", "compressor:powersgd"),
    "tests/test_composition_runs.py::test_a_stack_under_torchrun_resumes_bit_for_bit": (
        "torchrun", "heterogeneous", "lora", "bf16", "dp:allreduce", "compressor:int8", "codec:int4", "resume"),
    "tests/test_elastic_heterogeneous.py::test_lora_adapters_in_bf16_sync_by_segment_on_elastic_replicas":
        ("local", "elastic", "heterogeneous", "lora", "bf16", "codec:int4", "dp:allreduce", "compressor:int8"),
    "tests/test_elastic_heterogeneous.py::test_a_resumed_replica_of_another_split_waits_for_one_that_loaded_the_checkpoint":
        ("local", "elastic", "heterogeneous", "resume", "codec:pca", "dp:diloco", "compressor:powersgd"),
    "tests/test_elastic.py::test_subspace_codec_replicas_hold_one_basis_and_a_healed_one_takes_its_peers":
        ("local", "elastic", "codec:subspace", "dp:allreduce"),
    "tests/test_train.py::test_other_codecs_optimizers_and_compressors_train":
        ("local", "codec:topk", "dp:allreduce", "compressor:int8"),
    "tests/test_resume_exact.py::test_m95_ap_delay_mode_crash_then_resume_is_bit_identical":
        ("local", "anchor", "resume", "codec:mask", "dp:diloco", "compressor:powersgd"),
}


def covered(a: str, b: str) -> list[str]:
    """The tests of COVERAGE that run ``a`` and ``b`` together."""
    return [t for t, feats in COVERAGE.items() if a in feats and b in feats]


def pairs() -> list[tuple[str, str]]:
    """Every pair of features of different axes, in FEATURES order."""
    return [(a.name, b.name) for a, b in itertools.combinations(FEATURES, 2) if not (a.axis and a.axis == b.axis)]


def markdown() -> str:
    """docs/composition.md."""
    names = [f.name for f in FEATURES]
    mark = {INHERENT: "no", NOT_BUILT: "todo"}

    def cell(a, b):
        if a == b or (BY_NAME[a].axis and BY_NAME[a].axis == BY_NAME[b].axis):
            return "·"
        r = rule(a, b)
        return mark.get(r.kind) or ("ok" if covered(a, b) else "ok*")

    out = ["# Composition matrix", "",
           "Generated by `python -m orchestration.config.composition --markdown` from",
           "`orchestration/config/composition.py`, the source of the validator's refusals of a pair",
           "(`orchestration/config/validate.py`); `tests/test_composition.py` checks this file equals it.", "",
           "- **ok**: works, and a test runs the two together (listed below).",
           "- **ok\\***: accepted and expected to work, but no test runs the two together yet.",
           "- **no**: refused: the two cannot work together (the reason is inherent to the methods).",
           "- **todo**: refused: not built yet (the reason says what is missing).",
           "- **·**: alternatives (one boundary codec, one DP mode, one DP compressor, one launcher per run).", "",
           "## Features", "", "| feature | how a run gets it |", "|---|---|"]
    out += [f"| `{f.name}` | `{f.flag}` |" for f in FEATURES]
    out += ["", "## Matrix", "", "| | " + " | ".join(f"`{n}`" for n in names) + " |",
            "|---|" + "---|" * len(names)]
    out += [f"| `{a}` | " + " | ".join(cell(a, b) for b in names) + " |" for a in names]
    for kind, title in ((INHERENT, "Refused: cannot work together"), (NOT_BUILT, "Refused: not built yet")):
        out += ["", f"## {title}", ""]
        out += [f"- `{a}` + `{b}`: {rule(a, b).reason}." for a, b in pairs() if rule(a, b).kind == kind]
    notes = [f"- `{a}` + `{b}`: {rule(a, b).reason}." for a, b in pairs() if rule(a, b).kind == WORKS and rule(a, b).reason]
    out += ["", "## Notes", ""] + notes
    out += ["", "## Tests that run features together", ""]
    out += [f"- `{t}`: {', '.join(f'`{x}`' for x in feats)}" for t, feats in COVERAGE.items()]
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m orchestration.config.composition", description=__doc__.split("\n")[0])
    p.add_argument("--markdown", action="store_true", help="print docs/composition.md")
    a = p.parse_args(argv)
    if a.markdown:
        print(markdown(), end="")
    else:
        for x, y in pairs():
            r = rule(x, y)
            print(f"{x} + {y}: {r.kind}{': ' + r.reason if r.reason else ''}")


if __name__ == "__main__":
    main()
