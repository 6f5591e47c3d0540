"""What the leader's copy costs and what it buys across hosts: a fixed 1x2 pipeline, one stage
per host (each its own disk), checkpoints at step 2; then host 1 is replaced by a machine
with an empty disk and the same command resumes to step 3.

    python -m bench.hosts_heal                                  # root: orchestration.hosts
    python -m bench.hosts_heal --rate 200mbit -- --model.path smollm2-135m

Prints, from the hosts' logs: what each checkpoint sends to the leader in the background
(stage 1's model shard and, --checkpoint.leader-copy, its rank file: bytes and seconds at
the export's pace, half of --run.bandwidth-bps) and the heal (the rank file the leader sent
back to the empty host, bytes and seconds). Flags after ``--`` go to both hosts' runs.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time

WANT = ("[checkpoint]", "leader sent", "resumed from", "no checkpoint in")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="200mbit", help="tc tbf rate of every host's link (e.g. 200mbit, 20mbit)")
    ap.add_argument("--work", default="", help="where the hosts' directories go (default: a temporary one)")
    ap.add_argument("--timeout", type=float, default=3000.0, help="seconds each of the two runs may take")
    ap.add_argument("extra", nargs="*", help="flags for both hosts' runs (after --)")
    a = ap.parse_args(argv)
    from orchestration.hosts import Hosts, available, rate_bps

    if (why := available()) is not None:
        print(f"hosts_heal: cannot make hosts here: {why}", file=sys.stderr)
        return 2
    common = ["-m", "orchestration.train", "--data", "corpus:python", "--data.seq-len", "128", "--train.batch-size", "4",
              "--train.microbatches", "2", "--run.name", "h", "--mesh.rows", "1", "--mesh.stages", "2",
              "--run.eval-sequences", "0", "--mesh.timeout-s", "600", "--checkpoint.every", "2",
              "--run.progress", "false", "--run.bandwidth-bps", f"{rate_bps(a.rate):.0f}", *a.extra]
    env = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}
    work = a.work or tempfile.mkdtemp(prefix="meshkern-hosts-heal-")
    with Hosts(2, a.rate, root=work) as h:
        def run(extra: list[str], port: int, tag: str) -> None:
            t0 = time.monotonic()
            procs = [h.popen(i, h.torchrun(i, common + extra, port=port), env=env, log=f"{tag}.log") for i in range(2)]
            codes = h.wait_all(procs, timeout=a.timeout)
            print(f"{tag}: exit codes {codes}, {time.monotonic() - t0:.0f} s", flush=True)
            for p in procs:
                for line in p.lines:
                    if any(w in line for w in WANT):
                        text = re.sub(r"\s+", " ", line.strip())[:300]
                        print(f"  host {p.host}: {text}", flush=True)
            if any(codes):
                raise SystemExit(f"hosts_heal: the {tag} run failed; logs in {work}")

        run(["--train.steps", "2"], 29530, "first")
        shutil.rmtree(os.path.join(h.dirs[1], "runs", "h", "checkpoints"))  # host 1 replaced: an empty disk
        run(["--train.steps", "3", "--checkpoint.resume", "latest"], 29531, "healed")
    if not a.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
