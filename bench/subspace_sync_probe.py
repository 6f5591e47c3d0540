"""Streaming DiLoCo + SparseLoCo with subspace-constrained output projections: which
``projection`` keeps the constraint, and what each costs in loss (issue #16, item 3).

    python -m bench.subspace_sync_probe --steps 200 --density 0.0625   # ~7 min on 2 CPU cores
    (also --density 0.015625, and --no-merge-reproject; results: docs/subspace_sync.md)

Toy task: a tiny Llama (H=64, 4 layers, vocab 128) on a sparse Markov chain (entropy
floor ln 4 = 1.386), 3 replicas (gloo ranks), one subspace-projected stage boundary
after layer 2 as in Protocol Models: h <- E[ids] + U U^T (h - E[ids]) with the token
embedding E frozen and U [64, 16] a seeded random orthonormal basis. Every o_proj /
down_proj weight starts in span(U); the inner AdamW step is followed by W <- U U^T W
(the trainer's job), so every replica's pseudo-gradient is in the subspace and only the
outer step can break the constraint. DiLoCo: H=8, 2 fragments, overlap 1 (mix 0.5),
SparseLoCo (--density, default 1/16) with chunk 256, outer lr 0.7, no outer momentum
(SparseLoCo's default). After every merge the local weights are measured (max relative
norm of W - U U^T W over the constrained weights) and then re-projected, as the trainer
does (unless --no-merge-reproject), so the training that follows is the same constrained
model in every row; what differs is the update DiLoCo applies and what SparseLoCo spends
its top-k budget on ("share": the fraction of the synced update's energy, constrained
weights, that lies in the subspace).

Rows: each projection, plus two references: "dense" (NoCompression: the average of
subspace deltas is in the subspace, nothing to fix) and "free" (SparseLoCo, no
constraint, no boundary codec: the loss of an unconstrained model). Final loss: eval
loss on 8 held-out batches of the final (re-projected) model on rank 0, mean and std over
3 seeds (model init, U and data all change with the seed), and paired against "none".
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import socket
import tempfile
import time

import torch

H_DIM, K_DIM, VOCAB, LAYERS, BOUNDARY = 64, 16, 128, 4, 2
CONSTRAINED = ("o_proj.weight", "down_proj.weight")
PROJECTIONS = ["none", "outer", "error", "reproject", "outer+error", "error+reproject", "outer+error+reproject"]
REFERENCES = ["dense", "free"]


def markov_batch(seed: int, batch: int = 8, seq: int = 32) -> torch.Tensor:
    table = torch.randint(0, VOCAB, (VOCAB, 4), generator=torch.Generator().manual_seed(123))
    g = torch.Generator().manual_seed(seed)
    toks = torch.empty(batch, seq, dtype=torch.long)
    toks[:, 0] = torch.randint(0, VOCAB, (batch,), generator=g)
    choice = torch.randint(0, 4, (batch, seq), generator=g)
    for i in range(1, seq):
        toks[:, i] = table[toks[:, i - 1], choice[:, i]]
    return toks


def build(seed: int, constrained: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=H_DIM, intermediate_size=2 * H_DIM, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    q, _ = torch.linalg.qr(torch.randn(H_DIM, K_DIM, generator=torch.Generator().manual_seed(7000 + seed),
                                       dtype=torch.float64))
    U = q.float()

    def projector(name, t):
        return U @ (U.T @ t) if name.endswith(CONSTRAINED) else t

    if constrained:
        E = model.get_input_embeddings().weight
        E.requires_grad_(False)
        ids_box = {}

        def boundary(_mod, _inp, out):  # the stage boundary: only U^T (h - E[ids]) would travel
            h = out[0] if isinstance(out, tuple) else out
            base = E[ids_box["ids"]]
            h = base + (h - base) @ U @ U.T
            return (h,) + tuple(out[1:]) if isinstance(out, tuple) else h

        model.model.layers[BOUNDARY - 1].register_forward_hook(boundary)
        model.model.register_forward_pre_hook(lambda _m, args, kw: ids_box.update(ids=kw["input_ids"]),
                                              with_kwargs=True)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(projector(n, p))
    return model, U, projector


def violation(model, U) -> float:
    worst = 0.0
    for n, p in model.named_parameters():
        if n.endswith(CONSTRAINED):
            W = p.detach().double()
            Ud = U.double()
            worst = max(worst, float((W - Ud @ (Ud.T @ W)).norm() / W.norm()))
    return worst


def worker(rank: int, world: int, port: int, outdir: str, seeds: list[int], rows: list[str], steps: int,
           density: float, merge_reproject: bool) -> None:
    import torch.distributed as dist

    from meshkern.compress import NoCompression, SparseLoCo
    from meshkern.diloco import StreamingDiLoCo

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    evals = [markov_batch(900_000 + i) for i in range(8)]
    lines = []
    for seed in seeds:
        for row in rows:
            t0 = time.perf_counter()
            constrained = row != "free"
            model, U, projector = build(seed, constrained)
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
            comp = NoCompression() if row == "dense" else SparseLoCo(density, chunk=256)
            proj = row if row in PROJECTIONS else "none"
            dl = StreamingDiLoCo(list(model.named_parameters()), None, sync_every=8, num_fragments=2,
                                 overlap_steps=1, compressor=comp, projector=projector if constrained else None,
                                 projection=proj)
            worst, share = 0.0, [0.0, 0.0]
            reduce = comp.all_reduce_mean

            def recording(tensors, group=None, *, key="default"):  # in-subspace share of the synced update
                out = reduce(tensors, group, key=key)
                for i, a in zip(dl.fragments[int(key[len("fragment"):])], out):
                    if constrained and dl.names[i].endswith(CONSTRAINED) and bool(torch.isfinite(a).all()):
                        share[0] += float(projector(dl.names[i], a).norm() ** 2)
                        share[1] += float(a.norm() ** 2)
                return out

            comp.all_reduce_mean = recording

            def after_merge(n_hist):
                nonlocal worst
                if constrained and len(dl.history) > n_hist:
                    worst = max(worst, violation(model, U))
                    if merge_reproject:  # the trainer re-projects after every update, the outer step's too
                        with torch.no_grad():
                            for n, p in model.named_parameters():
                                p.copy_(projector(n, p))

            for t in range(steps):
                b = markov_batch(10_000_000 * seed + 1000 * t + rank)
                model(input_ids=b, labels=b).loss.backward()
                opt.step()
                opt.zero_grad()
                if constrained:
                    with torch.no_grad():
                        for n, p in model.named_parameters():
                            p.copy_(projector(n, p))
                n_hist = len(dl.history)
                dl.step()
                after_merge(n_hist)
            n_hist = len(dl.history)
            dl.finish()
            after_merge(n_hist)
            gviol = 0.0
            if constrained:
                for n, g in zip(dl.names, dl._global):
                    if n.endswith(CONSTRAINED):
                        gd, Ud = g.double(), U.double()
                        gviol = max(gviol, float((gd - Ud @ (Ud.T @ gd)).norm() / gd.norm()))
            with torch.no_grad():
                loss = sum(float(model(input_ids=b, labels=b).loss) for b in evals) / len(evals)
            lines.append(f"{seed}\t{row}\t{loss:.6f}\t{worst:.3e}\t{gviol:.3e}\t"
                         f"{share[0] / max(share[1], 1e-30):.4f}\t{dl.bytes_sent}\t{time.perf_counter() - t0:.1f}")
            if rank == 0:
                print(lines[-1], flush=True)
    if rank == 0:
        with open(os.path.join(outdir, "rows.tsv"), "w") as f:
            f.write("\n".join(lines) + "\n")
    dist.destroy_process_group()


def main(argv=None) -> None:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rows", nargs="+", default=PROJECTIONS + REFERENCES)
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--density", type=float, default=1 / 16, help="SparseLoCo density (chunk 256)")
    ap.add_argument("--no-merge-reproject", action="store_true",
                    help="do not re-project the weights after a merge (only after inner steps): the first "
                         "forward after a merge then runs on what DiLoCo wrote")
    a = ap.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    outdir = tempfile.mkdtemp(prefix="subspace_sync_")
    print(f"# density {a.density:g}, {a.steps} steps, {a.world} replicas, re-projection after a merge: "
          f"{not a.no_merge_reproject}", flush=True)
    print("# seed\trow\teval_loss\tmax_viol_after_merge\tfinal_global_viol\tsubspace_share\tbytes_sent\tseconds",
          flush=True)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, a.world, port, outdir, a.seeds, a.rows, a.steps, a.density,
                                                     not a.no_merge_reproject))
             for r in range(a.world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    by_row: dict[str, dict[int, tuple[float, ...]]] = {}
    for line in open(os.path.join(outdir, "rows.tsv")):
        seed, row, loss, viol, gviol, share, _, _ = line.rstrip("\n").split("\t")
        by_row.setdefault(row, {})[int(seed)] = (float(loss), float(viol), float(gviol), float(share))

    def mean_sd(xs):
        m = sum(xs) / len(xs)
        return m, math.sqrt(sum((x - m) ** 2 for x in xs) / max(1, len(xs) - 1))

    base = "none" if "none" in by_row else None
    print(f"\n| row | final eval loss (mean +/- std, {len(a.seeds)} seeds) | paired vs {base} | "
          "max violation after a merge | final global-copy violation | in-subspace share of the synced update |")
    print("|---|---|---|---|---|---|")
    for row in a.rows:
        v = list(by_row[row].values())
        m, sd = mean_sd([x[0] for x in v])
        paired = "-"
        if base is not None:
            dm, dsd = mean_sd([by_row[row][s][0] - by_row[base][s][0] for s in by_row[row]])
            paired = f"{dm:+.4f} +/- {dsd:.4f}"
        shares = [x[3] for x in v]
        share = f"{sum(shares) / len(shares):.3f}" if row != "free" else "-"
        print(f"| {row} | {m:.4f} +/- {sd:.4f} | {paired} | {max(x[1] for x in v):.1e} | "
              f"{max(x[2] for x in v):.1e} | {share} |")


if __name__ == "__main__":
    main()
