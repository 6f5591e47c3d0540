"""The per-step record (one all-reduce over the fast ranks), JSONL metrics, progress bar,
summary table, link byte totals (counted by orchestration.distributed.link_counter).
Loads no model and runs no link model: the trainer hands it the held-out loss and the
modeled step.

"""
from __future__ import annotations

import json
import math
import os
import sys

import torch
import torch.distributed as dist

from orchestration.codecs import pp_ratios
from orchestration.distributed.link_counter import AXES, LinkCounter

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


def drop_records_after(path: str, step: int) -> int:
    """Rewrites the metrics file at ``path`` without its records of steps after ``step``
    (what a run that crashed or was stopped after its last checkpoint logged; a resume
    from that checkpoint logs those steps again) and without a torn last line; atomic
    (os.replace). Returns the number of records dropped."""
    if not os.path.isfile(path):
        return 0
    keep, dropped = [], 0
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                dropped += 1  # a line torn by a crash
                continue
            if isinstance(rec, dict) and int(rec.get("step", 0)) > step:
                dropped += 1
            else:
                keep.append(line if line.endswith("\n") else line + "\n")
    if dropped:
        with open(path + ".part", "w") as f:
            f.writelines(keep)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".part", path)
    return dropped


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
    """(label, value) rows of the summary; the printed table with one line of explanation
    per figure is orchestration.components.run_summary.format_summary."""
    from orchestration.components.run_summary import summary_rows as rows

    return [(k, v) for k, v, _ in rows(s)]


# ------------------------------------------------------------ end-of-run records
def write_link_bytes(plan, mesh, counter: LinkCounter) -> str:
    """Every fast rank writes the bytes it sent per (axis, src -> dst) link; rank 0 merges
    them into RUN_DIR/link_bytes.json (the files travel to it as JSON bytes over the fast
    group, never pickles: hosts may have disks of their own)."""

    d = os.path.join(plan.run_dir, "link_bytes")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"rank_{mesh.rank:05d}.json"), "w") as f:
        json.dump({"links": counter.by_link(), "totals": counter.totals()}, f)
    dist.barrier(group=mesh.fast)
    if not mesh.elastic:  # hosts with disks of their own: rank 0 takes every file over the fast group (json, no pickle)
        from orchestration.components.checkpoint_hosts import recv_file, send_file

        if mesh.rank != 0:
            with open(os.path.join(d, f"rank_{mesh.rank:05d}.json"), "rb") as f:
                send_file(f.read(), 0, mesh.fast, mesh.device)
        for r in mesh.layout.fast_ranks()[1:] if mesh.rank == 0 else ():
            recv_file(os.path.join(d, f"rank_{r:05d}.json"), r, mesh.fast, mesh.device)
    path = os.path.join(plan.run_dir, "link_bytes.json")
    if mesh.rank == 0:
        merged = {"links": {}, "per_rank": {}}
        for r in mesh.layout.fast_ranks():
            if mesh.elastic and not os.path.exists(os.path.join(d, f"rank_{r:05d}.json")):
                continue  # an elastic replica that has not finished (or is gone): no barrier spans it
            with open(os.path.join(d, f"rank_{r:05d}.json")) as f:
                rec = json.load(f)
            merged["links"].update(rec["links"])
            merged["per_rank"][str(r)] = rec["totals"]
        with open(path, "w") as f:
            json.dump(merged, f, indent=1, sort_keys=True)
    return path


def links_local() -> bool:
    """Whether this run's ranks meet on this machine: the rendezvous address (MASTER_ADDR,
    as the local launcher or torchrun set it) is a loopback address."""
    import ipaddress
    import socket

    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        return ipaddress.ip_address(socket.gethostbyname(addr)).is_loopback
    except (OSError, ValueError):
        return False


def summarize(cfg, plan, history: list[dict], elapsed: float, steps_done: int, last_ckpt: str, model,
              where: str = "") -> dict:
    """The run's summary (rank 0): what ``summary_rows`` prints and what run_rank returns.
    ``model``: the link model's step for this run (orchestration.distributed.linkmodel.model_run) or None.
    ``where``: rank 0's device and torch.distributed backend, e.g. 'cuda:0, gloo'."""
    last = history[-1]
    t = cfg.train
    tokens_run = steps_done * cfg.fast_rows * t.batch_size * cfg.data.seq_len
    bpt = last["bytes_per_token"]
    s = {
        "mesh": ((f"replicas {','.join(map(str, cfg.mesh.replicas))} ({cfg.fast_rows} replicas of "
                  f"{', '.join(map(str, cfg.replica_stages))} stages"
                  + (f" + anchor x {cfg.mesh.stages} stages" if cfg.anchor.enabled else "") + ")") if cfg.mesh.replicas else
                 (f"{cfg.mesh.rows}x{cfg.mesh.stages} ({cfg.fast_rows} fast replicas"
                  + (" + anchor" if cfg.anchor.enabled else "") + f" x {cfg.mesh.stages} stages)"))
                + (f" on {where}" if where else ""),
        "model": f"{plan.arch} ({plan.num_layers} layers, H={plan.hidden_size}) from {plan.model_path}",
        "codec": cfg.boundary.codec + (f" p={cfg.boundary.p}" if cfg.boundary.codec in ("mask", "topk", "bottleneck") else "")
                 + (f" {json.dumps(cfg.boundary.options, sort_keys=True)}" if cfg.boundary.options else "")
                 + (" (pipeline replicas only: selective)"
                    if cfg.boundary.compress == "selective" and 1 in cfg.replica_stages else ""),
        "dp": cfg.dp.mode + ("" if cfg.dp.mode == "none" else f" + {cfg.dp.compressor}"),
        "steps": last["step"], "tokens": last["tokens"],
        "loss_first": history[0]["loss"], "loss_last": last["loss"],
        "tokens_per_s": tokens_run / max(elapsed, 1e-9),
        "bytes_per_token": bpt, "bytes_per_token_pp": bpt["pp_fwd"] + bpt["pp_bwd"],
        "pp_ratio": pp_ratios(bpt["pp_fwd"] + bpt["pp_bwd"], plan.hidden_size, cfg.replica_stages),
        "bytes_per_token_total": sum(bpt.values()),
        "bandwidth_bps": cfg.run.bandwidth_bps,
        "modeled_tokens_per_s": None if model is None else model.tokens_per_s,
        "modeled_limit": None if model is None else model.limiting,
        "checkpoint": last_ckpt, "metrics_path": os.path.join(plan.run_dir, "metrics.jsonl"),
        "run_dir": plan.run_dir, "ranks": cfg.world_size, "tensorboard": bool(cfg.run.tensorboard),
        "wandb": bool(cfg.run.wandb),
        "links_local": links_local(),
        "start_step": history[0]["step"] - 1, "steps_this": steps_done, "loss_first_run": None,
    }
    if s["start_step"] > 0:  # a resumed run: the whole run's first loss is in metrics.jsonl
        try:
            first = read_jsonl(s["metrics_path"])[:1]
            s["loss_first_run"] = first[0]["loss"] if first and first[0].get("step") == 1 else None
        except (OSError, ValueError, KeyError):
            pass
    if cfg.anchor.enabled:  # one rank's view of the anchor hook (orchestration.anchor stats; Trainer._anchor_view)
        s["anchor"] = {k[len("anchor_"):]: v for k, v in last.items()
                       if k in ("anchor_arrivals", "anchor_applied", "anchor_rejected", "anchor_mean_staleness",
                                "anchor_link", "anchor_prior_on", "anchor_generation")}
        from orchestration.distributed.mesh import MeshLayout

        s["anchor"]["seen_by"] = min(MeshLayout.of(cfg).anchor_rows())  # that rank's replica (its stage 0)
    return s


# ------------------------------------------------------------ per step
def reduce_step(cfg, mesh, step: int, stats, gnorm: float, skipped: int, counter: LinkCounter, stop: bool,
                step_s: float, lr: float) -> tuple[dict, bool]:
    """One small SUM all-reduce over the fast ranks (the anchor never joins it) of
    [stop flag, loss, grad norm, skipped steps, per-stage F and B compute seconds, bytes
    per axis, DP bytes per stage]; returns (the step's metrics record, stop requested)."""
    Y, X, t = cfg.mesh.stages, mesh.fast_replicas, cfg.train  # X: the replicas this reduction spans
    depth = cfg.replica_stages
    deepest = 1 if mesh.elastic else depth.count(Y)  # per-stage compute times: the mean over the deepest replicas (all, if alike)
    vec = torch.zeros(4 + 3 * Y + len(AXES), dtype=torch.float64)  # filled on CPU, reduced on mesh.device
    vec[0] = float(stop)
    vec[1] = stats.loss if mesh.is_last else 0.0
    vec[2] = (gnorm if math.isfinite(gnorm) else 0.0) / X if mesh.is_first else 0.0  # mean over replicas
    vec[3] = float(skipped) / depth[mesh.row]
    if depth[mesh.row] == Y:
        vec[4 + mesh.stage] = sum(stats.fwd_s) / len(stats.fwd_s) / deepest
        vec[4 + Y + mesh.stage] = sum(stats.bwd_s) / len(stats.bwd_s) / deepest
    tot = counter.totals()
    for i, a in enumerate(AXES):
        vec[4 + 2 * Y + i] = tot[a]
    vec[4 + 2 * Y + len(AXES) + mesh.stage] = tot["dp"]
    vec = vec.to(mesh.device)
    dist.all_reduce(vec, group=mesh.fast)
    vec = vec.cpu()
    tokens_per_step = cfg.fast_rows * t.batch_size * cfg.data.seq_len
    rec = {"step": step + 1, "loss": vec[1].item() / X, "lr": lr, "grad_norm": vec[2].item(),
           "tokens": (step + 1) * tokens_per_step, "step_s": step_s,
           "tokens_per_s": tokens_per_step / max(step_s, 1e-9), "skipped_steps": round(vec[3].item()),
           "fwd_s": vec[4:4 + Y].tolist(), "bwd_s": vec[4 + Y:4 + 2 * Y].tolist(),
           "bytes": {a: int(vec[4 + 2 * Y + i]) for i, a in enumerate(AXES)},
           "dp_bytes_by_stage": [int(v) for v in vec[4 + 2 * Y + len(AXES):].tolist()]}
    # per token of the replicas whose bytes were summed (an elastic replica: its own tokens,
    # not the whole run's; it once printed half its bytes per token with two replicas)
    spanned = (step + 1) * X * t.batch_size * cfg.data.seq_len
    rec["bytes_per_token"] = {a: rec["bytes"][a] / spanned for a in AXES}
    return rec, vec[0].item() > 0


class RunLog:
    """Rank 0's metrics file (every ``run.log_every`` steps and the last), its TensorBoard
    mirror (``--run.tensorboard``: the same scalars, RUN_DIR/tensorboard), its W&B mirror
    (``--run.wandb``: the same scalars at the same steps, RUN_DIR/wandb) and progress: a
    bar on a terminal, else one plain line every ``run.progress_every_s`` seconds (and at
    the first and last step), never carriage returns in a log file. Other ranks log nothing.
    ``clock`` and ``isatty`` are injectable for tests."""

    def __init__(self, cfg, plan, start: int, active: bool, *, clock=None, isatty=None, out=None):
        import time

        self.cfg, self.active, self.start = cfg, active, start
        self.out = out or sys.stdout
        self.clock = clock or time.monotonic
        path = os.path.join(plan.run_dir, "metrics.jsonl")
        if active:
            drop_records_after(path, start)  # a resume at step `start` logs the later steps again
        self.writer = JsonlWriter(path) if active else None
        self.tb = (open_tensorboard(os.path.join(plan.run_dir, "tensorboard"), purge_step=start or None)
                   if active and cfg.run.tensorboard else None)
        self.wb = open_wandb(cfg, plan.run_dir, start) if active and cfg.run.wandb else None
        self.bar = None
        self.last_line = None  # clock time of the last plain progress line
        tty = (isatty if isatty is not None else getattr(self.out, "isatty", lambda: False)())
        if active and cfg.run.progress and tty:
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.train.steps, initial=start, desc="train", unit="step", dynamic_ncols=True,
                            file=self.out)

    def _status(self, rec: dict) -> str:
        bpt = rec["bytes_per_token"]
        return (f"loss {rec['loss']:.3f} | {rec['tokens_per_s']:.0f} tok/s | "
                f"bytes/token PP {bpt['pp_fwd'] + bpt['pp_bwd']:.0f} DP {bpt['dp']:.0f}")

    def record(self, rec: dict, step: int) -> None:
        if not self.active:
            return
        if (step + 1) % self.cfg.run.log_every == 0 or step + 1 == self.cfg.train.steps:
            self.writer.write(rec)
            if self.tb is not None:
                for tag, v in scalars(rec).items():
                    self.tb.add_scalar(tag, v, rec["step"])
            if self.wb is not None:
                self.wb.log(scalars(rec), step=rec["step"])
        if self.bar is not None:
            self.bar.set_postfix_str(self._status(rec), refresh=False)
            self.bar.update(1)
        elif self.cfg.run.progress:
            now = self.clock()
            last = step + 1 == self.cfg.train.steps
            if self.last_line is None or last or now - self.last_line >= self.cfg.run.progress_every_s:
                self.last_line = now
                print(f"train step {step + 1}/{self.cfg.train.steps} | {self._status(rec)}", file=self.out, flush=True)

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.tb is not None:
            self.tb.close()
        if self.wb is not None:
            close_wandb(self.wb)


def scalars(rec: dict, prefix: str = "") -> dict[str, float]:
    """The numbers of a metrics record as flat TensorBoard tags (loss, bytes_per_token/dp,
    fwd_s/0, ...); the step itself is the x axis, not a scalar."""
    out: dict[str, float] = {}
    for k, v in rec.items():
        tag = f"{prefix}{k}"
        if k == "step" and not prefix:
            continue
        if isinstance(v, bool) or v is None:
            continue
        if isinstance(v, (int, float)):
            out[tag] = float(v)
        elif isinstance(v, dict):
            out.update(scalars(v, f"{tag}/"))
        elif isinstance(v, (list, tuple)):
            out.update(scalars({str(i): x for i, x in enumerate(v)}, f"{tag}/"))
    return out


def tensorboard_available() -> bool:
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401  (needs the tensorboard package)
        return True
    except ImportError:
        return False


def open_tensorboard(log_dir: str, purge_step: int | None = None):
    """A torch.utils.tensorboard SummaryWriter on ``log_dir``, or None (with one warning
    line) when the tensorboard package is absent: TensorBoard is optional. A resumed run
    purges the events after its checkpoint's step (``purge_step``), as metrics.jsonl does."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print("warning: --run.tensorboard: the tensorboard package is not installed (pip install tensorboard); "
              "logging to metrics.jsonl only", file=sys.stderr, flush=True)
        return None
    return SummaryWriter(log_dir=log_dir, purge_step=purge_step)


def wandb_available() -> bool:
    try:
        import wandb  # noqa: F401
        return True
    except ImportError:
        return False


WANDB_ID_FILE = "meshkern-run-id"  # in RUN_DIR/wandb: the W&B run id a resume continues


def wandb_run_id(wandb_dir: str, start: int) -> str:
    """The W&B run id of this run: the one RUN_DIR/wandb recorded when the run resumes
    (``start`` > 0: the same W&B run goes on), else a new one, recorded there. (wandb's own
    resume='auto' file is deleted when a run finishes, so a finished run that is later
    extended would start a second W&B run.)"""
    import secrets

    path = os.path.join(wandb_dir, WANDB_ID_FILE)
    if start > 0 and os.path.isfile(path):
        with open(path) as f:
            if rid := f.read().strip():
                return rid
    rid = secrets.token_hex(6)  # [0-9a-f]: a valid W&B run id
    os.makedirs(wandb_dir, exist_ok=True)
    with open(path, "w") as f:
        f.write(rid + "\n")
    return rid


def open_wandb(cfg, run_dir: str, start: int):
    """A wandb Run for this run (files under ``run_dir``/wandb, the run's config as its
    config, mode ``--run.wandb-mode``), or None, with one warning line, when the wandb
    package is absent or wandb.init fails (e.g. online without a login): W&B is optional
    and never stops training. A resumed run (``start`` > 0) continues the same W&B run;
    its steps are the trainer's, so they continue after ``start``. Offline and disabled
    runs touch no network: no system metrics, machine or git probes, no error reports."""
    try:
        import wandb
    except ImportError:
        print("warning: --run.wandb: the wandb package is not installed (pip install wandb); "
              "logging to metrics.jsonl only", file=sys.stderr, flush=True)
        return None
    r = cfg.run
    local = r.wandb_mode != "online"
    if local:  # read by wandb's service process when it starts; a user's own setting wins
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
    try:
        settings = wandb.Settings(
            console="off",  # our progress lines stay ours (rank 0 may be a forked process: no fd redirection)
            silent=local,  # offline: no banner per run; the run folder line names wandb/
            x_disable_stats=local, x_disable_meta=local, x_disable_machine_info=local,  # no probes (cloud metadata)
            disable_git=local, save_code=False, x_save_requirements=False)
        return wandb.init(project=r.wandb_project, name=r.wandb_name or os.path.basename(run_dir.rstrip("/")),
                          mode=r.wandb_mode, dir=run_dir, id=wandb_run_id(os.path.join(run_dir, "wandb"), start),
                          resume="allow" if start > 0 else None, config=cfg.to_dict(), settings=settings)
    except Exception as e:  # (wandb raises its own UsageError, CommError, ...; an older wandb, ValidationError)
        print(f"warning: --run.wandb: wandb.init failed ({type(e).__name__}: {e}); logging to metrics.jsonl only",
              file=sys.stderr, flush=True)
        return None


def close_wandb(run) -> None:
    """Finishes ``run`` (its records flushed to RUN_DIR/wandb, online: uploaded; the run
    marked finished) and stops wandb's service process: rank 0 may be a forked process
    that leaves with os._exit, which skips wandb's own atexit teardown."""
    import wandb

    run.finish()
    wandb.teardown()
