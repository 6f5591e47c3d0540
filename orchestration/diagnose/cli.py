"""``python -m orchestration.diagnose``: the command line (options -> ``Settings``), loading
the model and rows as the trainer does, the run with its partial report saved after every
step (``--resume``), and the outputs (``report.json``, ``table.txt``, plots).

A bad input (missing model or data, unknown codec or option, a boundary the model does
not have) is one ``error: ...`` line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

import torch

from orchestration.diagnose.candidates import CANDIDATES
from orchestration.diagnose.common import UsageError
from orchestration.diagnose.model import load_data, resolve_and_load
from orchestration.diagnose.report import write_outputs
from orchestration.diagnose.run import run_diagnostics
from orchestration.diagnose.settings import Settings, check_settings

DEFAULT_DATA = "corpus:python"


def build_parser() -> argparse.ArgumentParser:
    d = Settings()
    ap = argparse.ArgumentParser(prog="python -m orchestration.diagnose",
                                 description="Boundary-codec diagnostics without training: loss and gradient error "
                                             "per boundary and codec, activation statistics, anchor filter.")
    ap.add_argument("--model", default="", help="checkpoint directory, .gguf file or built-in name (smollm2-135m); "
                    "default: the default base model")
    ap.add_argument("--data", default=DEFAULT_DATA, help="data source as the trainer takes it (path, corpus:python, "
                    "corpus:prose, task:...)")
    ap.add_argument("--stages", default="2", help="comma-separated stage counts Y; their balanced-split boundaries are "
                    "measured, and the anchor per Y (empty: none)")
    ap.add_argument("--boundaries", default="", help="comma-separated extra boundaries (layer index L: before layer L)")
    ap.add_argument("--codecs", nargs="+", default=None, metavar="SPEC",
                    help="codec specs name[:key=value,...], e.g. mask:p=0.9 topk:k=19 int4:group_size=32 "
                    "(default: every codec at several ratios)")
    ap.add_argument("--candidates", nargs="*", default=None, metavar="NAME",
                    help=f"candidate designs (default all; none with an empty list): {', '.join(CANDIDATES)}")
    ap.add_argument("--no-pca-sweep", action="store_true", help="skip the PCA k sweep rows")
    ap.add_argument("--every-layer", action="store_true", help="also scan every layer boundary (stats + --scan losses)")
    ap.add_argument("--scan", nargs="+", default=d.scan, metavar="NAME", help="codec specs / candidates for the layer scan")
    ap.add_argument("--budget", type=int, default=d.budget, help="candidates use <= 1/BUDGET of dense bytes per token")
    ap.add_argument("--seq-len", type=int, default=d.seq_len)
    ap.add_argument("--eval-rows", type=int, default=d.eval_rows, help="held-out rows for the losses")
    ap.add_argument("--calib-rows", type=int, default=d.calib_rows, help="training rows for statistics and fits")
    ap.add_argument("--grad-rows", type=int, default=d.grad_rows, help="rows of the gradient batch (first eval rows)")
    ap.add_argument("--no-grad", action="store_true", help="skip the gradient comparisons")
    ap.add_argument("--no-anchor", action="store_true", help="skip the anchor diagnostics")
    ap.add_argument("--anchor-batches", type=int, default=d.anchor_batches, help="dense gradients folded into M_anc")
    ap.add_argument("--anchor-codec", default=d.anchor_codec, help="the masked circuit's codec at every stage boundary")
    ap.add_argument("--tau", type=float, default=d.tau)
    ap.add_argument("--alpha", type=float, default=d.alpha)
    ap.add_argument("--beta-anc", type=float, default=d.beta_anc)
    ap.add_argument("--rank", type=int, default=d.rank, help="truncated SVD rank of M_anc")
    ap.add_argument("--massive-m", type=int, default=d.massive_m, help="massive dims the massive+* candidates keep")
    ap.add_argument("--seed", type=int, default=d.seed, help="row choice and mask seed")
    ap.add_argument("--eval-fraction", type=float, default=d.eval_fraction)
    ap.add_argument("--split-seed", type=int, default=d.split_seed)
    ap.add_argument("--max-sequences", type=int, default=0)
    ap.add_argument("--out", default="diagnostics", help="output directory (report.json, table.txt, *.png)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--resume", action="store_true", help="continue from OUT/report.partial.json (written after every "
                    "boundary, scan step and anchor split) if it matches this run")
    ap.add_argument("--replot", default=None, metavar="REPORT_JSON",
                    help="only redraw the plots and the table of an existing report.json into --out")
    return ap


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--{what} takes comma-separated integers, got {text!r}") from None


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.replot:
        try:
            with open(a.replot) as f:
                rep = json.load(f)
        except (OSError, ValueError) as e:
            print(f"error: --replot {a.replot}: {e}", file=sys.stderr)
            return 2
        os.makedirs(a.out, exist_ok=True)
        write_outputs(rep, a.out, plots=True)
        return 0
    try:
        s = Settings(stages=_ints(a.stages, "stages"), boundaries=_ints(a.boundaries, "boundaries"), codecs=a.codecs,
                     candidates=a.candidates, pca_sweep=not a.no_pca_sweep, every_layer=a.every_layer, scan=a.scan,
                     budget=a.budget, seq_len=a.seq_len, eval_rows=a.eval_rows, calib_rows=a.calib_rows,
                     grad_rows=a.grad_rows, grads=not a.no_grad, anchor=not a.no_anchor,
                     anchor_batches=a.anchor_batches, anchor_codec=a.anchor_codec, tau=a.tau, alpha=a.alpha,
                     beta_anc=a.beta_anc, rank=a.rank, seed=a.seed, massive_m=a.massive_m,
                     eval_fraction=a.eval_fraction, split_seed=a.split_seed, max_sequences=a.max_sequences)
        check_settings(s)
        torch.set_num_threads(a.threads)
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        model, path = resolve_and_load(a.model)
        train_rows, eval_rows = load_data(path, a.data, s.seq_len, eval_fraction=s.eval_fraction,
                                          split_seed=s.split_seed, max_sequences=s.max_sequences)
    except (UsageError, ValueError, FileNotFoundError, TypeError) as e:  # bad inputs: one line, status 2
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    try:
        os.makedirs(a.out, exist_ok=True)
        part_file = os.path.join(a.out, "report.partial.json")
        partial = None
        if a.resume and os.path.exists(part_file):
            with open(part_file) as f:
                partial = json.load(f)

        def save(r):
            tmp = part_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump(r, f, default=str)
            os.replace(tmp, part_file)

        rep = run_diagnostics(model, path, train_rows, eval_rows, s, partial=partial, save=save)
    except UsageError as e:  # e.g. a boundary or codec that does not fit this model
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    rep["model_spec"], rep["data"] = a.model or "(default base model)", a.data
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "report.json"), "w") as f:
        json.dump(rep, f, indent=1, default=str)
    if os.path.exists(part_file):
        os.remove(part_file)
    write_outputs(rep, a.out, plots=not a.no_plots)
    return 0
