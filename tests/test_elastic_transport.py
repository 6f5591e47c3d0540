"""The heal transfer of elastic replicas (orchestration.elastic.transport), in one process:
the state arrives equal with the run's secret; without it, no byte of state is served; a
body altered on the way, or recorded for another request, is refused unread; it listens
on the host it was given; it loads with weights_only (a pickled object is refused)."""
import io
import os
import pickle
import threading
import urllib.error
import urllib.request
from datetime import timedelta

import pytest
import torch

pytest.importorskip("torchft", reason="torchft (pip install meshkern[elastic]) runs elastic replicas")

from orchestration.elastic.errors import HealRefused  # noqa: E402
from orchestration.elastic.transport import (AUTH_HEADER, NONCE_HEADER, TAG_HEADER, SecretHTTPTransport,  # noqa: E402
                                             _body_mac, _request_mac)

SECRET, OTHER = b"s" * 32, b"o" * 32
TMO = timedelta(seconds=5)


def _state():
    g = torch.Generator().manual_seed(0)
    return {"user": {"default": {"step": 7, "params": [torch.randn(5, 3, generator=g)],
                                 "optimizer": {"state": {0: {"exp_avg": torch.randn(5, 3, generator=g)}},
                                               "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0]}]}}},
            "torchft": {"step": 3, "batches_committed": 9}}


@pytest.fixture
def served():
    src = SecretHTTPTransport(SECRET, "127.0.0.1", TMO)
    state = _state()
    src.send_checkpoint([1], 3, state, TMO)
    yield src, state
    src.shutdown()


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_the_state_arrives_equal_with_the_runs_secret(served):
    src, state = served
    dst = SecretHTTPTransport(SECRET, "127.0.0.1", TMO)
    try:
        got = dst.recv_checkpoint(0, src.metadata(), 3, TMO)
    finally:
        dst.shutdown()
    assert _equal(got, state)
    assert dst.recv_log[0]["heal_bytes"] > 5 * 3 * 4 * 2 and src.refused == 0


def test_without_the_secret_no_byte_of_state_is_served(served):
    src, _ = served
    dst = SecretHTTPTransport(OTHER, "127.0.0.1", TMO)
    try:
        with pytest.raises(HealRefused, match="secret"):
            dst.recv_checkpoint(0, src.metadata(), 3, TMO)
    finally:
        dst.shutdown()
    with pytest.raises(urllib.error.HTTPError) as e:  # no proof at all
        urllib.request.urlopen(f"{src.metadata()}/heal/3", timeout=5)
    assert e.value.code == 403 and src.refused == 2


def test_a_body_altered_or_recorded_for_another_request_is_refused(served, monkeypatch):
    src, _ = served
    nonce = os.urandom(32).hex()
    req = urllib.request.Request(f"{src.metadata()}/heal/3",
                                 headers={NONCE_HEADER: nonce, AUTH_HEADER: _request_mac(SECRET, 3, nonce)})
    with urllib.request.urlopen(req, timeout=5) as f:
        body, tag = f.read(), f.headers[TAG_HEADER]
    assert tag == _body_mac(SECRET, 3, nonce, body)
    assert tag != _body_mac(SECRET, 3, nonce, body[:-1] + bytes([body[-1] ^ 1]))  # one bit flipped
    # a replayed answer (another request's nonce) does not verify for a new request
    dst = SecretHTTPTransport(SECRET, "127.0.0.1", TMO)

    class Replayed(io.BytesIO):
        headers = {TAG_HEADER: tag}

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: Replayed(body))
    try:
        with pytest.raises(HealRefused, match="refused unread"):
            dst.recv_checkpoint(0, src.metadata(), 3, TMO)
    finally:
        dst.shutdown()


def test_a_pickled_object_is_refused_by_weights_only(monkeypatch):
    evil = {"user": {"default": {"x": threading.Lock}}}  # not a tensor, a number or a container
    src = SecretHTTPTransport(SECRET, "127.0.0.1", TMO)
    dst = SecretHTTPTransport(SECRET, "127.0.0.1", TMO)
    try:
        buf = io.BytesIO()
        torch.save(evil, buf)
        with src._served_cv:
            src._served = (4, buf.getvalue())  # a peer with the secret that sends an object
        with pytest.raises(pickle.UnpicklingError):
            dst.recv_checkpoint(0, src.metadata(), 4, TMO)
    finally:
        src.shutdown()
        dst.shutdown()


def test_it_listens_on_the_host_given_and_serves_only_the_step_staged(served):
    src, _ = served
    assert src._server.server_address[0] == "127.0.0.1"
    assert src.metadata().startswith("http://127.0.0.1:")
    src.disallow_checkpoint()
    dst = SecretHTTPTransport(SECRET, "127.0.0.1", timedelta(seconds=0.5))
    src.timeout = timedelta(seconds=0.5)
    try:
        with pytest.raises(urllib.error.HTTPError) as e:  # nothing staged: 409 after the wait
            dst.recv_checkpoint(0, src.metadata(), 3, timedelta(seconds=5))
        assert e.value.code == 409
    finally:
        dst.shutdown()
