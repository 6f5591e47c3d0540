"""Every family the splitter takes, against the unsplit transformers model: logits bit for
bit and the same gradients over 1..L stages (uneven, tied and untied), bf16 within bf16's
tolerance, the MoE router loss as the unsplit model adds it, LoRA with the family's default
targets whose PEFT folder loads on the unsplit model, the pca codec's calibration, and
what cannot be split refused in one line."""
import copy
import json

import pytest
import torch
import transformers

from family_models import FAMILIES, MOE, tiny_config, tiny_model
from orchestration.distributed.stages import (causal_lm_loss, check_splittable, run_stages, split_model,
                                              supported_families)
from orchestration.models import routing

SPLITS = {1: [4], 2: [1, 3], 3: [2, 1, 1], 4: [1, 1, 1, 1]}


def _batch(B=2, T=12, V=96, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, V, (B, T), generator=g)


def _grads_match(stages, ref, tied: bool):
    """Every stage parameter's gradient equals the unsplit one's; a tied weight split in two
    copies: their sum does (what the trainer's tied sync adds up)."""
    want = dict(ref.named_parameters())
    got: dict = {}
    for st in stages:
        for hf, p in st.hf_named_parameters():
            got[hf] = p.grad if hf not in got else got[hf] + p.grad
    if tied and "lm_head.weight" in got and len(stages) > 1:
        got["model.embed_tokens.weight"] = got["model.embed_tokens.weight"] + got.pop("lm_head.weight")
    want = {k: v for k, v in want.items() if v.requires_grad}
    assert set(got) == set(want)
    for k, g in got.items():
        torch.testing.assert_close(g, want[k].grad, rtol=0, atol=1e-6, msg=k)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", FAMILIES)
def test_split_equals_unsplit(family, tied):
    ref = tiny_model(family, tied)
    ids, labels = _batch(), _batch()
    labels[0, :3] = -100
    pad = torch.ones_like(ids)
    pad[1, :4] = 0  # left padding on one row: the padding mask reaches every stage
    out = ref(ids, attention_mask=pad, labels=labels)
    out.loss.backward()
    for n, layers in SPLITS.items():  # 1..L stages, even and uneven
        model = copy.deepcopy(ref)
        model.zero_grad()
        stages = split_model(model, n, layers)
        logits = run_stages(stages, ids, attention_mask=pad)
        assert torch.equal(logits, out.logits), (family, layers)  # same ops, same order
        if layers in ([1, 3], [2, 1, 1]):
            loss = causal_lm_loss(logits, labels)
            assert torch.equal(loss, out.loss)
            loss.backward()
            _grads_match(stages, ref, tied)


@pytest.mark.parametrize("family", FAMILIES)
def test_position_ids_are_honoured(family):
    """Shifted positions (a packed or continued sequence) change the logits the same way."""
    ref = tiny_model(family)
    ids, pos = _batch(B=1), torch.arange(5, 17).unsqueeze(0)
    want = ref(ids, position_ids=pos).logits
    assert not torch.equal(want, ref(ids).logits)
    assert torch.equal(run_stages(split_model(copy.deepcopy(ref), 2), ids, position_ids=pos), want)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_within_bf16_tolerance(family):
    ref = tiny_model(family, dtype=torch.bfloat16)
    ids = _batch()
    want = ref(ids).logits
    got = run_stages(split_model(copy.deepcopy(ref), 3, [1, 2, 1]), ids)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)


def test_the_family_differences_matter_at_this_size():
    """The tiny configs exercise what the splitter does per family: without Granite's
    multipliers, Gemma 2's soft-capping or Gemma 3's local rope base the logits change
    (so the bit-exact tests above would catch a stage that dropped them)."""
    ids = _batch()
    for family, change in [("granite", dict(embedding_multiplier=1.0)), ("granite", dict(logits_scaling=1.0)),
                           ("gemma2", dict(final_logit_softcapping=None))]:
        assert not torch.allclose(tiny_model(family)(ids).logits, tiny_model(family, **change)(ids).logits)
    g3 = tiny_model("gemma3_text")
    other = copy.deepcopy(g3)
    other.config.rope_parameters["sliding_attention"]["rope_theta"] = 1e6
    other.model.rotary_emb = type(g3.model.rotary_emb)(other.config)
    assert not torch.allclose(g3(ids).logits, other(ids).logits)


@pytest.mark.parametrize("on", [False, True], ids=["router-loss-off", "router-loss-on"])
@pytest.mark.parametrize("family", MOE)
def test_moe_router_loss_follows_the_unsplit_model(family, on):
    ref = tiny_model(family, output_router_logits=on)
    ids = _batch()
    out = ref(ids, labels=ids)
    out.loss.backward()
    model = copy.deepcopy(ref)
    stages = split_model(model, 3, [2, 1, 1])
    logits = run_stages(stages, ids)
    assert torch.equal(logits, out.logits)
    loss = causal_lm_loss(logits, ids)
    if not on:
        assert all(st.router_logits == [] for st in stages)  # nothing recorded, nothing added
        assert torch.equal(loss, out.loss)
        return
    assert [len(st.router_logits) for st in stages] == [2, 1, 1]
    aux = routing.router_aux_loss([r for st in stages for r in st.router_logits], model.config)
    assert torch.equal(aux, out.aux_loss * ref.config.router_aux_loss_coef) and float(aux.detach()) > 0
    assert torch.equal(loss + aux, out.loss)
    # across processes: each stage's share given the totals adds up to the same loss and gradient
    stats = [routing.router_stats(st.router_logits, model.config) for st in stages]
    T, n = sum(s[0] for s in stats), sum(s[2] for s in stats)
    shares = [routing.stage_aux_term(s, T, n, model.config) for s in stats]
    torch.testing.assert_close(sum(shares), aux, rtol=1e-6, atol=0)
    (loss + sum(shares)).backward()
    _grads_match(stages, ref, tied=False)


def test_refused_in_one_line_saying_why():
    from transformers import Gemma3Config, GPT2Config, LlamaConfig, T5Config

    cases = [(T5Config(), "encoder-decoder"), (Gemma3Config(), "vision"), (GPT2Config(), "not a family"),
             (tiny_config("gemma3_text", use_bidirectional_attention=True), "bidirectional"),
             (LlamaConfig(architectures=["LlamaForSequenceClassification"]), "not a causal LM")]
    for cfg, why in cases:
        with pytest.raises(ValueError, match=why) as e:
            check_splittable(cfg)
        assert "\n" not in str(e.value)
    assert "Llama" in str(pytest.raises(ValueError, check_splittable, GPT2Config()).value)  # names what works
    for family in FAMILIES:
        assert check_splittable(tiny_config(family)) in supported_families()
    with pytest.raises(ValueError, match="not laid out"):  # structure checked, not just the name
        m = tiny_model("llama")
        m.model.final_norm = m.model.norm
        del m.model.norm
        split_model(m, 2)


def test_help_and_readme_list_the_code_s_families():
    import pathlib

    from orchestration.config.cli_help import families_help

    from orchestration.config import build_parser

    readme = " ".join((pathlib.Path(__file__).parents[1] / "README.md").read_text().split())
    line = families_help()
    assert line == ", ".join(supported_families())
    assert f"these families: {line} (" in readme
    assert line in " ".join(build_parser().format_help().split())


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_default_targets_and_peft_folder(family, tmp_path):
    """The family's default targets are linear layers its decoder layers have; a 2-stage
    LoRA model trained a step assembles into a PEFT folder that PeftModel.from_pretrained
    loads on the unsplit base with the stages' logits, and merges into the same model."""
    peft = pytest.importorskip("peft")
    from safetensors.torch import save_file

    from orchestration.adapters import AdapterState, apply_lora, check_targets, layer_linear_names, resolve_targets
    from orchestration.config.job_config import AdapterConfig

    cfg = tiny_config(family)
    acfg = AdapterConfig(kind="lora", rank=2, alpha=4.0)  # the flags' defaults: the family's own targets
    resolve_targets(acfg, cfg)
    assert set(acfg.target_list()) <= set(layer_linear_names(cfg)) and acfg.target_list()
    check_targets(acfg, cfg)
    with pytest.raises(ValueError, match="not a linear layer"):
        check_targets(AdapterConfig(kind="lora", targets="no_such_proj"), cfg)

    base_dir = tmp_path / "base"
    tiny_model(family).save_pretrained(base_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval()
    torch.manual_seed(0)
    apply_lora(model, acfg)
    stages = split_model(model, 2)
    ids = _batch()
    opt = torch.optim.SGD([p for st in stages for p in st.parameters() if p.requires_grad], lr=0.5)
    causal_lm_loss(run_stages(stages, ids), ids).backward()
    opt.step()
    with torch.no_grad():
        want = run_stages(stages, ids)
    tensors, peft_cfg = {}, None
    for st in stages:
        state = AdapterState(st, acfg, str(base_dir))
        tensors.update(state.tensors())
        peft_cfg = state.peft_config
    out = tmp_path / "adapter"
    out.mkdir()
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(peft_cfg))
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval()
    with torch.no_grad():
        before = base(ids).logits
    loaded = peft.PeftModel.from_pretrained(base, str(out)).eval()
    with torch.no_grad():
        got = loaded(ids).logits
        assert not torch.allclose(got, before)  # the adapters trained, and they are in the folder
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        merged = loaded.merge_and_unload()
        torch.testing.assert_close(merged(ids).logits, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_pca_calibrates_on_the_split_and_trains(family):
    """The pca codec's calibration reads the boundary hidden states of the split, which are
    the unsplit model's hidden states after that layer; through the fitted codec the stages
    train (finite, falling loss)."""
    from meshkern.mask import MaskKey
    from orchestration.codecs import PCACodec, apply_codec
    from orchestration.components import calibration

    model = tiny_model(family)
    rows = torch.cat([_batch(seed=s) for s in range(4)])
    hs, gs = calibration.boundary_states(model, rows, 2, [1, 3], grad_rows=4)
    with torch.no_grad():
        ref = model(rows, output_hidden_states=True).hidden_states[1]
    assert torch.equal(hs[0], ref.float()) and gs[0] is not None and torch.isfinite(gs[0]).all()
    codec = PCACodec(quant="absmax", bits=4, k=8, sink=True, seq_len=12)
    codec.bases = calibration.fit_model_bases(model, rows, codec, 2, [1, 3], grad_rows=4)
    stages = split_model(model.train(), 2, [1, 3])
    opt = torch.optim.AdamW([p for st in stages for p in st.parameters()], lr=1e-2)
    ids = rows[:4]
    losses = []
    for step in range(6):
        opt.zero_grad()
        logits = run_stages(stages, ids, boundary=lambda i, h: apply_codec(codec, h, MaskKey(0, i, step, 0)))
        loss = causal_lm_loss(logits, ids)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses


@pytest.mark.parametrize("name,published", [("mixtral-8x7b", 46.70e9), ("qwen3-30b-a3b", 30.53e9),
                                            ("gemma-2-2b", 2.614e9)])
def test_memory_table_holds_every_expert_and_the_large_vocab(name, published):
    """The table counts every expert's weights (the published totals: Mixtral 8x7B 46.7B,
    Qwen3-30B-A3B 30.5B, Gemma 2 2B 2.6B with its 256k tied vocabulary counted once), while an
    MoE token's activations follow its top-k experts only."""
    from orchestration.components import memory
    from orchestration.config.job_config import AdapterConfig

    hf = memory.geometry_config(name)
    rows = memory.stage_memory(hf, 2, dtype="bfloat16", adapter=None, seq_len=16)
    total = sum(r.params for r in rows) - (hf.vocab_size * hf.hidden_size if hf.tie_word_embeddings else 0)
    assert abs(total / published - 1) < 0.005, total
    if "gemma" in name:  # soft-capping keeps three more [T, V] tensors on the last stage
        hf.final_logit_softcapping = None
        plain = memory.stage_memory(hf, 2, dtype="bfloat16", adapter=None, seq_len=16)
        assert rows[-1].activations - plain[-1].activations == 3 * hf.vocab_size * 16 * 2  # bf16, one micro-batch in flight
        assert rows[0].activations == plain[0].activations
    else:  # all experts held, k of them computed: far below a dense layer of all experts' width
        E = getattr(hf, "num_local_experts", None) or hf.num_experts
        width = getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size
        per_token = rows[0].activations / (rows[0].layers[1] - rows[0].layers[0]) / 16 / 2 / 2  # bf16, 2 in flight
        assert memory.act_per_token(hf.hidden_size, hf.num_experts_per_tok * width, 0) < per_token
        assert per_token < memory.act_per_token(hf.hidden_size, E * width, 0) / 2
    lora = memory.stage_memory(hf, 2, adapter=AdapterConfig(kind="lora", rank=4), seq_len=16)
    assert all(r.trainable > 0 for r in lora)  # the family's default targets exist (attention for MoE)
