"""The MoE router's load-balancing loss across pipeline stages on spawned gloo ranks
(orchestration.distributed.pipeline with output_router_logits on): the gradients of every
stage equal the unsplit model's, whose loss over M equal micro-batches is the mean of
transformers' own per-micro-batch loss (cross-entropy + coef x aux), as gradient
accumulation gives."""
from __future__ import annotations

import copy

import pytest
import torch

from family_models import MOE, tiny_model
from orchestration.codecs import make_codec
from orchestration.distributed.link_counter import LinkCounter
from orchestration.distributed.mesh import MeshLayout, destroy_mesh, init_mesh
from orchestration.distributed.pipeline import PipelineExecutor
from orchestration.distributed.schedule import make_schedule
from orchestration.distributed.stages import split_model
from orchestration.launch.processes import run_local

S, B, T = 2, 4, 12


def _worker(rank, world, model, ids, M, kind):
    mesh = init_mesh(MeshLayout(1, S), timeout_s=60)
    try:
        stage = split_model(model, S)[rank]
        counter = LinkCounter()
        pipe = PipelineExecutor(stage, make_schedule(kind, S, M)[rank], codec=make_codec("dense"),
                                prev_rank=mesh.prev_rank, next_rank=mesh.next_rank, rank=rank, seed=1,
                                counter=counter)
        pipe.step(0, ids, num_microbatches=M)
        return {"grads": {n: p.grad.clone() for n, p in stage.hf_named_parameters() if p.grad is not None},
                "links": dict(counter.links)}
    finally:
        destroy_mesh()


@pytest.mark.slow
@pytest.mark.parametrize("family,M,kind", [("mixtral", 1, "gpipe"), ("mixtral", 2, "1f1b"), ("qwen3_moe", 2, "gpipe")])
def test_router_loss_gradients_follow_the_unsplit_model(family, M, kind):
    assert family in MOE
    model = tiny_model(family, output_router_logits=True, router_aux_loss_coef=0.5)
    ids = torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(3))
    res = run_local(_worker, S, (model, ids, M, kind), timeout_s=180)
    grads = {n: g for r in res for n, g in r["grads"].items()}
    ref = copy.deepcopy(model)
    loss = sum(ref(input_ids=mb, labels=mb).loss for mb in ids.chunk(M)) / M
    loss.backward()
    with_aux = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    routers = [n for n in with_aux if "gate" in n and "proj" not in n]
    assert routers and all(n in grads for n in routers)
    for n, g in grads.items():
        torch.testing.assert_close(g, with_aux[n], rtol=1e-4, atol=1e-6, msg=n)
    # the router loss is there at all: without it the routers' gradients differ
    ref2 = copy.deepcopy(model)
    ref2.config.output_router_logits = False
    (sum(ref2(input_ids=mb, labels=mb).loss for mb in ids.chunk(M)) / M).backward()
    assert any(not torch.allclose(dict(ref2.named_parameters())[n].grad, with_aux[n]) for n in routers)
    # the totals travel: E + 1 fp32 values per micro-batch and direction beside the dense wire
    E = model.config.num_local_experts if family == "mixtral" else model.config.num_experts
    dense = (B // M) * T * model.config.hidden_size * 4
    assert res[0]["links"][("pp_fwd", 0, 1)] == M * (dense + (E + 1) * 4)
    assert res[1]["links"][("pp_bwd", 1, 0)] == M * (dense + (E + 1) * 4)
