"""Typed run configuration: dataclasses, presets, YAML/JSON files, CLI flags.

Precedence, lowest first: dataclass defaults < ``--preset NAME`` (orchestration/presets/
NAME.yaml) < ``--config FILE`` (YAML or JSON) < individual flags. Every field is a flag
``--section.field`` (e.g. ``--mesh.rows 4``, ``--boundary.p 0.9``); a few common ones also
have a short alias (``--model``, ``--data``, ``--steps``, ``--resume``). Flags join words
with dashes like every other entry point (``--data.seq-len``); the field's own spelling
(``--data.seq_len``) is accepted as well. ``--help`` lists
all of them with their defaults.

``validate(cfg)`` is the one place for every rule on the configuration itself (shapes of
the mesh, divisibility of the batch, names of codecs/compressors, ranges, the anchor's
settings); ``orchestration.train.prepare`` checks it against the model and data it reads
before any rank starts. Every problem is a ValueError that names the flag.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import typing
from dataclasses import dataclass, field
from typing import Any

PRESET_DIR = os.path.join(os.path.dirname(__file__), "presets")


def _f(default, help: str, **kw):
    """A dataclass field carrying its --help text."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class MeshConfig:
    rows: int = _f(3, "rows of the mesh = data-parallel replicas (with the anchor on, the last row is the anchor replica)")
    stages: int = _f(2, "columns of the mesh = pipeline stages per replica")
    layers_per_stage: list = _f([], "decoder layers per stage, e.g. 3,1 (empty: balanced); with --mesh.replicas it applies to the deepest replicas (the others are balanced)")
    replicas: list = _f([], "a heterogeneous mesh: pipeline stages of each replica, e.g. 1,2,2 = one full replica (the whole model in one process) and two 2-stage pipeline replicas; sets --mesh.rows and --mesh.stages (the deepest replica); DP sync then runs per parameter name; unless set otherwise, this mode uses --dp.compressor sparseloco, --boundary.codec int4 and --boundary.compress selective (docs/heterogeneous.md); no anchor. Empty: --mesh.rows replicas of --mesh.stages stages")
    dist_backend: str = _f("auto", "torch.distributed backend of the mesh (not a kernel backend, see MESHKERN_BACKEND): "
                               "auto (nccl with CUDA, else gloo), gloo, nccl")
    timeout_s: float = _f(60.0, "a rank that waits on a dead or stalled peer longer than this fails with an error")
    start_method: str = _f("fork", "how the local launcher starts ranks: fork (fast: the parent loads model and data once) or spawn")
    threads_per_rank: int = _f(1, "torch intra-op threads per rank (1: ranks share few cores; OpenMP spin-waiting otherwise)")


@dataclass
class ModelConfig:
    path: str = _f("", "local Hugging Face checkpoint directory, a .gguf file, or a built-in name (smollm2-135m; "
                   "converted once into the cache) (empty: the default base model, built on first use)")
    dtype: str = _f("float32", "parameter dtype: float32 or bfloat16")
    tied_embeddings: str = _f("sync", "a model whose input and output embeddings are tied, split over stages (each end "
                              "holds a copy): sync = sum the two copies' gradients every step, exactly the unsplit "
                              "model, at V x H x 4 bytes each way between first and last stage per step (no codec "
                              "compresses it); untie = each copy trains on its own gradient, no such traffic, and the "
                              "exported model is untied (a separate lm_head.weight)")


@dataclass
class DataConfig:
    source: str = _f("", "text file/dir, .jsonl, or saved HF dataset (empty: the embedded adaptation corpus, domain B)")
    seq_len: int = _f(128, "tokens per packed sequence")
    eval_fraction: float = _f(0.05, "held-out fraction of the sequences (for evaluation, never trained on)")
    split_seed: int = _f(0, "seed of the held-out choice; independent of --train.seed, so every seed of an experiment scores the same held-out set")
    max_sequences: int = _f(0, "cap on the number of packed sequences (0: no cap)")
    text_field: str = _f("text", "field/column holding the text (.jsonl, .json/.csv/.parquet, saved HF datasets)")
    on_decode_error: str = _f("auto", "files that are not UTF-8 text: auto (skip inside a directory, error for one file), raise, skip")
    token_cache: str = _f("auto", "directory caching the packed tokens per source/tokenizer/settings (auto: $MESHKERN_CACHE/tokens or ~/.cache/meshkern/tokens; empty: off)")


@dataclass
class TrainConfig:
    steps: int = _f(60, "optimizer steps (each = one micro-batched pipeline pass per replica)")
    batch_size: int = _f(8, "sequences per replica per step (split into micro-batches)")
    microbatches: int = _f(4, "micro-batches per step (gradient accumulation through the pipeline)")
    schedule: str = _f("1f1b", "pipeline schedule: 1f1b or gpipe")
    optimizer: str = _f("adamw", "inner optimizer: adamw or spectral (SpectralAdamW, used with the anchor)")
    lr: float = _f(3e-4, "peak learning rate of the inner optimizer")
    min_lr_ratio: float = _f(0.1, "cosine decay floor as a fraction of lr")
    warmup_steps: int = _f(3, "linear warmup steps before the cosine decay")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    eps: float = _f(1e-8, "AdamW eps")
    clip_grad_norm: float = _f(1.0, "clip the replica's global gradient norm to this (0: off)")
    max_bad_steps: int = _f(5, "divergence guard: this many consecutive bad steps (non-finite loss or gradient in any replica, a gradient norm of exactly zero, or a loss spike) stop the run with DivergenceError, exit code 3, without saving (0: never stop)")
    spike_factor: float = _f(3.0, "divergence guard: a step whose loss exceeds this factor times the median loss of the last 50 good steps counts as bad (0: only non-finite steps are bad)")
    tau: float = _f(1e-3, "spectral filter tau (SpectralAdamW)")
    alpha: float = _f(0.3, "spectral mix alpha: G_proj = alpha*G + (1-alpha)*G_filt (SpectralAdamW)")
    beta_anc: float = _f(0.9, "anchor momentum decay (SpectralAdamW)")
    spectral_rank: int = _f(16, "truncated SVD rank of the anchor momentum (SpectralAdamW)")
    seed: int = _f(0, "seed of data order, masks and init of anything random")


@dataclass
class BoundaryConfig:
    codec: str = _f("pca", "pipeline boundary codec: dense, mask (the paper's; presets m95, m95-ap, m90-ap), topk, int8, int4, bottleneck, pca (the default: calibrated PCA basis, int4 coordinates, 1/15 of dense fp32 bytes; orchestration.calibration), aqsgd (AQ-SGD: per-sample delta quantization), tahquant (TAH-Quant: tile-wise, Hadamard on outlier tiles); a name or a spec name:key=value,... e.g. aqsgd:bits=4,gbits=16 or tahquant:bits=3 (options as in --boundary.options; docs/codecs.md)")
    p: float = _f(0.95, "fraction of hidden dims dropped per token (mask; also the ratio target of topk/bottleneck)")
    rescale: bool = _f(False, "mask: scale kept values by 1/(1-p) (dropout-style unbiased estimate)")
    options: dict = _f({}, "extra keyword arguments for the codec, as JSON, e.g. '{\"k\": 64}'")
    compress: str = _f("all", "which replicas use --boundary.codec: all, or selective (only the pipeline replicas; full replicas train uncompressed and, with the subspace codec, unconstrained); selective is the default with --mesh.replicas")


@dataclass
class DPConfig:
    mode: str = _f("diloco", "replica sync: allreduce (gradients every step), diloco (Streaming DiLoCo), none")
    compressor: str = _f("powersgd", "what compresses the DP exchange: none, powersgd, sparseloco, int8")
    compressor_options: dict = _f({}, "extra keyword arguments for the compressor, as JSON")
    sync_every: int = _f(10, "DiLoCo: inner steps between outer syncs of a fragment (H)")
    fragments: int = _f(2, "DiLoCo: parameter fragments synced on a staggered schedule")
    outer_lr: float = _f(0.7, "DiLoCo: outer Nesterov learning rate")
    outer_momentum: float = _f(-1.0, "DiLoCo: outer Nesterov momentum (-1: auto = 0.9, or 0 with sparseloco, whose error feedback replaces the momentum)")
    overlap_steps: int = _f(1, "DiLoCo: inner steps a fragment's sync may overlap")
    projection: str = _f("outer", "with --boundary.codec subspace, what a constrained replica's DiLoCo projects onto the subspace: none, or steps joined by '+': outer (the averaged pseudo-gradient), error (SparseLoCo's error feedback and its input; needs --dp.compressor sparseloco), reproject (the weights after the merge); docs/subspace_sync.md. The trainer also re-projects the weights after every optimizer step and merge")


@dataclass
class AnchorConfig:
    enabled: bool = _f(False, "run the slow anchor circuit in the last row of the mesh")
    snapshot_every: int = _f(5, "fast steps between parameter snapshots pulled by the anchor")
    microbatches: int = _f(2, "anchor micro-batches per round")
    transport: str = _f("dense", "anchor gradient transport: dense or factored (top-r SVD of its momentum)")
    max_staleness: int = _f(50, "anchor updates older than this many fast steps are rejected")
    delay: int = _f(0, "deterministic delay mode: apply anchor gradients exactly this many fast steps after their snapshot (0: asynchronous)")
    snapshot_codec: str = _f("int8", "snapshot transfer to the anchor: full (parameters as they are) or int8 (first in full, then int8 deltas against what the anchor holds, one scale per 1024 values: ~4x fewer bytes than fp32)")
    state_every: int = _f(1, "anchor rounds between saves of the anchor's state (round counter, factored momentum) to CHECKPOINT_DIR/anchor/; 0: never")
    restarts: int = _f(2, "local launcher: restart a dead anchor row up to this many times (it rejoins the running fast circuit)")
    join: bool = _f(False, "start only the anchor row and join a running fast circuit (with --anchor.store; same config otherwise)")
    store: str = _f("", "host:port of the running fast circuit's rendezvous store (its MASTER_ADDR:MASTER_PORT) for --anchor.join")
    secret_file: str = _f("", "the run's anchor secret (anchor rows authenticate with it; docs/security.md); default RUN_DIR/anchor.secret, created 0600 by the fast circuit; pass a copy with --anchor.join on another machine (or set MESHKERN_ANCHOR_SECRET)")


@dataclass
class CheckpointConfig:
    every: int = _f(50, "save a checkpoint every N steps, besides the end and Ctrl-C (0: only those); 50 bounds "
                    "the work a crash loses to ~1 min of the default run, and --checkpoint.keep bounds the disk "
                    "(a default-model checkpoint is ~30 MB with its optimizer state)")
    dir: str = _f("", "checkpoint directory (empty: RUN_DIR/checkpoints)")
    resume: str = _f("", "resume from: a checkpoint directory, or 'latest' (the newest in the checkpoint dir)")
    keep: int = _f(2, "complete checkpoints kept (older ones are deleted)")


@dataclass
class RunConfig:
    name: str = _f("", "run name (empty: derived from the preset and time)")
    out_dir: str = _f("runs", "parent directory of run directories")
    log_every: int = _f(1, "steps between metrics records (JSONL) and progress updates")
    progress: bool = _f(True, "show progress on rank 0 (a bar on a terminal, a plain line every --run.progress-every-s otherwise)")
    progress_every_s: float = _f(30.0, "seconds between plain progress lines when stdout is not a terminal")
    tensorboard: bool = _f(False, "also log metrics.jsonl's scalars to RUN_DIR/tensorboard (needs the tensorboard package)")
    bandwidth_bps: float = _f(200e6, "link model: bandwidth of every link in bit/s")
    latency_s: float = _f(0.0, "link model: one-way latency of every link in seconds")
    eval_sequences: int = _f(64, "held-out sequences scored by the final checkpoint (0: skip)")
    fail_rank: int = _f(-1, "fault injection (tests): this rank kills itself ...", hidden=True)
    fail_step: int = _f(-1, "... at the start of this step", hidden=True)


@dataclass
class Config:
    mesh: MeshConfig = field(default_factory=MeshConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    boundary: BoundaryConfig = field(default_factory=BoundaryConfig)
    dp: DPConfig = field(default_factory=DPConfig)
    anchor: AnchorConfig = field(default_factory=AnchorConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    preset: str = ""

    # ---- conversions -------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        cfg = cls()
        apply_dict(cfg, d, where="config")
        return cfg

    @property
    def fast_rows(self) -> int:
        return self.mesh.rows - (1 if self.anchor.enabled else 0)

    @property
    def world_size(self) -> int:
        return sum(self.mesh.replicas) if self.mesh.replicas else self.mesh.rows * self.mesh.stages

    @property
    def replica_stages(self) -> list[int]:
        """Pipeline stages of each fast replica."""
        return [int(y) for y in self.mesh.replicas] if self.mesh.replicas else [self.mesh.stages] * self.fast_rows

    def replica_codec(self, row: int) -> str:
        """The boundary codec replica ``row`` uses: --boundary.codec, or dense for a full
        (1-stage) replica under --boundary.compress selective."""
        if self.boundary.compress == "selective" and self.replica_stages[row] == 1:
            return "dense"
        return self.boundary.codec


SECTIONS = [f.name for f in dataclasses.fields(Config) if f.name != "preset"]
COMPRESSORS = ("none", "powersgd", "sparseloco", "int8")
ANCHOR_TRANSPORTS = ("dense", "factored")  # orchestration.anchor.wire numbers them on the wire
SNAPSHOT_CODECS = ("full", "int8")  # orchestration.anchor.snapshot.SnapshotCoder
# With --mesh.replicas, unless a preset, config file or flag sets them: the paper's DP sync
# (SparseLoCo, whose error feedback replaces DiLoCo's outer momentum) and boundaries.
HETEROGENEOUS_DEFAULTS = {("dp", "compressor"): "sparseloco", ("boundary", "codec"): "int4",
                          ("boundary", "compress"): "selective"}
RENAMED = {("mesh", "backend"): "dist_backend"}  # old field name -> its name now (old config files)
ALIASES = {  # short flag -> dotted field
    "model": "model.path", "data": "data.source", "steps": "train.steps",
    "resume": "checkpoint.resume", "rows": "mesh.rows", "stages": "mesh.stages",
    "codec": "boundary.codec", "p": "boundary.p", "name": "run.name",
}


def flag_name(section: str, field_name: str) -> str:
    """The command-line flag of a config field, in the one flag style of every entry
    point (words joined by dashes): data.seq_len -> --data.seq-len. The field's own
    spelling (--data.seq_len) is accepted too; config files use the field names."""
    return f"--{section}.{field_name.replace('_', '-')}"


def _hints(section_cls) -> dict:
    return typing.get_type_hints(section_cls)


def _coerce(value: Any, typ, where: str):
    """Converts a YAML/JSON/CLI value to the field's type, or raises a ValueError naming ``where``."""
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if typ is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if typ is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if typ is str:
            if not isinstance(value, (str, int, float)):
                raise ValueError
            return str(value)
        if typ is list:
            if isinstance(value, str):
                value = [v for v in value.replace(" ", "").split(",") if v]
            return [int(v) for v in value]
        if typ is dict:
            if isinstance(value, str):
                value = json.loads(value) if value.strip() else {}
            if not isinstance(value, dict):
                raise ValueError
            return dict(value)
    except (ValueError, TypeError, json.JSONDecodeError):
        pass
    raise ValueError(f"{where}: cannot use {value!r} as {typ.__name__}")


def apply_dict(cfg: Config, d: dict, where: str) -> None:
    """Overrides ``cfg`` in place with a nested dict {section: {field: value}}; unknown keys are errors."""
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a mapping of sections, got {type(d).__name__}")
    for sec, vals in d.items():
        if sec == "preset":
            cfg.preset = str(vals)
            continue
        if sec not in SECTIONS:
            raise ValueError(f"{where}: unknown section {sec!r}; known: {', '.join(SECTIONS)}")
        if not isinstance(vals, dict):
            raise ValueError(f"{where}: section {sec!r} must be a mapping")
        obj = getattr(cfg, sec)
        hints = _hints(type(obj))
        for k, v in vals.items():
            k = RENAMED.get((sec, k), k)
            if k not in hints:
                known = ", ".join(f.name for f in dataclasses.fields(obj))
                raise ValueError(f"{where}: unknown field {sec}.{k}; known in {sec}: {known}")
            setattr(obj, k, _coerce(v, hints[k], f"{where}: {sec}.{k}"))


def load_file(path: str) -> dict:
    """Reads a YAML or JSON config file into a nested dict, whatever its name ends with
    (recognised by content: YAML 1.1 reads JSON too); clear error if missing or malformed."""
    if not os.path.isfile(path):
        raise ValueError(f"config file not found: {path}")
    with open(path) as f:
        text = f.read()
    try:
        import yaml

        d = yaml.safe_load(text)
    except ImportError:  # pyyaml is a dependency, but JSON needs nothing
        d = None
    except Exception as e:  # yaml.YAMLError: try JSON before naming the file
        try:
            d = json.loads(text)
        except ValueError:
            raise ValueError(f"config file {path} is neither valid YAML nor JSON: {e}") from None
    if d is None and text.strip():
        try:
            d = json.loads(text)
        except ValueError as e:
            raise ValueError(f"config file {path} is not valid JSON (and pyyaml is missing): {e}") from None
    if d is not None and not isinstance(d, dict):
        raise ValueError(f"config file {path} holds a {type(d).__name__}, not a mapping of sections "
                         f"({', '.join(SECTIONS)}) as --print-config writes")
    return d or {}


def presets() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(PRESET_DIR) if f.endswith(".yaml"))


def load_preset(name: str) -> dict:
    path = os.path.join(PRESET_DIR, f"{name}.yaml")
    if not os.path.isfile(path):
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(presets())}")
    return load_file(path)


def build_parser() -> argparse.ArgumentParser:
    """The trainer's parser: usage, examples and built-ins from orchestration.cli_help,
    then one group per section; fields with ``hidden=True`` (test-only) are accepted, not listed."""
    from orchestration import cli_help

    ap = cli_help.TrainParser(
        prog=cli_help.PROG, usage=cli_help.USAGE, formatter_class=cli_help.Formatter,
        description="Adapt a causal LM on an X x Y mesh of processes (rows: replicas, columns: pipeline "
        "stages)\nwith compressed stage boundaries and compressed DP sync. Every config field is a flag "
        "--SECTION.FIELD;\nprecedence: defaults < --preset < --config < flags.\n\n" + cli_help.EXAMPLES,
        epilog=cli_help.epilog_builtins())
    g0 = ap.add_argument_group("run selection")
    g0.add_argument("--preset", default=None, metavar="NAME", help=f"a published row: {', '.join(presets())}")
    g0.add_argument("--config", default=None, metavar="FILE", help="YAML or JSON file {section: {field: value}}")
    g0.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    inv = {v: k for k, v in ALIASES.items()}
    defaults = Config()
    for sec in SECTIONS:
        obj = getattr(defaults, sec)
        g = ap.add_argument_group(f"--{sec}.*", cli_help.SECTIONS_HELP.get(sec))
        for f in dataclasses.fields(obj):
            dotted = f"{sec}.{f.name}"
            names = [flag_name(sec, f.name)] + ([f"--{inv[dotted]}"] if dotted in inv else [])
            default = getattr(obj, f.name)
            flag = {"nargs": "?", "const": "true"} if isinstance(default, bool) else {}  # bare --flag means true
            kw = dict(dest=dotted, default=None, metavar=type(default).__name__.upper(), **flag)
            text = f"{f.metadata.get('help', '')} (default: {default!r})".replace("%", "%%")
            g.add_argument(*names, **kw, help=argparse.SUPPRESS if f.metadata.get("hidden") else text)
            hidden = [f"--{dotted}"] if f"--{dotted}" != names[0] else []  # the field's spelling: --data.seq_len
            hidden += [f"--{sec}.{old}" for (s_, old), new in RENAMED.items() if s_ == sec and new == f.name]
            if hidden:  # accepted, not listed
                g.add_argument(*hidden, **kw, help=argparse.SUPPRESS)
    return ap


def parse_args(argv: list[str] | None = None) -> tuple[Config, argparse.Namespace]:
    """Builds the Config from defaults, preset, file and flags (in that order) and validates it."""
    ap = build_parser()
    ns = ap.parse_args(argv)
    cfg = Config()
    given: list[dict] = []
    if ns.preset:
        given.append(load_preset(ns.preset))
        apply_dict(cfg, given[-1], where=f"preset {ns.preset}")
        cfg.preset = ns.preset
    if ns.config:
        given.append(load_file(ns.config))
        apply_dict(cfg, given[-1], where=ns.config)
    over: dict = {}
    for dotted, v in vars(ns).items():
        if "." in dotted and v is not None:
            sec, k = dotted.split(".", 1)
            over.setdefault(sec, {})[k] = v
    apply_dict(cfg, over, where="command line")
    if cfg.mesh.replicas:  # a heterogeneous mesh's own defaults, for what nothing above set
        named = {(sec, k.replace("-", "_")) for d in [*given, over] for sec, sub in d.items()
                 if isinstance(sub, dict) for k in sub}
        reps = list(cfg.mesh.replicas)
        for k, v in (("rows", len(reps)), ("stages", max(reps))):
            # each flag given (here or in a file) must agree with the replicas; one not given is derived
            _need(("mesh", k) not in named or getattr(cfg.mesh, k) == v,
                  f"--mesh.replicas {','.join(map(str, reps))} makes a mesh of {len(reps)} replicas of up to "
                  f"{max(reps)} stages; it conflicts with --mesh.{k} {getattr(cfg.mesh, k)} (give one or the other)")
            setattr(cfg.mesh, k, v)
        fill: dict = {}
        for (sec, k), v in HETEROGENEOUS_DEFAULTS.items():
            if (sec, k) not in named:
                fill.setdefault(sec, {})[k] = v
        apply_dict(cfg, fill, where="heterogeneous-mesh defaults")
    validate(cfg)
    return cfg, ns


def ineffective_settings(cfg: Config) -> list[str]:
    """Settings a valid config accepts that change nothing in this mesh, one line each
    (the trainer prints them as warnings)."""
    out = []
    codecs = {cfg.replica_codec(r) for r in range(cfg.fast_rows)}
    if cfg.boundary.compress == "selective" and not cfg.mesh.replicas and cfg.mesh.stages > 1:
        out.append("--boundary.compress selective: this mesh has no full replica, so every replica's boundaries "
                   "are compressed, as with all")
    if cfg.boundary.codec == "subspace" and "subspace" not in codecs:
        out.append("--boundary.codec subspace: no replica uses it (selective keeps full replicas dense and this "
                   "mesh has no pipeline replica)")
    if cfg.dp.projection != DPConfig().projection and (
            cfg.dp.mode != "diloco" or cfg.fast_rows < 2 or "subspace" not in codecs):
        out.append(f"--dp.projection {cfg.dp.projection}: it acts on the DiLoCo sync (--dp.mode diloco, 2+ replicas) of "
                   f"subspace-constrained replicas; this run has none, so it is ignored")
    return out


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def validate(cfg: Config) -> Config:
    """Checks ranges and combinations; raises ValueError naming the flag. Touches no files."""
    m, t, b, dp, a = cfg.mesh, cfg.train, cfg.boundary, cfg.dp, cfg.anchor
    if m.replicas:
        _need(all(isinstance(y, int) and y >= 1 for y in m.replicas),
              f"--mesh.replicas entries are stage counts >= 1, got {m.replicas}")
        _need(not a.enabled, "--mesh.replicas (a heterogeneous mesh) cannot run the anchor row (--anchor.enabled)")
        m.rows, m.stages = len(m.replicas), max(m.replicas)  # parse_args checked given flags against these
    _need(m.rows >= 1, f"--mesh.rows must be >= 1, got {m.rows}")
    _need(m.stages >= 1, f"--mesh.stages must be >= 1, got {m.stages}")
    _need(not a.enabled or m.rows >= 2, "--anchor.enabled needs --mesh.rows >= 2 (the last row is the anchor)")
    if m.layers_per_stage:
        _need(len(m.layers_per_stage) == m.stages,
              f"--mesh.layers-per-stage has {len(m.layers_per_stage)} entries for {m.stages} stages")
        _need(all(n >= 1 for n in m.layers_per_stage), "--mesh.layers-per-stage entries must be >= 1")
    _need(m.dist_backend in ("auto", "gloo", "nccl"),
          f"--mesh.dist-backend must be auto, gloo or nccl, got {m.dist_backend!r}")
    _need(m.timeout_s > 0, f"--mesh.timeout-s must be > 0, got {m.timeout_s}")
    _need(m.start_method in ("fork", "spawn"), f"--mesh.start-method must be fork or spawn, got {m.start_method!r}")
    _need(m.threads_per_rank >= 1, "--mesh.threads-per-rank must be >= 1")
    _need(cfg.model.dtype in ("float32", "bfloat16"), f"--model.dtype must be float32 or bfloat16, got {cfg.model.dtype!r}")
    _need(cfg.model.tied_embeddings in ("sync", "untie"),
          f"--model.tied-embeddings must be sync or untie, got {cfg.model.tied_embeddings!r}")
    _need(cfg.data.seq_len >= 2, f"--data.seq-len must be >= 2, got {cfg.data.seq_len}")
    _need(0.0 <= cfg.data.eval_fraction < 1.0, "--data.eval-fraction must be in [0, 1)")
    _need(cfg.data.on_decode_error in ("auto", "raise", "skip"),
          f"--data.on-decode-error must be auto, raise or skip, got {cfg.data.on_decode_error!r}")
    _need(t.steps >= 1, f"--train.steps must be >= 1, got {t.steps}")
    _need(t.batch_size >= 1 and t.microbatches >= 1, "--train.batch-size and --train.microbatches must be >= 1")
    _need(t.batch_size % t.microbatches == 0,
          f"--train.batch-size {t.batch_size} does not split into --train.microbatches {t.microbatches} "
          f"equal micro-batches")
    _need(t.schedule in ("1f1b", "gpipe"), f"--train.schedule must be 1f1b or gpipe, got {t.schedule!r}")
    _need(t.optimizer in ("adamw", "spectral"), f"--train.optimizer must be adamw or spectral, got {t.optimizer!r}")
    _need(t.lr > 0 and 0 <= t.min_lr_ratio <= 1 and t.warmup_steps >= 0, "--train.lr/min_lr_ratio/warmup_steps out of range")
    _need(t.clip_grad_norm >= 0, "--train.clip-grad-norm must be >= 0")
    _need(t.max_bad_steps >= 0, f"--train.max-bad-steps must be >= 0, got {t.max_bad_steps}")
    _need(t.spike_factor == 0 or t.spike_factor > 1, f"--train.spike-factor must be 0 (off) or > 1, got {t.spike_factor}")
    from orchestration.codecs import CODECS, parse_spec  # the one list of boundary codecs

    if ":" in b.codec:  # a spec name:key=value,...: its options join --boundary.options (which win)
        try:
            name, spec_options = parse_spec(b.codec)
        except ValueError as e:
            _need(False, f"--boundary.codec: {e}")
        b.codec, b.options = name, {**spec_options, **b.options}
    _need(b.codec in CODECS, f"--boundary.codec must be one of {', '.join(CODECS)}, got {b.codec!r}")
    _need(b.compress in ("all", "selective"), f"--boundary.compress must be all or selective, got {b.compress!r}")
    if m.replicas and len(set(m.replicas)) > 1:
        _need(b.codec != "pca", "--mesh.replicas: the pca codec is not supported on a heterogeneous mesh (its calibration "
                                "fits the bases of one homogeneous split): use --boundary.codec subspace (the paper's), "
                                "int4, ... (docs/codecs.md)")
        full_compressed = [r for r in range(m.rows) if m.replicas[r] == 1 and cfg.replica_codec(r) not in ("dense", "subspace")]
        _need(not full_compressed, f"--mesh.replicas: replica {full_compressed[:1]} is a full replica (no stage boundary) "
                                   f"and --boundary.codec {b.codec} compresses boundaries only; use --boundary.compress "
                                   f"selective, or the subspace codec (a full replica keeps its constraint)")
    _need(0.0 <= b.p < 1.0, f"--boundary.p must be in [0, 1), got {b.p}")
    _need(dp.mode in ("allreduce", "diloco", "none"), f"--dp.mode must be allreduce, diloco or none, got {dp.mode!r}")
    _need(dp.compressor in COMPRESSORS, f"--dp.compressor must be one of {', '.join(COMPRESSORS)}, got {dp.compressor!r}")
    _need(dp.sync_every >= 1 and dp.fragments >= 1, "--dp.sync-every and --dp.fragments must be >= 1")
    _need(dp.mode != "diloco" or 0 <= dp.overlap_steps < dp.sync_every,
          f"--dp.overlap-steps {dp.overlap_steps} must be in [0, --dp.sync-every {dp.sync_every})")
    _need(dp.mode != "diloco" or dp.fragments <= dp.sync_every,
          f"--dp.fragments {dp.fragments} must be <= --dp.sync-every {dp.sync_every} (one fragment starts per step)")
    try:
        from meshkern.diloco import parse_projection

        steps = parse_projection(dp.projection)
    except ValueError as e:
        _need(False, f"--dp.projection: {e}")
    subspace_used = "subspace" in {cfg.replica_codec(r) for r in range(cfg.fast_rows)}
    _need(not (subspace_used and dp.mode == "diloco" and "error" in steps and dp.compressor != "sparseloco"),
          f"--dp.projection {dp.projection}: the 'error' step projects SparseLoCo's error feedback; "
          f"--dp.compressor {dp.compressor} has none (use outer or reproject, or --dp.compressor sparseloco)")
    _need(dp.outer_momentum == -1 or 0 <= dp.outer_momentum < 1,
          f"--dp.outer-momentum must be -1 (auto) or in [0, 1), got {dp.outer_momentum}")
    _need(a.transport in ANCHOR_TRANSPORTS,
          f"--anchor.transport must be {' or '.join(ANCHOR_TRANSPORTS)}, got {a.transport!r}")
    _need(a.snapshot_codec in SNAPSHOT_CODECS,
          f"--anchor.snapshot-codec must be {' or '.join(SNAPSHOT_CODECS)}, got {a.snapshot_codec!r}")
    if a.enabled:
        _need(t.optimizer == "spectral", "--anchor.enabled needs --train.optimizer spectral (SpectralAdamW consumes "
                                         f"the anchor updates), got {t.optimizer!r}")
        _need(a.snapshot_every >= 1 and a.microbatches >= 1,
              "--anchor.snapshot-every and --anchor.microbatches must be >= 1")
        _need(a.max_staleness >= 0 and a.delay >= 0, "--anchor.max-staleness and --anchor.delay must be >= 0")
        _need("subspace" not in {cfg.replica_codec(r) for r in range(cfg.fast_rows)},
              "--anchor.enabled with --boundary.codec subspace is not supported: the anchor row would need the "
              "constraint and the frozen embedding too")
        _need(a.delay <= a.max_staleness, f"--anchor.delay {a.delay} exceeds --anchor.max-staleness "
                                          f"{a.max_staleness}: every update would be rejected")
    _need(a.state_every >= 0 and a.restarts >= 0, "--anchor.state-every and --anchor.restarts must be >= 0")
    _need(not a.join or a.enabled, "--anchor.join needs --anchor.enabled (the config of the running fast circuit)")
    _need(not a.join or bool(a.store), "--anchor.join needs --anchor.store host:port (printed by the fast circuit's launcher)")
    _need(a.join or not a.store, "--anchor.store is for --anchor.join (a local run's anchor row uses its own launcher's store)")
    if a.store:
        host, _, port = a.store.rpartition(":")
        _need(bool(host) and port.isdigit() and 0 < int(port) < 65536, f"--anchor.store must be host:port, got {a.store!r}")
    _need(cfg.checkpoint.every >= 0 and cfg.checkpoint.keep >= 1, "--checkpoint.every must be >= 0 and --checkpoint.keep >= 1")
    _need(cfg.run.eval_sequences >= 0, "--run.eval-sequences must be >= 0")
    _need(cfg.run.log_every >= 1, "--run.log-every must be >= 1")
    _need(cfg.run.progress_every_s > 0, f"--run.progress-every-s must be > 0, got {cfg.run.progress_every_s}")
    _need(cfg.run.bandwidth_bps > 0 and cfg.run.latency_s >= 0, "--run.bandwidth-bps must be > 0, --run.latency-s >= 0")
    _need(cfg.run.fail_rank < cfg.world_size, f"--run.fail-rank {cfg.run.fail_rank} is not a rank of a {cfg.world_size}-rank mesh")
    return cfg


def to_yaml(cfg: Config) -> str:
    import yaml

    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
