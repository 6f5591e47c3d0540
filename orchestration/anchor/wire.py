"""The anchor circuit's wire format (docs/anchor.md, "Wire protocol"): the fixed int64
message header, the layout of one GRAD payload (``Layout``), and blocking send/receive on a
two-process gloo pair link. Tensors only, nothing pickled."""
from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch

from orchestration.config import ANCHOR_TRANSPORTS
from orchestration.distributed.failures import LinkFailure

MAGIC = 0x4D4B414E  # "MKAN"
HEADER_LEN = 16
F_MAGIC, F_KIND, F_ROUND, F_VERSION, F_TRANSPORT, F_NUMEL, F_LAYOUT, F_DTYPE, F_MS = range(9)
REQ, SNAP, GRAD, STOP, AUTH = 1, 2, 3, 4, 5
TRANSPORTS = {name: i for i, name in enumerate(ANCHOR_TRANSPORTS)}  # dense 0, factored 1
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.uint8: 3}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
TAG = 61  # one tag on a dedicated group: messages between two ranks arrive in send order
HEADER_BYTES = HEADER_LEN * 8
LINK_TIMEOUT = timedelta(days=7)  # never time out an anchor wait: a slow anchor is not a dead one
DRAIN_FACTOR = 4  # a wrong-size payload up to this many times the expected size is drained


def header(kind: int, *, round: int = 0, version: int = 0, transport: int = 0, numel: int = 0,
           layout: int = 0, dtype: int = 0, ms: int = 0) -> torch.Tensor:
    """The fixed int64[HEADER_LEN] header of one message."""
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h[F_MAGIC], h[F_KIND], h[F_ROUND], h[F_VERSION] = MAGIC, kind, round, version
    h[F_TRANSPORT], h[F_NUMEL], h[F_LAYOUT], h[F_DTYPE], h[F_MS] = transport, numel, layout, dtype, ms
    return h


def layout_hash(shapes) -> int:
    """FNV-1a (63 bits) over the tensor shapes of a payload: equal on both ends iff
    they agree on every tensor's shape and order (Python's hash() is salted per process)."""
    h = 0xCBF29CE484222325
    for shape in shapes:
        for d in (*shape, -1):
            h ^= (int(d) & 0xFFFFFFFF)
            h = (h * 0x100000001B3) & ((1 << 63) - 1)
    return h


class ProtocolError(LinkFailure):
    """The peer sent something this end cannot follow (a wrong header, an impossible size):
    the link is unusable, the same as a broken connection."""


class Rejected(ValueError):
    """An anchor message that must not be applied; ``reason`` is the counter it goes to."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def eligible_params(stage, groups) -> list[tuple[str, torch.nn.Parameter]]:
    """(HF name, param) of the parameters with a spectral prior, in stage order:
    2-D params of the groups whose ``spectral`` flag is true (SpectralAdamW's rule).
    ``groups``: SpectralAdamW.param_groups or meshkern.optim.spectral_param_groups(stage)."""
    ok = {id(p) for g in groups if g.get("spectral", True) for p in g["params"] if p.dim() == 2}
    return [(stage.hf_name(n), p) for n, p in stage.named_parameters() if p.requires_grad and id(p) in ok]


@dataclass(frozen=True)
class Layout:
    """What one GRAD payload holds: per eligible parameter [m, n], its gradient (dense)
    or U[m, r], S[r], V[n, r] with r = min(rank, m, n) (factored), flat and in order."""

    names: tuple
    shapes: tuple
    transport: str
    rank: int
    dtype: torch.dtype  # payload dtype: the parameters' dtype (dense) or float32 (factored)

    @classmethod
    def build(cls, named, transport: str, rank: int, param_dtype: torch.dtype) -> "Layout":
        if transport not in TRANSPORTS:  # (the trainer's flag: checked by orchestration.config.validate)
            raise ValueError(f"anchor transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        if param_dtype not in DTYPE_CODES or not param_dtype.is_floating_point:
            raise TypeError(f"anchor payloads support {list(DTYPE_CODES)}, not {param_dtype}")
        dtype = torch.float32 if transport == "factored" else param_dtype
        return cls(tuple(n for n, _ in named), tuple(tuple(p.shape) for _, p in named), transport, int(rank), dtype)

    def pieces(self) -> list[list[tuple[int, ...]]]:
        """Per entry, the shapes of its tensors on the wire."""
        if self.transport == "dense":
            return [[s] for s in self.shapes]
        out = []
        for m, n in self.shapes:
            r = min(self.rank, m, n)
            out.append([(m, r), (r,), (n, r)])
        return out

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for piece in self.pieces() for s in piece)

    @property
    def hash(self) -> int:
        return layout_hash([s for piece in self.pieces() for s in piece])

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def grad_header(self, round: int, version: int, ms: int = 0) -> torch.Tensor:
        return header(GRAD, round=round, version=version, transport=TRANSPORTS[self.transport],
                      numel=self.numel, layout=self.hash, dtype=DTYPE_CODES[self.dtype], ms=ms)

    def check_header(self, h: torch.Tensor) -> None:
        """Raises Rejected("protocol") for a message that is not a GRAD of this transport,
        Rejected("shape") for a GRAD whose size, dtype or shapes differ from this layout."""
        if h.numel() != HEADER_LEN or int(h[F_MAGIC]) != MAGIC or int(h[F_KIND]) != GRAD:
            raise Rejected("protocol", f"not an anchor update header: {h.tolist()}")
        if int(h[F_TRANSPORT]) != TRANSPORTS[self.transport]:
            raise Rejected("shape", f"transport code {int(h[F_TRANSPORT])}, expected {self.transport}")
        if int(h[F_DTYPE]) != DTYPE_CODES[self.dtype]:
            raise Rejected("shape", f"payload dtype code {int(h[F_DTYPE])}, expected {self.dtype}")
        if int(h[F_NUMEL]) != self.numel or int(h[F_LAYOUT]) != self.hash:
            raise Rejected("shape", f"payload of {int(h[F_NUMEL])} elements / layout {int(h[F_LAYOUT]):x}, "
                                    f"expected {self.numel} / {self.hash:x} ({len(self.shapes)} tensors)")

    def encode(self, grads, momentum=None) -> torch.Tensor:
        """The flat CPU payload: gradients in this layout's order (None: zeros), or the
        factors of ``momentum`` (a meshkern.optim.AnchorMomentum over ``shapes``) after
        folding them in. A non-finite gradient goes out non-finite (all NaN when factored,
        the momentum unchanged), so every fast rank rejects and counts it; in delay mode
        that also ends their wait for it."""
        grads = [torch.zeros(s, dtype=self.dtype) if g is None else g.detach() for g, s in zip(grads, self.shapes)]
        if self.transport == "dense":
            return torch.cat([g.reshape(-1).to("cpu", self.dtype) for g in grads])
        if not momentum.update(grads):  # non-finite: momentum kept; receivers reject and count it
            return torch.full((self.numel,), float("nan"), dtype=torch.float32)
        flat = []
        for U, S, V in momentum.factors():
            flat += [U.reshape(-1), S.reshape(-1), V.reshape(-1)]
        return torch.cat(flat).to("cpu", torch.float32)

    def decode(self, payload: torch.Tensor) -> list:
        """Per entry a tensor (dense) or a (U, S, V) triple (factored), views of ``payload``.
        Raises Rejected("shape") for a wrong size/dtype, Rejected("nonfinite") for NaN/Inf,
        Rejected("negative") for negative singular values."""
        if payload.dim() != 1 or payload.numel() != self.numel or payload.dtype != self.dtype:
            raise Rejected("shape", f"payload {tuple(payload.shape)} {payload.dtype}, expected "
                                    f"({self.numel},) {self.dtype}")
        if not bool(torch.isfinite(payload).all()):
            raise Rejected("nonfinite", "anchor update contains NaN/Inf")
        out, o = [], 0
        for piece in self.pieces():
            ts = []
            for s in piece:
                k = math.prod(s)
                ts.append(payload[o:o + k].view(s))
                o += k
            if self.transport == "factored" and bool((ts[1] < 0).any()):
                raise Rejected("negative", "anchor factors have negative singular values")
            out.append(ts[0] if self.transport == "dense" else tuple(ts))
        return out


def gloo_reason(e: BaseException) -> str:
    """A one-line reason for a broken link: gloo's message without its source location
    ("[.../pair.cc:553] ") and the advice it appends."""
    why = str(e).splitlines()[0] if str(e) else ""
    why = re.sub(r"^\[[^\]]*\]\s*", "", why).split(" This is typically")[0]
    return f"{type(e).__name__}: {why[:200]}"


# A payload travels in pieces of at least CHUNK_BYTES and at most MAX_CHUNKS of them, cut by
# its size alone, so both ends cut it alike without telling each other. Why pieces: a paced
# sender (``max_bps``) must hand the socket little at a time, or its burst sits in the
# uplink's queue ahead of the pipeline's activations (a home router's uplink is one FIFO);
# 8 KiB is 0.13 s at 500 kbit/s and 0.3 ms at 200 Mbit/s. The receiver posts every piece's
# receive at once, so gloo's notice that a receive is posted costs one round trip per
# payload, not one per piece.
CHUNK_BYTES = 8 * 1024
MAX_CHUNKS = 1024


def pieces(numel: int, element_size: int) -> list[tuple[int, int]]:
    """The (start, end) element ranges a payload of ``numel`` values travels in."""
    if numel * element_size <= CHUNK_BYTES:
        return [(0, numel)]
    per = max(CHUNK_BYTES // element_size, -(-numel // MAX_CHUNKS))
    return [(i, min(i + per, numel)) for i in range(0, numel, per)]


def send(tensors, peer: int, pg, timeout: timedelta = LINK_TIMEOUT, max_bps: float | Callable[[], float] = 0.0) -> int:
    """Sends ``tensors`` in order to ``peer`` (0 or 1) of a pair link; returns the bytes.
    ``timeout``: how long the peer may take to take them (elastic replicas: bounded,
    ``payload_timeout``; otherwise a slow peer is not a dead one). ``max_bps`` > 0 paces the
    bytes to at most that many bits per second (--anchor.max-rate-bps): one piece at a
    time, each after the pace allows it. A callable is asked before every piece (a link
    that is closing lifts its pace to 0, unpaced, to be done sooner)."""
    pace = max_bps if callable(max_bps) else (lambda: max_bps)
    flat = [t.reshape(-1)[a:b] for t in tensors for a, b in pieces(t.numel(), t.element_size())]
    total = sum(t.numel() * t.element_size() for t in tensors)
    if pace() <= 0:
        works = [pg.send([t], peer, TAG) for t in flat]
        for w in works:
            w.wait(timeout)
        return total
    t0, done = time.monotonic(), 0
    for t in flat:
        rate = pace()
        ahead = t0 + 8.0 * done / rate - time.monotonic() if rate > 0 else 0.0
        if ahead > 0:
            time.sleep(ahead)
        pg.send([t], peer, TAG).wait(timeout)
        done += t.numel() * t.element_size()
    return total


def recv(numel: int, dtype, peer: int, pg, timeout: timedelta = LINK_TIMEOUT) -> torch.Tensor:
    """The next message from ``peer``: ``numel`` values of ``dtype`` (received in the pieces
    ``send`` cut it into). ``timeout``: for a payload whose header arrived
    (``payload_timeout``), per piece; the next message itself may take any time
    (LINK_TIMEOUT)."""
    t = torch.empty(numel, dtype=dtype)
    works = [pg.recv([t[a:b]], peer, TAG) for a, b in pieces(numel, t.element_size())]
    for w in works:
        w.wait(timeout)
    return t


PAYLOAD_FLOOR_BPS = 1e6  # the slowest link a payload's timeout allows for (as the checkpoint export's)


def payload_timeout(nbytes: int, timeout_s: float) -> timedelta:
    """How long the payload of a header that arrived may take: ``timeout_s`` (--mesh.timeout-s)
    plus its bytes at PAYLOAD_FLOOR_BPS. A sender that died mid-payload (gloo does not always
    wake a receive posted to a peer whose connection closed) is then a link failure, not a
    wait of LINK_TIMEOUT."""
    return timedelta(seconds=timeout_s + 8.0 * nbytes / PAYLOAD_FLOOR_BPS)
