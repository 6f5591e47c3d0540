"""``python -m orchestration.experiments``: the paper's table at small scale, measured.

    python -m orchestration.experiments                          # main rows, 3 seeds, into runs/experiments/
    python -m orchestration.experiments --docs                   # the same, into the tracked results, results/figures
    python -m orchestration.experiments --rows baselines,ablations --seeds 0
    python -m orchestration.experiments --rows dense,m95 --quick --out /tmp/x   # tiny (tests)
    python -m orchestration.experiments --table-only              # rebuild table + plots

Every row of :data:`ROWS` is one trainer run (``python -m orchestration.train`` as a
subprocess: a preset plus flags, nothing re-implemented here) followed by evaluation
with ``orchestration.evaluate`` on the held-out rows the trainer itself kept (the
trainer's own ``prepare`` rebuilds them, so the split is exactly the run's):

    * held-out loss / perplexity at every checkpoint (``--checkpoint.every``) and of the
      base model (step 0): the curve "eval loss vs tokens"; the same curve against
      modeled wall-clock = steps x the run's modeled step time;
    * bytes/token per axis (pp_fwd, pp_bwd, dp, anchor) from the run's exact counters;
    * modeled tokens/s at ``--run.bandwidth-bps`` (200 Mbps) by the trainer's own link
      model replay (``orchestration.distributed.linkmodel.model_run``: measured per-stage compute,
      exact bytes) and the network-only ceiling (same replay with compute set to 0);
    * exact match on the synthetic tasks when the run adapts on ``task:...`` data;
    * magnitude-pruning robustness (30/50/70%) of the final model for the main rows.

Results: one JSON per (row, seed) in ``OUT/records/`` written atomically when the row is
finished (``"complete": true``); a finished row is never run again (resumable: kill
and restart at will; a partial run directory is discarded and the row re-run). After
the runs, ``OUT/table.md``, ``OUT/summary.csv`` and PNG plots in ``--figures`` (default
``OUT/figures``; OUT defaults to runs/experiments/results, and only ``--docs`` writes into
the repository's tracked results and results/figures) are
rebuilt from every complete JSON in ``OUT/records`` whose settings match this
invocation's (so several invocations with disjoint ``--rows`` can run side by side).

Mesh: ``--fast-rows`` fast replicas x ``--stages`` stages for every row; rows with the
anchor get one more mesh row (the anchor replica), as in the paper ("one extra
replica", off the critical path): the fast circuit sees the same tokens in every row.

Modules: cli (flags, settings, the main loop), runner (one row: trainer subprocess, result
record), evaluation (a finished run's curve, bytes, modeled tokens/s, codec-on loss), rows
(the rows, settings and result files), report (table, summary CSV, plots) and
heterogeneous (the heterogeneous-mesh rows).
"""
