"""The aqsgd boundary codec (AQ-SGD: delta quantization against per-sample stores) and the
low-bit helpers it shares with tahquant, against pure-Python / pure-torch references."""
import math

import pytest
import torch

from meshkern.mask import MaskKey
from orchestration.codecs import AQSGDCodec, apply_codec, make_codec, parse_spec
from orchestration.codecs.lowbit import pack_bits, packed_bytes, unpack_bits

torch.set_num_threads(1)
B, T, H = 3, 5, 24


def _key(step, mb=0, boundary=0):
    return MaskKey(seed=1, boundary=boundary, step=step, microbatch=mb)


def _ref_pack(values, bits):
    """The wire layout spelled out with Python ints: value j at stream bits j*bits.., LSB
    first; stream bit i is bit i % 8 of byte i // 8."""
    stream = 0
    for j, v in enumerate(values):
        stream |= int(v) << (j * bits)
    return [(stream >> (8 * i)) & 0xFF for i in range(packed_bytes(len(values), bits))]


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("n", [1, 7, 16, 21])
def test_pack_bits_matches_the_python_reference_and_round_trips(bits, n):
    g = torch.Generator().manual_seed(bits * 100 + n)
    codes = torch.randint(0, 2 ** bits, (2, n), generator=g)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (2, math.ceil(n * bits / 8))
    for r in range(2):
        assert packed[r].tolist() == _ref_pack(codes[r].tolist(), bits)
    assert torch.equal(unpack_bits(packed, bits, n), codes.to(torch.int32))


def _ref_quant(x, bits):
    """Per-token symmetric absmax quantization, dequantized (float64 reference)."""
    qmax = 2 ** (bits - 1) - 1
    x = x.double()
    scale = x.abs().amax(-1, keepdim=True) / qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(x / scale).clamp(-qmax, qmax) * scale, scale


class RefAQSGD:
    """AQ-SGD's forward as the paper states it, one dict per side: m starts at 0,
    m <- m + Q(h - m), the receiver's activation is m."""

    def __init__(self, bits):
        self.bits, self.m = bits, {}

    def visit(self, h, ids):
        prev = torch.stack([self.m.get(i, torch.zeros(h.shape[1:], dtype=torch.float64)) for i in ids])
        dq, _ = _ref_quant(h.double() - prev, self.bits)
        new = prev + dq
        for r, i in enumerate(ids):
            self.m[i] = new[r]
        return new


def test_spec_and_options():
    assert parse_spec("aqsgd:bits=3,gbits=16,store_dtype=float16") == (
        "aqsgd", {"bits": 3, "gbits": 16, "store_dtype": "float16"})
    c = make_codec("aqsgd:bits=3", gbits=6)
    assert (c.bits, c.gbits) == (3, 6)
    for bad in ({"bits": 1}, {"bits": 9}, {"gbits": 12}, {"store_dtype": "int8"}, {"bits": True}):
        with pytest.raises(ValueError):
            make_codec("aqsgd", **bad)


def test_trainer_flag_takes_a_spec():
    """--boundary.codec name:key=value,...: the config keeps the name (what the trainer's
    codec checks compare) and merges the options under --boundary.options."""
    from orchestration.config import parse_args, validate

    cfg, _ = parse_args(["--boundary.codec", "aqsgd:bits=2,gbits=16", "--boundary.options", '{"gbits": 8}'])
    validate(cfg)
    assert (cfg.boundary.codec, cfg.boundary.options) == ("aqsgd", {"bits": 2, "gbits": 8})
    with pytest.raises(ValueError, match="unknown boundary codec 'zip'"):
        validate(parse_args(["--boundary.codec", "zip:bits=2"])[0])


@pytest.mark.parametrize("bits,gbits", [(4, 8), (2, 16), (3, 5), (8, 4)])
def test_wire_bytes_are_exact(bits, gbits):
    c = make_codec("aqsgd", bits=bits, gbits=gbits)
    h = torch.randn(B, T, H)
    wire, _ = c.encode_fwd(h, _key(0))
    wire_b = c.encode_bwd(h, _key(0), wire)
    fwd = B * T * (math.ceil(H * bits / 8) + 4)
    bwd = B * T * H * 2 if gbits == 16 else B * T * (math.ceil(H * gbits / 8) + 4)
    assert c.wire_bytes((B, T, H), torch.float32, "fwd") == fwd == sum(t.numel() * t.element_size() for t in wire)
    assert c.wire_bytes((B, T, H), torch.float32, "bwd") == bwd == sum(t.numel() * t.element_size() for t in wire_b)
    # The paper's 8x forward at H=576 (SmolLM2), 4 bits: 288 B of codes + a 4 B scale.
    assert make_codec("aqsgd").wire_bytes((1, 576), torch.float32, "fwd") == 292


def test_sender_and_receiver_stores_stay_bit_identical_and_match_the_reference():
    """Two codec objects (the two stages), several steps over overlapping samples while the
    activations drift: after every step both stores hold exactly the same tensors, the
    receiver's output is its store, and both match the float64 reference."""
    torch.manual_seed(0)
    send, recv, ref = AQSGDCodec(bits=3), AQSGDCodec(bits=3), RefAQSGD(3)
    base = {i: torch.randn(T, H) * 4 for i in range(8)}
    batches = [[0, 1, 2, 3, 4, 5], [6, 7, 0, 1, 2, 3], [4, 5, 6, 7, 0, 1], [2, 3, 4, 5, 6, 7]] * 2
    for step, ids in enumerate(batches):
        sample_ids = torch.tensor(ids).chunk(2)
        send.begin_step(step, sample_ids)
        recv.begin_step(step, sample_ids)
        for mb, mb_ids in enumerate(sample_ids):
            h = torch.stack([base[int(i)] + 0.05 * step * torch.randn(T, H) for i in mb_ids])
            key = _key(step, mb, boundary=2)
            wire, _ = send.encode_fwd(h, key)
            out = recv.decode_fwd([w.clone() for w in wire], key, h.shape, h.dtype)
            want = ref.visit(h, [int(i) for i in mb_ids])
            torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-5)
            for r, i in enumerate(mb_ids.tolist()):
                assert torch.equal(recv.stores[("recv", 2)][i], out[r])
        s, r = send.stores[("send", 2)], recv.stores[("recv", 2)]
        assert sorted(s) == sorted(r)
        assert all(torch.equal(s[i], r[i]) for i in s)
    assert send.store_bytes() == recv.store_bytes() == 8 * T * H * 4


def test_error_shrinks_with_revisits_and_first_visit_is_plain_quantization():
    """A sample whose activation no longer changes: each visit quantizes the remaining
    error, which shrinks by at least 2*qmax per visit (the paper's vanishing error)."""
    c = AQSGDCodec(bits=4)
    h = torch.randn(2, T, H) * 10
    ids = torch.tensor([11, 12])
    errs = []
    for step in range(4):
        c.begin_step(step, [ids])
        wire, _ = c.encode_fwd(h, _key(step))
        out = c.decode_fwd(wire, _key(step), h.shape, h.dtype)
        errs.append((out - h).abs().max().item())
        if step == 0:
            plain, scale = _ref_quant(h, 4)
            torch.testing.assert_close(out.double(), plain, rtol=0, atol=1e-5)
            assert errs[0] <= scale.max().item() / 2 + 1e-5
    for a, b in zip(errs, errs[1:]):
        assert b <= a / (2 * 7) + 1e-5


def test_unbound_keys_are_stateless_first_visits():
    """apply_codec without begin_step (diagnose, held-out scoring): plain quantization,
    nothing stored, so the same call twice gives the same answer."""
    c = AQSGDCodec(bits=4)
    h = torch.randn(B, T, H)
    a = apply_codec(c, h, _key(0))
    b = apply_codec(c, h, _key(0))
    assert torch.equal(a, b) and c.store_bytes() == 0
    torch.testing.assert_close(a.double(), _ref_quant(h, 4)[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("gbits", [16, 8, 3])
def test_gradient_is_straight_through_then_quantized(gbits):
    c = AQSGDCodec(bits=4, gbits=gbits)
    h = torch.randn(B, T, H, requires_grad=True)
    g = torch.randn(B, T, H)
    c.begin_step(0, [torch.arange(B)])
    apply_codec(c, h, _key(0)).backward(g)
    want = g.to(torch.bfloat16).float() if gbits == 16 else _ref_quant(g, gbits)[0].float()
    torch.testing.assert_close(h.grad, want, rtol=0, atol=1e-6)


def test_bad_input_errors_name_the_problem():
    c = AQSGDCodec()
    with pytest.raises(ValueError, match="sample ids"):
        c.begin_step(0, None)
    with pytest.raises(ValueError, match="same sample twice"):
        c.begin_step(0, [torch.tensor([1, 1])])
    c.begin_step(0, [torch.tensor([1, 2])])
    with pytest.raises(ValueError, match="has 2 sample ids"):
        c.encode_fwd(torch.randn(3, T, H), _key(0))
    wire, _ = c.encode_fwd(torch.randn(2, T, H), _key(0))
    bad = [wire[0], -wire[1]]
    with pytest.raises(ValueError, match="non-positive scales"):
        c.decode_fwd(bad, _key(0), (2, T, H), torch.float32)
    with pytest.raises(ValueError, match="wire tensor 0"):
        c.decode_fwd([wire[0][..., :-1], wire[1]], _key(0), (2, T, H), torch.float32)
    c.begin_step(1, [torch.tensor([1, 2])])
    with pytest.raises(ValueError, match="was stored as"):
        c.encode_fwd(torch.randn(2, T + 1, H), _key(1))


def test_executor_hands_each_microbatch_its_sample_ids():
    """The plumbing: PipelineExecutor.step splits sample_ids like the batch and calls
    codec.begin_step once per step (a single-stage pipeline: no transfers needed)."""
    from orchestration.distributed.link_counter import LinkCounter
    from orchestration.distributed.pipeline import PipelineExecutor
    from orchestration.data.sampling import BatchSampler
    from orchestration.distributed.schedule import make_schedule
    from orchestration.distributed.stages import split_model
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16))
    seen = []

    class Recorder(AQSGDCodec):
        def begin_step(self, step, sample_ids):
            seen.append((step, [t.tolist() for t in sample_ids]))

    rows = torch.randint(0, 32, (10, 8), generator=torch.Generator().manual_seed(0))
    sampler = BatchSampler(rows, 4, seed=3)
    ex = PipelineExecutor(split_model(model, 1)[0], make_schedule("1f1b", 1, 2)[0], codec=Recorder(), prev_rank=None,
                          next_rank=None, rank=0, seed=0, counter=LinkCounter())
    for step in (0, 1, 2):
        idx = sampler.indices(step)
        assert torch.equal(sampler(step), rows[idx])
        ex.step(step, sampler(step), num_microbatches=2, sample_ids=idx)
        assert seen[-1] == (step, [idx[:2].tolist(), idx[2:].tolist()])
    # Two batches per epoch of 10 rows: step 2 starts epoch 1, same ids, new order.
    assert set(sampler.indices(2).tolist()) <= set(range(10))
    with pytest.raises(ValueError, match="sample_ids must be"):
        ex.step(3, sampler(3), num_microbatches=2, sample_ids=torch.arange(3))


def mesh_run(tiny, tmp_path, codec: str, options: str, steps: int, max_sequences: int = 200):
    """Trains the tiny model on a 1x2 mesh (one boundary) through ``codec``; returns
    (plan, the last stage's record)."""
    from orchestration.config import parse_args
    from orchestration.launch.processes import run_local
    from orchestration.distributed.mesh import MeshLayout
    from orchestration.train import prepare, run_rank

    argv = ["--model", str(tiny / "model"), "--data", str(tiny / "data.txt"), "--data.seq-len", "32",
            "--data.max-sequences", str(max_sequences), "--train.batch-size", "4", "--train.microbatches", "2",
            "--run.out-dir", str(tmp_path), "--run.name", "t", "--run.progress", "false",
            "--run.eval-sequences", "0", "--mesh.timeout-s", "60", "--mesh.rows", "1", "--mesh.stages", "2",
            "--train.steps", str(steps), "--train.lr", "3e-3", "--train.warmup-steps", "0",
            "--boundary.codec", codec, "--boundary.options", options, "--mesh.start-method", "fork"]
    cfg, _ = parse_args(argv)
    plan = prepare(cfg)
    res = run_local(run_rank, cfg.world_size, (cfg, plan), timeout_s=240, describe=MeshLayout(1, 2).describe,
                    start_method="fork")
    return cfg, plan, res[1]


@pytest.mark.slow
def test_aqsgd_trains_through_the_mesh_over_several_epochs(tiny, tmp_path):
    """23 training rows, 4 per step: 12 steps are ~2.4 epochs, so most samples are revisited
    (delta-coded against the stores). Finite, decreasing loss; pp bytes = the codec's
    wire bytes per micro-batch, exactly."""
    import json
    import os

    from orchestration.data.sampling import shard_rows

    cfg, plan, last = mesh_run(tiny, tmp_path, "aqsgd", '{"bits": 4, "gbits": 8}', steps=12, max_sequences=24)
    per_epoch = len(shard_rows(plan.train_rows, 0, 1)) // 4
    assert 12 / per_epoch >= 2
    losses = last["losses"]
    assert all(math.isfinite(x) for x in losses) and len(losses) == 12
    assert sum(losses[-3:]) < sum(losses[:3])
    c = make_codec("aqsgd", bits=4, gbits=8)
    links = json.load(open(os.path.join(plan.run_dir, "link_bytes.json")))["links"]
    assert links["pp_fwd:0->1"] == 12 * 2 * c.wire_bytes((2, 32, 40), torch.float32, "fwd")
    assert links["pp_bwd:1->0"] == 12 * 2 * c.wire_bytes((2, 32, 40), torch.float32, "bwd")
