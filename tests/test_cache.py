"""The paged cache: page allocation with holes (as published), block tables, batches, fills."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persistentkv.cache import (
    Batch, allocate, batch_for_step, check_hole_fraction, make_batch, numpy_dtype, random_cache,
    random_queries,
)
from persistentkv.errors import PKVError
from persistentkv.spec import AttentionSpec
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
    ([4, 0, 3], "length 0 is invalid"),
    ([-5], "length -5 is invalid"),
    ([], "at least one row"),
    ([3.7], "lengths must be integers"),
])
def test_make_batch_rejects_bad_lengths(lengths, message):
    with pytest.raises(PKVError, match=message) as info:
        make_batch(AttentionSpec(), lengths)
    assert "\n" not in str(info.value)


def test_batch_validation_errors():
    spec = AttentionSpec(page_size=4)
    ok = make_batch(spec, [5, 9])
    cases = [
        (dict(seq_lens=np.array([5, 0])), "row 1 has length 0"),
        (dict(seq_lens=np.array([5.0, 9.0])), "seq_lens must be integers"),
        (dict(kv_indptr=np.array([0, 2])), "kv_indptr must have shape \\[3\\]"),
        (dict(kv_indptr=np.array([0, 1, 5])), "row 0 lists 1 pages but its length needs 2"),
        (dict(kv_indices=ok.kv_indices[:-1]), "kv_indices length"),
        (dict(num_pages=2), "page ids must lie in \\[0, 2\\)"),
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
