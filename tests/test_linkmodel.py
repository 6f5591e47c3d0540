"""Link model against timelines computed by hand for tiny schedules."""
import pytest

from orchestration.distributed.linkmodel import (LinkSpec, model_step, replay, ring_allreduce_bytes, ring_allreduce_s,
                                     simulate)
from orchestration.distributed.schedule import Action, make_schedule

L = LinkSpec(200e6)  # 25e6 bytes take exactly 1 s
ONE_S = 25e6


def _msg(tl, kind, src, mb):
    return next(m for m in tl.messages if m[0] == kind and m[1] == src and m[3] == mb)


def test_linkspec_defaults_and_validation():
    assert L.wire_s(ONE_S) == 1.0 and LinkSpec().bandwidth_bps == 200e6
    with pytest.raises(ValueError, match="bandwidth"):
        LinkSpec(0)
    with pytest.raises(ValueError, match="latency"):
        LinkSpec(1e6, -1)


def test_two_stages_one_microbatch():
    # s0 F [0,1] -> wire [1,2] -> s1 F [2,3], B [3,5] -> wire [5,6] -> s0 B [6,8]
    sched = make_schedule("gpipe", 2, 1)
    ct, mb = {"F": 1.0, "B": 2.0}, {"F": ONE_S, "B": ONE_S}
    tl = simulate(sched, ct, mb, L)
    assert tl.step_s == pytest.approx(8.0)
    assert [(s, repr(a), t0, t1) for s, a, t0, t1 in tl.actions] == [
        (0, "F0", 0.0, 1.0), (1, "F0", 2.0, 3.0), (1, "B0", 3.0, 5.0), (0, "B0", 6.0, 8.0)]
    assert tl.compute_s == [3.0, 3.0]
    assert tl.bytes_by_kind() == {"F": ONE_S, "B": ONE_S}
    # latency: a node-topology path crosses two access links, a pair link one
    lat = LinkSpec(200e6, 0.1)
    assert replay(sched, ct, mb, lat) == pytest.approx(8.4)
    assert replay(sched, ct, mb, lat, topology="pair") == pytest.approx(8.2)


def test_gpipe_two_microbatches_overlap():
    # transfers 0.5 s; s0 F0[0,1] F1[1,2]; s1 F0[1.5,2.5] F1[2.5,3.5] B0[3.5,4.5] B1[4.5,5.5];
    # grads arrive at s0 at 5 and 6: B0[5,6] B1[6,7]
    tl = simulate(make_schedule("gpipe", 2, 2), {"F": 1.0, "B": 1.0}, {"F": ONE_S / 2, "B": ONE_S / 2}, L)
    assert tl.step_s == pytest.approx(7.0)
    starts = {(s, repr(a)): t0 for s, a, t0, _ in tl.actions}
    assert starts == pytest.approx({(0, "F0"): 0, (0, "F1"): 1, (1, "F0"): 1.5, (1, "F1"): 2.5,
                                    (1, "B0"): 3.5, (1, "B1"): 4.5, (0, "B0"): 5, (0, "B1"): 6})


def test_messages_queue_on_a_busy_link():
    # compute 0.1 s, transfers 1 s: the second activation waits for the first on the wire
    tl = simulate(make_schedule("gpipe", 2, 2), {"F": 0.1, "B": 0.1}, {"F": ONE_S, "B": ONE_S}, L)
    assert _msg(tl, "F", 0, 1)[6] == pytest.approx(1.1)  # ready at 0.2, starts when msg 0 is done
    assert tl.step_s == pytest.approx(4.4)
    assert tl.busy_s[("up", 0)] == pytest.approx(2.0) and tl.busy_s[("down", 0)] == pytest.approx(2.0)
    assert tl.bytes[("up", 1)] == 2 * ONE_S


def test_node_topology_shares_the_middle_downlink():
    # S=3, M=2, 1F1B, zero compute. Boundary 0 forward messages take 2 s, all others 1 s.
    # pair links: s2's grad for mb 0 leaves at 3 on its own link. Node links: the middle
    # node's downlink is still receiving activation 1 (2 s..4 s), so the grad waits to 4.
    sched = make_schedule("1f1b", 3, 2)
    ct = {"F": 0.0, "B": 0.0}
    mb = {"F": [2 * ONE_S, ONE_S], "B": [ONE_S, ONE_S]}
    pair = simulate(sched, ct, mb, L, topology="pair")
    node = simulate(sched, ct, mb, L, topology="node")
    assert _msg(pair, "B", 2, 0)[6] == pytest.approx(3.0)
    assert _msg(node, "B", 2, 0)[6] == pytest.approx(4.0)
    # hand timelines: s0's backwards start at 5 and 7 (pair) vs 6 and 7 (node)
    b0 = {name: {repr(a): t0 for s, a, t0, _ in tl.actions if s == 0 and a.kind == "B"}
          for name, tl in (("pair", pair), ("node", node))}
    assert b0 == {"pair": pytest.approx({"B0": 5.0, "B1": 7.0}), "node": pytest.approx({"B0": 6.0, "B1": 7.0})}
    assert pair.step_s == pytest.approx(7.0) and node.step_s == pytest.approx(7.0)


def test_single_stage_and_per_stage_compute():
    assert replay(make_schedule("1f1b", 1, 3), {"F": 1.0, "B": 2.0}, {"F": 0, "B": 0}) == pytest.approx(9.0)
    # stage-specific compute via callable: the slow stage sets the pace (1F1B steady state)
    ct = lambda s, a: (3.0 if s == 1 else 1.0) * (2 if a.kind == "B" else 1)  # noqa: E731
    t = replay(make_schedule("1f1b", 2, 4), ct, {"F": 0, "B": 0})
    # s0 F0[0,1]; s1 runs F,B for 4 micro-batches back to back from t=1: 4*9 = 36 -> 37;
    # s0's last B (2 s) starts when s1's B3 ends at 37
    assert t == pytest.approx(39.0)


def test_bad_inputs():
    s = make_schedule("gpipe", 2, 1)
    with pytest.raises(TypeError, match="compute_times"):
        replay(s, 1.0, {"F": 0, "B": 0})
    with pytest.raises(ValueError, match="2 numbers"):
        replay(s, {"F": [1, 2, 3], "B": 1}, {"F": 0, "B": 0})
    with pytest.raises(ValueError, match="links"):
        replay(s, {"F": 1, "B": 1}, {"F": 0, "B": 0}, [L, L, L])
    with pytest.raises(ValueError, match="deadlock|exactly once"):
        replay([[Action("B", 0), Action("F", 0)], s[1]], {"F": 1, "B": 1}, {"F": 0, "B": 0})
    with pytest.raises(ValueError, match="topology"):
        replay(s, {"F": 1, "B": 1}, {"F": 0, "B": 0}, topology="mesh")


def test_ring_allreduce():
    assert ring_allreduce_bytes(100.0, 4) == 150.0
    assert ring_allreduce_s(ONE_S, 4, LinkSpec(200e6, 0.01)) == pytest.approx(1.5 + 0.06)
    assert ring_allreduce_s(ONE_S, 1) == 0.0


def test_model_step_blocking_dp_adds_the_allreduce():
    sched = make_schedule("gpipe", 2, 1)
    ct, mb = {"F": 1.0, "B": 2.0}, {"F": ONE_S, "B": ONE_S}
    m = model_step(sched, ct, mb, L, replicas=4, tokens_per_replica=1000, dp_payload_bytes=[ONE_S, 2 * ONE_S],
                   dp_blocking=True)
    assert m.pipeline_s == pytest.approx(8.0)
    assert m.step_s == pytest.approx(8.0 + 3.0)  # stage 1's 2x payload: 1.5 * 2 s
    assert m.limiting == "dp (blocking)"
    assert m.tokens == 4000 and m.tokens_per_s == pytest.approx(4000 / 11.0)
    assert m.bytes == pytest.approx({"pp_fwd": 4 * ONE_S, "pp_bwd": 4 * ONE_S, "dp": 4 * 1.5 * 3 * ONE_S, "anchor": 0,
                                   "tied": 0})
    assert m.bytes_per_token["total"] == pytest.approx(sum(m.bytes.values()) / 4000)


def test_model_step_tied_embedding_allreduce_blocks_after_the_pipeline():
    """A tied embedding split over first and last stage: both send its gradient every step
    before the optimizer step, so its wire time adds to the step; it dominates when larger."""
    sched = make_schedule("gpipe", 2, 1)
    ct, mb = {"F": 1.0, "B": 2.0}, {"F": ONE_S, "B": ONE_S}  # pipeline 8 s
    m = model_step(sched, ct, mb, L, replicas=3, tokens_per_replica=100, tied_bytes=2 * ONE_S)
    assert m.step_s == pytest.approx(8.0 + 2.0) and m.limiting == "pipeline"
    assert m.bytes["tied"] == pytest.approx(3 * 2 * 2 * ONE_S)  # both ends of each replica
    big = model_step(sched, ct, mb, L, replicas=3, tokens_per_replica=100, tied_bytes=10 * ONE_S)
    assert big.step_s == pytest.approx(18.0) and big.limiting.startswith("tied-embedding")


def test_model_step_background_fills_idle_link_time():
    sched = make_schedule("gpipe", 2, 1)
    ct, mb = {"F": 1.0, "B": 2.0}, {"F": ONE_S, "B": ONE_S}  # pipeline 8 s, each link busy 1 s
    # DP every 2 steps, 4 replicas, 4 s of ring traffic per sync -> 2 s/step: fits in the idle time
    m = model_step(sched, ct, mb, L, replicas=4, tokens_per_replica=10, dp_payload_bytes=ONE_S * 8 / 3,
                   dp_every=2)
    assert m.step_s == pytest.approx(8.0) and m.limiting == "pipeline"
    # plus anchor traffic: stage 0 downlink: 1 s (pp) + 2 s (dp) + 6 s (anchor) = 9 s > 8 s
    m = model_step(sched, ct, mb, L, replicas=4, tokens_per_replica=10, dp_payload_bytes=ONE_S * 8 / 3,
                   dp_every=2, anchor_down_bytes=[6 * ONE_S, 0], anchor_up_bytes=[0, ONE_S])
    assert m.step_s == pytest.approx(9.0) and "downlink of stage 0" in m.limiting
    assert m.bytes["anchor"] == pytest.approx(4 * 7 * ONE_S)
    one = model_step(sched, ct, mb, L, replicas=4, tokens_per_replica=10, dp_payload_bytes=ONE_S * 8 / 3,
                     dp_every=2, anchor_down_bytes=[6 * ONE_S, 0], anchor_up_bytes=[0, ONE_S], anchor_up_nodes=1)
    assert one.bytes["anchor"] == pytest.approx(4 * 6 * ONE_S + ONE_S) and one.step_s == m.step_s
    assert m.bytes["dp"] == pytest.approx(4 * 2 * (ONE_S * 8 / 3 * 1.5) / 2)


def test_e2e_bench_1b_geometry_bytes_per_token():
    # Llama-3.2-1B shape, 2 stages, bf16: dense boundary = H*2 bytes per token per direction,
    # mask p=0.95 keeps K = round(0.05*2048) = 102 dims -> 204 bytes. Dense DP: 4 replicas
    # ring-all-reduce every bf16 gradient each step: per node 2*(4-1)/4 * 2 bytes * params.
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / "e2e_bench.py"  # bench/ is not installed
    spec = importlib.util.spec_from_file_location("e2e_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = {r["row"]: r for r in bench.main(["--geometry", "1b", "--rows", "dense,m95"])}
    d, m = out["dense"]["bytes_per_token"], out["m95"]["bytes_per_token"]
    assert d["pp_fwd"] == d["pp_bwd"] == 2048 * 2
    assert m["pp_fwd"] == m["pp_bwd"] == 102 * 2
    params = sum(p.numel() for st in bench.meta_stages(bench.llama_1b_config(), 2) for p in st.parameters())
    tokens = 4 * 32 * 2048
    assert d["dp"] == pytest.approx(4 * 1.5 * 2 * params / tokens)
    assert m["dp"] < d["dp"] / 100  # PowerSGD rank 16 and one sync per H=10 steps
    assert out["m95"]["tokens_per_s"] > out["dense"]["tokens_per_s"]
    # the codec sweep: per token per direction, values (+ int16 indices for topk forward)
    sweep = {r["codec_name"]: r["bytes_per_token"] for r in out.values() if r["geometry"] == "1b-codecs"}
    assert (sweep["topk"]["pp_fwd"], sweep["topk"]["pp_bwd"]) == (102 * 4, 102 * 2)
    assert sweep["bottleneck"]["pp_fwd"] == 102 * 2
    assert sweep["int4"]["pp_fwd"] == 2048 // 2 + 4 and sweep["int8"]["pp_bwd"] == 2048 + 4  # + fp32 scale


def test_model_step_diloco_fragments_must_fit_their_overlap_window():
    # pipeline 8 s, each link busy 1 s -> 7 s idle per step. 2 replicas (ring bytes =
    # payload), 20 s of DP wire per full sync, H = 10, F = 2: a 10 s burst every 5 steps.
    sched = make_schedule("gpipe", 2, 1)
    ct, mb = {"F": 1.0, "B": 2.0}, {"F": ONE_S, "B": ONE_S}
    kw = dict(replicas=2, tokens_per_replica=10, dp_payload_bytes=20 * ONE_S, dp_every=10)
    assert model_step(sched, ct, mb, L, dp_fragments=2, **kw).step_s == pytest.approx(8.0)  # spread over 5 steps
    # must finish within 1 step: 10 s > 7 s idle -> 3 s stall once per 5 steps
    assert model_step(sched, ct, mb, L, dp_fragments=2, dp_overlap_steps=1, **kw).step_s == pytest.approx(8.6)
    # one fragment, 1 step: 20 - 7 = 13 s stall per 10 steps
    assert model_step(sched, ct, mb, L, dp_overlap_steps=1, **kw).step_s == pytest.approx(9.3)
    # no overlap: each 10 s fragment sync blocks its step, once per 5 steps
    assert model_step(sched, ct, mb, L, dp_fragments=2, dp_overlap_steps=0, **kw).step_s == pytest.approx(8.0 + 2.0)
    # anchor traffic eating the idle time: 6 s/step on stage 0's downlink leaves 1 s idle;
    # window 2 of period 5: stall = (10 + 2*(6-7)) + 0 = 8 s per 5 steps
    m = model_step(sched, ct, mb, L, dp_fragments=2, dp_overlap_steps=2, anchor_down_bytes=[6 * ONE_S, 0], **kw)
    assert m.step_s == pytest.approx(8.0 + 8.0 / 5) and "downlink of stage 0" in m.limiting


def test_model_run_takes_diloco_bytes_at_their_steady_rate():
    """Under Streaming DiLoCo every record is taken with one fragment's sync in flight (its
    bytes count once its collectives ran): each record of this history holds the syncs of the
    steps before it. The model takes the rate between records, B per node and step, not the
    last total over all steps (11/12 of it)."""
    from types import SimpleNamespace

    from orchestration.config import parse_args

    cfg, _ = parse_args(["--preset", "dp", "--mesh.rows", "2", "--mesh.stages", "1", "--run.bandwidth-bps", "1e6"])
    B = 125_000  # bytes each of the 2 nodes sends per sync: 1.0 s at 1 Mbit/s
    hist = [{"step": k, "fwd_s": [0.01], "bwd_s": [0.02], "dp_bytes_by_stage": [2 * B * (k - 1)],
             "bytes": {"anchor": 0}} for k in range(1, 13)]
    from orchestration.distributed.linkmodel import model_run

    m = model_run(cfg, SimpleNamespace(hidden_size=192), hist)
    assert m.bytes["dp"] == pytest.approx(2 * B)
    assert m.step_s == pytest.approx(1.0, rel=0.01)  # the sync's wire time, the compute hidden under it


def test_a_stream_beside_the_pipeline_slows_its_messages_on_that_uplink_only():
    # two_stages_one_microbatch (8 s) with stage 0's uplink half taken: its forward message
    # takes 2 s instead of 1; stage 1's backward message, on stage 1's uplink, is untouched
    sched = make_schedule("gpipe", 2, 1)
    ct, mb = {"F": 1.0, "B": 2.0}, {"F": ONE_S, "B": ONE_S}
    tl = simulate(sched, ct, mb, L, uplink_taken=[0.5, 0.0])
    assert tl.step_s == pytest.approx(9.0)
    assert _msg(tl, "F", 0, 0)[7] - _msg(tl, "F", 0, 0)[6] == pytest.approx(2.0)
    assert _msg(tl, "B", 1, 0)[7] - _msg(tl, "B", 1, 0)[6] == pytest.approx(1.0)
    assert replay(sched, ct, mb, L, uplink_taken=0.75) == pytest.approx((1 + 1 + 2 + 2) + 4 + 4)  # compute, 2 messages
    with pytest.raises(ValueError, match="uplink_taken"):
        simulate(sched, ct, mb, L, uplink_taken=1.0)


def test_anchor_stream_share_is_its_time_on_the_wire_times_what_it_holds():
    from orchestration.distributed.linkmodel import anchor_stream_share

    assert anchor_stream_share(1.0, 500e3) == 0.5  # unpaced, always on its way: TCP halves the link
    assert anchor_stream_share(0.5, 500e3) == 0.25
    assert anchor_stream_share(1.0, 500e3, max_rate_bps=50e3) == pytest.approx(0.1)  # paced to a tenth
    assert anchor_stream_share(1.0, 500e3, max_rate_bps=1e9) == 0.5  # a pace above half the link: TCP's half
    assert anchor_stream_share(0.0, 500e3) == 0.0
    with pytest.raises(ValueError, match="in_flight"):
        anchor_stream_share(1.5, 500e3)


def test_model_run_charges_the_anchor_stream_by_its_measured_time_in_flight():
    """A 1x2 pipeline whose snapshot stream was on its way for the whole run: the modeled step
    is the pipeline's with every message at half the rate (unpaced), or at the rate less the
    pace (--anchor.max-rate-bps; by default a quarter of --run.bandwidth-bps); the anchor's
    bytes still count on their axis."""
    from types import SimpleNamespace

    from orchestration.config import parse_args
    from orchestration.distributed.linkmodel import model_run

    def run(*extra):
        cfg, _ = parse_args(["--preset", "m95-ap", "--mesh.rows", "2", "--mesh.stages", "2", "--anchor.delay", "0",
                             "--run.bandwidth-bps", "1e6", "--boundary.codec", "dense", "--data.seq-len", "8",
                             "--train.batch-size", "2", "--train.microbatches", "1", *extra])
        hist = [{"step": k, "step_s": 1.0, "fwd_s": [0.0, 0.0], "bwd_s": [0.0, 0.0], "dp_bytes_by_stage": [0, 0],
                 "bytes": {"anchor": 1000 * k}, "anchor_in_flight_s": 1.0 * k} for k in range(1, 6)]
        return model_run(cfg, SimpleNamespace(hidden_size=100), hist)

    # dense fp32 boundary: 2 x 8 x 100 x 4 = 6400 B each way, 51.2 ms at 1 Mbit/s; zero compute,
    # one micro-batch: the step is the forward and the backward message, one after the other
    m = run("--anchor.max-rate-bps", "0")
    assert m.step_s == pytest.approx(2 * 0.0512 / 0.5)
    assert m.bytes["anchor"] > 0
    assert run("--anchor.max-rate-bps", "1e5").step_s == pytest.approx(2 * 0.0512 / 0.9)
    assert run().step_s == pytest.approx(2 * 0.0512 / 0.75)  # the default: a quarter of --run.bandwidth-bps
