"""Programmatic dependent launch (DecodeEngine(pdl=True), the default on sm_90) on the GPU.

The hazard PDL adds: a kernel starts before the preceding kernel has finished. Ours reads only
its work item and page ids before ``griddepcontrol.wait``; Q, the cache, the partial states and
the merge counters come after it. These tests chain layers so that each layer's Q IS the
preceding kernel's output and every layer reuses the same partial-state and counter buffers:
a read or write moved before the wait would see the previous layer's data. The outputs must be
bit-identical to the same chain launched without PDL (same kernels, same arithmetic), eagerly
and under CUDA-graph replay, and the first layer must match float64.

With early_kv (the default) the first stages' K/V loads of every page but each item's last come
before the wait too. The same chains run with and without it (bit-identical again), and a test
writes a new token into each row's last page right before every layer, as a decode step's
append does: every layer must see its own append.
"""

from __future__ import annotations

import pytest

from gpu_support import TOLERANCE, device_case, reference_torch64, rel_err, replay_captured, requires_gpu, run_step
from persistentkv.spec import AttentionSpec

pytestmark = [pytest.mark.gpu, requires_gpu]

ROUTES = ("workqueue", "workqueue_host", "buckets", "split")


def _engines(spec, warps=4, early_kv=True):
    import torch

    from persistentkv.engine import engine_for

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90")
    return engine_for(spec, warps=warps, pdl=False), engine_for(spec, warps=warps, pdl=True, early_kv=early_kv)


def _chain(engine, plan, q0, k, v, layers: int, graph: bool, replan: bool = False):
    """layers calls, layer l's q = layer l-1's output (scaled into a sane range by the kernel's
    own softmax: outputs are convex combinations of V rows); ``replan``: the GPU planner runs
    first, inside the step (and the graph)."""
    import torch

    outs = [torch.full_like(q0, float("nan")) for _ in range(layers)]

    def step():
        if replan:
            engine.replan_device(plan)
        engine.run(q0, (k, v), plan, outs[0])
        for layer in range(1, layers):
            engine.run(outs[layer - 1], (k, v), plan, outs[layer])

    run_step(step, outs, graph)
    return outs


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("early_kv", [False, True], ids=["items-early", "kv-early"])
def test_chained_layers_match_the_plain_launch_bit_for_bit(route, graph, early_kv):
    import torch

    spec = AttentionSpec(32, 8, 128, 16, "float16")
    plain, pdl = _engines(spec, early_kv=early_kv)
    batch, q, k, v = device_case(spec, [9000, 1, 300, 4100, 64, 20000], hole_fraction=0.3, seed=17)
    layers = 12
    ref = _chain(plain, plain.plan(batch, route), q, k, v, layers, graph)
    got = _chain(pdl, pdl.plan(batch, route), q, k, v, layers, graph)
    assert rel_err(got[0], reference_torch64(batch, q, k, v)) <= TOLERANCE["float16"]
    for layer in range(layers):
        assert not torch.isnan(got[layer]).any(), f"layer {layer}: unwritten output"
        assert torch.equal(got[layer], ref[layer]), f"{route} layer {layer}: differs from the launch without PDL"


@pytest.mark.parametrize("warps", [4, 8])
def test_whole_step_with_replan_in_one_graph(warps):
    """GPU plan + chained layers captured together: the first layer after the replan reads its
    items only after the wait (early_ok is False there), the later ones before it."""
    import torch

    spec = AttentionSpec(32, 8, 128, 16, "bfloat16")
    plain, pdl = _engines(spec, warps)
    batch, q, k, v = device_case(spec, [70000, 3, 5000, 129], hole_fraction=0.2, seed=warps)
    results = [_chain(engine, engine.plan(batch, "workqueue"), q, k, v, 8, graph=True, replan=True)
               for engine in (plain, pdl)]
    assert rel_err(results[1][0], reference_torch64(batch, q, k, v)) <= TOLERANCE["bfloat16"]
    for layer, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a, b), f"warps={warps} layer {layer}"


@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("graph", [False, True])
def test_early_loads_see_the_append_into_the_last_page(warps, graph):
    """early_kv: before each layer a torch kernel writes token n-1 of every row (the step's new
    token, in the row's last page) with values of its own; each layer's output must equal float64
    over the cache as that write left it, eagerly and under graph replay."""
    import torch

    spec = AttentionSpec(32, 8, 128, 16, "float16")
    _, early = _engines(spec, warps, early_kv=True)
    assert early.early_kv
    lengths = [4096, 16, 17, 300, 9000, 2049]  # page-boundary lengths and long rows
    batch, q, k, v = device_case(spec, lengths, hole_fraction=0.3, seed=23 + warps)
    layers = 6
    page = torch.tensor([int(batch.kv_indices[batch.kv_indptr[i] + (n - 1) // spec.page_size])
                         for i, n in enumerate(lengths)], device="cuda")
    slot = torch.tensor([(n - 1) % spec.page_size for n in lengths], device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(99)
    new_k = [torch.randn((len(lengths), spec.num_kv_heads, spec.head_dim), generator=gen, device="cuda").half()
             for _ in range(layers)]
    new_v = [torch.randn_like(t) for t in new_k]
    outs = [torch.full_like(q, float("nan")) for _ in range(layers)]
    plan = early.plan(batch, "workqueue")

    def step():
        for layer in range(layers):
            k[page, slot] = new_k[layer]
            v[page, slot] = new_v[layer]
            early.run(q, (k, v), plan, outs[layer])

    step()
    if graph:
        replay_captured(step, outs)
    torch.cuda.synchronize()
    for layer in range(layers):
        k[page, slot] = new_k[layer]
        v[page, slot] = new_v[layer]
        ref = reference_torch64(batch, q, k, v)
        assert rel_err(outs[layer], ref) <= TOLERANCE["float16"], f"layer {layer} missed its own append"
