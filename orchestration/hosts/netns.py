"""Hosts on one Linux box: network namespaces joined to a hub by shaped veth links.

    with Hosts(2, rate="200mbit") as h:        # host i: namespace, address h.addr(i), dir h.dirs[i]
        procs = [h.popen(i, h.torchrun(i, ["-m", "orchestration.train", "--mesh.stages", "2"]))
                 for i in range(2)]
        codes = h.wait_all(procs, timeout=600)

Topology: a hub namespace (IP forwarding on) and one namespace per host; host i is joined
to the hub by a veth pair, its end ``h.ifname(i)`` ("r<i>") with address 10.213.<i>.2/24
and a default route via the hub's end ("h<i>", 10.213.<i>.1). ``tc tbf`` on the host's end
shapes its uplink, on the hub's end its downlink: every host has an access link of the
given rate, as a consumer machine on the internet has. Hosts reach each other only through
the hub; nothing is routed out of the namespaces (there is no link to the root namespace),
so a run inside can talk only to the addresses the harness made.

What it cannot model: this kernel has ``tbf`` and ``htb`` but not ``netem``, so the links'
bandwidth is shaped but their latency and loss are not (a veth hop adds microseconds, not
the tens of milliseconds of a path between homes). Figures measured here say so.

Each host has its own working directory (``dirs[i]``, its "disk"); a command runs there
with ``GLOO_SOCKET_IFNAME`` set to the host's interface and the repository on PYTHONPATH.
``link(i, up)`` takes host i's link down (both directions; its peers see silence, not an
error, as with a home connection that dropped) and up again. A harness creates and deletes only its own namespaces (names start with
a prefix unique to the process and instance), kills only the processes inside them, and
cleans up in ``close`` (``with``, and atexit for an interpreter that exits without it).

``available()`` is None where this works, else why not (not root, no ``ip``/``tc``, no
network namespaces, no tbf): tests skip with it.
"""
from __future__ import annotations

import atexit
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

SUBNET = "10.213"  # 10.213.<host>.0/24 per access link, inside the namespaces only
_COUNT = itertools.count()
_AVAILABLE: list = []
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rate_bps(rate: str) -> float:
    """A link rate as tc writes it (``500kbit``, ``2mbit``, ``1gbit``) in bit/s; ValueError
    naming the form otherwise."""
    m = re.fullmatch(r"([0-9.]+)\s*([kmg]?)bit", rate.strip().lower())
    if not m:
        raise ValueError(f"rate {rate!r}: give it as tc does, like 500kbit or 2mbit")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


class HostsError(RuntimeError):
    """A namespace command that failed (the message holds the command and its stderr)."""


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode:
        raise HostsError(f"`{' '.join(cmd)}` failed (exit {r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
    return r


def available() -> str | None:
    """None if namespaces with tbf-shaped veth links can be made here, else the reason not."""
    if _AVAILABLE:
        return _AVAILABLE[0]
    why = _probe()
    _AVAILABLE.append(why)
    return why


def _probe() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "needs root: creating network namespaces and tc qdiscs (ip netns, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command (install iproute2)"
    ns = f"mkh{os.getpid()}probe{next(_COUNT)}"
    r = _sh("ip", "netns", "add", ns, check=False)
    if r.returncode:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    try:
        r = _sh("ip", "-n", ns, "link", "add", "name", "mka", "type", "veth", "peer", "name", "mkb", check=False)
        if r.returncode:
            return f"cannot create a veth pair: {r.stderr.strip()}"
        r = _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "mka", "root", "tbf", "rate", "1mbit",
                "burst", "32kb", "latency", "100ms", check=False)
        if r.returncode:
            return f"no tbf qdisc (tc): {r.stderr.strip()}"
    finally:
        _sh("ip", "netns", "del", ns, check=False)
    return None


class Proc:
    """A command running in a host's namespace: its output goes to a log file (and, with
    ``echo``, to stdout prefixed by the host), and ``wait_line`` waits for a line in it."""

    def __init__(self, host: int, argv: list[str], env: dict, cwd: str, log_path: str, echo: bool,
                 notify: threading.Condition):
        self.host, self.argv, self.log_path = host, argv, log_path
        self.lines: list[str] = []
        self._cond, self._notify, self._done = threading.Condition(), notify, False
        self.p = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, text=True, errors="replace", bufsize=1,
                                  start_new_session=True)
        self._thread = threading.Thread(target=self._pump, args=(echo,), daemon=True)
        self._thread.start()

    def _pump(self, echo: bool) -> None:
        with open(self.log_path, "a") as log:
            for line in self.p.stdout:
                log.write(line)
                log.flush()
                if echo:
                    sys.stdout.write(f"[host {self.host}] {line}")
                    sys.stdout.flush()
                with self._cond:
                    self.lines.append(line)
                    self._cond.notify_all()
        self.p.wait()
        with self._cond:
            self._done = True
            self._cond.notify_all()
        with self._notify:
            self._notify.notify_all()

    @property
    def done(self) -> bool:
        """The process exited and all its output was read."""
        return self._done

    @property
    def returncode(self) -> int | None:
        return self.p.returncode if self._done else None

    def tail(self, n: int = 25) -> str:
        with self._cond:
            return "".join(self.lines[-n:])

    def wait_line(self, pattern: str, timeout: float, *, start: int = 0) -> re.Match:
        """The first output line matching ``pattern`` (waits for it up to ``timeout`` s);
        ``start``: among the lines from that index on (``len(proc.lines)`` taken earlier:
        a line that comes after some event)."""
        rx, deadline, i = re.compile(pattern), time.monotonic() + timeout, start
        with self._cond:
            while True:
                for line in self.lines[i:]:
                    m = rx.search(line)
                    if m:
                        return m
                i = len(self.lines)
                if self._done:
                    raise HostsError(f"host {self.host} exited (code {self.p.returncode}) without a line matching "
                                     f"{pattern!r}; its last lines:\n{self.tail()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"host {self.host}: no line matching {pattern!r} within {timeout:.0f} s; "
                                       f"its last lines:\n{self.tail()}")
                self._cond.wait(left)

    def wait(self, timeout: float) -> int:
        """The exit code (waits up to ``timeout`` s; TimeoutError naming the host after)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._done:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"host {self.host} still running after {timeout:.0f} s: {' '.join(self.argv)}; "
                                       f"its last lines:\n{self.tail()}")
                self._cond.wait(left)
        return self.p.returncode

    def signal(self, sig: int = signal.SIGTERM) -> None:
        """Sends ``sig`` to the command's process group (torchrun forwards it to its workers)."""
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, sig)
            except ProcessLookupError:
                pass


class Hosts:
    """``n`` hosts as network namespaces (module doc). ``rate`` / ``down_rate``: tc rate of
    every host's uplink / downlink ("200mbit", "500kbit"; ``down_rate`` defaults to ``rate``);
    ``root``: where the hosts' working directories go (a new temporary directory if None;
    removed by ``close`` only if the harness made it and ``keep`` is False)."""

    def __init__(self, n: int, rate: str = "200mbit", *, down_rate: str | None = None, burst: str = "64kb",
                 root: str | None = None, keep: bool = False, echo: bool = False):
        why = available()
        if why:
            raise HostsError(f"cannot make hosts as network namespaces: {why}")
        if n < 1:
            raise ValueError(f"hosts: n must be >= 1, not {n}")
        self.n, self.rate, self.down_rate, self.burst, self.echo = n, rate, down_rate or rate, burst, echo
        self.tag = f"mkh{os.getpid()}x{next(_COUNT)}"
        self.hub = f"{self.tag}hub"
        self.names = [f"{self.tag}n{i}" for i in range(n)]
        self._made_root = root is None
        self.root = os.path.abspath(root) if root else tempfile.mkdtemp(prefix="meshkern-hosts-")
        self.keep = keep
        self.dirs = [os.path.join(self.root, f"host{i}") for i in range(n)]
        self.procs: list[Proc] = []
        self._made: list[str] = []
        self._exited = threading.Condition()
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ topology
    def _build(self) -> None:
        for d in self.dirs:
            os.makedirs(d, exist_ok=True)
        for ns in [self.hub] + self.names:
            _sh("ip", "netns", "add", ns)
            self._made.append(ns)
        _sh("ip", "netns", "exec", self.hub, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        _sh("ip", "-n", self.hub, "link", "set", "lo", "up")
        for i, ns in enumerate(self.names):
            r, h = self.ifname(i), f"h{i}"
            # made inside the hub so that no name ever lands in the root namespace
            _sh("ip", "-n", self.hub, "link", "add", "name", r, "type", "veth", "peer", "name", h)
            _sh("ip", "-n", self.hub, "link", "set", r, "netns", ns)
            _sh("ip", "-n", self.hub, "addr", "add", f"{SUBNET}.{i}.1/24", "dev", h)
            _sh("ip", "-n", self.hub, "link", "set", h, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", r)
            _sh("ip", "-n", ns, "link", "set", r, "up")
            _sh("ip", "-n", ns, "route", "add", "default", "via", f"{SUBNET}.{i}.1")
            for where, dev, rate in ((ns, r, self.rate), (self.hub, h, self.down_rate)):  # uplink, downlink
                _sh("ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                    "rate", rate, "burst", self.burst, "latency", "200ms")

    def addr(self, i: int) -> str:
        """Host ``i``'s address (on its access link)."""
        return f"{SUBNET}.{i}.2"

    def ifname(self, i: int) -> str:
        """Host ``i``'s interface name inside its namespace (GLOO_SOCKET_IFNAME)."""
        return f"r{i}"

    def qdiscs(self, i: int) -> tuple[str, str]:
        """``tc qdisc show`` of host ``i``'s uplink and downlink (what is applied)."""
        up = _sh("ip", "netns", "exec", self.names[i], "tc", "qdisc", "show", "dev", self.ifname(i)).stdout
        down = _sh("ip", "netns", "exec", self.hub, "tc", "qdisc", "show", "dev", f"h{i}").stdout
        return up, down

    def link(self, i: int, up: bool) -> None:
        """Takes host ``i``'s access link down (``up=False``) or brings it back up: the host's
        end of the pair (``ip link set r<i> down``). Its peers then see silence (the hub still
        routes to the dead link: their packets vanish and their connections wait or time out,
        as with a home connection that dropped), the host itself has no route while it is
        down. Addresses and the tbf shaping stay; ``up`` puts the default route back."""
        ns, dev = self.names[i], self.ifname(i)
        _sh("ip", "-n", ns, "link", "set", dev, "up" if up else "down")
        if up:  # the kernel dropped the routes through the link when it went down
            _sh("ip", "-n", ns, "route", "replace", "default", "via", f"{SUBNET}.{i}.1", "dev", dev)

    # ------------------------------------------------------------------ commands
    def env(self, i: int, extra: dict | None = None) -> dict:
        """The environment of host ``i``'s commands: this one's, plus GLOO_SOCKET_IFNAME (and
        TP_SOCKET_IFNAME) = its interface, the repository first on PYTHONPATH, ``extra``."""
        env = dict(os.environ)
        env.update(GLOO_SOCKET_IFNAME=self.ifname(i), TP_SOCKET_IFNAME=self.ifname(i),
                   PYTHONPATH=os.pathsep.join([REPO] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]))
        env.update(extra or {})
        return env

    def fill(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` with {i} {n} {addr} {master} {ifname} {dir} replaced for host ``i``
        ({master}: host 0's address, where torchrun's rendezvous is)."""
        subs = {"{i}": str(i), "{n}": str(self.n), "{addr}": self.addr(i), "{master}": self.addr(0),
                "{ifname}": self.ifname(i), "{dir}": self.dirs[i]}
        out = []
        for a in argv:
            for k, v in subs.items():
                a = a.replace(k, v)
            out.append(a)
        return out

    def torchrun(self, i: int, args: list[str], *, port: int = 29500, nproc: int = 1,
                 python: str = sys.executable, nnodes: int | None = None, node_rank: int | None = None,
                 master: str | None = None) -> list[str]:
        """The torchrun line a user runs on host ``i`` (static rendezvous at host 0's address;
        ``nnodes`` / ``node_rank`` / ``master``: another world, e.g. an anchor row alone on
        its host: nnodes=1, node_rank=0, master="127.0.0.1"). orchestration.torchrun: torchrun
        with its store bound to the master address, as docs/deploy.md tells users."""
        return [python, "-m", "orchestration.torchrun", "--nnodes", str(self.n if nnodes is None else nnodes),
                "--node-rank", str(i if node_rank is None else node_rank), "--nproc-per-node", str(nproc),
                "--master-addr", master or self.addr(0), "--master-port", str(port), *args]

    def popen(self, i: int, argv: list[str], *, env: dict | None = None, log: str = "host.log") -> Proc:
        """Starts ``argv`` (after ``fill``) in host ``i``'s namespace and directory; its output
        goes to ``dirs[i]/log``."""
        p = Proc(i, ["ip", "netns", "exec", self.names[i], *self.fill(i, argv)], self.env(i, env), self.dirs[i],
                 os.path.join(self.dirs[i], log), self.echo, self._exited)
        self.procs.append(p)
        return p

    def kill_host(self, i: int) -> None:
        """SIGKILL to every process in host ``i``'s namespace (all started by this harness):
        the machine dies, whatever process groups its commands made."""
        for pid in _sh("ip", "netns", "pids", self.names[i], check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass

    @staticmethod
    def wait_until(pred, procs: list[Proc], what: str, timeout: float, poll_s: float = 0.2):
        """``pred()``'s first true value, polled every ``poll_s`` s (a condition on files the
        hosts write: event records, metrics); HostsError naming ``what`` if a process in
        ``procs`` exits first, TimeoutError after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            got = pred()
            if got:
                return got
            for p in procs:
                if p.done:
                    raise HostsError(f"host {p.host} exited (code {p.returncode}) before: {what}; its last "
                                     f"lines:\n{p.tail(40)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:.0f} s waiting for: {what}")
            time.sleep(poll_s)  # the hosts write files, which announce nothing: polled

    def stop_training(self, i: int, sig: int = signal.SIGINT) -> list[int]:
        """Sends ``sig`` to host ``i``'s training processes (``orchestration.train`` ranks,
        not a torchrun agent: an agent that gets SIGINT itself exits with an error, while
        its workers' clean stop at the next step boundary makes it exit 0, as a user's stop
        of one rank does). Returns their pids."""
        pids = []
        for pid in _sh("ip", "netns", "pids", self.names[i], check=False).stdout.split():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue  # ended meanwhile
            if b"orchestration.train" in argv and not {b"torch.distributed.run", b"orchestration.torchrun"} & set(argv):
                try:
                    os.kill(int(pid), sig)
                    pids.append(int(pid))
                except ProcessLookupError:
                    pass
        return pids

    def wait_all(self, procs: list[Proc], timeout: float, *, fail_fast: bool = True) -> list[int]:
        """Waits for every process to exit (up to ``timeout`` s); ``fail_fast``: the first to
        fail has the others stopped (SIGTERM) instead of left waiting on a dead peer.
        Returns the exit codes; TimeoutError (the processes stopped) if they outlive it."""
        deadline = time.monotonic() + timeout
        stopped = False
        with self._exited:
            while not all(p.done for p in procs):
                if fail_fast and not stopped and any(p.done and p.returncode for p in procs):
                    stopped = True
                    for p in procs:
                        p.signal(signal.SIGTERM)
                left = deadline - time.monotonic()
                if left <= 0:
                    for p in procs:
                        p.signal(signal.SIGKILL)
                    late = [p for p in procs if not p.done]
                    raise TimeoutError(f"hosts {[p.host for p in late]} still running after {timeout:.0f} s; last "
                                       f"lines of host {late[0].host}:\n{late[0].tail()}")
                self._exited.wait(left)  # woken by a process's exit (Proc._pump)
        return [p.returncode for p in procs]

    def transfer(self, src: int, dst: int, nbytes: int, *, port: int = 5201, timeout: float = 120.0) -> float:
        """One bulk TCP transfer of ``nbytes`` from host ``src`` to host ``dst`` through both
        access links; the payload rate in bit/s (receiver's clock, first byte to EOF): a few %
        under the tbf rate (TCP/IP headers, tbf's accounting)."""
        recv = ("import socket,sys,time\n"
                "s=socket.create_server((sys.argv[1],int(sys.argv[2])));print('READY',flush=True)\n"
                "c,_=s.accept();n=0;t0=None\n"
                "while True:\n"
                " b=c.recv(1<<20)\n"
                " if not b: break\n"
                " t0=t0 or time.perf_counter();n+=len(b)\n"
                "print('GOT',n,time.perf_counter()-t0,flush=True)\n")
        send = ("import socket,sys\n"
                "c=socket.create_connection((sys.argv[1],int(sys.argv[2])),timeout=60)\n"
                "c.sendall(bytes(int(sys.argv[3])));c.shutdown(socket.SHUT_WR);c.recv(1)\n")
        r = self.popen(dst, [sys.executable, "-c", recv, self.addr(dst), str(port)], log="transfer.log")
        r.wait_line("^READY", timeout)
        s = self.popen(src, [sys.executable, "-c", send, self.addr(dst), str(port), str(nbytes)], log="transfer.log")
        m = r.wait_line(r"^GOT (\d+) (\S+)", timeout)
        self.wait_all([r, s], timeout)
        if int(m.group(1)) != nbytes:
            raise HostsError(f"transfer {src} -> {dst}: {m.group(1)} of {nbytes} bytes arrived")
        return nbytes * 8 / float(m.group(2))

    # ------------------------------------------------------------------ teardown
    def _kill_inside(self) -> None:
        """Every process still in one of this harness's namespaces (all started by it), by pid."""
        for p in self.procs:
            p.signal(signal.SIGKILL)
        for ns in self._made:
            pids = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        for p in self.procs:
            try:
                p.p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass

    def close(self) -> None:
        """Stops the processes, deletes the namespaces (and the directories the harness made,
        unless ``keep``). Safe to call twice."""
        if not self._made and not self.procs:
            return
        self._kill_inside()
        for ns in reversed(self._made):
            _sh("ip", "netns", "del", ns, check=False)
        self._made, self.procs = [], []
        if self._made_root and not self.keep:
            shutil.rmtree(self.root, ignore_errors=True)
        atexit.unregister(self.close)

    def __enter__(self) -> "Hosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
