"""The run configuration as typed dataclasses: one section per concern, every field with
its default and --help text, and the named choices the checks and the wire formats use.

Every field is a flag ``--section.field`` (``flag_name``); orchestration.config.manager
reads flags, files and presets into a :class:`Config`, orchestration.config.validate
checks it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


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
    replicas: list = _f([], "a heterogeneous mesh: pipeline stages of each replica, e.g. 1,2,2 = one full replica (the whole model in one process) and two 2-stage pipeline replicas; sets --mesh.rows and --mesh.stages (the deepest replica); DP sync then runs per parameter name; unless set otherwise, this mode uses --dp.compressor sparseloco, --boundary.codec int4 and --boundary.compress selective (docs/heterogeneous.md); with --anchor.enabled the anchor row is one more row, of the deepest replicas' split, serving the replicas of that split. Empty: --mesh.rows replicas of --mesh.stages stages")
    dist_backend: str = _f("auto", "torch.distributed backend of the mesh (not a kernel backend, see MESHKERN_BACKEND): "
                               "auto (nccl when every local rank has a GPU of its own, else gloo), gloo, nccl")
    device: str = _f("auto", "where each fast rank computes: auto (cuda when torch sees a GPU, else cpu), cpu, or cuda "
                             "(GPU LOCAL_RANK mod the GPUs visible: ranks share GPUs when there are fewer GPUs than ranks, "
                             "and then talk over gloo, wire tensors through CPU copies; orchestration.distributed.devices)")
    timeout_s: float = _f(60.0, "a rank that waits on a dead or stalled peer longer than this fails with an error")
    start_method: str = _f("auto", "how the local launcher starts ranks: auto (fork on CPU, spawn on CUDA), fork (fast: the "
                                   "parent loads model and data once; CPU only) or spawn")
    threads_per_rank: int = _f(1, "torch intra-op threads per rank (1: ranks share few cores; OpenMP spin-waiting otherwise)")
    elastic: bool = _f(False, "elastic fast replicas on torchft (docs/elastic.md): a replica that dies drops out of the next "
                              "quorum and the others go on; the local launcher starts a lighthouse and restarts dead "
                              "replicas, which heal from a live one. Off by default")
    replica_restarts: int = _f(2, "--mesh.elastic, local launcher: restart dead fast replicas up to this many times in all")
    min_replicas: int = _f(1, "--mesh.elastic: fewest live replicas a step needs; below it a replica keeps asking "
                              "for --mesh.rejoin-timeout-s, then stops with an error (the last checkpoint stays valid)")
    quorum_timeout_s: float = _f(60.0, "--mesh.elastic: how long a replica waits for a quorum of --mesh.min-replicas")
    rejoin_timeout_s: float = _f(600.0, "--mesh.elastic: a replica that gets no quorum (its link is down, the lighthouse "
                                          "is unreachable, or fewer than --mesh.min-replicas are live) keeps asking, with "
                                          "backoff, for this long in all, saying what it waits for; when the link is back "
                                          "it rejoins and heals from a live replica. After it: QuorumLost, the leader "
                                          "saving its last committed step first (0: stop at the first quorum that times out)")
    heartbeat_s: float = _f(2.0, "--mesh.elastic: a replica silent this long (dead, or its link down) is out of the next quorum")
    join: str = _f("", "--mesh.elastic: start one fast replica (--mesh.replica-id) that joins the running elastic run whose "
                       "lighthouse is this URL (http://HOST:PORT, printed by its launcher; RUN_DIR/elastic/lighthouse); "
                       "same config otherwise, and the run's secret (--anchor.secret-file)")
    replica_id: int = _f(-1, "--mesh.join: which of the mesh's --mesh.rows replicas this one is (its data shard and seed)")
    local_replicas: list = _f([], "--mesh.elastic: the replica ids this launcher starts (empty: all of 0..rows-1); the "
                                  "others may join later with --mesh.join")
    bind: str = _f("127.0.0.1", "--mesh.elastic: the address the lighthouse, each replica's torchft manager, its heal "
                                "server and its torchft store listen on and advertise: another machine's replicas must reach it, so "
                                "with a lighthouse on another host it must be this host's address on their network "
                                "(checked at start). A replica's own stages talk over loopback whatever it is")


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
    codec: str = _f("pca", "pipeline boundary codec: dense, mask (the paper's; presets m95, m95-ap, m90-ap), topk, int8, int4, bottleneck, pca (the default: calibrated PCA basis, every coordinate its own code width on a Gaussian code book (quant=nf), 1/15 of dense fp32 bytes; pca:quant=absmax: int4 on the top half of the coordinates; orchestration.components.calibration), aqsgd (AQ-SGD: per-sample delta quantization), tahquant (TAH-Quant: tile-wise, Hadamard on outlier tiles); a name or a spec name:key=value,... e.g. aqsgd:bits=4,gbits=16 or tahquant:bits=3 (options as in --boundary.options; docs/codecs.md)")
    p: float = _f(0.95, "fraction of hidden dims dropped per token (mask; also the ratio target of topk/bottleneck)")
    rescale: bool = _f(False, "mask: scale kept values by 1/(1-p) (dropout-style unbiased estimate)")
    options: dict = _f({}, "extra keyword arguments for the codec, as JSON, e.g. '{\"k\": 64}'")
    dense_tail: int = _f(0, "the last N training steps send every stage boundary uncompressed (the dense codec, in the model's dtype) so training ends on exact activations, their bytes counted; 0: off (a codec-free tail, issue 43)")
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
    max_rate_bps: float = _f(-1.0, "pace the anchor's payloads (snapshots up, updates down) to at most this many bit/s each way, so they leave the fast circuit's pipeline most of a shared link (a home uplink is one queue: unpaced, TCP splits it about evenly while a snapshot is on its way, measured: docs/benchmarks.md, Across hosts); -1 (auto): a quarter of --run.bandwidth-bps; 0: unpaced")
    snapshot_codec: str = _f("int8", "snapshot transfer to the anchor: full (parameters as they are) or int8 (first in full, then int8 deltas against what the anchor holds, one scale per 1024 values: ~4x fewer bytes than fp32)")
    state_every: int = _f(1, "anchor rounds between saves of the anchor's state (round counter, factored momentum) to CHECKPOINT_DIR/anchor/; 0: never")
    restarts: int = _f(2, "local launcher: restart a dead anchor row up to this many times (it rejoins the running fast circuit)")
    join: bool = _f(False, "start only the anchor row and join a running fast circuit (with --anchor.store; same config otherwise)")
    store: str = _f("", "host:port of the store where the anchor row meets the fast circuit: for --anchor.join, the running fast circuit's rendezvous store (its MASTER_ADDR:MASTER_PORT); with --mesh.elastic, the anchor store the lighthouse hosts (printed by the local launcher; by hand: orchestration.elastic.lighthouse --anchor-store PORT), given to every replica that joins and to the anchor row")
    secret_file: str = _f("", "the run's anchor secret (anchor rows authenticate with it; docs/security.md); default RUN_DIR/anchor.secret, created 0600 by the fast circuit; pass a copy with --anchor.join on another machine (or set MESHKERN_ANCHOR_SECRET)")


@dataclass
class AdapterConfig:
    kind: str = _f("none", "train adapters instead of the full model: none (full fine-tuning) or lora (LoRA built with "
                   "peft on every stage: base weights frozen, in --model.dtype; adapters trained in fp32; adapter-only "
                   "checkpoints, a PEFT folder RUN_DIR/adapter at the end; docs/lora.md)")
    rank: int = _f(16, "LoRA rank r of every adapted linear layer")
    alpha: float = _f(32.0, "LoRA alpha: the adapter's update is scaled by alpha / rank")
    dropout: float = _f(0.0, "LoRA dropout on the adapter's input, in [0, 1)")
    targets: str = _f("q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                      "comma-separated linear layers of every decoder layer that get an adapter (names as in the "
                      "model, e.g. q_proj,v_proj)")
    export: str = _f("adapter", "what a LoRA run writes at its end besides its checkpoints: adapter (RUN_DIR/adapter, a "
                     "PEFT folder: PeftModel.from_pretrained(base, folder)) or merged (also RUN_DIR/merged, the base "
                     "model with the adapters merged in, a plain HF checkpoint)")

    def target_list(self) -> list[str]:
        return [t for t in self.targets.replace(" ", "").split(",") if t]


@dataclass
class CheckpointConfig:
    every: int = _f(50, "save a checkpoint every N steps, besides the end and Ctrl-C (0: only those); 50 bounds "
                    "the work a crash loses to ~1 min of the default run, and --checkpoint.keep bounds the disk "
                    "(a default-model checkpoint is ~30 MB with its optimizer state)")
    dir: str = _f("", "checkpoint directory (empty: RUN_DIR/checkpoints)")
    resume: str = _f("", "resume from: a checkpoint directory, or 'latest' (the newest in the checkpoint dir)")
    keep: int = _f(2, "complete checkpoints kept (older ones are deleted)")
    leader_copy: bool = _f(True, "hosts with disks of their own: every rank's training state (weights, optimizer) also "
                           "travels to the leader, in the background with the model, so that a host replaced with an "
                           "empty disk resumes from the leader's copy (off: only the model travels; such a host is "
                           "then refused, naming what to copy). Costs the rank files' bytes on the export axis")
    boundary_transform: bool = _f(True, "a run whose codec sends position 0 as a sink row (pca with sink=true, the "
                                  "default) writes meshkern_boundary.json into its checkpoints and exports, and "
                                  "orchestration.models.loading then keeps position 0's int8 round trip at each "
                                  "boundary layer, as the model trained (docs/codecs.md); false: the plain model. "
                                  "Never for dense or other codecs")


@dataclass
class RunConfig:
    name: str = _f("", "run name (empty: derived from the preset and time)")
    out_dir: str = _f("runs", "parent directory of run directories")
    log_every: int = _f(1, "steps between metrics records (JSONL) and progress updates")
    progress: bool = _f(True, "show progress on rank 0 (a bar on a terminal, a plain line every --run.progress-every-s otherwise)")
    progress_every_s: float = _f(30.0, "seconds between plain progress lines when stdout is not a terminal")
    tensorboard: bool = _f(False, "also log metrics.jsonl's scalars to RUN_DIR/tensorboard (needs the tensorboard package)")
    wandb: bool = _f(False, "also log metrics.jsonl's scalars and the run's config to Weights & Biases, files under "
                     "RUN_DIR/wandb (needs the wandb package); a resumed run continues the same W&B run")
    wandb_project: str = _f("meshkern", "--run.wandb: the W&B project")
    wandb_name: str = _f("", "--run.wandb: the W&B run's display name (empty: the run's name, --run.name)")
    wandb_mode: str = _f("offline", "--run.wandb: offline (no network; upload later with wandb sync "
                         "RUN_DIR/wandb/offline-run-*), online (needs wandb login) or disabled")
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
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    preset: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def fast_rows(self) -> int:
        return self.mesh.rows - (1 if self.anchor.enabled else 0)

    @property
    def world_size(self) -> int:
        """Every process: the fast replicas' stages plus, with the anchor, its row of --mesh.stages."""
        return sum(self.replica_stages) + (self.mesh.stages if self.anchor.enabled else 0)

    @property
    def replicas_rows(self) -> int:
        """The rows --mesh.replicas makes: one per replica, the anchor row last."""
        return len(self.mesh.replicas) + (1 if self.anchor.enabled else 0)

    @property
    def replica_stages(self) -> list[int]:
        """Pipeline stages of each fast replica."""
        return [int(y) for y in self.mesh.replicas] if self.mesh.replicas else [self.mesh.stages] * self.fast_rows

    @property
    def anchor_pace_bps(self) -> float:
        """The anchor's payload pace in bit/s (--anchor.max-rate-bps; auto: ANCHOR_PACE_SHARE of
        --run.bandwidth-bps); 0: unpaced."""
        r = self.anchor.max_rate_bps
        return float(r) if r >= 0 else ANCHOR_PACE_SHARE * self.run.bandwidth_bps

    def replica_codec(self, row: int) -> str:
        """The boundary codec replica ``row`` uses: --boundary.codec, or dense for a full
        (1-stage) replica under --boundary.compress selective."""
        if self.boundary.compress == "selective" and self.replica_stages[row] == 1:
            return "dense"
        return self.boundary.codec


SECTIONS = [f.name for f in dataclasses.fields(Config) if f.name != "preset"]
COMPRESSORS = ("none", "powersgd", "sparseloco", "int8")
ADAPTERS = ("none", "lora")
ADAPTER_EXPORTS = ("adapter", "merged")
WANDB_MODES = ("offline", "online", "disabled")  # wandb.init(mode=...)
# The anchor's default pace, a share of the uplink (--run.bandwidth-bps): the pipeline keeps
# the rest while a snapshot travels. Measured at 500 kbit/s (docs/benchmarks.md, Across hosts):
# unpaced, the fast step went from 0.25 s to 0.56 s; paced at a tenth, it stayed at 0.25 s.
ANCHOR_PACE_SHARE = 0.25
ANCHOR_TRANSPORTS = ("dense", "factored")  # orchestration.anchor.wire numbers them on the wire
SNAPSHOT_CODECS = ("full", "int8")  # orchestration.anchor.snapshot.SnapshotCoder
RENAMED = {("mesh", "backend"): "dist_backend"}  # old field name -> its name now (old config files)
ALIASES = {  # short flag -> dotted field
    "model": "model.path", "data": "data.source", "steps": "train.steps",
    "resume": "checkpoint.resume", "rows": "mesh.rows", "stages": "mesh.stages",
    "codec": "boundary.codec", "p": "boundary.p", "name": "run.name",
    "adapter": "adapter.kind", "export": "adapter.export",
}


def flag_name(section: str, field_name: str) -> str:
    """The command-line flag of a config field, in the one flag style of every entry
    point (words joined by dashes): data.seq_len -> --data.seq-len. The field's own
    spelling (--data.seq_len) is accepted too; config files use the field names."""
    return f"--{section}.{field_name.replace('_', '-')}"
