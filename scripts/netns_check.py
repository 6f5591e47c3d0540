"""Measured vs modeled: a small pipeline over gloo between rate-limited network namespaces.

Run as root (creates and deletes its own namespaces; talks only to addresses it created):

    python scripts/netns_check.py                 # 2 rows x 3 stages, 4 micro-batches, 200 Mbit/s
    python scripts/netns_check.py --rows 1        # one pipeline, no DP sync
    python scripts/netns_check.py --help

Topology (what orchestration.distributed.linkmodel calls "node"): one host per rank made by
orchestration.hosts (a namespace joined to a hub namespace by a veth pair; ``tc tbf rate
200mbit`` on the rank side, its uplink, and on the hub side, its downlink). So every rank
has a 200 Mbit/s access link, as consumer GPUs on the internet do. Bandwidth only: this
kernel has no netem, so no latency or loss is modeled on the links.

Workload: a rows x stages mesh (rank = row * stages + stage). Each rank is one pipeline
stage running the schedule of orchestration/distributed/schedule.py exactly as listed, with real
gloo isend/recv of the boundary messages (sizes from orchestration/codecs.py: a dense
and a masked p=0.95 boundary of a [micro-batch, T, H] fp32 activation); then, with
rows > 1, a blocking gloo all_reduce of --dp-bytes within each stage column (plain DP),
which the link model prices as a ring all-reduce (``model_step(dp_blocking=True)``). Compute is a sleep of fixed length (this machine
has 2 cores for 3+ ranks: real compute would measure core contention, not links); the
actual per-action durations are measured and fed to the link model with the counted
bytes. Measured step time (median over steps, max over ranks) is set beside the
model's prediction at the nominal rate and at the rate calibrated by one bulk transfer
(TCP/IP headers and tbf's accounting make the payload rate a few % below nominal).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# ---------------------------------------------------------------------------------
# worker: one rank = one pipeline stage (runs inside its namespace)
# ---------------------------------------------------------------------------------

def worker(a) -> None:
    import torch
    import torch.distributed as dist

    from orchestration.distributed.schedule import make_schedule

    torch.set_num_threads(1)
    rank, S, X = a.rank, a.stages, a.world // a.stages
    row, stage = divmod(rank, S)
    dist.init_process_group("gloo", init_method=f"tcp://{a.master}:{a.port}", rank=rank, world_size=a.world,
                            timeout=__import__("datetime").timedelta(seconds=60))
    columns = [dist.new_group([r * S + c for r in range(X)]) for c in range(S)]  # every rank creates all
    sched = make_schedule(a.schedule, S, a.microbatches)[stage]
    nf, nb = a.fwd_bytes // 4, a.bwd_bytes // 4  # fp32 payloads of exactly these byte counts
    dp_buf = torch.zeros(a.dp_bytes // 4) if X > 1 and a.dp_bytes else None
    out = {"rank": rank, "stage": stage, "steps": [], "F": [], "B": []}
    if a.calibrate and rank in (0, 1):  # one bulk transfer 0 -> 1 through both access links
        buf = torch.zeros(a.calibrate // 4)
        dist.barrier()
        t0 = time.perf_counter()
        dist.send(buf, 1) if rank == 0 else dist.recv(buf, 0)
        if rank == 1:
            dist.send(torch.zeros(1), 0)
        else:
            dist.recv(torch.zeros(1), 1)
        out["calib_s"] = time.perf_counter() - t0
    elif a.calibrate:
        dist.barrier()
    prev, nxt = (rank - 1 if stage > 0 else None), (rank + 1 if stage < S - 1 else None)
    for step in range(a.warmup + a.steps):
        recvs = {}
        for act in sched:  # pre-post every receive of the step, in schedule order
            if act.kind == "F" and prev is not None:
                t = torch.empty(nf)
                recvs[act] = (t, dist.irecv(t, prev, tag=2 * act.microbatch))
            elif act.kind == "B" and nxt is not None:
                t = torch.empty(nb)
                recvs[act] = (t, dist.irecv(t, nxt, tag=2 * act.microbatch + 1))
        sends = []
        dist.barrier()
        t0 = time.perf_counter()
        for act in sched:
            if act in recvs:
                recvs[act][1].wait()
            c0 = time.perf_counter()
            time.sleep(a.f_s if act.kind == "F" else a.b_s)  # stand-in compute (module doc)
            c1 = time.perf_counter()
            if step >= a.warmup:
                out[act.kind].append(c1 - c0)
            if act.kind == "F" and nxt is not None:
                sends.append(dist.isend(torch.zeros(nf), nxt, tag=2 * act.microbatch))
            elif act.kind == "B" and prev is not None:
                sends.append(dist.isend(torch.zeros(nb), prev, tag=2 * act.microbatch + 1))
        for w in sends:
            w.wait()
        if dp_buf is not None:
            dist.all_reduce(dp_buf, group=columns[stage])
        if step >= a.warmup:
            out["steps"].append(time.perf_counter() - t0)
    dist.barrier()
    dist.destroy_process_group()
    print("RESULT " + json.dumps(out), flush=True)


# ---------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------

def run_case(hosts, a, fwd_bytes: int, bwd_bytes: int, calibrate: int, port: int) -> list[dict]:
    env = {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}
    procs = []
    for i in range(hosts.n):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker",
               "--rank", str(i), "--world", str(hosts.n), "--stages", str(a.stages),
               "--dp-bytes", str(a.dp_bytes), "--master", hosts.addr(0), "--port", str(port),
               "--schedule", a.schedule, "--microbatches", str(a.microbatches), "--steps", str(a.steps),
               "--warmup", "1", "--f-s", str(a.f_s), "--b-s", str(a.b_s),
               "--fwd-bytes", str(fwd_bytes), "--bwd-bytes", str(bwd_bytes), "--calibrate", str(calibrate)]
        procs.append(hosts.popen(i, cmd, env=env, log=f"case{port}.log"))
    codes = hosts.wait_all(procs, a.timeout_s)  # the first to fail stops the others
    bad = [p for p, c in zip(procs, codes) if c]
    if bad:
        raise RuntimeError(f"rank {bad[0].host} failed (exit {bad[0].returncode}):\n{bad[0].tail(40)}")
    return [json.loads(next(ln for ln in p.lines if ln.startswith("RESULT "))[7:]) for p in procs]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--stages", type=int, default=3, help="pipeline stages per row")
    ap.add_argument("--rows", type=int, default=2, help="replicas (rows x stages ranks = namespaces)")
    ap.add_argument("--dp-bytes", type=int, default=4 * 2 ** 20,
                    help="rows > 1: bytes each rank all-reduces in its stage column after every step")
    ap.add_argument("--microbatches", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    ap.add_argument("--steps", type=int, default=4, help="measured steps per case (after 1 warm-up)")
    ap.add_argument("--rate", default="200mbit", help="tc tbf rate of every access link")
    ap.add_argument("--burst", default="64kb", help="tc tbf burst (bucket size)")
    ap.add_argument("--f-s", type=float, default=0.03, help="stand-in forward compute per micro-batch (s)")
    ap.add_argument("--b-s", type=float, default=0.06, help="stand-in backward compute per micro-batch (s)")
    ap.add_argument("--shape", default="2,128,1024", help="boundary activation [micro-batch, T, H] (fp32)")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="per case; a stuck rank fails the run")
    ap.add_argument("--json", default="", help="also write the figures to this JSON file")
    # worker-only flags
    for f, t in (("--rank", int), ("--world", int), ("--port", int), ("--warmup", int), ("--fwd-bytes", int),
                 ("--bwd-bytes", int), ("--calibrate", int)):
        ap.add_argument(f, type=t, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--master", default="", help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker(a)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from orchestration.hosts import Hosts, available

    if available():
        raise SystemExit(f"netns_check: {available()}")
    if a.stages < 2 or a.rows < 1:
        raise SystemExit("--stages must be >= 2 and --rows >= 1")

    import torch

    from orchestration.codecs import make_codec
    from orchestration.distributed.linkmodel import LinkSpec, model_step
    from orchestration.distributed.schedule import make_schedule

    shape = tuple(int(x) for x in a.shape.split(","))
    rate_bps = float(a.rate.lower().replace("mbit", "e6").replace("kbit", "e3").replace("gbit", "e9"))
    cases = [(name, make_codec(name, p=0.95)) for name in ("dense", "mask")]
    hosts = Hosts(a.rows * a.stages, a.rate, burst=a.burst)
    rows, calib_bps = [], None
    try:
        for j, (name, codec) in enumerate(cases):
            fb = codec.wire_bytes(shape, torch.float32, "fwd")
            bb = codec.wire_bytes(shape, torch.float32, "bwd")
            calib = 8 * 2 ** 20 if j == 0 else 0
            res = run_case(hosts, a, fb, bb, calib, 29600 + j)
            if calib:
                calib_bps = calib * 8 / next(r["calib_s"] for r in res if "calib_s" in r)
            measured = statistics.median(max(r["steps"][k] for r in res) for k in range(a.steps))
            ct = {k: [statistics.mean(x for r in res if r["stage"] == st for x in r[k]) for st in range(a.stages)]
                  for k in ("F", "B")}
            sched = make_schedule(a.schedule, a.stages, a.microbatches)

            def modeled(bps):
                return model_step(sched, ct, {"F": fb, "B": bb}, LinkSpec(bps), replicas=a.rows, tokens_per_replica=1,
                                  dp_payload_bytes=a.dp_bytes if a.rows > 1 else 0, dp_blocking=True)

            nominal, calibrated = modeled(rate_bps), modeled(calib_bps)
            rows.append(dict(codec=name, fwd_bytes=fb, bwd_bytes=bb, measured_s=measured,
                             model_nominal_s=nominal.step_s, model_calibrated_s=calibrated.step_s,
                             model_pipeline_s=calibrated.pipeline_s, compute=ct))
    finally:
        hosts.close()
    dp = f", DP all-reduce {a.dp_bytes} B per column per step" if a.rows > 1 else ""
    print(f"netns check: {a.rows} rows x {a.stages} stages{dp}, {a.microbatches} micro-batches, {a.schedule}, tbf {a.rate} "
          f"(burst {a.burst}) per access link, activation {shape} fp32, compute F={a.f_s}s B={a.b_s}s (sleep)")
    print(f"bulk transfer through two shaped links: {calib_bps / 1e6:.1f} Mbit/s payload "
          f"(nominal {rate_bps / 1e6:.0f})")
    print(f"{'codec':8} {'bytes/msg':>10} {'measured s':>11} {'model@nominal':>14} {'model@calib':>12} "
          f"{'(pipeline part)':>16} {'meas/calib':>11}")
    for r in rows:
        print(f"{r['codec']:8} {r['fwd_bytes']:>10} {r['measured_s']:>11.3f} {r['model_nominal_s']:>14.3f} "
              f"{r['model_calibrated_s']:>12.3f} {r['model_pipeline_s']:>16.3f} "
              f"{r['measured_s'] / r['model_calibrated_s']:>11.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(args=vars(a), calib_bps=calib_bps, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
