"""The paper's two extra baselines as boundary codecs (aqsgd, tahquant) next to int4, and
our pca (the trainer's default) and subspace codecs: bytes per token, encode/decode time,
AQ-SGD's store memory and its error per visit, and where tahquant's time goes (is a fast
Hadamard kernel worth writing?). pca's basis is fitted to the bench's activations (as
calibration does, from the activations themselves); subspace runs on activations that
satisfy its constraint (E[ids] + a vector in span(U)), where it is exact.

    python -m bench.codec_baselines_bench                       # B=8, T=128, H=576 (SmolLM2-135M)
    python -m bench.codec_baselines_bench --shape 4x2048x2048   # a Llama-3.2-1B micro-batch
    python -m bench.codec_baselines_bench --device cuda

Activations are synthetic (normal, plus a few large fixed dims like a pretrained residual
stream's massive dims); AQ-SGD's revisits drift them by --drift (relative) per visit, the
slow change it relies on. Times are medians of --repeats process-CPU-time (CPU) or
synchronized wall (CUDA) measurements, one thread by default.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from meshkern.mask import MaskKey
from orchestration.codecs import make_codec


def _timer(device: str):
    if device == "cuda":
        def now():
            torch.cuda.synchronize()
            return time.perf_counter()
        return now
    return time.process_time


def _median_ms(fn, repeats: int, now) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t0 = now()
        fn()
        out.append((now() - t0) * 1e3)
    return statistics.median(out)


def activations(B, T, H, device, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H, generator=g)
    x[..., 5] += 60.0
    x[..., H // 3] -= 25.0
    return x.to(device)


def _ours(x: torch.Tensor, B: int, T: int, H: int):
    """(label, codec, activations) for pca (budget 15, sink; the default nf codes and the int4
    layout; basis fitted to x) and subspace (budget 16, fp32 coordinates; x moved into
    E[ids] + span(U))."""
    from meshkern import pca_nf
    from orchestration.codecs import PCABasis, PCACodec, PCANFCodec
    from orchestration.codecs.pca import pca_width
    from orchestration.subspace.constraint import make_basis

    flat = x.reshape(-1, H).float().cpu()
    mean = flat.mean(0)
    _, _, V = torch.linalg.svd(flat - mean, full_matrices=False)
    sd_all = ((flat - mean) @ V.T).std(0).clamp_min(1e-6)
    nf = PCANFCodec(budget=15, sink=True, seq_len=T, bases={})
    bits = pca_nf.allocate_bits(sd_all ** 2, 8 * nf.code_bytes(H))
    kn = int((bits > 0).sum())  # widths fall with the variance: the coordinates with bits lead
    nf.bases = {0: PCABasis(mean, V[:kn].T.contiguous(), sd_all[:kn], torch.ones(kn), bits=bits[:kn],
                            gbits=pca_nf.allocate_bits(torch.ones(kn), 8 * nf.code_bytes(H))).to(x.device)}
    yield "pca (default: nf, budget=15, sink)", nf, x

    pca = PCACodec(quant="absmax", bits=4, budget=15, sink=True, seq_len=T, bases={})
    k = pca_width(H, bits=4, budget=15, sink=True, seq_len=T)
    U = V[:k].T.contiguous()
    pca.bases = {0: PCABasis(mean, U, sd_all[:k], torch.ones(k)).to(x.device)}
    yield "pca:quant=absmax (int4, sink)", pca, x

    sub = make_codec("subspace:budget=16")
    V_, ks = 4096, sub.width(H)
    g = torch.Generator().manual_seed(2)
    E = torch.randn(V_, H, generator=g).to(x.device)
    Us = make_basis(H, ks, seed=3).to(x.device)
    ids = torch.randint(0, V_, (B, T), generator=g).to(x.device)
    sub.attach(E, Us)
    sub.bind_inputs([ids])
    yield "subspace (budget=16, fp32)", sub, E[ids] + (x @ Us) @ Us.T


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="8x128x576", help="BxTxH of one micro-batch's boundary tensor")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--visits", type=int, default=4, help="AQ-SGD visits of the same samples")
    ap.add_argument("--drift", type=float, default=0.01, help="relative change of h between visits")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    B, T, H = (int(v) for v in a.shape.split("x"))
    now = _timer(a.device)
    x = activations(B, T, H, a.device)
    key = MaskKey(0, 0, 0, 0)
    dense = 4 * H
    print(f"# boundary tensor {B}x{T}x{H} fp32 on {a.device}, {a.threads} thread(s); dense {dense} B/token")
    print(f"{'codec':34s} {'fwd B/tok':>9s} {'x fp32':>7s} {'bwd B/tok':>9s} {'x fp32':>7s} "
          f"{'enc ms':>8s} {'dec ms':>8s} {'rel err':>8s}")
    baselines = [(spec, make_codec(spec), x) for spec in
                 ("int4", "aqsgd:bits=4,gbits=16", "aqsgd:bits=2,gbits=8", "tahquant:gbits=16", "tahquant:bits=3")]
    for spec, c, xs in baselines + list(_ours(x, B, T, H)):
        fb, bb = (c.wire_bytes((B, T, H), torch.float32, d) / (B * T) for d in ("fwd", "bwd"))
        wire, _ = c.encode_fwd(xs, key)
        enc = _median_ms(lambda: c.encode_fwd(xs, key), a.repeats, now)
        dec = _median_ms(lambda: c.decode_fwd(wire, key, xs.shape, xs.dtype), a.repeats, now)
        err = float((c.decode_fwd(wire, key, xs.shape, xs.dtype) - xs).norm() / xs.norm())
        print(f"{spec:34s} {fb:9.1f} {dense / fb:7.2f} {bb:9.1f} {dense / bb:7.2f} {enc:8.2f} {dec:8.2f} {err:8.4f}")

    # AQ-SGD over visits: the same B samples, h drifting slowly; sender and receiver objects.
    print(f"\n# aqsgd bits=4: the same {B} samples visited {a.visits} times, h drifting {a.drift:.0%} per visit")
    send, recv = make_codec("aqsgd:bits=4"), make_codec("aqsgd:bits=4")
    ids = [torch.arange(B)]
    g = torch.Generator().manual_seed(1)
    h = x.clone()
    for v in range(a.visits):
        h = h + a.drift * x.std() * torch.randn(h.shape, generator=g).to(a.device)
        k = MaskKey(0, 0, v, 0)
        send.begin_step(v, ids)
        recv.begin_step(v, ids)
        t0 = now()
        wire, _ = send.encode_fwd(h, k)
        out = recv.decode_fwd(wire, k, h.shape, h.dtype)
        ms = (now() - t0) * 1e3
        print(f"visit {v}: rel err {float((out - h).norm() / h.norm()):.5f}  encode+decode {ms:7.2f} ms  "
              f"store per side {send.store_bytes() / 2**20:.2f} MiB ({send.store_bytes() // B} B/sample = T*H*4)")

    # Where tahquant's time goes.
    from torch.profiler import ProfilerActivity, profile

    c = make_codec("tahquant")
    wire, _ = c.encode_fwd(x, key)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])
    with profile(activities=acts) as prof:
        c.encode_fwd(x, key)
        c.decode_fwd(wire, key, x.shape, x.dtype)
    ev = prof.key_averages()
    attr = "self_device_time_total" if a.device == "cuda" else "self_cpu_time_total"
    total = sum(getattr(e, attr, 0) for e in ev)
    mm = sum(getattr(e, attr, 0) for e in ev if e.key in ("aten::mm", "aten::matmul", "aten::bmm"))
    print(f"\n# tahquant encode+decode: the Hadamard matmuls take {mm / max(total, 1):.1%} of the op time")
    for e in sorted(ev, key=lambda e: -getattr(e, attr, 0))[:6]:
        print(f"  {e.key:28s} {getattr(e, attr, 0) / max(total, 1):6.1%}")


if __name__ == "__main__":
    main()
