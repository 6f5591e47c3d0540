"""Position 0 at the boundary (layer 15 output) of the base model on corpus:locales, 8 held-out rows:
how much of it the int8 absmax round trip zeroes (issue #43 item 2).   PYTHONPATH=. python results/far-locales-long/sink_stats.py"""
import json, torch
from orchestration.experiments.evaluation import _plan_for
from orchestration.models.loading import load_causal_lm
from orchestration.distributed.stages import split_model
torch.set_num_threads(1)
argv = json.load(open("runs/probe-locales/pcanf-s0/row.json"))["trainer_argv"]
cfg, plan = _plan_for(argv)
model, _ = load_causal_lm(plan.model_path)
s0, s1 = split_model(model, 2, None)
with torch.no_grad():
    h = s0(plan.eval_rows[:8])
h0 = h[:, 0].float()
amax = h0.abs().amax(-1, keepdim=True)
scale = amax / 127
zero = (h0.abs() < scale / 2).float().mean().item()
top = h0.abs().topk(3, -1)
print("absmax per row", amax.squeeze().tolist())
print("top dims", top.indices[0].tolist(), top.values[0].tolist())
print("share of dims rounded to 0:", zero)
e = h0.pow(2)
print("energy share of zeroed dims:", (e * (h0.abs() < scale / 2)).sum().item() / e.sum().item())
print("pos>=1 norm mean", h[:, 1:].norm(dim=-1).mean().item(), "pos0 norm", h0.norm(dim=-1).mean().item())
