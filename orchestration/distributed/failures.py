"""Which errors mean "a peer or a link is gone": the one rule that the launchers (is this
rank's failure a consequence of another's?), the anchor's side links (drop the link, keep
training) and the elastic replicas (report it to the quorum) all apply.

A link failure is what a broken or misbehaving connection raises: a closed or refused
connection, a timeout, a rendezvous store that went away, or a peer that broke the
protocol or could not prove the run's secret (those raise a ``LinkFailure`` subclass).
Anything else is a programming error, which must surface instead of passing for "the
peer is gone".
"""
from __future__ import annotations

# torch.distributed's own error types, by name: they are not importable from one place
# across torch versions, and a name check cannot pull in a backend at import.
_DIST_ERRORS = ("DistBackendError", "DistNetworkError", "DistStoreError")
_STORE_ERRORS = ("DistStoreError", "DistNetworkError")
# What gloo, NCCL and the c10d store say in a RuntimeError when the other end is gone.
_PEER_MARKERS = ("connection closed", "connection reset", "broken pipe", "timed out", "timeout",
                 "connection refused", "peer", "socket", "gloo", "nccl", "closed by")


class LinkFailure(RuntimeError):
    """A peer or link that is gone or misbehaved (the base of the project's own such errors:
    the anchor's ProtocolError, AuthError and FastCircuitGone)."""


class PeerFailure(LinkFailure):
    """Raised inside a rank when a peer it depends on is gone."""


def is_store_error(e: BaseException) -> bool:
    """A rendezvous-store wait that timed out, or a store that went away."""
    return type(e).__name__ in _STORE_ERRORS or "timeout" in str(e).lower()


def is_peer_error(e: BaseException) -> bool:
    """True if ``e`` looks like a consequence of another rank failing (a communication
    error of torch.distributed, or one of ours)."""
    if isinstance(e, PeerFailure):
        return True
    if type(e).__name__ in _DIST_ERRORS:
        return True
    return isinstance(e, RuntimeError) and any(m in str(e).lower() for m in _PEER_MARKERS)


def is_link_failure(e: BaseException) -> bool:
    """True for what a broken or misbehaving link raises (see the module docstring); False
    for a programming error."""
    return isinstance(e, (LinkFailure, ConnectionError, TimeoutError)) or is_peer_error(e) or is_store_error(e)
