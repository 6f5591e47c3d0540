"""torchft's lighthouse (the quorum service of elastic replicas), run in a process of its own.

``python -m orchestration.elastic.lighthouse --bind 127.0.0.1:0 --min-replicas 1`` prints
``LIGHTHOUSE http://HOST:PORT`` on its first line once it listens, then serves until
Ctrl-C / SIGTERM (started by the local launcher: until its stdin closes, i.e. the launcher
is gone). Its own process,
not a thread of the launcher: the launcher forks the replicas' ranks, and a forked child
must not inherit the lighthouse's Rust runtime threads half-copied.

torchft's ``LighthouseServer.address()`` reports the machine's hostname whatever it is
bound to; the address printed here is the one bound (``--bind`` host, the port it got).

With ``--anchor-store PORT`` it also hosts the store where an elastic run's anchor rows and
fast replicas meet (docs/anchor.md, "Elastic replicas": the fixed mesh uses its rendezvous
store; elastic replicas have no common one), printed as ``ANCHOR_STORE HOST:PORT`` on the
second line. It lives as long as the lighthouse, i.e. the run.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import urllib.request


def start_lighthouse(bind: str, min_replicas: int, heartbeat_s: float, join_timeout_s: float,
                     timeout_s: float = 60.0, anchor_store: bool = False) -> tuple[subprocess.Popen, str, str]:
    """Starts the lighthouse process; returns (process, "http://host:port", the anchor
    store's "host:port" or "" without ``anchor_store``). Raises RuntimeError with its stderr
    if it does not come up within ``timeout_s``."""
    proc = subprocess.Popen([sys.executable, "-m", "orchestration.elastic.lighthouse", "--bind", bind,
                             "--min-replicas", str(min_replicas), "--heartbeat-ms", str(int(heartbeat_s * 1000)),
                             "--join-timeout-ms", str(int(join_timeout_s * 1000)), "--exit-with-stdin"]
                            + (["--anchor-store", "0"] if anchor_store else []),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # a Ctrl-C stops the replicas cleanly; it keeps serving them
    lines: list[str] = []
    want = ("LIGHTHOUSE ", "ANCHOR_STORE ") if anchor_store else ("LIGHTHOUSE ",)
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout.readline() for _ in want), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if len(lines) < len(want) or any(not x.startswith(w) for x, w in zip(lines, want)):
        proc.kill()
        err = proc.stderr.read() if proc.poll() is not None else ""
        raise RuntimeError(f"the torchft lighthouse did not start on {bind} within {timeout_s:g} s: {err.strip()[-800:]}")
    # its stderr (torchft logs a line per quorum) must not fill the pipe and block it
    threading.Thread(target=proc.stderr.read, daemon=True).start()
    return proc, lines[0].split()[1], lines[1].split()[1] if anchor_store else ""


def heartbeat_ages(url: str, timeout_s: float) -> dict[str, float]:
    """The replica ids the lighthouse at ``url`` ("http://host:port") has heard from (a
    heartbeat or a quorum request), each with the seconds since it last did, on the
    lighthouse's own clock: it counts a replica live while that is below its heartbeat
    timeout. Read from its /status page (torchft 0.2.0 has no RPC that tells). Raises
    OSError when the page cannot be read within ``timeout_s``."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy answers for the lighthouse
    with opener.open(url.rstrip("/") + "/status", timeout=timeout_s) as r:
        page = r.read().decode("utf-8", "replace")
    # torchft's templates/status.html: "<li class=...> {{replica_id}}: seen {{age}}s ago </li>"
    return {rid: float(age) for rid, age in re.findall(r"(\S+): seen ([0-9.]+)s ago", page)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bind", default="127.0.0.1:0", help="host:port to listen on (port 0: any free one)")
    p.add_argument("--min-replicas", type=int, default=1, help="fewest replicas a quorum needs")
    p.add_argument("--heartbeat-ms", type=int, default=2000, help="a replica silent this long is out of the next quorum")
    p.add_argument("--join-timeout-ms", type=int, default=4000,
                   help="how long a quorum waits for live replicas that have not asked to join it yet")
    p.add_argument("--quorum-tick-ms", type=int, default=50, help="how often the lighthouse tries to form a quorum")
    p.add_argument("--anchor-store", type=int, default=None, metavar="PORT",
                   help="also host the store of the run's anchor circuit on the --bind host at PORT (0: any free "
                        "one); its replicas and anchor row take it as --anchor.store HOST:PORT")
    p.add_argument("--exit-with-stdin", action="store_true",
                   help="stop when stdin closes (the local launcher's pipe; not for a lighthouse started by hand, "
                        "whose stdin may be /dev/null)")
    a = p.parse_args(argv)
    os.environ.setdefault("RUST_LOG", "warn")  # torchft logs every quorum at INFO otherwise (read at import)
    from torchft._torchft import LighthouseServer

    host = a.bind.rsplit(":", 1)[0]
    server = LighthouseServer(bind=a.bind, min_replicas=a.min_replicas, join_timeout_ms=a.join_timeout_ms,
                              quorum_tick_ms=a.quorum_tick_ms, heartbeat_timeout_ms=a.heartbeat_ms)
    port = server.address().rsplit(":", 1)[1]
    print(f"LIGHTHOUSE http://{host}:{port}", flush=True)
    store = None
    if a.anchor_store is not None:
        from datetime import timedelta

        import torch.distributed as dist

        from orchestration.distributed.mesh import listen_socket

        sock = listen_socket(host, a.anchor_store)  # the --bind host only (TCPStore's own socket binds them all)
        port = sock.getsockname()[1]
        store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60),
                              master_listen_fd=sock.detach(), use_libuv=True)
        print(f"ANCHOR_STORE {host}:{port}", flush=True)  # (``store`` serves while it is referenced)
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        if a.exit_with_stdin:
            sys.stdin.read()  # returns when the launcher closes our stdin or dies
        else:
            threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
