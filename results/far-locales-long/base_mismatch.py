"""The base model's boundary mismatch on any domain (issue #43 item 2): the default codec's
basis fitted as a pcanf run of seed 0 fits it (64 of the run's training rows, the
trainer's calibration rule), then orchestration.diagnose.mismatch.measure on the run's
held-out rows (the first 32), the variants given.

    PYTHONPATH=. python results/far-locales-long/base_mismatch.py corpus:python OUT.jsonl codec,span,quant,sink [bos]

With ``bos`` every held-out row's first token is replaced by the tokenizer's BOS token
(a prompt as deployed starts with it; the packed rows start mid-document).
"""
import json
import sys

import torch

from orchestration import codecs
from orchestration.components import calibration
from orchestration.diagnose import mismatch
from orchestration.experiments.evaluation import _plan_for
from orchestration.models.loading import load_causal_lm

torch.set_num_threads(1)
data, out, only = sys.argv[1], sys.argv[2], tuple(v for v in sys.argv[3].split(",") if v)
bos = len(sys.argv) > 4 and sys.argv[4] == "bos"
argv = ["--preset", "pca4", "--boundary.options", json.dumps({"quant": "nf", "budget": 15, "sink": True, "calib_rows": 64}),
        "--model", "smollm2-135m", "--data", data, "--mesh.rows", "1", "--mesh.stages", "2", "--train.steps", "200",
        "--train.batch-size", "4", "--train.microbatches", "2", "--data.seq-len", "128", "--data.max-sequences", "0",
        "--train.seed", "0", "--train.lr", "2e-5", "--model.tied-embeddings", "untie"]
cfg, plan = _plan_for(argv)
codec = codecs.codec_for(cfg.boundary)
model, _ = load_causal_lm(plan.model_path)
calib = calibration.calibration_rows(plan.train_rows, codec.calib_rows, cfg.train.seed)
bases = calibration.fit_model_bases(model, calib, codec, cfg.mesh.stages, cfg.mesh.layers_per_stage,
                                    grad_rows=codec.grad_rows)
held = plan.eval_rows[:32].clone()
if bos:
    held[:, 0] = model.config.bos_token_id
recs = mismatch.measure(model, held, codec, bases, cfg.mesh.stages, cfg.mesh.layers_per_stage,
                        top=(), only=only)
with open(out, "w") as f:
    for r in recs:
        r = {"data": data, "step": 0, "first_token": "bos" if bos else "as packed", **r}
        f.write(json.dumps(r) + "\n")
        print(mismatch.format_row(r), flush=True)
