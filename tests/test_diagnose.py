"""orchestration.diagnose against independent references, on the tiny conftest model.

References used here do not go through diagnose's own staging or codec plumbing: the
unsplit HF model's loss, a forward-pre-hook on decoder layer L that applies meshkern's
pure-torch reference mask (meshkern.reference_mask), hand-built low-rank data with known
PCA spectra, and hand-accumulated anchor momenta.
"""
import json
import math

import pytest
import torch

torch.set_num_threads(1)

from orchestration import diagnose as dg  # noqa: E402

SEQ = 32


@pytest.fixture(scope="module")
def tiny_setup(tiny):
    from orchestration.models import loading as models

    model, _ = models.load_causal_lm(tiny / "model")
    train, held = dg.load_data(str(tiny / "model"), str(tiny / "data.txt"), SEQ, token_cache=None)
    return model, str(tiny / "model"), train, held


def _hooked_loss(model, ids, L, fn):
    """Loss of the unsplit HF model with fn applied to the input of decoder layer L."""
    layer = model.model.layers[L]

    def pre(mod, args, kwargs):
        if args:
            return (fn(args[0]),) + tuple(args[1:]), kwargs
        kwargs = dict(kwargs)
        kwargs["hidden_states"] = fn(kwargs["hidden_states"])
        return args, kwargs

    hnd = layer.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        with torch.no_grad():
            return float(model(input_ids=ids, labels=ids, use_cache=False).loss)
    finally:
        hnd.remove()


def test_dense_codec_is_exactly_the_unsplit_loss(tiny_setup):
    model, _, _, held = tiny_setup
    ids = held[:4]
    split = dg.LayerSplit(model)
    with torch.no_grad():
        ref = float(model(input_ids=ids, labels=ids, use_cache=False).loss)
    for L in range(1, split.n):
        h = split.prefix(ids, L)
        t = dg.codec_transform("dense", split.hidden_size, L, seed=0)
        assert dg.forward_loss(split, h, L, ids, t.fn)[0] == ref
        assert t.bytes_fwd == t.bytes_bwd == dg.dense_bytes(split.hidden_size)


@pytest.mark.parametrize("p", [0.5, 0.75])
def test_mask_row_equals_hand_applied_reference_mask(tiny_setup, p):
    from meshkern import reference_mask
    from meshkern.mask import MaskKey, kept_dims

    model, path, train, held = tiny_setup
    s = dg.Settings(stages=[2], codecs=[f"mask:p={p}"], candidates=[], pca_sweep=False, grads=False, anchor=False,
                    eval_rows=6, calib_rows=4, seed=3)
    rep = dg.run_diagnostics(model, path, train, held, s, progress=lambda m: None)
    L = 2  # the 2-stage boundary of a 4-layer model
    row = next(r for r in rep["boundaries"][str(L)]["transforms"] if r["spec"] == f"mask:p={p}")
    ids = dg.pick_rows(held, 6, 3)  # the tool's row choice (not what is under test)
    H = model.config.hidden_size
    K = kept_dims(H, p)
    s_lo, s_hi, b, step, mb = MaskKey(3, L, 0, 0).words()
    words = (s_lo, s_hi, step, (b << 16) | mb)

    def ref_mask(h):
        flat = h.reshape(-1, H)
        keep = reference_mask.kept_bitmap(words, flat.shape[0], H, K)
        return (flat * keep).reshape(h.shape)

    assert row["loss"] == pytest.approx(_hooked_loss(model, ids, L, ref_mask), abs=1e-5)
    assert rep["base_loss"] == pytest.approx(_hooked_loss(model, ids, L, lambda h: h), abs=0)
    assert row["bytes_fwd"] == K * 4 and row["fraction_of_dense_fwd"] == K / H


def test_pca_energy_is_exact_for_a_constructed_low_rank_activation():
    torch.manual_seed(0)
    N, H, r = 300, 24, 3
    Z = torch.randn(N, r, dtype=torch.float64)
    Z -= Z.mean(0)
    Z, _ = torch.linalg.qr(Z)  # orthonormal, zero-mean columns
    Q, _ = torch.linalg.qr(torch.randn(H, r, dtype=torch.float64))
    s = torch.tensor([9.0, 4.0, 1.0], dtype=torch.float64)
    mu = torch.randn(H, dtype=torch.float64) * 5
    x = (mu + (Z * s) @ Q.T).float()
    pca = dg.fit_pca(x)
    lam = s ** 2 / N
    assert torch.allclose(pca.eigvals[:r], lam, rtol=1e-4)
    assert pca.eigvals[r:].abs().max() < 1e-6 * float(lam[0])
    tot = float(lam.sum())
    for k, want in [(1, 81 / 98), (2, 97 / 98), (3, 1.0), (10, 1.0)]:
        assert pca.energy(k) == pytest.approx(want, abs=1e-6)
        assert pca.energy_on(x, k) == pytest.approx(want, abs=1e-5)
    spec = dg.spectrum_stats(pca.eigvals)
    assert spec["participation_ratio"] == pytest.approx(tot ** 2 / float((lam ** 2).sum()), rel=1e-5)
    p = lam / tot
    assert spec["entropy_rank"] == pytest.approx(math.exp(-float((p * p.log()).sum())), rel=1e-4)
    # mean + top-r PCA reconstructs a rank-r activation (up to fp32 rounding)
    assert torch.allclose(dg.pca_project(x, pca, r), x, atol=1e-4)
    st, _ = dg.activation_stats(x.reshape(10, 30, H))
    assert st["energy_in_sample"]["1/10"] == pytest.approx(pca.energy(max(1, round(H / 10))), abs=1e-9)


def test_massive_dims_and_outlier_tokens_are_counted():
    torch.manual_seed(0)
    x = torch.randn(4, 16, 32)
    x[..., 5] += 200.0  # one massive dim (mean |h| ~200 vs median ~0.8)
    x[:, 0] *= 50.0  # an attention-sink-like first token
    st, _ = dg.activation_stats(x)
    assert st["top_dims"][0] == 5
    assert st["massive_dims"][">=100x_median"] == 1
    assert st["outlier_token_positions"] == [0] and st["outlier_tokens"] == 4


def test_gradient_cosine_of_dense_vs_dense_is_one(tiny_setup):
    model, _, _, held = tiny_setup
    split = dg.LayerSplit(model)
    probe = dg.GradProbe(split, held[:3], 2)
    H = split.hidden_size
    d = probe.compare(dg.codec_transform("dense", H, 2, 0).fn, {"stage 0": ["0", "embed"]})
    for part in ("boundary", "prefix", "prefix_layers", "suffix"):
        assert d[part]["cos"] == pytest.approx(1.0, abs=1e-12)
        assert d[part]["rel_err"] == 0.0 and d[part]["norm_ratio"] == pytest.approx(1.0, abs=1e-12)
    assert d["prefix_by_stage"]["stage 0"]["cos"] == pytest.approx(1.0, abs=1e-12)
    m = probe.compare(dg.codec_transform("mask:p=0.9", H, 2, 0).fn)
    assert m["prefix"]["cos"] < 0.99 and m["boundary"]["cos"] < 0.99 and m["prefix"]["rel_err"] > 0.1


def test_gradient_probe_matches_plain_autograd(tiny_setup):
    """The prefix-parameter gradient with the mask codec at L equals a direct backward through
    the unsplit HF model with the same mask (reference mask, in a hook)."""
    from meshkern import reference_mask
    from meshkern.mask import MaskKey, kept_dims

    model, _, _, held = tiny_setup
    ids, L, p = held[:3], 2, 0.75
    split = dg.LayerSplit(model)
    probe = dg.GradProbe(split, ids, L)
    loss, _, g_pre, _ = probe.grads(dg.codec_transform(f"mask:p={p}", split.hidden_size, L, 0).fn)
    H = model.config.hidden_size
    s_lo, s_hi, b, step, mb = MaskKey(0, L, 0, 0).words()
    keep = reference_mask.kept_bitmap((s_lo, s_hi, step, (b << 16) | mb), ids.numel(), H, kept_dims(H, p))
    hnd = model.model.layers[L].register_forward_pre_hook(
        lambda mod, args, kw: ((args[0] * keep.reshape(args[0].shape),) + args[1:], kw) if args else
        (args, {**kw, "hidden_states": kw["hidden_states"] * keep.reshape(kw["hidden_states"].shape)}),
        with_kwargs=True)
    try:
        ref_loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        names = [n for n, _ in probe.pre]
        params = dict(model.named_parameters())
        ref = torch.autograd.grad(ref_loss, [params[n] for n in names])
    finally:
        hnd.remove()
    assert loss == pytest.approx(float(ref_loss.detach()), abs=1e-5)
    for n, a, r in zip(names, g_pre, ref):
        assert torch.allclose(a, r, atol=1e-6, rtol=1e-4), n


def test_candidates_fit_the_budget_and_are_differentiable(tiny_setup):
    model, _, train, held = tiny_setup
    split = dg.LayerSplit(model)
    L, H = 2, split.hidden_size
    with torch.no_grad():
        hc = split.prefix(train[:8], L)
        cal = dg.calibrate(hc, split.embed(train[:8]))
    assert {t.name for t in dg.candidate_transforms(cal, split.embed, H, L, 0, 15)} == set(dg.CANDIDATES) - {
        "pca-int8/gpca-int8", "pca-int4/gpca-int4", "sink+pca-int4/gpca-int4"}  # needs the gradient calibration
    cal.grad_pca = dg.fit_pca(dg.boundary_gradients(split, hc, L, train[:8]))
    ts = dg.candidate_transforms(cal, split.embed, H, L, seed=0, budget=15, seq_len=SEQ)
    assert {t.name for t in ts} == set(dg.CANDIDATES)
    h = split.prefix(held[:2], L).detach().requires_grad_(True)
    for t in ts:
        assert t.bytes_fwd <= dg.dense_bytes(H) // 15, t.name
        out = t.fn(h, held[:2])
        assert out.shape == h.shape and torch.isfinite(out).all(), t.name
        (g,) = torch.autograd.grad(out.square().sum(), h)
        assert torch.isfinite(g).all() and g.abs().sum() > 0, t.name
    with pytest.raises(dg.UsageError, match="unknown candidate"):
        dg.candidate_transforms(cal, split.embed, H, L, 0, 15, names=["nope"])


def test_two_way_candidate_sends_the_gradient_through_its_own_basis(tiny_setup):
    model, _, train, held = tiny_setup
    split = dg.LayerSplit(model)
    L, H = 2, split.hidden_size
    with torch.no_grad():
        hc = split.prefix(train[:8], L)
    gp = dg.fit_pca(dg.boundary_gradients(split, hc, L, train[:8]))
    cal = dg.calibrate(hc, split.embed(train[:8]), grad_pca=gp)
    (t,) = dg.candidate_transforms(cal, split.embed, H, L, 0, 15, names=["pca-int8/gpca-int8"])
    (fwd,) = dg.candidate_transforms(cal, split.embed, H, L, 0, 15, names=["pca-int8"])
    h = split.prefix(held[:2], L).detach().requires_grad_(True)
    assert torch.equal(t.fn(h, held[:2]), fwd.fn(h, held[:2]))
    g = torch.randn_like(h)
    (got,) = torch.autograd.grad(t.fn(h, held[:2]), h, g)
    n8 = dg.dense_bytes(H) // 15 - dg.SCALE_BYTES
    assert torch.equal(got, dg.pca_project(g, gp, n8, bits=8))


def test_sink_candidates_fit_pca_without_outlier_tokens_and_keep_position_0():
    torch.manual_seed(0)
    B, T, H = 6, 16, 40
    x = torch.randn(B, T, H) @ torch.randn(H, H) * 0.3
    x[:, 0] = torch.randn(H) * 400.0  # an attention-sink-like constant first token
    cal = dg.calibrate(x, torch.zeros_like(x))
    assert torch.allclose(cal.pca_robust.mean, x[:, 1:].reshape(-1, H).mean(0), atol=1e-4)
    (t,) = dg.candidate_transforms(cal, lambda ids: torch.zeros(*ids.shape, H), H, 1, 0, 15,
                                   names=["sink+pca"], seq_len=T)
    y = t.fn(x, torch.zeros(B, T, dtype=torch.long))
    qc = dg.QuantCodec(8)
    assert torch.equal(y[:, 0], qc.dequantize(qc.quantize(x[:, :1]), (B, 1, H), x.dtype)[:, 0])
    k = (dg.dense_bytes(H) // 15 - (-(-(H + 4) // T))) // 4
    assert torch.allclose(y[:, 1:], dg.pca_project(x[:, 1:], cal.pca_robust, k), atol=1e-5)
    assert t.bytes_fwd == k * 4 + (-(-(H + 4) // T)) <= dg.dense_bytes(H) // 15


def test_pca_at_full_rank_is_lossless(tiny_setup):
    model, _, train, held = tiny_setup
    split = dg.LayerSplit(model)
    L, ids = 2, held[:4]
    with torch.no_grad():
        pca = dg.fit_pca(split.prefix(train[:16], L))
        h = split.prefix(ids, L)
    base = dg.forward_loss(split, h, L, ids)[0]
    full = dg.forward_loss(split, h, L, ids, lambda x, i: dg.pca_project(x, pca, split.hidden_size))[0]
    assert full == pytest.approx(base, abs=1e-4)


def test_anchor_singular_values_match_a_hand_built_momentum(tiny_setup):
    model, _, train, held = tiny_setup
    batches = [train[i * 3:(i + 1) * 3] for i in range(3)]
    rep = dg.anchor_diagnostics(model, 2, held[:3], batches, codec_spec="dense", rank=4, beta_anc=0.9,
                                progress=lambda m: None)
    # the masked circuit with the dense codec is the dense circuit
    assert rep["masked_vs_dense"]["cos"] == pytest.approx(1.0, abs=1e-9)
    name = "model.layers.1.mlp.down_proj.weight"
    w = dict(model.named_parameters())[name]
    M = torch.zeros_like(w)
    for b in batches:
        (g,) = torch.autograd.grad(model(input_ids=b, labels=b, use_cache=False).loss, [w])
        M = 0.9 * M + 0.1 * g
    want = torch.linalg.svdvals(M)[:4]
    assert torch.allclose(torch.tensor(rep["singular_values"][name]), want, rtol=1e-3, atol=1e-7)
    row = rep["per_tau"]["0.001"]
    assert 0.0 <= row["energy_kept_dense"] <= 1.0 and 0.0 <= row["gain_mean"] <= 1.0
    # the filter output stays correlated with the dense gradient it was applied to
    assert row["alpha=0.3"]["filtered_dense_vs_dense"]["cos"] > row["alpha=0"]["filtered_dense_vs_dense"]["cos"] - 1e-9


@pytest.mark.slow
def test_cli_end_to_end_writes_report_and_plots(tiny, tmp_path, capsys):
    out = tmp_path / "diag"
    rc = dg.main(["--model", str(tiny / "model"), "--data", str(tiny / "data.txt"), "--stages", "2,3",
                  "--seq-len", str(SEQ), "--eval-rows", "4", "--calib-rows", "8", "--grad-rows", "2",
                  "--anchor-batches", "2", "--rank", "4", "--every-layer", "--threads", "1", "--out", str(out)])
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    assert set(rep["boundaries"]) == {"2", "3"} and set(rep["layer_scan"]) == {"1", "2", "3"}
    assert set(rep["anchor"]) == {"2", "3"}
    for b in rep["boundaries"].values():
        dense = next(r for r in b["transforms"] if r["name"] == "dense")
        assert dense["loss"] == rep["base_loss"] == rep["base_loss_unsplit_model"]
        assert dense["grad"]["prefix"]["cos"] == pytest.approx(1.0, abs=1e-12)
        assert any(r["kind"] == "candidate" for r in b["transforms"])
    for png in ("loss_vs_bytes", "candidates", "activations", "pca_loss", "grad_error", "anchor", "layer_scan"):
        assert (out / f"{png}.png").stat().st_size > 1000
    assert "base held-out loss" in capsys.readouterr().out
    table = (out / "table.txt").read_text()
    assert "| transform | bytes | L=2 | L=3 |" in table and "\n| pca | " in table


@pytest.mark.parametrize("args, msg", [
    (["--model", "/nonexistent/model-dir"], "does not exist"),
    (["--codecs", "nosuch"], "unknown codec 'nosuch'"),
    (["--codecs", "mask:q=3"], "does not take options"),
    (["--codecs", "mask:p=1.5"], "p (fraction of hidden dims dropped)"),
    (["--candidates", "nope"], "unknown candidate 'nope'"),
    (["--stages", "1"], "at least 2 stages"),
])
def test_cli_errors_are_one_line_with_status_2(args, msg, capsys):
    rc = dg.main(args + ["--no-plots", "--out", "/nonexistent-out-dir"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and msg in err


def test_cli_missing_model_subprocess(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "orchestration.diagnose", "--model", str(tmp_path / "none"),
                        "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "does not exist" in lines[0]


def test_partial_report_is_continued_not_remeasured(tiny_setup):
    model, path, train, held = tiny_setup
    s = dg.Settings(stages=[2, 3], codecs=["dense", "mask:p=0.9"], candidates=["pca"], pca_sweep=False,
                    grads=False, anchor=False, eval_rows=4, calib_rows=4)
    saved = []
    full = dg.run_diagnostics(model, path, train, held, s, progress=lambda m: None,
                              save=lambda r: saved.append(json.loads(json.dumps(r, default=str))))
    assert len(saved) == 2 and list(saved[0]["boundaries"]) == ["2"]
    msgs = []
    again = dg.run_diagnostics(model, path, train, held, s, progress=msgs.append, partial=saved[0])
    assert not any(m.startswith("boundary 2 ") for m in msgs) and any(m.startswith("boundary 3 ") for m in msgs)
    def measured(r):
        return {L: {k: v for k, v in b.items() if k != "seconds"} for L, b in
                json.loads(json.dumps(r["boundaries"], default=str)).items()}
    assert measured(again) == measured(full)
    other = dg.Settings(**{**vars(s), "eval_rows": 3})
    with pytest.raises(dg.UsageError, match="cannot resume"):
        dg.run_diagnostics(model, path, train, held, other, progress=lambda m: None, partial=saved[0])


def test_default_codecs_include_the_pca_codec_within_budget(tiny_setup):
    model, path, train, held = tiny_setup
    specs = dg.default_codec_specs(40, 15, seq_len=SEQ)
    assert f"pca:budget=15,seq_len={SEQ}" in specs and f"pca:quant=absmax,bits=8,budget=15,seq_len={SEQ}" in specs
    assert f"pca:quant=absmax,budget=15,seq_len={SEQ}" in specs  # the int4 layout beside the default nf
    s = dg.Settings(stages=[2], codecs=[f"pca:budget=15,seq_len={SEQ}"], candidates=[], pca_sweep=False,
                    anchor=False, eval_rows=4, calib_rows=8, grad_rows=2, seq_len=SEQ)
    rep = dg.run_diagnostics(model, path, train, held, s, progress=lambda m: None)
    (row,) = rep["boundaries"]["2"]["transforms"]
    assert row["bytes_fwd"] <= dg.dense_bytes(40) // 15 and row["grad"]["prefix"]["cos"] > 0.5
