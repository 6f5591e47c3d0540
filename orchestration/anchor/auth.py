"""Who may be the anchor (docs/security.md): a per-run secret, HMAC-SHA256 tags on the
store keys the protocol trusts, and a challenge-response on every pair link before any
weight is sent or any update is listened to.

The secret and the one rule of who creates it: orchestration.distributed.secret (the
elastic replicas use the same secret). Every process receives it in its Plan.

Handshake on a fresh pair link (fast end F, anchor end A; G generation, s stage, r
replica; every MAC is HMAC-SHA256(secret, "meshkern-anchor|<role>|G|s|r|" + nonce)):

    F -> A   AUTH header + nonce_F (32 random bytes)
    A -> F   MAC("anchor", nonce_F) + nonce_A
    F        checks it (constant time); a wrong MAC: F sends nothing more and drops the link
    F -> A   MAC("fast", nonce_A)
    A        checks it: a fast end that cannot prove the secret gets no update either

Fresh nonces on both sides make a recorded handshake useless on another link.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import re
from datetime import timedelta

import torch

from orchestration.distributed.failures import LinkFailure
from orchestration.anchor.wire import (AUTH, F_KIND, F_MAGIC, F_NUMEL, F_ROUND, F_VERSION, HEADER_LEN, MAGIC, TAG,
                                       header, send)

_FAST, _ANCHOR = 0, 1  # links.FAST, links.ANCHOR (links imports this module)
NONCE_BYTES = MAC_BYTES = 32
DOMAIN = b"meshkern-anchor|"


class AuthError(LinkFailure):
    """The other end of a pair link did not prove the run's secret (or sent garbage
    instead). A link failure (orchestration.distributed.failures): the link is dropped,
    nothing was sent or used."""


def mac(secret: bytes, *parts) -> bytes:
    """HMAC-SHA256(secret, DOMAIN + "|".join(parts)); bytes parts are taken as they are."""
    msg = DOMAIN + b"|".join(p if isinstance(p, bytes) else str(p).encode() for p in parts)
    return hmac.new(secret, msg, hashlib.sha256).digest()


def generation_value(secret: bytes, generation: int) -> str:
    """The store value that announces anchor-row generation G: "G:hex(MAC)"."""
    return f"{generation}:{mac(secret, 'generation', generation).hex()}"


def parse_generation(secret: bytes, value) -> int | None:
    """G from an announce value if it is well formed and carries the secret's MAC, else
    None (a value written by someone without the secret, or garbage)."""
    try:
        text = value.decode("ascii") if isinstance(value, (bytes, bytearray)) else str(value)
    except UnicodeDecodeError:
        return None
    m = re.fullmatch(r"([1-9][0-9]{0,15}):([0-9a-f]{64})", text)
    if m is None:
        return None
    g = int(m.group(1))
    return g if hmac.compare_digest(bytes.fromhex(m.group(2)), mac(secret, "generation", g)) else None


# ------------------------------------------------------------------ the handshake
def _u8(b: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8).clone()


def _recv_bytes(pg, peer: int, n: int, timeout_s: float) -> bytes:
    t = torch.empty(n, dtype=torch.uint8)
    pg.recv([t], peer, TAG).wait(timedelta(seconds=timeout_s))
    return t.numpy().tobytes()


def fast_handshake(pg, secret: bytes, generation: int, stage: int, row: int, timeout_s: float) -> None:
    """Fast end of a new pair link: returns once the anchor end proved the secret (and
    was answered); raises AuthError if it did not, before anything else is sent. Each
    wait is bounded by ``timeout_s``: a silent peer cannot hold the link thread."""
    nonce = os.urandom(NONCE_BYTES)
    send([header(AUTH, round=generation, version=stage, numel=row), _u8(nonce)], _ANCHOR, pg)
    got = _recv_bytes(pg, _ANCHOR, MAC_BYTES + NONCE_BYTES, timeout_s)
    if not hmac.compare_digest(got[:MAC_BYTES], mac(secret, "anchor", generation, stage, row, nonce)):
        raise AuthError(f"the anchor of generation {generation}, stage {stage} did not prove the run's secret")
    send([_u8(mac(secret, "fast", generation, stage, row, got[MAC_BYTES:]))], _ANCHOR, pg)


def anchor_handshake(pg, secret: bytes, generation: int, stage: int, row: int, timeout_s: float) -> None:
    """Anchor end: answers the fast end's challenge and checks its answer to ours;
    AuthError if the fast end sent something else or cannot prove the secret."""
    t = torch.empty(HEADER_LEN, dtype=torch.int64)
    pg.recv([t], _FAST, TAG).wait(timedelta(seconds=timeout_s))
    if (int(t[F_MAGIC]), int(t[F_KIND]), int(t[F_ROUND]), int(t[F_VERSION]), int(t[F_NUMEL])) != \
            (MAGIC, AUTH, generation, stage, row):
        raise AuthError(f"anchor generation {generation}, stage {stage}: expected the fast end's challenge, got "
                        f"header {t.tolist()[:8]}")
    nonce_f = _recv_bytes(pg, _FAST, NONCE_BYTES, timeout_s)
    nonce = os.urandom(NONCE_BYTES)
    send([_u8(mac(secret, "anchor", generation, stage, row, nonce_f) + nonce)], _FAST, pg)
    got = _recv_bytes(pg, _FAST, MAC_BYTES, timeout_s)
    if not hmac.compare_digest(got, mac(secret, "fast", generation, stage, row, nonce)):
        raise AuthError(f"anchor generation {generation}, stage {stage}: fast replica {row} did not prove the "
                        "run's secret")
