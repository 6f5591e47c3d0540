"""``python -m orchestration.hosts``: rehearse a multi-host run on one Linux box (root).

    python -m orchestration.hosts -n 2 --rate 200mbit -- \\
        torchrun --nnodes {n} --node-rank {i} --nproc-per-node 1 --master-addr {master} \\
        --master-port 29500 -m orchestration.train --mesh.rows 1 --mesh.stages 2 --steps 3
    python -m orchestration.hosts -n 2 --rate 20mbit --check     # the links only: a measured transfer

Makes N hosts as network namespaces, each with a tc-tbf-shaped access link to a hub and its
own working directory (its "disk", under --dir), and runs the command on every host at once
in that directory, with {i} (host index), {n} (hosts), {addr} (its address), {master} (host
0's address: the rendezvous), {ifname} and {dir} filled in and GLOO_SOCKET_IFNAME set to its
interface: exactly the line a user runs on each machine. Waits for all; the first failure
stops the others. Deletes its namespaces at the end (and its directories, unless --dir is
given). Only bandwidth is shaped: this kernel has tbf/htb but no netem, so latency and loss
are those of a veth (microseconds, none).
"""
from __future__ import annotations

import argparse
import sys

from orchestration.hosts.netns import Hosts, HostsError, available


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cmd = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="python -m orchestration.hosts", description=__doc__.split("\n\n")[0],
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--hosts", type=int, default=2, help="how many hosts (namespaces)")
    ap.add_argument("--rate", default="200mbit", help="tc tbf rate of every host's uplink (e.g. 200mbit, 500kbit)")
    ap.add_argument("--down-rate", default=None, help="every host's downlink rate (default: --rate)")
    ap.add_argument("--burst", default="64kb", help="tc tbf bucket size")
    ap.add_argument("--dir", default=None, help="where the hosts' directories go (host0/, host1/, ...; kept); "
                                                "default: a temporary directory, removed at the end")
    ap.add_argument("--timeout-s", type=float, default=3600.0, help="stop every host after this long")
    ap.add_argument("--check", action="store_true", help="no command: measure one transfer host 0 -> host 1")
    a = ap.parse_args(own)
    why = available()
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    if not cmd and not a.check:
        ap.error("give the command to run on every host after --, or --check")
    try:
        with Hosts(a.hosts, a.rate, down_rate=a.down_rate, burst=a.burst, root=a.dir, keep=a.dir is not None,
                   echo=True) as h:
            for i in range(h.n):
                print(f"host {i}: {h.addr(i)} ({h.ifname(i)}), dir {h.dirs[i]}", flush=True)
            if a.check:
                if h.n < 2:
                    ap.error("--check needs 2 hosts")
                bps = h.transfer(0, 1, 4 << 20)
                print(f"4 MiB host 0 -> host 1: {bps / 1e6:.2f} Mbit/s payload (tbf rate {a.rate}; no latency or "
                      "loss shaping: no netem)")
                return 0
            procs = [h.popen(i, cmd) for i in range(h.n)]
            codes = h.wait_all(procs, a.timeout_s)
    except (HostsError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for i, c in enumerate(codes):
        print(f"host {i}: exit {c}", flush=True)
    return max((abs(c) for c in codes), default=0) and 1


if __name__ == "__main__":
    sys.exit(main())
