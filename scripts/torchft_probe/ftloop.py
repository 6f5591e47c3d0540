"""Loopback-only plumbing for torchft 0.2.0 (everything torchft itself would bind on every
interface is bound to 127.0.0.1 here), plus instrumentation for the probe.

What torchft 0.2.0 binds by itself (see REPORT.md for file:line):
  * ManagerServer (gRPC):   manager.py:312  bind = f"[::]:{port}"   -> patched below
  * HTTPTransport (heal):   checkpointing/http_transport.py:135 ("", 0) on AF_INET6 -> subclass below
  * Lighthouse:             LighthouseServer(bind=...) takes any bind -> we pass 127.0.0.1:0
  * TCPStore (ours):        torch binds every interface unless given master_listen_fd -> loopback fd
  * Gloo pairs:             GLOO_SOCKET_IFNAME=lo
"""
import io
import os
import socket
import threading
import time
import urllib.request
from datetime import timedelta
from http.server import ThreadingHTTPServer

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torchft.manager as tfm  # noqa: E402
from torchft._torchft import ManagerServer as _RawManagerServer  # noqa: E402
from torchft.checkpointing import http_transport as ht  # noqa: E402
from torch.distributed._serialization import _streaming_load  # noqa: E402
from ftloop_listen import listening_sockets  # noqa: E402,F401  (proto.py calls ftloop.listening_sockets)

LOOPBACK = "127.0.0.1"


def _loopback_manager_server(**kw):
    # Manager.__init__ calls ManagerServer(replica_id=..., bind=f"[::]:{port}", ...) with
    # keywords only (manager.py:322-332); keep the port, force the host.
    port = kw["bind"].rsplit(":", 1)[1]
    kw["bind"] = f"{LOOPBACK}:{port}"
    return _RawManagerServer(**kw)


tfm.ManagerServer = _loopback_manager_server


class _V4LoopbackServer(ThreadingHTTPServer):
    request_queue_size = 64

    def __init__(self, _addr, handler):  # torchft passes ("", 0)
        super().__init__((LOOPBACK, 0), handler)


class LoopbackHTTPTransport(ht.HTTPTransport):
    """torchft's HTTPTransport bound to 127.0.0.1, advertising 127.0.0.1, loading with
    weights_only=True (torchft uses weights_only=False: a pickle from whoever answers),
    and counting the bytes and seconds of each receive."""

    weights_only = True

    def __init__(self, timeout: timedelta, num_chunks: int = 0) -> None:
        orig = ht._IPv6HTTPServer
        ht._IPv6HTTPServer = _V4LoopbackServer
        try:
            super().__init__(timeout=timeout, num_chunks=num_chunks)
        finally:
            ht._IPv6HTTPServer = orig
        self.recv_log = []  # one dict per heal
        self.sent = 0

    def address(self) -> str:
        return f"http://{LOOPBACK}:{self._server.socket.getsockname()[1]}/checkpoint/"

    _bytes = threading.local()

    @classmethod
    def _load_from_address(cls, address, timeout):
        with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
            data = f.read()
        cls._bytes.n = getattr(cls._bytes, "n", 0) + len(data)
        return _streaming_load(io.BytesIO(data), weights_only=cls.weights_only)

    def send_checkpoint(self, dst_ranks, step, state_dict, timeout):
        self.sent += 1
        return super().send_checkpoint(dst_ranks, step, state_dict, timeout)

    def recv_checkpoint(self, src_rank, metadata, step, timeout):
        LoopbackHTTPTransport._bytes.n = 0
        t0 = time.perf_counter()
        out = super().recv_checkpoint(src_rank, metadata, step, timeout)
        self.recv_log.append({"heal_s": time.perf_counter() - t0,
                              "heal_bytes": LoopbackHTTPTransport._bytes.n,
                              "heal_src_rank": src_rank, "heal_step": step,
                              "heal_wall": time.time()})
        return out


class QuorumRecorder:
    """Wraps Manager._client (a Rust ManagerClient) to keep the last QuorumResult."""

    def __init__(self, client):
        self._c = client
        self.last = None
        self.last_wall = 0.0
        self.last_s = 0.0

    def _quorum(self, **kw):
        t0 = time.perf_counter()
        r = self._c._quorum(**kw)
        self.last_s = time.perf_counter() - t0
        self.last, self.last_wall = r, time.time()
        return r

    def __getattr__(self, name):
        return getattr(self._c, name)


def loopback_store(port: int, is_master: bool, world_size: int, timeout_s: float = 30.0):
    """A TCPStore; the master listens on 127.0.0.1 only (fd handed to torch, as
    orchestration/distributed/mesh.py does). port=0 picks one."""
    tmo = timedelta(seconds=timeout_s)
    if not is_master:
        return dist.TCPStore(LOOPBACK, port, world_size, False, tmo, wait_for_workers=False)
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((LOOPBACK, port))
    s.listen(1024)
    port = s.getsockname()[1]
    store = dist.TCPStore(LOOPBACK, port, world_size, True, tmo, wait_for_workers=False,
                          master_listen_fd=s.detach(), use_libuv=True)
    return store, port


