"""Subspace-constrained training (Protocol Models): the constraint and its trainer side.

Modules: constraint (the shared basis U and the projection that keeps o_proj / down_proj
in span(U)) and training (SubspaceRun: attaching the constraint and the subspace codec
to a stage).
"""
