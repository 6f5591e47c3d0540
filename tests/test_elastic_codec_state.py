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
from orchestration.elastic.calibrated import SUBSPACE_KEY, CodecMismatch, CodecState, digest  # noqa: E402


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


def test_the_subspace_basis_is_taken_at_a_heal_and_a_different_one_stops_a_replica_at_step_0(tmp_path):
    """The subspace codec's U (the real SubspaceRun, constraining a tiny stage): a heal's U is
    taken (in place: the projector and the codec's table follow), a differing U at the step-0
    agreement is refused, since this replica's weights are already constrained to its own."""
    from orchestration.codecs import make_codec
    from orchestration.subspace import constraint as sub
    from orchestration.subspace.training import SubspaceRun

    cfg, _ = parse_args(["--mesh.elastic", "--boundary.codec", "subspace", "--boundary.options", '{"k": 2}'])
    H = 6
    stage = torch.nn.Module()
    stage.self_attn = torch.nn.Module()
    stage.self_attn.o_proj = torch.nn.Linear(H, H, bias=False)  # an output projection: constrained
    codec = make_codec("subspace", k=2)
    E = torch.randn(10, H)
    mesh = type("M", (), {"fast": None, "row": 0, "device": "cpu"})()
    run = SubspaceRun(cfg, mesh, stage, codec, {"U": sub.make_basis(H, 2, seed=0), "E": E})
    mine = CodecState(cfg, str(tmp_path), 0, "test rank")
    mine.attach_subspace(run)
    sd = mine.state()
    assert set(sd["tensors"]) == {SUBSPACE_KEY} and sd["digest"] == mine.digest
    other = sub.make_basis(H, 2, seed=1)
    theirs = {SUBSPACE_KEY: other}
    with pytest.raises(CodecMismatch, match="subspace basis differs"):
        mine.adopt(theirs, "the quorum's leader at step 0", weights_follow=False)
    assert not torch.equal(run.U, other)
    project = run.projector
    mine.load({"digest": digest(theirs), "tensors": theirs}, "a live peer's heal")
    assert torch.equal(run.U, other) and mine.digest == digest(theirs)
    w = torch.randn(H, H)
    name = "self_attn.o_proj.weight"
    assert torch.allclose(project(name, w), sub.project_tensor(name, w, other))


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
