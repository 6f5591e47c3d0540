"""What one diagnostics run measures (``Settings``: the command line's options as data) and
the checks on them that need no model (``check_settings``), so a bad input fails before
minutes of loading.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from orchestration.diagnose.candidates import CANDIDATES
from orchestration.diagnose.common import ALPHA, BETA_ANC, EVAL_FRACTION, RANK, SPLIT_SEED, TAU, UsageError
from orchestration.diagnose.transforms import parse_codec_spec, spec_codec


@dataclass
class Settings:
    stages: list[int] = field(default_factory=lambda: [2])
    boundaries: list[int] = field(default_factory=list)
    codecs: list[str] | None = None  # None: default_codec_specs
    candidates: list[str] | None = None  # None: all CANDIDATES; []: none
    pca_sweep: bool = True
    every_layer: bool = False
    scan: list[str] = field(default_factory=lambda: ["mask:p=0.95", "massive+mask", "pca", "emb+pca", "pca-int8",
                                                     "sink+pca-int4"])
    budget: int = 15
    seq_len: int = 128
    eval_rows: int = 8
    calib_rows: int = 16
    grad_rows: int = 4
    grads: bool = True
    anchor: bool = True
    anchor_batches: int = 4
    anchor_codec: str = "mask:p=0.95"
    tau: float = TAU
    alpha: float = ALPHA
    beta_anc: float = BETA_ANC
    rank: int = RANK
    seed: int = 0
    massive_m: int = 8
    eval_fraction: float = EVAL_FRACTION
    split_seed: int = SPLIT_SEED
    max_sequences: int = 0


def check_settings(s: Settings) -> None:
    """UsageError for inputs that are wrong before any model is loaded."""
    if not s.stages and not s.boundaries and not s.every_layer:
        raise UsageError("nothing to measure: give --stages, --boundaries or --every-layer")
    for y in s.stages:
        if y < 2:
            raise UsageError(f"--stages {y}: a split needs at least 2 stages to have a boundary")
    for spec in (s.codecs or []) + [s.anchor_codec]:
        spec_codec(spec)
    for name in (s.candidates or []):
        if name not in CANDIDATES:
            raise UsageError(f"--candidates: unknown candidate {name!r}; choose from {', '.join(CANDIDATES)}")
    for name in s.scan:
        if name not in CANDIDATES:
            parse_codec_spec(name)
    if s.budget < 1:
        raise UsageError(f"--budget must be >= 1, got {s.budget}")
    for what in ("eval_rows", "calib_rows", "grad_rows"):
        if getattr(s, what) < 1:
            raise UsageError(f"--{what.replace('_', '-')} must be >= 1")
    if s.grad_rows > s.eval_rows:
        raise UsageError("--grad-rows must be <= --eval-rows (the gradient batch is the first eval rows)")
