"""The anchor circuit's bytes per trained token at users' batch sizes (issue #43 item 3),
from the 200-step python records of results/real-long (SmolLM2-135M, 1x2 + the anchor row,
4 x 128 = 512 tokens per step, a round every 5 steps).

The anchor's traffic is per round, not per token: each round every stage sends a snapshot
of its parameters and gets an update back, whatever the batch. So its bytes per step are
fixed, and per token they fall as 1 / (tokens per step). The default codec's boundary bytes
(pp_fwd + pp_bwd) are per token. This prints, per seed, the anchor's bytes per step (the
records' anchor bytes per token x 512) and, at 512 to 128k tokens per step, its bytes per
token and their ratio to the default's (pcanf, the same seed's record), and the batch at
which the anchor's bytes equal the default's.

    python results/anchor-batch/per_token.py

Arithmetic on measured records, no new training: the quality at those batch sizes is not
measured here (a 200-step row at 4k tokens per step is ~8x a 512-token row's compute).
"""
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
RECORDS = os.path.join(HERE, "..", "real-long", "records")
BATCHES = (512, 4096, 16384, 65536, 131072)


def record(name: str) -> dict:
    with open(os.path.join(RECORDS, name + ".json")) as f:
        return json.load(f)


def main() -> None:
    print("| seed | anchor MB/step | default pp B/token | " + " | ".join(f"{t // 1024 or t}{'k' if t >= 1024 else ''} tokens/step"
                                                                   for t in BATCHES) + " | break-even tokens/step |")
    print("|---" * (4 + len(BATCHES)) + "|")
    shares = []
    for seed in (0, 1):
        ap, pc = record(f"pcanf-ap-s{seed}"), record(f"pcanf-s{seed}")
        s = ap["settings"]
        tokens = s["batch_size"] * s["seq_len"]  # per step, this record
        per_step = ap["bytes_per_token"]["anchor"] * tokens
        pp = pc["bytes_per_token"]["pp_fwd"] + pc["bytes_per_token"]["pp_bwd"]
        cells = [f"{per_step / t:,.0f} B ({per_step / t / pp:.1f}x)" for t in BATCHES]
        print(f"| {seed} | {per_step / 1e6:.1f} | {pp:.0f} | " + " | ".join(cells) + f" | {per_step / pp:,.0f} |")
        a = ap["anchor"]
        snap, upd = a["anchor_snapshot_bytes"], a["anchor_update_bytes"]
        shares.append(f"seed {seed}: snapshots {snap / (snap + upd):.0%} of the anchor's bytes "
                      f"({snap / a['anchor_snapshots_sent'] / 1e6:.1f} MB each, stage 0), updates "
                      f"{upd / (snap + upd):.0%}; a round every {round(1 / a['anchor_arrival_rate'])} steps")
    print()
    print("\n".join(shares))


if __name__ == "__main__":
    main()
