"""What every part of orchestration.diagnose shares: the trainer's defaults it measures
with, the one error type for bad inputs, and the progress log.

The defaults are read from orchestration.config (DataConfig, TrainConfig) so a
diagnostics run splits rows and builds the anchor exactly as a training run would.
"""
from __future__ import annotations

import json
import sys
import time

# The trainer's defaults (orchestration/config.py); read from there when present.
try:  # pragma: no cover - depends on the config module's current shape
    from orchestration.config import DataConfig as _DC, TrainConfig as _TC
    EVAL_FRACTION, SPLIT_SEED = float(_DC().eval_fraction), int(_DC().split_seed)
    TAU, ALPHA, BETA_ANC, RANK = float(_TC().tau), float(_TC().alpha), float(_TC().beta_anc), int(_TC().spectral_rank)
except Exception:  # pragma: no cover
    EVAL_FRACTION, SPLIT_SEED, TAU, ALPHA, BETA_ANC, RANK = 0.05, 0, 1e-3, 0.3, 0.9, 16


class UsageError(ValueError):
    """A bad command-line input: reported as one line, exit status 2."""


def log(msg: str) -> None:
    print(f"[diagnose {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def fmt(x, nd=3) -> str:
    """A number for the table and the progress lines; None (not measurable) as a dash."""
    return "   -  " if x is None else f"{x:.{nd}f}"


def write_jsonl(path: str, records) -> None:
    """``records`` as ``path``, one JSON object a line, and a line saying where they went."""
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    print(f"wrote {path}", flush=True)
