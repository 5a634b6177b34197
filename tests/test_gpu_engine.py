"""The GPU engine against float64, over every configuration that ships.

One matrix, parametrised over CONFIGS (the 4- and 8-warp modules x every engine route) and the
inputs: dtypes, head dims, group sizes, page sizes with page- and stage-boundary lengths, ragged
batches over scattered pages, empty splits, a 1M-token row, the numerics stress kinds of
tests/numerics.py (large scores, a one-hot softmax, equal keys, the maximum in a row's last page
or at its first token, large values, zero queries); then the GPU planner against the host
planner, plans uploaded behind a busy stream, graph replay over rotated caches, a whole step
(plan + 32 layers) in one graph, the append into a row's last page right before each run, and
groups split past the fused merge's fan-in (two-level merge).

Every case draws fresh random inputs, poisons the output with NaN first (so an unwritten element
fails), and gates every (row, query head) alone, ||out[b, h] - ref[b, h]|| / ||ref[b, h]|| within
the dtype's tolerance, against the float64 reference (tests/gpu_support.py assert_rows_close),
which never looks at a plan. The main matrix runs each case on a contiguous cache and on K/V
interleaved in one [pages, 2, P, Hkv, D] buffer (vLLM's layout: strided K and V views).
"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_support import (LAYOUTS, assert_graph_replay_matches, assert_repeats_bit_exact, assert_rows_close,
                         device_case, reference_torch64, replay_captured, requires_gpu, torch_dtype)
from numerics import KINDS, stress_case
from persistentkv import plan as planner
from persistentkv.cache import Batch, make_batch
from persistentkv.names import ENGINE_ROUTES
from persistentkv.spec import AttentionSpec

pytestmark = [pytest.mark.gpu, requires_gpu]

#: (warps, route): every engine configuration that ships.
CONFIGS = [(w, r) for w in (4, 8) for r in ENGINE_ROUTES]
CONFIG_IDS = [f"w{w}-{r}" for w, r in CONFIGS]


def engine_of(spec, warps=4, **options):
    """The cached engine, or a skip where this GPU cannot hold the 8-warp CTA (192 KB at head_dim
    128 exceeds e.g. an A100's 163 KB opt-in) or the module cannot exist (8 warps at D=256)."""
    from persistentkv.engine import engine_for
    from persistentkv.errors import PKVError

    if warps == 8 and spec.head_dim > 128:
        pytest.skip("no 8-warp module at head_dim > 128")
    try:
        return engine_for(spec, warps=warps, **options)
    except PKVError as exc:
        if "this device allows" in str(exc):
            pytest.skip(str(exc))
        raise


def run_case(spec, lengths, warps=4, route="workqueue", seed=0, hole_fraction=0.25, what="",
             layout="contiguous", **options):
    """One run of ``route`` on fresh inputs (caches in ``layout``), gated per (row, head) against
    float64 at the spec dtype's tolerance; (worst error, out, plan, engine, (batch, q, k, v))."""
    import torch

    engine = engine_of(spec, warps)
    batch, q, k, v = device_case(spec, lengths, hole_fraction, seed, layout)
    plan = engine.plan(batch, route, **options)
    out = torch.full_like(q, float("nan"))
    engine.run(q, (k, v), plan, out)
    torch.cuda.synchronize()
    err = assert_rows_close(out, reference_torch64(batch, q, k, v), spec.dtype, what, seq_lens=batch.seq_lens)
    return err, out, plan, engine, (batch, q, k, v)


def boundary_lengths(P: int) -> list[int]:
    """Page boundaries, 32-token tile, 64- and 128-token stage boundaries, and rows too short to
    fill a stage."""
    return sorted({1, 2, max(P - 1, 1), P, P + 1, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257,
                   3 * P + 5, 1000, 1023, 1025, 3001})


# --------------------------------------------------------------------------- the correctness matrix
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("warps, route", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_dtype_headdim(warps, route, dtype, head_dim, layout):
    spec = AttentionSpec(32, 8, head_dim, 16, dtype)
    run_case(spec, [1, 15, 16, 17, 300, 4096, 777], warps, route, seed=head_dim,
             what=f"{dtype} D={head_dim} w{warps} {route} {layout}", layout=layout)


@pytest.mark.parametrize("warps, route", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("group", [1, 2, 4, 7, 8, 16])
def test_group_sizes(warps, route, group):
    spec = AttentionSpec(4 * group, 4, 128, 16, "float16")
    run_case(spec, [5, 64, 2000, 513], warps, route, seed=group, what=f"G={group} w{warps} {route}")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("warps, route", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("page_size", [1, 8, 16, 32, 64, 128, 256])
def test_page_sizes_and_boundaries(warps, route, page_size, layout):
    spec = AttentionSpec(32, 8, 128, page_size, "float16")
    run_case(spec, boundary_lengths(page_size), warps, route, seed=page_size, hole_fraction=0.5,
             what=f"P={page_size} w{warps} {route} {layout}", layout=layout)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("warps, route", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("batch_size", [2, 64, 256])
def test_ragged_batches(warps, route, batch_size, layout):
    rng = np.random.default_rng(batch_size)
    lengths = rng.integers(1, 9000, size=batch_size)
    spec = AttentionSpec(32, 8, 128, 16, "bfloat16")
    run_case(spec, lengths, warps, route, seed=batch_size, what=f"B={batch_size} w{warps} {route} {layout}",
             layout=layout)


@pytest.mark.parametrize("warps", [4, 8])
def test_empty_splits_in_the_rectangle(warps):
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    # S = 64 splits over rows of 1..3 tiles: most items are empty and must write neutral states.
    _, _, plan, *_ = run_case(spec, [1, 40, 70, 96], warps, "split", what=f"empty splits w{warps}", num_splits=64)
    assert plan.host_plan.counters().nonempty_items < plan.host_plan.num_items


@pytest.mark.parametrize("warps", [4, 8])
def test_million_token_row(warps):
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    run_case(spec, [1 << 20], warps, "workqueue", seed=7, hole_fraction=0.0, what=f"1M tokens, w{warps}")


@pytest.mark.parametrize("warps, route", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_numerics_stress(warps, route, kind, dtype, group):
    """The engine on inputs that stress the softmax and the accumulators, against float64 over
    the same rounded values (tests/numerics.py), with ragged rows at page and stage boundaries."""
    import torch

    spec = AttentionSpec(8 * group, 8, 128, 16, dtype)
    engine = engine_of(spec, warps)
    batch, *host = stress_case(kind, spec, [1, 15, 16, 17, 63, 129, 1000, 4097], seed=group)
    q, k, v = (torch.from_numpy(a).to(device="cuda", dtype=torch_dtype(dtype)) for a in host)
    plan = engine.plan(batch, route)
    out = torch.full_like(q, float("nan"))
    engine.run(q, (k, v), plan, out)
    torch.cuda.synchronize()
    assert_rows_close(out, reference_torch64(batch, q, k, v), dtype, f"{kind} {dtype} G={group} w{warps} {route}",
                      seq_lens=batch.seq_lens)


# --------------------------------------------------------------------------- the modules
@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_module_facts(warps, head_dim):
    """The kernel's own launch facts, and the engine defaults derived from them: 3 stages of
    16 x warps tokens for K and V (2 at head_dim 256), one 8-warp CTA per SM at head_dim 128 (192 KB),
    two 4-warp CTAs or more on sm_90."""
    from persistentkv.launch import min_chunk_tiles_for, stage_tokens

    engine = engine_of(AttentionSpec(32, 8, head_dim, 16, "float16"), warps)
    mod = engine.module
    assert (mod.threads, mod.tile, mod.stages) == (32 * warps, stage_tokens(warps), 2 if head_dim == 256 else 3)
    assert mod.smem_bytes >= 2 * mod.stages * mod.tile * head_dim * 2  # the K and V rings
    assert engine.target_items == mod.occupancy * engine.num_sms
    assert engine.min_chunk_tiles == min_chunk_tiles_for(warps)
    if warps == 8 and head_dim == 128:
        assert mod.occupancy == 1
    if warps == 4 and head_dim <= 128 and engine.capability[0] >= 9:
        assert mod.occupancy >= 2


@pytest.mark.parametrize("warps", [4, 8])
def test_gpu_planner_equals_cpu_planner(warps):
    """pkv_plan's items equal plan.plan_workqueue's on random, bimodal and extreme rows and several
    wave sizes."""
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    engine = engine_of(spec, warps)
    rng = np.random.default_rng(3)
    bimodal = [49152, 4096, 8192, 6144, 40960, 8192, 6144, 7168]
    cases = [rng.integers(1, 70000, size=B) for B in (1, 3, 8, 100, 512, 3000)] + [bimodal, [1, 5, 1 << 20], [4096]]
    for lengths in cases:
        batch = make_batch(spec, lengths)
        for target in (engine.target_items, 64, 1000):
            dev = engine.device_items(engine.plan(batch, "workqueue", target_items=target))
            cpu = planner.plan_workqueue(batch, target_items=target, min_chunk_tiles=engine.min_chunk_tiles)
            np.testing.assert_array_equal(dev, cpu.items, err_msg=f"B={len(lengths)} target={target}")


def test_plans_made_while_the_stream_is_busy_keep_their_own_uploads():
    """Each GPU plan uploads through a pinned staging block that torch's caching host allocator
    recycles once the copy is done. Plans made back to back while the stream is still busy (so
    their copies are queued, not done) must each keep their own lengths and block table: every
    plan's packed upload, counters and items are checked after the stream drains, and a plan's
    output against float64."""
    import torch

    spec = AttentionSpec(32, 8, 128, 16, "float16")
    engine = engine_of(spec)
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
    assert_rows_close(out, reference_torch64(batch, q, k, v), "float16", "plan 5 behind a busy stream",
                      seq_lens=batch.seq_lens)


@pytest.mark.parametrize("route", ["buckets", "split"])
def test_host_route_plans_made_while_the_stream_is_busy_keep_their_own_uploads(route):
    """The host-planned routes upload through DecodeEngine._i32: pinned staging, an asynchronous
    copy, no synchronisation. Plans made back to back behind a busy stream must each keep their
    own items, block table and merge groups (checked against the host planner after the drain),
    and each must compute its own batch's attention."""
    import torch

    spec = AttentionSpec(32, 8, 128, 16, "float16")
    engine = engine_of(spec)
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
        host = plan.host_plan
        np.testing.assert_array_equal(plan.buffers["items"].cpu().numpy()[:host.num_items, :4], host.items,
                                      err_msg=f"plan {i}")
        np.testing.assert_array_equal(plan.buffers["kv_indices"].cpu().numpy()[:batch.kv_indices.size],
                                      batch.kv_indices, err_msg=f"plan {i}")
        assert_rows_close(out, reference_torch64(batch, q, k, v), "float16", f"plan {i}", seq_lens=batch.seq_lens)


def test_run_refuses_a_cache_smaller_than_the_block_table():
    from persistentkv.errors import PKVError

    spec = AttentionSpec(32, 8, 128, 16, "float16")
    _, out, plan, engine, (batch, q, k, v) = run_case(spec, [3000, 900])
    with pytest.raises(PKVError, match="pages; the plan's block table addresses page ids up to"):
        engine.run(q, (k[:-1], v[:-1]), plan, out)


@pytest.mark.parametrize("warps", [4, 8])
def test_repeated_fused_launches_reset_their_counters(warps):
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    _, out, plan, engine, (batch, q, k, v) = run_case(spec, [3000, 9000], warps, what=f"w{warps}")
    assert_repeats_bit_exact(engine, plan, q, k, v, out)


#: the fused merge's fan-in (kernels/pkv_decode.cu MERGE_FANIN): groups above it merge in two levels
MERGE_FANIN = 16


@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("heads, head_dim", [((4, 1), 128), ((8, 1), 128), ((16, 2), 64), ((16, 1), 256)],
                         ids=["G4", "G8", "G8-D64-Hkv2", "G16-D256"])
@pytest.mark.parametrize("target", [15, 16, 17, 31, 32, 33, 200, 264])
def test_groups_split_past_the_fanin_merge_in_two_levels(warps, heads, head_dim, target):
    """One row (and a ragged pair) whose groups split about ``target`` ways, around the fan-in
    and its multiples (a last subgroup of one split at 17 and 33), against float64; the plan must
    really hold groups of that many splits, and repeated launches (the per-slot counters reset
    by their last CTA) must agree bit for bit."""
    import torch

    from persistentkv.engine import DecodeEngine
    from persistentkv.errors import PKVError

    spec = AttentionSpec(heads[0], heads[1], head_dim, 16, "float16")
    if warps == 8 and head_dim > 128:
        pytest.skip("no 8-warp module at head_dim > 128")
    try:
        engine = DecodeEngine(spec, warps=warps, target_items=target * heads[1], min_chunk_tiles=1)
    except PKVError as exc:
        if "this device allows" in str(exc):
            pytest.skip(str(exc))
        raise
    for lengths in ([32 * 64 * target], [40000, 3 * 32 * target + 5]):
        batch, q, k, v = device_case(spec, lengths, 0.3, target)
        plan = engine.plan(batch, "workqueue")
        out = torch.full_like(q, float("nan"))
        engine.run(q, (k, v), plan, out)
        torch.cuda.synchronize()
        nsplit = engine.device_items(plan)[:, 3] >> 16
        if len(lengths) == 1:  # one row: the queue splits its group exactly ``target`` ways
            assert nsplit.max() == target, f"{lengths}: the plan split the group {nsplit.max()} ways"
        assert_rows_close(out, reference_torch64(batch, q, k, v), "float16",
                          f"{lengths} target {target} (max split {nsplit.max()})", seq_lens=batch.seq_lens)
        assert_repeats_bit_exact(engine, plan, q, k, v, out)


def test_refuses_unsupported_specs_before_launch():
    import torch

    from persistentkv.engine import DecodeEngine
    from persistentkv.errors import PKVError

    with pytest.raises(PKVError, match="G=32"):
        DecodeEngine(AttentionSpec(32, 1, 128, 16, "float16"))
    engine = engine_of(AttentionSpec(32, 8, 128, 16, "float16"))
    batch, q, k, v = device_case(engine.spec, [100])
    plan = engine.plan(batch)
    with pytest.raises(PKVError, match="dtype"):
        engine.run(q.float(), (k, v), plan, torch.empty_like(q))
    with pytest.raises(PKVError, match="shape"):
        engine.run(q[:, :16], (k, v), plan, torch.empty_like(q))


# --------------------------------------------------------------------------- graphs
@pytest.mark.parametrize("warps, route", CONFIGS, ids=CONFIG_IDS)
def test_graph_replay_over_rotated_caches(warps, route):
    """A plan captured once, its graph cycling over copies of the cache, replayed three times."""
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    _, _, plan, engine, (batch, q, k, v) = run_case(spec, [1000, 20000, 77], warps, route, seed=5,
                                                    hole_fraction=0.2, what=f"eager w{warps} {route}")
    assert_graph_replay_matches(engine, plan, batch, q, k, v, "float16")


@pytest.mark.parametrize("warps", [4, 8])
def test_whole_step_capture_with_lengths_changed_on_the_device(warps):
    """A step = GPU plan + 32 layers (each its own cache) captured in one graph, replayed after the
    lengths change on the device: no host synchronisation inside."""
    import torch

    spec = AttentionSpec(32, 8, 128, 16, "float16")
    engine = engine_of(spec, warps)
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
        assert_rows_close(outs[layer], ref, "float16", f"layer {layer}", seq_lens=ref_batch.seq_lens)


# --------------------------------------------------------------------------- the step's append
@pytest.mark.parametrize("warps, route", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("append", ["torch", "step_ops"])
def test_each_run_sees_the_append_into_the_last_page(warps, route, graph, append):
    """Before each layer a kernel writes token n-1 of every row (the step's new token, in the row's
    last page) with values of its own, as a decode step's append does: torch's indexed copy, or
    the decode step's own append (model.step_ops.append_kv, which signals its dependents at its
    entry); each layer's output must equal float64 over the cache as that write left it, eagerly
    and under graph replay."""
    import torch

    from persistentkv.model import step_ops

    spec = AttentionSpec(32, 8, 128, 16, "float16")
    engine = engine_of(spec, warps)
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
    plan = engine.plan(batch, route)

    slots = page * spec.page_size + slot  # rows of the caches viewed as [pages * P, Hkv, D]
    k_flat, v_flat = k.view(-1, spec.num_kv_heads, spec.head_dim), v.view(-1, spec.num_kv_heads, spec.head_dim)

    def step():
        for layer in range(layers):
            if append == "torch":
                k[page, slot] = new_k[layer]
                v[page, slot] = new_v[layer]
            else:
                step_ops.append_kv(k_flat, v_flat, slots, new_k[layer], new_v[layer])
            engine.run(q, (k, v), plan, outs[layer])

    step()
    if graph:
        replay_captured(step, outs)
    torch.cuda.synchronize()
    for layer in range(layers):
        k[page, slot] = new_k[layer]
        v[page, slot] = new_v[layer]
        ref = reference_torch64(batch, q, k, v)
        assert_rows_close(outs[layer], ref, "float16", f"layer {layer} (missed its own append?)",
                          seq_lens=batch.seq_lens)
