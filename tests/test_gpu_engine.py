"""The GPU engine against float64: dtypes, head dims, G, page sizes, routes, ragged and scattered
batches, page-boundary lengths, large batches, a 1M-token row; GPU planner parity; graph replay.

Every case draws fresh random inputs, poisons the output with NaN first (so an unwritten element
fails), and compares ||out - ref|| / ||ref|| with the float64 reference (tests/gpu_support.py),
which never looks at a plan.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_support import (TOLERANCE, assert_graph_replay_matches, assert_repeats_bit_exact, device_case,
                         reference_torch64, rel_err, requires_gpu)
from persistentkv import plan as planner
from persistentkv.cache import Batch, make_batch
from persistentkv.spec import AttentionSpec

pytestmark = [pytest.mark.gpu, requires_gpu]

ROUTES = ("workqueue", "workqueue_host", "buckets", "split")


def run_case(spec, lengths, route="workqueue", seed=0, hole_fraction=0.25, **options):
    import torch

    from persistentkv.engine import engine_for

    engine = engine_for(spec)
    batch, q, k, v = device_case(spec, lengths, hole_fraction, seed)
    plan = engine.plan(batch, route, **options)
    out = torch.full_like(q, float("nan"))
    engine.run(q, (k, v), plan, out)
    torch.cuda.synchronize()
    return rel_err(out, reference_torch64(batch, q, k, v)), out, plan, engine, (batch, q, k, v)


def boundary_lengths(P: int) -> list[int]:
    return sorted({1, 2, P - 1 if P > 1 else 1, P, P + 1, 31, 32, 33, 63, 64, 65, 127, 128, 129, 3 * P + 5, 1000})


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("route", ROUTES)
def test_dtype_headdim_route(dtype, head_dim, route):
    spec = AttentionSpec(32, 8, head_dim, 16, dtype)
    lengths = [1, 15, 16, 17, 300, 4096, 777]
    err, *_ = run_case(spec, lengths, route, seed=head_dim)
    assert err <= TOLERANCE[dtype], f"{dtype} D={head_dim} {route}: rel err {err}"


@pytest.mark.parametrize("group", [1, 2, 4, 7, 8, 16])
@pytest.mark.parametrize("route", ["workqueue", "split"])
def test_group_sizes(group, route):
    spec = AttentionSpec(4 * group, 4, 128, 16, "float16")
    err, *_ = run_case(spec, [5, 64, 2000, 513], route, seed=group)
    assert err <= TOLERANCE["float16"], f"G={group} {route}: rel err {err}"


@pytest.mark.parametrize("page_size", [1, 8, 16, 32, 64, 128, 256])
def test_page_sizes_and_boundaries(page_size):
    spec = AttentionSpec(32, 8, 128, page_size, "float16")
    for route in ROUTES:
        err, *_ = run_case(spec, boundary_lengths(page_size), route, seed=page_size, hole_fraction=0.5)
        assert err <= TOLERANCE["float16"], f"P={page_size} {route}: rel err {err}"


@pytest.mark.parametrize("batch_size", [2, 64, 256])
def test_ragged_batches(batch_size):
    rng = np.random.default_rng(batch_size)
    lengths = rng.integers(1, 9000, size=batch_size)
    spec = AttentionSpec(32, 8, 128, 16, "bfloat16")
    for route in ("workqueue", "buckets"):
        err, *_ = run_case(spec, lengths, route, seed=batch_size)
        assert err <= TOLERANCE["bfloat16"], f"B={batch_size} {route}: rel err {err}"


def test_empty_splits_in_the_rectangle():
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    # S = 64 splits over rows of 1..3 tiles: most items are empty and must write neutral states.
    err, _, plan, *_ = run_case(spec, [1, 40, 70, 96], "split", num_splits=64)
    assert plan.host_plan.counters().nonempty_items < plan.host_plan.num_items
    assert err <= TOLERANCE["float16"]


def test_million_token_row():
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    err, *_ = run_case(spec, [1 << 20], "workqueue", seed=7, hole_fraction=0.0)
    assert err <= TOLERANCE["float16"], f"1M tokens: rel err {err}"


def test_gpu_planner_equals_cpu_planner():
    from persistentkv.engine import engine_for

    spec = AttentionSpec(32, 8, 128, 16, "float16")
    engine = engine_for(spec)
    rng = np.random.default_rng(3)
    bimodal = [49152, 4096, 8192, 6144, 40960, 8192, 6144, 7168]  # where the two chunk rules differ
    cases = [rng.integers(1, 70000, size=B) for B in (1, 3, 8, 100, 512, 3000)] + [bimodal, [1, 5, 1 << 20]]
    for lengths in cases:
        batch = make_batch(spec, lengths)
        for target in (engine.target_items, 64, 1000):
            for rule in planner.CHUNK_RULES:
                dev = engine.plan(batch, "workqueue", target_items=target, chunk_rule=rule)
                cpu = planner.plan_workqueue(batch, target_items=target, min_chunk_tiles=engine.min_chunk_tiles,
                                             chunk_rule=rule)
                np.testing.assert_array_equal(engine.device_items(dev), cpu.items,
                                              err_msg=f"B={len(lengths)} target={target} rule={rule}")


def test_plans_made_while_the_stream_is_busy_keep_their_own_uploads():
    """Each GPU plan uploads through a pinned staging block that torch's caching host allocator
    recycles once the copy is done. Plans made back to back while the stream is still busy (so
    their copies are queued, not done) must each keep their own lengths and block table: every
    plan's packed upload, counters and items are checked after the stream drains, and a plan's
    output against float64."""
    import torch

    from persistentkv.engine import engine_for

    spec = AttentionSpec(32, 8, 128, 16, "float16")
    engine = engine_for(spec)
    rng = np.random.default_rng(11)
    batches = [make_batch(spec, rng.integers(1, 20000, size=B), hole_fraction=0.3, seed=i)
               for i, B in enumerate((1, 5, 1, 17, 3, 64, 2, 9) * 3)]
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of every copy below
    plans = [engine.plan(batch, "workqueue") for batch in batches]
    torch.cuda.synchronize()
    for i, (batch, plan) in enumerate(zip(batches, plans)):
        packed = plan.view("packed").cpu().numpy()
        np.testing.assert_array_equal(packed, np.concatenate([batch.seq_lens, batch.kv_indptr, batch.kv_indices]),
                                      err_msg=f"plan {i}")
        assert (plan.view("counters").cpu().numpy() == 0).all(), f"plan {i}"
        cpu = planner.plan_workqueue(batch, target_items=engine.target_items, min_chunk_tiles=engine.min_chunk_tiles)
        np.testing.assert_array_equal(engine.device_items(plan), cpu.items, err_msg=f"plan {i}")
    batch, q, k, v = device_case(spec, batches[5].seq_lens, 0.3, 5)
    plan = engine.plan(batch, "workqueue")
    out = torch.full_like(q, float("nan"))
    engine.run(q, (k, v), plan, out)
    torch.cuda.synchronize()
    assert rel_err(out, reference_torch64(batch, q, k, v)) <= TOLERANCE["float16"]


@pytest.mark.parametrize("route", ["buckets", "split", "workqueue_host", "cluster"])
def test_host_route_plans_made_while_the_stream_is_busy_keep_their_own_uploads(route):
    """The host-planned routes and the cluster route upload through DecodeEngine._i32: pinned
    staging, an asynchronous copy, no synchronisation. Plans made back to back behind a busy
    stream must each keep their own items, block table and merge groups (checked against the
    host planner after the drain), and each must compute its own batch's attention."""
    import torch

    from persistentkv.engine import engine_for

    spec = AttentionSpec(32, 8, 128, 16, "float16")
    engine = engine_for(spec)
    if route == "cluster" and engine.capability[0] < 9:
        pytest.skip("route cluster needs sm_90")
    rng = np.random.default_rng(12)
    cases = [device_case(spec, rng.integers(1, 9000, size=B), 0.3, 20 + i) for i, B in enumerate((1, 5, 2, 9, 3))]
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of every copy below
    plans = [engine.plan(batch, route) for batch, *_ in cases]
    outs = []
    for (batch, q, k, v), plan in zip(cases, plans):
        outs.append(torch.full_like(q, float("nan")))
        engine.run(q, (k, v), plan, outs[-1])
    torch.cuda.synchronize()
    for i, ((batch, q, k, v), plan, out) in enumerate(zip(cases, plans, outs)):
        if route == "cluster":
            packed = plan.buffers["packed"].cpu().numpy()
            np.testing.assert_array_equal(packed, np.concatenate([batch.seq_lens, batch.kv_indptr, batch.kv_indices]),
                                          err_msg=f"plan {i}")
        else:
            host = plan.host_plan
            np.testing.assert_array_equal(plan.buffers["items"].cpu().numpy()[:host.num_items, :4], host.items,
                                          err_msg=f"plan {i}")
            np.testing.assert_array_equal(plan.buffers["kv_indices"].cpu().numpy()[:batch.kv_indices.size],
                                          batch.kv_indices, err_msg=f"plan {i}")
        assert rel_err(out, reference_torch64(batch, q, k, v)) <= TOLERANCE["float16"], f"plan {i}"


def test_run_refuses_a_cache_smaller_than_the_block_table():
    from persistentkv.errors import PKVError

    spec = AttentionSpec(32, 8, 128, 16, "float16")
    err, out, plan, engine, (batch, q, k, v) = run_case(spec, [3000, 900], "workqueue")
    assert err <= TOLERANCE["float16"]
    with pytest.raises(PKVError, match="pages; the plan's block table addresses page ids up to"):
        engine.run(q, (k[:-1], v[:-1]), plan, out)


def test_repeated_fused_launches_reset_their_counters():
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    err, out, plan, engine, (batch, q, k, v) = run_case(spec, [3000, 9000], "workqueue")
    assert err <= TOLERANCE["float16"]
    assert_repeats_bit_exact(engine, plan, q, k, v, out)


def test_cuda_graph_replay_and_whole_step_capture():
    """A step = GPU plan + 32 layers (each its own cache) captured in one graph, replayed after the
    lengths change on the device: no host synchronisation inside."""
    import torch

    from persistentkv.engine import engine_for

    spec = AttentionSpec(32, 8, 128, 16, "float16")
    engine = engine_for(spec)
    lengths = [5000, 1234, 64, 9999]
    batch, q, k, v = device_case(spec, [n + 8 for n in lengths], hole_fraction=0.0, seed=11)
    layers = 32
    ks = [k.clone() for _ in range(2)]
    # Plan for the longer lengths (pages exist), then shrink the lengths on the device.
    plan = engine.plan(batch, "workqueue")
    outs = [torch.empty_like(q) for _ in range(layers)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        engine.replan_device(plan)
        engine.run(q, (ks[0], v), plan, outs[0])  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        engine.replan_device(plan)
        for layer in range(layers):
            engine.run(q, (ks[layer % 2], v), plan, outs[layer])
    seq = plan.view("packed")[: batch.batch_size]
    seq.copy_(torch.tensor(lengths, dtype=torch.int32, device="cuda"))
    for o in outs:
        o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    # The same rows at their shorter lengths: a prefix of each row's pages.
    counts = [-(-n // spec.page_size) for n in lengths]
    ref_batch = Batch(spec, np.asarray(lengths, np.int32),
                      np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
                      np.concatenate([batch.kv_indices[batch.kv_indptr[i]:batch.kv_indptr[i] + c]
                                      for i, c in enumerate(counts)]), batch.num_pages)
    ref = reference_torch64(ref_batch, q, ks[0], v)
    for layer in range(layers):
        assert rel_err(outs[layer], ref) <= TOLERANCE["float16"], f"layer {layer}"


@pytest.mark.parametrize("route", ROUTES)
def test_graph_replay_of_every_route_over_rotated_caches(route):
    """Several plans captured side by side, each graph cycling over copies of the cache."""
    from persistentkv.engine import engine_for

    spec = AttentionSpec(32, 8, 128, 16, "float16")
    engine = engine_for(spec)
    batch, q, k, v = device_case(spec, [1000, 20000, 77], hole_fraction=0.2, seed=5)
    assert_graph_replay_matches(engine, engine.plan(batch, route), batch, q, k, v, TOLERANCE["float16"])


def test_refuses_unsupported_specs_before_launch():
    from persistentkv.engine import DecodeEngine
    from persistentkv.errors import PKVError

    with pytest.raises(PKVError, match="G=32"):
        DecodeEngine(AttentionSpec(32, 1, 128, 16, "float16"))
    engine = DecodeEngine(AttentionSpec(32, 8, 128, 16, "float16"))
    import torch

    batch, q, k, v = device_case(engine.spec, [100])
    plan = engine.plan(batch)
    with pytest.raises(PKVError, match="dtype"):
        engine.run(q.float(), (k, v), plan, torch.empty_like(q))
    with pytest.raises(PKVError, match="shape"):
        engine.run(q[:, :16], (k, v), plan, torch.empty_like(q))
