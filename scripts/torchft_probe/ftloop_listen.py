"""listening_sockets() without importing ftloop (which patches torchft)."""
import os
import socket


def listening_sockets(pid: int):
    """(local address, port) of every TCP socket in LISTEN state owned by pid (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            t = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if t.startswith("socket:["):
            inodes.add(t[8:-1])
    out = []
    for fam, path in (("v4", "/proc/net/tcp"), ("v6", "/proc/net/tcp6")):
        with open(path) as f:
            next(f)
            for line in f:
                p = line.split()
                if p[3] == "0A" and p[9] in inodes:  # 0A = LISTEN
                    host, port = p[1].split(":")
                    if fam == "v4":
                        h = socket.inet_ntop(socket.AF_INET, bytes.fromhex(host)[::-1])
                    else:
                        b = bytes.fromhex(host)
                        b = b"".join(b[i:i + 4][::-1] for i in range(0, 16, 4))
                        h = socket.inet_ntop(socket.AF_INET6, b)
                    out.append((h, int(port, 16)))
    return sorted(out)
