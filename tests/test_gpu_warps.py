"""The 8-warp modules (engine warps=8: 128-token pipeline stages, 256 threads, head_dim <= 128)
against float64, on every route: dtypes, head dims, G, page sizes, ragged lengths at page and
stage boundaries; the module's launch facts, GPU planner parity at its one-stage minimum chunk,
cluster counters over 128-token stages, and graph replay.

As in test_gpu_engine.py, every case draws fresh inputs, poisons the output with NaN first (an
unwritten element fails) and compares with the float64 reference of tests/gpu_support.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_support import TOLERANCE, assert_graph_replay_matches, device_case, reference_torch64, rel_err, requires_gpu
from persistentkv import plan as planner
from persistentkv.cache import make_batch
from persistentkv.spec import AttentionSpec

pytestmark = [pytest.mark.gpu, requires_gpu]

WARPS = 8
#: (route, plan options): the queue, the rectangle, the buckets, and clusters of 2 and 8 CTAs.
ROUTES = [("workqueue", {}), ("split", {}), ("buckets", {}), ("cluster", {"cluster_size": 2}),
          ("cluster", {"cluster_size": 8})]
ROUTE_IDS = ["workqueue", "split", "buckets", "cluster2", "cluster8"]


def engine8(spec):
    """The 8-warp engine, or a skip where this GPU cannot hold its CTA (192 KB at head_dim 128
    exceeds e.g. an A100's 163 KB opt-in) or the route needs clusters it lacks."""
    from persistentkv.engine import engine_for
    from persistentkv.errors import PKVError

    try:
        return engine_for(spec, warps=WARPS)
    except PKVError as exc:
        if "this device allows" in str(exc):
            pytest.skip(str(exc))
        raise


def run_case(spec, lengths, route="workqueue", seed=0, hole_fraction=0.25, **options):
    import torch

    engine = engine8(spec)
    if route == "cluster" and engine.capability[0] < planner.CLUSTER_MIN_MAJOR:
        pytest.skip(f"thread-block clusters need compute capability 9.0+, this GPU is {engine.capability}")
    batch, q, k, v = device_case(spec, lengths, hole_fraction, seed)
    plan = engine.plan(batch, route, **options)
    out = torch.full_like(q, float("nan"))
    engine.run(q, (k, v), plan, out)
    torch.cuda.synchronize()
    return rel_err(out, reference_torch64(batch, q, k, v)), out, plan, engine, (batch, q, k, v)


def stage_lengths(P: int, C: int = 8) -> list[int]:
    """Page boundaries, 64- and 128-token stage boundaries, and rows too short for C stages."""
    return sorted({1, 2, P - 1, P, P + 1, 63, 64, 65, 127, 128, 129, 255, 256, 257, 3 * P + 5,
                   128 * C - 1, 128 * C + 1, 1000, 3001})


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("route, options", ROUTES, ids=ROUTE_IDS)
def test_dtype_headdim_route(dtype, head_dim, route, options):
    spec = AttentionSpec(32, 8, head_dim, 16, dtype)
    err, *_ = run_case(spec, [1, 15, 127, 128, 129, 300, 4096, 777], route, seed=head_dim, **options)
    assert err <= TOLERANCE[dtype], f"{dtype} D={head_dim} {route} {options}: rel err {err}"


@pytest.mark.parametrize("group", [1, 4, 7, 8])
@pytest.mark.parametrize("route, options", ROUTES, ids=ROUTE_IDS)
def test_group_sizes(group, route, options):
    spec = AttentionSpec(4 * group, 4, 128, 16, "float16")
    err, *_ = run_case(spec, [5, 64, 2000, 513, 128], route, seed=group, **options)
    assert err <= TOLERANCE["float16"], f"G={group} {route} {options}: rel err {err}"


@pytest.mark.parametrize("page_size", [8, 16, 128])
@pytest.mark.parametrize("route, options", ROUTES, ids=ROUTE_IDS)
def test_page_sizes_and_stage_boundaries(page_size, route, options):
    spec = AttentionSpec(32, 8, 128, page_size, "bfloat16")
    err, *_ = run_case(spec, stage_lengths(page_size), route, seed=page_size, hole_fraction=0.5, **options)
    assert err <= TOLERANCE["bfloat16"], f"P={page_size} {route} {options}: rel err {err}"


@pytest.mark.parametrize("batch_size", [2, 64])
def test_ragged_batches(batch_size):
    rng = np.random.default_rng(batch_size)
    lengths = rng.integers(1, 9000, size=batch_size)
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    for route in ("workqueue", "buckets"):
        err, *_ = run_case(spec, lengths, route, seed=batch_size)
        assert err <= TOLERANCE["float16"], f"B={batch_size} {route}: rel err {err}"


@pytest.mark.parametrize("head_dim", [64, 128])
def test_module_facts(head_dim):
    """The kernel's own launch facts for 8 warps, and the engine defaults derived from them."""
    from persistentkv.engine import min_chunk_tiles_for, stage_tokens

    engine = engine8(AttentionSpec(32, 8, head_dim, 16, "float16"))
    mod = engine.module
    assert (mod.threads, mod.tile, mod.stages) == (32 * WARPS, stage_tokens(WARPS), 3)
    assert mod.smem_bytes == 2 * mod.stages * mod.tile * head_dim * 2  # the K and V rings
    assert engine.target_items == mod.occupancy * engine.num_sms
    assert engine.min_chunk_tiles == min_chunk_tiles_for(WARPS) == 4
    if head_dim == 128:  # 192 KB: one CTA per SM
        assert mod.occupancy == 1


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_four_warp_module_facts(head_dim):
    """The 4-warp modules hold two CTAs per SM or more (the queue's default target: occupancy x
    SMs items): 3 stages of 64 tokens for K and V (96 KB at head_dim 128), 2 at 256 (one CTA)."""
    from persistentkv.engine import engine_for

    engine = engine_for(AttentionSpec(32, 8, head_dim, 16, "float16"))
    mod = engine.module
    assert mod.stages == (2 if head_dim == 256 else 3)
    assert mod.smem_bytes >= 2 * mod.stages * mod.tile * head_dim * 2
    assert engine.target_items == mod.occupancy * engine.num_sms
    if head_dim <= 128 and engine.capability[0] >= 9:  # 228 KB per SM (an A100's 164 KB holds one)
        assert mod.occupancy >= 2


def test_gpu_planner_equals_cpu_planner():
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    engine = engine8(spec)
    rng = np.random.default_rng(3)
    for B in (1, 3, 8, 100, 512):
        batch = make_batch(spec, rng.integers(1, 70000, size=B))
        for target in (engine.target_items, 64, 1000):
            dev = engine.plan(batch, "workqueue", target_items=target)
            cpu = planner.plan_workqueue(batch, target_items=target, min_chunk_tiles=engine.min_chunk_tiles)
            np.testing.assert_array_equal(engine.device_items(dev), cpu.items, err_msg=f"B={B} target={target}")


def test_cluster_counters_follow_128_token_stages():
    """300 tokens are 3 stages of 128: 3 of 8 CTAs per (row, kv head) read tokens, as the counters say."""
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    err, _, plan, *_ = run_case(spec, [300, 4096], "cluster", cluster_size=8)
    assert err <= TOLERANCE["float16"]
    counters = plan.counters()
    assert counters["decode_ctas"] == 2 * 8 * 8
    assert counters["nonempty_items"] == 8 * (3 + 8)


@pytest.mark.parametrize("route, options", ROUTES, ids=ROUTE_IDS)
def test_graph_replay_over_rotated_caches(route, options):
    """A plan captured once, its graph cycling over copies of the cache, replayed three times."""
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    err, _, plan, engine, (batch, q, k, v) = run_case(spec, [1000, 20000, 77], route, seed=5, hole_fraction=0.2,
                                                      **options)
    assert err <= TOLERANCE["float16"]
    assert_graph_replay_matches(engine, plan, batch, q, k, v, TOLERANCE["float16"])
