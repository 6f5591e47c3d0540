"""The experiment grid of ``python -m orchestration.experiments``: its rows (a preset plus
flags each), the settings shared by every row, the trainer command of one (row, seed), and
where a finished (row, seed) keeps its result record."""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
from dataclasses import dataclass


# ============================================================== the rows
@dataclass(frozen=True)
class Row:
    """One table row: a trainer preset plus flag overrides."""

    name: str
    group: str          # "main", "baseline" or "ablation"
    preset: str
    flags: tuple = ()   # extra trainer flags, e.g. ("--boundary.p", "0.99")
    label: str = ""
    paper: str = ""     # what the paper reports for this row (method.md), for the table


def _nf_options(budget: float, **extra) -> str:
    """--boundary.options of an nf row at 1/budget of dense fp32 (64-row basis, sink), spelled
    as the rows' records were run with."""
    return json.dumps({"quant": "nf", "budget": budget, "sink": True, "calib_rows": 64, **extra})


ROWS: tuple[Row, ...] = (
    Row("dense", "main", "dense", label="Dense (dense PP, full DP all-reduce)",
        paper="MedQA 0.280 / HumanEval 0.177; 22.9k B/tok"),
    # What a bf16 pipeline sends (2 bytes per value each way): the baseline that counts on GPUs.
    Row("dense-bf16", "baseline", "dense", ("--boundary.codec", "dense:dtype=bfloat16"),
        label="Dense with bf16 boundaries (a GPU pipeline's wire)", paper="(not in the paper)"),
    Row("dp", "main", "dp", label="+DP (dense PP, DiLoCo+PowerSGD)",
        paper="0.275 / 0.171; 6.9k B/tok"),
    Row("m95", "main", "m95", label="M95 (mask p=0.95, no anchor)",
        paper="0.180 / 0.072; 370 B/tok"),
    Row("m90-ap", "main", "m90-ap", label="M90+AP (mask p=0.90 + anchor + spectral)",
        paper="0.325 / 0.215; 790 B/tok"),
    Row("m95-ap", "main", "m95-ap", label="M95+AP (mask p=0.95 + anchor + spectral)",
        paper="0.321 / 0.207; 446 B/tok"),
    # PP-codec baselines at comparable ratios; everything else as M95 (DiLoCo+PowerSGD).
    # Ratios at H=192, fp32: topk keeps K=round(0.067*192)=13 dims of 4 B value + 2 B index
    # = 78 B vs 768 B dense (9.8x, the paper's 10x); bottleneck r=10 coordinates (19.2x,
    # the paper's 20x); int4: 4-bit values + one fp32 scale per token = 100 B (7.7x vs fp32,
    # 3.8x vs bf16: the paper's 4x counts against 16-bit activations).
    Row("topk", "baseline", "m95", ("--boundary.codec", "topk", "--boundary.p", "0.933"),
        label="top-k ~10x/10x (no anchor)", paper="collapses on generation"),
    Row("int4", "baseline", "m95", ("--boundary.codec", "int4"),
        label="4-bit quantization ~8x/8x vs fp32 (no anchor)", paper="collapses on generation"),
    Row("bottleneck", "baseline", "m95", ("--boundary.codec", "bottleneck", "--boundary.p", "0.95"),
        label="bottleneck projection 20x/20x (no anchor)", paper="collapses on generation"),
    # Calibrated PCA codec at 1/15 of dense fp32 per direction (k int4 coordinates + position 0 as int8).
    Row("pca4", "baseline", "pca4", label="PCA-int4 + sink, 1/15 of dense (no anchor)",
        paper="(not in the paper; diagnose: sink+pca-int4)"),
    # pca4 whose coordinates are re-centred and re-scaled per micro-batch (issue #28: the
    # calibrated mean and sd go stale as the model trains; 2k fp32 more per micro-batch).
    Row("pca4-adapt", "baseline", "pca4", ("--boundary.codec", "pca:adapt=true"),
        label="PCA-int4 + sink + per-micro-batch normalization", paper="(not in the paper)"),
    # pca4 whose backward takes its coordinates in a basis of the gradient's own (issue #28:
    # the activations' span keeps only ~half of the boundary gradient's energy); same bytes,
    # plus the gradient basis once. And the upper bound: pca4 forward, dense backward.
    Row("pca4-gb", "baseline", "pca4", ("--boundary.codec", "pca:bwd=gbasis,grad_rows=16"),
        label="PCA-int4 + sink, backward in a gradient basis", paper="(not in the paper)"),
    Row("pca4-bwdense", "baseline", "pca4", ("--boundary.codec", "pca:bwd=dense"),
        label="PCA-int4 + sink forward, dense backward (a bound)", paper="(not in the paper)"),
    # Twice pca4's bytes: k = 558 of 576 coordinates at H = 576 (almost no truncation, only the
    # int4 rounding): how much of pca4's gap is the subspace it leaves out.
    Row("pca4-b8", "baseline", "pca4", ("--boundary.options", '{"quant": "absmax", "bits": 4, "budget": 8, "sink": true}'),
        label="PCA-int4 + sink, 1/8 of dense (almost full rank)", paper="(not in the paper)"),
    # The same bytes as pca4-b8 spent the other way: half the coordinates (k = 279), int8.
    Row("pca8-b8", "baseline", "pca4", ("--boundary.options", '{"quant": "absmax", "bits": 8, "budget": 8, "sink": true}'),
        label="PCA-int8 + sink, 1/8 of dense", paper="(not in the paper)"),
    # pca4 calibrated on 64 rows instead of 16 (the nf rows below use 64: this row tells the
    # better-fitted basis apart from the code books).
    Row("pca4-c64", "baseline", "pca4", ("--boundary.options", '{"quant": "absmax", "bits": 4, "budget": 15, "sink": true, "calib_rows": 64}'),
        label="PCA-int4 + sink, 1/15 of dense, basis fitted on 64 rows", paper="(not in the paper)"),
    # Per-coordinate code widths on Gaussian code books (quant=nf, meshkern.pca_nf): pca4's
    # bytes spent on every coordinate by its variance instead of int4 on the top half.
    Row("pcanf", "baseline", "pca4", ("--boundary.options", _nf_options(15)),
        label="PCA-NF (bits per coordinate) + sink, 1/15 of dense", paper="(not in the paper)"),
    # pcanf whose last 10 / 25 steps (of the long runs' 200) send dense boundaries (issue #43,
    # the codec-free tail): does ending on exact activations close the deployed model's gap,
    # and at how many more bytes (the tail's dense bytes are counted)?
    *(Row(f"pcanf-tail{n}", "baseline", "pca4", ("--boundary.options", _nf_options(15), "--boundary.dense-tail", str(n)),
          label=f"PCA-NF + sink, 1/15 of dense, the last {n} steps dense", paper="(not in the paper)")
      for n in (10, 25)),
    # pcanf's bytes with the forward's widths allocated by each coordinate's variance times the
    # calibration gradient's mean square along it (alloc=loss: least first-order change of the
    # loss instead of least squared error; issue #43 item 3, the gap at the default's bytes)
    Row("pcanf-loss", "baseline", "pca4", ("--boundary.options", _nf_options(15, alloc="loss")),
        label="PCA-NF + sink, 1/15 of dense, widths by loss sensitivity", paper="(not in the paper)"),
    # pcanf's bytes split unevenly (issue #43 item 3), asked because a dense backward bought
    # nothing over 20 steps (results/NOTEBOOK.md, "What pca loses"): 230 B forward and 76 B
    # back at H = 576, 306 in all as pcanf (measured: docs/far-domain.md, "split unevenly")
    Row("pcanf-fwd", "baseline", "pca4", ("--boundary.options", _nf_options(10, bwd_budget=30)),
        label="PCA-NF + sink, 1/10 of dense forward, 1/30 backward", paper="(not in the paper)"),
    # ... and the other way (pcanf-fwd bought 6 points of the codec-on model's share of dense's
    # gain and lost 1 of the deployed model's: is it the backward the deployed model needs?)
    Row("pcanf-bwd", "baseline", "pca4", ("--boundary.options", _nf_options(30, bwd_budget=10)),
        label="PCA-NF + sink, 1/30 of dense forward, 1/10 backward", paper="(not in the paper)"),
    # ... and between the two (pcanf-fwd lost 1 point of the deployed model's share, pcanf-bwd
    # 11): 184 B forward and 122 back, 306 in all
    Row("pcanf-60", "baseline", "pca4", ("--boundary.options", _nf_options(12.5, bwd_budget=18.8)),
        label="PCA-NF + sink, 60% of pcanf's bytes forward", paper="(not in the paper)"),
    # 1/12 of dense fp32 (190 B/token at H = 576): about pca4-b8's forward error (every
    # coordinate but a few gets a bit) at two thirds of its bytes.
    Row("pcanf-b12", "baseline", "pca4", ("--boundary.options", _nf_options(12)),
        label="PCA-NF + sink, 1/12 of dense", paper="(not in the paper)"),
    # Issue #28's byte goal: 1/30 of dense fp32 (>= 15x less than bf16 dense) each way, the
    # basis sent in fp16.
    Row("pcanf-b30", "baseline", "pca4", ("--boundary.options", _nf_options(30, basis_dtype="float16")),
        label="PCA-NF + sink, 1/30 of dense (fp16 basis)", paper="(not in the paper)"),
    # The anchor circuit and spectral correction on top of pca4 (issue #12): M95+AP's anchor
    # settings (factored transport, SpectralAdamW) with pca4's boundaries.
    Row("pca4-ap", "baseline", "m95-ap", ("--boundary.codec", "pca", "--boundary.options",
                                          '{"quant": "absmax", "bits": 4, "budget": 15, "sink": true}'),
        label="PCA-int4 + sink + anchor + spectral (1/15 of dense)", paper="(not in the paper)"),
    # The same anchor on top of the per-coordinate nf code (issue #28): does the unmasked
    # anchor close the rest of pcanf's gap over a long run?
    Row("pcanf-ap", "baseline", "m95-ap", ("--boundary.codec", "pca", "--boundary.options", _nf_options(15)),
        label="PCA-NF + sink + anchor + spectral (1/15 of dense)", paper="(not in the paper)"),
    # pcanf-b12's bytes with the anchor: do the two (forward error, the anchor's correction)
    # add up to issue #28's 95% of dense's gain over 200 steps?
    Row("pcanf-b12-ap", "baseline", "m95-ap", ("--boundary.codec", "pca", "--boundary.options", _nf_options(12)),
        label="PCA-NF + sink + anchor + spectral (1/12 of dense)", paper="(not in the paper)"),
    # The paper's two other baselines, at its 8x forward / 2x backward (vs fp32): at H=192,
    # seq 128, aqsgd sends 96 B of 4-bit delta codes + a 4 B scale per token forward (7.7x)
    # and tahquant ~106 B (3.8 bits on average + per-tile fp16 zero/scale + flags/pivots,
    # 7.2x); both send bf16 gradients back (2x). AQ-SGD's delta only pays off from a
    # sample's second visit: the record's "epochs" says how many the run made.
    Row("aqsgd", "baseline", "m95", ("--boundary.codec", "aqsgd", "--boundary.options", '{"bits": 4, "gbits": 16}'),
        label="AQ-SGD fw 4-bit delta / bw bf16 ~8x/2x (no anchor)", paper="collapses on generation (8x/2x)"),
    Row("tahquant", "baseline", "m95", ("--boundary.codec", "tahquant", "--boundary.options", '{"bits": 4, "gbits": 16}'),
        label="TAH-Quant fw 3.8 bits / bw bf16 ~7x/2x (no anchor)", paper="collapses on generation (8x/2x)"),
    # Ablations around M95+AP (p=0.90 with the anchor is the main row m90-ap; m90 is its
    # no-anchor control, separating the effect of p from the anchor's).
    Row("m90", "ablation", "m95", ("--boundary.p", "0.90"), label="M90 (mask p=0.90, no anchor)",
        paper="(not reported)"),
    Row("p99-ap", "ablation", "m95-ap", ("--boundary.p", "0.99"), label="M99+AP (p=0.99)",
        paper="0.230 / 0.075"),
    Row("delay10", "ablation", "m95-ap", ("--anchor.delay", "10"), label="M95+AP, anchor delay 10 (deterministic)",
        paper="0.328 / 0.215"),
    Row("delay20", "ablation", "m95-ap", ("--anchor.delay", "20"), label="M95+AP, anchor delay 20 (deterministic)",
        paper="(default ~20)"),
    Row("delay50", "ablation", "m95-ap", ("--anchor.delay", "50"), label="M95+AP, anchor delay 50 (deterministic)",
        paper="0.250 / 0.090"),
    Row("tau1e-5", "ablation", "m95-ap", ("--train.tau", "1e-5"), label="M95+AP, tau=1e-5",
        paper="0.215 / 0.105"),
    Row("tau1e-1", "ablation", "m95-ap", ("--train.tau", "1e-1"), label="M95+AP, tau=1e-1",
        paper="0.245 / 0.140"),
    Row("alpha0", "ablation", "m95-ap", ("--train.alpha", "0"), label="M95+AP, alpha=0 (filtered only)",
        paper="0.260 / 0.105"),
    Row("alpha1", "ablation", "m95-ap", ("--train.alpha", "1"), label="M95+AP, alpha=1 (no correction)",
        paper="0.180 / 0.072"),
    # Since issue #15 the AP presets send the factors (transport factored): "factored" pins
    # what the preset does (its records predate the change, when the presets sent dense
    # gradients), "anchor-dense" is the other transport.
    Row("factored", "ablation", "m95-ap", ("--anchor.transport", "factored"),
        label="M95+AP, anchor sends top-r SVD factors of its momentum", paper="(anchor axis ~76 B/tok)"),
    Row("anchor-dense", "ablation", "m95-ap", ("--anchor.transport", "dense"),
        label="M95+AP, anchor sends its dense gradients", paper="(the paper's fast-node M_anc)"),
)
ROW_BY_NAME = {r.name: r for r in ROWS}
GROUPS = ("main", "baseline", "ablation")
GROUP_ALIASES = {"main": "main", "baselines": "baseline", "baseline": "baseline",
                 "ablations": "ablation", "ablation": "ablation", "all": None}


def select_rows(spec: str) -> list[Row]:
    """Rows named by a comma list of row names and/or groups (main, baselines, ablations,
    all), in table order; ValueError names an unknown entry."""
    want: set[str] = set()
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        if item in GROUP_ALIASES:
            g = GROUP_ALIASES[item]
            want |= {r.name for r in ROWS if g is None or r.group == g}
        elif item in ROW_BY_NAME:
            want.add(item)
        else:
            raise ValueError(f"--rows: unknown row or group {item!r}; rows: {', '.join(ROW_BY_NAME)}; "
                             f"groups: main, baselines, ablations, all")
    if not want:
        raise ValueError("--rows selects no row")
    return [r for r in ROWS if r.name in want]


# ============================================================== scale
@dataclass
class Settings:
    """What makes two results comparable (everything but the row and the seed)."""

    model: str
    data: str
    steps: int
    fast_rows: int
    stages: int
    batch_size: int
    microbatches: int
    seq_len: int
    eval_every: int
    eval_sequences: int
    max_sequences: int = 0
    trainer_args: str = ""
    prune: tuple = (0.3, 0.5, 0.7)
    n_task: int = 100

    def key(self) -> dict:
        """The settings a record is matched by; the model path under the home directory is
        written as ~/..., so records name no particular machine and match on any."""
        d = dataclasses.asdict(self)
        d["prune"] = list(d["prune"])
        home = os.path.expanduser("~")
        if isinstance(d["model"], str) and d["model"].startswith(home + os.sep):
            d["model"] = "~" + d["model"][len(home):]
        return d


# Default scale: chosen so one row trains in ~2 min on the shared 2-core machine (the
# default Llama 192h/4L; 2x2 fast mesh; ~1.3 s/step under load). 80 steps leave room for
# the delay-50 ablation (snapshots at 0,5,..,25 applied at 50..75). Evaluation: 64 held-out
# sequences (8128 predicted tokens) at 5 points; 128 sequences at 9 points took as long as
# the training itself (~115 s) on the loaded machine.
DEFAULT = dict(steps=80, fast_rows=2, stages=2, batch_size=8, microbatches=4, seq_len=128,
               eval_every=20, eval_sequences=64, max_sequences=0)
# --quick: a few seconds per row with whatever --model is given (tests use a tiny one).
QUICK = dict(steps=4, fast_rows=1, stages=2, batch_size=2, microbatches=2, seq_len=32,
             eval_every=2, eval_sequences=8, max_sequences=200)


def trainer_argv(row: Row, seed: int, s: Settings, run_root: str, run_name: str) -> list[str]:
    """The trainer's command-line flags for one (row, seed)."""
    anchor = bool(_preset(row.preset).get("anchor", {}).get("enabled", False))
    argv = ["--preset", row.preset, *row.flags,
            "--model", s.model, "--data", s.data,
            "--mesh.rows", str(s.fast_rows + (1 if anchor else 0)), "--mesh.stages", str(s.stages),
            "--train.steps", str(s.steps), "--train.batch-size", str(s.batch_size),
            "--train.microbatches", str(s.microbatches), "--data.seq-len", str(s.seq_len),
            "--data.max-sequences", str(s.max_sequences), "--train.seed", str(seed),
            "--checkpoint.every", str(s.eval_every), "--checkpoint.keep", "100000",
            "--run.out-dir", run_root, "--run.name", run_name, "--run.progress", "false",
            "--run.eval-sequences", "0"]  # we evaluate every checkpoint ourselves
    if "delay" in row.name:  # deterministic delay must not exceed the staleness bound
        argv += ["--anchor.max-staleness", str(max(50, int(row.flags[row.flags.index("--anchor.delay") + 1])))]
    return argv + shlex.split(s.trainer_args)


def _preset(name: str) -> dict:
    from orchestration.config import load_preset

    return load_preset(name)


def _write_json(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)  # a reader sees the old file or the whole new one


# Not "runs": .gitignore ignores every directory of that name (trainer output), and these
# small records are meant to be committed.
RECORDS = "records"


def result_path(out: str, row: str, seed: int) -> str:
    return os.path.join(out, RECORDS, f"{row}-s{seed}.json")


def load_result(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
