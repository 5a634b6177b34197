"""The development per-warp pipeline (engine defines=("PKV_WARPRING=1",): each warp loads the 16
token rows it computes and waits only for its own loads, no CTA barrier per tile) on the GPU.

The define changes only which thread issues each load and how the loads are waited for, not what
any thread computes, so its
outputs must equal the shipped kernel's bit for bit on the same plan: over dtypes, G, page sizes,
head dims, ragged rows ending anywhere in a page or a stage, scattered pages, every route, and
PDL chains whose layers feed each other (with early K/V loads, eagerly and under graph replay);
and the first layer must match float64. Every output starts as NaN, so an unwritten element fails.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_support import TOLERANCE, device_case, reference_torch64, rel_err, requires_gpu, run_step
from persistentkv.spec import AttentionSpec

pytestmark = [pytest.mark.gpu, requires_gpu]

WARPRING = ("PKV_WARPRING=1",)


def engines(spec, warps, **options):
    """(shipped, per-warp ring) engines of the same shape and options."""
    from persistentkv.engine import engine_for
    from persistentkv.errors import PKVError

    try:
        return engine_for(spec, warps=warps, **options), engine_for(spec, warps=warps, defines=WARPRING, **options)
    except PKVError as exc:  # e.g. an 8-warp CTA this GPU cannot hold
        if "this device allows" in str(exc):
            pytest.skip(str(exc))
        raise


def outputs(spec, lengths, warps, route="workqueue", seed=0, hole_fraction=0.3, **plan_options):
    import torch

    batch, q, k, v = device_case(spec, lengths, hole_fraction, seed)
    outs = []
    for engine in engines(spec, warps):
        plan = engine.plan(batch, route, **plan_options)
        out = torch.full_like(q, float("nan"))
        engine.run(q, (k, v), plan, out)
        outs.append(out)
    torch.cuda.synchronize()
    return outs, rel_err(outs[1], reference_torch64(batch, q, k, v))


def stage_lengths(P: int) -> list[int]:
    """Row ends in every position of a page and of a 64- or 128-token stage, and long rows."""
    return sorted({1, 15, 16, 17, P - 1, P, P + 1, 63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 257,
                   383, 385, 1000, 3001, 8191, 20000})


@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("G", [1, 4, 7])
def test_warpring_equals_the_shipped_kernel_and_float64(warps, dtype, G):
    import torch

    spec = AttentionSpec(8 * G, 8, 128, 16, dtype)
    (shipped, ring), err = outputs(spec, stage_lengths(16), warps, seed=G)
    assert not torch.isnan(ring).any()
    assert err <= TOLERANCE[dtype], err
    assert torch.equal(ring, shipped)


@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("P", [8, 32, 128])
@pytest.mark.parametrize("route", ["workqueue", "workqueue_host", "split", "buckets", "cluster"])
def test_warpring_page_sizes_and_routes(warps, P, route):
    import torch

    if route == "cluster" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the cluster route needs sm_90")
    spec = AttentionSpec(32, 8, 128, P, "float16")
    options = {"cluster_size": 2} if route == "cluster" else {}
    (shipped, ring), err = outputs(spec, stage_lengths(P), warps, route=route, seed=P, **options)
    assert err <= TOLERANCE["float16"], err
    assert torch.equal(ring, shipped)


@pytest.mark.parametrize("head_dim", [64, 256])
def test_warpring_other_head_dims(head_dim):
    import torch

    spec = AttentionSpec(32, 8, head_dim, 16, "float16")
    (shipped, ring), err = outputs(spec, stage_lengths(16), 4, seed=head_dim)
    assert err <= TOLERANCE["float16"], err
    assert torch.equal(ring, shipped)


@pytest.mark.parametrize("warps", [4, 8])
def test_warpring_long_rows_and_a_wide_batch(warps):
    import torch

    spec = AttentionSpec(32, 8, 128, 16, "float16")
    rng = np.random.default_rng(warps)
    for lengths, seed in (([131072 + 5], 1), (rng.integers(1, 9000, size=96).tolist(), 2)):
        (shipped, ring), err = outputs(spec, lengths, warps, seed=seed, hole_fraction=0.5)
        assert err <= TOLERANCE["float16"], err
        assert torch.equal(ring, shipped)


@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("graph", [False, True])
def test_warpring_pdl_chain_with_early_loads(warps, graph):
    """Layers chained under PDL with early K/V loads (layer l's q = layer l-1's output, the same
    partial states and counters reused), eagerly and as a replayed graph: bit-identical to the
    shipped kernel's chain."""
    import torch

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90")
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    batch, q, k, v = device_case(spec, [9000, 1, 300, 4100, 64, 20000], hole_fraction=0.3, seed=17 + warps)
    layers = 8
    chains = []
    for engine in engines(spec, warps, pdl=True, early_kv=True):
        plan = engine.plan(batch, "workqueue")
        outs = [torch.full_like(q, float("nan")) for _ in range(layers)]

        def step(engine=engine, plan=plan, outs=outs):
            engine.run(q, (k, v), plan, outs[0])
            for layer in range(1, layers):
                engine.run(outs[layer - 1], (k, v), plan, outs[layer])

        run_step(step, outs, graph)
        chains.append(outs)
    assert rel_err(chains[1][0], reference_torch64(batch, q, k, v)) <= TOLERANCE["float16"]
    for layer, (a, b) in enumerate(zip(*chains)):
        assert not torch.isnan(b).any(), f"layer {layer}: unwritten output"
        assert torch.equal(a, b), f"warps={warps} layer {layer}: differs from the shipped kernel"
