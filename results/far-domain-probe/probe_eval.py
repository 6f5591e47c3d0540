"""Issue #43 far-domain probe: the held-out loss of the base model and of a dense run's
step-N checkpoint on the trainer's own held-out rows (the first 32 of the split, as
orchestration.experiments scores them). The dense run is an ordinary 200-step row of
orchestration.experiments (so its schedule is the long runs' one), stopped after its step-N
checkpoint; the same row resumes later from there.

    python results/far-domain-probe/probe_eval.py RUN_DIR STEP OUT.json
"""
import json
import os
import sys
import time

import torch

from orchestration.components import checkpoint as ckpt
from orchestration.experiments.evaluation import _plan_for
from orchestration.models.loading import load_causal_lm
from orchestration.models.scoring import eval_loss

torch.set_num_threads(1)
run_dir, step, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
argv = json.load(open(os.path.join(run_dir, "row.json")))["trainer_argv"]
cfg, plan = _plan_for(argv)
held = plan.eval_rows[:32]
rec = {"run_dir": run_dir, "data": cfg.data.source, "seed": cfg.train.seed, "trainer_argv": argv,
       "eval_sequences": int(held.shape[0])}
for s, path in [(0, plan.model_path)] + ckpt.complete_checkpoints(os.path.join(run_dir, "checkpoints")):
    if s not in (0, step):
        continue
    t = time.time()
    model, _ = load_causal_lm(path)
    rec[f"loss@{s}"] = eval_loss(model, held)["loss"]
    print(f"step {s}: {rec[f'loss@{s}']:.4f} ({time.time() - t:.0f} s)", flush=True)
rec["gain@%d" % step] = rec["loss@0"] - rec[f"loss@{step}"]
json.dump(rec, open(out, "w"), indent=1)
print(json.dumps({k: v for k, v in rec.items() if "@" in k}))
