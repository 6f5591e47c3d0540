"""GGUF files of families beyond Llama (orchestration.models.gguf_convert): a tiny Phi-3
(fused qkv / gate_up tensors) and Qwen3 (QK-norm) GGUF written here with the gguf package's
GGUFWriter under llama.cpp's tensor names convert to the model transformers builds from the
GGUF itself, and that model splits exactly; a family transformers' reader lacks is refused
in one line naming the ones that work."""
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="GGUF support needs: pip install gguf accelerate")
pytest.importorskip("accelerate", reason="GGUF support needs: pip install gguf accelerate")

from orchestration.models import gguf_convert  # noqa: E402
from test_gguf import _tokenizer, cache  # noqa: E402,F401  (cache: a fixture)

H, FFN, LAYERS = 32, 64, 2
# (heads, kv heads, head_dim): transformers' GGUF reader takes Qwen3's head_dim from its config
# default (128, as every published Qwen3), not from the file
GEOM = {"phi3": (4, 2, 8), "qwen3": (2, 1, 128)}
# HF parameter suffix -> llama.cpp tensor suffix (gguf's TensorNameMap), per family
NAMES = {
    "phi3": {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.qkv_proj": "attn_qkv",
             "self_attn.o_proj": "attn_output", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"},
    "qwen3": {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
              "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"},
}


def _write(path, arch: str):
    import json

    import transformers

    tok = _tokenizer()
    vocab = tok.backend_tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m)
              for m in json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]]
    cfg_cls = {"phi3": transformers.Phi3Config, "qwen3": transformers.Qwen3Config}[arch]
    heads, kv, hd = GEOM[arch]
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg_cls(
        vocab_size=len(tokens), hidden_size=H, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd, max_position_embeddings=256,
        rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=0, bos_token_id=0, eos_token_id=0))
    sd = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(FFN)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(hd)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3 if t == "<|endoftext|>" else 1 for t in tokens])
    w.add_bos_token_id(vocab["<|endoftext|>"])
    w.add_eos_token_id(vocab["<|endoftext|>"])
    w.add_pad_token_id(vocab["<|endoftext|>"])  # Phi-3's config default (32000) is past this tiny vocab
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"].numpy())
    for i in range(LAYERS):
        for hf, g in NAMES[arch].items():
            w.add_tensor(f"blk.{i}.{g}.weight", sd[f"model.layers.{i}.{hf}.weight"].numpy())
    w.add_tensor("output_norm.weight", sd["model.norm.weight"].numpy())
    w.add_tensor("output.weight", sd["lm_head.weight"].numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sd


@pytest.mark.parametrize("arch,cls", [("phi3", "Phi3ForCausalLM"), ("qwen3", "Qwen3ForCausalLM")])
def test_gguf_of_another_family_converts_and_splits(arch, cls, tmp_path, cache):  # noqa: F811
    from transformers import AutoModelForCausalLM

    from orchestration.distributed.stages import run_stages, split_model
    from orchestration.models.loading import load_causal_lm

    sd = _write(tmp_path / f"{arch}.gguf", arch)
    out = gguf_convert.converted_checkpoint(tmp_path / f"{arch}.gguf", progress=False)
    model, tok = load_causal_lm(out)
    assert type(model).__name__ == cls and tok == out
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=f"{arch}.gguf", dtype=torch.float32).eval()
    got = dict(model.state_dict())
    for k, v in sd.items():  # our weights, as written
        torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = theirs(ids).logits
        assert torch.equal(model(ids).logits, want)
        assert torch.equal(run_stages(split_model(model, 2), ids), want)


def test_gguf_of_an_unsplittable_family_is_refused_naming_those_that_work(tmp_path, cache):  # noqa: F811
    w = gguf.GGUFWriter(str(tmp_path / "falcon.gguf"), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(8, 32).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="'falcon' is not supported; --model FILE.gguf takes GGUFs of gemma2, "
                                         "gemma3, llama, mistral, phi3, qwen2, qwen2moe, qwen3, qwen3moe") as e:
        gguf_convert.converted_checkpoint(tmp_path / "falcon.gguf", progress=False)
    assert "\n" not in str(e.value)
