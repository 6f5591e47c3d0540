"""python -m orchestration.experiments.heterogeneous end to end on the tiny model: one seed, one
width, the three rows; exact bytes per token; records reused; the table rebuilt."""
import json
import os

import pytest

from orchestration.experiments import heterogeneous as hx


@pytest.mark.slow
def test_three_rows_run_record_exact_bytes_and_rebuild_the_table(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--out", str(out), "--model", str(tiny / "model"), "--data", str(tiny / "data.txt"), "--seeds", "0",
            "--ks", "8", "--steps", "2", "--batch-size", "2", "--seq-len", "32", "--eval-sequences", "4",
            "--max-sequences", "200", "--trainer-args", "--mesh.timeout-s 60 --dp.sync-every 1 --dp.fragments 1 --dp.overlap-steps 0"]
    assert hx.main(argv) == 0
    recs = {r: json.load(open(out / "records" / f"{r}-s0.json")) for r in ("dense", "all-k8", "sel-k8")}
    H, k = 40, 8
    for name, rec in recs.items():
        assert rec["complete"] and rec["final_loss"] > 0 and rec["base_loss"] > 0 and rec["pipeline_loss"] > 0
        # two of the three replicas are pipelines: their boundary bytes over every trained token
        per_pipeline_token = (4 * H) if name == "dense" else (4 * k)
        assert rec["bytes_per_token"]["pp_fwd"] == pytest.approx(per_pipeline_token * 2 / 3)
        assert rec["bytes_per_token"]["dp"] > 0
    # dense boundaries, compression off otherwise but SparseLoCo: the pipeline replica's
    # rebuilt model is a different model from the full replica's, but close to it
    assert abs(recs["dense"]["pipeline_loss"] - recs["dense"]["final_loss"]) < 0.5
    table = (out / "table.md").read_text()
    assert all(f"| {r} | 1 |" in table for r in recs)
    assert os.path.isfile(out / "loss_vs_bytes.png")
    capsys.readouterr()
    assert hx.main(argv) == 0  # records exist: nothing runs again
    assert "[1/" not in capsys.readouterr().out
    assert hx.main([*argv, "--table-only"]) == 0
