"""Stages: the split model is the unsplit model (logits bit for bit, same gradients)."""
import copy

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from orchestration.distributed.stages import (Stage, balanced_layers, causal_lm_loss, run_stages, split_model,
                                  tied_weight_pairs)

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128)  # GQA: 4 query heads share 2 kv heads


def _model(family: str, tied: bool = False, **extra):
    torch.manual_seed(0)
    cfg_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                          "qwen3": (Qwen3Config, Qwen3ForCausalLM),
                          "mistral": (MistralConfig, MistralForCausalLM)}[family]
    cfg = cfg_cls(**{**TINY, **extra}, tie_word_embeddings=tied)
    if family == "qwen2":
        cfg.attention_bias = True  # Qwen2's q/k/v biases
    return model_cls(cfg).eval()


def _batch(B=2, T=12, V=128):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (B, T), generator=g)


@pytest.mark.parametrize("family,layers", [("llama", None), ("llama", [1, 3]), ("qwen2", None), ("qwen3", [3, 1]),
                                           ("mistral", [2, 1, 1]), ("llama", [1, 1, 1, 1])])
def test_split_reproduces_logits_and_grads(family, layers):
    ref = _model(family)
    model = copy.deepcopy(ref)
    ids = _batch()
    labels = ids.clone()
    labels[0, :3] = -100
    out = ref(ids, labels=labels)
    out.loss.backward()

    num_stages = len(layers) if layers else 2
    stages = split_model(model, num_stages, layers)
    assert [st.layer_range for st in stages][-1][1] == 4
    logits = run_stages(stages, ids)
    assert torch.equal(logits, out.logits)  # bit-identical: same ops in the same order
    loss = causal_lm_loss(logits, labels)
    assert torch.equal(loss, out.loss)
    loss.backward()
    ref_grads = dict(ref.named_parameters())
    seen = 0
    for st in stages:
        for hf, p in st.hf_named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[hf].grad, rtol=0, atol=1e-6)
            seen += 1
    assert seen == len(ref_grads)


def test_hf_state_dict_names_match_unsplit_checkpoint():
    ref = _model("llama")
    stages = split_model(copy.deepcopy(ref), 3, [2, 1, 1])
    merged = {}
    for st in stages:
        merged.update(st.hf_state_dict())
    want = ref.state_dict()
    assert set(merged) == set(want)
    for k in want:
        assert torch.equal(merged[k], want[k]), k


def test_tied_embeddings_split_into_two_copies_whose_grads_sum_to_the_tied_grad():
    ref = _model("llama", tied=True)
    assert ref.lm_head.weight is ref.model.embed_tokens.weight
    model = copy.deepcopy(ref)
    ids = _batch()
    out = ref(ids, labels=ids)
    out.loss.backward()
    stages = split_model(model, 2)
    assert stages[-1].tied_lm_head and not stages[0].tied_lm_head
    assert stages[-1].lm_head.weight is not stages[0].embed_tokens.weight
    assert tied_weight_pairs(stages) == [(0, "embed_tokens.weight", 1, "lm_head.weight")]
    logits = run_stages(stages, ids)
    assert torch.equal(logits, out.logits)
    causal_lm_loss(logits, ids).backward()
    summed = stages[0].embed_tokens.weight.grad + stages[-1].lm_head.weight.grad
    torch.testing.assert_close(summed, ref.model.embed_tokens.weight.grad, rtol=0, atol=1e-6)


def test_single_stage_keeps_tie():
    model = _model("qwen2", tied=True)
    (st,) = split_model(model, 1)
    assert st.lm_head.weight is st.embed_tokens.weight and not st.tied_lm_head
    assert tied_weight_pairs([st]) == []
    ids = _batch()
    assert torch.equal(st(ids), model(ids).logits)


def test_position_ids_and_padding_mask_are_honoured():
    ref = _model("llama")
    ids = _batch()
    att = torch.ones_like(ids)
    att[1, :4] = 0  # left padding on the second row
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    want = ref(ids, attention_mask=att, position_ids=pos).logits
    stages = split_model(copy.deepcopy(ref), 2)
    got = run_stages(stages, ids, position_ids=pos, attention_mask=att)
    torch.testing.assert_close(got[att.bool()], want[att.bool()], rtol=0, atol=0)


def test_sliding_window_layers_get_their_own_mask():
    # Qwen2 with a window smaller than the sequence on the upper layers: the split must
    # give each stage the mask kind of its own layers.
    ref = _model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=2)
    assert "sliding_attention" in ref.config.layer_types
    ids = _batch(T=16)
    stages = split_model(copy.deepcopy(ref), 2, [2, 2])
    assert torch.equal(run_stages(stages, ids), ref(ids).logits)


def test_mistral_sliding_window_is_kept_per_stage():
    ref = _model("mistral", sliding_window=4)
    ids = _batch(T=16)
    want = ref(ids).logits
    full = copy.deepcopy(ref)
    full.config.sliding_window = None
    assert not torch.allclose(full(ids).logits, want)  # the window matters at T=16
    assert torch.equal(run_stages(split_model(copy.deepcopy(ref), 2), ids), want)


def test_bad_input_gives_clear_errors():
    m = _model("llama")
    with pytest.raises(ValueError, match="more stages than layers"):
        split_model(m, 5)
    with pytest.raises(ValueError, match="sum to"):
        split_model(m, 2, [1, 1])
    with pytest.raises(ValueError, match="positive"):
        split_model(m, 2, [0, 4])
    with pytest.raises(ValueError, match="2 stages"):
        split_model(m, 2, [1, 1, 2])
    with pytest.raises(ValueError, match="supported families"):
        split_model(torch.nn.Linear(2, 2), 1)
    st = split_model(m, 2)
    with pytest.raises(TypeError, match="input_ids"):
        st[0](torch.randn(2, 3, 64))
    with pytest.raises(TypeError, match="hidden states"):
        st[1](_batch())
    with pytest.raises(ValueError, match="labels"):
        causal_lm_loss(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


def test_balanced_layers():
    assert balanced_layers(16, 4) == [4, 4, 4, 4]
    assert balanced_layers(5, 3) == [2, 2, 1]
    assert isinstance(split_model(_model("llama"), 1)[0], Stage)


def test_microbatch_losses_add_up_with_num_items():
    ref = _model("llama")
    ids = _batch(B=4)
    full = ref(ids, labels=ids).loss
    n = (ids.shape[1] - 1) * ids.shape[0]
    parts = sum(causal_lm_loss(ref(ids[i:i + 2]).logits, ids[i:i + 2], num_items_in_batch=n) for i in (0, 2))
    torch.testing.assert_close(parts, full, rtol=1e-6, atol=1e-6)
