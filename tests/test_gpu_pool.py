"""The fused work queue with a pool (DecodeEngine(pool=...)) against float64 on the GPU.

A pooled group's CTAs claim stages of the row's pool from a cursor while they stream, so which
CTA reads which tokens changes from run to run: every case here poisons the output with NaN,
compares with the float64 reference (tests/gpu_support.py), and runs the same plan again and
again (eagerly, chained under PDL, and replayed from a CUDA graph) so that a cursor left unreset,
a stage claimed twice or never, or a ring entry read before it is written shows up as a wrong or
unwritten output. The counters (merge arrivals and cursors) must be zero after every launch.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_support import TOLERANCE, assert_graph_replay_matches, device_case, reference_torch64, rel_err, requires_gpu
from persistentkv import plan as planner
from persistentkv.spec import AttentionSpec

pytestmark = [pytest.mark.gpu, requires_gpu]

# one-row steps from one stage per item to many (4K at 8 warps: two stages; 1M: hundreds), ragged
# rows at page boundaries, and a batch that fills one wave
LENGTHS = [[4096], [8192], [32768], [1, 17, 2049, 4096], [16, 4111, 300, 70000], [2000] * 16]


def pooled_engine(spec, warps, pool, **options):
    from persistentkv.engine import engine_for

    return engine_for(spec, warps=warps, pool=pool, **options)


def check_runs(engine, batch, q, k, v, plan, tolerance, runs=4):
    import torch

    ref = reference_torch64(batch, q, k, v)
    for i in range(runs):
        out = torch.full_like(q, float("nan"))
        engine.run(q, (k, v), plan, out)
        torch.cuda.synchronize()
        err = rel_err(out, ref)
        assert err <= tolerance, f"run {i}: rel err {err}"
        assert (plan.view("counters").cpu().numpy() == 0).all(), f"run {i}: counters not reset"


@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("pool", [0.25, 0.5, 0.9375])
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda x: f"B{len(x)}-max{max(x)}")
def test_pooled_queue_matches_float64_run_after_run(warps, pool, lengths):
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    engine = pooled_engine(spec, warps, pool)
    batch, q, k, v = device_case(spec, lengths, 0.3, seed=len(lengths) + warps)
    plan = engine.plan(batch, "workqueue")
    items = engine.device_items(plan, pools=True)
    cpu = planner.plan_workqueue(batch, target_items=engine.target_items, min_chunk_tiles=engine.min_chunk_tiles)
    np.testing.assert_array_equal(items, planner.pooled_items(cpu.items, batch.seq_lens, engine.pool_units,
                                                              engine.target_items))
    check_runs(engine, batch, q, k, v, plan, TOLERANCE["float16"])


def test_pooled_queue_one_million_tokens():
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    engine = pooled_engine(spec, 8, 0.25)
    batch, q, k, v = device_case(spec, [1 << 20], 0.0, seed=20)
    check_runs(engine, batch, q, k, v, engine.plan(batch, "workqueue"), TOLERANCE["float16"], runs=2)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("group,page", [(1, 8), (4, 16), (7, 32), (8, 128)])
def test_pooled_queue_over_dtypes_groups_and_pages(dtype, group, page):
    spec = AttentionSpec(4 * group, 4, 128, page, dtype)
    engine = pooled_engine(spec, 8, 0.25)
    batch, q, k, v = device_case(spec, [page * 300 + 1, 3 * page, 9000], 0.25, seed=group)
    check_runs(engine, batch, q, k, v, engine.plan(batch, "workqueue"), TOLERANCE[dtype])


@pytest.mark.parametrize("head_dim", [64, 256])
def test_pooled_queue_head_dims(head_dim):
    spec = AttentionSpec(32, 8, head_dim, 16, "float16")
    engine = pooled_engine(spec, 4, 0.25)
    batch, q, k, v = device_case(spec, [20000, 333], 0.25, seed=head_dim)
    check_runs(engine, batch, q, k, v, engine.plan(batch, "workqueue"), TOLERANCE["float16"])


def test_pooled_host_route_uploads_the_pools():
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    engine = pooled_engine(spec, 8, 0.25)
    batch, q, k, v = device_case(spec, [30000, 513], 0.25, seed=7)
    plan = engine.plan(batch, "workqueue_host")
    items = engine.device_items(plan, pools=True)
    assert (items[:, 5] > items[:, 4]).any(), "no pooled item in a one-wave queue of long rows"
    np.testing.assert_array_equal(items, planner.pooled_items(plan.host_plan.items, batch.seq_lens,
                                                              engine.pool_units, engine.target_items))
    check_runs(engine, batch, q, k, v, plan, TOLERANCE["float16"])


@pytest.mark.parametrize("early_kv", [True, False])
def test_pooled_queue_under_graph_replay(early_kv):
    """Chained runs of one plan in one graph (PDL: each launch's CTAs start while the last one's
    merge resets the cursor), over two cache copies, replayed three times."""
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    engine = pooled_engine(spec, 8, 0.25, early_kv=early_kv)
    for lengths in ([32768], [4096, 9000, 17]):
        batch, q, k, v = device_case(spec, lengths, 0.3, seed=len(lengths))
        plan = engine.plan(batch, "workqueue")
        assert_graph_replay_matches(engine, plan, batch, q, k, v, TOLERANCE["float16"], calls=6)
        assert (plan.view("counters").cpu().numpy() == 0).all()


def test_pool_is_inert_on_a_multiwave_queue():
    """Beyond one wave the items keep their ranges: the pool's items equal the unpooled queue's."""
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    engine = pooled_engine(spec, 8, 0.5)
    batch, q, k, v = device_case(spec, [3000] * 40, 0.25, seed=5)
    plan = engine.plan(batch, "workqueue")
    items = engine.device_items(plan, pools=True)
    assert len(items) > engine.target_items and (items[:, 4:] == 0).all()
    check_runs(engine, batch, q, k, v, plan, TOLERANCE["float16"], runs=2)
