"""The run's shared secret: what anchor rows (orchestration.anchor.auth) and elastic
replicas (orchestration.elastic.transport) prove to each other before any weight moves
(docs/security.md).

Where it comes from, first match wins:
    MESHKERN_ANCHOR_SECRET   hex, or any string of >= 16 characters
    --anchor.secret-file     a file (mode 0600)
    RUN_DIR/anchor.secret    the run's own file

The one creation rule: only the process that starts a run on its own machine (the local
launcher of a new run) may create the file; a process that joins a running one
(``--anchor.join``, ``--mesh.join``) or runs under torchrun (every host would make its
own) must be given it, and is told how when it is missing.
"""
from __future__ import annotations

import os
import re
import sys

SECRET_ENV = "MESHKERN_ANCHOR_SECRET"
SECRET_FILE = "anchor.secret"
MIN_SECRET_BYTES = 16
HOW_TO_SHARE = ("copy the run's secret file to this machine (mode 0600) and pass --anchor.secret-file PATH, or set "
                f"{SECRET_ENV}; to make one for a new run: python -c 'import secrets; print(secrets.token_hex(32))' "
                "> run.secret && chmod 600 run.secret")


def secret_path(cfg, run_dir: str) -> str:
    """Where the run's secret file is: ``--anchor.secret-file``, else RUN_DIR/anchor.secret."""
    return getattr(cfg.anchor, "secret_file", "") or os.path.join(run_dir, SECRET_FILE)


def creates_secret(cfg, under_torchrun: bool) -> bool:
    """The creation rule (module docstring): True only for the local launcher of a new run."""
    return not (under_torchrun or cfg.anchor.join or cfg.mesh.join)


def run_secret(cfg, run_dir: str, *, create: bool) -> bytes:
    """The run's secret; ``create``: make the file if there is none (``creates_secret``).
    Raises FileNotFoundError (how to pass one) or ValueError (too short)."""
    key = _from_env()
    if key is not None:
        return key
    path = secret_path(cfg, run_dir)
    if create:
        return ensure_secret(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"this process joins a run and needs the run's secret, but {path} does not exist: "
                                f"{HOW_TO_SHARE}")
    return _read(path)


def _from_env() -> bytes | None:
    v = os.environ.get(SECRET_ENV, "")
    if not v:
        return None
    key = bytes.fromhex(v) if re.fullmatch(r"(?:[0-9a-fA-F]{2})+", v) else v.encode()
    if len(key) < MIN_SECRET_BYTES:
        raise ValueError(f"{SECRET_ENV} holds {len(key)} bytes; the run's secret needs >= {MIN_SECRET_BYTES}")
    return key


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        key = f.read().strip()
    if len(key) < MIN_SECRET_BYTES:
        raise ValueError(f"{path} holds {len(key)} bytes; the run's secret needs >= {MIN_SECRET_BYTES}")
    mode = os.stat(path).st_mode & 0o777
    if mode & 0o077:
        print(f"warning: the run's secret {path} is readable by others (mode {mode:o}); chmod 600 it",
              file=sys.stderr, flush=True)
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
