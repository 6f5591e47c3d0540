"""Data-parallel compression benchmarks: PowerSGD speed and bytes per sync.

    python -m bench.dp_bench                    # all tables (~2-4 min on 2 shared cores)
    python -m bench.dp_bench --only psgd        # or: op, bytes
    python -m bench.dp_bench --quick            # small shapes, a smoke run

Every ratio is measured in one run on this machine: medians of --repeats timings with
torch.set_num_threads(--threads) (default 1, printed in the header), on a 1-rank gloo
group, so the collectives are no-ops and the tables time compression compute alone.

psgd   PowerSGD compress + decompress (error feedback, warm start) of the weight
       matrices of one Llama-3.2-1B layer (hidden 2048, ffn 8192, 32 / 8 kv heads, fp32)
       at rank 8 and 32: meshkern's PowerSGD (fused ef_project on "auto") vs the same
       with the pure-torch ops (backend "reference") vs torch's powerSGD_hook math
       (its own _orthogonalize, per-tensor as the hook's default
       batch_tensors_with_same_shape=False, input clone for error feedback).
op     powersgd_ef_project (err += grad; p = err @ q) C++ vs torch add_ + bmm per shape.
bytes  bytes per sync for a Llama-3.2-1B-shaped parameter set (16 layers, tied
       128256 x 2048 embedding, norms): payload each rank contributes, bytes each
       rank sends over a ring at world 7 (the paper's fast replicas), and the ratio to
       fp32 NoCompression. Counted analytically by each compressor's payload_bytes_for
       and checked against a real call on one layer.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from bench.spectral_bench import llama_layer_shapes
from meshkern.compress import Int8, NoCompression, PowerSGD, SparseLoCo
from meshkern.compress.base import ring_all_gather_bytes, ring_all_reduce_bytes
from meshkern.compress.powersgd_ops import ef_project_reference, powersgd_ef_project

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 2048, 8192, 32, 8, 16, 128256


def layer_shapes(hidden=HIDDEN, ffn=FFN, heads=HEADS, kv=KV_HEADS):
    """One Llama decoder layer's parameter shapes (bench.spectral_bench's table)."""
    return llama_layer_shapes(hidden, ffn, heads, kv, layers=1)


def model_shapes():
    return [(VOCAB, HIDDEN)] + layer_shapes() * LAYERS + [(HIDDEN,)]


def median_time(fn, repeats):
    fn()  # warm up (allocations, first-touch)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def hook_math(tensors, state, rank):
    """One call of torch's powerSGD_hook on a 1-rank group, minus the collectives:
    error-feedback add, input clone, per-tensor P = MQ, orthogonalize, Q = M^T P,
    M_hat = P Q^T, error = input - M_hat (with the hook's own _orthogonalize)."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize, _should_compress

    flat = torch.cat([t.reshape(-1) for t in tensors])
    if "err" in state:
        flat.add_(state["err"])
    cp = flat.clone()
    views, o = [], 0
    for t in tensors:
        views.append(flat[o:o + t.numel()].view(t.shape))
        o += t.numel()
    qs = state.setdefault("q", {})
    for i, v in enumerate(views):
        if v.dim() < 2:
            continue
        m = v.reshape(v.shape[0], -1).unsqueeze(0)
        n_, m_ = m.shape[1:]
        r = min(n_, m_, rank)
        if not _should_compress(n_, m_, r, 2.0)[0]:
            continue
        if i not in qs:
            qs[i] = torch.randn(1, m_, r)
        q = qs[i]
        _orthogonalize(q, 0)
        p = torch.bmm(m, q)
        _orthogonalize(p, 0)
        torch.bmm(m.transpose(1, 2), p, out=q)
        torch.bmm(p, q.transpose(1, 2), out=m)
    state["err"] = cp - flat
    return views


def table_psgd(args):
    shapes = layer_shapes() if not args.quick else layer_shapes(256, 1024, 8, 2)
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=g) for s in shapes]
    print(f"\n## PowerSGD compress + decompress, one Llama-3.2-1B layer "
          f"({sum(t.numel() for t in tensors) / 1e6:.1f} M params, fp32), median of {args.repeats}")
    print("| rank | meshkern auto (s) | meshkern reference ops (s) | torch hook math (s) | hook / auto | reference / auto |")
    print("|---|---|---|---|---|---|")
    for rank in (8, 32):
        auto = PowerSGD(rank, backend="auto")
        ref = PowerSGD(rank, backend="reference")
        state: dict = {}
        ta = median_time(lambda: auto.all_reduce_mean(tensors, None), args.repeats)
        tr = median_time(lambda: ref.all_reduce_mean(tensors, None), args.repeats)
        th = median_time(lambda: hook_math(tensors, state, rank), args.repeats)
        print(f"| {rank} | {ta:.3f} | {tr:.3f} | {th:.3f} | {th / ta:.2f}x | {tr / ta:.2f}x |")


def table_op(args):
    shapes = [(2, 2048, 2048), (2, 512, 2048), (2, 8192, 2048), (1, 2048, 8192)]
    if args.quick:
        shapes = [(2, 256, 256)]
    print(f"\n## powersgd_ef_project (err += grad; p = err @ q), fp32, median of {args.repeats}")
    print("| B x n x m | r | C++ (ms) | torch add_ + bmm (ms) | torch / C++ | copy of grad (ms) |")
    print("|---|---|---|---|---|---|")
    for B, n, m in shapes:
        g = torch.Generator().manual_seed(1)
        grad, err = torch.randn(B, n, m, generator=g), torch.randn(B, n, m, generator=g)
        dst = torch.empty_like(grad)
        tc = median_time(lambda: dst.copy_(grad), args.repeats)
        for r in (8, 32):
            q = torch.randn(B, m, r, generator=g)
            t_cpp = median_time(lambda: powersgd_ef_project(grad, err, q, backend="cpp"), args.repeats)
            t_ref = median_time(lambda: ef_project_reference(grad, err, q), args.repeats)
            print(f"| {B}x{n}x{m} | {r} | {t_cpp * 1e3:.1f} | {t_ref * 1e3:.1f} | {t_ref / t_cpp:.2f}x | {tc * 1e3:.1f} |")


def table_bytes(args, world=7):
    shapes = model_shapes()
    numel = sum(int(torch.Size(s).numel()) for s in shapes)
    dense = NoCompression().payload_bytes_for(shapes)
    comps = [("none (fp32)", NoCompression(), "all_reduce"), ("PowerSGD r=8", PowerSGD(8), "all_reduce"),
             ("PowerSGD r=32", PowerSGD(32), "all_reduce"), ("SparseLoCo 1/64, 2-bit", SparseLoCo(), "all_gather"),
             ("Int8", Int8(), "all_gather")]
    print(f"\n## Bytes per sync, Llama-3.2-1B-shaped parameter set ({numel / 1e9:.3f} B params), world {world}")
    print("| compressor | collective | payload / rank (MB) | sent / rank, ring (MB) | payload ratio vs fp32 | sent ratio vs fp32 |")
    print("|---|---|---|---|---|---|")
    dense_sent = ring_all_reduce_bytes(numel, 4, world, 0)[0]
    for name, c, coll in comps:
        payload = c.payload_bytes_for(shapes)
        if coll == "all_reduce":
            # PowerSGD: P and Q go in two all-reduces; ring cost of each, rank 0
            if isinstance(c, PowerSGD):
                groups, unc = c._plan(shapes)
                n_p = sum(len(ix) * n * r for (n, m, r), ix in groups.items()) + \
                    sum(int(torch.Size(shapes[i]).numel()) for i in unc)
                n_q = sum(len(ix) * m * r for (n, m, r), ix in groups.items())
                sent = ring_all_reduce_bytes(n_p, 4, world, 0)[0] + ring_all_reduce_bytes(n_q, 4, world, 0)[0]
            else:
                sent = ring_all_reduce_bytes(payload // 4, 4, world, 0)[0]
        else:
            sent = ring_all_gather_bytes(payload, world)[0]
        print(f"| {name} | {coll} | {payload / 1e6:.2f} | {sent / 1e6:.2f} | {dense / payload:.1f}x | {dense_sent / sent:.1f}x |")
    # check the analytic counts against real calls on one layer (1-rank group: payload counter)
    layer = [torch.randn(s) for s in layer_shapes(256, 1024, 8, 2)]
    for name, c, _ in comps:
        c.all_reduce_mean(layer, None)
        assert c.payload_bytes == c.payload_bytes_for([t.shape for t in layer]), name
    print("(payload_bytes_for checked against the counters of real calls on a small layer: equal)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=["psgd", "op", "bytes"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    torch.set_num_threads(args.threads)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    print(f"# dp_bench: torch {torch.__version__}, threads {torch.get_num_threads()}, repeats {args.repeats}"
          f"{', quick' if args.quick else ''}")
    try:
        if args.only in (None, "psgd"):
            table_psgd(args)
        if args.only in (None, "op"):
            table_op(args)
        if args.only in (None, "bytes"):
            table_bytes(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
