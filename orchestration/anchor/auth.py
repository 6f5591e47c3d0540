"""Who may be the anchor (docs/security.md): a per-run secret, HMAC-SHA256 tags on the
store keys the protocol trusts, and a challenge-response on every pair link before any
weight is sent or any update is listened to.

The secret: MESHKERN_ANCHOR_SECRET (hex, or any string of >= 16 characters) if set, else
the file ``--anchor.secret-file`` (default RUN_DIR/anchor.secret), created by the fast
circuit with mode 0600 the first time it is needed (atomically: whoever links the file
first wins, every process reads the same bytes). An anchor row started by the run's own
launcher may create it too (same machine, same run directory); one that joins with
``--anchor.join`` must be given it.

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
import sys
from datetime import timedelta

import torch

from orchestration.anchor.wire import (AUTH, F_KIND, F_MAGIC, F_NUMEL, F_ROUND, F_VERSION, HEADER_LEN, MAGIC, TAG,
                                       header, send)

_FAST, _ANCHOR = 0, 1  # links.FAST, links.ANCHOR (links imports this module)
SECRET_ENV = "MESHKERN_ANCHOR_SECRET"
SECRET_FILE = "anchor.secret"
NONCE_BYTES = MAC_BYTES = 32
MIN_SECRET_BYTES = 16
DOMAIN = b"meshkern-anchor|"


class AuthError(RuntimeError):
    """The other end of a pair link did not prove the run's secret (or sent garbage
    instead). A link failure (links.is_link_failure): the link is dropped, nothing was
    sent or used."""


def secret_path(cfg, plan) -> str:
    """Where the run's secret lives: ``--anchor.secret-file`` or RUN_DIR/anchor.secret."""
    return getattr(cfg.anchor, "secret_file", "") or os.path.join(plan.run_dir, SECRET_FILE)


def _from_env() -> bytes | None:
    v = os.environ.get(SECRET_ENV, "")
    if not v:
        return None
    key = bytes.fromhex(v) if re.fullmatch(r"(?:[0-9a-fA-F]{2})+", v) else v.encode()
    if len(key) < MIN_SECRET_BYTES:
        raise ValueError(f"{SECRET_ENV} holds {len(key)} bytes; the anchor secret needs >= {MIN_SECRET_BYTES}")
    return key


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        key = f.read().strip()
    if len(key) < MIN_SECRET_BYTES:
        raise ValueError(f"{path} holds {len(key)} bytes; the anchor secret needs >= {MIN_SECRET_BYTES}")
    mode = os.stat(path).st_mode & 0o777
    if mode & 0o077:
        print(f"[anchor] warning: the anchor secret {path} is readable by others (mode {mode:o}); "
              "chmod 600 it", file=sys.stderr, flush=True)
    return key


def ensure_secret(path: str) -> bytes:
    """The secret in ``path``, created (32 random bytes, hex, mode 0600) if there is none.
    Race-free between processes: the file is written in full under a temporary name, then
    linked into place (a link never replaces an existing file)."""
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, os.urandom(32).hex().encode() + b"\n")
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process was first: use its secret
        finally:
            os.unlink(tmp)
    return _read(path)


def load_secret(cfg, plan, *, create: bool) -> bytes:
    """The run's secret (see the module docstring). ``create``: make the file if missing
    (the fast circuit, or an anchor row of the same local launch); otherwise a missing
    file is a FileNotFoundError that says how to pass it."""
    key = _from_env()
    if key is not None:
        return key
    path = secret_path(cfg, plan)
    if create:
        return ensure_secret(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"the anchor needs the fast circuit's secret, {path} does not exist: copy the run's "
                                f"{SECRET_FILE} (mode 0600) and pass --anchor.secret-file PATH, or set {SECRET_ENV}")
    return _read(path)


def anchor_secret(cfg) -> bytes:
    """An anchor rank's secret, from its config alone (the rank has no Plan when it joins):
    MESHKERN_ANCHOR_SECRET, else ``--anchor.secret-file``, else RUN_DIR/anchor.secret with
    RUN_DIR = --run.out-dir/--run.name (what the fast circuit's config.yaml names). An
    anchor row of the run's own launch may create the file (whichever side comes first);
    one started with ``--anchor.join`` must find it."""
    key = _from_env()
    if key is not None:
        return key
    path = getattr(cfg.anchor, "secret_file", "")
    if not path:
        if not cfg.run.name:
            raise FileNotFoundError(f"the anchor needs the fast circuit's secret: pass --anchor.secret-file PATH "
                                    f"(the run's {SECRET_FILE}), set {SECRET_ENV}, or --run.name")
        path = os.path.join(cfg.run.out_dir, cfg.run.name, SECRET_FILE)
    if not cfg.anchor.join:
        return ensure_secret(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"the anchor needs the fast circuit's secret, {path} does not exist: copy the run's "
                                f"{SECRET_FILE} (mode 0600) and pass --anchor.secret-file PATH, or set {SECRET_ENV}")
    return _read(path)


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
