"""orchestration.experiments end to end at --quick scale with a tiny model: the trainer
runs as a subprocess, results/table/plots are written, a second invocation skips the
finished rows, and the table's numbers are the ones in the result files."""
import glob
import json
import os

import pytest

from orchestration.experiments import cli as experiments
from orchestration.experiments import evaluation, rows, runner


@pytest.fixture(scope="module")
def tiny(tiny_factory):
    """A 2-layer tiny model on less text: the end-to-end experiment test stays short."""
    return tiny_factory("tiny_exp", num_layers=2, text_chars=60_000)


def _argv(tiny, out, rows="dense,m95"):
    return ["--quick", "--rows", rows, "--seeds", "0", "--model", str(tiny / "model"),
            "--data", str(tiny / "data.txt"), "--out", str(out / "res"), "--figures", str(out / "fig"),
            "--work", str(out / "work"), "--trainer-args", "--mesh.timeout-s 30"]


@pytest.mark.slow
def test_quick_run_writes_results_table_plots_and_resumes(tiny, tmp_path, capsys):
    # One row keeps the test short (each row is a trainer process tree); m95 exercises the
    # mask codec, DiLoCo-less single replica, checkpoints, evaluation and pruning.
    assert experiments.main(_argv(tiny, tmp_path, rows="m95")) == 0
    r = json.loads((tmp_path / "res" / "records" / "m95-s0.json").read_text())
    assert r["complete"] and r["row"] == "m95" and r["seed"] == 0
    # one evaluation at step 0 (base) and at every checkpoint (every 2 of 4 steps)
    assert [p["step"] for p in r["curve"]] == [0, 2, 4]
    assert [p["tokens"] for p in r["curve"]] == [0, 2 * 2 * 32, 4 * 2 * 32]  # fast rows 1 x batch 2 x seq 32
    assert r["final_loss"] == r["curve"][-1]["loss"] and r["base_loss"] == r["curve"][0]["loss"]
    assert all(p["loss"] > 0 and p["perplexity"] > 1 for p in r["curve"])
    assert r["modeled_tokens_per_s"] > 0 and r["network_bound_tokens_per_s"] >= r["modeled_tokens_per_s"]
    assert "0.5" in r["pruning"]  # main rows carry the pruning sweep
    # mask p=0.95 sends K=round(0.05 H) fp32 values per token each way, nothing else
    K = round(0.05 * r["hidden_size"])
    assert r["bytes_per_token"]["pp_fwd"] == pytest.approx(4 * K)
    assert r["bytes_per_token"]["pp_bwd"] == pytest.approx(4 * K)
    assert r["bytes_per_token"]["dp"] == 0 and r["bytes_per_token"]["anchor"] == 0  # one replica, no anchor
    table = (tmp_path / "res" / "table.md").read_text()
    assert "| m95 |" in table and f"{r['final_loss']:.3f}" in table
    for group_plot in ("main_loss_vs_tokens.png", "main_loss_vs_wallclock.png"):
        png = tmp_path / "fig" / group_plot
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "res" / "summary.csv").read_text().count("\n") == 2
    # checkpoints are removed after evaluation unless asked to keep them
    assert not glob.glob(str(tmp_path / "work" / "*" / "checkpoints"))

    # second invocation: the row is finished, nothing trains again
    capsys.readouterr()
    mtime = os.path.getmtime(tmp_path / "res" / "records" / "m95-s0.json")
    assert experiments.main(_argv(tiny, tmp_path, rows="m95")) == 0
    out = capsys.readouterr().out
    assert "finished, skipped" in out and "training" not in out
    assert os.path.getmtime(tmp_path / "res" / "records" / "m95-s0.json") == mtime


@pytest.mark.slow
def test_incomplete_result_is_rerun_and_failures_are_recorded(tiny, tmp_path, capsys):
    runs = tmp_path / "res" / "records"
    runs.mkdir(parents=True)
    (runs / "dense-s0.json").write_text('{"row": "dense", "seed": 0, "complete": false}')
    # a trainer flag that fails validation makes the row fail, recorded as incomplete
    argv = _argv(tiny, tmp_path, rows="dense")
    argv[argv.index("--trainer-args") + 1] = "--train.lr -1"
    assert experiments.main(argv) == 1
    r = json.loads((runs / "dense-s0.json").read_text())
    assert r["complete"] is False and "trainer exit" in r["status"]
    assert "FAILED" in capsys.readouterr().out


def test_row_selection_and_bad_flags():
    assert [r.name for r in rows.select_rows("main")] == ["dense", "dp", "m95", "m90-ap", "m95-ap"]
    assert {r.group for r in rows.select_rows("baselines")} == {"baseline"}
    assert [r.name for r in rows.select_rows("m95-ap,dense")] == ["dense", "m95-ap"]
    with pytest.raises(ValueError, match="unknown row"):
        rows.select_rows("m96")
    assert experiments.main(["--rows", "nope"]) == 2
    assert experiments.main(["--seeds", "", "--model", "x"]) == 2


def test_trainer_argv_adds_the_anchor_row_and_is_valid():
    from orchestration.config import parse_args

    s = rows.Settings(model="m", data="corpus:python", **rows.DEFAULT)
    for row in rows.ROWS:
        cfg, _ = parse_args(rows.trainer_argv(row, 3, s, "/tmp/w", "n"))
        assert cfg.fast_rows == s.fast_rows and cfg.train.seed == 3 and cfg.train.steps == s.steps
        assert cfg.anchor.enabled == row.preset.endswith("-ap")  # presets m90-ap / m95-ap carry the anchor
        assert cfg.mesh.rows == s.fast_rows + int(cfg.anchor.enabled)
    cfg, _ = parse_args(rows.trainer_argv(rows.ROW_BY_NAME["delay50"], 0, s, "/tmp/w", "n"))
    assert cfg.anchor.delay == 50 and cfg.anchor.max_staleness >= 50 and cfg.mesh.rows == s.fast_rows + 1


def test_codec_eval_loss_dense_is_plain_loss_and_mask_is_the_hand_computation(tiny):
    """The codec-on held-out loss (evaluation.codec_eval_loss: the trainer's stage split +
    boundary codec, no training): with the dense codec it is the plain held-out loss; with
    the p=0.95 mask it differs, and equals zeroing the dims the Philox key drops at the one
    boundary of a 2-stage split, by hand."""
    import torch
    import torch.nn.functional as F

    from meshkern.mask import MaskKey, mask_indices
    from orchestration.config import parse_args
    from orchestration.models.loading import load_causal_lm
    from orchestration.models.scoring import eval_loss

    model, _ = load_causal_lm(tiny / "model")
    V, H = model.config.vocab_size, model.config.hidden_size
    held = torch.randint(0, V, (6, 24), generator=torch.Generator().manual_seed(0))
    plain = eval_loss(model, held)["loss"]

    def cfg_of(preset):
        return parse_args(["--preset", preset, "--model", str(tiny / "model"), "--mesh.rows", "1",
                           "--mesh.stages", "2"])[0]

    dense = evaluation.codec_eval_loss(model, held, cfg_of("dense"), seed=1, step=20)
    assert dense["loss"] == pytest.approx(plain, rel=1e-6, abs=1e-6)

    cfg = cfg_of("m95")
    masked = evaluation.codec_eval_loss(model, held, cfg, seed=1, step=20)["loss"]
    assert abs(masked - plain) > 1e-3  # 95% of the boundary dims dropped (random init: either sign)

    # by hand: stage 0 = embedding + the first half of the layers, then keep the K dims
    # mask_indices names for every token (key: replica 0's seed rule, boundary 0, step 20)
    from orchestration.distributed.stages import split_model

    s0, s1 = split_model(model, 2, cfg.mesh.layers_per_stage or None)
    with torch.no_grad():
        h = s0(held)
        idx = mask_indices(MaskKey((1 << 16) | 0, 0, 20, 0), held.numel(), H, cfg.boundary.p)
        keep = torch.zeros(held.numel(), H).scatter_(1, idx, 1.0).view_as(h)
        logits = s1(h * keep)
        hand = F.cross_entropy(logits[:, :-1].reshape(-1, V).float(), held[:, 1:].reshape(-1)).item()
    assert masked == pytest.approx(hand, rel=1e-5)


def test_codec_eval_loss_with_pca_decodes_with_the_runs_saved_basis(tiny, tmp_path):
    """A codec that needs calibration (pca) is evaluated with the basis the run saved
    (RUN_DIR/pca_basis.pt): the loss equals the stage split with that codec's round trip at
    the boundary, by hand."""
    import torch
    import torch.nn.functional as F

    from meshkern.mask import MaskKey
    from orchestration.codecs import codec_for
    from orchestration.components import calibration
    from orchestration.config import parse_args
    from orchestration.distributed.stages import split_model
    from orchestration.models.loading import load_causal_lm

    model, _ = load_causal_lm(tiny / "model")
    V = model.config.vocab_size
    held = torch.randint(0, V, (6, 24), generator=torch.Generator().manual_seed(0))
    cfg = parse_args(["--model", str(tiny / "model"), "--mesh.rows", "1", "--mesh.stages", "2",
                      "--boundary.codec", "pca"])[0]
    codec = codec_for(cfg.boundary)
    (L,) = calibration.boundary_layers(model.config.num_hidden_layers, 2, cfg.mesh.layers_per_stage)
    bases = calibration.fit_layer_bases(model, held[:4], codec, [L], grad_rows=0)
    calibration.save(bases, str(tmp_path))
    got = evaluation.codec_eval_loss(model, held, cfg, seed=1, step=20, run_dir=str(tmp_path))["loss"]
    codec.bases = {0: bases[L]}
    s0, s1 = split_model(model, 2, cfg.mesh.layers_per_stage or None)
    with torch.no_grad():
        h = s0(held)
        key = MaskKey(0, 0, 20, 0)  # (pca reads the boundary only)
        logits = s1(codec.decode_fwd(codec.encode_fwd(h, key)[0], key, tuple(h.shape), h.dtype))
        hand = F.cross_entropy(logits[:, :-1].reshape(-1, V).float(), held[:, 1:].reshape(-1)).item()
    assert got == pytest.approx(hand, rel=1e-5)


def test_results_go_under_runs_by_default_and_into_docs_only_when_asked():
    a = experiments.build_parser().parse_args([])
    experiments.output_dirs(a)
    assert (a.out, a.figures) == (os.path.join("runs", "experiments", "results"),
                                  os.path.join("runs", "experiments", "results", "figures"))
    a = experiments.build_parser().parse_args(["--docs"])
    experiments.output_dirs(a)
    assert (a.out, a.figures) == ("results", os.path.join("results", "figures"))
    a = experiments.build_parser().parse_args(["--out", "x"])
    experiments.output_dirs(a)
    assert (a.out, a.figures) == ("x", os.path.join("x", "figures"))


def test_experiments_help_shows_each_default_once():
    text = " ".join(experiments.build_parser().format_help().split())
    assert "(default: None)" not in text and "(default: False)" not in text
    assert text.count("default 80") == 1 and "default 80, --quick 4) (default" not in text
    assert "(default: main)" in text and "(default: 0,1,2)" in text and "--docs" in text


def test_code_version_names_only_the_checkout_the_code_is_in(tmp_path):
    """A record's code version is the commit of the checkout holding the code; a copy of the
    tree inside another checkout (or no checkout) is "unknown", not the outer commit."""
    import subprocess

    def git(*a):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *a], cwd=tmp_path, check=True,
                       capture_output=True)

    git("init", "-q")
    (tmp_path / "f.txt").write_text("x")
    git("add", "f.txt")
    git("commit", "-q", "-m", "c")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True,
                          text=True).stdout.strip()
    assert runner._code_version(str(tmp_path)) == head
    (tmp_path / "f.txt").write_text("y")
    assert runner._code_version(str(tmp_path)) == head + "-dirty"
    (tmp_path / "copy").mkdir()
    assert runner._code_version(str(tmp_path / "copy")) == "unknown"


@pytest.mark.slow
def test_an_interrupted_row_continues_from_its_last_checkpoint(tiny, tmp_path, monkeypatch):
    """A row whose trainer died after its step-2 checkpoint continues from there when the
    tool runs again (issue #28: long rows over several sessions), and its record is the
    one an uninterrupted run writes: the same training losses and held-out curve."""
    import subprocess

    assert experiments.main(_argv(tiny, tmp_path / "whole", rows="m95")) == 0
    whole = json.loads((tmp_path / "whole" / "res" / "records" / "m95-s0.json").read_text())

    real_popen, calls = subprocess.Popen, []

    def dies_once(cmd, *args, **kw):  # the first trainer loses rank 1 at the start of step 3
        calls.append(list(cmd))
        extra = ["--run.fail-rank", "1", "--run.fail-step", "2"] if len(calls) == 1 else []
        return real_popen(list(cmd) + extra, *args, **kw)

    monkeypatch.setattr(runner.subprocess, "Popen", dies_once)
    out = tmp_path / "cut"
    assert experiments.main(_argv(tiny, out, rows="m95")) == 1
    rec = json.loads((out / "res" / "records" / "m95-s0.json").read_text())
    assert rec["complete"] is False and rec["status"].startswith("trainer exit")
    assert runner.resume_point(str(out / "work" / "m95-s0"), calls[0][3:])[1] == 2

    assert experiments.main(_argv(tiny, out, rows="m95")) == 0
    assert calls[1][-2:] == ["--checkpoint.resume", "latest"] and calls[1][:-2] == calls[0]
    rec = json.loads((out / "res" / "records" / "m95-s0.json").read_text())
    assert rec["complete"] and rec["resumed_from_step"] == 2
    assert rec["train_loss"] == whole["train_loss"]
    assert [p["loss"] for p in rec["curve"]] == [p["loss"] for p in whole["curve"]]


def test_a_row_started_with_other_flags_does_not_resume(tmp_path):
    run_dir = tmp_path / "m95-s0"
    run_dir.mkdir()
    assert runner.resume_point(str(run_dir), ["--steps", "4"]) is None  # never started: no row.json
    rows._write_json(str(run_dir / runner.ROW_FILE), {"trainer_argv": ["--steps", "8"]})
    assert runner.resume_point(str(run_dir), ["--steps", "4"]) is None  # other flags
    assert runner.resume_point(str(run_dir), ["--steps", "8"]) is None  # same flags, no checkpoint yet


def test_paired_gaps_subtract_dense_seed_by_seed_at_common_steps():
    from orchestration.experiments.report import paired_gaps

    def rec(seed, losses):
        return {"seed": seed, "curve": [{"step": s, "loss": v} for s, v in losses.items()]}
    by_row = {"dense": [rec(0, {0: 3.0, 10: 2.0, 20: 1.5}), rec(1, {0: 3.2, 10: 2.4, 20: 1.9})],
              "a": [rec(0, {0: 3.0, 10: 2.1, 20: 1.7}), rec(1, {0: 3.2, 10: 2.7, 20: 2.0}), rec(5, {0: 9.0})],
              "b": [rec(1, {0: 3.2, 10: 2.5})],  # only step 0 and 10 evaluated
              "c": [rec(7, {0: 1.0})]}  # no seed in common with dense
    g = paired_gaps(by_row)
    assert sorted(g) == ["a", "b"]
    steps, mean, lo, hi, n = zip(*g["a"])
    assert steps == (0, 10, 20) and n == (2, 2, 2)
    assert mean == pytest.approx((0.0, 0.2, 0.15)) and lo == pytest.approx((0.0, 0.1, 0.1))
    assert hi == pytest.approx((0.0, 0.3, 0.2))
    assert [(s, round(m, 6), k) for s, m, _, _, k in g["b"]] == [(0, 0.0, 1), (10, 0.1, 1)]


def test_record_settings_name_the_model_from_home_not_this_machine():
    """A record's settings write a model under the home directory as ~/..., so records made
    on one machine match (and name no path of it) on another."""
    import os

    from orchestration.experiments.rows import DEFAULT, Settings

    home_model = os.path.join(os.path.expanduser("~"), ".cache", "meshkern", "base-v1")
    assert Settings(model=home_model, data="corpus:python", **DEFAULT).key()["model"] == "~/.cache/meshkern/base-v1"
    assert Settings(model="/opt/models/x", data="corpus:python", **DEFAULT).key()["model"] == "/opt/models/x"


def test_share_of_dense_gain_is_paired_by_seed_in_both_tables():
    """Issue #43: the tables report the share of dense's gain (base - row) / (base - dense),
    seed by seed at every evaluation and at the end, also for the codec-on loss."""
    from orchestration.experiments.report import gain_share, make_curve_table, make_table

    assert gain_share(2.1, 3.0, 2.0) == pytest.approx(0.9)
    assert gain_share(2.5, 3.0, 3.0) != gain_share(2.5, 3.0, 3.0)  # NaN: dense gained nothing

    def rec(seed, losses, codec_on=None):
        c = [{"step": s, "loss": v} for s, v in losses.items()]
        return {"seed": seed, "curve": c, "base_loss": c[0]["loss"], "final_loss": c[-1]["loss"],
                "final_perplexity": 1.0, "bytes_per_token": dict.fromkeys(("pp_fwd", "pp_bwd", "dp", "anchor", "tied"), 0.0),
                "bytes_per_token_total": 0.0, "hidden_size": 8, "modeled_tokens_per_s": 1.0,
                "network_bound_tokens_per_s": 1.0, "codec_on_loss": codec_on}
    by_row = {"dense": [rec(0, {0: 3.0, 10: 2.0}), rec(1, {0: 3.0, 10: 2.5})],
              "a": [rec(0, {0: 3.0, 10: 2.2}, codec_on=2.1), rec(1, {0: 3.0, 10: 2.55}, codec_on=2.5)]}
    s = rows.Settings(model="m", data="d", steps=10, fast_rows=1, stages=2, batch_size=1, microbatches=1,
                      seq_len=8, eval_every=10, eval_sequences=1, prune=())
    table = make_table(by_row, s).splitlines()
    head = [c.strip() for c in table[0].split("|")]
    a = [c.strip() for c in table[3].split("|")]
    assert a[head.index("share of Dense's gain (paired)")] == "85.0 ± 7.1 %"  # 0.8 and 0.9
    assert a[head.index("codec-on share of Dense's gain")] == "95.0 ± 7.1 %"  # 0.9 and 1.0
    curve = make_curve_table(by_row).splitlines()
    head = [c.strip() for c in curve[0].split("|")]
    assert [c.strip() for c in curve[3].split("|")][head.index("share of Dense's gain @ 10 (paired)")] == "85.0 ± 7.1 %"
    assert [c.strip() for c in curve[2].split("|")][head.index("share of Dense's gain @ 10 (paired)")] == "100 %"
