"""The one exit-code rule of a run, from what its ranks returned: every launcher (local,
torchrun, elastic, an anchor row joining) ends through ``exit_code``.

    0          trained to the end
    DIVERGED   the divergence guard stopped the run (its report printed)
    130        stopped by Ctrl-C / SIGTERM after saving (the shell's convention); under
               torchrun a clean stop exits 0 instead, since torchrun restarts workers
               that exit non-zero
    1          the mesh failed (orchestration.components.resume.mesh_stopped says where to
               continue from); 2 is a bad command line or input, before anything started
"""
from __future__ import annotations

import sys

from orchestration.components.divergence import DIVERGED

INTERRUPTED = 130


def say_anchor_rows(layout, results) -> None:
    """One line per anchor rank that returned a record (``None``: lost): its generation,
    rounds and why it stopped."""
    for r in results:
        if r is not None:
            print(f"[anchor] {layout.describe(r['rank'])}, generation {r['generation']}: {r['rounds']} rounds, "
                  f"stopped: {r['stopped']}", file=sys.stderr, flush=True)


def exit_code(results, *, speak: bool = True, clean_stop: int = INTERRUPTED) -> int:
    """The exit code of ranks' ``results`` (records, None for an optional rank that was
    lost); ``speak``: print the divergence report (one process of the run does)."""
    outs = [r for r in results if r]
    diverged = next((o["diverged"] for o in outs if o.get("diverged")), "")
    if diverged:
        if speak:
            print(f"error: {diverged}", file=sys.stderr, flush=True)
        return DIVERGED
    return clean_stop if any(o.get("interrupted") for o in outs) else 0
