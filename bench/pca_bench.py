"""pca codec kernels: fused encode / decode (meshkern.pca) against today's unfused torch path
(the reference: the codec's own math) and against the GEMM of the same size.

    python -m bench.pca_bench                   # CPU (cpp), 1 thread, B x T = 32 x 128 tokens, H = 576
    python -m bench.pca_bench --hidden 576 2048 --tokens 2048
    python -m bench.pca_bench --device cuda     # the Triton kernels on a GPU
    python -m bench.pca_bench --json out.json

Per hidden size H, k = the codec's default width (orchestration.codecs.pca.pca_width:
288 / 1050 / 2110 at H = 576 / 2048 / 4096), the codec's default wire (int4 body, int8
sink row), fp32 boundary tensor [B, T, H]:
  fused      meshkern.pca.encode / decode (cpp on CPU, triton on CUDA)
  unfused    the same ops with backend="reference": x.float(), slice, (x - mean) @ U / sd,
             absmax, divide, round, clamp, pad, pack; decode: unpack, * scale * sd, @ U^T,
             + mean, cat with the sink row
  matmul     h @ U [N, H] x [H, k] (encode) and c @ U^T (decode): the GEMM alone, the limit
Columns: ms (median), unfused/fused (what the fusion buys), fused/matmul (distance from
the limit). Timings interleaved round-robin in one run, the order rotated every round
(bench.subspace_bench.rotated_medians); CPU clock = process CPU time.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from bench.subspace_bench import rotated_medians
from meshkern import _backend
from meshkern import pca


def _case(B, T, H, k, device, repeats, clock, be):
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(B, T, H, generator=g) * 3).to(device)
    U = torch.linalg.qr(torch.randn(H, k, generator=g))[0].contiguous().to(device)
    mean = torch.randn(H, generator=g).to(device)
    sd = (torch.rand(k, generator=g) + 0.5).to(device)
    wire = pca.encode(h, U, sd, mean=mean, backend="reference")
    h2, c, Ut = h.view(-1, H), torch.randn(B * T, k, generator=g).to(device), U.T
    kw = dict(shape=h.shape, dtype=h.dtype, mean=mean)
    fns = {
        "enc fused": lambda: pca.encode(h, U, sd, mean=mean, backend=be),
        "enc unfused": lambda: pca.encode(h, U, sd, mean=mean, backend="reference"),
        "enc matmul": lambda: h2 @ U,
        "dec fused": lambda: pca.decode(wire, U, sd, backend=be, **kw),
        "dec unfused": lambda: pca.decode(wire, U, sd, backend="reference", **kw),
        "dec matmul": lambda: c @ Ut,
    }
    return {n: v * 1e3 for n, v in rotated_medians(fns, repeats, device, clock).items()}


def parser(doc: str) -> argparse.ArgumentParser:
    """The pca benches' shared flags (this one and bench.pca_nf_bench)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=4096, help="B x T, T = --seq")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--hidden", type=int, nargs="+", default=[576])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", default=None)
    return ap


def setup(a, strict: bool = True):
    """(device, fused backend, clock, B) for parsed flags ``a``; threads pinned. The fused
    backend is cpp on CPU, triton on CUDA; if it cannot run: SystemExit, or with ``strict``
    False the reference (said on stdout)."""
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    be = "cpp" if device.type == "cpu" else "triton"
    why = _backend.why_unavailable(be, "pca", device)
    if why and strict:
        raise SystemExit(f"backend {be} unavailable: {why}")
    if why:
        print(f"# backend {be} unavailable ({why}): the reference path instead")
        be = "reference"
    clock = time.process_time if device.type == "cpu" else time.perf_counter
    return device, be, clock, max(1, a.tokens // a.seq)


def main(argv=None):
    a = parser(__doc__).parse_args(argv)
    device, be, clock, B = setup(a)
    print(f"# pca bench: device={device} backend={be} threads={torch.get_num_threads()} B x T = {B} x {a.seq} "
          f"fp32, int4 body + int8 sink row, clock={'process CPU time' if device.type == 'cpu' else 'wall'}, "
          f"medians of {a.repeats}")
    print(f"{'H':>5} {'k':>5} | {'op':<7} {'fused ms':>9} {'unfused ms':>10} {'matmul ms':>9} "
          f"{'unfused/fused':>13} {'fused/matmul':>12}")
    rows = []
    for H in a.hidden:
        k = pca.CODEC_WIDTH.get(H, H // 2)
        t = _case(B, a.seq, H, k, device, a.repeats, clock, be)
        for op, p in (("encode", "enc"), ("decode", "dec")):
            f, u, m = t[f"{p} fused"], t[f"{p} unfused"], t[f"{p} matmul"]
            print(f"{H:>5} {k:>5} | {op:<7} {f:>9.3f} {u:>10.3f} {m:>9.3f} {u / f:>13.2f} {f / m:>12.2f}")
            rows.append(dict(H=H, k=k, op=op, fused_ms=f, unfused_ms=u, matmul_ms=m))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
