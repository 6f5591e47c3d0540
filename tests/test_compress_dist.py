"""Compressors on 3 spawned gloo ranks, checked against single-process references.

One spawn (module fixture) runs every scenario of dp_helpers.compressor_worker; the
tests below recompute each expected result here from the same deterministic inputs.
PowerSGD's reference is torch's own DDP hook math, run with the hook's helpers.
"""
import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize, _should_compress

import dp_helpers as H
from meshkern.compress import PowerSGD, SparseLoCo
from meshkern.compress.base import ring_all_reduce_bytes

WORLD = 3
STEPS = 6


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("compress")
    codes = H.spawn(H.compressor_worker, WORLD, str(out), STEPS, timeout=300)
    assert codes == [0] * WORLD, f"rank exit codes {codes}"
    return [H.load(str(out / f"rank{r}.safetensors")) for r in range(WORLD)]


def hook_reference(rank_cfg: int, steps: int):
    """torch's powerSGD_hook math (batched same-shape matrices, warm start, error
    feedback) for WORLD simulated ranks, using the hook's own helpers. Returns the
    per-step outputs and the final per-rank errors of each shape group."""
    comp = PowerSGD(rank_cfg, seed=7)  # only for the shared initial Q
    shapes = H.SHAPES
    groups = {}
    for i, s in enumerate(shapes):
        if len(s) < 2:
            continue
        n, m = s[0], int(torch.Size(s[1:]).numel())
        r = min(n, m, rank_cfg)
        if _should_compress(n, m, r, 2.0)[0]:
            groups.setdefault((n, m, r), []).append(i)
    err = {g: [torch.zeros(len(ix), g[0], g[1]) for _ in range(WORLD)] for g, ix in groups.items()}
    qmem = {g: comp.initial_q("k", *g, len(ix)).float() for g, ix in groups.items()}
    outs = []
    for t in range(steps):
        xs = [H.inputs(w, t) for w in range(WORLD)]
        out = [None] * len(shapes)
        for i in range(len(shapes)):
            if not any(i in ix for ix in groups.values()):
                out[i] = sum(x[i] for x in xs) / WORLD
        for g, ix in groups.items():
            n, m, r = g
            mats = [torch.stack([xs[w][i].reshape(n, m) for i in ix]) + err[g][w] for w in range(WORLD)]
            q = qmem[g]
            _orthogonalize(q, 0)
            p = sum(torch.bmm(mw, q) for mw in mats)
            _orthogonalize(p, 0)
            q = sum(torch.bmm(mw.transpose(1, 2), p) for mw in mats) / WORLD
            qmem[g] = q
            mhat = torch.bmm(p, q.transpose(1, 2))
            err[g] = [mw - mhat for mw in mats]
            for b, i in enumerate(ix):
                out[i] = mhat[b].view(shapes[i])
        outs.append(out)
    return outs, err


@pytest.mark.slow
@pytest.mark.parametrize("name,rank_cfg", [("psgd", 4), ("psgd_gs", 2)])
def test_powersgd_matches_torch_hook_math(ranks, name, rank_cfg):
    outs, err = hook_reference(rank_cfg, STEPS)
    for t in range(STEPS):
        for i, exp in enumerate(outs[t]):
            for r in range(WORLD):
                got = ranks[r][f"{name}.out{t}.{i}"]
                torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-4,
                                           msg=lambda m: f"step {t} tensor {i} rank {r}: {m}")
    for (n, m, r_), e in err.items():
        for r in range(WORLD):
            torch.testing.assert_close(ranks[r][f"{name}.err.{n}x{m}x{r_}"], e[r], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_every_rank_gets_bitwise_identical_results(ranks):
    for key in ranks[0]:
        if ".out" in key:
            for r in range(1, WORLD):
                assert torch.equal(ranks[0][key], ranks[r][key]), key


@pytest.mark.slow
def test_powersgd_error_feedback_running_sum_tracks_inputs(ranks):
    """sum_t M_hat_t = sum_t mean_w G_w(t) - mean_w E_w(T) exactly, so the running sum
    of reconstructions tracks the running sum of inputs with a bounded gap."""
    compressed = [0, 1, 2]  # indices of the matrices PowerSGD compresses at rank 4
    rel = []
    for T in range(1, STEPS + 1):
        num = den = 0.0
        for i in compressed:
            target = sum(sum(H.inputs(w, t)[i] for w in range(WORLD)) / WORLD for t in range(T))
            got = sum(ranks[0][f"psgd.out{t}.{i}"] for t in range(T))
            num += float((got - target).norm() ** 2)
            den += float(target.norm() ** 2)
        rel.append((num / den) ** 0.5)
    assert rel[-1] < 0.5 * rel[0], rel
    # the exact identity with the final error state
    mean_err = sum(ranks[r]["psgd.err.48x40x4"] for r in range(WORLD)) / WORLD
    for b, i in enumerate([0, 1]):
        target = sum(sum(H.inputs(w, t)[i] for w in range(WORLD)) / WORLD for t in range(STEPS))
        got = sum(ranks[0][f"psgd.out{t}.{i}"] for t in range(STEPS))
        torch.testing.assert_close(got + mean_err[b], target, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_byte_counters_show_the_powersgd_ratio(ranks):
    n, m, r = 64, 48, 4
    none = torch.stack([ranks[w]["bytes_none.counters"] for w in range(WORLD)])
    psgd = torch.stack([ranks[w]["bytes_psgd.counters"] for w in range(WORLD)])
    assert int(none[0, 2]) == n * m * 4 and int(psgd[0, 2]) == (n + m) * r * 4
    # ring all-reduce: all ranks together send and receive 2*(world-1) payloads
    for c, payload in ((none, n * m * 4), (psgd, (n + m) * r * 4)):
        assert int(c[:, 0].sum()) == int(c[:, 1].sum()) == 2 * (WORLD - 1) * payload
    assert float(none[:, 0].sum()) / float(psgd[:, 0].sum()) == pytest.approx(n * m / ((n + m) * r), rel=1e-12)


@pytest.mark.slow
def test_sparseloco_all_gather_average_matches_per_rank_encoding(ranks):
    comps = [SparseLoCo(1 / 16, chunk=64) for _ in range(WORLD)]
    for t in range(STEPS):
        xs = [H.inputs(w, t) for w in range(WORLD)]
        dense = []
        for w in range(WORLD):
            x, n = H_chunks(xs[w], 64)
            _, idx, v_hat, _ = comps[w].encode(x, "k")
            comps[w]._state["k"].view(-1)[n:] = 0
            dense.append(torch.zeros_like(x).scatter_add_(1, idx, v_hat).view(-1)[:n])
        mean = sum(dense) / WORLD
        flat = torch.cat([ranks[0][f"sparse.out{t}.{i}"].reshape(-1) for i in range(len(H.SHAPES))])
        torch.testing.assert_close(flat, mean, rtol=1e-6, atol=1e-6)
    c = ranks[0]["sparse.counters"]
    numel = sum(int(torch.Size(s).numel()) for s in H.SHAPES)
    nc = -(-numel // 64)
    msg = (nc * 4 * 6 + 7) // 8 + (nc * 4 * 2 + 7) // 8 + nc * 8  # k=4, 6-bit idx, 2-bit codes, 2 fp32 scales
    assert int(c[2]) == STEPS * msg and int(c[0]) == int(c[1]) == STEPS * (WORLD - 1) * msg


def H_chunks(tensors, chunk):
    from meshkern.compress.packing import to_chunks
    return to_chunks(tensors, chunk)


@pytest.mark.slow
def test_int8_average_close_and_counted(ranks):
    for t in range(STEPS):
        xs = [H.inputs(w, t) for w in range(WORLD)]
        for i in range(len(H.SHAPES)):
            exact = sum(x[i] for x in xs) / WORLD
            got = ranks[0][f"int8.out{t}.{i}"]
            # absmax int8: error per value <= max|x| / 254 per rank (+ carried error)
            assert float((got - exact).abs().max()) < 0.05 * float(exact.abs().max()) + 0.05
    numel = sum(int(torch.Size(s).numel()) for s in H.SHAPES)
    nc = -(-numel // 64)
    c = ranks[0]["int8.counters"]
    assert int(c[2]) == STEPS * (nc * 64 + nc * 4)


def test_ring_byte_model_small_cases():
    # world 2: each rank sends and receives exactly the payload
    assert ring_all_reduce_bytes(10, 4, 2, 0) == (40, 40)
    # world 3, 10 elements -> chunks 4,3,3; rank 0 skips chunks 1,2 when sending
    assert ring_all_reduce_bytes(10, 1, 3, 0) == (20 - 3 - 3, 20 - 4 - 3)
    assert ring_all_reduce_bytes(10, 1, 1, 0) == (0, 0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["poison_psgd", "poison_sparse", "poison_int8", "poison_none"])
def test_one_rank_nonfinite_input_is_skipped_everywhere_and_never_poisons_the_state(ranks, name):
    """Rank 1 feeds an Inf on call 0: every rank returns all-NaN for that call (so callers
    skip it alike), and calls 1-2 are bit-identical to a compressor that never saw call 0:
    the error feedback / warm start were left untouched."""
    for w in range(WORLD):
        r = ranks[w]
        assert bool(r[f"{name}.nan0"]) and bool(r[f"{name}.same1"]) and bool(r[f"{name}.same2"])
        assert r[f"{name}.skipped"].tolist() == [1, 0]
