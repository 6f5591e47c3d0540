"""An elastic replica's calibrated codec state (orchestration.elastic.calibrated) and the
advertised-address rules (orchestration.distributed.addresses), in one process: the pca
bases travel as tensors with a digest; a heal's bases are checked against their digest and
taken where this replica's differ (installed for the codec, RUN_DIR/pca_basis.pt rewritten);
equal ones change nothing; a tampered state is refused."""
import pytest
import torch

pytest.importorskip("torchft", reason="torchft (pip install meshkern[elastic]) runs elastic replicas")

from orchestration import codecs  # noqa: E402
from orchestration.components import calibration  # noqa: E402
from orchestration.config import parse_args  # noqa: E402
from orchestration.distributed.addresses import advertise_problem, local_problem  # noqa: E402
from orchestration.elastic.calibrated import CodecState, digest  # noqa: E402


@pytest.fixture
def bases():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(4, 16, 8, generator=g)
    out = {0: calibration.fit_basis(h, 3, sink=True)}
    old = dict(codecs.PCA_BASES)
    calibration.install(out)
    yield out
    calibration.install(old)


def _state(tmp_path, stage=0):
    cfg, _ = parse_args(["--mesh.elastic"])  # the default codec: pca
    return CodecState(cfg, str(tmp_path), stage, "test rank")


def test_heal_state_round_trip_and_adoption(tmp_path, bases):
    mine = _state(tmp_path)
    sd = mine.state()
    assert set(sd) == {"digest", "tensors"} and sd["digest"] == mine.digest
    assert all(isinstance(v, torch.Tensor) for v in sd["tensors"].values())
    mine.load(sd, "peer")  # the same bases: nothing changes, nothing written
    assert not (tmp_path / calibration.BASIS_FILE).exists()
    theirs = {k: v.clone() for k, v in sd["tensors"].items()}
    theirs["0.mean"] += 1.0
    peer = {"digest": digest(theirs), "tensors": theirs}
    before = mine.digest
    mine.load(peer, "peer")
    assert mine.digest == peer["digest"] != before
    assert torch.equal(codecs.PCA_BASES[0].mean, theirs["0.mean"])
    on_disk = calibration.load(str(tmp_path))  # a restart of this replica loads the run's bases
    assert torch.equal(on_disk[0].mean, theirs["0.mean"])


def test_a_state_that_does_not_match_its_digest_is_refused(tmp_path, bases):
    mine = _state(tmp_path)
    sd = mine.state()
    sd["tensors"]["0.mean"] = sd["tensors"]["0.mean"] + 1.0  # altered after its digest was taken
    with pytest.raises(ValueError, match="does not match its digest"):
        mine.load(sd, "peer")


def test_only_stage_0_writes_the_basis_file(tmp_path, bases):
    mine = _state(tmp_path, stage=1)
    theirs = {k: v + 1.0 for k, v in mine.state()["tensors"].items()}
    assert mine.adopt(theirs, "peer")
    assert not (tmp_path / calibration.BASIS_FILE).exists()


def test_advertised_addresses():
    assert advertise_problem("10.0.0.2", "http://10.0.0.1:29510") is None
    assert advertise_problem("127.0.0.1", "http://127.0.0.1:29510") is None  # one machine
    assert advertise_problem("127.0.0.1", "") is None  # the local launcher's own lighthouse
    assert "--mesh.bind 127.0.0.1 is loopback" in advertise_problem("127.0.0.1", "http://10.0.0.1:29510")
    assert "--mesh.bind localhost is loopback" in advertise_problem("localhost", "http://10.0.0.1:29510")
    assert "wildcard" in advertise_problem("0.0.0.0", "")
    assert "wildcard" in advertise_problem("::", "http://10.0.0.1:29510")
    assert local_problem("127.0.0.1") is None
    assert "not an address of this host" in local_problem("192.0.2.77")  # TEST-NET-1: never local
