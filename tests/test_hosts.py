"""Across hosts, as users run it (issue 40): hosts as network namespaces with shaped links
and their own disks (orchestration.hosts), and a torchrun mesh spread over them that trains,
checkpoints (each host's state on its own disk, the model assembled on the leader), stops
and resumes. Skipped without root / network namespaces / tbf (the reason is printed)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from orchestration.hosts import Hosts, available

pytestmark = pytest.mark.skipif(available() is not None, reason=f"orchestration.hosts: {available()}")


def _namespaces() -> set[str]:
    return set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())


def _mine(h: Hosts) -> set[str]:
    return {ns for ns in _namespaces() if ns.startswith(h.tag)}


def test_hosts_shape_their_links_and_go_away(tmp_path):
    """Namespaces and tbf qdiscs at the set rates exist while the harness does and are gone
    after; one bulk transfer runs at the shaped rate (within a generous band)."""
    with Hosts(2, "8mbit", down_rate="4mbit", root=str(tmp_path)) as h:
        assert _mine(h) == {h.hub, *h.names}
        up, down = h.qdiscs(1)
        assert "tbf" in up and "rate 8Mbit" in up, up
        assert "tbf" in down and "rate 4Mbit" in down, down
        assert all(os.path.isdir(d) and d.startswith(str(tmp_path)) for d in h.dirs)
        bps = h.transfer(0, 1, 1 << 20)  # host 0's 8 Mbit/s uplink, then host 1's 4 Mbit/s downlink
        assert 0.6 * 4e6 < bps < 1.05 * 4e6, bps
        tag = h.tag
    assert not {ns for ns in _namespaces() if ns.startswith(tag)}


def test_link_down_is_silence_and_up_restores_it(tmp_path):
    """A downed link: a peer's connection attempt times out (no route error from the hub);
    back up, traffic flows at the shaped rate again."""
    probe = ("import socket,sys\ntry:\n socket.create_connection((sys.argv[1], 9), timeout=2)\n"
             "except OSError as e: print('ERR', type(e).__name__)\n")
    with Hosts(2, "8mbit", root=str(tmp_path)) as h:
        h.link(1, False)
        p = h.popen(0, [sys.executable, "-c", probe, h.addr(1)])
        assert p.wait(60) == 0
        assert p.wait_line(r"^ERR ", 1).group(0) == "ERR " and "TimeoutError" in p.tail()
        h.link(1, True)
        assert "rate 8Mbit" in h.qdiscs(1)[0]
        assert h.transfer(1, 0, 1 << 19) > 0.6 * 8e6


def test_a_failed_build_leaves_nothing(tmp_path, monkeypatch):
    """A harness whose topology fails half way deletes what it made."""
    from orchestration.hosts import netns

    real, calls = netns._sh, []

    def failing(*cmd, check=True):
        calls.append(cmd)
        if "tc" in cmd and "qdisc" in cmd and "add" in cmd:
            raise netns.HostsError("injected")
        return real(*cmd, check=check)

    before = _namespaces()
    monkeypatch.setattr(netns, "_sh", failing)
    with pytest.raises(netns.HostsError, match="injected"):
        Hosts(2, "8mbit", root=str(tmp_path))
    monkeypatch.setattr(netns, "_sh", real)
    assert any(c[:3] == ("ip", "netns", "add") for c in calls)
    assert _namespaces() == before


def test_cli_check_runs_and_cleans(tmp_path):
    p = subprocess.Popen([sys.executable, "-m", "orchestration.hosts", "-n", "2", "--rate", "16mbit", "--check",
                          "--dir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert "Mbit/s payload" in out and "no netem" in out and "host 1: 10.213.1.2" in out
    assert sorted(os.listdir(tmp_path)) == ["host0", "host1"]  # --dir: kept
    assert not {ns for ns in _namespaces() if ns.startswith(f"mkh{p.pid}x")}
