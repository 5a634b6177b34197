"""The cluster route (kernel v5) against float64: dtypes, head dims, G, C, page sizes, ragged and
scattered batches, page-boundary lengths, empty splits, a 1M-token row, lengths changed on the
device (down to 0) under graph replay, and one CTA per SM.

Every case poisons the output with NaN first, so an element the cluster merge fails to write
fails the comparison (tests/gpu_support.py holds the reference, which never looks at a plan).
"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_support import TOLERANCE, assert_repeats_bit_exact, device_case, reference_torch64, rel_err, requires_gpu
from persistentkv.cache import Batch
from persistentkv.spec import AttentionSpec

pytestmark = [pytest.mark.gpu, requires_gpu]


def _sm90_reason():
    import torch

    major, minor = torch.cuda.get_device_capability()
    return None if major >= 9 else f"thread-block clusters need compute capability 9.0+, this GPU is {major}.{minor}"


@pytest.fixture(autouse=True)
def needs_sm90():
    reason = _sm90_reason()
    if reason:
        pytest.skip(reason)


def run_cluster(spec, lengths, cluster_size=None, seed=0, hole_fraction=0.25, **options):
    import torch

    from persistentkv.engine import engine_for

    engine = engine_for(spec)
    batch, q, k, v = device_case(spec, lengths, hole_fraction, seed)
    plan = engine.plan(batch, "cluster", cluster_size=cluster_size, **options)
    out = torch.full_like(q, float("nan"))
    engine.run(q, (k, v), plan, out)
    torch.cuda.synchronize()
    return rel_err(out, reference_torch64(batch, q, k, v)), out, plan, engine, (batch, q, k, v)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("C", [2, 4, 8, 16])
def test_dtype_headdim_cluster_size(dtype, head_dim, C):
    spec = AttentionSpec(32, 8, head_dim, 16, dtype)
    err, _, plan, *_ = run_cluster(spec, [1, 15, 17, 300, 4096, 777], C, seed=head_dim + C)
    assert plan.launches[0].grid == 6 * 8 * C
    assert err <= TOLERANCE[dtype], f"{dtype} D={head_dim} C={C}: rel err {err}"


@pytest.mark.parametrize("group", [1, 4, 7, 8, 16])
@pytest.mark.parametrize("C", [2, 16])
def test_group_sizes(group, C):
    spec = AttentionSpec(4 * group, 4, 128, 16, "float16")
    err, *_ = run_cluster(spec, [5, 64, 2000, 513], C, seed=group)
    assert err <= TOLERANCE["float16"], f"G={group} C={C}: rel err {err}"


@pytest.mark.parametrize("page_size", [8, 16, 128])
@pytest.mark.parametrize("C", [1, 4, 16])
def test_page_sizes_boundaries_and_empty_splits(page_size, C):
    P = page_size
    # page boundaries, tile boundaries, and T < C * 64 (splits left empty)
    lengths = sorted({1, 2, P - 1, P, P + 1, 63, 64, 65, 127, 128, 129, 3 * P + 5, 64 * C - 1, 64 * C + 1, 1000})
    spec = AttentionSpec(32, 8, 128, P, "float16")
    err, *_ = run_cluster(spec, lengths, C, seed=P, hole_fraction=0.5)
    assert err <= TOLERANCE["float16"], f"P={P} C={C}: rel err {err}"


@pytest.mark.parametrize("batch_size", [2, 17, 64])
def test_ragged_batches_default_cluster_size(batch_size):
    rng = np.random.default_rng(batch_size)
    spec = AttentionSpec(32, 8, 128, 16, "bfloat16")
    err, _, plan, engine, _ = run_cluster(spec, rng.integers(1, 9000, size=batch_size), seed=batch_size)
    from persistentkv.plan import default_cluster_size

    assert plan.counters()["decode_ctas"] == batch_size * 8 * default_cluster_size(batch_size, 8, engine.num_sms)
    assert err <= TOLERANCE["bfloat16"], f"B={batch_size}: rel err {err}"


def test_million_token_row_cluster16():
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    err, *_ = run_cluster(spec, [1 << 20], 16, seed=7, hole_fraction=0.0)
    assert err <= TOLERANCE["float16"], f"1M tokens: rel err {err}"


def test_one_cta_per_sm_gives_the_same_output():
    import torch

    spec = AttentionSpec(32, 8, 128, 16, "float16")
    err, out, plan, engine, (batch, q, k, v) = run_cluster(spec, [5000], 16, seed=3)
    assert err <= TOLERANCE["float16"]
    wide = engine.plan(batch, "cluster", cluster_size=16, cluster_smem_bytes=engine.module.smem_optin)
    assert engine.occupancy(wide.launches[0]) == 1
    out2 = torch.full_like(q, float("nan"))
    engine.run(q, (k, v), wide, out2)
    torch.testing.assert_close(out2, out, rtol=0, atol=0)  # same ranges, same merge order


def test_repeated_launches_are_deterministic():
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    err, out, plan, engine, (batch, q, k, v) = run_cluster(spec, [3000, 9000], 8)
    assert err <= TOLERANCE["float16"]
    assert_repeats_bit_exact(engine, plan, q, k, v, out)


def test_counters_of_the_device_plan():
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    _, _, plan, _, (batch, *_) = run_cluster(spec, [4096, 4000], 8)
    counters = plan.counters()
    assert counters["launches"] == 1 and counters["merge_ctas"] == 0 and counters["merge_state_bytes"] == 0
    assert counters["h2d_bytes"] == plan.buffers["packed"].numel() * 4
    assert plan.num_launches == 1


@pytest.mark.parametrize("C", [2, 16])
def test_graph_replay_with_lengths_changed_on_the_device(C):
    """Captured once; the lengths shrink on the device (one row to 0 tokens: output 0) and the
    graph is replayed over rotated caches without replanning."""
    import torch

    from persistentkv.engine import engine_for

    spec = AttentionSpec(32, 8, 128, 16, "float16")
    engine = engine_for(spec)
    lengths = [5000, 1234, 0, 9999] if C == 2 else [3000]
    batch, q, k, v = device_case(spec, [n + 100 for n in lengths], hole_fraction=0.2, seed=11 + C)
    ks, vs = [k, k.clone()], [v, v.clone()]
    plan = engine.plan(batch, "cluster", cluster_size=C)
    outs = [torch.empty_like(q) for _ in range(4)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        engine.run(q, (k, v), plan, outs[0])  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        engine.replan_device(plan)  # a no-op for this route
        for i, o in enumerate(outs):
            engine.run(q, (ks[i % 2], vs[i % 2]), plan, o)
    plan.buffers["packed"][: batch.batch_size].copy_(torch.tensor(lengths, dtype=torch.int32, device="cuda"))
    for o in outs:
        o.fill_(float("nan"))
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    live = [i for i, n in enumerate(lengths) if n > 0]
    counts = [-(-lengths[i] // spec.page_size) for i in live]
    ref_batch = Batch(spec, np.asarray([lengths[i] for i in live], np.int32),
                      np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
                      np.concatenate([batch.kv_indices[batch.kv_indptr[i]:batch.kv_indptr[i] + c]
                                      for i, c in zip(live, counts)]), batch.num_pages)
    ref = reference_torch64(ref_batch, q[live], k, v)
    for o in outs:
        assert rel_err(o[live], ref) <= TOLERANCE["float16"]
        for i in set(range(len(lengths))) - set(live):
            assert bool((o[i] == 0).all()), "a row of 0 tokens must come out as zeros"


def test_auto_route_of_the_backend():
    import torch

    from persistentkv.backends.pkv import PKVWorkqueue

    spec = AttentionSpec(32, 8, 128, 16, "float16")
    backend = PKVWorkqueue(route="auto")
    for lengths, route in (([2048], "cluster"), ([8192], "workqueue"), ([2048, 500], "workqueue")):
        batch, q, k, v = device_case(spec, lengths, seed=len(lengths))
        plan = backend.plan(batch)
        assert plan.route == route
        out = torch.full_like(q, float("nan"))
        backend.run(q, (k, v), plan, out)
        torch.cuda.synchronize()
        assert rel_err(out, reference_torch64(batch, q, k, v)) <= TOLERANCE["float16"]
