"""Data-parallel compressors: average tensors across replicas, exchanging fewer bytes.

    NoCompression   exact mean (one all_reduce)                      the reference
    PowerSGD        rank-r factors P, Q with error feedback          ~ n*m / ((n+m)*r)
    SparseLoCo      top-k per chunk + 2-bit values, error feedback   ~ 32 / (density*(log2(chunk)+2))
    Int8            per-chunk absmax int8, error feedback            ~ 4x

All share :class:`Compressor` (``all_reduce_mean(tensors, group, key=...)``, exact
``bytes_sent`` / ``bytes_received`` / ``payload_bytes`` counters, timeouts raising
:class:`SyncError`, ``state_dict``). See meshkern.diloco for the outer loop.
"""
from meshkern.compress.base import Compressor, SyncError
from meshkern.compress.int8 import Int8
from meshkern.compress.none import NoCompression
from meshkern.compress.powersgd import PowerSGD, orthogonalize, should_compress
from meshkern.compress.sparseloco import SparseLoCo

__all__ = ["Compressor", "SyncError", "NoCompression", "PowerSGD", "SparseLoCo", "Int8",
           "orthogonalize", "should_compress"]
