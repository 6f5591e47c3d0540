"""torchrun with its rendezvous store bound to --master-addr: the same launcher, flags and
behaviour, except that machine 0's agent store listens on the address the run names instead
of on every interface (torch's TCPStore server binds them all; torchrun has no flag for it).

    python -m orchestration.torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 \\
        --master-addr 10.0.0.1 --master-port 29500 -m orchestration.train ...
    meshkern-torchrun ...          # the same, as installed

What changes: with the static rendezvous (--master-addr / --master-port, torchrun's default),
the agent of node 0 serves its store on a socket bound to --master-addr:--master-port (the
fast circuit's own listeners are bound alike: orchestration.distributed.mesh.listen_socket).
Every other rendezvous backend (--rdzv-backend c10d, etcd) is torchrun's own, unchanged.
--master-addr must then be an address of machine 0 (its VPN address, docs/deploy.md); a
name or an address it does not hold fails at start with the reason, not later.
"""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous
    from torch.distributed.run import main as torchrun_main

    from orchestration.distributed.mesh import bound_tcp_store

    static_tcp_rendezvous.TCPStore = bound_tcp_store  # the one name its rendezvous makes the store with
    torchrun_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
