"""Pretraining: a tiny run end to end, its output format, determinism, the CLI."""
import json

import pytest
import torch
from safetensors.torch import load_file

from orchestration import evaluate

from orchestration.data import corpora

from orchestration.data import tokens as data

from orchestration.models import loading as models

from orchestration.models import pretrain

TINY = dict(steps=4, seq_len=16, batch_size=2, threads=1, vocab_size=300, max_corpus_bytes=20_000,
            eval_batches=1, warmup_steps=2)


def _weights(path):
    return load_file(str(next(path.glob("*.safetensors"))))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pt") / "base"
    meta = pretrain.pretrain(out, pretrain.PretrainConfig(**TINY), progress=False)
    return out, meta


def test_tiny_run_writes_loadable_checkpoint(tiny_run):
    out, meta = tiny_run
    assert models.is_complete_checkpoint(out)
    model, tok_path = models.load_causal_lm(out)
    tok = data.load_tokenizer(tok_path)
    assert len(tok) == model.config.vocab_size == 300
    assert json.loads((out / models.METADATA_FILE).read_text()) == json.loads(json.dumps(meta))
    assert set(meta["held_out"]) == {"prose", "python"}
    assert meta["train_tokens"] == 4 * 2 * 16 and len(meta["train_loss_curve"]) == 4
    # the saved weights are the trained ones: re-evaluating reproduces the recorded loss
    docs = corpora.load_corpus("prose", max_bytes=20_000)
    ds = data.build_token_dataset(docs, tok, 16).split(0.02, seed=0)[1]
    assert evaluate.eval_loss(model, ds, max_batches=1)["loss"] == pytest.approx(
        meta["held_out"]["prose"]["loss"], rel=1e-5)


def test_loss_decreases_from_init(tiny_run):
    _, meta = tiny_run
    assert meta["held_out"]["prose"]["loss"] < torch.log(torch.tensor(300.0)).item()


def test_deterministic_for_fixed_seed(tiny_run, tmp_path):
    out, meta = tiny_run
    again = pretrain.pretrain(tmp_path / "again", pretrain.PretrainConfig(**TINY), progress=False)
    a, b = _weights(out), _weights(tmp_path / "again")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert again["train_loss_curve"] == meta["train_loss_curve"]
    other = pretrain.pretrain(tmp_path / "seed1", pretrain.PretrainConfig(**{**TINY, "seed": 1}),
                              progress=False)
    c = _weights(tmp_path / "seed1")
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert other["train_loss_curve"] != meta["train_loss_curve"]


def test_refuses_to_overwrite(tiny_run):
    out, _ = tiny_run
    with pytest.raises(FileExistsError, match="not empty"):
        pretrain.pretrain(out, pretrain.PretrainConfig(**TINY), progress=False)


def test_bad_settings_rejected(tmp_path):
    with pytest.raises(ValueError, match="steps must be a positive int"):
        pretrain.pretrain(tmp_path / "x", pretrain.PretrainConfig(steps=0))
    assert not (tmp_path / "x").exists()


def test_lr_schedule_warmup_then_cosine():
    cfg = pretrain.PretrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    assert pretrain.lr_at(0, cfg) == pytest.approx(0.1)
    assert pretrain.lr_at(9, cfg) == pytest.approx(1.0)
    assert pretrain.lr_at(10, cfg) == pytest.approx(1.0)
    assert pretrain.lr_at(55, cfg) == pytest.approx(0.55)   # halfway down the cosine
    assert pretrain.lr_at(100, cfg) == pytest.approx(0.1)


def test_cli_help_documents_flags(capsys):
    with pytest.raises(SystemExit) as e:
        pretrain.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--out", "--steps", "--seq-len", "--batch-size", "--lr", "--seed", "--threads"):
        assert flag in out


def test_cli_runs(tmp_path, capsys):
    pretrain.main(["--out", str(tmp_path / "cli"), "--steps", "2", "--seq-len", "16", "--batch-size", "2",
                   "--threads", "1", "--vocab-size", "300", "--max-corpus-bytes", "20000", "--no-progress"])
    assert models.is_complete_checkpoint(tmp_path / "cli")
    assert "final train loss" in capsys.readouterr().out


def test_init_from_continues_a_checkpoint_on_another_source(tiny_run, tmp_path):
    out, meta = tiny_run
    cfg = pretrain.PretrainConfig(**{**TINY, "init_from": str(out), "corpus": "task:add",
                                     "eval_corpora": ("python",), "lr": 1e-2})
    adapted = pretrain.pretrain(tmp_path / "adapted", cfg, progress=False)
    assert adapted["held_out_initial"]["python"] == pytest.approx(meta["held_out"]["python"])
    assert set(adapted["held_out"]) == {"task:add", "python"}
    assert adapted["held_out"]["task:add"]["loss"] < adapted["held_out_initial"]["task:add"]["loss"]
    assert (tmp_path / "adapted" / "tokenizer.json").read_text() == (out / "tokenizer.json").read_text()
    with pytest.raises(FileNotFoundError):
        pretrain.pretrain(tmp_path / "x", pretrain.PretrainConfig(**{**TINY, "init_from": str(tmp_path / "none")}))
