"""A multi-host deployment rehearsed on one Linux box: hosts as network namespaces with
shaped links and their own disks (``orchestration.hosts.netns``; ``python -m
orchestration.hosts``). Bandwidth is shaped (tc tbf); latency and loss are not (no netem)."""
from orchestration.hosts.netns import SUBNET, Hosts, HostsError, Proc, available, rate_bps

__all__ = ["Hosts", "HostsError", "Proc", "SUBNET", "available", "rate_bps"]
