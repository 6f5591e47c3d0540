"""orchestration.diagnose.mismatch: the boundary inputs against known answers, and the
deployed / codec losses equal the evaluation's own."""
import pytest
import torch

from orchestration.codecs import make_codec
from orchestration.components import calibration
from orchestration.diagnose import mismatch
from meshkern.mask import MaskKey


def _nf_case(H=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(1, -2, H)
    h = torch.randn(8, 16, H, generator=g) * scales + 3.0
    codec = make_codec("pca")  # the default: quant=nf, sink
    basis = calibration.fit_for(codec, h)
    return g, h, codec, basis


def test_variants_split_the_codec_error_into_its_parts():
    g, h, codec, basis = _nf_case()
    k = basis.U.shape[1]
    assert k < h.shape[-1]  # some coordinates get no bit: h has a part outside the span
    W, _ = torch.linalg.qr(torch.randn(h.shape[-1], 3, generator=g))
    v = mismatch.variants(codec, basis, h, MaskKey(0, 0, 0, 0), (1, 3), W)
    d = {n: x - h for n, x in v.items()}
    assert torch.equal(v["deployed"], h)
    for n, x in d.items():  # position 0 (the sink) is exact but where the codec's int8 row is put back
        if n not in ("codec", "quant", "sink", "span+sink"):
            assert torch.equal(x[:, 0], torch.zeros_like(x[:, 0])), n
    # codec error = (span - h) + quantization error, the two orthogonal
    assert torch.allclose(d["codec"], d["span"] + d["quant"], atol=1e-4)
    assert torch.equal(d["sink"][:, 0], d["codec"][:, 0]) and not d["sink"][:, 1:].any()
    assert torch.equal(v["span+sink"][:, 1:], v["span"][:, 1:]) and torch.equal(v["span+sink"][:, 0], v["codec"][:, 0])
    U = basis.U
    assert torch.allclose(d["span"][:, 1:] @ U, torch.zeros(8, 15, k), atol=1e-3)  # span drops only the outside
    assert torch.allclose(d["quant"][:, 1:] - (d["quant"][:, 1:] @ U) @ U.T, torch.zeros_like(h[:, 1:]), atol=1e-4)
    # the bits-w errors add up to the quantization error
    widths = [n for n in v if n.startswith("bits-")]
    assert widths and torch.allclose(sum(d[n] for n in widths), d["quant"] - d["sink"], atol=1e-4)
    # outside-j removes the outside part along the given directions only
    assert torch.allclose(d["outside-3"][:, 1:] @ W, -(((h[:, 1:] - basis.mean) - ((h[:, 1:] - basis.mean) @ U) @ U.T)
                                                       @ W), atol=1e-3)


def test_measure_scores_the_deployed_model_and_its_codec_as_the_evaluation_does(tiny_factory):
    from orchestration.config import parse_args
    from orchestration.experiments import evaluation
    from orchestration.models.loading import load_causal_lm
    from orchestration.models.scoring import eval_loss

    tiny = tiny_factory("tiny_mismatch", num_layers=2, text_chars=20_000)
    model, _ = load_causal_lm(tiny / "model")
    held = torch.randint(0, model.config.vocab_size, (6, 24), generator=torch.Generator().manual_seed(0))
    cfg = parse_args(["--model", str(tiny / "model"), "--mesh.rows", "1", "--mesh.stages", "2"])[0]
    codec = make_codec("pca")
    (L,) = calibration.boundary_layers(model.config.num_hidden_layers, 2, None)
    bases = calibration.fit_layer_bases(model, held[:4], codec, [L], grad_rows=0)
    (rec,) = mismatch.measure(model, held, codec, {0: bases[L]}, 2, top=(1,))
    assert rec["loss"]["deployed"] == pytest.approx(eval_loss(model, held)["loss"], rel=1e-5)
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        calibration.save(bases, d)
        on = evaluation.codec_eval_loss(model, held, cfg, run_dir=d)["loss"]
    assert rec["loss"]["codec"] == pytest.approx(on, rel=1e-5)
    assert 0 <= rec["outside_energy"] <= 1 and set(rec["loss"]) >= {"span", "quant", "outside-1"}
    (few,) = mismatch.measure(model, held, codec, {0: bases[L]}, 2, top=(1,), only=("codec",))
    assert few["loss"] == {"deployed": rec["loss"]["deployed"], "codec": rec["loss"]["codec"]}


def test_cli_names_a_directory_that_is_no_run(tmp_path, capsys):
    assert mismatch.main([str(tmp_path)]) == 2
    assert "has no config.yaml" in capsys.readouterr().err
