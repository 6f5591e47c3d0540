"""Readers of the long runs' records that the issue #43 share tables (results/*/shares.py)
have in common. Share of dense's gain = (base - loss) / (base - dense loss at that step)."""
import json


def curve(rec: dict) -> dict:
    """{step: held-out loss of the deployed model} of an experiments record."""
    return {c["step"]: c["loss"] for c in rec["curve"]}


def sink_loss(path: str, step: int = 200):
    """The held-out loss with the sink's round trip at ``step`` from an
    ``orchestration.diagnose.mismatch`` JSON-lines file (None if that step is not there)."""
    for line in open(path):
        r = json.loads(line)
        if r.get("step") == step:
            return r["loss"]["sink"]
    return None


def pp_bytes(rec: dict) -> float:
    """Pipeline bytes per token of a record, both directions."""
    b = rec["bytes_per_token"]
    return b["pp_fwd"] + b["pp_bwd"]
