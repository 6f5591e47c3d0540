"""Mask kernel benchmark: index generation, fused pack, unpack, per backend, as ratios.

    python -m bench.mask_bench                  # T=4096, H=2048, p=0.95, fp32 + bf16 (~1-2 min on 2 cores)
    python -m bench.mask_bench --full           # T x H in {4096x1024, 4096x2048, 2048x4096},
                                                # p in {0.9, 0.95, 0.99}, fp32 and bf16
    python -m bench.mask_bench --device cuda    # cuda + triton backends on a GPU
    python -m bench.mask_bench --json out.json  # also write the rows
    python -m bench.mask_bench --device cuda --shapes 16384x4096 --dtypes bfloat16 --no-reference
                                                # issue 15's bandwidth goal (GB/s vs the device's peak)

Every ratio compares timings taken in the same run, interleaved round-robin (one
timing of each contender per round, --repeats rounds, medians), so load from other
processes on the shared machine hits both sides alike. Thread count: --threads
(default 1, printed in the header) for every contender, reference and baselines
included. Clock (--clock): on CPU the default is process CPU time (user + system,
all threads; page faults included), which other processes on a shared machine do
not inflate the way they inflate wall time (measured: wall-time medians of the same
op varied 3x between runs at load average 20, CPU time by < 10%); with 1 thread it
equals the op's latency on an idle core. On CUDA it is wall time after synchronize.

Columns, per backend and op:
  ms            median time of the op
  x ref         reference time / op time (speedup over the pure-torch reference)
  / limit       op time / memory-limit time, where the limit is
                  pack:    h.clone() of the same [T, H] tensor (reads and writes all of h;
                           pack reads <= h and writes 1/20 of it)
                  unpack:  torch.zeros(T, H) (allocating + zero-filling its output)
                  indices: a clone of an int64 [T, K] tensor (writing the index tensor)
The targets (cpp, T=4096, H=2048, p=0.95), checked and printed at the end: issue 2 (fp32):
pack / clone <= 2, unpack / zeros <= 1.5; issue 15 item 3 (each dtype): pack x ref >= 15,
indices / limit <= 8 (index generation within 8x of writing the index tensor).

Triton is not timed on CPU (the interpreter's speed means nothing); the reference is
timed with fewer repeats (--ref-repeats) because one call takes ~0.1-1 s.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import meshkern
from bench.spectral_bench import _sync
from meshkern import MaskKey, kept_dims
from meshkern import _backend

KEY = MaskKey(seed=0x5EED, boundary=1, step=100, microbatch=3)
DEFAULT_SHAPES = [(4096, 2048)]
FULL_SHAPES = [(4096, 1024), (4096, 2048), (2048, 4096)]
DEFAULT_PS = [0.95]
FULL_PS = [0.9, 0.95, 0.99]


def interleaved_medians(fns: dict, repeats: dict, device: torch.device, clock=time.perf_counter) -> dict:
    """{name: median seconds}; one warm-up call each, then round-robin timings."""
    for fn in fns.values():
        fn()
    _sync(device)
    times = {name: [] for name in fns}
    for r in range(max(repeats.values())):
        for name, fn in fns.items():
            if r >= repeats[name]:
                continue
            _sync(device)
            t0 = clock()
            fn()
            _sync(device)
            times[name].append(clock() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def backends_for(device: torch.device) -> list[str]:
    out = []
    for b in ("cpp", "cuda", "triton"):
        if b == "triton" and device.type == "cpu":
            continue  # interpreter only: timing it is meaningless
        if _backend.why_unavailable(b, "mask", device) is None:
            out.append(b)
    return out


def bench_config(T: int, H: int, p: float, dtype: torch.dtype, device: torch.device, repeats: int,
                 ref_repeats: int, with_reference: bool = True, clock=time.perf_counter) -> list[dict]:
    K = kept_dims(H, p)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(T, H, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(T, K, generator=g).to(device=device, dtype=dtype)
    idx_src = torch.zeros(T, K, dtype=torch.int64, device=device)
    fns = {
        "clone": lambda: h.clone(),
        "zeros": lambda: torch.zeros(T, H, dtype=dtype, device=device),
        "idxcopy": lambda: idx_src.clone(),
    }
    reps = {"clone": repeats, "zeros": repeats, "idxcopy": repeats}
    backends = backends_for(device) + (["reference"] if with_reference else [])
    for b in backends:
        fns[f"{b}:indices"] = lambda b=b: meshkern.mask_indices(KEY, T, H, p, device=device, backend=b)
        fns[f"{b}:pack"] = lambda b=b: meshkern.pack(h, KEY, p, backend=b)
        fns[f"{b}:unpack"] = lambda b=b: meshkern.unpack(v, KEY, H, p, backend=b)
        for op in ("indices", "pack", "unpack"):
            reps[f"{b}:{op}"] = ref_repeats if b == "reference" else repeats
    med = interleaved_medians(fns, reps, device, clock)
    limit = {"pack": med["clone"], "unpack": med["zeros"], "indices": med["idxcopy"]}
    # Bytes a dense pass would move (the convention of the GB/s columns): pack reads [T, H]
    # and writes [T, K]; unpack reads [T, K] and writes [T, H]; indices writes [T, K] int64.
    es = torch.empty((), dtype=dtype).element_size()
    nbytes = {"pack": T * (H + K) * es, "unpack": T * (H + K) * es, "indices": T * K * 8}
    clone_gbps = 2 * T * H * es / med["clone"] / 1e9
    rows = []
    for b in backends:
        for op in ("indices", "pack", "unpack"):
            t = med[f"{b}:{op}"]
            rows.append(dict(T=T, H=H, p=p, K=K, dtype=str(dtype).replace("torch.", ""), device=device.type,
                             backend=b, op=op, ms=t * 1e3,
                             x_ref=(med[f"reference:{op}"] / t) if with_reference else None,
                             limit_ms=limit[op] * 1e3, over_limit=t / limit[op],
                             gbps=nbytes[op] / t / 1e9, clone_gbps=clone_gbps))
    return rows


def peak_bandwidth_gbps(device: torch.device) -> float | None:
    """The device's memory bandwidth from its properties (2 transfers per memory clock x
    bus width), or None where torch does not report them (CPU, older torch)."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if not clock_khz or not bus_bits:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9


def print_bandwidth(rows: list[dict], peak: float | None) -> None:
    """Achieved GB/s of pack / unpack (dense-pass bytes, see bench_config) against the
    device's memory bandwidth (peak; issue 15 goal >= 80% at T=16384, H=4096, bf16) and
    against a clone of the same [T, H] tensor (what a plain copy reaches here)."""
    print("\nachieved bandwidth (dense-pass bytes / time):")
    for r in rows:
        if r["op"] == "indices" or r["backend"] == "reference":
            continue
        of_peak = f"{100 * r['gbps'] / peak:5.1f}% of peak {peak:.0f} GB/s" if peak else "peak unknown"
        print(f"  {r['T']:>5}x{r['H']:<5} p={r['p']} {r['dtype']:>8} {r['backend']:>6} {r['op']:>6}: {r['gbps']:8.1f} GB/s "
              f"= {of_peak}; {100 * r['gbps'] / r['clone_gbps']:5.1f}% of clone ({r['clone_gbps']:.0f} GB/s)")
    if peak:
        goal = [r for r in rows if (r["T"], r["H"], r["dtype"], r["op"]) == (16384, 4096, "bfloat16", "pack")
                or (r["T"], r["H"], r["dtype"], r["op"]) == (16384, 4096, "bfloat16", "unpack")]
        for r in goal:
            if r["backend"] != "reference":
                print(f"  goal (issue 15): {r['backend']} {r['op']} T=16384 H=4096 bf16 at {100 * r['gbps'] / peak:.1f}% "
                      f"of peak (>= 80%): {'PASS' if r['gbps'] >= 0.8 * peak else 'FAIL'}")


HEADER = (f"{'T':>5} {'H':>5} {'p':>5} {'K':>4} {'dtype':>8} {'backend':>9} {'op':>8} {'ms':>9} {'x ref':>7} "
          f"{'limit ms':>9} {'/ limit':>8}")


def print_rows(rows: list[dict]) -> None:
    for r in rows:
        xref = f"{r['x_ref']:7.1f}" if r["x_ref"] is not None else "      -"
        print(f"{r['T']:>5} {r['H']:>5} {r['p']:>5} {r['K']:>4} {r['dtype']:>8} {r['backend']:>9} {r['op']:>8} "
              f"{r['ms']:9.3f} {xref} {r['limit_ms']:9.3f} {r['over_limit']:8.2f}", flush=True)


def check_targets(rows: list[dict]) -> list[str]:
    """The acceptance ratios, on the cpp rows of T=4096, H=2048, p=0.95: issue 2 (fp32) and
    issue 15 item 3 (pack >= 15x the reference, index generation <= 8x writing the index
    tensor; every dtype in the run)."""
    out = []
    for dtype in ("float32", "bfloat16", "float16", "float64"):
        sel = {r["op"]: r for r in rows if (r["backend"], r["T"], r["H"], r["p"], r["dtype"]) ==
               ("cpp", 4096, 2048, 0.95, dtype)}
        if not sel:
            continue
        pk, up, ix = sel["pack"], sel["unpack"], sel["indices"]
        if pk["x_ref"] is not None:
            out.append(f"{dtype}: pack speedup over reference {pk['x_ref']:.1f}x (issue 15 target >= 15): "
                       f"{'PASS' if pk['x_ref'] >= 15 else 'FAIL'}")
        out.append(f"{dtype}: indices / writing the index tensor {ix['over_limit']:.2f} (issue 15 target <= 8): "
                   f"{'PASS' if ix['over_limit'] <= 8 else 'FAIL'}")
        if dtype == "float32":
            out.append(f"{dtype}: pack / h.clone() {pk['over_limit']:.2f} (issue 2 target <= 2): "
                       f"{'PASS' if pk['over_limit'] <= 2 else 'FAIL'}")
            out.append(f"{dtype}: unpack / torch.zeros {up['over_limit']:.2f} (issue 2 target <= 1.5): "
                       f"{'PASS' if up['over_limit'] <= 1.5 else 'FAIL'}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="the whole T x H x p x dtype grid")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=1, help="torch threads for every contender (default 1)")
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds (default 15 cpu / 50 cuda)")
    ap.add_argument("--ref-repeats", type=int, default=5, help="timed rounds of the slow reference")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--shapes", default=None, help="TxH,... instead of the default / --full shapes (e.g. 16384x4096)")
    ap.add_argument("--ps", default=None, help="p,... instead of the default / --full values")
    ap.add_argument("--no-reference", action="store_true", help="skip the pure-torch reference")
    ap.add_argument("--json", default=None, help="write the rows to this file")
    ap.add_argument("--clock", default=None, choices=["cpu", "wall"],
                    help="cpu: process CPU time (default on CPU); wall: perf_counter (default on CUDA)")
    args = ap.parse_args(argv)

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    repeats = args.repeats or (50 if device.type == "cuda" else 15)
    clock_name = args.clock or ("wall" if device.type == "cuda" else "cpu")
    clock = time.process_time if clock_name == "cpu" else time.perf_counter
    shapes, ps = (FULL_SHAPES, FULL_PS) if args.full else (DEFAULT_SHAPES, DEFAULT_PS)
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    if args.ps:
        ps = [float(x) for x in args.ps.split(",")]
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    isa = ""
    if device.type == "cpu" and _backend.extension("mask") is not None:
        isa = f" cpu_selection={torch.ops.meshkern_C.mask_cpu_isa()}"
    print(f"meshkern mask bench: device={device.type} threads={torch.get_num_threads()} clock={clock_name} repeats={repeats} "
          f"(reference {args.ref_repeats}) backends={backends_for(device)}{isa} torch={torch.__version__} "
          f"load avg {os.getloadavg()[0]:.1f}")
    print(HEADER)
    print("-" * len(HEADER))
    rows = []
    for T, H in shapes:
        for p in ps:
            for dtype in dtypes:
                new = bench_config(T, H, p, dtype, device, repeats, args.ref_repeats, not args.no_reference, clock)
                print_rows(new)  # as they come: a run cut short still shows its rows
                rows += new
    print_bandwidth(rows, peak_bandwidth_gbps(device))
    for line in check_targets(rows):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(threads=torch.get_num_threads(), device=device.type, clock=clock_name, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
