"""The work queue's pool on the CPU: plan.pooled_items and the engine's ``pool`` option.

What the kernel relies on (kernels/pkv_decode.cu, decode_item): in each (row, kv head) group the
items' own ranges and the group's pool tile the row exactly once, the pool is one range at the
row's end shared by every item of the group, and nothing changes without a pool or beyond one
wave. The GPU planner's agreement with this function is tested on the GPU (tests/test_gpu_pool.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from persistentkv import plan as planner
from persistentkv.cache import make_batch
from persistentkv.errors import PKVError
from persistentkv.spec import AttentionSpec

SPEC = AttentionSpec(32, 8, 128, 16, "float16")


def queue(lengths, target=132, min_chunk=4):
    batch = make_batch(SPEC, lengths)
    return batch, planner.plan_workqueue(batch, target_items=target, min_chunk_tiles=min_chunk)


def groups(items):
    by = {}
    for rh, lo, hi, ss, plo, phi in items.tolist():
        by.setdefault((rh & 0xFFFF, rh >> 16), []).append((ss & 0xFFFF, ss >> 16, lo, hi, plo, phi))
    return by


@pytest.mark.parametrize("pool_units", [1, 4, 8, 15])
@pytest.mark.parametrize("lengths", [[32768], [4096], [1, 17, 2049, 4096], [16, 4111, 300, 70000], [33] * 7,
                                     [5, 1 << 20]])
def test_items_and_pool_tile_each_row_once(pool_units, lengths):
    batch, plan = queue(lengths)
    assert plan.num_items <= 132
    pooled = planner.pooled_items(plan.items, batch.seq_lens, pool_units, 132)
    np.testing.assert_array_equal(pooled[:, 0], plan.items[:, 0])
    np.testing.assert_array_equal(pooled[:, 3], plan.items[:, 3])
    for (row, head), its in groups(pooled).items():
        N = int(batch.seq_lens[row])
        its.sort()
        S = its[0][1]
        assert [s for s, *_ in its] == list(range(S)) and all(n == S for _, n, *_ in its)
        pools = {(plo, phi) for *_, plo, phi in its}
        assert len(pools) == 1, f"row {row} head {head}: items disagree on the pool {pools}"
        (plo, phi), = pools
        T = -(-N // planner.TILE_TOKENS)
        if S >= 2 and T * pool_units // planner.POOL_UNITS > 0:
            assert phi == N and 0 <= plo < N and plo % planner.TILE_TOKENS == 0
        else:
            assert (plo, phi) == (0, 0)
            plo = N
        covered = np.zeros(N, dtype=np.int64)
        for _, _, lo, hi, *_ in its:
            assert 0 <= lo <= hi <= plo
            covered[lo:hi] += 1
        covered[plo:phi] += 1
        assert (covered == 1).all(), f"row {row} head {head}: tokens covered {np.unique(covered)} times"
        own = [hi - lo for _, _, lo, hi, *_ in its]  # balanced: within one planner tile (and the row's end)
        assert max(own) - min(own) <= planner.TILE_TOKENS + (planner.TILE_TOKENS - 1)


def test_no_pool_and_multiwave_queues_keep_their_items():
    batch, plan = queue([4096, 9000, 17])
    same = planner.pooled_items(plan.items, batch.seq_lens, 0, 132)
    np.testing.assert_array_equal(same[:, :4], plan.items)
    assert (same[:, 4:] == 0).all()
    batch, plan = queue([3000] * 40)
    assert plan.num_items > 132
    wide = planner.pooled_items(plan.items, batch.seq_lens, 8, 132)
    np.testing.assert_array_equal(wide[:, :4], plan.items)
    assert (wide[:, 4:] == 0).all()


def test_pool_share_of_a_long_row():
    """B=1 x 32K on 132 slots: 8 groups of 16 items; a quarter of the 1024 tiles is the pool."""
    batch, plan = queue([32768])
    pooled = planner.pooled_items(plan.items, batch.seq_lens, 4, 132)
    assert plan.num_items == 128
    assert set(pooled[:, 4].tolist()) == {768 * 32} and set(pooled[:, 5].tolist()) == {32768}
    assert set((pooled[:, 2] - pooled[:, 1]).tolist()) == {48 * 32}


@pytest.mark.parametrize("bad", [-0.0625, 1.0, 0.3, True, "0.25", None, float("nan")])
def test_pool_share_is_checked(bad):
    with pytest.raises(PKVError, match="pool must be a multiple of 1/16"):
        planner.check_pool(bad)


def test_pool_share_in_sixteenths():
    assert [planner.check_pool(p) for p in (0, 0.0, 0.0625, 0.25, 0.9375)] == [0, 0, 1, 4, 15]


def test_engine_refuses_a_bad_pool_before_any_gpu_use():
    from persistentkv.engine import DecodeEngine

    with pytest.raises(PKVError, match="pool must be"):
        DecodeEngine(SPEC, pool=1.5)


def test_gpu_planner_launch_gets_the_pool():
    from test_engine_plan_layout import args_of, fake_engine

    engine, launched = fake_engine(warps=8)
    engine.pool_units = 4
    plan = engine.plan(make_batch(SPEC, [32768]), "workqueue")
    assert args_of(plan.launches[0].args)["pool_units"] == 4


def test_a_pooled_engine_builds_the_pool_code():
    from persistentkv.engine import with_pool_code

    assert with_pool_code((), 0) == () and with_pool_code(("PKV_TRACE=1",), 0) == ("PKV_TRACE=1",)
    assert with_pool_code((), 4) == ("PKV_POOL=1",)
    assert with_pool_code(("PKV_POOL=1", "PKV_TRACE=1"), 4) == ("PKV_POOL=1", "PKV_TRACE=1")
    with pytest.raises(PKVError, match="pool needs the kernel's pool code"):
        with_pool_code(("PKV_POOL=0",), 4)
