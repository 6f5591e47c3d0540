"""Where a run starts: everything between ``python -m orchestration.train`` (or torchrun)
and a rank's Trainer.

    prepare.py    the config checked against the model, data and checkpoint; loaded once (Plan)
    local.py      this machine's processes: the fixed mesh, or an anchor row joining (--anchor.join)
    torchrun.py   torchrun started this process as one rank
    elastic.py    the lighthouse and this machine's elastic replicas (--mesh.elastic, --mesh.join)
    replicas.py   the elastic replicas' supervisor (a replica dies and restarts alone)
    processes.py  local processes: start, watch, name the first failure, stop cleanly
    rank.py       the one rank entry, whatever started the process (run_rank)
    outcome.py    the one exit-code rule

The secret every mode shares, and who creates it: orchestration.distributed.secret.
"""
