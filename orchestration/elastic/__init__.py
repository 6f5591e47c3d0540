"""Elastic fast replicas on torchft (--mesh.elastic; docs/elastic.md).

    lighthouse.py   torchft's quorum service, in a process of its own
    replica.py      one rank's torchft Manager: quorum per step, commit, heal
    gate.py         the Trainer's step gate over it (orchestration.components.gate's protocol)
    transport.py    the heal transfer, gated by the run's secret
    events.py       the replicas' event files, launch markers, the run summary

Starting replicas (the local supervisor, torchrun, joining a lighthouse) is
orchestration.launch's job; this package holds what runs inside one.

The algorithm (Streaming DiLoCo, the compressors, the optimizer) knows nothing of this
package: it syncs over whatever group the replica's Manager hands it.
"""
