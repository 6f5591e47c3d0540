"""Elastic fast replicas on torchft (--mesh.elastic; docs/elastic.md).

    lighthouse.py   torchft's quorum service, in a process of its own
    launcher.py     the local launcher: one process group per replica, restarts, the summary
    replica.py      one rank's torchft Manager: quorum per step, commit, heal
    transport.py    the heal transfer, gated by the run's secret

The algorithm (Streaming DiLoCo, the compressors, the optimizer) knows nothing of this
package: it syncs over whatever group the replica's Manager hands it.
"""
