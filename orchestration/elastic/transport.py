"""The heal transfer of elastic replicas: torchft's ``CheckpointTransport`` over HTTP,
gated by the run's secret.

torchft's own HTTPTransport listens on every interface, serves the live state to any GET
and unpickles what it receives (``weights_only=False``). This one:

- listens on, and advertises, the address the run names (``--mesh.bind``; 127.0.0.1 in
  tests), never every interface;
- serves only a GET that proves the run's secret: ``X-Meshkern-Nonce`` (32 random hex
  bytes chosen by the receiver) and ``X-Meshkern-Auth`` = HMAC(secret, "heal-request",
  step, nonce); anything else is answered 403 and gets no byte of state;
- tags the body with HMAC(secret, "heal-body", step, nonce, sha256(body)): the receiver
  rejects a body that someone without the secret wrote or altered, or one recorded for
  another request (the nonce is the receiver's own), before it parses a byte of it;
- serializes the state once, when torchft hands it over (``send_checkpoint``): later steps
  never change what is served, and the state can be mutated at once;
- loads with ``torch.load(weights_only=True)``: tensors and plain values only.

``recv_log`` keeps (seconds, bytes, step) of each heal received, for the run summary.
"""
from __future__ import annotations

import hashlib
import hmac
import io
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from torchft.checkpointing.transport import CheckpointTransport

from orchestration.anchor.auth import mac
from orchestration.elastic.errors import HealRefused

NONCE_HEADER, AUTH_HEADER, TAG_HEADER = "X-Meshkern-Nonce", "X-Meshkern-Auth", "X-Meshkern-Tag"


def _request_mac(secret: bytes, step: int, nonce: str) -> str:
    return mac(secret, "heal-request", step, nonce).hex()


def _body_mac(secret: bytes, step: int, nonce: str, body: bytes) -> str:
    return mac(secret, "heal-body", step, nonce, hashlib.sha256(body).hexdigest()).hex()


class SecretHTTPTransport(CheckpointTransport):
    """See the module docstring. ``host``: the address to listen on and advertise."""

    def __init__(self, secret: bytes, host: str, timeout: timedelta, *, rate_bps: float = 200e6, describe: str = "",
                 device=None):
        self.secret, self.host, self.timeout = secret, host, timeout
        self.device = device  # where received tensors land (this rank's; the peer's may be another GPU index)
        self.rate_bps, self.describe = rate_bps, describe or "elastic replica"
        self._served_cv = threading.Condition()
        self._served: tuple[int, bytes] | None = None  # (step, serialized state) while a heal is open
        self.recv_log: list[dict] = []
        self.recv_attempts = 0
        self.refused = 0  # requests answered 403 (no or wrong proof of the secret)
        transport = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                parts = self.path.strip("/").split("/")
                if len(parts) != 2 or parts[0] != "heal" or not parts[1].isdigit():
                    self.send_error(404, "expected /heal/<step>")
                    return
                step, nonce = int(parts[1]), self.headers.get(NONCE_HEADER, "")
                proof = self.headers.get(AUTH_HEADER, "")
                if len(nonce) != 64 or not hmac.compare_digest(proof, _request_mac(transport.secret, step, nonce)):
                    transport.refused += 1
                    self.send_error(403, "the request does not prove the run's secret")
                    return
                # The healer asks as soon as the quorum names its source, which may not have
                # staged the state yet: wait for it (torchft's own transport blocks alike).
                with transport._served_cv:
                    transport._served_cv.wait_for(lambda: transport._served is not None and transport._served[0] == step,
                                                  timeout=transport.timeout.total_seconds())
                    served = transport._served
                if served is None or served[0] != step:
                    self.send_error(409, f"not serving step {step} now")
                    return
                body = served[1]
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(body)))
                self.send_header(TAG_HEADER, _body_mac(transport.secret, step, nonce, body))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # no line per request on stderr
                pass

        self._server = ThreadingHTTPServer((host, 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="meshkern-heal", daemon=True)
        self._thread.start()

    # ---- torchft's CheckpointTransport ----------------------------------------------------
    def metadata(self) -> str:
        return f"http://{self.host}:{self._server.server_address[1]}"

    def send_checkpoint(self, dst_ranks, step: int, state_dict, timeout) -> None:
        buf = io.BytesIO()
        torch.save(state_dict, buf)
        with self._served_cv:
            self._served = (int(step), buf.getvalue())
            self._served_cv.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._served_cv:
            self._served = None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout):
        self.recv_attempts += 1
        t0 = time.perf_counter()
        nonce = os.urandom(32).hex()
        req = urllib.request.Request(f"{metadata}/heal/{int(step)}", headers={
            NONCE_HEADER: nonce, AUTH_HEADER: _request_mac(self.secret, int(step), nonce)})
        tmo = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        try:
            with urllib.request.urlopen(req, timeout=tmo) as f:  # tmo: per read, a stalled peer
                body, tag = self._read_body(f, metadata, tmo, t0), f.headers.get(TAG_HEADER, "")
        except urllib.error.HTTPError as e:
            if e.code == 403:
                raise HealRefused(f"the peer at {metadata} refused the heal: this replica's secret is not the "
                                  "run's (--anchor.secret-file / MESHKERN_ANCHOR_SECRET)") from None
            raise
        if not hmac.compare_digest(tag, _body_mac(self.secret, int(step), nonce, body)):
            raise HealRefused(f"the heal state from {metadata} does not carry the run's secret: refused unread")
        state = torch.load(io.BytesIO(body), weights_only=True, map_location=self.device)
        self.recv_log.append({"heal_s": time.perf_counter() - t0, "heal_bytes": len(body), "step": int(step)})
        return state

    def _read_body(self, f, metadata: str, tmo: float, t0: float) -> bytes:
        """The body in chunks: a deadline from its size and the link's rate (--run.bandwidth-bps,
        3x slack, plus the stall timeout), and a progress line on stderr every few seconds of
        a long transfer, never a silent wait."""
        total = int(f.headers.get("Content-Length") or 0)
        expect = total * 8 / max(self.rate_bps, 1.0)
        deadline = t0 + tmo + 3 * expect
        chunks, got, said = [], 0, time.perf_counter()
        print(f"[elastic] {self.describe}: healing from {metadata}: {total / 1e6:.1f} MB (~{expect:.1f} s at "
              f"--run.bandwidth-bps {self.rate_bps:g}; giving up after {deadline - t0:.0f} s)", file=sys.stderr, flush=True)
        while True:
            b = f.read(1 << 20)
            if not b:
                break
            chunks.append(b)
            got += len(b)
            now = time.perf_counter()
            if now > deadline:
                raise TimeoutError(f"{self.describe}: the heal from {metadata} moved {got / 1e6:.1f} of "
                                   f"{total / 1e6:.1f} MB in {now - t0:.0f} s, past its deadline of {deadline - t0:.0f} s "
                                   f"(~{expect:.0f} s at --run.bandwidth-bps {self.rate_bps:g}, x3, plus "
                                   f"--mesh.timeout-s {tmo:g}); set --run.bandwidth-bps to the link's real rate")
            if now - said >= 5.0:
                said = now
                rate = got * 8 / max(now - t0, 1e-9)
                print(f"[elastic] {self.describe}: healing from {metadata}: {got / 1e6:.1f} of {total / 1e6:.1f} MB "
                      f"in {now - t0:.0f} s ({rate / 1e6:.1f} Mbit/s, ~{(total - got) * 8 / max(rate, 1.0):.0f} s left)",
                      file=sys.stderr, flush=True)
        if total and got != total:
            raise ConnectionError(f"{self.describe}: the heal from {metadata} ended after {got} of {total} bytes")
        return b"".join(chunks)

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
