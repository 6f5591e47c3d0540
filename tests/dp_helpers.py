"""Helpers for the data-parallel tests: spawn gloo ranks on 127.0.0.1 with a hard
timeout, and the rank-side bodies of the compressor tests.

Ranks report results through safetensors files in a temporary directory (read back
with safetensors, never pickled). Each spawned process uses one thread and
OMP_WAIT_POLICY=PASSIVE (inherited from tests/conftest.py's environment).
"""
from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, world: int, *args, timeout: float = 150.0) -> list[int]:
    """Run ``fn(rank, world, port, *args)`` in ``world`` spawned processes; return
    their exit codes. Processes still running after ``timeout`` seconds are killed and
    a TimeoutError is raised, so a hung collective cannot hang the test suite."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=fn, args=(rank, world, port, *args), daemon=True) for rank in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join(5)
    if hung:
        raise TimeoutError(f"{len(hung)} of {world} ranks still running after {timeout} s")
    return [p.exitcode for p in procs]


def init(rank: int, world: int, port: int, timeout_s: float = 60.0) -> None:
    """One thread, gloo process group over TCP on 127.0.0.1."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def shutdown() -> None:
    """Leave the group together: rank 0 holds the tcp:// store, and a rank 0 that destroys
    its group and exits while a peer is still finishing its last collective aborted under
    load ('terminate called without an active exception', exit -6; 1 run in 8 of
    test_h1_f1 with two busy processes beside it)."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def save(path: str, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, path)


def load(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


# ---- deterministic inputs shared by the rank side and the reference side -------------------
SHAPES = [(48, 40), (48, 40), (32, 24), (16,), (3, 5, 6)]


def inputs(rank: int, step: int, shapes=SHAPES) -> list[torch.Tensor]:
    """Rank ``rank``'s tensors at ``step``: a low-rank signal shared by all ranks and
    steps (fine-tuning's slowly drifting gradient subspace) plus per-rank, per-step
    full-rank noise, so compression has structure to find."""
    g = torch.Generator().manual_seed(17)
    gr = torch.Generator().manual_seed(1000 * step + rank)
    out = []
    for s in shapes:
        if len(s) >= 2:
            n, m = s[0], int(torch.Size(s[1:]).numel())
            signal = torch.randn(n, 2, generator=g) @ torch.randn(2, m, generator=g)
            out.append((signal + 0.3 * torch.randn(n, m, generator=gr)).view(s))
        else:
            out.append(torch.randn(s, generator=gr))
    return out


# ---- rank side of tests/test_compress*.py ---------------------------------------------------
def compressor_worker(rank: int, world: int, port: int, outdir: str, steps: int) -> None:
    """Runs every compressor scenario; writes {outdir}/rank{rank}.safetensors."""
    from meshkern.compress import Int8, NoCompression, PowerSGD, SparseLoCo

    init(rank, world, port)
    res: dict[str, torch.Tensor] = {}

    def counters(name, c):
        res[f"{name}.counters"] = torch.tensor([c.bytes_sent, c.bytes_received, c.payload_bytes], dtype=torch.int64)

    for name, comp in [("psgd", PowerSGD(4, seed=7)), ("psgd_gs", PowerSGD(2, seed=7)),
                       ("sparse", SparseLoCo(1 / 16, chunk=64)), ("int8", Int8(chunk=64))]:
        for t in range(steps):
            for i, o in enumerate(comp.all_reduce_mean(inputs(rank, t), None, key="k")):
                res[f"{name}.out{t}.{i}"] = o
        for gk, st in (comp._state.get("k", {}).items() if name.startswith("psgd") else []):
            res[f"{name}.err.{gk}"] = st["err"]
        counters(name, comp)

    # One rank's input holds an Inf on call 0 only: every rank gets all-NaN for that call,
    # then exactly what a compressor that never saw call 0 returns (state untouched).
    for name, make in [("poison_psgd", lambda: PowerSGD(4, seed=7)), ("poison_sparse", lambda: SparseLoCo(1 / 16, chunk=64)),
                       ("poison_int8", lambda: Int8(chunk=64)), ("poison_none", NoCompression)]:
        hit, clean = make(), make()
        for t in range(3):
            x = inputs(rank, t)
            if t == 0 and rank == 1:
                x[0] = x[0].clone()
                x[0][3, 5] = float("inf")
            got = hit.all_reduce_mean(x, None, key="k")
            want = clean.all_reduce_mean(x, None, key="k") if t > 0 else None
            res[f"{name}.nan0"] = torch.tensor([all(bool(o.isnan().all()) for o in got)]) if t == 0 else res[f"{name}.nan0"]
            if t > 0:
                res[f"{name}.same{t}"] = torch.tensor([all(torch.equal(a, b) for a, b in zip(got, want))])
        res[f"{name}.skipped"] = torch.tensor([hit.skipped, clean.skipped])

    one = [inputs(rank, 0, [(64, 48)])[0]]
    for name, comp in [("bytes_none", NoCompression()), ("bytes_psgd", PowerSGD(4))]:
        comp.all_reduce_mean(one, None)
        counters(name, comp)
    save(os.path.join(outdir, f"rank{rank}.safetensors"), res)
    shutdown()


# ---- rank side of tests/test_diloco*.py ------------------------------------------------------
def tiny_mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def mlp_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + 100 * step + rank)
    x = torch.randn(16, 8, generator=g)
    return x, torch.sin(x[:, :4]) + 0.1 * torch.randn(16, 4, generator=g)


def diloco_equiv_worker(rank: int, world: int, port: int, outdir: str, steps: int) -> None:
    """H=1, F=1, no overlap, no compression: AdamW inner steps + DiLoCo."""
    from meshkern.compress import NoCompression
    from meshkern.diloco import StreamingDiLoCo

    init(rank, world, port)
    model = tiny_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dl = StreamingDiLoCo(model.named_parameters(), None, sync_every=1, num_fragments=1, overlap_steps=0,
                         compressor=NoCompression())
    for t in range(steps):
        x, y = mlp_batch(rank, t)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        dl.step()
    res = {k: v for k, v in model.state_dict().items()}
    res["counters"] = torch.tensor([dl.bytes_sent, dl.bytes_received, dl.syncs_done])
    save(os.path.join(outdir, f"rank{rank}.safetensors"), res)
    shutdown()


def llama_lm(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=128, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def markov_batch(seed: int, batch: int = 8, seq: int = 32) -> torch.Tensor:
    """Sequences of a fixed sparse Markov chain over 128 tokens (each token has 4
    possible successors): learnable structure with a known entropy floor of ln 4."""
    table = torch.randint(0, 128, (128, 4), generator=torch.Generator().manual_seed(123))
    g = torch.Generator().manual_seed(seed)
    toks = torch.empty(batch, seq, dtype=torch.long)
    toks[:, 0] = torch.randint(0, 128, (batch,), generator=g)
    choice = torch.randint(0, 4, (batch, seq), generator=g)
    for i in range(1, seq):
        toks[:, i] = table[toks[:, i - 1], choice[:, i]]
    return toks


def llama_worker(rank: int, world: int, port: int, outdir: str, steps: int, diloco_kw: dict) -> None:
    """Trains the tiny Llama twice on the same per-rank data: synchronous DP (gradient
    all-reduce every step) and Streaming DiLoCo with PowerSGD; records eval losses."""
    import torch.distributed as dist

    from meshkern.compress import NoCompression, PowerSGD
    from meshkern.diloco import StreamingDiLoCo

    init(rank, world, port)
    evals = [markov_batch(50_000 + i) for i in range(4)]

    def eval_loss(model):
        with torch.no_grad():
            return sum(float(model(input_ids=b, labels=b).loss) for b in evals) / len(evals)

    res = {}
    for mode in ("sync", "diloco"):
        model = llama_lm()
        if mode == "sync":
            res["initial"] = torch.tensor(eval_loss(model))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        dl = None
        if mode == "diloco":
            kw = dict(diloco_kw)
            r = kw.pop("rank", 4)
            dl = StreamingDiLoCo(model.named_parameters(), None, compressor=PowerSGD(r) if r else NoCompression(),
                                 **kw)
        for t in range(steps):
            b = markov_batch(1000 * t + rank)
            model(input_ids=b, labels=b).loss.backward()
            if mode == "sync":
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad.div_(world)
            opt.step()
            opt.zero_grad()
            if dl is not None:
                dl.step()
        if dl is not None:
            dl.finish()
            res["bytes"] = torch.tensor([dl.bytes_sent, dl.bytes_received, dl.syncs_done])
            res["dense_bytes"] = torch.tensor(4 * sum(p.numel() for p in model.parameters()))
        res[mode] = torch.tensor(eval_loss(model))
        # replicas must agree after the final merge only up to the mix; record spread
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        res[f"{mode}.params"] = flat
    save(os.path.join(outdir, f"rank{rank}.safetensors"), res)
    shutdown()


def dying_peer_worker(rank: int, world: int, port: int, outdir: str, how: str) -> None:
    """Rank 1 dies (or hangs) between PowerSGD's P and Q all-reduces of a sync; rank 0
    must raise SyncError within the timeout and keep its parameters unmerged."""
    import time as _time

    from meshkern.compress import PowerSGD, SyncError
    from meshkern.diloco import StreamingDiLoCo

    class FailingPowerSGD(PowerSGD):
        def _all_reduce(self, flat, group, what):
            out = super()._all_reduce(flat, group, what)
            if self.calls >= 5 and rank == 1:  # 5th sync = fragment 0's, started at step 5
                if how == "die":
                    os._exit(7)
                # hang until rank 0 has reported (it must time out on its own: 10 s)
                deadline = _time.monotonic() + 60
                while not os.path.exists(os.path.join(outdir, "rank0.safetensors")) and _time.monotonic() < deadline:
                    _time.sleep(0.1)
                os._exit(0)
            return out

    init(rank, world, port, timeout_s=120)  # gloo's own timeout must not be what fires
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    comp = FailingPowerSGD(2, min_compression_rate=0.0, timeout_s=10.0)
    dl = StreamingDiLoCo(model.named_parameters(), None, sync_every=2, num_fragments=2, overlap_steps=1,
                         compressor=comp, timeout_s=10.0)
    res = {}
    for t in range(6):
        x, y = mlp_batch(rank, t)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if rank == 0 and t == 4:
            t0 = _time.monotonic()
            try:
                dl.step()  # starts the sync of step 5 in the background; merges nothing
                x, y = mlp_batch(rank, t + 1)
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                before = {k: v.clone() for k, v in model.state_dict().items()}
                dl.step()  # step 6: the sync is due -> must raise
                res["raised"] = torch.tensor(0)
            except SyncError as e:
                res["raised"] = torch.tensor(1)
                res["elapsed"] = torch.tensor(_time.monotonic() - t0)
                with open(os.path.join(outdir, "error.txt"), "w") as f:
                    f.write(str(e))
            for k, v in model.state_dict().items():
                res[f"same.{k}"] = torch.tensor(int(torch.equal(v, before[k])))
            try:
                dl.step()
                res["usable_after"] = torch.tensor(1)
            except SyncError:
                res["usable_after"] = torch.tensor(0)
            save(os.path.join(outdir, "rank0.safetensors"), res)
            os._exit(0)
        dl.step()
    os._exit(0)


@contextlib.contextmanager
def world1_group(store_dir: str):
    """A 1-rank gloo group in this process (FileStore in ``store_dir``, no port); left
    alone if a default group already exists."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        store = dist.FileStore(os.path.join(store_dir, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()
