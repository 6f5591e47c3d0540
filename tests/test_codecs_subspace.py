"""The subspace codec (orchestration/codecs/subspace.py) and the constraint that makes it
exact (orchestration/subspace/constraint.py), on the default small Llama with random weights: the
reference is the unsplit constrained model run by transformers itself."""
import copy

import pytest
import torch

from meshkern import MaskKey
from orchestration.codecs import NonFiniteWire, apply_codec, make_codec
from orchestration.codecs.subspace import SubspaceCodec, subspace_width
from orchestration.models.loading import default_config
from orchestration.distributed.stages import causal_lm_loss, split_model
from orchestration.subspace.constraint import (constrain_, constrained_names, is_constrained, make_basis, make_projector,
                                    project_tensor, violation)

V, H, K = 256, 192, 12
KEY = MaskKey(seed=0, boundary=0, step=0, microbatch=0)


def _model(seed=0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(default_config(vocab_size=V)).eval()


def _ids(seed=1, B=2, T=16):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def _codec(model, U, ids_per_mb, **kw):
    codec = make_codec("subspace", k=U.shape[1], **kw)
    codec.attach(model.model.embed_tokens.weight, U)
    codec.bind_inputs(ids_per_mb)
    return codec


def _split_run(model, U, ids, **kw):
    """stage 0 -> codec round trip -> stage 1 on a copy of ``model``; returns (logits,
    {unsplit name: grad}) after backward of the unsplit model's loss."""
    stages = split_model(copy.deepcopy(model), 2)
    codec = _codec(model, U, [ids], **kw)
    logits = stages[1](apply_codec(codec, stages[0](ids), KEY))
    causal_lm_loss(logits, ids).backward()
    grads = {n: p.grad for s in stages for n, p in s.hf_named_parameters()}
    return logits.detach(), grads


def _reference(model, ids):
    model = copy.deepcopy(model)
    logits = model(ids).logits
    causal_lm_loss(logits, ids).backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_constrained_model_round_trip_is_exact_logits_and_gradients():
    model = _model()
    U = make_basis(H, K, seed=3)
    assert violation(model, U) > 0.9  # random weights: ~sqrt(1 - k/H) of each outside span(U)
    names = constrain_(model, U)
    assert len(names) == 2 * model.config.num_hidden_layers  # o_proj + down_proj per layer, no biases
    assert violation(model, U) < 1e-6
    ids = _ids()
    want_logits, want = _reference(model, ids)
    logits, got = _split_run(model, U, ids)
    torch.testing.assert_close(logits, want_logits, atol=2e-5, rtol=1e-5)
    layers_stage0 = split_model(copy.deepcopy(model), 2)[0].layer_range[1]
    checked = 0
    for name, g in got.items():
        if "embed_tokens" in name:
            continue  # frozen in this mode: the boundary does not carry its gradient
        ref = want[name]
        upstream = name.startswith("model.layers.") and int(name.split(".")[2]) < layers_stage0
        if upstream and is_constrained(name):
            # The receiver sends U^T g: an upstream output projection's gradient misses
            # (I - U U^T) g_boundary a^T, which the constraint removes from any update:
            # they agree after the projection U U^T (and differ before it).
            assert (g - ref).abs().max() > 1e-6, name
            g, ref = project_tensor(name, g, U), project_tensor(name, ref, U)
        torch.testing.assert_close(g, ref, atol=1e-6, rtol=1e-4, msg=name)
        checked += 1
    assert checked == sum(1 for n, _ in model.named_parameters() if "embed_tokens" not in n)


def test_unconstrained_model_is_not_reproduced():
    # Without the constraint the residual stream leaves span(U): the codec is lossy.
    model = _model()
    U = make_basis(H, K, seed=3)
    ids = _ids()
    want_logits, _ = _reference(model, ids)
    logits, _ = _split_run(model, U, ids)
    assert (logits - want_logits).abs().max() > 1e-2


def test_microbatch_picks_its_own_ids():
    model = _model()
    U = make_basis(H, K, seed=3)
    constrain_(model, U)
    a, b = _ids(1), _ids(2)
    stages = split_model(copy.deepcopy(model), 2)
    codec = _codec(model, U, [a, b])
    with torch.no_grad():
        for m, ids in enumerate((a, b)):
            h = stages[0](ids)
            key = MaskKey(seed=0, boundary=0, step=5, microbatch=m)
            wire, _ = codec.encode_fwd(h, key)
            torch.testing.assert_close(codec.decode_fwd(wire, key, h.shape, h.dtype), h, atol=2e-6, rtol=0)
        wrong = MaskKey(seed=0, boundary=0, step=5, microbatch=0)  # b's activation with a's ids
        assert (codec.decode_fwd(codec.encode_fwd(h, wrong)[0], wrong, h.shape, h.dtype) - h).abs().max() > 1e-3


@pytest.mark.parametrize("bits,gbits", [(32, 32), (16, 16), (8, 8), (4, 16)])
def test_wire_bytes_are_the_wire_tensors_bytes(bits, gbits):
    codec = SubspaceCodec(bits=bits, gbits=gbits)
    k = codec.width(H)
    g = torch.Generator().manual_seed(0)
    codec.attach(torch.randn(V, H, generator=g), torch.linalg.qr(torch.randn(H, k, generator=g))[0])
    ids = _ids()
    codec.bind_inputs([ids])
    h = torch.randn(*ids.shape, H, generator=g)
    wire, ctx = codec.encode_fwd(h, KEY)
    wire_b = codec.encode_bwd(torch.randn(h.shape, generator=g), KEY, wire)
    for direction, w in (("fwd", wire), ("bwd", wire_b)):
        assert codec.wire_bytes(h.shape, h.dtype, direction) == sum(t.numel() * t.element_size() for t in w)
        specs = codec.wire_specs(h.shape, h.dtype, direction)
        assert [(tuple(t.shape), t.dtype) for t in w] == [(tuple(s), d) for s, d in specs]
    # the default budget is 1/16 of dense fp32: 4 H / 16 = 48 bytes per token at H = 192
    assert codec.wire_bytes((2, 16, H), torch.float32, "fwd") == 2 * 16 * 48


def test_width_known_answers():
    assert subspace_width(192) == 12 and subspace_width(576) == 36 and subspace_width(576, budget=32) == 18
    assert subspace_width(192, bits=16) == 24  # 48 bytes = 24 bf16
    assert subspace_width(192, bits=8) == 44  # 44 codes + 4-byte scale = 48
    assert subspace_width(192, bits=4) == 88  # ceil(88 * 4 / 8) + 4 = 48
    assert SubspaceCodec(k=20).width(192) == 20


def test_quantized_coordinates_error_is_bounded():
    # bits=8: each coordinate off by at most absmax/(2*127) of its token.
    codec = SubspaceCodec(k=K, bits=8)
    g = torch.Generator().manual_seed(0)
    E = torch.randn(V, H, generator=g)
    U = torch.linalg.qr(torch.randn(H, K, generator=g))[0]
    codec.attach(E, U)
    ids = _ids()
    codec.bind_inputs([ids])
    c = torch.randn(*ids.shape, K, generator=g)
    h = E[ids] + c @ U.T
    h_hat = codec.decode_fwd(codec.encode_fwd(h, KEY)[0], KEY, h.shape, h.dtype)
    err = (h_hat - h).norm(dim=-1)
    bound = K ** 0.5 * c.abs().amax(-1) / 254 + 1e-5
    assert (err <= bound).all() and err.max() > 0


def test_garbage_and_misuse_raise():
    codec = SubspaceCodec(k=K)
    h = torch.randn(2, 16, H)
    with pytest.raises(RuntimeError, match="attach"):
        codec.encode_fwd(h, KEY)
    g = torch.Generator().manual_seed(0)
    E = torch.randn(V, H, generator=g)
    U = torch.linalg.qr(torch.randn(H, K, generator=g))[0]
    codec.attach(E, U)
    with pytest.raises(RuntimeError, match="bind_inputs"):
        codec.encode_fwd(h, KEY)
    codec.bind_inputs([_ids()])
    with pytest.raises(RuntimeError, match="micro-batch 3"):
        codec.encode_fwd(h, MaskKey(seed=0, boundary=0, step=0, microbatch=3))
    with pytest.raises(ValueError, match="bound input ids"):
        codec.encode_fwd(h[:, :8], KEY)
    wire, ctx = codec.encode_fwd(h, KEY)
    bad = [wire[0].clone()]
    bad[0][0, 0, 0] = float("nan")
    with pytest.raises(NonFiniteWire):
        codec.decode_fwd(bad, KEY, h.shape, h.dtype)
    with pytest.raises(ValueError, match="wire tensor 0"):
        codec.decode_fwd([wire[0][..., :-1]], KEY, h.shape, h.dtype)
    grad = torch.randn(h.shape)
    grad[1, 3] = float("inf")
    with pytest.raises(NonFiniteWire):
        codec.decode_bwd(codec.encode_bwd(grad, KEY, wire), KEY, ctx)
    codec.bind_inputs([torch.full((2, 16), V)])  # an id outside the table
    with pytest.raises(ValueError, match=r"\[0, V=256\)"):
        codec.encode_fwd(h, KEY)
    with pytest.raises(ValueError, match="k=5 columns"):
        codec.attach(E, U[:, :5])
    with pytest.raises(ValueError, match="orthonormal"):
        codec.attach(E, 2 * U)
    with pytest.raises(ValueError, match="not both"):
        SubspaceCodec(k=4, budget=8)
    with pytest.raises(ValueError, match="bits"):
        SubspaceCodec(bits=12)
    with pytest.raises(TypeError, match="does not take"):
        make_codec("subspace", rank=3)


def test_basis_and_projection_helpers():
    U = make_basis(H, K, seed=3)
    assert U.shape == (H, K) and U.dtype == torch.float32
    torch.testing.assert_close(U.T @ U, torch.eye(K), atol=1e-6, rtol=0)
    assert torch.equal(U, make_basis(H, K, seed=3)) and not torch.equal(U, make_basis(H, K, seed=4))
    with pytest.raises(ValueError, match="1 <= k <= H"):
        make_basis(H, H + 1)

    # names: a Stage's own and the unsplit model's
    assert is_constrained("model.layers.3.self_attn.o_proj.weight") and is_constrained("layers.0.mlp.down_proj.bias")
    assert not is_constrained("model.layers.3.mlp.up_proj.weight") and not is_constrained("model.embed_tokens.weight")
    t = torch.randn(H, 40)
    assert project_tensor("model.layers.0.mlp.up_proj.weight", t, U) is t
    P = U.double() @ U.double().T
    torch.testing.assert_close(project_tensor("model.layers.3.self_attn.o_proj.weight", t, U).double(), P @ t.double(),
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(make_projector(U)("model.layers.1.mlp.down_proj.bias", t[:, 0]).double(),
                               P @ t[:, 0].double(), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="does not start with U's H"):
        project_tensor("model.layers.3.self_attn.o_proj.weight", t.T, U)

    # a Stage: only its own layers' output projections, under its own names
    model = _model()
    stages = split_model(model, 2)
    names = constrained_names(stages[1])
    assert names and all(n.startswith("layers.") for n in names)
    before0 = violation(stages[0], U)
    constrain_(stages[1], U)
    assert violation(stages[1], U) < 1e-6 and violation(stages[0], U) == before0 > 0.9

    # fitted basis: for a model constrained to U0, the fitted k-dim subspace is span(U0)
    model = _model(seed=2)
    U0 = make_basis(H, K, seed=9)
    constrain_(model, U0)
    Uf = make_basis(H, K, model=model)
    torch.testing.assert_close(Uf.T @ Uf, torch.eye(K), atol=1e-5, rtol=0)
    assert float((Uf.double() @ Uf.double().T - U0.double() @ U0.double().T).norm()) < 1e-4
    assert violation(model, Uf) < 1e-4
    assert torch.equal(Uf, make_basis(H, K, model=split_model(model, 2)))  # same from the stages


# ------------------------------------------------------- a real pipeline (spawned gloo mesh)
PIPE_S, PIPE_M, PIPE_STEP = 3, 4, 7  # 3 stages: a middle one receives and sends


def _pipe_worker(rank, world, model, ids, E, U):
    from orchestration.distributed.mesh import MeshLayout, destroy_mesh, init_mesh
    from orchestration.distributed.link_counter import LinkCounter
    from orchestration.distributed.pipeline import PipelineExecutor
    from orchestration.distributed.schedule import make_schedule

    mesh = init_mesh(MeshLayout(1, PIPE_S), timeout_s=30)
    stage = split_model(model, PIPE_S)[rank]
    codec = make_codec("subspace", k=U.shape[1])
    codec.attach(E, U)  # every rank, the receivers too: they re-add E[ids]
    counter = LinkCounter()
    pipe = PipelineExecutor(stage, make_schedule("1f1b", PIPE_S, PIPE_M)[rank], codec=codec,
                            prev_rank=mesh.prev_rank, next_rank=mesh.next_rank, rank=rank, seed=1, counter=counter)
    stats = pipe.step(PIPE_STEP, ids, num_microbatches=PIPE_M)  # calls codec.bind_inputs
    grads = {n: p.grad.clone() for n, p in stage.hf_named_parameters() if p.grad is not None}
    destroy_mesh()
    return {"loss": stats.loss, "grads": grads, "links": dict(counter.links), "rejected": stats.rejected}


@pytest.mark.slow
def test_pipeline_executor_with_the_subspace_codec_equals_the_unsplit_model():
    from orchestration.launch.processes import run_local

    model = _model()
    U = make_basis(H, K, seed=3)
    constrain_(model, U)
    model.model.embed_tokens.weight.requires_grad_(False)  # frozen in this mode
    ids = _ids(seed=4, B=8, T=16)
    E = model.model.embed_tokens.weight.detach().clone()
    res = run_local(_pipe_worker, PIPE_S, (model, ids, E, U), timeout_s=180)
    ref = copy.deepcopy(model)
    ref_loss = causal_lm_loss(ref(ids).logits, ids)
    ref_loss.backward()
    assert res[-1]["loss"] == pytest.approx(ref_loss.item(), rel=1e-5)
    assert all(r["rejected"] == 0 for r in res)
    mb = ids.shape[0] // PIPE_M
    for b in range(PIPE_S - 1):  # k fp32 values per token, per boundary and direction
        assert res[b]["links"][("pp_fwd", b, b + 1)] == PIPE_M * mb * ids.shape[1] * K * 4
        assert res[b + 1]["links"][("pp_bwd", b + 1, b)] == PIPE_M * mb * ids.shape[1] * K * 4
    grads = {n: g for r in res for n, g in r["grads"].items()}
    named = dict(ref.named_parameters())
    assert set(grads) == {n for n, p in named.items() if p.requires_grad}
    last_upstream = split_model(copy.deepcopy(model), PIPE_S)[-2].layer_range[1]
    for n, g in grads.items():
        want = named[n].grad
        if is_constrained(n) and int(n.split(".")[2]) < last_upstream:
            g, want = project_tensor(n, g, U), project_tensor(n, want, U)
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6, msg=n)
