"""What the subspace constraint costs a pretrained model before any training: one forward
pass over held-out sequences after ``orchestration.subspace.constraint.constrain_`` (every o_proj /
down_proj projected onto span(U)), for a U fitted to the output projections and a seeded
random U, at each width k.

    python bench/subspace_constraint_probe.py [--model M] [--data D] [--ks 24,12,6] [--sequences 16]

Prints the base model's held-out loss, then one line per (k, basis). The results and the
commands are in docs/heterogeneous.md."""
import argparse

import torch

from orchestration.subspace import constraint as sub
from orchestration.config import parse_args
from orchestration.models.loading import load_causal_lm
from orchestration.models.scoring import eval_loss
from orchestration.train import prepare


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="base model (default: the trainer's default model)")
    ap.add_argument("--data", default="corpus:prose")
    ap.add_argument("--ks", default="24,12,6", help="subspace widths")
    ap.add_argument("--sequences", type=int, default=16, help="held-out sequences of 128 tokens")
    a = ap.parse_args()
    torch.set_num_threads(1)
    cfg, _ = parse_args((["--model", a.model] if a.model else []) + ["--data", a.data, "--data.seq-len", "128"])
    plan = prepare(cfg, load_model=False)
    rows = plan.eval_rows[:a.sequences]
    base, _ = load_causal_lm(plan.model_path)
    H = base.config.hidden_size
    print(f"model {plan.model_path} (H={H}), {a.data}, {len(rows)} held-out sequences: "
          f"base loss {eval_loss(base, rows)['loss']:.4f}", flush=True)
    for k in (int(k) for k in a.ks.split(",")):
        for kind in ("fitted", "random"):
            m, _ = load_causal_lm(plan.model_path)
            U = sub.make_basis(H, k, seed=0, model=m if kind == "fitted" else None)
            sub.constrain_(m, U)
            print(f"k={k:4d} ({H / k:4.0f}x fewer PP bytes than dense fp32) {kind:6s}: "
                  f"loss {eval_loss(m, rows)['loss']:.4f}", flush=True)


if __name__ == "__main__":
    main()
