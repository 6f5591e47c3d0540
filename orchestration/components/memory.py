"""How much memory each pipeline stage needs: weights, gradients, optimizer state and
activations, for full fine-tuning or LoRA, from a model's config alone (no weights).

    python -m orchestration.components.memory --model llama-3.2-1b --stages 2 --adapter lora
    python -m orchestration.train ... --dry-run          # the same table for a run's config

``stage_memory(hf_config, ...)`` -> one ``StageMemory`` per stage. Parameters are counted
exactly on a meta-device copy of the model split as the trainer splits it (no memory is
allocated, so an 8B config costs nothing). What is assumed:

- weights in --model.dtype; LoRA adds r x (in + out) fp32 values per adapted linear layer.
- full fine-tuning: a gradient and AdamW's two moments per parameter, in the parameter's
  dtype (torch.optim.AdamW keeps its state in the parameter's dtype); LoRA: the same for
  the adapters only, in fp32. (SpectralAdamW adds the anchor's low-rank state: small.)
- activations kept for the backward pass of one micro-batch of ``m`` sequences of ``T``
  tokens, per decoder layer and token: ACT_PER_TOKEN(H, I, kv) values in the model's dtype
  (the inputs of the norms, projections, attention and MLP: 10 H + 2 kv + 4 I for
  scaled-dot-product attention, which keeps no T x T matrix), plus, on the last stage,
  the fp32 logits and their gradient (2 x V per token), and one more V per token in the
  model's dtype for each transform of the logits a family applies (Gemma's soft-capping
  keeps three: divided, tanh, multiplied; Granite's scaling one). A vocabulary of 256k
  (Gemma) makes these the largest activations by far: give the last stage fewer layers
  (--mesh.layers-per-stage).
- MoE layers (Mixtral, Qwen-MoE): every expert's weights are held (the parameter count is
  exact), but a token computes through its top-k experts only (plus a shared expert), so I
  above is the active width ``families.active_intermediate`` (k x the expert width), plus
  the router's E logits and probabilities per token. A stage holds the activations of
  the micro-batches in flight: under 1F1B stage s of S keeps min(S - s, M) of them, under
  GPipe all M.
Not counted: the framework's own footprint (CUDA context, allocator slack; ~0.3-1 GB per
process), the boundary codec's buffers (a few micro-batches of [m, T, H]) and, on CPU
with fork, the parent's copy of the model.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

# Published geometries (config.json of the Hugging Face checkpoints): plan without downloading.
GEOMETRIES = {  # model_type defaults to llama
    "gemma-2-2b": dict(model_type="gemma2", hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=256000,
                       tie_word_embeddings=True, final_logit_softcapping=30.0),
    "mixtral-8x7b": dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, num_local_experts=8,
                         num_experts_per_tok=2, tie_word_embeddings=False),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          vocab_size=151936, num_experts=128, num_experts_per_tok=8, tie_word_embeddings=False),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, head_dim=64),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, head_dim=128),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, head_dim=64),
}


def geometry_config(name: str):
    """The config of a published geometry (GEOMETRIES)."""
    from transformers import AutoConfig

    from orchestration.models.families import FAMILIES

    if name not in GEOMETRIES:
        raise ValueError(f"unknown geometry {name!r}; known: {', '.join(GEOMETRIES)}")
    kw = dict(GEOMETRIES[name])
    mtype = kw.pop("model_type", "llama")
    return AutoConfig.for_model(mtype, **kw, architectures=[FAMILIES[mtype].causal_lm])


def act_per_token(hidden: int, intermediate: int, kv: int) -> int:
    """Values kept per token and decoder layer for the backward pass (module doc)."""
    return 10 * hidden + 2 * kv + 4 * intermediate


@dataclass
class StageMemory:
    stage: int
    layers: tuple[int, int]
    params: int
    trainable: int
    weights: int
    grads: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations


def stage_memory(hf_config, stages: int, *, layers_per_stage=None, dtype: str = "float32", adapter=None,
                 micro_batch: int = 1, seq_len: int = 2048, microbatches: int = 4, schedule: str = "1f1b"
                 ) -> list[StageMemory]:
    """Bytes per stage (module doc). ``adapter``: an AdapterConfig with kind lora, or None
    (full fine-tuning)."""
    from orchestration.distributed.stages import replica_split, split_model
    from orchestration.models.families import active_intermediate, family_of
    from orchestration.models.loading import meta_model

    model = meta_model(hf_config)
    split = replica_split(hf_config.num_hidden_layers, stages, layers_per_stage)
    parts = split_model(model, stages, split)
    b = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    lora = adapter is not None and adapter.kind == "lora"
    if lora:
        from orchestration.adapters import resolve_targets

        resolve_targets(adapter, hf_config)  # the flags' default means the family's own targets
    targets = set(adapter.target_list()) if lora else set()
    fam = family_of(hf_config)
    H, I = hf_config.hidden_size, active_intermediate(hf_config)
    kv = hf_config.num_key_value_heads * (getattr(hf_config, "head_dim", None) or H // hf_config.num_attention_heads)
    router = 2 * int(getattr(hf_config, fam.experts)) if fam.experts else 0  # router logits + probabilities
    logit_copies = {"softcap": 3 if getattr(hf_config, "final_logit_softcapping", None) else 0,
                    "granite": 1}.get(fam.logits, 0)
    out = []
    for st in parts:
        params = sum(p.numel() for p in {id(p): p for p in st.parameters()}.values())
        lora_n = sum(adapter.rank * (m.in_features + m.out_features) for n, m in st.named_modules()
                     if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in targets and n.startswith("layers."))
        trainable = lora_n if lora else params
        state_b = 4 if lora else b
        in_flight = microbatches if schedule == "gpipe" else min(stages - st.index, microbatches)
        tokens = micro_batch * seq_len
        act = len(st.layers) * (act_per_token(H, I, kv) + router) * tokens * b
        if st.is_last:
            act += 2 * hf_config.vocab_size * tokens * 4 + logit_copies * hf_config.vocab_size * tokens * b
        out.append(StageMemory(st.index, st.layer_range, params + lora_n, trainable,
                               weights=params * b + lora_n * 4, grads=trainable * state_b,
                               optimizer=2 * trainable * state_b, activations=act * in_flight))
    return out


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def format_table(rows: list[StageMemory], title: str = "") -> str:
    """The per-stage table (GiB), one line per stage and a total line."""
    head = f"{'stage':>5}  {'layers':>7}  {'params':>12}  {'trainable':>12}  {'weights':>7}  {'grads':>6}  " \
           f"{'optim':>6}  {'activ':>6}  {'total GiB':>9}"
    lines = ([title] if title else []) + [head]
    for r in rows:
        lines.append(f"{r.stage:>5}  {r.layers[0]:>3}-{r.layers[1] - 1:<3}  {r.params:>12,}  {r.trainable:>12,}  "
                     f"{_gib(r.weights):>7}  {_gib(r.grads):>6}  {_gib(r.optimizer):>6}  {_gib(r.activations):>6}  "
                     f"{_gib(r.total):>9}")
    return "\n".join(lines)


def for_config(cfg, hf_config) -> list[StageMemory]:
    """The table of a trainer Config (its first replica's split, micro-batch and schedule)."""
    t = cfg.train
    return stage_memory(hf_config, cfg.replica_stages[0], layers_per_stage=cfg.mesh.layers_per_stage,
                        dtype=cfg.model.dtype, adapter=cfg.adapter, micro_batch=max(1, t.batch_size // t.microbatches),
                        seq_len=cfg.data.seq_len, microbatches=t.microbatches, schedule=t.schedule)


def banner(cfg, hf_config) -> str:
    """The per-stage memory table of a trainer Config, titled with what it assumes (the
    trainer's start banner and --dry-run)."""
    t = cfg.train
    what = f"LoRA r={cfg.adapter.rank}" if cfg.adapter.kind == "lora" else "full fine-tuning"
    return format_table(for_config(cfg, hf_config), (
        f"memory per stage of replica 0 ({what}, {cfg.model.dtype}, micro-batch {max(1, t.batch_size // t.microbatches)}"
        f" x {cfg.data.seq_len} tokens, {t.microbatches} micro-batches, {t.schedule}; orchestration.components.memory):"))


def main(argv=None) -> int:
    from orchestration.config import AdapterConfig

    ap = argparse.ArgumentParser(prog="python -m orchestration.components.memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.2-1b",
                    help=f"a geometry ({', '.join(GEOMETRIES)}) or a local HF checkpoint directory (its config.json)")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--adapter", default="lora", choices=("none", "lora"))
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank")
    ap.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"))
    a = ap.parse_args(argv)
    try:
        if a.model in GEOMETRIES:
            hf = geometry_config(a.model)
        else:
            from transformers import AutoConfig

            hf = AutoConfig.from_pretrained(a.model, local_files_only=True)
        rows = stage_memory(hf, a.stages, dtype=a.dtype, adapter=AdapterConfig(kind=a.adapter, rank=a.rank),
                            micro_batch=a.micro_batch, seq_len=a.seq_len, microbatches=a.microbatches,
                            schedule=a.schedule)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(rows, f"{a.model}: {a.stages} stages, {a.dtype}, "
                             f"{'LoRA r=' + str(a.rank) if a.adapter == 'lora' else 'full fine-tuning'}, "
                             f"micro-batch {a.micro_batch} x {a.seq_len} tokens, {a.microbatches} micro-batches "
                             f"({a.schedule})"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
