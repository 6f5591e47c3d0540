"""The errors of elastic runs (importable without torchft: the trainer catches them), and
how an elastic rank ends on one it does not catch."""
from __future__ import annotations

import os
import sys
import traceback


class QuorumLost(RuntimeError):
    """Fewer live replicas than --mesh.min-replicas for longer than --mesh.quorum-timeout-s."""


class HealRefused(PermissionError):
    """A heal transfer that the run's secret does not authenticate (either side)."""


def hard_exit_on_error() -> None:
    """An uncaught exception must end this process at once: a normal interpreter exit joins
    torchft's quorum thread while its Rust ManagerServer keeps heartbeating, so a half-dead
    replica would look alive to the lighthouse until the join timeout."""
    def hook(kind, value, tb):
        # to the real stderr: torch.distributed wraps this hook and buffers sys.stderr around it,
        # to prefix the rank, and would print the buffer only after the hook returned
        traceback.print_exception(kind, value, tb, file=sys.__stderr__)
        sys.__stderr__.flush()
        os._exit(1)

    sys.excepthook = hook
