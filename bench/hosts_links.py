"""The harness's links themselves, under the trainer: what a shaped link carries and what
gloo's all-reduce takes on it, against the link model's bytes / rate. Tells a gap in
bench.hosts_bench's measured / modeled apart from the link (tbf, TCP) and from gloo.

    python -m bench.hosts_links --rate 500kbit          # root: orchestration.hosts

Two hosts (network namespaces, tbf-shaped access links, the burst bench.hosts_bench uses):
- bulk TCP, 1 MiB one way, then 1 MiB each way at once (both directions of every link busy,
  as a ring all-reduce or 1F1B's overlapped forward and backward make them): kbit/s per
  direction;
- gloo all_reduce of float32 tensors between the two hosts (the median of 3, after a
  warm-up), alone and as a PowerSGD-like chain (two all-reduces of half the size, then one
  of a single element): seconds, and the ratio to the link model's time for a ring
  all-reduce of 2 ranks (each rank sends and receives the tensor's bytes once) at --rate.
"""
from __future__ import annotations

import argparse
import json
import sys

from orchestration.hosts import Hosts, available, rate_bps

SINK = r'''
import socket, sys, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 5001)); s.listen(4)
print("LISTENING", flush=True)
def drain(c):
    while c.recv(65536):
        pass
    c.close()
while True:
    c, _ = s.accept(); threading.Thread(target=drain, args=(c,), daemon=True).start()
'''
SEND = r'''
import socket, sys, time
n = int(sys.argv[2]); c = socket.create_connection((sys.argv[1], 5001)); buf = b"x" * 65536; t0 = time.time(); sent = 0
while sent < n:
    c.sendall(buf); sent += len(buf)
c.shutdown(socket.SHUT_WR)
while c.recv(4096):  # the sink closes once it has read everything: the bytes crossed the link
    pass
print(f"SENT {sent} {time.time() - t0:.3f}", flush=True)
'''
ALLREDUCE = r'''
import json, sys, time, torch, torch.distributed as dist
torch.set_num_threads(1)
rank = int(sys.argv[1]); dist.init_process_group("gloo", init_method=f"tcp://{sys.argv[2]}:29700", rank=rank, world_size=2)
out = []
for numel in (256, 4096, 16384, 65536, 262144):
    t, a, b, f = torch.ones(numel), torch.ones(numel // 2), torch.ones(numel // 2), torch.ones(1)
    dist.barrier(); dist.all_reduce(t)
    one, chain = [], []
    for _ in range(3):
        dist.barrier(); t0 = time.perf_counter(); dist.all_reduce(t); one.append(time.perf_counter() - t0)
        dist.barrier(); t0 = time.perf_counter(); dist.all_reduce(a); dist.all_reduce(b); dist.all_reduce(f)
        chain.append(time.perf_counter() - t0)
    out.append({"bytes": numel * 4, "one_s": sorted(one)[1], "chain_s": sorted(chain)[1]})
if rank == 0:
    print("RESULT " + json.dumps(out), flush=True)
dist.destroy_process_group()
'''


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="500kbit", help="link rate, as tc writes it (500kbit, 2mbit)")
    ap.add_argument("--burst", default="3kb", help="tbf bucket (bench.hosts_bench's)")
    ap.add_argument("--bytes", type=float, default=2 ** 20, help="bytes of each bulk transfer")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    a = ap.parse_args(argv)
    why = available()
    if why is not None:
        print(f"bench.hosts_links: the multi-host harness cannot run here: {why}", file=sys.stderr)
        return 2
    bps, n = rate_bps(a.rate), int(a.bytes)
    res: dict = {"rate": a.rate, "burst": a.burst, "bulk_bytes": n}
    with Hosts(2, a.rate, burst=a.burst) as h:
        sinks = [h.popen(i, [sys.executable, "-c", SINK, "{addr}"], log="sink.log") for i in (0, 1)]
        for s in sinks:
            s.wait_line(r"^LISTENING", 60)
        for mode, senders in (("one_way", (0,)), ("both_ways", (0, 1))):
            procs = [h.popen(i, [sys.executable, "-c", SEND, h.addr(1 - i), str(n)], log=f"send_{mode}.log")
                     for i in senders]
            secs = []
            for p in procs:
                if p.wait(1200) != 0:
                    raise SystemExit(f"bulk transfer failed:\n{p.tail(20)}")
                secs.append(float(p.wait_line(r"^SENT ", 5).string.split()[2]))
            res[mode + "_kbps"] = [round(n * 8 / s / 1e3) for s in secs]
        for s in sinks:
            s.signal()
        ar = [h.popen(i, [sys.executable, "-c", ALLREDUCE, str(i), h.addr(0)], log="allreduce.log") for i in (0, 1)]
        if h.wait_all(ar, timeout=1800) != [0, 0]:
            raise SystemExit(f"all_reduce failed:\n{ar[0].tail(20)}\n{ar[1].tail(20)}")
        rows = json.loads(ar[0].wait_line(r"^RESULT ", 5).string[len("RESULT "):])
    for r in rows:  # the link model's ring all-reduce of 2 ranks: each sends (and receives) the bytes once
        model = r["bytes"] * 8 / bps
        r.update(model_s=round(model, 4), one_ratio=round(r["one_s"] / model, 2), chain_ratio=round(r["chain_s"] / model, 2))
    res["allreduce"] = rows
    print(f"bulk TCP at {a.rate} (tbf burst {a.burst}): one way {res['one_way_kbps'][0]} kbit/s; "
          f"both ways at once {res['both_ways_kbps']} kbit/s")
    print("| all_reduce bytes | alone s | chain s | model s | alone / model | chain / model |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['bytes']} | {r['one_s']:.3f} | {r['chain_s']:.3f} | {r['model_s']:.3f} | {r['one_ratio']} | "
              f"{r['chain_ratio']} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
