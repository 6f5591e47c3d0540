"""Models: default config, loading local checkpoints, the cached base model build."""
import json
import threading
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from orchestration.data import tokens as data

from orchestration.models import paths as model_paths

from orchestration.models import loading as models

from orchestration.models import pretrain


TINY = pretrain.PretrainConfig(steps=2, seq_len=16, batch_size=2, threads=1, vocab_size=300,
                               max_corpus_bytes=20_000, eval_batches=1)


def _tiny_checkpoint(path: Path, with_tokenizer=True):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    if with_tokenizer:
        data.train_bpe(["hello world, some text to learn from " * 20], vocab_size=300).save_pretrained(str(path))
    return model


def test_default_config_is_small_untied_llama():
    cfg = models.default_config()
    assert cfg.model_type == "llama" and cfg.vocab_size == 2048 and not cfg.tie_word_embeddings
    n = sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())
    assert 1e6 < n < 5e6  # trains in minutes on 2 CPU cores
    assert models.default_config(vocab_size=512, num_hidden_layers=2).num_hidden_layers == 2


def test_load_causal_lm_roundtrip(tmp_path):
    ref = _tiny_checkpoint(tmp_path / "m")
    model, tok_path = models.load_causal_lm(tmp_path / "m")
    assert tok_path == str(tmp_path / "m") and not model.training
    x = torch.randint(0, 300, (2, 10))
    ref.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, ref(input_ids=x).logits)
    assert list((tmp_path / "m").glob("*.safetensors"))
    _tiny_checkpoint(tmp_path / "notok", with_tokenizer=False)
    assert models.load_causal_lm(tmp_path / "notok")[1] is None


def test_load_causal_lm_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        models.load_causal_lm(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        models.load_causal_lm(tmp_path)
    (tmp_path / "weird").mkdir()
    (tmp_path / "weird" / "config.json").write_text(json.dumps({"model_type": "no-such-arch"}))
    with pytest.raises(ValueError, match="unknown model architecture"):
        models.load_causal_lm(tmp_path / "weird")


def test_cache_root_env(monkeypatch, tmp_path):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "c"))
    assert models.cache_root() == tmp_path / "c"
    assert models.cache_root(tmp_path / "x") == tmp_path / "x"
    monkeypatch.delenv(models.CACHE_ENV)
    assert models.cache_root() == Path.home() / ".cache" / "meshkern"


def test_default_base_model_builds_once_atomically(monkeypatch, tmp_path):
    calls = []
    real = pretrain.pretrain

    def tiny(out, cfg, **kw):
        calls.append(out)
        return real(out, TINY, **kw)

    monkeypatch.setattr(pretrain, "pretrain", tiny)
    paths = []
    threads = [threading.Thread(target=lambda: paths.append(
        model_paths.default_base_model(tmp_path, progress=False))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(paths)) == 1  # the lock let one caller build
    path = Path(paths[0])
    assert path == tmp_path / models.BASE_MODEL_VERSION and models.is_complete_checkpoint(path)
    model, tok = models.load_causal_lm(path)
    assert tok == str(path) and model.config.vocab_size == 300
    assert models.read_metadata(path)["config"]["steps"] == 2
    assert model_paths.default_base_model(tmp_path, progress=False) == str(path) and len(calls) == 1
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == [models.BASE_MODEL_VERSION]


class _InterruptingJson:
    """Stands in for the json module in pretrain: the interrupt comes after the model
    and tokenizer are written, while the metadata is being written."""
    @staticmethod
    def dumps(*a, **k):
        raise KeyboardInterrupt


def test_interrupted_build_leaves_no_checkpoint(monkeypatch, tmp_path):
    monkeypatch.setattr(pretrain, "PretrainConfig", lambda: TINY)
    monkeypatch.setattr(pretrain, "json", _InterruptingJson)
    with pytest.raises(KeyboardInterrupt):
        model_paths.default_base_model(tmp_path, progress=False)
    assert not (tmp_path / models.BASE_MODEL_VERSION).exists()
    assert [p.name for p in tmp_path.iterdir()] == [f"{models.BASE_MODEL_VERSION}.lock"]  # no temp dir left
