"""The paged cache: page allocation with holes (as published), block tables, batches, fills."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persistentkv import cache
from persistentkv.cache import (
    Batch, allocate, batch_for_step, check_hole_fraction, make_batch, numpy_dtype, random_cache,
    random_queries,
)
from persistentkv.errors import PKVError
from persistentkv.spec import MAX_SEQ_LEN, AttentionSpec
from persistentkv.traces import Request, TorchCompatibleRNG, generate

PAGE_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def _requests(prompts, decodes=None):
    decodes = decodes or [0] * len(prompts)
    return tuple(Request(i, 0, p, d) for i, (p, d) in enumerate(zip(prompts, decodes)))


@pytest.mark.parametrize("rho", [0.0, 0.5])
def test_allocation_follows_the_published_rule(rho):
    trace = generate("bimodal", 20260622, 24, 8, 48)
    page_size, seed = 16, 20260622
    alloc = allocate(trace.requests, page_size, rho, seed)
    reserved = [math.ceil((r.prompt_len + r.decode_steps) / page_size) for r in trace.requests]
    total = sum(reserved)
    assert alloc.num_pages == math.ceil(total / (1 - rho))
    # each request (id order) takes the next consecutive slice of randperm(universe, seed + 99)
    perm = TorchCompatibleRNG(seed + 99).randperm(alloc.num_pages)
    cursor = 0
    for r, count in zip(trace.requests, reserved):
        np.testing.assert_array_equal(alloc.pages[r.id], perm[cursor:cursor + count])
        cursor += count
    used = np.concatenate([alloc.pages[r.id] for r in trace.requests])
    assert used.size == total and np.unique(used).size == total          # pages unique
    assert used.min() >= 0 and used.max() < alloc.num_pages
    assert alloc.num_pages - total == pytest.approx(rho * alloc.num_pages, abs=1)   # the holes
    # physical ids are scattered: logical neighbours are almost never physical neighbours
    adjacent = np.mean([np.mean(np.diff(alloc.pages[r.id].astype(np.int64)) == 1) for r in trace.requests])
    assert adjacent < 0.01


def test_allocation_matches_torch_randperm():
    torch = pytest.importorskip("torch", reason="torch is not installed; tests/fixtures covers randperm")
    trace = generate("uniform", 20260623, 8, 8)
    alloc = allocate(trace.requests, 16, 0.5, 20260623)
    perm = torch.randperm(alloc.num_pages, generator=torch.Generator().manual_seed(20260623 + 99)).numpy()
    np.testing.assert_array_equal(np.concatenate([alloc.pages[r.id] for r in trace.requests]),
                                  perm[:sum(a.size for a in alloc.pages.values())])


def test_hole_fraction_bounds():
    for rho in (-0.1, 0.96, 1.0, float("nan")):
        with pytest.raises(PKVError, match="hole_fraction"):
            check_hole_fraction(rho)
    for rho in ("0.5", True, None):
        with pytest.raises(PKVError, match="hole_fraction must be a number"):
            check_hole_fraction(rho)
    assert check_hole_fraction(0) == 0.0 and check_hole_fraction(0.95) == 0.95


@settings(max_examples=80, deadline=None)
@given(lengths=st.lists(st.integers(1, 3000), min_size=1, max_size=10),
       page_size=st.sampled_from(PAGE_SIZES), rho=st.sampled_from([0.0, 0.25, 0.5]),
       seed=st.integers(0, 2**31))
def test_block_table_covers_exactly_ceil_n_over_p(lengths, page_size, rho, seed):
    spec = AttentionSpec(page_size=page_size)
    batch = make_batch(spec, lengths, rho, seed)
    counts = np.diff(batch.kv_indptr)
    assert counts.tolist() == [math.ceil(n / page_size) for n in lengths]
    assert batch.kv_indices.dtype == np.int32 and batch.kv_indptr.dtype == np.int32
    assert np.unique(batch.kv_indices).size == batch.kv_indices.size
    assert batch.kv_indices.max() < batch.num_pages
    assert batch.last_page_len.tolist() == [(n - 1) % page_size + 1 for n in lengths]
    table = batch.padded_block_table(fill=-1)
    for i, n in enumerate(counts):
        np.testing.assert_array_equal(table[i, :n], batch.kv_indices[batch.kv_indptr[i]:batch.kv_indptr[i + 1]])
        assert (table[i, n:] == -1).all()
    assert batch.kv_bytes == sum(lengths) * spec.kv_bytes_per_token


def test_batches_of_a_trace_grow_one_token_per_step():
    spec = AttentionSpec()
    trace = generate("zipf", 20260624, 24, 8, 48)
    alloc = allocate(trace.requests, spec.page_size, 0.0, trace.seed)
    previous = {}
    for step in trace.steps:
        batch = batch_for_step(spec, alloc, step)
        assert batch.seq_lens.tolist() == list(step.lengths)
        for row, rid in enumerate(step.request_ids):
            pages = batch.kv_indices[batch.kv_indptr[row]:batch.kv_indptr[row + 1]]
            np.testing.assert_array_equal(pages, alloc.pages[rid][:pages.size])   # a prefix of its pages
            if rid in previous:
                assert step.lengths[row] == previous[rid] + 1
            previous[rid] = step.lengths[row]


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("heads", [(8, 8), (32, 8), (16, 2)])
def test_random_cache_and_queries(head_dim, heads):
    spec = AttentionSpec(num_qo_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim, page_size=8)
    k, v = random_cache(spec, 5, seed=3)
    assert k.shape == v.shape == (5, 8, heads[1], head_dim) and k.dtype == np.float16
    assert not np.array_equal(k, v)
    k2, _ = random_cache(spec, 5, seed=3)
    np.testing.assert_array_equal(k, k2)
    q = random_queries(spec, 3, seed=3)
    assert q.shape == (3, heads[0], head_dim) and q.dtype == np.float16


def test_numpy_dtype_for_bfloat16_is_a_clear_error():
    with pytest.raises(PKVError, match="bfloat16"):
        numpy_dtype("bfloat16")


@pytest.mark.parametrize("lengths, message", [
    ([4, 0, 3], "lengths\\[1\\] = 0 is out of range \\[1, 2147483520\\]"),
    ([-5], "lengths\\[0\\] = -5 is out of range"),
    ([], "at least one row"),
    ([3.7], "lengths must be integers, got float64 values such as 3.7"),
    (np.array([MAX_SEQ_LEN + 1]), f"lengths\\[0\\] = {MAX_SEQ_LEN + 1} is out of range"),
])
def test_make_batch_rejects_bad_lengths(lengths, message):
    with pytest.raises(PKVError, match=message) as info:
        make_batch(AttentionSpec(), lengths)
    assert "\n" not in str(info.value)


def test_batch_validation_errors():
    spec = AttentionSpec(page_size=4)
    ok = make_batch(spec, [5, 9])
    cases = [
        (dict(seq_lens=np.array([5, 0])), "seq_lens\\[1\\] = 0 is out of range"),
        (dict(seq_lens=np.array([5.0, 9.0])), "seq_lens must be integers"),
        (dict(kv_indptr=np.array([0, 2])), "kv_indptr must have shape \\[3\\]"),
        (dict(kv_indptr=np.array([0, 1, 5])), "row 0 lists 1 pages but its length needs 2"),
        (dict(kv_indptr=np.array([0, 2, 2**31])), "kv_indptr\\[2\\] = 2147483648 is out of range"),
        (dict(kv_indices=ok.kv_indices[:-1]), "kv_indices length"),
        (dict(num_pages=2), "kv_indices \\(page ids\\)\\[\\d\\] = \\d is out of range \\[0, 1\\]"),
        (dict(num_pages=np.int64(2**31 + 1)), "num_pages must be an integer in \\[1, 2147483648\\]"),
        (dict(num_pages=True), "num_pages must be an integer"),
    ]
    for change, message in cases:
        fields = dict(spec=spec, seq_lens=ok.seq_lens, kv_indptr=ok.kv_indptr, kv_indices=ok.kv_indices,
                      num_pages=ok.num_pages)
        fields.update(change)
        with pytest.raises(PKVError, match=message):
            Batch(**fields)


def test_allocation_table_rejects_rows_longer_than_reserved():
    alloc = allocate(_requests([10]), 4, 0.0, 0)
    with pytest.raises(PKVError, match="request 0 needs 4 pages but reserved 3"):
        alloc.table([0], [13])


def test_spec_and_allocation_page_sizes_must_agree():
    trace = generate("uniform", 1, 2, 2, 1)
    alloc = allocate(trace.requests, 32, 0.0, 1)
    with pytest.raises(PKVError, match="page_size"):
        batch_for_step(AttentionSpec(page_size=16), alloc, trace.steps[0])


def test_integer_arrays_of_any_integer_dtype_are_accepted_and_stored_as_int32():
    spec = AttentionSpec(page_size=4)
    ok = make_batch(spec, [5, 9])
    for dtype in (np.int64, np.uint16, np.uint64, np.int32):
        batch = Batch(spec, ok.seq_lens.astype(dtype), ok.kv_indptr.astype(dtype), ok.kv_indices.astype(dtype),
                      np.int64(ok.num_pages))
        for field in (batch.seq_lens, batch.kv_indptr, batch.kv_indices):
            assert field.dtype == np.int32
        assert type(batch.num_pages) is int and batch.kv_indices.tolist() == ok.kv_indices.tolist()
    listed = Batch(spec, [5, 9], ok.kv_indptr.tolist(), ok.kv_indices.tolist(), ok.num_pages)
    assert listed.seq_lens.tolist() == [5, 9]


def test_the_longest_row_is_accepted_and_one_more_token_refused():
    spec = AttentionSpec(page_size=256)
    pages = -(-MAX_SEQ_LEN // 256)
    indices = np.arange(pages, dtype=np.int32)
    batch = Batch(spec, np.array([MAX_SEQ_LEN]), np.array([0, pages]), indices, pages)
    assert batch.max_len == MAX_SEQ_LEN == 2**31 - 128
    with pytest.raises(PKVError, match=f"seq_lens\\[0\\] = {MAX_SEQ_LEN + 1} is out of range"):
        Batch(spec, np.array([MAX_SEQ_LEN + 1]), np.array([0, pages]), indices, pages)


def test_allocation_universe_cap(monkeypatch):
    """The shuffle is refused, with what it would need, before the loop runs; at the cap it runs."""
    monkeypatch.setattr(cache, "MAX_ALLOCATION_PAGES", 10)
    assert allocate(_requests([40]), 4, 0.0, 0).num_pages == 10
    with pytest.raises(PKVError, match="a universe of 11 pages \\(11 reserved, hole fraction 0.0\\), more than "
                                       "the 10 the allocator shuffles"):
        allocate(_requests([41]), 4, 0.0, 0)
    with pytest.raises(PKVError, match="a universe of 20 pages \\(10 reserved, hole fraction 0.5\\)"):
        allocate(_requests([40]), 4, 0.5, 0)


def test_a_step_table_covers_only_its_rows_and_names_what_is_missing():
    alloc = allocate(_requests([10, 20]), 4, 0.0, 0)
    indptr, indices = alloc.table(np.array([1], dtype=np.uint8), [17])
    assert indptr.tolist() == [0, 5] and indices.tolist() == alloc.pages[1][:5].tolist()
    with pytest.raises(PKVError, match="2 request ids but 1 lengths"):
        alloc.table([0, 1], [3])
    with pytest.raises(PKVError, match="request 5 has no pages in this allocation"):
        alloc.table([5], [3])


def test_random_arrays_refuse_bad_sizes_and_seeds_with_one_line():
    spec = AttentionSpec(num_qo_heads=2, num_kv_heads=1, head_dim=64, page_size=4, dtype="float32")
    for call, message in [(lambda: random_cache(spec, 0, 1), "num_pages must be an integer in \\[1, "),
                          (lambda: random_queries(spec, 0, 1), "batch_size must be an integer >= 1, got 0"),
                          (lambda: random_queries(spec, True, 1), "batch_size must be an integer"),
                          (lambda: random_cache(spec, 2, np.float64(3)), "seed must be a non-negative integer"),
                          (lambda: random_queries(None, 2, 1), "spec must be an AttentionSpec, got NoneType")]:
        with pytest.raises(PKVError, match=message):
            call()
    k, _ = random_cache(spec, 2, np.uint32(5))           # a NumPy integer seed is a seed
    np.testing.assert_array_equal(k, random_cache(spec, 2, 5)[0])
