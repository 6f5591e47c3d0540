"""Pretrain the default small Llama densely on the ``prose`` corpus (domain A).

    python -m orchestration.models.pretrain --out runs/base            # defaults: ~2 min on 2 idle cores
    python -m orchestration.models.pretrain --out /tmp/b --steps 20    # a quick smoke run

Single process, plain ``torch.optim.AdamW``, linear warmup then cosine decay, a tqdm
progress bar. It trains a byte-level BPE (vocab 2048) on both embedded domains (so the
tokenizer covers the adaptation domain as a real pretrained model's would), pretrains
on ``prose`` only, and writes a Hugging Face checkpoint (safetensors) plus the
tokenizer and ``meshkern_pretrain.json`` (settings, losses, wall time, corpus
fingerprints, held-out loss on ``prose`` and on ``python``). The output directory is
written atomically (built next to it, then renamed).

``--init-from PATH --corpus python`` instead continues training an existing checkpoint
(with its own tokenizer) on another domain: a single-process dense adaptation
reference, without any mesh.

Deterministic: the same seed, settings, thread count and installed corpus files give
bit-identical weights.
"""
from __future__ import annotations

import argparse
import sys
import dataclasses
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclass
class PretrainConfig:
    """Pretraining settings; defaults are the embedded base model's recipe.

    The defaults were sized on 2 CPU cores: 400 steps of batch 16 x 128 tokens
    (0.82M tokens, < 1 epoch of the 4 MB corpus) cost ~205 CPU-seconds with 2 threads
    (measured), i.e. ~2 minutes on 2 idle cores, and reach a held-out loss of 4.91 on
    prose (6.30 on python). The peak lr 3e-3 suits a 2.6M-parameter model.
    """
    steps: int = 400
    seq_len: int = 128
    batch_size: int = 16
    lr: float = 3e-3
    min_lr_ratio: float = 0.1      # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    threads: int = 2
    vocab_size: int = 2048
    corpus: str = "prose"          # training domain (orchestration.data.corpora) or any data source
    init_from: str | None = None   # continue from this checkpoint (and its tokenizer)
    tokenizer_corpora: tuple[str, ...] = ("prose", "python")
    eval_corpora: tuple[str, ...] = ("prose", "python")
    eval_fraction: float = 0.02
    eval_batches: int = 8          # held-out evaluation: at most 8 x 16 rows per corpus
    max_corpus_bytes: int = 4_000_000

    def validate(self):
        for name in ("steps", "seq_len", "batch_size", "threads", "vocab_size"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.warmup_steps:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")


def lr_at(step: int, cfg: PretrainConfig) -> float:
    """Linear warmup to cfg.lr over warmup_steps, then cosine to lr * min_lr_ratio
    (meshkern.optim.warmup_cosine_lr, the trainer's schedule)."""
    from meshkern.optim import warmup_cosine_lr

    return warmup_cosine_lr(step, lr=cfg.lr, steps=cfg.steps, warmup_steps=cfg.warmup_steps,
                            min_lr_ratio=cfg.min_lr_ratio)


def _texts(name: str, cfg: PretrainConfig) -> list[str]:
    """An embedded domain by name (bounded by max_corpus_bytes), else any data source."""
    from orchestration.data import corpora
    from orchestration.data import tokens as data

    if name in corpora.DOMAINS:
        return corpora.load_corpus(name, max_bytes=cfg.max_corpus_bytes)
    return data.load_texts(name)


def _corpus_datasets(cfg: PretrainConfig, tokenizer):
    from orchestration.data import tokens as data

    out = {}
    for name in dict.fromkeys((cfg.corpus,) + tuple(cfg.eval_corpora)):
        ds = data.build_token_dataset(_texts(name, cfg), tokenizer, cfg.seq_len)
        out[name] = ds.split(cfg.eval_fraction, seed=cfg.seed)
    return out


def pretrain(out_dir: str | os.PathLike, cfg: PretrainConfig | None = None, *,
             progress: bool = True, overwrite: bool = False) -> dict:
    """Run the pretraining recipe and write the checkpoint to ``out_dir``; returns the
    metadata dict that is also saved as ``meshkern_pretrain.json``."""
    from tqdm.auto import tqdm
    from transformers import LlamaForCausalLM

    from orchestration.data import corpora

    from orchestration.data import tokens as data

    from orchestration.models import loading as models

    from orchestration.models import scoring

    cfg = cfg or PretrainConfig()
    cfg.validate()
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; pass overwrite=True (--overwrite)")
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    try:
        torch.manual_seed(cfg.seed)
        if cfg.init_from:
            model, tok_path = models.load_causal_lm(cfg.init_from, boundary=False)
            if tok_path is None:
                raise ValueError(f"--init-from {cfg.init_from}: the checkpoint holds no tokenizer")
            tokenizer = data.load_tokenizer(tok_path)
        else:
            tok_docs = [d for name in cfg.tokenizer_corpora for d in _texts(name, cfg)]
            tokenizer = data.train_bpe(tok_docs, cfg.vocab_size)
            model = LlamaForCausalLM(models.default_config(vocab_size=len(tokenizer),
                                                           max_position_embeddings=max(1024, cfg.seq_len)))
        sets = _corpus_datasets(cfg, tokenizer)
        train_set = sets[cfg.corpus][0]
        initial = None
        if cfg.init_from:  # where adaptation starts from, on the same held-out rows
            initial = {name: scoring.eval_loss(model, ev, batch_size=16, max_batches=cfg.eval_batches)
                       for name, (_, ev) in sets.items()}
        model.train()
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=cfg.lr, betas=(0.9, 0.95))
        batches = train_set.batches(cfg.batch_size, seed=cfg.seed)
        losses = []
        t_train = time.perf_counter()
        bar = tqdm(range(cfg.steps), desc="pretrain", disable=not progress, dynamic_ncols=True)
        for step in bar:
            for g in opt.param_groups:
                g["lr"] = lr_at(step, cfg)
            x = next(batches)
            loss = model(input_ids=x, labels=x, use_cache=False).loss
            if not torch.isfinite(loss):
                raise FloatingPointError(f"pretraining diverged at step {step} (loss {loss.item()}); "
                                         "lower --lr")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            losses.append(loss.item())
            if step % 10 == 0 or step == cfg.steps - 1:
                bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{lr_at(step, cfg):.1e}")
        train_s = time.perf_counter() - t_train
        model.eval()
        held_out = {name: scoring.eval_loss(model, ev, batch_size=16, max_batches=cfg.eval_batches)
                    for name, (_, ev) in sets.items()}
        tail = losses[-min(20, len(losses)):]
        meta = {
            "version": models.BASE_MODEL_VERSION,
            "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()},
            "parameters": sum(p.numel() for p in model.parameters()),
            "final_train_loss": sum(tail) / len(tail),   # mean of the last 20 steps
            "train_loss_curve": losses[:: max(1, len(losses) // 50)],
            "held_out": held_out,
            "held_out_initial": initial,
            "train_tokens": cfg.steps * cfg.batch_size * cfg.seq_len,
            "train_seconds": train_s,
            "wall_seconds": time.perf_counter() - t0,
            "corpus_fingerprints": {n: corpora.corpus_fingerprint(n, max_bytes=cfg.max_corpus_bytes)
                                    for n in sets if n in corpora.DOMAINS},
            "torch_threads": cfg.threads,
        }
        _write_atomically(out, model, tokenizer, meta, overwrite)
    finally:
        torch.set_num_threads(prev_threads)
    return meta


def _write_atomically(out: Path, model, tokenizer, meta: dict, overwrite: bool):
    from orchestration.models import loading as models

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; a model directory is readable by all
        model.save_pretrained(tmp)  # safetensors
        tokenizer.save_pretrained(tmp)
        (tmp / models.METADATA_FILE).write_text(json.dumps(meta, indent=2))
        if out.exists():
            if not overwrite and any(out.iterdir()):
                raise FileExistsError(f"{out} appeared while pretraining; not overwriting it")
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main(argv=None):
    d = PretrainConfig()
    ap = argparse.ArgumentParser(prog="python -m orchestration.models.pretrain",
                                 description="Pretrain the default small Llama on the embedded "
                                             "'prose' corpus and save it in Hugging Face format.")
    ap.add_argument("--out", required=True, help="output directory (created; must be empty "
                                                 "unless --overwrite)")
    ap.add_argument("--steps", type=int, default=d.steps, help=f"optimizer steps (default {d.steps})")
    ap.add_argument("--seq-len", type=int, default=d.seq_len, help=f"tokens per sequence (default {d.seq_len})")
    ap.add_argument("--batch-size", type=int, default=d.batch_size, help=f"sequences per step (default {d.batch_size})")
    ap.add_argument("--lr", type=float, default=d.lr, help=f"peak learning rate, cosine decay (default {d.lr})")
    ap.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help=f"linear warmup steps (default {d.warmup_steps})")
    ap.add_argument("--seed", type=int, default=d.seed, help=f"seed for init, data order and split (default {d.seed})")
    ap.add_argument("--threads", type=int, default=d.threads, help=f"torch CPU threads (default {d.threads}); "
                    "results are bit-identical only for the same thread count")
    ap.add_argument("--vocab-size", type=int, default=d.vocab_size, help=f"BPE vocabulary (default {d.vocab_size})")
    ap.add_argument("--max-corpus-bytes", type=int, default=d.max_corpus_bytes,
                    help=f"text per corpus domain (default {d.max_corpus_bytes})")
    ap.add_argument("--corpus", default=d.corpus, help=f"training text: an embedded domain "
                    f"(prose, python) or any data source (path, task:<name>) (default {d.corpus})")
    ap.add_argument("--init-from", default=None, help="continue training this checkpoint with its own "
                    "tokenizer instead of training a BPE and a fresh model")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = ap.parse_args(argv)
    cfg = PretrainConfig(steps=a.steps, seq_len=a.seq_len, batch_size=a.batch_size, lr=a.lr,
                         warmup_steps=a.warmup_steps, seed=a.seed, threads=a.threads,
                         vocab_size=a.vocab_size, max_corpus_bytes=a.max_corpus_bytes,
                         corpus=a.corpus, init_from=a.init_from)
    try:
        if a.init_from and not os.path.exists(a.init_from):
            raise FileNotFoundError(f"--init-from {a.init_from!r} does not exist")
        from orchestration.data import corpora

        if a.corpus not in corpora.DOMAINS and not a.corpus.startswith(("corpus:", "task:")) \
                and not os.path.exists(a.corpus):
            raise FileNotFoundError(f"--corpus {a.corpus!r} is neither an embedded domain "
                                    f"({', '.join(corpora.DOMAINS)}) nor an existing path")
        meta = pretrain(a.out, cfg, progress=not a.no_progress, overwrite=a.overwrite)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        # a user's mistake (--steps -1, a missing path, an existing --out): one line, rc 2
        msg = str(e)
        for field in ("steps", "seq_len", "batch_size", "threads", "vocab_size", "lr", "warmup_steps"):
            if msg.startswith(f"{field} must"):
                msg = f"--{field.replace('_', '-')}" + msg[len(field):]
        print(f"error: {msg}", file=sys.stderr)
        return 2
    ho = "  ".join(f"{k}: loss {v['loss']:.3f} ppl {v['perplexity']:.1f}" for k, v in meta["held_out"].items())
    if meta["held_out_initial"]:
        ho += "\n  before: " + "  ".join(f"{k}: loss {v['loss']:.3f}" for k, v in meta["held_out_initial"].items())
    print(f"saved {a.out}  ({meta['parameters'] / 1e6:.2f}M params, {meta['train_tokens']} tokens, "
          f"train {meta['train_seconds']:.0f}s, wall {meta['wall_seconds']:.0f}s)\n"
          f"final train loss {meta['final_train_loss']:.3f}   held-out  {ho}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
