"""Subspace codec kernels: fused encode (h - E[ids]) @ U and decode E[ids] + c @ U^T
against the unfused torch ops and against a plain matmul of the same size.

    python -m bench.subspace_bench                 # CPU, 1 thread, N=4096, H in {576, 192}, k = H/16, H/32
    python -m bench.subspace_bench --device cuda   # the Triton kernel on a GPU
    python -m bench.subspace_bench --json out.json

Contenders, per (H, k), fp32, ids uniform over a V=49152-row table (SmolLM2's vocab):
  fused        meshkern.subspace.encode / decode (cpp on CPU, triton on CUDA)
  unfused      torch: (h - E.index_select(0, ids)) @ U;  E.index_select(0, ids) + c @ U.T
  matmul       h @ U;  c @ U.T  -- the GEMM alone, the physical limit of either op (the
               fused op does this GEMM plus one gathered read of E)
  offset       the broadcast-offset form (PCA mean): fused vs torch (h - mean) @ U
  enc table    encode with the [V, k] table T = E U precomputed (E is frozen in this mode):
               fused = meshkern.subspace.encode(h, ids, None, U, table=T) (the GEMM, then the
               gathered k-wide T rows subtracted in its epilogue), unfused = torch
               h @ U - T.index_select(0, ids); k values gathered per token instead of H.
               What the subspace codec's encode runs.
Columns: ms (median), unfused/fused (speedup of the fusion), fused/matmul (distance
from the limit). Timings interleaved round-robin in one run, the order rotated every
round (rotated_medians); CPU clock = process CPU time with 1 thread (what limits it: the
GEMM's FLOPs for encode, the write of the [N, H] output for decode).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import statistics
from meshkern import _backend
from meshkern import subspace as S


def rotated_medians(fns: dict, repeats: int, device: torch.device, clock) -> dict:
    """{name: median seconds}: one warm-up call each, then ``repeats`` rounds with one
    timing of every contender per round, the order rotated by one each round (so no
    contender always runs right after the same one, whose cache footprint it would
    inherit: the E-form ops stream a 113 MB table)."""
    from bench.spectral_bench import _sync

    names = list(fns)
    for fn in fns.values():
        fn()
    _sync(device)
    times = {n: [] for n in names}
    for r in range(repeats):
        for n in names[r % len(names):] + names[:r % len(names)]:
            _sync(device)
            t0 = clock()
            fns[n]()
            _sync(device)
            times[n].append(clock() - t0)
    return {n: statistics.median(ts) for n, ts in times.items()}


def _case(N, H, k, V, device, repeats, clock):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=g).to(device)
    ids = torch.randint(0, V, (N,), generator=g).to(device)
    E = torch.randn(V, H, generator=g).to(device)
    U = torch.linalg.qr(torch.randn(H, k, generator=g))[0].contiguous().to(device)
    c = torch.randn(N, k, generator=g).to(device)
    mean = torch.randn(H, generator=g).to(device)
    Ut = U.T
    EU = S.projected_table(E, U)  # [V, k]: E is frozen, so the codec keeps this table
    be = "cpp" if device.type == "cpu" else "triton"
    fns = {
        "enc fused": lambda: S.encode(h, ids, E, U, backend=be),
        "enc unfused": lambda: (h - E.index_select(0, ids)) @ U,
        "enc matmul": lambda: h @ U,
        "enc table fused": lambda: S.encode(h, ids, None, U, table=EU, backend=be),
        "enc table unfused": lambda: torch.sub(h @ U, EU.index_select(0, ids)),
        "dec fused": lambda: S.decode(c, ids, E, U, backend=be),
        "dec unfused": lambda: E.index_select(0, ids) + c @ Ut,
        "dec matmul": lambda: c @ Ut,
        "off enc fused": lambda: S.encode(h, None, None, U, offset=mean, backend=be),
        "off enc unfused": lambda: (h - mean) @ U,
        "off dec fused": lambda: S.decode(c, None, None, U, offset=mean, backend=be),
        "off dec unfused": lambda: c @ Ut + mean,
    }
    t = rotated_medians(fns, repeats, device, clock)
    return {n: v * 1e3 for n, v in t.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, nargs="+", default=[576, 192])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    be = "cpp" if device.type == "cpu" else "triton"
    why = _backend.why_unavailable(be, "subspace", device)
    if why:
        raise SystemExit(f"backend {be} unavailable: {why}")
    clock = time.process_time if device.type == "cpu" else time.perf_counter
    print(f"# subspace bench: device={device} backend={be} threads={torch.get_num_threads()} "
          f"N={a.tokens} V={a.vocab} fp32, clock={'process CPU time' if device.type == 'cpu' else 'wall'}, "
          f"medians of {a.repeats}")
    print(f"{'H':>5} {'k':>4} | {'op':<10} {'fused ms':>9} {'unfused ms':>10} {'matmul ms':>9} "
          f"{'unfused/fused':>13} {'fused/matmul':>12}")
    rows = []
    for H in a.hidden:
        for k in (H // 16, H // 32):
            t = _case(a.tokens, H, k, a.vocab, device, a.repeats, clock)
            for op, mm in (("encode", "enc matmul"), ("decode", "dec matmul")):
                p = "enc" if op == "encode" else "dec"
                f, u, m = t[f"{p} fused"], t[f"{p} unfused"], t[mm]
                print(f"{H:>5} {k:>4} | {op:<10} {f:>9.3f} {u:>10.3f} {m:>9.3f} {u / f:>13.2f} {f / m:>12.2f}")
                rows.append(dict(H=H, k=k, op=op, fused_ms=f, unfused_ms=u, matmul_ms=m))
            f, u, m = t["enc table fused"], t["enc table unfused"], t["enc matmul"]
            print(f"{H:>5} {k:>4} | {'enc table':<10} {f:>9.3f} {u:>10.3f} {m:>9.3f} {u / f:>13.2f} {f / m:>12.2f}"
                  f"   (vs unfused E form: {t['enc unfused'] / f:.2f}x)")
            rows.append(dict(H=H, k=k, op="enc table", fused_ms=f, unfused_ms=u, matmul_ms=m,
                             unfused_E_form_ms=t["enc unfused"]))
            for op in ("enc", "dec"):
                f, u = t[f"off {op} fused"], t[f"off {op} unfused"]
                m = t[f"{op} matmul"]
                name = "off " + ("encode" if op == "enc" else "decode")
                print(f"{H:>5} {k:>4} | {name:<10} {f:>9.3f} {u:>10.3f} {m:>9.3f} {u / f:>13.2f} {f / m:>12.2f}")
                rows.append(dict(H=H, k=k, op=name, fused_ms=f, unfused_ms=u, matmul_ms=m))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
