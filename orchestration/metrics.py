"""Byte accounting per link/direction/axis, JSONL metrics, progress bar, summary table.

Axes: "pp_fwd" (activations between stages), "pp_bwd" (activation gradients),
"dp" (replica sync: gradient all-reduce or DiLoCo fragments, as counted by the
compressor / StreamingDiLoCo), "anchor" (anchor <-> fast traffic). Every rank counts
the bytes it SENDS, so summing over ranks counts each byte on the wire once.
"""
from __future__ import annotations

import json
import os
from collections import defaultdict

import torch
import torch.distributed as dist

AXES = ("pp_fwd", "pp_bwd", "dp", "anchor")


class LinkCounter:
    """Exact bytes sent by this rank, per (axis, src, dst) link; never reset (totals)."""

    def __init__(self):
        self.links: dict[tuple[str, int, int], int] = defaultdict(int)
        self.extra: dict[str, int] = defaultdict(int)  # axis totals reported without a link (e.g. DP)

    def add(self, axis: str, src: int, dst: int, nbytes: int) -> None:
        if axis not in AXES:
            raise ValueError(f"unknown axis {axis!r}; known: {AXES}")
        self.links[(axis, src, dst)] += int(nbytes)

    def set_total(self, axis: str, nbytes: int) -> None:
        """Records a running total kept elsewhere (e.g. a compressor's bytes_sent)."""
        if axis not in AXES:
            raise ValueError(f"unknown axis {axis!r}; known: {AXES}")
        self.extra[axis] = int(nbytes)

    def totals(self) -> dict[str, int]:
        out = {a: 0 for a in AXES}
        for (axis, _, _), n in self.links.items():
            out[axis] += n
        for axis, n in self.extra.items():
            out[axis] += n
        return out

    def by_link(self) -> dict[str, int]:
        return {f"{a}:{s}->{d}": n for (a, s, d), n in sorted(self.links.items())}

    def state_dict(self) -> dict:
        return {"links": [[a, s, d, n] for (a, s, d), n in self.links.items()], "extra": dict(self.extra)}

    def load_state_dict(self, sd: dict) -> None:
        self.links = defaultdict(int, {(a, int(s), int(d)): int(n) for a, s, d, n in sd["links"]})
        self.extra = defaultdict(int, {k: int(v) for k, v in sd["extra"].items()})


class JsonlWriter:
    """Appends one JSON object per line; flushes every record (a crash loses nothing logged)."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self.f = open(path, "a")

    def write(self, rec: dict) -> None:
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def format_table(rows: list[tuple[str, str]], title: str = "") -> str:
    """A two-column text table."""
    w = max(len(k) for k, _ in rows)
    lines = [title, "-" * max(len(title), w + 30)] if title else []
    lines += [f"{k:<{w}}  {v}" for k, v in rows]
    return "\n".join(lines)


def summary_rows(s: dict) -> list[tuple[str, str]]:
    """Rows of the final table from the summary dict written by the train loop."""
    rows = [
        ("mesh", s["mesh"]),
        ("model", s["model"]),
        ("boundary codec", s["codec"]),
        ("DP sync", s["dp"]),
        ("steps", f"{s['steps']}  ({s['tokens']:,} tokens)"),
        ("loss first -> last", f"{s['loss_first']:.4f} -> {s['loss_last']:.4f}"),
    ]
    if s.get("eval_loss") is not None:
        base = s.get("eval_loss_base")
        rows.append(("held-out loss base -> final", (f"{base:.4f} -> " if base is not None else "") + f"{s['eval_loss']:.4f}"))
    rows.append(("measured tokens/s (CPU)", f"{s['tokens_per_s']:.1f}"))
    if s.get("modeled_tokens_per_s") is not None:
        rows.append((f"modeled tokens/s @ {s['bandwidth_bps'] / 1e6:.0f} Mbps", f"{s['modeled_tokens_per_s']:.1f}"))
    for a in AXES:
        rows.append((f"bytes/token {a}", f"{s['bytes_per_token'][a]:.1f}"))
    rows.append(("bytes/token PP (fwd+bwd)", f"{s['bytes_per_token_pp']:.1f}"))
    rows.append(("bytes/token total", f"{s['bytes_per_token_total']:.1f}"))
    if s.get("anchor"):
        a = s["anchor"]
        ms = a.get("mean_staleness")
        rows.append(("anchor updates (rank 0)", f"{a.get('applied', 0)} applied of {a.get('arrivals', 0)} arrived, "
                     f"{a.get('rejected', 0)} rejected, mean staleness "
                     f"{'n/a' if ms is None else f'{ms:.1f}'} steps, "
                     + ("no anchor ever linked" if a.get("generation") == 0 else
                        f"link {a.get('link', '?')} (anchor row generation {a.get('generation', '?')})")))
    if s.get("checkpoint"):
        rows.append(("checkpoint", s["checkpoint"]))
    rows.append(("metrics", s["metrics_path"]))
    if s.get("links_path"):
        rows.append(("bytes per link", s["links_path"]))
    return rows


# ------------------------------------------------------------ end-of-run records
def write_link_bytes(plan, mesh, counter: LinkCounter) -> str:
    """Every fast rank writes the bytes it sent per (axis, src -> dst) link; rank 0 merges
    them into RUN_DIR/link_bytes.json (files, not pickles over the network)."""

    d = os.path.join(plan.run_dir, "link_bytes")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"rank_{mesh.rank:05d}.json"), "w") as f:
        json.dump({"links": counter.by_link(), "totals": counter.totals()}, f)
    dist.barrier(group=mesh.fast)
    path = os.path.join(plan.run_dir, "link_bytes.json")
    if mesh.rank == 0:
        merged = {"links": {}, "per_rank": {}}
        for r in mesh.layout.fast_ranks():
            with open(os.path.join(d, f"rank_{r:05d}.json")) as f:
                rec = json.load(f)
            merged["links"].update(rec["links"])
            merged["per_rank"][str(r)] = rec["totals"]
        with open(path, "w") as f:
            json.dump(merged, f, indent=1, sort_keys=True)
    return path


def held_out_loss(cfg, plan, path: str):
    """Mean next-token loss of the exported checkpoint on up to --run.eval_sequences held-out rows."""
    if plan.eval_rows is None or not path or cfg.run.eval_sequences == 0:
        return None
    from orchestration.evaluate import eval_loss
    from orchestration.models import load_causal_lm

    model, _ = load_causal_lm(path, dtype=getattr(torch, cfg.model.dtype))
    return eval_loss(model, plan.eval_rows[:cfg.run.eval_sequences])["loss"]


def summarize(cfg, plan, history: list[dict], elapsed: float, steps_done: int, last_ckpt: str) -> dict:
    """The run's summary (rank 0): what ``summary_rows`` prints and what run_rank returns."""
    last = history[-1]
    t = cfg.train
    tokens_run = steps_done * cfg.fast_rows * t.batch_size * cfg.data.seq_len
    bpt = last["bytes_per_token"]
    model = modeled_step(cfg, plan, history)
    s = {
        "mesh": f"{cfg.mesh.rows}x{cfg.mesh.stages} ({cfg.fast_rows} fast replicas"
                + (" + anchor" if cfg.anchor.enabled else "") + f" x {cfg.mesh.stages} stages)",
        "model": f"{plan.arch} ({plan.num_layers} layers, H={plan.hidden_size}) from {plan.model_path}",
        "codec": cfg.boundary.codec + (f" p={cfg.boundary.p}" if cfg.boundary.codec in ("mask", "topk", "bottleneck") else ""),
        "dp": cfg.dp.mode + ("" if cfg.dp.mode == "none" else f" + {cfg.dp.compressor}"),
        "steps": last["step"], "tokens": last["tokens"],
        "loss_first": history[0]["loss"], "loss_last": last["loss"],
        "tokens_per_s": tokens_run / max(elapsed, 1e-9),
        "bytes_per_token": bpt, "bytes_per_token_pp": bpt["pp_fwd"] + bpt["pp_bwd"],
        "bytes_per_token_total": sum(bpt.values()),
        "bandwidth_bps": cfg.run.bandwidth_bps,
        "modeled_tokens_per_s": None if model is None else model.tokens_per_s,
        "modeled_limit": None if model is None else model.limiting,
        "checkpoint": last_ckpt, "metrics_path": os.path.join(plan.run_dir, "metrics.jsonl"),
    }
    if cfg.anchor.enabled:  # rank 0's view of the anchor hook (orchestration.anchor stats)
        s["anchor"] = {k[len("anchor_"):]: v for k, v in last.items()
                       if k in ("anchor_arrivals", "anchor_applied", "anchor_rejected", "anchor_mean_staleness",
                                "anchor_link", "anchor_prior_on", "anchor_generation")}
    return s


def modeled_step(cfg, plan, history: list[dict]):
    """The link model's step (orchestration.linkmodel.model_step) at --run.bandwidth_bps and
    --run.latency_s, replaying this run's schedule with its measured per-stage compute times
    (median over steps, the first step excluded as warm-up) and its exact byte counts."""
    from orchestration import linkmodel
    from orchestration.codecs import make_codec
    from orchestration.schedule import make_schedule

    t, Y, X = cfg.train, cfg.mesh.stages, cfg.fast_rows
    hist = history[1:] or history
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    compute = {"F": [med([h["fwd_s"][s] for h in hist]) for s in range(Y)],
               "B": [med([h["bwd_s"][s] for h in hist]) for s in range(Y)]}
    codec = make_codec(cfg.boundary.codec, p=cfg.boundary.p, rescale=cfg.boundary.rescale, **cfg.boundary.options)
    shape = (t.batch_size // t.microbatches, cfg.data.seq_len, plan.hidden_size)
    dtype = getattr(torch, cfg.model.dtype)
    msg = {"F": codec.wire_bytes(shape, dtype, "fwd"), "B": codec.wire_bytes(shape, dtype, "bwd")}
    # Measured DP bytes each node sent per step (ring all-reduce), back to the payload.
    n = history[-1]["step"]  # counters are cumulative since step 0 (restored on resume)
    ring = 2.0 * (X - 1) / X if X > 1 else 1.0
    dp_payload = [history[-1]["dp_bytes_by_stage"][s] / n / X / ring for s in range(Y)]
    anchor = history[-1]["bytes"]["anchor"] / n / max(1, X * Y)
    return linkmodel.model_step(make_schedule(t.schedule, Y, t.microbatches), compute, msg,
                                linkmodel.LinkSpec(cfg.run.bandwidth_bps, cfg.run.latency_s),
                                replicas=X, tokens_per_replica=t.batch_size * cfg.data.seq_len,
                                dp_payload_bytes=dp_payload, dp_blocking=cfg.dp.mode == "allreduce",
                                anchor_up_bytes=anchor)
