"""The pipeline executor on spawned gloo meshes vs the unsplit model in one process."""
import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import meshkern
from meshkern.mask import MaskKey, kept_dims
from orchestration.codecs import make_codec
from orchestration.launch.processes import run_local
from orchestration.distributed.mesh import MeshLayout, destroy_mesh, init_mesh
from orchestration.distributed.link_counter import LinkCounter
from orchestration.distributed.pipeline import PipelineExecutor
from orchestration.distributed.schedule import make_schedule
from orchestration.distributed.stages import causal_lm_loss, split_model

S, M, B, T, H = 3, 4, 8, 16, 40   # 3 stages (a middle one too), 4 micro-batches of 2
SEED, STEP = 1234, 7


def tiny_model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=H, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).float()


def _worker(rank, world, model, ids, codec_name, p, kind):
    mesh = init_mesh(MeshLayout(1, S), timeout_s=30)
    stage = split_model(model, S)[rank]
    counter = LinkCounter()
    codec = make_codec(codec_name, p=p)
    pipe = PipelineExecutor(stage, make_schedule(kind, S, M)[rank], codec=codec, prev_rank=mesh.prev_rank,
                            next_rank=mesh.next_rank, rank=rank, seed=SEED, counter=counter)
    stats = pipe.step(STEP, ids, num_microbatches=M)
    grads = {n: p.grad.clone() for n, p in stage.hf_named_parameters()}
    destroy_mesh()
    return {"loss": stats.loss, "grads": grads, "links": dict(counter.links)}


def _gather(results):
    grads = {}
    for r in results:
        grads.update(r["grads"])
    return grads, results[-1]["loss"]


@pytest.mark.slow
def test_dense_pipeline_equals_unsplit_model():
    model = tiny_model()
    ids = torch.randint(0, 96, (B, T), generator=torch.Generator().manual_seed(1))
    res = run_local(_worker, S, (model, ids, "dense", 0.0, "1f1b"), timeout_s=120)
    grads, loss = _gather(res)
    ref = copy.deepcopy(model)
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    assert loss == pytest.approx(ref_loss.item(), rel=1e-5, abs=1e-6)
    named = dict(ref.named_parameters())
    assert set(grads) == set(named)
    for n, g in grads.items():
        torch.testing.assert_close(g, named[n].grad, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.slow
def test_masked_pipeline_bytes_and_grads_match_masked_reference():
    p = 0.95 if H >= 40 else 0.9
    K = kept_dims(H, p)
    model = tiny_model()
    ids = torch.randint(0, 96, (B, T), generator=torch.Generator().manual_seed(2))
    res = run_local(_worker, S, (model, ids, "mask", p, "gpipe"), timeout_s=120)
    grads, loss = _gather(res)

    # Byte counters: exactly T*K*4 bytes per sequence, per boundary, per direction, per micro-batch.
    mb = B // M
    for b in range(S - 1):
        assert res[b]["links"][("pp_fwd", b, b + 1)] == M * mb * T * K * 4
        assert res[b + 1]["links"][("pp_bwd", b + 1, b)] == M * mb * T * K * 4
    assert sum(len(r["links"]) for r in res) == 2 * (S - 1)

    # Reference: the unsplit model's layers in one process, the same Philox masks applied
    # with meshkern.pack/unpack at each boundary, keyed by (seed, boundary, step, micro-batch).
    ref = copy.deepcopy(model)
    stages = split_model(ref, S)
    n_items = ids[:, 1:].numel()
    total = 0.0
    for m, x in enumerate(ids.chunk(M)):
        h = x
        for i, st in enumerate(stages):
            h = st(h)
            if i < S - 1:
                key = MaskKey(SEED, i, STEP, m)
                h = meshkern.unpack(meshkern.pack(h, key, p), key, H, p)
        l = causal_lm_loss(h, x, num_items_in_batch=n_items)
        l.backward()
        total += l.item()
    assert loss == pytest.approx(total, rel=1e-5)
    named = dict(ref.named_parameters())
    for n, g in grads.items():
        torch.testing.assert_close(g, named[n].grad, rtol=1e-4, atol=1e-6, msg=n)
    # and masking did change the gradients (the test can fail)
    dense = copy.deepcopy(model)
    dense(input_ids=ids, labels=ids).loss.backward()
    w = "model.layers.0.mlp.down_proj.weight"
    assert not torch.allclose(dict(dense.named_parameters())[w].grad, grads[w], atol=1e-5)


def _staged_worker(rank, world, model, ids):
    """_worker with the executor's CPU staging forced on (what ranks sharing a GPU over gloo
    run; on CPU the copies are no-ops, so the result must be the unstaged one exactly)."""
    mesh = init_mesh(MeshLayout(1, S), timeout_s=30)
    stage = split_model(model, S)[rank]
    pipe = PipelineExecutor(stage, make_schedule("1f1b", S, M)[rank], codec=make_codec("int4"), prev_rank=mesh.prev_rank,
                            next_rank=mesh.next_rank, rank=rank, seed=SEED, counter=LinkCounter())
    assert pipe.via_cpu is False  # CPU tensors over gloo: no staging unless forced
    pipe.via_cpu = True
    stats = pipe.step(STEP, ids, num_microbatches=M)
    grads = {n: p.grad.clone() for n, p in stage.hf_named_parameters()}
    destroy_mesh()
    return {"loss": stats.loss, "grads": grads}


@pytest.mark.slow
def test_cpu_staged_p2p_equals_direct_p2p():
    model = tiny_model()
    ids = torch.randint(0, 96, (B, T), generator=torch.Generator().manual_seed(1))
    staged = _gather(run_local(_staged_worker, S, (model, ids), timeout_s=120))
    direct = _gather(run_local(_worker, S, (model, ids, "int4", 0.0, "1f1b"), timeout_s=120))
    assert staged[1] == direct[1]
    for n, g in staged[0].items():
        assert torch.equal(g, direct[0][n]), n
