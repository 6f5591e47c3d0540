"""pca:quant=nf (meshkern.pca_nf: the C++ or Triton pack/unpack and the reference) against the GEMM of the
same size (the limit) and against the int4 codec's fused ops at the same bytes per token.

    python -m bench.pca_nf_bench                       # CPU, 1 thread, 32 x 128 tokens, H = 576
    python -m bench.pca_nf_bench --hidden 576 2048 --budget 15 30 --json out.json

Per hidden size H and budget (1/budget of dense fp32 bytes per token per direction), a
spectrum like SmolLM2-135M's boundary (variances falling as i^-1.5), the widths allocated
as calibration allocates them (k = the coordinates that get a bit), fp32 boundary [B, T, H]:
  nf         encode / decode with the int4 column's backend (the code search and the bit
             stream: cpp on CPU, csrc/pca/pca_nf_cpu.cpp; triton on CUDA,
             meshkern/triton_kernels/pca_nf.py; the GEMMs torch's)
  nf ref     encode_reference / decode_reference (searchsorted over per-coordinate tables,
             the stream in 32-bit words; decode: unpacking, code book gathers, GEMM)
  matmul     h @ U [N, H] x [H, k] (encode) and c @ U^T (decode)
  int4       meshkern.pca.encode / decode at the int4 codec's k for the same budget
             (fused: cpp on CPU, triton on CUDA)
Columns: ms (median), nf/matmul (distance from the limit), nf/int4. Interleaved round-robin
(bench.subspace_bench.rotated_medians); CPU clock = process CPU time.
"""
from __future__ import annotations

import json

import torch

from bench.pca_bench import parser, setup
from bench.subspace_bench import rotated_medians
from meshkern import pca, pca_nf
from orchestration.codecs.pca import pca_width
from orchestration.codecs.pca_nf import nf_code_bytes


def _case(B, T, H, budget, device, repeats, clock, be):
    g = torch.Generator().manual_seed(0)
    var = torch.arange(1, H + 1, dtype=torch.float64) ** -1.5
    nb = nf_code_bytes(H, budget, True, T)
    bits = pca_nf.allocate_bits(var, 8 * nb)
    k = int((bits > 0).sum())
    bits = bits[:k]
    h = (torch.randn(B, T, H, generator=g) * 3).to(device)
    U = torch.linalg.qr(torch.randn(H, k, generator=g))[0].contiguous().to(device)
    mean = torch.randn(H, generator=g).to(device)
    sd = var[:k].sqrt().float().to(device)
    k4 = pca_width(H, 4, budget, True, T)
    U4, sd4 = U[:, :k4].contiguous(), sd[:k4].contiguous()
    wire = pca_nf.encode_reference(h, U, sd, bits, nb, mean=mean)
    wire4 = pca.encode(h, U4, sd4, mean=mean, backend="reference")
    h2, c, Ut = h.view(-1, H), torch.randn(B * T, k, generator=g).to(device), U.T
    fns = {
        "enc nf": lambda: pca_nf.encode(h, U, sd, bits, nb, mean=mean, backend=be),
        "enc nf ref": lambda: pca_nf.encode_reference(h, U, sd, bits, nb, mean=mean),
        "enc matmul": lambda: h2 @ U,
        "enc int4": lambda: pca.encode(h, U4, sd4, mean=mean, backend=be),
        "dec nf": lambda: pca_nf.decode(wire, U, sd, bits, h.shape, h.dtype, mean=mean, backend=be),
        "dec nf ref": lambda: pca_nf.decode_reference(wire, U, sd, bits, h.shape, h.dtype, mean=mean),
        "dec matmul": lambda: c @ Ut,
        "dec int4": lambda: pca.decode(wire4, U4, sd4, shape=h.shape, dtype=h.dtype, mean=mean, backend=be),
    }
    return k, k4, {n: v * 1e3 for n, v in rotated_medians(fns, repeats, device, clock).items()}


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--budget", type=float, nargs="+", default=[15, 30])
    a = ap.parse_args(argv)
    device, be, clock, B = setup(a, strict=False)
    print(f"# pca nf bench: device={device} threads={torch.get_num_threads()} B x T = {B} x {a.seq} fp32, "
          f"int4 column backend={be}, clock={'process CPU time' if device.type == 'cpu' else 'wall'}, "
          f"medians of {a.repeats}")
    print(f"{'H':>5} {'budget':>6} {'k nf':>5} {'k int4':>6} | {'op':<7} {'nf ms':>8} {'nf ref ms':>9} {'matmul ms':>9} "
          f"{'int4 ms':>8} {'nf/matmul':>9} {'nf/int4':>7}")
    rows = []
    for H in a.hidden:
        for budget in a.budget:
            k, k4, t = _case(B, a.seq, H, budget, device, a.repeats, clock, be)
            for op, p in (("encode", "enc"), ("decode", "dec")):
                f, fr, m, i4 = t[f"{p} nf"], t[f"{p} nf ref"], t[f"{p} matmul"], t[f"{p} int4"]
                print(f"{H:>5} {budget:>6g} {k:>5} {k4:>6} | {op:<7} {f:>8.3f} {fr:>9.3f} {m:>9.3f} {i4:>8.3f} "
                      f"{f / m:>9.2f} {f / i4:>7.2f}")
                rows.append(dict(H=H, budget=budget, k=k, k_int4=k4, op=op, nf_ms=f, nf_reference_ms=fr, matmul_ms=m,
                                 int4_ms=i4))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
