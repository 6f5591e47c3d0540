"""Evaluation: held-out loss/perplexity (orchestration.models.scoring), exact match on synthetic
tasks by greedy generation, and robustness to magnitude pruning;
``python -m orchestration.evaluate``.

Every function accepts either a Hugging Face causal LM or a plain callable
``input_ids [B, T] int64 -> logits [B, T, V]`` (how a staged / pipelined model is
evaluated: chain the stages in that callable, or pass the list of stages, which are
then called one after the other on the previous one's output).
"""
from __future__ import annotations

import copy
import sys
from typing import Sequence

import torch

from orchestration.models.scoring import LogitsFn, _logits_of, _rows, as_logits_fn, eval_loss  # noqa: F401


@torch.no_grad()
def greedy_generate(model_or_stages, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int, *,
                    stop_ids: set[int] | frozenset = frozenset(), batch_size: int = 32
                    ) -> list[list[int]]:
    """Greedy continuation of each prompt (argmax, no sampling, no KV cache: the
    whole sequence is re-run each step, which also works for staged models).

    Prompts of equal length are batched together, so no padding enters the model and
    a row's output equals what the model produces for that prompt alone. A row stops
    after emitting a token in ``stop_ids`` (that token is kept) or ``max_new_tokens``.
    """
    fn = as_logits_fn(model_or_stages)
    out: list[list[int] | None] = [None] * len(prompt_ids)
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompt_ids):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        by_len.setdefault(len(p), []).append(i)
    for _, idx in sorted(by_len.items()):
        for s in range(0, len(idx), batch_size):
            rows = idx[s:s + batch_size]
            x = torch.tensor([list(prompt_ids[i]) for i in rows], dtype=torch.int64)
            done = torch.zeros(len(rows), dtype=torch.bool)
            gen = []
            for _ in range(max_new_tokens):
                nxt = fn(x)[:, -1].argmax(-1)
                gen.append(nxt)
                x = torch.cat([x, nxt[:, None]], dim=1)
                done |= torch.tensor([int(t) in stop_ids for t in nxt])
                if bool(done.all()):
                    break
            g = torch.stack(gen, 1).tolist() if gen else [[] for _ in rows]
            for r, i in enumerate(rows):
                ids = g[r]
                cut = next((k + 1 for k, t in enumerate(ids) if t in stop_ids), len(ids))
                out[i] = ids[:cut]
    return out  # type: ignore[return-value]


def _task_prompts(tok, task, n: int, seed: int | None):
    """(examples, separator id, prompt ids): ``n`` examples of ``task`` (evaluation seed by
    default), each prompt preceded by the document separator as in packed training data."""
    from orchestration.data import tokens as data
    from orchestration.data import tasks

    exs = tasks.examples(task, n, seed=tasks.EVAL_SEED if seed is None else seed)
    sep = data.separator_id(tok)
    prefix = [sep] if sep is not None else []
    return exs, sep, [prefix + tok.encode(e.prompt, add_special_tokens=False) for e in exs]


def exact_match(model_or_stages, tokenizer, task, *, n: int = 100, seed: int | None = None,
                max_new_tokens: int | None = None, batch_size: int = 32) -> dict:
    """Exact-match accuracy on ``n`` fresh examples of a synthetic task by greedy
    generation (``orchestration.data.tasks``; evaluation seed by default).

    Each prompt is preceded by the tokenizer's document separator (eos, else bos),
    as every document is in packed training data. Generation stops at the eos or at
    a token that decodes to a newline; the answer is the text before the newline.
    Returns ``{"accuracy", "n", "samples"}`` (samples: the first 5 (prompt, answer,
    prediction) triples).
    """
    from orchestration.data import tokens as data
    from orchestration.data import tasks

    tok = data.load_tokenizer(tokenizer)
    exs, sep, prompts = _task_prompts(tok, task, n, seed)
    if max_new_tokens is None:  # room for the longest answer + newline, plus slack
        max_new_tokens = max(len(tok.encode(" " + e.answer + "\n", add_special_tokens=False)) for e in exs) + 2
    stop = {sep} if sep is not None else set()
    stop |= {i for i in range(len(tok)) if "\n" in tok.decode([i])}
    gens = greedy_generate(model_or_stages, prompts, max_new_tokens, stop_ids=stop, batch_size=batch_size)
    preds = [tok.decode([t for t in g if t != sep]) for g in gens]
    acc = tasks.exact_match(preds, [e.answer for e in exs])
    return {"accuracy": acc, "n": n,
            "samples": [(e.prompt, e.answer, tasks.extract_answer(p)) for e, p in zip(exs[:5], preds)]}


@torch.no_grad()
def answer_loss(model_or_stages, tokenizer, task, *, n: int = 100, seed: int | None = None,
                batch_size: int = 32) -> dict:
    """Mean negative log-likelihood (nats per token) of the answer tokens
    (``" " + answer + "\\n"``, as in the training text) given the separator and the
    prompt, over ``n`` fresh examples: a continuous companion to :func:`exact_match`,
    informative even where a small model's exact-match accuracy is still ~0.
    Returns ``{"loss", "tokens", "n"}``."""
    from orchestration.data import tokens as data

    tok = data.load_tokenizer(tokenizer)
    fn = as_logits_fn(model_or_stages)
    exs, _, prompts = _task_prompts(tok, task, n, seed)
    rows = []
    for e, p in zip(exs, prompts):
        a = tok.encode(" " + e.answer + "\n", add_special_tokens=False)
        rows.append((p + a, len(p)))
    by_len: dict[int, list[tuple[list[int], int]]] = {}
    for ids, plen in rows:
        by_len.setdefault(len(ids), []).append((ids, plen))
    total, count = 0.0, 0
    for _, group in sorted(by_len.items()):
        for s in range(0, len(group), batch_size):
            chunk = group[s:s + batch_size]
            x = torch.tensor([ids for ids, _ in chunk], dtype=torch.int64)
            logp = fn(x).float().log_softmax(-1)
            for r, (ids, plen) in enumerate(chunk):
                pos = torch.arange(plen - 1, len(ids) - 1)  # positions predicting answer tokens
                total -= logp[r, pos, x[r, pos + 1]].sum().item()
                count += len(pos)
    return {"loss": total / count, "tokens": count, "n": n}


# ----------------------------------------------------------------- pruning
def prunable_weights(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The 2-D weights of the model's ``nn.Linear`` layers except the output head:
    the matrices the method trains and transmits. Embeddings and ``lm_head`` are left
    dense (pruning the vocabulary projections measures tokenizer coverage, not the
    robustness of the learned transformations)."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and not name.endswith("lm_head"):
            out[f"{name}.weight"] = mod.weight
    if not out:
        raise ValueError("model has no nn.Linear weights to prune")
    return out


@torch.no_grad()
def magnitude_prune(model: torch.nn.Module, fraction: float, *, scope: str = "per_matrix",
                    inplace: bool = False) -> torch.nn.Module:
    """Zero the ``fraction`` of smallest-magnitude entries of the prunable weights
    (:func:`prunable_weights`). Returns a pruned deep copy unless ``inplace``.

    ``scope="per_matrix"`` (default) zeroes exactly ``round(fraction * numel)``
    entries of every matrix: each layer keeps the same share, so no layer is wiped
    out because its weights happen to be small in absolute terms. ``scope="global"``
    ranks all prunable entries together (one threshold), zeroing exactly
    ``round(fraction * total)`` of them. Ties are broken by position (topk), so the
    counts are exact.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"prune fraction must be in [0, 1), got {fraction}")
    if scope not in ("per_matrix", "global"):
        raise ValueError(f"scope must be 'per_matrix' or 'global', got {scope!r}")
    target = model if inplace else copy.deepcopy(model)
    weights = list(prunable_weights(target).values())
    if fraction == 0.0:
        return target
    if scope == "per_matrix":
        for w in weights:
            k = round(fraction * w.numel())
            if k:
                idx = w.detach().abs().flatten().topk(k, largest=False).indices
                w.view(-1)[idx] = 0
    else:
        flat = torch.cat([w.detach().abs().flatten().float() for w in weights])
        k = round(fraction * flat.numel())
        idx = flat.topk(k, largest=False).indices if k else flat.new_zeros(0, dtype=torch.int64)
        mask = torch.ones_like(flat, dtype=torch.bool)
        mask[idx] = False
        offset = 0
        for w in weights:
            n = w.numel()
            w.mul_(mask[offset:offset + n].view_as(w).to(w.dtype))
            offset += n
    return target


def pruning_robustness(model: torch.nn.Module, dataset, *, fractions=(0.3, 0.5, 0.7),
                       scope: str = "per_matrix", batch_size: int = 16,
                       max_batches: int | None = None) -> dict:
    """Held-out loss of the model and of magnitude-pruned copies (the model itself is
    not modified). Returns ``{fraction: {"loss", "perplexity", "tokens",
    "loss_increase_pct"}}`` including fraction 0.0 (the unpruned model);
    ``loss_increase_pct`` is 100 * (loss / unpruned loss - 1)."""
    base = eval_loss(model, dataset, batch_size=batch_size, max_batches=max_batches)
    out = {0.0: {**base, "loss_increase_pct": 0.0}}
    for f in fractions:
        r = eval_loss(magnitude_prune(model, f, scope=scope), dataset, batch_size=batch_size,
                      max_batches=max_batches)
        out[float(f)] = {**r, "loss_increase_pct": 100.0 * (r["loss"] / base["loss"] - 1.0)}
    return out


# ----------------------------------------------------------------- CLI
def evaluate_model(model, tokenizer, *, data_sources=("corpus:prose", "corpus:python"),
                   seq_len: int = 128, eval_fraction: float = 0.02, seed: int = 0,
                   max_batches: int | None = 8, batch_size: int = 16, task_names=(),
                   n_task: int = 100, prune_fractions=(), prune_source: str | None = None,
                   prune_scope: str = "per_matrix") -> dict:
    """One evaluation report: held-out loss/perplexity on each data source (the
    ``split(eval_fraction, seed)`` held-out rows, first ``max_batches`` batches),
    exact match per task, and the pruning sweep on ``prune_source`` (default: the
    last data source)."""
    from orchestration.data import tokens as data

    tokenizer = data.load_tokenizer(tokenizer)  # once, not per data source and task
    report: dict = {"held_out": {}, "exact_match": {}, "pruning": {}}
    held = {}
    for src in data_sources:
        ds = data.build_token_dataset(src, tokenizer, seq_len)
        held[src] = ds.split(eval_fraction, seed=seed)[1]
        report["held_out"][src] = eval_loss(model, held[src], batch_size=batch_size,
                                            max_batches=max_batches)
    report["answer_loss"] = {}
    for t in task_names:
        report["exact_match"][t] = exact_match(model, tokenizer, t, n=n_task)
        report["answer_loss"][t] = answer_loss(model, tokenizer, t, n=n_task)
    if prune_fractions:
        src = prune_source or data_sources[-1]
        if src not in held:
            held[src] = data.build_token_dataset(src, tokenizer, seq_len).split(eval_fraction, seed=seed)[1]
        report["pruning"] = {"source": src, "scope": prune_scope, "results": pruning_robustness(
            model, held[src], fractions=prune_fractions, scope=prune_scope,
            batch_size=batch_size, max_batches=max_batches)}
    return report


def main(argv=None):
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m orchestration.evaluate",
                                 description="Held-out loss/perplexity, synthetic-task exact match "
                                             "and magnitude-pruning robustness of a local HF model.")
    ap.add_argument("--model", default=None, help="checkpoint directory, .gguf file or built-in name "
                    "(smollm2-135m); default: the cached base model")
    ap.add_argument("--tokenizer", default=None, help="tokenizer path (default: the model's own)")
    ap.add_argument("--base", default=None, help="--model is a PEFT adapter folder (a LoRA run's RUN_DIR/adapter or "
                    "checkpoint): its base model (default: the one its adapter_config.json names)")
    ap.add_argument("--data", default="corpus:prose,corpus:python",
                    help="comma-separated sources: paths, corpus:<domain>, task:<name>")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--eval-fraction", type=float, default=0.02, help="held-out share of rows")
    ap.add_argument("--seed", type=int, default=0, help="seed of the held-out split")
    ap.add_argument("--max-batches", type=int, default=8, help="held-out batches of 16 rows (0 = all)")
    ap.add_argument("--tasks", default="", help="comma-separated synthetic tasks or 'all'")
    ap.add_argument("--n-task", type=int, default=100, help="examples per task")
    ap.add_argument("--prune", default="", help="comma-separated prune fractions, e.g. 0.3,0.5,0.7")
    ap.add_argument("--prune-scope", default="per_matrix", choices=["per_matrix", "global"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--plain", action="store_true", help="score the plain model: ignore the checkpoint's "
                    "meshkern_boundary.json (position 0's int8 round trip at the boundary layers, which a model "
                    "trained through a pca codec with a sink row is deployed with; docs/codecs.md)")
    ap.add_argument("--json", default=None, help="also write the report to this file")
    a = ap.parse_args(argv)
    try:
        return _run(a)
    except (ValueError, FileNotFoundError, FileExistsError, IsADirectoryError) as e:
        # a user's mistake (a path that does not exist, a bad number, a corrupt checkpoint): one line, rc 2
        print(f"error: {e}", file=sys.stderr)
        return 2


def _check_args(a) -> None:
    """ValueError/FileNotFoundError naming the flag, before anything is loaded."""
    import os

    if a.seq_len < 2:
        raise ValueError(f"--seq-len must be >= 2, got {a.seq_len}")
    if not 0 < a.eval_fraction < 1:
        raise ValueError(f"--eval-fraction must be in (0, 1), got {a.eval_fraction}")
    if a.max_batches < 0:
        raise ValueError(f"--max-batches must be >= 0 (0 = all), got {a.max_batches}")
    if a.n_task < 1:
        raise ValueError(f"--n-task must be >= 1, got {a.n_task}")
    if a.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {a.threads}")
    try:
        fracs = [float(f) for f in a.prune.split(",") if f]
    except ValueError:
        raise ValueError(f"--prune must be comma-separated fractions, e.g. 0.3,0.5, got {a.prune!r}") from None
    if not all(0 <= f < 1 for f in fracs):
        raise ValueError(f"--prune fractions must be in [0, 1), got {a.prune!r}")
    from orchestration.data import tasks

    unknown = [t for t in a.tasks.split(",") if t and a.tasks != "all" and t not in tasks.TASKS]
    if unknown:
        raise ValueError(f"--tasks: unknown task(s) {', '.join(unknown)}; known: {', '.join(sorted(tasks.TASKS))} or all")
    for src in (s for s in a.data.split(",") if s):
        if not src.startswith(("corpus:", "task:")) and not os.path.exists(src):
            raise FileNotFoundError(f"--data source {src!r} does not exist")
    if a.tokenizer and not os.path.exists(a.tokenizer):
        raise FileNotFoundError(f"--tokenizer {a.tokenizer!r} does not exist")
    if a.base and not os.path.isdir(a.base):
        raise FileNotFoundError(f"--base {a.base!r} is not a directory")
    if a.model and not os.path.exists(a.model) and (os.sep in a.model or a.model.endswith(".gguf")):
        raise FileNotFoundError(f"--model {a.model!r} does not exist")


def _run(a) -> int:
    import json
    import os

    _check_args(a)
    torch.set_num_threads(a.threads)
    from orchestration.components import checkpoint

    # the trainer's resolution: default, built-in name (smollm2-135m), .gguf or a directory
    from orchestration.models import paths as model_paths
    from orchestration.models import loading as models
    from orchestration.data import tasks
    path = model_paths.resolve_model(a.model)
    if os.path.isfile(os.path.join(path, "meta.json")):  # a trainer checkpoint: verify its files first
        problem = checkpoint.model_problem(path, checkpoint.verify(path))
        if problem:  # one host's part of a multi-host checkpoint, or a model not (yet) assembled
            raise ValueError(problem)
    model, tok_path = models.load_causal_lm(path, base=a.base,  # an adapter folder: its base, adapters merged in
                                            boundary=not a.plain)  # its boundary transform, as deployed
    tokenizer = a.tokenizer or tok_path
    if tokenizer is None:
        raise ValueError(f"{path} holds no tokenizer; pass --tokenizer")
    task_names = sorted(tasks.TASKS) if a.tasks == "all" else [t for t in a.tasks.split(",") if t]
    rep = evaluate_model(model, tokenizer, data_sources=[s for s in a.data.split(",") if s],
                         seq_len=a.seq_len, eval_fraction=a.eval_fraction, seed=a.seed,
                         max_batches=a.max_batches or None, task_names=task_names, n_task=a.n_task,
                         prune_fractions=[float(f) for f in a.prune.split(",") if f],
                         prune_scope=a.prune_scope)
    print(f"model {path}")
    if getattr(model, "meshkern_boundary", None):
        print(f"boundary transform: position 0's int8 round trip at decoder layers {model.meshkern_boundary['layers']} "
              "(meshkern_boundary.json; --plain: without)")
    for src, r in rep["held_out"].items():
        print(f"held-out {src:24s} loss {r['loss']:.4f}  ppl {r['perplexity']:9.2f}  ({r['tokens']} tokens)")
    for t, r in rep["exact_match"].items():
        print(f"exact match {t:10s} {r['accuracy']:.3f} (n={r['n']})  answer loss "
              f"{rep['answer_loss'][t]['loss']:.3f}  e.g. {r['samples'][0]}")
    if rep["pruning"]:
        print(f"pruning ({rep['pruning']['scope']}) on {rep['pruning']['source']}:")
        for f, r in rep["pruning"]["results"].items():
            print(f"  {f:4.0%}  loss {r['loss']:.4f}  (+{r['loss_increase_pct']:.1f}%)")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rep, fh, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
