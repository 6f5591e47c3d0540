"""The distributed machinery of a run: who talks to whom, and what crosses each link.

Modules: mesh (the process grid and its groups), launch (local spawn, peer failures),
stages (splitting a causal LM into pipeline stages), schedule (GPipe / 1F1B actions),
pipeline (one step's pipeline execution with boundary codecs), dp_sync (data-parallel
sync of a stage across replicas), link_counter (exact bytes per axis) and linkmodel (a
replay of a run's schedule over modeled links: tokens/s at a given bandwidth).
"""
