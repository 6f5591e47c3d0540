"""The errors of elastic runs (importable without torchft: the trainer catches them)."""


class QuorumLost(RuntimeError):
    """Fewer live replicas than --mesh.min-replicas for longer than --mesh.quorum-timeout-s."""


class HealRefused(PermissionError):
    """A heal transfer that the run's secret does not authenticate (either side)."""
