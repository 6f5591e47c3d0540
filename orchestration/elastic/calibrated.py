"""What a codec calibrated at start, the same on every replica: the pca bases
(orchestration.components.calibration) and the subspace codec's basis U
(orchestration.subspace.training), as named tensors with a digest, never pickled.

Every replica gets its bases at start the way a fixed mesh does (RUN_DIR/pca_basis.pt on
its own disk, else fitted from the model and the run's seeded calibration rows, by rank 0
of its own world): the fit is deterministic, so replicas on alike software fit alike. Two
checks make the run's bases every replica's, whatever its host computed:

- a heal carries the healer's bases (``state``) in the heal state, with their digest; the
  healed replica checks the tensors against it and, where its own differ, takes the
  peer's (``adopt``: installed for its codec, RUN_DIR/pca_basis.pt rewritten so that its
  restarts load them). A replica that joins late or comes back after an outage heals;
- a quorum at step 0 (no replica has committed yet, so nobody heals) exchanges every
  member's bases over the stage's DP group (``agree``): a replica whose digest differs
  from the quorum's leader (its lowest replica id) takes the leader's.

The subspace basis differs from the bases in one way: the weights are constrained to it
before the first step, so a replica whose U differs at step 0 cannot take the leader's (its
weights would stay projected on its own U): ``agree`` stops it (CodecMismatch, not
restarted) naming both digests. A heal carries the peer's weights with its U, so there the
U is taken like the bases.
"""
from __future__ import annotations

import hashlib
import os
import sys

import torch
import torch.distributed as dist

from orchestration.components import calibration


SUBSPACE_KEY = "subspace.U"


class CodecMismatch(RuntimeError):
    """A replica's calibrated state differs from the quorum leader's and cannot be taken."""


def _named() -> dict[str, torch.Tensor] | None:
    from orchestration import codecs

    if not codecs.PCA_BASES:
        return None
    return {f"{b}.{k}": v for b, basis in sorted(codecs.PCA_BASES.items()) for k, v in basis.state_dict().items()}


def digest(named: dict[str, torch.Tensor]) -> str:
    """sha256 over the names, dtypes, shapes and bytes (order-free)."""
    h = hashlib.sha256()
    for k in sorted(named):
        t = named[k].detach().cpu().contiguous()
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:32]


class CodecState:
    """This rank's calibrated codec state (none for a codec that calibrates nothing).
    ``run_dir``: where RUN_DIR/pca_basis.pt is rewritten (by stage 0) after an adoption."""

    def __init__(self, cfg, run_dir: str, stage: int, describe: str):
        self.active = calibration.codec_of(cfg) is not None
        self.run_dir, self.stage, self.describe = run_dir, stage, describe
        self.subspace = None  # the rank's SubspaceRun (attach_subspace), with the subspace codec

    def attach_subspace(self, run) -> None:
        self.subspace = run

    def _named(self) -> dict[str, torch.Tensor] | None:
        named = _named() if self.active else None
        if self.subspace is not None:
            named = {**(named or {}), SUBSPACE_KEY: self.subspace.U}
        return named

    @property
    def digest(self) -> str | None:
        named = self._named()
        return None if named is None else digest(named)

    def state(self) -> dict:
        """For the heal state: {} or {"digest", "tensors"} (copies: served later)."""
        named = self._named()
        if named is None:
            return {}
        return {"digest": digest(named), "tensors": {k: v.detach().clone() for k, v in named.items()}}

    def load(self, sd: dict, source: str) -> None:
        """A heal's codec state: verified against its digest, adopted where ours differs."""
        if self._named() is None or not sd:
            return
        named = sd["tensors"]
        if digest(named) != sd["digest"]:
            raise ValueError(f"{self.describe}: the codec state healed from {source} does not match its digest")
        self.adopt(named, source)

    def adopt(self, named: dict[str, torch.Tensor], source: str, *, weights_follow: bool = True) -> bool:
        """Installs ``named`` as this process's bases (and subspace basis) if they differ from
        ours; True if so. ``weights_follow``: the weights come from the same peer (a heal);
        without it a differing subspace basis raises CodecMismatch."""
        mine = self.digest
        theirs = digest(named)
        if mine == theirs:
            return False
        named = dict(named)
        U = named.pop(SUBSPACE_KEY, None)
        if self.subspace is not None and U is not None and not torch.equal(U, self.subspace.U):
            if not weights_follow:
                raise CodecMismatch(
                    f"{self.describe}: this replica's subspace basis differs from {source}'s (digest {theirs[:12]}, "
                    f"this replica's {str(mine)[:12]}), and its weights are already constrained to its own: the "
                    "replicas computed different bases from the base model (different software or model files?)")
            self.subspace.adopt_basis(U)
            print(f"[elastic] {self.describe}: took the run's subspace basis from {source}", file=sys.stderr,
                  flush=True)
        if named and self.active and digest(named) != digest(_named() or {}):
            bases = calibration._bases_from_named(named)
            calibration.install(bases)
            if self.stage == 0:
                calibration.save(bases, self.run_dir)
            print(f"[elastic] {self.describe}: took the run's pca bases from {source} (digest {theirs[:12]}; this "
                  f"replica's were {str(mine)[:12]})", file=sys.stderr, flush=True)
        return True

    def agree(self, group, leader: bool) -> None:
        """Step 0, every member of the quorum: all bases exchanged over ``group`` (safetensors
        bytes, padded to the longest); a replica whose digest differs from the leader's
        (participating rank 0) takes the leader's. Raises what a failed collective raises."""
        if self._named() is None:
            return
        from safetensors.torch import load as st_load
        from safetensors.torch import save as st_save

        payload = st_save({k: v.detach().cpu().contiguous() for k, v in (self._named() or {}).items()})
        n = torch.tensor([len(payload)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
        dist.all_gather(sizes, n, group=group)
        width = max(int(s.item()) for s in sizes)
        buf = torch.zeros(width, dtype=torch.uint8)
        buf[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        got = [torch.zeros(width, dtype=torch.uint8) for _ in sizes]
        dist.all_gather(got, buf, group=group)
        if not leader:
            first = st_load(got[0][:int(sizes[0].item())].numpy().tobytes())
            self.adopt(first, "the quorum's leader at step 0", weights_follow=False)
