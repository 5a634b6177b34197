"""The planner, held to its invariants over thousands of random batches (hypothesis).

One example draws a spec, a ragged batch (page-boundary and tile-boundary lengths included) and
route parameters, then plans it with every route and checks each plan with :func:`check_plan`.
The default run covers 200 examples x 9 plans plus a seeded sweep of boundary lengths (about
5,500 checked plans in all); ``PKV_SLOW=1`` adds 5,000 larger examples.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persistentkv.cache import allocate, batch_for_step, make_batch
from persistentkv.errors import PKVError
from persistentkv.plan import (
    MAX_SPLITS, PAPER_PARTIAL_FLOATS_EXTRA, PARTIAL_FLOATS_EXTRA, TILE_TOKENS, Plan,
    balanced_chunk_tiles, length_buckets, make_plan, max_workqueue_items, plan_buckets, plan_split,
    plan_workqueue, split_tile_bounds, unpack_items,
)
from persistentkv.spec import HEAD_DIMS, AttentionSpec
from persistentkv.traces import generate

PAGE_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]


# --------------------------------------------------------------------------- the checker

def _same(a, b) -> None:
    """assert_array_equal without its formatting cost (it dominates thousands of cheap checks)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and np.array_equal(a, b), (a, b)


def check_plan(plan: Plan, batch, *, span: np.ndarray | None = None) -> dict:
    """Assert every planner invariant for ``plan``; return a few derived numbers for callers.

    ``span`` is the token count each row's items must partition (N_i for exact routes, the padded
    bucket length for padded buckets).
    """
    spec = batch.spec
    B, H, G, D = batch.batch_size, spec.num_kv_heads, spec.group_size, spec.head_dim
    N = batch.seq_lens.astype(np.int64)
    span = N if span is None else np.asarray(span, np.int64)
    assert plan.items.dtype == np.int32 and plan.items.ndim == 2 and plan.items.shape[1] == 4
    assert plan.merge_groups.dtype == np.int32 and plan.merge_groups.shape[1:] == (4,)
    assert (plan.items >= 0).all() and (plan.merge_groups >= 0).all()   # packed words never wrap
    _same(plan.row_tokens, span)
    c = {k: v.astype(np.int64) for k, v in unpack_items(plan.items).items()}
    row, head, lo, hi, split, nsplit = c["row"], c["head"], c["tok_lo"], c["tok_hi"], c["split"], c["num_splits"]
    n = plan.num_items
    assert ((row < B) & (head < H)).all()
    assert (lo <= hi).all() and (hi <= span[row]).all()

    # items of a (row, kv head) are one contiguous run, in split order, and every pair has one
    key = row * H + head
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    lengths = np.diff(np.r_[starts, n])
    assert starts.size == B * H and np.unique(key[starts]).size == B * H
    pos = np.arange(n) - np.repeat(starts, lengths)
    _same(split, pos)
    _same(nsplit, np.repeat(lengths, lengths))
    _same(plan.row_splits[row[starts]], lengths)

    # the splits of a run partition [0, span_i): first at 0, each starts where the last ended
    first, last = starts, starts + lengths - 1
    assert (lo[first] == 0).all() and (hi[last] == span[row[last]]).all()
    inner = np.ones(n, bool)
    inner[last] = False
    _same(hi[inner], lo[np.flatnonzero(inner) + 1])
    # ... along the row-local bound over the span's tiles
    T = -(-span[row] // TILE_TOKENS)
    _same(lo, np.minimum(T * split // nsplit * TILE_TOKENS, span[row]))
    _same(hi, np.minimum(T * (split + 1) // nsplit * TILE_TOKENS, span[row]))

    # an item reads only its own row's pages (padded items are clipped to N_i by executors)
    P = spec.page_size
    read_hi = np.minimum(hi, N[row])
    nonempty_read = read_hi > lo
    page_lo = batch.kv_indptr[row] + lo // P
    page_hi = batch.kv_indptr[row] + -(-read_hi // P)
    assert (page_lo[nonempty_read] >= batch.kv_indptr[row][nonempty_read]).all()
    assert (page_hi[nonempty_read] <= batch.kv_indptr[row + 1][nonempty_read]).all()

    # merge groups: exactly the runs with more than one split, pointing at their split 0
    multi = lengths > 1
    expected_groups = np.stack([row[starts], head[starts], starts, lengths], axis=1)[multi]
    got = plan.merge_groups.astype(np.int64)
    assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, expected_groups.tolist()))

    # launches: decode/fused ones tile the item array in order; each merge launch follows its
    # decode launch and merges only groups whose items that launch wrote
    compute = [l for l in plan.launches if l.kind in ("decode", "fused")]
    assert [l.start for l in compute] == [0] + [l.stop for l in compute[:-1]] and compute[-1].stop == n
    kinds = {l.kind for l in plan.launches}
    assert kinds <= {"decode", "merge", "fused"} and not ({"decode", "fused"} <= kinds)
    merges = [l for l in plan.launches if l.kind == "merge"]
    if merges:
        assert [l.start for l in merges] == [0] + [l.stop for l in merges[:-1]]
        assert merges[-1].stop == plan.merge_groups.shape[0]
        for i, launch in enumerate(plan.launches):
            if launch.kind == "merge":
                decode = plan.launches[i - 1]
                assert decode.kind == "decode"
                slots = got[launch.start:launch.stop]
                assert (slots[:, 2] >= decode.start).all() and (slots[:, 2] + slots[:, 3] <= decode.stop).all()
    if "decode" in kinds:   # unfused: a decode launch needs a merge launch iff it wrote partials
        for i, launch in enumerate(plan.launches):
            if launch.kind == "decode":
                needs = bool((nsplit[launch.start:launch.stop] > 1).any())
                follows = i + 1 < len(plan.launches) and plan.launches[i + 1].kind == "merge"
                assert needs == follows

    # counters add up
    cnt = plan.counters()
    bpt = spec.kv_bytes_per_token
    partials = int(lengths[multi].sum())
    assert cnt.launches == len(plan.launches)
    assert cnt.decode_ctas == sum(l.size for l in compute) == n
    assert cnt.merge_ctas == sum(l.size for l in merges) == int(multi.sum()) * (0 if plan.fused_merge else 1)
    assert cnt.nonempty_items == int((hi > lo).sum())
    assert cnt.useful_kv_bytes == int(N.sum()) * bpt
    assert cnt.padded_kv_bytes == int((span - N).sum()) * bpt
    assert cnt.merge_state_bytes == partials * G * 4 * (D + PARTIAL_FLOATS_EXTRA)
    assert cnt.paper_merge_state_bytes == partials * G * 4 * (D + PAPER_PARTIAL_FLOATS_EXTRA)
    assert cnt.h2d_bytes == plan.items.nbytes + plan.merge_groups.nbytes
    return {"runs": lengths, "nonempty": hi > lo}


# --------------------------------------------------------------------------- random cases

def _special_lengths(page_size: int) -> list[int]:
    values = {1, page_size - 1, page_size, page_size + 1, 2 * page_size + 1}
    for m in (1, 2, 3, 32, 127, 128):
        values |= {TILE_TOKENS * m - 1, TILE_TOKENS * m, TILE_TOKENS * m + 1}
    return sorted(v for v in values if 1 <= v <= 5000)


@st.composite
def planner_cases(draw, max_rows: int = 10, max_splits: int = 64):
    page_size = draw(st.sampled_from(PAGE_SIZES))
    hkv = draw(st.sampled_from([1, 2, 4, 8]))
    group = draw(st.sampled_from([1, 2, 4, 8]))
    spec = AttentionSpec(num_qo_heads=hkv * group, num_kv_heads=hkv,
                         head_dim=draw(st.sampled_from(HEAD_DIMS)), page_size=page_size)
    length = st.one_of(st.integers(1, 5000), st.sampled_from(_special_lengths(page_size)))
    lengths = draw(st.lists(length, min_size=1, max_size=max_rows))
    if draw(st.booleans()) and len(lengths) > 1:   # repeated lengths make multi-row buckets
        lengths = lengths[: len(lengths) // 2] * 2
    batch = make_batch(spec, lengths, draw(st.sampled_from([0.0, 0.5])), draw(st.integers(0, 2**20)))
    return {
        "batch": batch,
        "splits": draw(st.integers(1, max_splits)),
        "target": draw(st.integers(1, 700)),
        "min_chunk": draw(st.sampled_from([1, 1, 2, 4])),
        "bucket": draw(st.sampled_from([1, 16, 100, 512, 2048, 8192])),
    }


def check_all_routes(case) -> int:
    """Plan ``case`` with every route and check each; returns how many plans were checked."""
    batch, S = case["batch"], case["splits"]
    B, H = batch.batch_size, batch.spec.num_kv_heads
    N = batch.seq_lens.astype(np.int64)
    T = -(-N // TILE_TOKENS)
    checked = 0
    for fused in (False, True):
        rect = plan_split(batch, S, fused_merge=fused)
        check_plan(rect, batch)
        assert rect.num_items == B * H * S                     # the full rectangle
        assert rect.counters().nonempty_items == H * int(np.minimum(T, S).sum())
        assert len(rect.launches) == (1 if fused or S == 1 else 2)

        exact = plan_buckets(batch, S, fused_merge=fused)
        check_plan(exact, batch)
        assert exact.num_items == B * H * S
        distinct = len(set(N.tolist()))
        assert len(exact.launches) == distinct * (1 if fused or S == 1 else 2)

        wq = plan_workqueue(batch, num_splits=S, fused_merge=fused)   # fixed S, empties dropped
        info = check_plan(wq, batch)
        assert info["nonempty"].all()
        _same(wq.row_splits, np.minimum(S, T))
        checked += 3

    padded = plan_buckets(batch, S, bucket_tokens=case["bucket"])
    span = -(-N // case["bucket"]) * case["bucket"]
    check_plan(padded, batch, span=span)
    assert padded.route == "padded_buckets" and len(padded.launches) <= 2 * len(set(span.tolist()))

    balanced = plan_workqueue(batch, target_items=case["target"], min_chunk_tiles=case["min_chunk"])
    info = check_plan(balanced, batch)
    assert info["nonempty"].all()                               # no empty work-queue item
    assert balanced.num_items <= max_workqueue_items(B, H, case["target"])
    chunk = balanced.params["chunk_tiles"]
    assert chunk >= case["min_chunk"] and chunk == balanced_chunk_tiles(T, H, case["target"], case["min_chunk"])
    _same(balanced.row_splits, -(-T // chunk))
    # the smallest chunk that fits: one tile less would overflow the waves (or the minimum)
    cap = max_workqueue_items(B, H, case["target"])
    assert chunk == case["min_chunk"] or H * int((-(-T // (chunk - 1))).sum()) > cap
    # the closed form (every row's ceil() paid up front) always fits, so it bounds the chunk
    closed = max(case["min_chunk"], -(-(H * int(T.sum())) // (cap - B * H)))
    assert chunk <= closed and H * int((-(-T // closed)).sum()) <= cap
    assert len(balanced.launches) == 1 and balanced.launches[0].kind == "fused"

    balanced2 = plan_workqueue(batch, target_items=case["target"], fused_merge=False)
    check_plan(balanced2, batch)
    return checked + 3


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=planner_cases())
def test_every_route_on_random_batches(case):
    check_all_routes(case)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PKV_SLOW"), reason="slow sweep (~1 min): set PKV_SLOW=1 to run it")
@settings(max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=planner_cases(max_rows=64, max_splits=256))
def test_every_route_on_random_batches_slow(case):
    check_all_routes(case)


def test_seeded_sweep_of_boundary_lengths():
    """Deterministic companion to the hypothesis run: every boundary length, alone and mixed."""
    rng = np.random.default_rng(20260622)
    checked = 0
    for page_size in PAGE_SIZES:
        special = _special_lengths(page_size)
        spec = AttentionSpec(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=page_size)
        for n in special:
            for S in (1, 33):
                case = {"batch": make_batch(spec, [n]), "splits": S, "target": 16, "min_chunk": 1, "bucket": 64}
                checked += check_all_routes(case)
        for _ in range(4):
            lengths = rng.choice(special, size=int(rng.integers(2, 9)))
            case = {"batch": make_batch(spec, lengths, 0.5, int(rng.integers(1000))),
                    "splits": int(rng.integers(1, 40)), "target": int(rng.integers(1, 300)),
                    "min_chunk": 1, "bucket": 2048}
            checked += check_all_routes(case)
    assert checked > 3000


# --------------------------------------------------------------------------- worked numbers and facts

def closed_form(tiles, heads, target, min_chunk=1) -> int:
    """The chunk that pays every row's ceil() up front: ceil(Hkv * sum T / (cap - B * Hkv))."""
    cap = max_workqueue_items(len(tiles), heads, target)
    return max(min_chunk, -(-(heads * sum(tiles)) // (cap - len(tiles) * heads)))


def test_balanced_chunk_worked_numbers():
    # B=1 at 4096 tokens (128 tiles), Hkv=8, target 264: room 264 - 8 = 256, ceil(1024 / 256) = 4
    assert balanced_chunk_tiles([128], 8, 264) == 4 == closed_form([128], 8, 264)
    plan = plan_workqueue(make_batch(AttentionSpec(), [4096]), target_items=264)
    assert plan.row_splits.tolist() == [32] and plan.num_items == 256
    assert plan.counters().launches == 1
    # B=4 x 32768 (1024 tiles each): closed form ceil(8 * 4096 / 232) = 142; the smallest chunk
    # that fits is 128 (8 * 4 * ceil(1024 / 128) = 256 <= 264; 127 would need 9 splits: 288); S_i = 8
    assert closed_form([1024] * 4, 8, 264) == 142
    plan = plan_workqueue(make_batch(AttentionSpec(), [32768] * 4), target_items=264)
    assert plan.params["chunk_tiles"] == 128 and plan.row_splits.tolist() == [8] * 4
    assert plan.num_items == 256 <= max_workqueue_items(4, 8, 264) == 264


def test_min_chunk_fills_the_wave_on_ragged_rows():
    """The B=8 bimodal-like row set of bench-kernels: the closed form leaves 32 of 264 slots empty
    with items of up to 5120 tokens (a chunk of 163 tiles); the smallest fitting chunk, 128 tiles, fills all
    264 with items of at most 4096 tokens."""
    lens = [49152, 4096, 8192, 6144, 40960, 8192, 6144, 7168]
    batch = make_batch(AttentionSpec(), lens)
    tiles = [-(-n // TILE_TOKENS) for n in lens]
    closed = closed_form(tiles, 8, 264, 2)
    splits = [-(-t // closed) for t in tiles]
    longest = max(min(n, split_tile_bounds(t, S, s)[1] * TILE_TOKENS) - split_tile_bounds(t, S, s)[0] * TILE_TOKENS
                  for n, t, S in zip(lens, tiles, splits) for s in range(S))
    assert (closed, 8 * sum(splits), longest) == (163, 232, 5120)
    plan = plan_workqueue(batch, target_items=264, min_chunk_tiles=2)
    cols = unpack_items(plan.items)
    assert (plan.params["chunk_tiles"], plan.num_items, int((cols["tok_hi"] - cols["tok_lo"]).max())) == (128, 264, 4096)


@settings(max_examples=300, deadline=None)
@given(tiles=st.lists(st.integers(0, 5000), min_size=1, max_size=70), heads=st.integers(1, 16),
       target=st.integers(1, 600), min_chunk=st.integers(1, 8))
def test_min_chunk_is_the_brute_force_minimum(tiles, heads, target, min_chunk):
    """Bisection equals a linear scan for the smallest chunk that fits, on lists and arrays alike."""
    cap = max_workqueue_items(len(tiles), heads, target)
    closed = closed_form(tiles, heads, target, min_chunk)
    assert heads * sum(-(-t // closed) for t in tiles) <= cap                  # the closed form fits
    brute = next(c for c in range(min_chunk, closed + 1) if heads * sum(-(-t // c) for t in tiles) <= cap)
    assert balanced_chunk_tiles(tiles, heads, target, min_chunk) == brute
    assert balanced_chunk_tiles(np.asarray(tiles, dtype=np.int64), heads, target, min_chunk) == brute


def test_published_fan_out_on_bimodal_b8():
    """Exact-length buckets launch a decode + merge pair per distinct length; the queue launches 2."""
    spec = AttentionSpec()
    trace = generate("bimodal", 20260622, 24, 8, 48)
    alloc = allocate(trace.requests, spec.page_size, 0.0, trace.seed)
    full = 0
    for step in trace.steps:
        batch = batch_for_step(spec, alloc, step)
        buckets = plan_buckets(batch, 20).counters()
        queue = plan_workqueue(batch, num_splits=20, fused_merge=False).counters()
        assert buckets.launches == 2 * len(set(step.lengths))
        assert queue.launches == 2 and plan_workqueue(batch, target_items=264).counters().launches == 1
        # with S <= T_i for every row the fixed-S queue is the full rectangle (weakness 4)
        assert queue.decode_ctas == plan_split(batch, 20).counters().decode_ctas
        full += step.batch_size == 8 and len(set(step.lengths)) == 8
    assert full > 0   # steps with 8 rows of 8 distinct lengths exist: 16 launches -> 2


def test_length_buckets_order_and_padding():
    assert [(k, r.tolist()) for k, r in length_buckets(np.array([5, 9, 5, 3]))] == [(5, [0, 2]), (9, [1]), (3, [3])]
    assert [(k, r.tolist()) for k, r in length_buckets(np.array([5, 9, 17, 3]), 8)] == [(8, [0, 3]), (16, [1]), (24, [2])]
    with pytest.raises(PKVError, match="bucket_tokens"):
        length_buckets(np.array([5]), 0)


def test_make_plan_dispatch_and_errors():
    batch = make_batch(AttentionSpec(), [100, 2000])
    assert make_plan(batch, "split", num_splits=4).route == "split"
    assert make_plan(batch, "buckets", num_splits=4).route == "buckets"
    assert make_plan(batch, "padded_buckets", num_splits=4, bucket_tokens=1024).route == "padded_buckets"
    assert make_plan(batch, "workqueue", target_items=64).route == "workqueue"
    with pytest.raises(PKVError, match="unknown route 'rectangle'"):
        make_plan(batch, "rectangle")
    with pytest.raises(PKVError, match="padded_buckets needs bucket_tokens"):
        make_plan(batch, "padded_buckets", num_splits=4)
    with pytest.raises(PKVError, match="exactly one of target_items and num_splits"):
        plan_workqueue(batch)
    with pytest.raises(PKVError, match="exactly one of target_items and num_splits"):
        plan_workqueue(batch, target_items=4, num_splits=4)
    for bad in (0, MAX_SPLITS + 1, 2.5, True):
        with pytest.raises(PKVError, match="num_splits must be an integer"):
            plan_split(batch, bad)
    for bad in (0, 2.7, "5", True):
        with pytest.raises(PKVError, match="target_items must be an integer >= 1"):
            plan_workqueue(batch, target_items=bad)
    for bad in (0, "2", 1.5):
        with pytest.raises(PKVError, match="min_chunk_tiles must be an integer >= 1"):
            plan_workqueue(batch, target_items=64, min_chunk_tiles=bad)
    for bad in (2.5, "16", 0):
        with pytest.raises(PKVError, match="bucket_tokens must be an integer >= 1"):
            make_plan(batch, "padded_buckets", num_splits=4, bucket_tokens=bad)
    with pytest.raises(PKVError, match="route split takes num_splits, fused_merge; not target_items"):
        make_plan(batch, "split", num_splits=4, target_items=64)
    with pytest.raises(PKVError, match="route split: missing a required argument: 'num_splits'"):
        make_plan(batch, "split")
    with pytest.raises(PKVError, match="the planner takes a cache.Batch, got NoneType"):
        make_plan(None, "split", num_splits=4)


def test_largest_split_count_stays_packable():
    spec = AttentionSpec(num_qo_heads=1, num_kv_heads=1, head_dim=64, page_size=16)
    plan = plan_split(make_batch(spec, [100]), MAX_SPLITS)
    assert int(unpack_items(plan.items)["num_splits"].min()) == MAX_SPLITS
    assert plan.merge_groups.tolist() == [[0, 0, 0, MAX_SPLITS]]
    long_row = make_batch(spec, [TILE_TOKENS * (MAX_SPLITS + 1)])
    with pytest.raises(PKVError, match="more than"):
        plan_workqueue(long_row, target_items=10**9)


def test_plan_is_frozen_and_shapes_documented():
    plan = plan_workqueue(make_batch(AttentionSpec(), [33, 1]), target_items=8)
    with pytest.raises(Exception):
        plan.route = "split"
    assert plan.row_tokens.dtype == np.int64 and plan.row_splits.dtype == np.int32
    assert math.prod(plan.items.shape) == plan.num_items * 4


def test_checker_catches_corrupted_plans():
    """check_plan is only worth its passes if it fails on broken plans: corrupt one in each way."""
    import dataclasses

    batch = make_batch(AttentionSpec(num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=16), [100, 700, 33])
    good = plan_split(batch, 4)
    check_plan(good, batch)

    def corrupt(items=None, merge_groups=None, launches=None):
        return dataclasses.replace(good, items=good.items if items is None else items,
                                   merge_groups=good.merge_groups if merge_groups is None else merge_groups,
                                   launches=good.launches if launches is None else launches)

    shifted = good.items.copy()
    shifted[1, 2] += TILE_TOKENS           # split 0 ends past where split 1 starts
    swapped = good.items.copy()
    swapped[[0, 1]] = swapped[[1, 0]]      # splits out of order
    overlong = good.items.copy()
    overlong[3, 2] += 1                    # last split runs past N_0
    groups = good.merge_groups.copy()
    groups[0, 3] -= 1                      # merges one split too few
    broken = [corrupt(items=shifted), corrupt(items=swapped), corrupt(items=overlong),
              corrupt(items=good.items[:-1]), corrupt(merge_groups=groups),
              corrupt(merge_groups=good.merge_groups[1:]), corrupt(launches=good.launches[:1])]
    for plan in broken:
        with pytest.raises(AssertionError):
            check_plan(plan, batch)
