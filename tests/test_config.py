"""Config: defaults < preset < file < flags, types, validation messages, --help."""
import json

import pytest

from orchestration.config import Config, build_parser, flag_name, from_dict, parse_args, presets, validate


def test_precedence_preset_file_flags(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("boundary: {p: 0.9}\ntrain: {steps: 7, lr: 1.0e-4}\n")
    cfg, _ = parse_args(["--preset", "m95", "--config", str(f), "--steps", "9"])
    assert cfg.boundary.codec == "mask"          # from the preset
    assert cfg.boundary.p == 0.9                 # file overrides preset
    assert cfg.train.lr == 1e-4 and cfg.train.steps == 9  # flag overrides file
    assert cfg.dp.mode == "diloco" and cfg.dp.compressor == "powersgd"


def test_json_file_and_typed_values(tmp_path):
    f = tmp_path / "run.json"
    f.write_text(json.dumps({"mesh": {"rows": 2, "layers_per_stage": [3, 1]}, "boundary": {"options": {"k": 3}}}))
    cfg, _ = parse_args(["--config", str(f), "--run.progress", "false", "--dp.compressor-options", '{"rank": 2}'])
    assert cfg.mesh.rows == 2 and cfg.mesh.layers_per_stage == [3, 1]
    assert cfg.boundary.options == {"k": 3} and cfg.dp.compressor_options == {"rank": 2}
    assert cfg.run.progress is False
    cfg, _ = parse_args(["--mesh.layers-per-stage", "2,1,1", "--mesh.stages", "3"])
    assert cfg.mesh.layers_per_stage == [2, 1, 1]


def test_bare_bool_flag_means_true():
    cfg, _ = parse_args(["--preset", "m95-ap", "--anchor.join", "--anchor.store", "10.0.0.2:29500"])
    assert cfg.anchor.join is True and cfg.anchor.store == "10.0.0.2:29500"
    cfg, _ = parse_args(["--run.progress", "--anchor.enabled", "false"])
    assert cfg.run.progress is True and cfg.anchor.enabled is False


def test_every_preset_loads_and_matches_its_row():
    assert set(presets()) >= {"dense", "dp", "m95", "m90-ap", "m95-ap"}
    rows = {n: parse_args(["--preset", n])[0] for n in ("dense", "dp", "m95", "m90-ap", "m95-ap")}
    assert rows["dense"].boundary.codec == "dense" and rows["dense"].dp.compressor == "none"
    assert rows["dp"].boundary.codec == "dense" and rows["dp"].dp.compressor == "powersgd"
    assert rows["m90-ap"].boundary.p == 0.9 and rows["m90-ap"].anchor.enabled
    assert rows["m95-ap"].train.optimizer == "spectral"
    # issue #15: the AP presets ship SVD factors (no SVD on fast nodes); the generic default stays dense
    assert rows["m95-ap"].anchor.transport == rows["m90-ap"].anchor.transport == "factored"
    assert parse_args(["--preset", "m95-ap", "--anchor.transport", "dense"])[0].anchor.transport == "dense"
    assert parse_args([])[0].anchor.transport == "dense"


@pytest.mark.parametrize("argv, message", [
    (["--train.batch-size", "6", "--train.microbatches", "4"], "does not split into"),
    (["--boundary.p", "1.0"], "--boundary.p must be a float in [0, 1), got 1.0"),
    (["--mesh.rows", "1", "--anchor.enabled", "true"], "needs --mesh.rows >= 2"),
    (["--mesh.stages", "2", "--mesh.layers-per-stage", "1,1,2"], "has 3 entries for 2 stages"),
    (["--train.steps", "x"], "cannot use 'x' as int"),
    (["--preset", "nope"], "unknown preset 'nope'"),
    (["--dp.mode", "ring"], "--dp.mode must be"),
    (["--anchor.join"], "--anchor.join needs --anchor.enabled"),
    (["--preset", "m95-ap", "--anchor.join"], "--anchor.join needs --anchor.store host:port"),
    (["--preset", "m95-ap", "--anchor.join", "--anchor.store", "localhost"], "--anchor.store must be host:port"),
    (["--preset", "m95-ap", "--anchor.store", "10.0.0.2:29500"], "--anchor.store is for --anchor.join"),
])
def test_bad_values_name_the_flag(argv, message):
    with pytest.raises(ValueError) as ei:
        parse_args(argv)
    assert message in str(ei.value)


def test_unknown_keys_in_files_are_errors(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("train: {stepz: 3}\n")
    with pytest.raises(ValueError, match="unknown field train.stepz"):
        parse_args(["--config", str(f)])
    f.write_text("trian: {steps: 3}\n")
    with pytest.raises(ValueError, match="unknown section 'trian'"):
        parse_args(["--config", str(f)])
    with pytest.raises(ValueError, match="not found"):
        parse_args(["--config", str(tmp_path / "missing.yaml")])


def test_help_lists_every_field():
    """Every field is a flag in the one style of every entry point (--data.seq-len); the
    field's own spelling (--data.seq_len) is accepted, not listed."""
    text = build_parser().format_help()
    cfg = Config()
    hidden = {"--run.fail-rank", "--run.fail-step"}  # test-only: accepted, not listed
    for sec, vals in cfg.to_dict().items():
        if isinstance(vals, dict):
            for k in vals:
                assert (flag_name(sec, k) in text) != (flag_name(sec, k) in hidden)
                assert "_" not in flag_name(sec, k)
    assert "--data.seq_len" not in text
    a, _ = parse_args(["--data.seq_len", "64", "--train.batch-size", "4", "--train.microbatches", "2"])
    b, _ = parse_args(["--data.seq-len", "64", "--train.batch_size", "4", "--train.microbatches", "2"])
    assert a == b and a.data.seq_len == 64 and a.train.batch_size == 4


def test_round_trip_through_dict():
    cfg, _ = parse_args(["--preset", "m90-ap", "--mesh.rows", "4"])
    again = validate(from_dict(cfg.to_dict()))
    assert again == cfg


def test_mesh_dist_backend_is_not_a_kernel_backend_and_old_name_still_loads(tmp_path):
    """mesh.dist_backend (gloo/nccl) was mesh.backend, the word the kernels use for
    cpp/cuda/triton/reference; a config file or flag with the old name still works."""
    f = tmp_path / "old.yaml"
    f.write_text("mesh: {backend: gloo}\n")
    cfg, _ = parse_args(["--config", str(f)])
    assert cfg.mesh.dist_backend == "gloo" and not hasattr(cfg.mesh, "backend")
    cfg, _ = parse_args(["--mesh.backend", "gloo"])
    assert cfg.mesh.dist_backend == "gloo"
    assert "--mesh.dist-backend" in build_parser().format_help()
    with pytest.raises(ValueError, match="--mesh.dist-backend must be"):
        parse_args(["--mesh.dist-backend", "cpp"])


# The optimizer's flags: each bad value is refused by parse_args (before any process is
# spawned), and the optimizer constructors themselves refuse the same value: the check
# here agrees with the reference it stands in for.
OPTIMIZER_FLAGS = [
    ("beta1", "--train.beta1", 1.0), ("beta2", "--train.beta2", -0.1), ("eps", "--train.eps", -1e-8),
    ("weight_decay", "--train.weight-decay", -0.01), ("tau", "--train.tau", -1e-3),
    ("tau", "--train.tau", float("nan")), ("alpha", "--train.alpha", 1.5), ("beta_anc", "--train.beta-anc", 1.0),
    ("spectral_rank", "--train.spectral-rank", 0),
]


@pytest.mark.parametrize("field,flag,bad", OPTIMIZER_FLAGS)
def test_optimizer_flags_are_checked_at_parse_time(field, flag, bad):
    import torch

    from orchestration.components.builders import make_optimizer

    with pytest.raises(ValueError, match=flag.replace(".", r"\.")):
        parse_args([flag, str(bad)])
    cfg, _ = parse_args(["--train.optimizer", "spectral"])
    setattr(cfg.train, field, bad)
    with pytest.raises(ValueError):  # what every rank's constructor would have said, later
        make_optimizer(cfg, torch.nn.Linear(4, 4))


@pytest.mark.parametrize("flag,edge", [("--train.beta1", "0"), ("--train.beta2", "0.999"), ("--train.eps", "0"),
                                       ("--train.weight-decay", "0"), ("--train.tau", "0"), ("--train.alpha", "1"),
                                       ("--train.beta-anc", "0"), ("--train.spectral-rank", "1")])
def test_optimizer_flags_accept_their_range_edges(flag, edge):
    cfg, _ = parse_args([flag, edge, "--train.optimizer", "spectral"])
    assert cfg.train.optimizer == "spectral"


def test_a_bad_optimizer_flag_stops_the_trainer_before_anything_runs(capsys, monkeypatch):
    from orchestration import train

    monkeypatch.setattr(train, "prepare", lambda *a, **k: pytest.fail("got past the config check"))
    assert train.main(["--train.alpha", "2"]) == 2
    assert "--train.alpha must be in [0, 1], got 2.0" in capsys.readouterr().err


def test_validate_checks_and_never_changes_the_config():
    import copy

    cfg, _ = parse_args(["--mesh.replicas", "1,2,2", "--boundary.codec", "aqsgd:bits=2"])
    assert (cfg.mesh.rows, cfg.mesh.stages) == (3, 2)  # derived while parsing
    assert (cfg.boundary.codec, cfg.boundary.options) == ("aqsgd", {"bits": 2})
    before = copy.deepcopy(cfg)
    assert validate(cfg) == before
    raw = Config()
    raw.mesh.replicas, raw.boundary.codec, raw.boundary.compress = [1, 2, 2, 2], "int4", "selective"
    with pytest.raises(ValueError, match="makes 4 replicas of up to 2 stages, not --mesh.rows 3 x --mesh.stages 2"):
        validate(raw)  # rows not derived: validate says so instead of fixing it
    again = from_dict(raw.to_dict())  # a config from a dict is normalized like parsed flags
    assert (again.mesh.rows, again.mesh.stages) == (4, 2) and validate(again) is again
