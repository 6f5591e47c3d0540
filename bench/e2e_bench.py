"""End-to-end benchmark (link model): bytes/token per axis and modeled tokens/s at 200 Mbps.

    python -m bench.e2e_bench                         # both geometries, rows dense, dp, m95, m95-ap
    python -m bench.e2e_bench --measured runs/X/metrics.jsonl   # small model: the run's compute times
    python -m bench.e2e_bench --help

Rows are the trainer's presets (orchestration/config/presets/*.yaml, read through
orchestration.config, so the bench models exactly what ``--preset NAME`` runs):
    dense   dense boundaries; plain gradient all-reduce every step (blocks the step)
    dp      dense boundaries; Streaming DiLoCo (every parameter synced once per H steps
            in F staggered fragments, each sync overlapping ``dp.overlap_steps`` steps of
            compute) + PowerSGD on the exchanged pseudo-gradients
    m95     mask codec at p = 0.95 on every boundary + the dp row's DP sync
    m95-ap  m95 + the anchor replica (last row): snapshots from replica 0 up, anchor
            gradients (small: dense, the preset) or momentum factors (1b) down
and, on the 1b geometry, every boundary codec (dense, mask, topk, bottleneck, int8,
int4) in the m95 row's place: the paper's baselines at their per-direction ratios.

Every byte count is exact and comes from the code that sends it: boundary messages from
``orchestration.codecs.codec_for(cfg.boundary).wire_bytes`` and DP payloads from the preset's
compressor's ``payload_bytes_for`` over the stage's real parameter shapes (a meta-device
model split by ``orchestration.distributed.stages.split_model``). The step time comes from
``orchestration.distributed.linkmodel.model_step`` (discrete-event replay of the preset's schedule
over 200 Mbps access links, DP/anchor as link occupancy; assumptions in its docstring).

Geometries:
    small   the trainer's default model (orchestration.models.loading.default_config) and mesh
            (3 x 2, batch 8 x 128 tokens per replica, 4 micro-batches, fp32). Compute
            times: MEASURED here (one thread, this CPU) by timing each stage's forward
            and backward on one micro-batch, or from a training run's metrics.jsonl
            (--measured: per-stage fwd_s/bwd_s, median over steps after the first).
    1b      Llama-3.2-1B shape (hidden 2048, 16 layers, ffn 8192, 32 heads / 8 kv,
            vocab 128256) on 8 nodes = 4 rows x 2 stages, context 2048, batch 32
            sequences per replica per step in 8 micro-batches, bf16. Compute times:
            ANALYTIC (no such GPU here): 2 FLOP per weight per token forward plus causal
            attention 2*T*H per layer, backward = 2x forward, at --tflops effective per
            node (default 40: a consumer GPU at ~25-50 % of its bf16 peak). Replace with
            measured per-stage times through --compute-1b F0,F1:B0,B1 (seconds per
            micro-batch) when a GPU run exists. Anchor (m95-ap): a snapshot every 20 fast
            steps (the paper's ~20-step anchor delay; a 1B stage snapshot alone takes
            ~50 s at 200 Mbps) and factored transport. Llama-3.2-1B ties its embeddings; we
            model untied copies (the trainer's tied-gradient all-reduce between the
            first and last stage every step would add V*H*2 bytes each way; printed).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from orchestration.anchor import SnapshotCoder
from orchestration.codecs import codec_for
from orchestration.distributed.linkmodel import LinkSpec, model_step
from orchestration.distributed.schedule import make_schedule
from orchestration.distributed.stages import split_model

PAPER = {  # method.md, Llama 3.2 1B at 200 Mbps: (bytes/token, tokens/s)
    "dense": (22.9e3, 1.1e3), "dp": (6.9e3, 3.6e3), "m95": (370, 48.9e3), "m95-ap": (446, 46.5e3)}
ROWS = ("dense", "dp", "m95", "m95-ap")


def preset_config(name: str, overrides: list[str]):
    """The trainer's Config for preset ``name`` with extra CLI-style overrides."""
    from orchestration.config import parse_args
    cfg, _ = parse_args(["--preset", name, *overrides])
    return cfg


def llama_1b_config():
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=2048,
                       tie_word_embeddings=False, rope_theta=500000.0)


def small_config():
    from orchestration.models.loading import default_config
    return default_config()


def meta_stages(hf_config, num_stages: int, layers_per_stage=None):
    """Stages of a parameterless (meta-device) model: real shapes, no memory."""
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        model = LlamaForCausalLM(hf_config)
    return split_model(model, num_stages, layers_per_stage or None)


def stage_shapes(stages) -> list[list[tuple[int, ...]]]:
    return [[tuple(p.shape) for p in st.parameters()] for st in stages]


def analytic_compute(stages, hf_config, mb_tokens: int, seq_len: int, tflops: float) -> dict:
    """Seconds per micro-batch per stage: matmul FLOPs (2 per weight per token, the
    embedding lookup excluded) + causal attention (2*T*H per layer per token), backward
    = 2x forward, at ``tflops`` effective."""
    F = []
    for st in stages:
        weights = sum(p.numel() for n, p in st.named_parameters() if p.dim() == 2 and not n.startswith("embed_tokens"))
        nl = st.layer_range[1] - st.layer_range[0]
        flops = mb_tokens * (2 * weights + 2 * seq_len * hf_config.hidden_size * nl)
        F.append(flops / (tflops * 1e12))
    return {"F": F, "B": [2 * f for f in F]}


def measured_compute_cpu(hf_config, cfg, reps: int = 5) -> dict:
    """Median seconds of each stage's forward and backward on one micro-batch, this CPU,
    one thread (what a rank of the default CPU mesh runs)."""
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = LlamaForCausalLM(hf_config).to(getattr(torch, cfg.model.dtype))
    stages = split_model(model, cfg.mesh.stages, cfg.mesh.layers_per_stage or None)
    mb = cfg.train.batch_size // cfg.train.microbatches
    ids = torch.randint(0, hf_config.vocab_size, (mb, cfg.data.seq_len))
    F, B = [[] for _ in stages], [[] for _ in stages]
    for _ in range(reps + 1):  # the first round warms up allocators
        x = ids
        outs = []
        for s, st in enumerate(stages):
            inp = x if s == 0 else x.detach().requires_grad_()
            t0 = time.perf_counter()
            y = st(inp)
            F[s].append(time.perf_counter() - t0)
            outs.append((inp, y))
            x = y
        grad = None
        for s in reversed(range(len(stages))):
            inp, y = outs[s]
            t0 = time.perf_counter()
            if s == len(stages) - 1:
                y.float().logsumexp(-1).mean().backward()
            else:
                y.backward(grad)
            B[s].append(time.perf_counter() - t0)
            grad = inp.grad if s else None
    return {"F": [statistics.median(f[1:]) for f in F], "B": [statistics.median(b[1:]) for b in B]}


def measured_compute_jsonl(path: str, stages: int) -> dict:
    """Hook for a training run: per-stage fwd_s/bwd_s (seconds per micro-batch action) from
    the trainer's metrics.jsonl, median over steps after the first (as train.modeled_step)."""
    recs = [json.loads(ln) for ln in open(path) if ln.strip()]
    recs = [r for r in recs if "fwd_s" in r and "bwd_s" in r]
    if not recs:
        raise ValueError(f"{path}: no records with fwd_s/bwd_s")
    recs = recs[1:] or recs
    return {k: [statistics.median(r[key][s] for r in recs) for s in range(stages)]
            for k, key in (("F", "fwd_s"), ("B", "bwd_s"))}


def anchor_bytes(cfg, stages, dtype) -> tuple[list[float], list[float]]:
    """Per step (amortized over ``anchor.snapshot_every``), per stage: (up, down) anchor
    bytes of a fast node, as orchestration/anchor.py sends them (headers ignored).

    Up: replica 0 alone serves one snapshot of its stage's parameters per round: in
    ``dtype`` (``anchor.snapshot_codec=full``) or as an int8 delta with one fp32 scale per
    1024 values (``int8``, the default; the first snapshot of a link in full is not
    amortized here). Down: per round, every fast node receives the anchor's result for the
    parameters SpectralAdamW filters (2-D, not embedding / lm_head): dense = their
    gradients in ``dtype``; factored = (U, S, V) at rank r = ``train.spectral_rank``,
    r*(m+n+1) fp32 numbers per matrix. Assumes the anchor keeps up with one round per
    ``snapshot_every`` fast steps.
    """
    a, r = cfg.anchor, cfg.train.spectral_rank
    el = dtype.itemsize
    up, down = [], []
    for st in stages:
        named = list(st.named_parameters())
        numel = sum(p.numel() for _, p in named)
        snap = SnapshotCoder.delta_numel(numel) if a.snapshot_codec == "int8" else numel * el
        up.append(snap / a.snapshot_every)
        mats = [p.shape for n, p in named if p.dim() == 2 and "embed" not in n and "lm_head" not in n]
        if a.transport == "factored":
            d = sum(min(r, m, n) * (m + n + 1) * 4 for m, n in mats)
        else:
            d = sum(m * n for m, n in mats) * el
        down.append(d / a.snapshot_every)
    return up, down


def model_row(name: str, geom: str, cfg, hf_config, compute, link: LinkSpec, tflops_note: str):
    from orchestration.components.builders import make_compressor
    Y, X = cfg.mesh.stages, cfg.fast_rows
    dtype = getattr(torch, cfg.model.dtype)
    stages = meta_stages(hf_config, Y, cfg.mesh.layers_per_stage)
    shapes = stage_shapes(stages)
    mb = cfg.train.batch_size // cfg.train.microbatches
    shape = (mb, cfg.data.seq_len, hf_config.hidden_size)
    codec = codec_for(cfg.boundary)
    msg = {"F": codec.wire_bytes(shape, dtype, "fwd"), "B": codec.wire_bytes(shape, dtype, "bwd")}
    comp = make_compressor(cfg)
    dp_payload = [comp.payload_bytes_for(s, dtype) for s in shapes] if X > 1 else [0.0] * Y
    raw_payload = [sum(math.prod(x) for x in s) * dtype.itemsize for s in shapes]
    blocking = cfg.dp.mode == "allreduce"
    dp_every = 1.0 if blocking else float(cfg.dp.sync_every)
    up = down = 0.0
    if cfg.anchor.enabled:
        up, down = anchor_bytes(cfg, stages, dtype)
    m = model_step(make_schedule(cfg.train.schedule, Y, cfg.train.microbatches), compute, msg, link,
                   replicas=X, tokens_per_replica=cfg.train.batch_size * cfg.data.seq_len,
                   dp_payload_bytes=dp_payload, dp_blocking=blocking, dp_every=dp_every,
                   dp_fragments=cfg.dp.fragments, dp_overlap_steps=cfg.dp.overlap_steps,
                   anchor_up_bytes=up, anchor_down_bytes=down, anchor_up_nodes=1)
    return dict(row=name, geometry=geom, mesh=f"{cfg.mesh.rows}x{Y}" + (" (+anchor row)" if cfg.anchor.enabled else ""),
                codec=f"{cfg.boundary.codec}" + (f" p={cfg.boundary.p}" if cfg.boundary.codec == "mask" else ""),
                dp=f"{cfg.dp.mode}/{cfg.dp.compressor}" + ("" if blocking else
                                                            f" H={cfg.dp.sync_every} F={cfg.dp.fragments}"),
                dp_ratio=sum(raw_payload) / max(sum(dp_payload), 1) * dp_every,
                schedule=cfg.train.schedule, msg_bytes=msg, step_s=m.step_s, pipeline_s=m.pipeline_s, tokens_per_s=m.tokens_per_s,
                bytes_per_token=m.bytes_per_token, limiting=m.limiting, compute=compute, compute_source=tflops_note)


def fmt_k(x: float) -> str:
    return f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--geometry", choices=["small", "1b", "both"], default="both")
    ap.add_argument("--rows", default=",".join(ROWS), help="presets to model")
    ap.add_argument("--bandwidth-bps", type=float, default=200e6, help="every access link")
    ap.add_argument("--latency-s", type=float, default=0.0, help="one-way latency of every access link")
    ap.add_argument("--tflops", type=float, default=40.0, help="1b: effective TFLOP/s per node (analytic compute)")
    ap.add_argument("--compute-1b", default="", help="1b: measured seconds per micro-batch 'F0,F1:B0,B1' (hook)")
    ap.add_argument("--measured", default="", help="small: a training run's metrics.jsonl (compute-time hook)")
    ap.add_argument("--powersgd-rank-1b", type=int, default=16,
                    help="1b: PowerSGD rank (16: ~64x on the 2048-wide matrices, the paper's ~64x)")
    ap.add_argument("--schedule", choices=["", "1f1b", "gpipe"], default="",
                    help="pipeline schedule for every row (empty: the preset's, i.e. the trainer's default)")
    ap.add_argument("--no-codec-sweep", action="store_true",
                    help="1b: skip the table of every boundary codec in the m95 row's place")
    ap.add_argument("--json", default="", help="also write all figures here")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    link = LinkSpec(a.bandwidth_bps, a.latency_s)
    rows = [r.strip() for r in a.rows.split(",") if r.strip()]
    sched = ["--train.schedule", a.schedule] if a.schedule else []
    out = []
    if a.geometry in ("small", "both"):
        hf = small_config()
        base = preset_config("dense", [])
        if a.measured:
            compute, src = measured_compute_jsonl(a.measured, base.mesh.stages), f"measured: {a.measured}"
        else:
            compute, src = measured_compute_cpu(hf, base), "measured here (1 CPU thread, random init)"
        for r in rows:
            out.append(model_row(r, "small", preset_config(r, sched), hf, compute, link, src))
    if a.geometry in ("1b", "both"):
        hf = llama_1b_config()
        over = sched + ["--mesh.rows", "4", "--mesh.stages", "2", "--data.seq-len", "2048", "--train.batch-size", "32",
                "--train.microbatches", "8", "--model.dtype", "bfloat16", "--anchor.transport", "factored",
                "--anchor.snapshot-every", "20"]
        psgd = ["--dp.compressor-options", json.dumps({"rank": a.powersgd_rank_1b})]
        # compute times depend only on the geometry (same for every row): once
        cfg0 = preset_config("dense", over)
        if a.compute_1b:
            f, b = a.compute_1b.split(":")
            compute = {"F": [float(x) for x in f.split(",")], "B": [float(x) for x in b.split(",")]}
            src = "measured (--compute-1b)"
        else:
            mbt = cfg0.train.batch_size // cfg0.train.microbatches * cfg0.data.seq_len
            compute = analytic_compute(meta_stages(hf, cfg0.mesh.stages), hf, mbt, cfg0.data.seq_len, a.tflops)
            src = f"analytic at {a.tflops:g} TFLOP/s"
        for r in rows:
            cfg = preset_config(r, over + (psgd if r != "dense" else []))
            out.append(model_row(r, "1b", cfg, hf, compute, link, src))
        if not a.no_codec_sweep:  # the paper's boundary baselines, each in the m95 row's place
            for name in ("dense", "mask", "topk", "bottleneck", "int8", "int4"):
                cfg = preset_config("m95", over + psgd + ["--boundary.codec", name])
                out.append(dict(model_row(f"codec:{name}", "1b-codecs", cfg, hf, compute, link, src), codec_name=name))
    print(f"link model: every node an access link of {link.bandwidth_bps / 1e6:g} Mbit/s, latency {link.latency_s:g} s; "
          f"bytes/token = all bytes sent on all links / fast-replica tokens; schedule "
          f"{out[0]['schedule'] if out else '-'}")
    hdr = (f"{'':5} {'':7} {'':18} {'':11} {'':26}|{'bytes/token':^39}|\n"
           f"{'geom':5} {'row':7} {'mesh':18} {'codec':11} {'dp sync':26}|{'pp_fwd':>7} {'pp_bwd':>7} {'dp':>7} "
           f"{'anchor':>7} {'total':>7}|{'step s':>8} {'tok/s':>8}  limited by")
    for geom in ("small", "1b"):
        rs = [r for r in out if r["geometry"] == geom]
        if not rs:
            continue
        print(f"\n[{geom}] compute: {rs[0]['compute_source']}: F/B s per micro-batch per stage "
              f"{[round(x, 4) for x in rs[0]['compute']['F']]} / {[round(x, 4) for x in rs[0]['compute']['B']]}")
        print(hdr)
        for r in rs:
            b = r["bytes_per_token"]
            print(f"{geom:5} {r['row']:7} {r['mesh']:18} {r['codec']:11} {r['dp']:26}|{b['pp_fwd']:>7.0f} "
                  f"{b['pp_bwd']:>7.0f} {b['dp']:>7.1f} {b['anchor']:>7.1f} {b['total']:>7.0f}|{r['step_s']:>8.3f} "
                  f"{r['tokens_per_s']:>8.0f}  {r['limiting']}")
        by = {r["row"]: r for r in rs}
        if "dense" in by and "m95" in by:
            d, m = by["dense"], by["m95"]
            print(f"  dense -> m95: bytes/token {fmt_k(d['bytes_per_token']['total'])} -> "
                  f"{fmt_k(m['bytes_per_token']['total'])} "
                  f"(-{100 * (1 - m['bytes_per_token']['total'] / d['bytes_per_token']['total']):.1f}%), "
                  f"tokens/s {fmt_k(d['tokens_per_s'])} -> {fmt_k(m['tokens_per_s'])} "
                  f"({m['tokens_per_s'] / d['tokens_per_s']:.1f}x); PP bytes/token ratio "
                  f"{(d['bytes_per_token']['pp_fwd'] + d['bytes_per_token']['pp_bwd']) / (m['bytes_per_token']['pp_fwd'] + m['bytes_per_token']['pp_bwd']):.1f}x")
        if geom == "1b":
            print("  paper (Llama 3.2 1B, 200 Mbps): " + ", ".join(
                f"{k} {fmt_k(v[0])} B/tok {fmt_k(v[1])} tok/s" for k, v in PAPER.items() if k in by))
            print(f"  paper dense -> M95+AP: 22.9k -> 446 bytes/token (-98.1%), 1.1k -> 46.5k tokens/s (42x)")
            if "m95-ap" in by and "dense" in by:
                d, m = by["dense"], by["m95-ap"]
                print(f"  ours  dense -> m95-ap: {fmt_k(d['bytes_per_token']['total'])} -> "
                      f"{fmt_k(m['bytes_per_token']['total'])} bytes/token, {fmt_k(d['tokens_per_s'])} -> "
                      f"{fmt_k(m['tokens_per_s'])} tokens/s ({m['tokens_per_s'] / d['tokens_per_s']:.1f}x)")
            dpr = by.get("dp", by.get("m95"))
            if dpr:
                print(f"  DP compression vs per-step dense all-reduce: {dpr['dp_ratio']:.0f}x fewer DP bytes "
                      f"(PowerSGD rank {a.powersgd_rank_1b} x DiLoCo H={preset_config('dp', []).dp.sync_every})")
            tied = hf.vocab_size * hf.hidden_size * 2
            print(f"  not modeled: tied-embedding gradient sync (Llama-3.2-1B ties): {tied / 1e6:.0f} MB each way "
                  f"per replica per step = {link.wire_s(tied):.1f} s at this rate if done every step")
    sweep = [r for r in out if r["geometry"] == "1b-codecs"]
    if sweep:
        dense = next(r for r in sweep if r["codec_name"] == "dense")["bytes_per_token"]
        paper = {"mask": "20x/20x", "topk": "10x/10x", "bottleneck": "20x/20x", "int4": "4x/4x"}
        print("\n[1b] boundary codecs in the m95 row's place (p=0.95 where it applies; DiLoCo+PowerSGD DP):")
        print(f"{'codec':11} {'pp_fwd B/tok':>12} {'pp_bwd B/tok':>12} {'ratio fwd/bwd':>14} {'paper':>8} "
              f"{'step s':>7} {'tok/s':>8}")
        for r in sweep:
            b = r["bytes_per_token"]
            ratio = f"{dense['pp_fwd'] / b['pp_fwd']:.1f}x/{dense['pp_bwd'] / b['pp_bwd']:.1f}x"
            print(f"{r['codec_name']:11} {b['pp_fwd']:>12.0f} {b['pp_bwd']:>12.0f} {ratio:>14} "
                  f"{paper.get(r['codec_name'], ''):>8} {r['step_s']:>7.3f} {r['tokens_per_s']:>8.0f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return out


if __name__ == "__main__":
    main()
