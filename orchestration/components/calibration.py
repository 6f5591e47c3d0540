"""Calibration of a boundary codec that ``needs_calibration`` (the ``pca`` codecs,
orchestration.codecs.PCABaseCodec: PCANFCodec, PCACodec): one fixed basis per pipeline
boundary, identical on both sides of it.

A boundary is named by the decoder layer it sits after (``boundary_layers``), not by the
stage that sends it: in a heterogeneous mesh (--mesh.replicas 1,2,2, or 2,3) replicas of
different depths cut the model in different places, and the run fits one basis for every
distinct cut of every replica that uses the codec (``run_boundary_layers``). Two replicas
that cut after the same layer share its basis. A full replica left uncompressed
(--boundary.compress selective: ``Config.replica_codec``) has no boundary and needs none.

What is fitted, per boundary (the hidden state after decoder layer L), from
``calib_rows`` rows of the TRAINING set (never the held-out rows) with the model as
loaded, before any training step:
    tokens   the boundary hidden states of those rows; with ``sink`` position 0 of every
             row is left out (it travels as int8 on its own), and so is every token whose
             norm is >= 10x the median token norm (attention-sink-like outliers), as
             orchestration.diagnose's sink+pca candidates do
    mean, U  their mean and the top-k eigenvectors of their covariance (fit_pca)
    sd       the std of each coordinate, sqrt(eigenvalue)
    gsd      the rms of each gradient coordinate U^T g over the dense boundary gradients
             of the first ``grad_rows`` of those rows (the loss's gradient w.r.t. h_b; with
             ``sink`` positions >= 1 only); ones if grad_rows = 0
The hidden states after layer L do not depend on where else the model is cut, so all the
run's boundaries are fitted in one pass over the model cut at every one of them
(``fit_layer_bases``). The basis is fixed for the run (no refresh schedule): the codec's
subspace does not follow the model as it trains. It is stored as RUN_DIR/pca_basis.pt,
``{"after_layer": {L: basis}}``; a resumed run (and orchestration.experiments' codec-on
evaluation) loads that file instead of fitting again. A file of a run from before layer
keys (``{stage boundary b: basis}``, homogeneous meshes only) still loads: its boundary b
is the one after ``boundary_layers(...)[b]`` of the run's split.

How both sides get it (``attach``, called by every fast rank whose replica uses the
codec): under the local launcher with fork, ``train.prepare`` (which loaded the model)
fitted it into codecs.PCA_BASES (keyed by layer) and the ranks inherited it; otherwise
(torchrun, spawn) the first such rank of the world fits it (or loads RUN_DIR/pca_basis.pt)
and broadcasts it to the others at start. Each rank's codec then holds its own replica's
view, ``{stage boundary b: basis after boundary_layers[b]}``: the key the pipeline
executor's MaskKey carries, so the executor is the same for every mesh. The basis bytes
are counted once per sending rank on the pp_fwd axis (what stage b sends stage b+1 once:
H + H*k + 2k values, PCABasis.nbytes).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from orchestration import codecs
from meshkern.pca_nf import allocate_bits
from orchestration.codecs import PCABaseCodec, PCABasis

BASIS_FILE = "pca_basis.pt"
OUTLIER_TOKEN_RATIO = 10.0  # a token whose norm is >= 10x the median token norm (attention sinks)


# --------------------------------------------------------------------- PCA
@dataclass
class PCA:
    mean: torch.Tensor  # [H]
    eigvals: torch.Tensor  # [H] descending (covariance, float64)
    eigvecs: torch.Tensor  # [H, H] columns, float32

    def basis(self, k: int) -> torch.Tensor:
        return self.eigvecs[:, :k]

    def energy(self, k: int) -> float:
        """Share of the (centered) variance the top k directions keep, in-sample."""
        tot = float(self.eigvals.clamp_min(0).sum())
        return float(self.eigvals[:k].clamp_min(0).sum()) / tot if tot > 0 else 1.0

    def energy_on(self, x: torch.Tensor, k: int) -> float:
        """Share of the centered variance of other tokens x [N, H] that the top k keep."""
        xc = (x.reshape(-1, x.shape[-1]).double() - self.mean.double())
        tot = float(xc.pow(2).sum())
        kept = float((xc @ self.eigvecs[:, :k].double()).pow(2).sum())
        return kept / tot if tot > 0 else 1.0


def fit_pca(x: torch.Tensor) -> PCA:
    """Mean and eigendecomposition of the covariance of tokens x [..., H] (float64)."""
    x = x.reshape(-1, x.shape[-1]).double()
    mu = x.mean(0)
    xc = x - mu
    w, V = torch.linalg.eigh(xc.T @ xc / max(1, x.shape[0]))
    return PCA(mu.float(), w.flip(0), V.flip(1).float().contiguous())


def inlier_tokens(h: torch.Tensor, sink: bool) -> torch.Tensor:
    """The tokens of h [..., T, H] the basis is fitted on, as [N, H]: without position 0
    (if ``sink``) and without outliers (norm >= 10x the median norm)."""
    if sink:
        h = h[..., 1:, :]
    x = h.reshape(-1, h.shape[-1]).float()
    tn = x.norm(dim=1)
    keep = tn < OUTLIER_TOKEN_RATIO * tn.median()
    return x if bool(keep.all()) else x[keep]


ALLOCS = ("var", "loss")  # how quant=nf allocates the forward's code widths (fit_basis)


def fit_basis(h: torch.Tensor, k: int, sink: bool = True, grads: torch.Tensor | None = None,
              gbasis: bool = False, nf_bits: int | None = None, half: bool = False, alloc: str = "var",
              gnf_bits: int | None = None) -> PCABasis:
    """The basis of one boundary from its calibration hidden states h [..., T, H] (and the
    dense boundary gradients ``grads`` [..., T, H] of some of those rows, for gsd; with
    ``gbasis`` also the gradient basis Ug: the top-k eigenvectors of their second moment).
    ``nf_bits`` (quant=nf): code bits per token per direction; the forward's widths are
    allocated over the top k coordinates by their variance (meshkern.pca_nf.allocate_bits),
    the basis keeps those that get a bit, and the backward's widths are allocated over them
    by gsd^2, within ``gnf_bits`` (default ``nf_bits``). ``half``: mean, U, sd and gsd
    rounded to fp16 values (counted at 2 bytes).
    ``alloc`` (quant=nf): "var" allocates the forward's widths by each coordinate's variance
    (least squared error); "loss" by its variance times the mean square of the loss
    gradient along it (least first-order change of the loss, E[(g . e)^2] over the
    calibration gradients: needs ``grads``), keeping the coordinates that get a bit
    whatever their rank."""
    if alloc not in ALLOCS:
        raise ValueError(f"pca calibration: alloc must be one of {', '.join(ALLOCS)}, got {alloc!r}")
    if alloc == "loss" and (grads is None or nf_bits is None):
        raise ValueError("pca calibration: alloc=loss weighs the widths by the calibration gradients "
                         "(quant=nf, grad_rows >= 1)")
    x = inlier_tokens(h, sink)
    if x.shape[0] < 2:
        raise ValueError(f"pca calibration: {x.shape[0]} calibration tokens, need more rows")
    pca = fit_pca(x)
    g = None
    if grads is not None:
        g = grads[..., 1:, :] if sink else grads
        g = g.reshape(-1, g.shape[-1]).double()
    bits, U, var = None, pca.basis(k), pca.eigvals[:k].clamp_min(0)
    if nf_bits is not None:
        weight = var if alloc == "var" else var * (g @ U.double()).pow(2).mean(0).float()
        bits = allocate_bits(weight, nf_bits)
        # "var": descending variances get non-increasing widths, the coordinates with a bit are a
        # prefix; "loss": any subset (the columns of U keep their order)
        keep = (bits > 0).nonzero().flatten() if bool((bits > 0).any()) else torch.zeros(1, dtype=torch.long)
        k, bits, U, var = len(keep), bits[keep], U[:, keep], var[keep]
    U = U.contiguous()
    sd = var.clamp_min(1e-30).sqrt().float()
    gsd, Ug = torch.ones(k), None
    if gbasis and grads is None:
        raise ValueError("pca calibration: a gradient basis needs calibration gradients (grad_rows >= 1)")
    if g is not None:
        if gbasis:  # uncentered: the backward sends Ug^T g with no mean
            w, V = torch.linalg.eigh(g.T @ g / max(1, g.shape[0]))
            Ug = V.flip(1)[:, :k].float().contiguous()
        rms = (g @ (U if Ug is None else Ug).double()).pow(2).mean(0).sqrt()
        if float(rms.max()) > 0:
            gsd = rms.clamp_min(float(rms.max()) * 1e-6).float()
    mean = pca.mean
    if half:
        mean, U, sd, gsd = (t.half().float() for t in (mean, U, sd, gsd))
        Ug = None if Ug is None else Ug.half().float()
    gbits = None if bits is None else allocate_bits(gsd.double() ** 2, nf_bits if gnf_bits is None else gnf_bits)
    return PCABasis(mean, U, sd, gsd, Ug, bits, gbits, 2 if half else 4)


# --------------------------------------------------------------------- per run
def calibration_rows(train_rows: torch.Tensor, n: int, seed: int = 0) -> torch.Tensor:
    """``n`` training rows, a seeded choice (the same in every process)."""
    g = torch.Generator().manual_seed(int(seed))
    idx = torch.randperm(train_rows.shape[0], generator=g)[:min(int(n), train_rows.shape[0])]
    return train_rows[idx.sort().values]


def boundary_layers(num_layers: int, num_stages: int, layers_per_stage=None) -> list[int]:
    """The decoder layer each boundary of a ``num_stages``-stage split sits after (0-based),
    boundary b first: the split the trainer makes (stages.replica_split)."""
    from orchestration.distributed.stages import replica_split

    split = replica_split(num_layers, num_stages, layers_per_stage or None)
    return [sum(split[:b + 1]) - 1 for b in range(len(split) - 1)]


def calibrating_rows(cfg) -> list[int]:
    """The fast replicas whose codec (``Config.replica_codec``) needs calibration: every
    one, or, under --boundary.compress selective, all but the full replicas."""
    return [row for row in range(cfg.fast_rows)
            if codecs.codec_class(cfg.replica_codec(row), cfg.boundary.options).needs_calibration]


def run_boundary_layers(cfg, num_layers: int) -> dict[int, list[int]]:
    """{fast replica: ``boundary_layers`` of its split}, for every ``calibrating_rows`` one."""
    return {row: boundary_layers(num_layers, cfg.replica_stages[row], cfg.mesh.layers_per_stage)
            for row in calibrating_rows(cfg)}


def _run_layers(cfg, num_layers: int) -> list[int]:
    """Every distinct boundary layer of the run, ascending."""
    return sorted({L for layers in run_boundary_layers(cfg, num_layers).values() for L in layers})


def boundary_states(model, rows: torch.Tensor, num_stages: int, layers_per_stage=None, grad_rows: int = 8,
                    chunk: int = 4) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """(hs, gs): boundary b's hidden states (stage b's outputs, [N, T, H] fp32) on ``rows``
    of ``model`` split as the trainer splits it (stages.split_model), and the dense
    boundary gradients of the unsplit model's loss on the first ``grad_rows`` rows (None
    when 0). What a basis is fitted on, and what orchestration.diagnose.drift measures."""
    from orchestration.distributed.stages import causal_lm_loss, split_model

    stages = split_model(model, num_stages, layers_per_stage or None)
    was_training = model.training
    model.eval()
    hs: list[list[torch.Tensor]] = [[] for _ in stages[:-1]]
    gs: list[list[torch.Tensor]] = [[] for _ in stages[:-1]]
    try:
        for i in range(0, rows.shape[0], chunk):
            ids = rows[i:i + chunk]
            want_grad = i < grad_rows
            with torch.set_grad_enabled(want_grad):
                x, outs = ids, []
                for st in stages:
                    x = st(x)
                    if not st.is_last:
                        if want_grad and not x.requires_grad:
                            # a frozen base (LoRA's, or a stage with no trainable weight
                            # before this boundary): the boundary gradient is still wanted
                            x.requires_grad_()
                        outs.append(x)
                for b, o in enumerate(outs):
                    hs[b].append(o.detach().float())
                if want_grad and outs:  # (a one-stage split has no boundary to differentiate at)
                    loss = causal_lm_loss(x, ids)
                    for b, g in enumerate(torch.autograd.grad(loss, outs)):
                        gs[b].append(g.detach().float())
            del x, outs
    finally:
        model.train(was_training)
    return [torch.cat(h) for h in hs], [torch.cat(g) if g else None for g in gs]


def fit_for(codec: PCABaseCodec, h: torch.Tensor, grads: torch.Tensor | None = None) -> PCABasis:
    """``fit_basis`` with what ``codec`` asks for (its width, sink and fit_options)."""
    H = h.shape[-1]
    return fit_basis(h, codec.width(H), codec.sink, grads, **codec.fit_options(H))


def fit_model_bases(model, rows: torch.Tensor, codec: PCABaseCodec, num_stages: int,
                    layers_per_stage=None, grad_rows: int = 8, chunk: int = 4) -> dict[int, PCABasis]:
    """The basis of every boundary of ``model`` split as the trainer splits it, fitted on
    ``rows`` (``boundary_states``)."""
    hs, gs = boundary_states(model, rows, num_stages, layers_per_stage, grad_rows, chunk)
    return {b: fit_for(codec, h, g) for b, (h, g) in enumerate(zip(hs, gs))}


def fit_layer_bases(model, rows: torch.Tensor, codec: PCABaseCodec, layers, grad_rows: int = 8,
                    chunk: int = 4) -> dict[int, PCABasis]:
    """{L: the basis of the boundary after decoder layer L} for every L in ``layers``: one
    pass over ``model`` cut after each of them (``fit_model_bases``; a homogeneous run's
    layers are its own split's cuts, so this is the very split it trains with)."""
    cuts = sorted({int(L) for L in layers})
    n = model.config.num_hidden_layers
    if any(not 0 <= L < n - 1 for L in cuts):
        raise ValueError(f"pca calibration: boundary layers {cuts} must be in 0..{n - 2} for {n} decoder layers")
    split = [b - a for a, b in zip([-1] + cuts, cuts + [n - 1])]
    fitted = fit_model_bases(model, rows, codec, len(split), split, grad_rows, chunk)
    return {L: fitted[b] for b, L in enumerate(cuts)}


def codec_of(cfg):
    """The run's boundary codec if it needs calibration, else None."""
    if not codecs.codec_class(cfg.boundary.codec, cfg.boundary.options).needs_calibration:
        return None
    return codecs.codec_for(cfg.boundary)


def bases_for_run(cfg, model, train_rows: torch.Tensor, run_dir: str | None = None) -> dict[int, PCABasis]:
    """{boundary layer: basis} for every boundary of the run (``run_boundary_layers``):
    RUN_DIR/pca_basis.pt if it exists (a resumed run keeps its basis), else fitted on
    ``model`` and the run's training rows."""
    n = model.config.num_hidden_layers
    if run_dir and os.path.isfile(os.path.join(run_dir, BASIS_FILE)):
        return load(run_dir, boundary_layers(n, cfg.mesh.stages, cfg.mesh.layers_per_stage))
    codec = codec_of(cfg)
    rows = calibration_rows(train_rows, codec.calib_rows, cfg.train.seed)
    return fit_layer_bases(model, rows, codec, _run_layers(cfg, n), grad_rows=codec.grad_rows)


_ATTACHED: list = []  # (codec, its replica's boundary layers) of every codec ``attach`` gave a view


def install(bases: dict[int, PCABasis]) -> None:
    """Make ``bases`` (the run's, {boundary layer: basis}) this process's codecs.PCA_BASES,
    and every attached codec's view of them (an elastic replica that adopts its peers'
    bases after attach: orchestration.elastic.calibrated)."""
    codecs.PCA_BASES.clear()
    codecs.PCA_BASES.update(bases)
    for codec, layers in _ATTACHED:
        codec.bases = for_split(codecs.PCA_BASES, layers)


def for_split(bases: dict[int, PCABasis], layers) -> dict[int, PCABasis]:
    """{stage boundary b: basis}: the view of {boundary layer: basis} ``bases`` for a split
    whose boundary b sits after ``layers[b]`` (``boundary_layers``): what its codec holds."""
    missing = [L for L in layers if L not in bases]
    if missing:
        raise ValueError(f"pca: no basis for the boundary after decoder layer {missing[0]} (the bases are for "
                         f"the boundaries after layers {sorted(bases)}: fitted for another split)")
    return {b: bases[L] for b, L in enumerate(layers)}


def save(bases: dict[int, PCABasis], run_dir: str) -> str:
    """RUN_DIR/pca_basis.pt: ``{"after_layer": {L: PCABasis.state_dict()}}``."""
    path = os.path.join(run_dir, BASIS_FILE)
    os.makedirs(run_dir, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"  # local elastic replicas fit at once and write to one run folder
    torch.save({"after_layer": {int(L): v.state_dict() for L, v in bases.items()}}, tmp)
    os.replace(tmp, path)
    return path


def read(path: str, layers=None) -> dict[int, PCABasis]:
    """{boundary layer: basis} from a basis file. A file from before layer keys holds
    {stage boundary b: basis} of one homogeneous split: ``layers`` (that split's
    ``boundary_layers``) names its boundaries; ValueError without it."""
    sd = torch.load(path, map_location="cpu", weights_only=True)
    if "after_layer" in sd:
        sd = sd["after_layer"]
    else:  # keyed by stage boundary
        if layers is None or len(layers) < len(sd) or any(int(b) >= len(layers) for b in sd):
            raise ValueError(f"{path}: bases keyed by stage boundary {sorted(int(b) for b in sd)}; the run's split "
                             f"(its boundary layers) is needed to read them, got {layers}")
        sd = {layers[int(b)]: v for b, v in sd.items()}
    return {int(L): PCABasis(**v) for L, v in sd.items()}  # (Ug, bits/gbits, elem only where fitted with them)


def load(run_dir: str, layers=None) -> dict[int, PCABasis]:
    """``read`` RUN_DIR/pca_basis.pt."""
    return read(os.path.join(run_dir, BASIS_FILE), layers)


def load_split(run_dir: str, num_layers: int, num_stages: int, layers_per_stage=None) -> dict[int, PCABasis]:
    """{stage boundary b: basis} of RUN_DIR/pca_basis.pt for the trainer's split of
    ``num_stages`` stages (what a codec of that split holds: ``for_split``)."""
    layers = boundary_layers(num_layers, num_stages, layers_per_stage)
    return for_split(load(run_dir, layers), layers)


def prepare_run(cfg, plan) -> None:
    """train.prepare (launcher process, model loaded, before the ranks fork): fit (or load)
    the run's bases and install them, so that forked ranks inherit them. No-op for other
    codecs or without a loaded model (torchrun / spawn: ``attach`` does it)."""
    if codec_of(cfg) is None or getattr(plan, "model", None) is None:
        return
    install(bases_for_run(cfg, plan.model, plan.train_rows, plan.run_dir))


def _calibrating_ranks(cfg, mesh) -> list[int]:
    """The ranks of this rank's world that call ``attach``: an elastic replica's world is
    the replica; the fast circuit's holds every ``calibrating_rows`` replica's ranks."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [0]
    if mesh.elastic:
        return list(range(dist.get_world_size()))
    return [r for row in calibrating_rows(cfg) for r in mesh.layout.pp_ranks(row)]


def attach(codec, cfg, plan, mesh, counter) -> None:
    """Every fast rank whose replica uses the codec, in Trainer.__init__: make sure this
    process holds the run's bases (inherited, or fitted/loaded by the first calibrating
    rank of its world and broadcast to the others as tensors, never pickled), have that
    rank store them in RUN_DIR, give ``codec`` this replica's view of them (``for_split``)
    and count the basis this rank sends once on its pp_fwd link (``counter``)."""
    import torch.distributed as dist

    if not codec.needs_calibration:
        return
    layers = run_boundary_layers(cfg, plan.num_layers)
    need = {L for mine in layers.values() for L in mine}
    distributed = dist.is_available() and dist.is_initialized()
    members = _calibrating_ranks(cfg, mesh)
    # The rank that fits or loads them: the first calibrating rank of this rank's world (the
    # fast circuit's, or an elastic replica's own world, where the whole mesh's rank 0 may
    # live on another host).
    source = not distributed or dist.get_rank() == members[0]
    if not need <= set(codecs.PCA_BASES):  # the same on every calibrating rank: all inherited, or none
        named = None
        if source:
            from orchestration.models.loading import load_causal_lm

            if os.path.isfile(os.path.join(plan.run_dir, BASIS_FILE)):
                bases = load(plan.run_dir, boundary_layers(plan.num_layers, cfg.mesh.stages, cfg.mesh.layers_per_stage))
            else:
                model, _ = load_causal_lm(plan.model_path, dtype=getattr(torch, cfg.model.dtype), boundary=False)
                bases = bases_for_run(cfg, model, plan.train_rows)
                del model
            named = {f"{L}.{k}": v for L, basis in bases.items() for k, v in basis.state_dict().items()}
        if distributed and len(members) > 1:
            from orchestration.distributed.tensor_broadcast import broadcast_tensors

            group = None if len(members) == dist.get_world_size() else \
                dist.new_group(members, use_local_synchronization=True)  # (the others never call attach)
            named = broadcast_tensors(named, src=members[0], group=group, device=mesh.device)
        install(_bases_from_named(named))
    if source and not os.path.isfile(os.path.join(plan.run_dir, BASIS_FILE)):
        save({L: codecs.PCA_BASES[L] for L in sorted(need)}, plan.run_dir)
    codec.bases = for_split(codecs.PCA_BASES, layers.get(mesh.row, []))
    _ATTACHED[:] = [(codec, layers.get(mesh.row, []))]  # one trainer per process
    if not mesh.is_last:
        counter.add("pp_fwd", mesh.rank, mesh.next_rank, codec.one_off_bytes(mesh.stage))


def _bases_from_named(named: dict[str, torch.Tensor]) -> dict[int, PCABasis]:
    """{boundary layer: PCABasis} from flat "<layer>.<field>" tensors (PCABasis checks each one)."""
    per: dict[int, dict] = {}
    for key, t in named.items():
        b, _, field = key.partition(".")
        per.setdefault(int(b), {})[field] = t
    return {b: PCABasis(**v) for b, v in per.items()}
