"""Measured against modeled across hosts: the trainer on hosts made as network namespaces
(orchestration.hosts) with tbf-shaped links, each row's wall-clock step time beside what
orchestration.distributed.linkmodel predicts for the same run (its measured compute times
and exact bytes, at the shaped rate).

    python -m bench.hosts_bench                    # the four rows, rate from the scaling rule
    python -m bench.hosts_bench --rows pca,dp --rate 1mbit --steps 12

Scaling rule (what makes a CPU box stand for a GPU deployment): link time per second of
compute is what decides how a mesh runs, so the links are shaped to the rate at which a
step's bytes take as long, relative to this machine's compute, as they would take at
``--gpu-link`` (200 Mbit/s) beside a GPU's compute:

    rate = gpu_link x t_gpu / t_cpu,   t_gpu = 6 x params x tokens / gpu_flops

with t_cpu this machine's measured forward + backward time of the whole model on one step's
tokens (one thread) and ``--gpu-flops`` the GPU's sustained training rate (default 66e12:
an RTX 4090-class card's 165 bf16 TFLOP/s at 40% utilisation). A model this small would be
latency-bound on a real GPU; the rule keeps the ratio of bytes to FLOPs, which is what the
link model is about.

What the harness cannot model: tbf shapes bandwidth; this kernel has no netem, so there is
no latency or loss on these links, and the hosts share this machine's cores (the link model
gives every rank a device of its own). Rows:

    dense   1x2 pipeline, dense fp32 boundaries                     (2 hosts)
    pca     1x2 pipeline, the default pca codec                     (2 hosts)
    m95-ap  1x2 pipeline, p=0.95 mask, anchor row on a third host   (3 hosts)
    dp      2x1, dense, replicas synced by Streaming DiLoCo + PowerSGD (2 hosts)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import sys
import tempfile
import time

ROWS = {
    "dense": (2, ["--mesh.rows", "1", "--mesh.stages", "2", "--boundary.codec", "dense"]),
    "pca": (2, ["--mesh.rows", "1", "--mesh.stages", "2"]),
    # --anchor.delay 0: the asynchronous anchor (newest update first), the paper's; delay mode
    # makes the fast circuit wait at step v + delay for snapshot v's update, which at these
    # rates (a snapshot of the whole stage per round) stalls it for minutes
    "m95-ap": (2, ["--preset", "m95-ap", "--mesh.rows", "2", "--mesh.stages", "2", "--anchor.delay", "0",
                   "--anchor.snapshot-every", "2"]),
    "dp": (2, ["--preset", "dp", "--mesh.rows", "2", "--mesh.stages", "1", "--dp.sync-every", "2"]),
}
SECRET = "meshkern-bench-" + "0" * 32  # a throwaway secret for the anchor row of this bench run only


def scaled_rate(model_path: str, batch: int, seq: int, gpu_flops: float, gpu_link: float) -> tuple[float, dict]:
    """The link rate of the scaling rule (module doc) and the figures it came from."""
    import torch

    from orchestration.models.loading import load_causal_lm

    torch.set_num_threads(1)
    model, _ = load_causal_lm(model_path)
    params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    times = []
    for _ in range(4):
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        times.append(time.perf_counter() - t0)
    t_cpu = statistics.median(times[1:])
    t_gpu = 6.0 * params * batch * seq / gpu_flops
    return gpu_link * t_gpu / t_cpu, {"params": params, "t_cpu_s": t_cpu, "t_gpu_s": t_gpu}


def _modeled_step_s(log: str, tokens_per_step: int) -> float | None:
    m = re.search(r"^modeled tokens/s @ [^ ]+ [^ ]+ +([0-9.]+)$", log, re.M)
    return tokens_per_step / float(m.group(1)) if m else None


def run_row(name: str, rate_bps: float, a) -> dict:
    from orchestration.hosts import Hosts

    n_fast, flags = ROWS[name]
    anchor = name == "m95-ap"
    n = n_fast + (1 if anchor else 0)
    common = ["--model", a.model, "--data", "corpus:python", "--data.seq-len", str(a.seq_len),
              "--data.max-sequences", "256", "--train.batch-size", str(a.batch), "--train.microbatches", "2",
              "--steps", str(a.steps), "--run.name", name, "--run.bandwidth-bps", f"{rate_bps:.0f}",
              "--checkpoint.every", "0", "--mesh.timeout-s", "600", "--run.eval-sequences", "0",
              # one directory every host sees: the final checkpoint's model assembly (minutes at these
              # rates) stays out of what is timed (it is measured in tests/test_hosts_export.py)
              "--checkpoint.dir", os.path.join(a.work, f"{name}-checkpoints"), *flags, *shlex.split(a.trainer_args)]
    env = {"MESHKERN_ANCHOR_SECRET": SECRET, "OMP_NUM_THREADS": "1"}
    # A small token bucket: tbf's default-sized burst would let each step's first few dozen kB
    # through at line rate, and a step's messages are of that size at these rates (measured:
    # with a 64 kB bucket a dense 1x2 pipeline ran 30% faster than its shaped rate allows).
    with Hosts(n, f"{rate_bps / 1e3:.0f}kbit", burst="3kb", root=a.work, echo=a.verbose) as h:
        calibrated = h.transfer(0, 1, max(1 << 16, int(rate_bps / 8 * 8)))  # ~8 s of payload through both links
        fast = [sys.executable, "-m", "orchestration.torchrun", "--nnodes", str(n_fast), "--nproc-per-node", "1",
                "--master-addr", h.addr(0), "--master-port", "29500"]  # (the anchor's host is not a node of it)
        procs = [h.popen(i, [*fast, "--node-rank", str(i), "-m", "orchestration.train", *common], env=env,
                         log=f"{name}.log") for i in range(n_fast)]
        if anchor:  # the anchor row: one process per stage on a host of its own, joining the fast circuit's store
            procs[0].wait_line(r"^\[anchor\] the fast circuit's store is ", a.timeout)
            procs.append(h.popen(n_fast, [sys.executable, "-m", "orchestration.torchrun", "--nnodes", "1",
                                          "--nproc-per-node", "2", "--master-addr", h.addr(n_fast),
                                          "--master-port", "29600", "-m", "orchestration.train", *common,
                                          "--anchor.join", "--anchor.store", f"{h.addr(0)}:29500"],
                                 env=env, log=f"{name}-anchor.log"))
        codes = h.wait_all(procs, a.timeout)
        if any(codes[:n_fast]):
            raise RuntimeError(f"row {name}: exit codes {codes}; log tail:\n{procs[0].tail(30)}")
        log = "".join(procs[0].lines)
        recs = [json.loads(x) for x in open(os.path.join(h.dirs[0], "runs", name, "metrics.jsonl"))]
    step_s = statistics.median(r["step_s"] for r in recs[1:])  # the link model drops the first step too
    tokens = recs[-1]["tokens"] // recs[-1]["step"]
    modeled = _modeled_step_s(log, tokens)
    return {"row": name, "hosts": n, "rate_bps": rate_bps, "calibrated_bps": calibrated, "steps": len(recs),
            "measured_step_s": step_s, "modeled_step_s": modeled,
            "measured_over_modeled": None if modeled is None else step_s / modeled,
            "bytes_per_token": recs[-1]["bytes_per_token"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {', '.join(ROWS)}")
    ap.add_argument("--model", default="", help="HF checkpoint directory (default: the default base model)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--rate", default="", help="link rate, e.g. 1mbit (default: the scaling rule)")
    ap.add_argument("--gpu-flops", type=float, default=66e12, help="the GPU's sustained training FLOP/s (rule)")
    ap.add_argument("--gpu-link", type=float, default=200e6, help="the deployment's link rate in bit/s (rule)")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds a row may take")
    ap.add_argument("--work", default="", help="where the hosts' directories go (default: a temporary one)")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    ap.add_argument("--verbose", action="store_true", help="echo the hosts' output")
    ap.add_argument("--trainer-args", default="", help="more trainer flags for every row, after the row's own "
                                                       "(the last one wins), e.g. '--anchor.snapshot-every 50'")
    a = ap.parse_args(argv)
    import signal

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a kill unwinds: the namespaces are deleted
    from orchestration.hosts import available, rate_bps

    if (why := available()) is not None:
        print(f"error: cannot build hosts here: {why}", file=sys.stderr)
        return 2
    rows = [r for r in a.rows.split(",") if r]
    if bad := [r for r in rows if r not in ROWS]:
        print(f"error: --rows: unknown {bad}; choose from {', '.join(ROWS)}", file=sys.stderr)
        return 2
    if not a.model:
        from orchestration.models.paths import default_base_model

        a.model = default_base_model()
    rule = {}
    if a.rate:
        try:
            rate = rate_bps(a.rate)
        except ValueError:
            print(f"error: --rate {a.rate!r}: like 500kbit or 2mbit", file=sys.stderr)
            return 2
    else:
        rate, rule = scaled_rate(a.model, a.batch, a.seq_len, a.gpu_flops, a.gpu_link)
    with tempfile.TemporaryDirectory(prefix="hosts-bench-") as tmp:
        a.work = a.work or tmp
        print(f"hosts_bench: rate {rate / 1e3:.0f} kbit/s" + (f" (rule: {json.dumps(rule)})" if rule else ""),
              flush=True)
        out = []
        for r in rows:
            res = run_row(r, rate, a)
            out.append(res)
            ratio = res["measured_over_modeled"]
            print(f"{r:7s} hosts {res['hosts']}  measured {res['measured_step_s']:.3f} s/step  modeled "
                  f"{res['modeled_step_s'] or float('nan'):.3f} s/step  measured/modeled "
                  f"{ratio if ratio is not None else float('nan'):.2f}  "
                  f"(link calibrated {res['calibrated_bps'] / 1e3:.0f} kbit/s)",
                  flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"rule": rule, "rate_bps": rate, "rows": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
