"""The development fence-free merge (engine defines=("PKV_LLMERGE=1",), benchmarks/NOTES.md v21)
against float64, at 4 and 8 warps: the fused queue's groups of 2 to 132 splits (more than one
chunk of the merge's unrolled loads), ragged rows with holes and lengths at page boundaries, the
GPU-planned and host-planned queues, many launches of one plan (each must leave every state slot
holding the sentinel for the next), and graph replay.

As in test_gpu_engine.py, every case draws fresh inputs, poisons the output with NaN first (an
unwritten element fails) and compares with the float64 reference of tests/gpu_support.py.
"""

from __future__ import annotations

import pytest

from gpu_support import TOLERANCE, assert_graph_replay_matches, device_case, reference_torch64, rel_err, requires_gpu
from persistentkv.spec import AttentionSpec

pytestmark = [pytest.mark.gpu, requires_gpu]

LL = ("PKV_LLMERGE=1",)
SENTINEL = -1  # all bits set, as int32


def ll_engine(spec, warps):
    from persistentkv.engine import engine_for

    return engine_for(spec, warps=warps, defines=LL)


def states_all_sentinel(plan) -> bool:
    import torch

    return all(bool((plan.view(name).view(torch.int32) == SENTINEL).all()) for name in ("part_o", "part_lse"))


def check(spec, lengths, warps, route="workqueue", seed=0, launches=3):
    """Every launch of one plan on fresh q matches float64; the states are all sentinel after each."""
    import torch

    engine = ll_engine(spec, warps)
    batch, q, k, v = device_case(spec, lengths, 0.3, seed)
    plan = engine.plan(batch, route)
    for i in range(launches):
        q = torch.randn_like(q) if i else q
        out = torch.full_like(q, float("nan"))
        engine.run(q, (k, v), plan, out)
        torch.cuda.synchronize()
        err = rel_err(out, reference_torch64(batch, q, k, v))
        assert err <= TOLERANCE[spec.dtype], (i, err)
        assert states_all_sentinel(plan), f"launch {i} left a state slot without the sentinel"
    return engine, plan, (batch, q, k, v)


@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("G", [1, 4, 7, 8])
def test_ll_merge_matches_float64_on_ragged_rows(warps, dtype, G):
    spec = AttentionSpec(8 * G if G != 7 else 14, 8 if G != 7 else 2, 128, 16, dtype)
    check(spec, [1, 15, 16, 17, 255, 256, 257, 1000, 3001, 8191, 16384 + 3], warps, seed=G)


@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("lengths", [[4096], [32768 + 7], [131072 + 5], [16384, 16384], [8192] * 4, [1, 131072]])
def test_ll_merge_many_splits_per_group(warps, lengths):
    """One to four rows over 132 SMs: groups of up to ~132 / (B * Hkv) splits, one row of one page."""
    check(AttentionSpec(32, 8, 128, 16, "float16"), lengths, warps, seed=len(lengths))


@pytest.mark.parametrize("P", [8, 32, 128])
def test_ll_merge_host_planned_queue_and_page_sizes(P):
    check(AttentionSpec(32, 8, 128, P, "float16"), [P - 1, P, P + 1, 5000, 20000], 8, route="workqueue_host", seed=P)


@pytest.mark.parametrize("head_dim", [64, 256])
def test_ll_merge_head_dims(head_dim):
    check(AttentionSpec(32, 8, head_dim, 16, "float16"), [100, 4096, 30000], 4, seed=head_dim)


@pytest.mark.parametrize("warps", [4, 8])
def test_ll_merge_graph_replay(warps):
    engine, plan, (batch, q, k, v) = check(AttentionSpec(32, 8, 128, 16, "float16"), [12345, 4096, 1], warps,
                                           launches=1)
    assert_graph_replay_matches(engine, plan, batch, q, k, v, TOLERANCE["float16"])
    assert states_all_sentinel(plan)
