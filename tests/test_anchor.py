"""The slow anchor circuit (orchestration.anchor) on spawned gloo meshes with a tiny Llama:
the anchor gradient is the unsplit model's dense gradient at the snapshot, factored and
dense transport give the same filter, stalls / NaN / wrong shapes / a killed anchor
never stop or corrupt the fast circuit. Plus the wire layout checks in-process."""
import glob
import math
import os
import sysconfig

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from orchestration import anchor as A
from orchestration import checkpoint as ckpt
from orchestration.config import parse_args
from orchestration.launch import run_local
from orchestration.mesh import MeshLayout
from orchestration.metrics import read_jsonl
from orchestration.train import prepare, run_rank


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama (H=40, 4 layers, GQA, untied) + offline BPE tokenizer, and local text."""
    from orchestration.data import train_bpe

    root = tmp_path_factory.mktemp("anchor_tiny")
    src = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")))
    text = "\n".join(open(f).read() for f in src)[:120_000]
    (root / "data.txt").write_text(text)
    tok = train_bpe([text], vocab_size=300)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=40, intermediate_size=64,
                                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=64, tie_word_embeddings=False))
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    return root


def _argv(tiny, tmp_path, name, *extra):
    return ["--preset", "m95-ap", "--model", str(tiny / "model"), "--data", str(tiny / "data.txt"),
            "--data.seq_len", "32", "--data.max_sequences", "200", "--train.batch_size", "4",
            "--train.microbatches", "2", "--anchor.microbatches", "2", "--train.spectral_rank", "8",
            "--run.out_dir", str(tmp_path), "--run.name", name, "--run.progress", "false",
            "--run.eval_sequences", "0", "--mesh.timeout_s", "30", "--mesh.rows", "2", "--mesh.stages", "2",
            "--dp.mode", "none", *extra]


def _spy_rank(rank, world, cfg, plan, outdir):
    """run_rank, recording every update a fast rank applies (fork: the patch stays in this rank)."""
    orig = A.FastHook._applied

    def spy(self, x, entries, staleness):
        flat = [list(e) if isinstance(e, tuple) else [e] for e in entries]
        torch.save({"round": x.round, "version": x.version, "staleness": staleness, "names": list(self.layout.names),
                    "entries": [[t.clone() for t in e] for e in flat]},
                   os.path.join(outdir, f"r{rank}_k{x.round}.pt"))
        return orig(self, x, entries, staleness)

    A.FastHook._applied = spy
    return run_rank(rank, world, cfg, plan)


def _run(argv, outdir=None, timeout_s=150):
    cfg, _ = parse_args(argv)
    plan = prepare(cfg)
    lay = MeshLayout(cfg.mesh.rows, cfg.mesh.stages, True)
    anchors = {r for r in range(lay.world_size) if lay.is_anchor(r)}
    fn, args = (run_rank, (cfg, plan)) if outdir is None else (_spy_rank, (cfg, plan, str(outdir)))
    res = run_local(fn, cfg.world_size, args, timeout_s=timeout_s, describe=lay.describe, optional=anchors)
    recs = read_jsonl(os.path.join(plan.run_dir, "metrics.jsonl"))
    return cfg, plan, res, recs


# ------------------------------------------------------------------ in-process: the wire
def _named(shapes):
    return [(f"w{i}", torch.nn.Parameter(torch.randn(s))) for i, s in enumerate(shapes)]


def test_layout_sizes_and_round_trip():
    named = _named([(6, 4), (3, 5), (8, 2)])
    dense = A.Layout.build(named, "dense", 3, torch.float32)
    fact = A.Layout.build(named, "factored", 3, torch.float32)
    assert dense.numel == 6 * 4 + 3 * 5 + 8 * 2
    assert fact.numel == sum(min(3, m, n) * (m + n + 1) for m, n in [(6, 4), (3, 5), (8, 2)])
    grads = [torch.randn(p.shape) for _, p in named]
    out = dense.decode(dense.encode(grads))
    for g, o in zip(grads, out):
        torch.testing.assert_close(o, g, rtol=0, atol=0)
    from meshkern.optim import AnchorMomentum

    mom = AnchorMomentum([p for _, p in named], 0.9, 3)
    facs = fact.decode(fact.encode(grads, mom))
    for (U, S, V), (U2, S2, V2) in zip(facs, AnchorMomentum.factors(mom)):
        torch.testing.assert_close(U, U2)
        torch.testing.assert_close(S, S2)
        torch.testing.assert_close(V, V2)
    dense.check_header(dense.grad_header(0, 0))
    fact.check_header(fact.grad_header(0, 0))


@pytest.mark.parametrize("tamper, reason", [
    (lambda h: h.__setitem__(A.F_NUMEL, h[A.F_NUMEL] + 1), "shape"),
    (lambda h: h.__setitem__(A.F_LAYOUT, h[A.F_LAYOUT] ^ 1), "shape"),
    (lambda h: h.__setitem__(A.F_DTYPE, 1), "shape"),
    (lambda h: h.__setitem__(A.F_TRANSPORT, 1), "shape"),
    (lambda h: h.__setitem__(A.F_MAGIC, 7), "protocol"),
    (lambda h: h.__setitem__(A.F_KIND, A.SNAP), "protocol"),
])
def test_bad_headers_are_rejected(tamper, reason):
    lay = A.Layout.build(_named([(6, 4), (3, 5)]), "dense", 3, torch.float32)
    h = lay.grad_header(1, 2)
    tamper(h)
    with pytest.raises(A.Rejected) as e:
        lay.check_header(h)
    assert e.value.reason == reason


def test_bad_payloads_are_rejected():
    named = _named([(6, 4), (3, 5)])
    lay = A.Layout.build(named, "dense", 3, torch.float32)
    good = lay.encode([torch.randn(p.shape) for _, p in named])
    for bad, reason in [(good[:-1], "shape"), (good.double(), "shape"),
                        (good.clone().index_fill_(0, torch.tensor([5]), float("nan")), "nonfinite"),
                        (good.clone().index_fill_(0, torch.tensor([0]), float("inf")), "nonfinite")]:
        with pytest.raises(A.Rejected) as e:
            lay.decode(bad)
        assert e.value.reason == reason
    fact = A.Layout.build(named, "factored", 3, torch.float32)
    p = torch.rand(fact.numel)
    p[6 * 3] = -1.0  # first S entry of the first matrix (after U[6, 3])
    with pytest.raises(A.Rejected, match="negative"):
        fact.decode(p)


def test_layout_hash_depends_on_shapes_and_order():
    assert A.layout_hash([(4, 6), (3,)]) == A.layout_hash([(4, 6), (3,)])
    assert A.layout_hash([(4, 6), (3,)]) != A.layout_hash([(6, 4), (3,)])
    assert A.layout_hash([(4, 6), (3,)]) != A.layout_hash([(3,), (4, 6)])
    assert A.layout_hash([(4, 6)]) != A.layout_hash([(4,), (6,)])


def test_fault_spec_and_config_checks():
    assert A.parse_faults("nan:1, stall:3=2.5,die:4") == {"nan": {1: 0.0}, "stall": {3: 2.5}, "die": {4: 0.0}}
    with pytest.raises(ValueError, match="bad item"):
        A.parse_faults("boom:1")
    cfg, _ = parse_args(["--preset", "m95-ap"])
    A.check_config(cfg)
    cfg.train.optimizer = "adamw"
    with pytest.raises(ValueError, match="--train.optimizer spectral"):
        A.check_config(cfg)
    cfg, _ = parse_args(["--preset", "m95-ap", "--anchor.delay", "60"])
    with pytest.raises(ValueError, match="exceeds --anchor.max_staleness"):
        A.check_config(cfg)
