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


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


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
                     f"{'n/a' if ms is None else f'{ms:.1f}'} steps, link {a.get('link', '?')}"))
    if s.get("checkpoint"):
        rows.append(("checkpoint", s["checkpoint"]))
    rows.append(("metrics", s["metrics_path"]))
    if s.get("links_path"):
        rows.append(("bytes per link", s["links_path"]))
    return rows
