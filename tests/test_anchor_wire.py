"""The anchor link's payload pieces (orchestration.anchor.wire.pieces / send / recv) on a real
gloo pair: every size and dtype arrives as sent, and a paced send keeps to its rate."""
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from orchestration.anchor import wire


def test_pieces_cover_the_payload_in_order_by_its_size_alone():
    assert wire.pieces(10, 4) == [(0, 10)]  # a header or a nonce: one message
    n = 3 * wire.CHUNK_BYTES // 4 + 5  # fp32 values: three full pieces and a rest
    got = wire.pieces(n, 4)
    assert got[0] == (0, wire.CHUNK_BYTES // 4) and got[-1][1] == n and len(got) == 4
    assert all(a == b for (_, a), (b, _) in zip(got, got[1:]))
    big = wire.pieces(10**9, 1)  # a 1 GB payload: at most MAX_CHUNKS pieces
    assert len(big) <= wire.MAX_CHUNKS and big[-1][1] == 10**9


def _pair(port):
    """Two gloo ranks of one process group each, joined by a TCPStore (threads of this process)."""
    store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=30))
    out = [None, None]

    def make(r, s):
        out[r] = dist.ProcessGroupGloo(dist.PrefixStore("p", s), r, 2, timedelta(seconds=30))

    ts = [threading.Thread(target=make, args=(r, s)) for r, s in ((0, store), (1, client))]
    [t.start() for t in ts]
    [t.join() for t in ts]
    return out, (store, client)


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("max_bps", [0.0, 2e6])
def test_payloads_of_every_size_arrive_as_sent(max_bps):
    (a, b), _stores = _pair(_free_port())
    torch.manual_seed(0)
    msgs = [torch.arange(16, dtype=torch.int64), torch.randn(1), torch.randn(wire.CHUNK_BYTES // 4),
            torch.randn(wire.CHUNK_BYTES // 4 + 1), torch.randint(0, 255, (3 * wire.CHUNK_BYTES + 7,), dtype=torch.uint8),
            torch.randn(20_001).to(torch.bfloat16)]
    got = []
    t = threading.Thread(target=lambda: got.extend(wire.recv(m.numel(), m.dtype, 0, b) for m in msgs))
    t.start()
    sent = wire.send(msgs, 1, a, max_bps=max_bps)
    t.join()
    assert sent == sum(m.numel() * m.element_size() for m in msgs)
    assert all(torch.equal(x, y) for x, y in zip(msgs, got))


def test_a_paced_send_takes_at_least_its_bytes_at_the_pace():
    # a lower bound only: a loaded machine makes it slower, never faster
    (a, b), _stores = _pair(_free_port())
    x = torch.zeros(8 * wire.CHUNK_BYTES, dtype=torch.uint8)  # 8 pieces
    rate = 8 * wire.CHUNK_BYTES * 8 / 0.5  # the whole payload in 0.5 s
    t = threading.Thread(target=lambda: wire.recv(x.numel(), x.dtype, 0, b))
    t.start()
    t0 = time.monotonic()
    wire.send([x], 1, a, max_bps=rate)
    took = time.monotonic() - t0
    t.join()
    assert took >= 0.5 * 7 / 8  # the last piece goes as soon as the pace allows it


def test_the_pace_is_asked_before_every_piece_and_0_lifts_it(monkeypatch):
    """The sleeps a paced send asks for (on a fake clock that only sleeping moves): at a
    constant pace they add up to the payload's time at that pace less one piece; a pace that
    drops to 0 (a closing link) asks for none after that."""
    (a, b), _stores = _pair(_free_port())
    x = torch.zeros(8 * wire.CHUNK_BYTES, dtype=torch.uint8)
    rate = wire.CHUNK_BYTES * 8 / 100.0  # one piece per 100 s
    for pace, want in ((rate, 7 * 100.0), (iter([rate] * 3 + [0.0] * 8).__next__, 100.0)):
        slept, clock = [], [0.0]
        monkeypatch.setattr(wire.time, "monotonic", lambda: clock[0])
        monkeypatch.setattr(wire.time, "sleep", lambda s: (slept.append(s), clock.__setitem__(0, clock[0] + s)))
        got = []
        t = threading.Thread(target=lambda: got.append(wire.recv(x.numel(), x.dtype, 0, b)))
        t.start()
        wire.send([x], 1, a, max_bps=pace)
        t.join()
        assert torch.equal(got[0], x)
        assert sum(slept) == pytest.approx(want, rel=0.01)
