"""Usage: python docs/results/real-prose/base_codec_on.py DATA OUT.json ROWS [RUN_ROOT]
(ROWS e.g. m95,pca4; RUN_ROOT: the experiments' --work, needed for pca rows)

Codec-on held-out loss of the BASE model (no training), per seed and codec, on the exact
held-out rows of the experiment: the reference for the trained rows' codec-on loss.
Same as docs/results/real/base_codec_on.py, plus: the prose table's trainer args, and for
a pca row the basis the run of that seed fitted and trained with (RUN_ROOT/<row>-s<seed>/
pca_basis.pt), so the base model is scored through the very codec the row trained with."""
import json, os, sys, time
import torch
from orchestration.experiments import cli, evaluation, rows as experiment_rows
from orchestration.models.loading import load_causal_lm
torch.set_num_threads(1)
data, out = sys.argv[1], sys.argv[2]
rows = sys.argv[3].split(",")
run_root = sys.argv[4] if len(sys.argv) > 4 else None
a = cli.build_parser().parse_args(["--model", "smollm2-135m", "--data", data, "--fast-rows", "1", "--stages", "2",
    "--batch-size", "4", "--microbatches", "2", "--seq-len", "128", "--steps", "20", "--eval-every", "10",
    "--eval-sequences", "16", "--prune", "none", "--trainer-args", "--train.lr 2e-5 --anchor.transport dense"])
s = cli.settings_from(a)
res = {"settings": s.key(), "data": data, "rows": {}}
model = None
for row in rows:
    for seed in (0, 1, 2):
        argv = experiment_rows.trainer_argv(experiment_rows.ROW_BY_NAME[row], seed, s, "/tmp/x", "x")
        cfg, plan = evaluation._plan_for(argv)
        held = plan.eval_rows[:s.eval_sequences]
        if model is None:
            model, _ = load_causal_lm(plan.model_path)
        run_dir = os.path.join(run_root, f"{row}-s{seed}") if run_root else None
        if cfg.boundary.codec == "pca" and not (run_dir and os.path.exists(os.path.join(run_dir, "pca_basis.pt"))):
            print(row, seed, "skipped: no", run_dir and os.path.join(run_dir, "pca_basis.pt"), flush=True)
            continue
        t = time.time()
        r = evaluation.codec_eval_loss(model, held, cfg, seed=seed, step=s.steps, run_dir=run_dir)
        res["rows"].setdefault(row, {})[str(seed)] = r["loss"]
        print(row, seed, cfg.boundary.codec, r["loss"], f"{time.time()-t:.0f}s", flush=True)
json.dump(res, open(out, "w"), indent=1)
