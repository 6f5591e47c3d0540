"""Addresses an elastic replica advertises, checked at start (importable without torchft).

A replica advertises one address to the others (``--mesh.bind``): its torchft store (where
the replicas' DP groups rendezvous), its manager and its heal server listen there, and the
lighthouse hands it to every peer. One the peers cannot reach does not fail loudly in
torchft: every quorum with it waits out --mesh.quorum-timeout-s and the run crawls at one
step per timeout with no sync. So these are errors at start, naming the flag to set:

- a wildcard (0.0.0.0, ::): it would be advertised as is, and no peer can connect to it;
- a loopback address while the lighthouse (--mesh.join) is not: replicas on other hosts
  would connect to their own loopback;
- an address that is not one of this host's (nothing can listen on it).
"""
from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

SET_BIND = ("set --mesh.bind to this host's address on the network the other replicas and the lighthouse are on "
            "(e.g. its VPN or LAN address)")


def _ip(host: str):
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def is_loopback(host: str) -> bool:
    """A loopback literal or name (names other than ``localhost`` are resolved; one that does
    not resolve is not called loopback)."""
    ip = _ip(host)
    if ip is not None:
        return ip.is_loopback
    if host.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def advertise_problem(bind: str, lighthouse: str) -> str | None:
    """Why ``bind`` (--mesh.bind) cannot be what other replicas reach, given the lighthouse
    URL ``lighthouse`` (--mesh.join; empty: this launcher starts it on ``bind``), else None."""
    ip = _ip(bind)
    if not bind or (ip is not None and ip.is_unspecified):
        return (f"--mesh.bind {bind!r} is a wildcard: it is advertised to the other replicas as is, and none can "
                f"connect to it; {SET_BIND}")
    host = urlsplit(lighthouse).hostname if lighthouse else None
    if host and is_loopback(bind) and not is_loopback(host):
        return (f"--mesh.bind {bind} is loopback but the lighthouse {lighthouse} is not: this replica's torchft store, "
                f"manager and heal server would be advertised at {bind}, which replicas on other hosts cannot reach "
                f"(every quorum with them would time out); {SET_BIND}")
    return None


def local_problem(bind: str) -> str | None:
    """Why nothing can listen on ``bind`` on this host, else None (checked where the replica runs)."""
    try:
        infos = socket.getaddrinfo(bind, 0, type=socket.SOCK_STREAM)
    except OSError as e:
        return f"--mesh.bind {bind!r} does not resolve here ({e}); {SET_BIND}"
    err = None
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            try:
                s.bind(addr)
                return None
            except OSError as e:
                err = e
    return f"--mesh.bind {bind} is not an address of this host ({err}); {SET_BIND}"
