"""Evaluation: loss/perplexity against HF's own loss, greedy generation against
HF generate, exact match through an oracle model, magnitude pruning counts."""
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from orchestration import evaluate

from orchestration.data import tokens as data

from orchestration.data import tasks


@pytest.fixture(scope="module")
def tok():
    return data.train_bpe(tasks.task_texts("all", 300), vocab_size=300)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def rows():
    return data.TokenDataset(torch.randint(0, 300, (7, 12), generator=torch.Generator().manual_seed(1)))


# ------------------------------------------------------------------ loss
def test_eval_loss_is_token_mean_of_hf_loss(model, rows):
    with torch.no_grad():
        ref = model(input_ids=rows.tokens, labels=rows.tokens).loss.item()
    got = evaluate.eval_loss(model, rows, batch_size=3)  # uneven batches: 3+3+1 rows
    assert got["loss"] == pytest.approx(ref, rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(ref), rel=1e-5)
    assert got["tokens"] == 7 * 11


def test_eval_loss_accepts_callable_and_stages(model, rows):
    ref = evaluate.eval_loss(model, rows)["loss"]
    fn = lambda x: model(input_ids=x).logits  # noqa: E731
    assert evaluate.eval_loss(fn, rows.tokens)["loss"] == pytest.approx(ref, rel=1e-6)
    stages = [lambda x: model(input_ids=x), lambda out: out.logits * 1.0]
    assert evaluate.eval_loss(stages, rows)["loss"] == pytest.approx(ref, rel=1e-6)
    first_two = evaluate.eval_loss(model, rows, batch_size=2, max_batches=2)
    assert first_two["tokens"] == 4 * 11


def test_eval_loss_restores_training_mode(model, rows):
    model.train()
    evaluate.eval_loss(model, rows)
    assert model.training
    model.eval()


def test_eval_loss_errors(model):
    with pytest.raises(TypeError, match="int64"):
        evaluate.eval_loss(model, torch.zeros(2, 4))
    with pytest.raises(TypeError, match="logits"):
        evaluate.eval_loss(lambda x: x.float(), torch.zeros(2, 4, dtype=torch.int64))


# ------------------------------------------------------------------ generation
def test_greedy_generate_matches_hf_generate(model):
    prompts = [[5, 9, 2], [7, 1, 1, 4], [3, 3, 8]]
    got = evaluate.greedy_generate(model, prompts, 6)
    for p, g in zip(prompts, got):
        ref = model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, pad_token_id=0,
                             eos_token_id=None, min_new_tokens=6)
        assert g == ref[0, len(p):].tolist()
    stop = {got[0][2]}
    cut = evaluate.greedy_generate(model, prompts[:1], 6, stop_ids=stop)[0]
    assert cut == got[0][: got[0].index(got[0][2]) + 1]


class Oracle:
    """Logits that spell out prompt + (answer or a wrong answer) + newline, one-hot."""

    def __init__(self, tok, exs, wrong):
        sep = [tok.eos_token_id]
        self.targets = []
        for i, e in enumerate(exs):
            ans = "WRONG" if i in wrong else e.answer
            p = sep + tok.encode(e.prompt, add_special_tokens=False)
            self.targets.append(p + tok.encode(" " + ans + "\n", add_special_tokens=False))
        self.vocab = len(tok)

    def __call__(self, x):
        out = torch.full((*x.shape, self.vocab), -10.0)
        for r, row in enumerate(x.tolist()):
            n = min(len(row), max(len(t) for t in self.targets))
            t = next(t for t in self.targets if t[:n] == row[: len(t)][:n])
            if len(row) < len(t):
                out[r, -1, t[len(row)]] = 10.0
        return out


@pytest.mark.parametrize("task", sorted(tasks.TASKS))
def test_exact_match_with_oracle(tok, task):
    exs = tasks.examples(task, 10, seed=tasks.EVAL_SEED)
    r = evaluate.exact_match(Oracle(tok, exs, wrong=set()), tok, task, n=10)
    assert r["accuracy"] == 1.0 and r["samples"][0][1] == r["samples"][0][2]
    r = evaluate.exact_match(Oracle(tok, exs, wrong={0, 3, 4}), tok, task, n=10)
    assert r["accuracy"] == pytest.approx(0.7)
    assert r["samples"][0][2] == "WRONG"


# ------------------------------------------------------------------ pruning
@pytest.mark.parametrize("frac", [0.3, 0.5, 0.7])
def test_per_matrix_pruning_zeroes_exact_fraction_of_smallest(model, frac):
    pruned = evaluate.magnitude_prune(model, frac)
    before = evaluate.prunable_weights(model)
    after = evaluate.prunable_weights(pruned)
    assert before.keys() == after.keys() and len(after) == 2 * 7  # q,k,v,o,gate,up,down per layer
    for name, w in after.items():
        orig = before[name]
        zeroed = w == 0
        assert zeroed.sum().item() == round(frac * w.numel())
        assert orig[zeroed].abs().max() <= orig[~zeroed].abs().min()  # the smallest went
        assert torch.equal(w[~zeroed], orig[~zeroed])
    assert torch.equal(pruned.lm_head.weight, model.lm_head.weight)
    assert torch.equal(pruned.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert all((w != 0).all() for w in before.values())  # the original is untouched


def test_global_pruning_one_threshold(model):
    pruned = evaluate.magnitude_prune(model, 0.5, scope="global")
    before = torch.cat([w.flatten() for w in evaluate.prunable_weights(model).values()])
    after = torch.cat([w.flatten() for w in evaluate.prunable_weights(pruned).values()])
    zeroed = after == 0
    assert zeroed.sum().item() == round(0.5 * after.numel())
    assert before[zeroed].abs().max() <= before[~zeroed].abs().min()


def test_pruning_robustness_zero_is_identity(model, rows):
    res = evaluate.pruning_robustness(model, rows, fractions=(0.0, 0.5, 0.9))
    base = evaluate.eval_loss(model, rows)["loss"]
    assert res[0.0]["loss"] == base and res[0.0]["loss_increase_pct"] == 0.0
    half = evaluate.eval_loss(evaluate.magnitude_prune(model, 0.5), rows)["loss"]
    assert res[0.5]["loss"] == pytest.approx(half)
    assert res[0.5]["loss_increase_pct"] == pytest.approx(100 * (half / base - 1))
    assert res[0.9]["loss"] != base


def test_pruning_errors(model):
    with pytest.raises(ValueError, match="fraction"):
        evaluate.magnitude_prune(model, 1.0)
    with pytest.raises(ValueError, match="scope"):
        evaluate.magnitude_prune(model, 0.5, scope="rows")
    with pytest.raises(ValueError, match="no nn.Linear"):
        evaluate.magnitude_prune(torch.nn.Embedding(3, 3), 0.5)


# ------------------------------------------------------------------ report / CLI
def test_cli_report_matches_direct_evaluation(model, tok, tmp_path, capsys):
    import json
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(str(tmp_path / "m"))
    evaluate.main(["--model", str(tmp_path / "m"), "--data", "task:add,task:upper", "--seq-len", "16",
                   "--max-batches", "0", "--tasks", "reverse", "--n-task", "4", "--prune", "0.5",
                   "--threads", "1", "--json", str(tmp_path / "r.json")])
    rep = json.loads((tmp_path / "r.json").read_text())
    held = data.build_token_dataset("task:upper", tok, 16).split(0.02, seed=0)[1]
    assert rep["held_out"]["task:upper"]["loss"] == pytest.approx(evaluate.eval_loss(model, held)["loss"], rel=1e-5)
    assert rep["exact_match"]["reverse"]["n"] == 4
    assert rep["pruning"]["source"] == "task:upper"
    half = evaluate.eval_loss(evaluate.magnitude_prune(model, 0.5), held)["loss"]
    assert rep["pruning"]["results"]["0.5"]["loss"] == pytest.approx(half, rel=1e-5)
    assert "held-out task:add" in capsys.readouterr().out


def test_answer_loss_counts_only_answer_tokens(model, tok):
    exs = tasks.examples("copy", 5, seed=9)
    total, count = 0.0, 0
    for e in exs:  # one example at a time, by hand
        p = [tok.eos_token_id] + tok.encode(e.prompt, add_special_tokens=False)
        a = tok.encode(" " + e.answer + "\n", add_special_tokens=False)
        x = torch.tensor([p + a])
        with torch.no_grad():
            logp = model(input_ids=x).logits.float().log_softmax(-1)[0]
        for j, t in enumerate(a):
            total -= logp[len(p) - 1 + j, t].item()
            count += 1
    got = evaluate.answer_loss(model, tok, "copy", n=5, seed=9, batch_size=2)
    assert got["tokens"] == count
    assert got["loss"] == pytest.approx(total / count, rel=1e-5)
    def peeks(x):  # "predicts" each next token by reading it: a perfect model
        out = torch.full((*x.shape, len(tok)), -30.0)
        out[:, :-1].scatter_(2, x[:, 1:, None], 30.0)
        return out
    assert evaluate.answer_loss(peeks, tok, "copy", n=5, seed=9)["loss"] < 1e-6
