"""Test-wide settings.

- One thread per process: these machines have 2 cores, and OpenMP spin-waiting with
  another busy process made 2-thread runs 40x slower.
- Without a GPU, Triton kernels run in the interpreter (TRITON_INTERPRET=1). It must be
  set before triton.jit decorates any kernel, hence here, at collection time.
"""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1)


import glob  # noqa: E402
import sysconfig  # noqa: E402

import pytest  # noqa: E402


def build_tiny_model_dir(root, num_layers=4, text_chars=120_000):
    """A tiny Llama (H=40, GQA, untied) + offline BPE tokenizer saved as an HF directory
    under ``root/model``, and ``root/data.txt`` (stdlib json sources). Deterministic."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from orchestration.data.tokens import train_bpe

    src = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")))
    text = "\n".join(open(f).read() for f in src)[:text_chars]
    (root / "data.txt").write_text(text)
    tok = train_bpe([text], vocab_size=300)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=40, intermediate_size=64,
                                         num_hidden_layers=num_layers, num_attention_heads=4,
                                         num_key_value_heads=2, max_position_embeddings=64,
                                         tie_word_embeddings=False))
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    return root


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """The shared 4-layer tiny model directory of the trainer/anchor tests (read-only)."""
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_factory(tmp_path_factory):
    """Build another tiny model directory: ``tiny_factory(name, num_layers=.., text_chars=..)``."""
    return lambda name, **kw: build_tiny_model_dir(tmp_path_factory.mktemp(name), **kw)
