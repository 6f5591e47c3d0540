"""orchestration.torchrun: torchrun whose rendezvous store listens on --master-addr only.
A one-node launch at 127.0.0.1 whose worker lists, from /proc/net/tcp{,6}, the sockets that
listen on the store's port while the agent holds it: only 127.0.0.1, where torch's own
torchrun listens on every interface (0.0.0.0 / ::)."""
import os
import socket
import subprocess
import sys
import textwrap

import pytest

WORKER = textwrap.dedent('''
    import os, sys
    port = int(os.environ["MASTER_PORT"])
    seen = []
    for f in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(f).readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                seen.append(local.rsplit(":", 1)[0])
    print("LISTEN", ",".join(sorted(seen)))
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listeners(tmp_path, module: str) -> list[str]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = subprocess.run([sys.executable, "-m", module, "--nnodes", "1", "--node-rank", "0", "--nproc-per-node", "1",
                          "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(script)],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("LISTEN"))
    return line.split()[1].split(",") if len(line.split()) > 1 else []


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs /proc/net/tcp (Linux)")
def test_the_store_listens_on_the_master_address_only(tmp_path):
    assert _listeners(tmp_path, "orchestration.torchrun") == ["0100007F"]  # 127.0.0.1, nothing else
    stock = _listeners(tmp_path, "torch.distributed.run")
    assert stock and all(set(a) == {"0"} for a in stock)  # torch's own: 0.0.0.0 / ::, every interface
