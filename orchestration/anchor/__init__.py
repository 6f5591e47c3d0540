"""The slow anchor circuit (method.md sections 2-3; protocol, faults and restarts in
docs/anchor.md).

    wire       message header, GRAD payload layout (Layout), send/recv on a pair link
    bounds     magnitude / orthonormality bounds on a decoded GRAD payload
    auth       MAC'd store keys and the pair-link handshake with the run's secret (docs/security.md)
    links      the fast circuit's store, anchor-row generations, pair links, join
    snapshot   replica 0 -> anchor snapshot stream (full or int8 deltas)
    node       the anchor rank's loop (run_anchor_rank), fault injection, saved state
    fastlink   a fast rank's link thread (FastLink)
    hook       a fast rank's per-step hook on the trainer's thread (FastHook)
"""
from orchestration.anchor.auth import AuthError, anchor_handshake, fast_handshake, generation_value, parse_generation
from orchestration.anchor.bounds import check_entries
from orchestration.anchor.fastlink import Arrival, FastLink
from orchestration.anchor.hook import FastHook
from orchestration.anchor.links import (ANCHOR, FAST, PREFIX, FastCircuitGone, accept_slot, announced_generation,
                                        claim_generation, is_link_failure, is_store_error, join_anchor_row,
                                        link_to_fast, pair_link, register_fast, side_store, store_address)
from orchestration.anchor.node import (exact_resume_round, load_state, parse_faults, round_batch, round_state_path,
                                       run_anchor_rank, save_state, state_path)
from orchestration.anchor.snapshot import SNAP_DELTA, SNAP_FULL, SNAPSHOT_CHUNK, SnapshotCoder
from orchestration.anchor.wire import (AUTH, F_DTYPE, F_KIND, F_LAYOUT, F_MAGIC, F_NUMEL, F_TRANSPORT, F_VERSION,
                                       GRAD, HEADER_LEN, MAGIC, REQ, SNAP, STOP, TRANSPORTS, Layout, ProtocolError,
                                       Rejected, eligible_params, layout_hash)

__all__ = ["AUTH", "AuthError", "anchor_handshake", "fast_handshake",
           "generation_value", "parse_generation", "check_entries",
           "announced_generation", "ANCHOR", "FAST", "PREFIX", "Arrival", "FastCircuitGone", "FastHook", "FastLink", "Layout",
           "ProtocolError", "Rejected", "SNAPSHOT_CHUNK", "SNAP_DELTA", "SNAP_FULL", "SnapshotCoder", "TRANSPORTS",
           "F_DTYPE", "F_KIND", "F_LAYOUT", "F_MAGIC", "F_NUMEL", "F_TRANSPORT", "F_VERSION", "GRAD", "HEADER_LEN",
           "MAGIC", "REQ", "SNAP", "STOP", "claim_generation", "eligible_params", "is_link_failure",
           "is_store_error", "join_anchor_row", "layout_hash", "link_to_fast", "load_state", "pair_link",
           "parse_faults", "round_batch", "round_state_path", "exact_resume_round", "run_anchor_rank", "save_state", "side_store", "state_path",
           "store_address", "accept_slot", "register_fast"]
