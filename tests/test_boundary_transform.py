"""The boundary transform a model trained through a codec with a sink row is deployed with
(orchestration.models.boundary_transform, issue #43): position 0's int8 round trip, as the
codec sends it, at the input of each boundary layer; recorded as meshkern_boundary.json in
checkpoints and exports and applied by orchestration.models.loading."""
import json
import os

import pytest
import torch

from orchestration import codecs
from orchestration.codecs.pca_base import sink_round_trip
from orchestration.components import calibration
from orchestration.components import checkpoint as ckpt
from orchestration.config import parse_args
from orchestration.distributed.stages import split_model
from orchestration.components.boundary_record import record_for, write
from orchestration.models import boundary_transform as bt
from orchestration.models.loading import load_causal_lm

from meshkern.mask import MaskKey


def _rec(layers, n):
    return {"format": bt.FORMAT, "kind": bt.KIND, "layers": list(layers), "num_hidden_layers": n}


def _by_hand(model, ids, stages, codec=None, bases=None):
    """The model run stage by stage, position 0 of each boundary replaced by what the codec's
    own round trip delivers there (encode_fwd / decode_fwd; ``codec`` None: sink_round_trip)."""
    parts = split_model(model, stages)
    h = parts[0](ids)
    for b, st in enumerate(parts[1:]):
        h = h.clone()
        if codec is None:
            h[:, 0] = sink_round_trip(h[:, 0])
        else:
            codec.bases = {b: bases[b]}
            key = MaskKey(0, b, 0, 0)
            h_hat = codec.decode_fwd(codec.encode_fwd(h, key)[0], key, tuple(h.shape), h.dtype)
            h[:, 0] = h_hat[:, 0]
        h = st(h)
    return h


@pytest.fixture(scope="module")
def fitted(tiny):
    """The tiny model, rows, and pca bases (default pcanf and quant=absmax) for a 2- and a 3-stage split."""
    model, _ = load_causal_lm(tiny / "model")
    ids = torch.randint(0, model.config.vocab_size, (6, 24), generator=torch.Generator().manual_seed(0))
    n = model.config.num_hidden_layers
    out = {}
    for spec in ("pca", "pca:quant=absmax"):
        codec = codecs.make_codec(spec)
        for stages in (2, 3):
            layers = calibration.boundary_layers(n, stages)
            bases = calibration.fit_layer_bases(model, ids[:4], codec, layers, grad_rows=0)
            out[(spec, stages)] = (codec, calibration.for_split(bases, layers), layers)
    return model, ids, out


@pytest.mark.parametrize("spec", ["pca", "pca:quant=absmax"])
def test_sink_round_trip_is_position_0_of_the_codecs_own_round_trip(fitted, spec):
    model, ids, by = fitted
    codec, bases, _ = by[(spec, 2)]
    with torch.no_grad():
        h = split_model(model, 2)[0](ids)
    codec.bases = {0: bases[0]}
    key = MaskKey(0, 0, 0, 0)
    h_hat = codec.decode_fwd(codec.encode_fwd(h, key)[0], key, tuple(h.shape), h.dtype)
    assert torch.equal(sink_round_trip(h[:, 0]), h_hat[:, 0])
    assert not torch.equal(h_hat[:, 0], h[:, 0])  # it does round
    assert sink_round_trip(h[:, 0].to(torch.bfloat16)).dtype == torch.bfloat16  # cast back as the codec's decode


@pytest.mark.parametrize("spec,stages", [("pca", 2), ("pca", 3), ("pca:quant=absmax", 2)])
def test_hooked_model_equals_the_stages_run_by_hand_with_the_codecs_sink_row(tiny, fitted, spec, stages):
    model, ids, by = fitted
    codec, bases, layers = by[(spec, stages)]
    n = model.config.num_hidden_layers
    cfg = parse_args(["--model", str(tiny / "model"), "--mesh.rows", "1", "--mesh.stages", str(stages),
                      "--boundary.codec", spec])[0]
    rec = record_for(cfg, n)
    assert rec["layers"] == [L + 1 for L in layers] and (rec["codec"], rec["codec_options"]) == codecs.parse_spec(spec)
    with torch.no_grad():
        plain = model(ids).logits
        want = _by_hand(model, ids, stages, codec, bases)
        try:
            bt.install(model, rec)
            assert bt.installed(model)["layers"] == rec["layers"]
            got = model(ids).logits
        finally:
            bt.remove(model)
        assert bt.installed(model) is None
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert (got - plain).abs().max() > 1e-4  # the transform changes the output
        torch.testing.assert_close(model(ids).logits, plain, rtol=0, atol=0)  # removed: the plain model again


def test_hidden_states_positional_or_keyword_and_only_position_0():
    seen = []

    class Echo(torch.nn.Module):
        def forward(self, hidden_states, **kw):
            seen.append(hidden_states)
            return hidden_states

    m = Echo()
    m.register_forward_pre_hook(bt._hook(1), with_kwargs=True)
    h = torch.randn(3, 5, 16) * torch.linspace(0.1, 30, 16)
    want = h.clone()
    want[:, 0] = sink_round_trip(h[:, 0])
    for call in (lambda: m(h), lambda: m(hidden_states=h), lambda: m(h, position_ids=torch.arange(5)[None]),
                 lambda: m(hidden_states=h, position_ids=torch.arange(5).expand(3, 5))):
        assert torch.equal(call(), want)
    assert not torch.equal(want, h)
    # a cached step: positions 5.. (position_ids) or a layer cache that holds tokens: untouched
    assert torch.equal(m(h, position_ids=torch.arange(5, 10)[None]), h)

    class Cache:
        def get_seq_length(self, layer_idx=0):
            return 7 if layer_idx == 1 else 0

    assert torch.equal(m(hidden_states=h, cache=Cache()), h)
    # left padding: position 0 is where the positions say, row by row
    pos = torch.tensor([[0, 1, 2, 3, 4], [1, 1, 0, 1, 2], [1, 1, 1, 1, 0]])
    want = h.clone()
    for r, t in enumerate((0, 2, 4)):
        want[r, t] = sink_round_trip(h[r, t])
    assert torch.equal(m(h, position_ids=pos), want)


def test_kv_cache_generation_equals_generation_without_a_cache(tiny):
    model, _ = load_causal_lm(tiny / "model")
    n = model.config.num_hidden_layers
    bt.install(model, _rec([2], n))
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids).logits
        # the prompt with a cache, then the last token alone: the transform ran on the prompt's position 0 only
        out = model(ids[:, :-1], use_cache=True)
        step = model(ids[:, -1:], cache=out.cache, use_cache=True).logits
        torch.testing.assert_close(step[:, -1], full[:, -1], rtol=1e-5, atol=1e-5)
        kw = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True,
                  pad_token_id=0)
        a = model.generate(ids, use_cache=True, **kw)
        b = model.generate(ids, use_cache=False, **kw)
    assert torch.equal(a.sequences, b.sequences)
    torch.testing.assert_close(torch.stack(a.scores), torch.stack(b.scores), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_other_families_hooked_equals_by_hand_and_the_cache_agrees(family):
    from family_models import tiny_model

    model = tiny_model(family)
    ids = torch.randint(3, 96, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = _by_hand(model, ids, 2)
        plain = model(ids).logits
        bt.install(model, _rec([2], 4))
        got = model(ids).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert (got - plain).abs().max() > 0
        out = model(ids[:, :-1], use_cache=True)
        step = model(ids[:, -1:], cache=out.cache, use_cache=True).logits
        torch.testing.assert_close(step[:, -1], got[:, -1], rtol=1e-5, atol=1e-5)


def test_record_for_only_codecs_with_a_sink_row(tiny):
    def rec(*flags):
        cfg = parse_args(["--model", str(tiny / "model"), "--mesh.rows", "1", *flags])[0]
        return record_for(cfg, 4)

    assert rec("--mesh.stages", "2")["layers"] == [2]  # the default codec (pca, sink)
    assert rec("--mesh.stages", "2", "--boundary.codec", "pca:quant=absmax")["layers"] == [2]
    assert rec("--mesh.stages", "4")["layers"] == [1, 2, 3]
    assert rec("--mesh.stages", "2", "--mesh.layers-per-stage", "3,1")["layers"] == [3]
    for flags in (("--boundary.codec", "dense"), ("--boundary.codec", "pca:sink=false"), ("--boundary.codec", "int8"),
                  ("--checkpoint.boundary-transform", "false")):
        assert rec("--mesh.stages", "2", *flags) is None, flags
    assert rec("--mesh.stages", "1") is None


def test_loading_applies_the_file_and_only_then(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    import shutil

    folder = tmp_path / "m"
    shutil.copytree(tiny / "model", folder)
    model, _ = load_causal_lm(folder)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))  # no file: the plain model, no hooks
    assert bt.installed(model) is None and bt.read(folder) is None
    with torch.no_grad():
        plain = model(ids).logits
        write(folder, _rec([2], 4))
        assert not os.path.exists(folder / (bt.FILE + ".part"))
        hooked, _ = load_causal_lm(folder)
        assert bt.installed(hooked)["layers"] == [2]
        unhooked, _ = load_causal_lm(folder, boundary=False)
        assert bt.installed(unhooked) is None
        torch.testing.assert_close(unhooked(ids).logits, plain, rtol=0, atol=0)
        torch.testing.assert_close(hooked(ids).logits, _by_hand(unhooked, ids, 2), rtol=1e-5, atol=1e-5)
        hf = AutoModelForCausalLM.from_pretrained(str(folder)).eval()  # plain transformers ignores the file
        torch.testing.assert_close(hf(ids).logits, plain, rtol=0, atol=0)
    (folder / bt.FILE).write_text(json.dumps({"kind": "something-else", "format": 1, "layers": [2]}))
    with pytest.raises(ValueError, match="not a boundary transform"):
        load_causal_lm(folder)
    assert bt.installed(load_causal_lm(folder, boundary=False)[0]) is None
    write(folder, _rec([2], 6))
    with pytest.raises(ValueError, match="for 6 decoder layers"):
        load_causal_lm(folder)


def _train(tiny, tmp_path, *extra):
    from test_train import _args, _run

    return _run(_args(tiny, tmp_path, "--mesh.rows", "1", "--mesh.stages", "2", "--train.steps", "2", *extra))


@pytest.mark.slow
def test_a_pca_run_checkpoint_carries_the_file_and_loads_with_it_dense_none(tiny, tmp_path, capsys):
    from orchestration.models.scoring import eval_loss

    cfg, plan, res = _train(tiny, tmp_path / "pca")
    last = ckpt.resolve("latest", plan.ckpt_dir)
    rec = bt.read(last)
    assert rec is not None and rec["layers"] == [2] and rec["codec"] == "pca" and "far-domain" in rec["why"]
    assert bt.FILE in ckpt.read_meta(last)["files"]  # covered by the checkpoint's verification
    ckpt.verify(last)
    model, _ = load_causal_lm(last)
    assert bt.installed(model) == rec
    rows = plan.eval_rows[:cfg.run.eval_sequences]
    s = res[0]["summary"]
    plain_model, _ = load_causal_lm(last, boundary=False)
    assert s["eval_loss"] == pytest.approx(eval_loss(model, rows)["loss"], rel=1e-6)
    assert s["eval_loss_plain"] == pytest.approx(eval_loss(plain_model, rows)["loss"], rel=1e-6)
    assert s["eval_loss"] != s["eval_loss_plain"]
    from orchestration import evaluate
    from orchestration.components.run_summary import format_summary

    assert "held-out loss final, plain model" in format_summary(s)
    flags = ["--model", last, "--data", str(tiny / "data.txt"), "--seq-len", "32", "--max-batches", "1", "--threads", "1"]
    assert evaluate.main(flags) == 0
    assert "boundary transform: position 0's int8 round trip at decoder layers [2]" in capsys.readouterr().out
    assert evaluate.main(flags + ["--plain"]) == 0
    assert "boundary transform" not in capsys.readouterr().out
    # a corrupted record fails the verification like any checkpoint file
    with open(os.path.join(last, bt.FILE), "a") as f:
        f.write(" ")
    with pytest.raises(ckpt.CheckpointError, match=bt.FILE):
        ckpt.verify(last)

    cfg, plan, res = _train(tiny, tmp_path / "dense", "--boundary.codec", "dense")
    last = ckpt.resolve("latest", plan.ckpt_dir)
    assert bt.read(last) is None and bt.FILE not in os.listdir(last)
    assert res[0]["summary"]["eval_loss_plain"] is None
    assert bt.installed(load_causal_lm(last)[0]) is None


@pytest.mark.slow
def test_lora_exports_carry_the_file_unless_plain(tiny, tmp_path):
    pytest.importorskip("peft")
    from orchestration import export

    cfg, plan, res = _train(tiny, tmp_path, "--adapter", "lora", "--adapter.rank", "2", "--adapter.alpha", "4",
                            "--adapter.export", "merged")
    last = ckpt.resolve("latest", plan.ckpt_dir)
    rec = bt.read(last)
    assert rec["layers"] == [2]
    for d in ("adapter", "merged"):
        assert bt.read(os.path.join(plan.run_dir, d)) == rec, d
    assert res[0]["summary"]["eval_loss_plain"] is not None
    ids = plan.eval_rows[:2]
    with torch.no_grad():
        merged, _ = load_causal_lm(os.path.join(plan.run_dir, "merged"))
        adapter, _ = load_causal_lm(os.path.join(plan.run_dir, "adapter"))  # base + adapters merged, transform on
        assert bt.installed(merged) == rec and bt.installed(adapter) == rec
        torch.testing.assert_close(merged(ids).logits, adapter(ids).logits, rtol=1e-4, atol=1e-4)
        bt.remove(merged)
        want = _by_hand(merged, ids, 2)
        bt.install(merged, rec)
        torch.testing.assert_close(merged(ids).logits, want, rtol=1e-5, atol=1e-5)
    for merged_flag in ([], ["--merged"]):
        out = tmp_path / f"plain{len(merged_flag)}"
        assert export.main([last, "--out", str(out), "--plain", *merged_flag]) == 0
        assert bt.read(out) is None and bt.installed(load_causal_lm(out)[0]) is None
