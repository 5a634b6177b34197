"""The float64 reference and the NumPy executor: every route, ragged rows, scattered pages.

The executor runs a plan's items and merges them; it must equal dense float64 attention to
1e-12 (float64 cache) and to FP16 tolerance (float16 cache), including rows of length 1, P-1, P,
P+1 and empty splits (S > T_i in the rectangular route). The reference itself is checked against
attention over dense, unpaged tensors.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persistentkv.cache import make_batch, random_cache, random_queries
from persistentkv.errors import PKVError
from persistentkv.plan import TILE_TOKENS, make_plan, plan_split
from persistentkv.reference import (
    TOLERANCE, default_scale, execute_plan, gate, merge_states, partial_state, reference_decode, relative_error,
)
from persistentkv.spec import AttentionSpec

FP64_RTOL = TOLERANCE["float64"]
FP16_RTOL = TOLERANCE["float16"]


def routes(splits: int, target: int, bucket: int) -> list[tuple[str, dict]]:
    return [
        ("split", {"num_splits": splits}),
        ("split", {"num_splits": splits, "fused_merge": True}),
        ("buckets", {"num_splits": splits}),
        ("padded_buckets", {"num_splits": splits, "bucket_tokens": bucket}),
        ("workqueue", {"target_items": target}),
        ("workqueue", {"target_items": target, "fused_merge": False}),
        ("workqueue", {"num_splits": splits}),
    ]


def setup(spec: AttentionSpec, lengths, rho: float = 0.5, seed: int = 0):
    batch = make_batch(spec, lengths, rho, seed)
    k, v = random_cache(spec, batch.num_pages, seed)
    q = random_queries(spec, batch.batch_size, seed)
    return batch, q, k, v


def run_all_routes(spec, lengths, splits, target, bucket, rho, seed, rtol):
    batch, q, k, v = setup(spec, lengths, rho, seed)
    ref = reference_decode(q, k, v, batch)
    for route, options in routes(splits, target, bucket):
        plan = make_plan(batch, route, **options)
        out = np.full(q.shape, np.nan, dtype=k.dtype)        # poison: every element must be written
        execute_plan(plan, q, k, v, batch, out=out)
        assert np.isfinite(out).all(), (route, options)
        verdict = gate(out, ref, rtol, batch.seq_lens)
        assert verdict.passed, (route, options, lengths, verdict.describe())


def _boundary_lengths(page_size: int) -> list[int]:
    return sorted({1, max(1, page_size - 1), page_size, page_size + 1, TILE_TOKENS - 1, TILE_TOKENS + 1, 97})


@pytest.mark.parametrize("page_size", [1, 4, 16, 64])
def test_boundary_lengths_float64(page_size):
    spec = AttentionSpec(num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=page_size, dtype="float64")
    # S = 8 > T_i = 1 for the short rows: the rectangular routes carry empty splits
    run_all_routes(spec, _boundary_lengths(page_size), 8, 6, 64, 0.5, page_size, FP64_RTOL)


@pytest.mark.parametrize("page_size", [1, 16, 256])
def test_boundary_lengths_float16(page_size):
    spec = AttentionSpec(num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=page_size)
    run_all_routes(spec, _boundary_lengths(page_size), 8, 6, 64, 0.5, page_size, FP16_RTOL)


@st.composite
def executor_cases(draw):
    hkv = draw(st.sampled_from([1, 2]))
    spec = AttentionSpec(num_qo_heads=hkv * draw(st.sampled_from([1, 2, 4, 8])), num_kv_heads=hkv,
                         head_dim=draw(st.sampled_from([64, 128, 256])),
                         page_size=draw(st.sampled_from([1, 2, 8, 16, 32, 256])),
                         dtype=draw(st.sampled_from(["float64", "float16"])))
    lengths = draw(st.lists(st.integers(1, 400), min_size=1, max_size=4))
    return dict(spec=spec, lengths=lengths, splits=draw(st.integers(1, 12)), target=draw(st.integers(1, 40)),
                bucket=draw(st.sampled_from([16, 128, 512])), rho=draw(st.sampled_from([0.0, 0.5])),
                seed=draw(st.integers(0, 2**16)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=executor_cases())
def test_random_ragged_batches(case):
    rtol = FP64_RTOL if case["spec"].dtype == "float64" else FP16_RTOL
    run_all_routes(rtol=rtol, **case)


def test_float16_longer_rows():
    """Thousands of tokens per row in FP16: the float32 state keeps the error within 2e-3."""
    spec = AttentionSpec(num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16)
    run_all_routes(spec, [4097, 1500, 31], 24, 32, 2048, 0.5, 11, FP16_RTOL)


# --------------------------------------------------------------------------- merge and partial states

def test_merge_of_all_empty_group_is_zero():
    G, D = 4, 8
    o = np.zeros((3, G, D))
    lse = np.full((3, G), -np.inf)
    with np.errstate(all="raise"):   # no invalid operation on the way, not only no NaN at the end
        merged = merge_states(o, lse)
    assert merged.shape == (G, D) and (merged == 0).all()


def test_merge_ignores_empty_splits_and_equals_one_pass():
    rng = np.random.default_rng(0)
    G, D, n = 2, 16, 50
    q, k, v = rng.standard_normal((G, D)), rng.standard_normal((n, D)), rng.standard_normal((n, D))
    whole, whole_lse = partial_state(q, k, v, 0.25)
    cuts = [0, 0, 17, 17, 50, 50]   # empty, [0,17), empty, [17,50), empty
    parts = [partial_state(q, k[a:b], v[a:b], 0.25) for a, b in zip(cuts[:-1], cuts[1:])]
    merged = merge_states(np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts]))
    np.testing.assert_allclose(merged, whole, rtol=1e-13, atol=1e-13)
    empty_o, empty_lse = parts[0]
    assert (empty_o == 0).all() and np.isneginf(empty_lse).all()
    assert np.isfinite(whole_lse).all()


def test_merge_with_mixed_empty_heads():
    """One query head's splits all empty, the other's not: the empty head merges to 0."""
    o = np.ones((2, 2, 3))
    lse = np.array([[-np.inf, 0.0], [-np.inf, 1.0]])
    merged = merge_states(o, lse)
    assert (merged[0] == 0).all() and np.allclose(merged[1], 1.0)


# --------------------------------------------------------------------------- the reference itself

def test_reference_equals_dense_attention_on_unpaged_tensors():
    """Write dense per-row K/V through the block table, then compare with plain softmax attention."""
    spec = AttentionSpec(num_qo_heads=6, num_kv_heads=3, head_dim=64, page_size=4, dtype="float64")
    lengths = [1, 3, 4, 5, 37]
    batch = make_batch(spec, lengths, 0.5, 3)
    rng = np.random.default_rng(3)
    k = np.zeros((batch.num_pages, 4, 3, 64))
    v = np.zeros_like(k)
    dense_k = [rng.standard_normal((n, 3, 64)) for n in lengths]
    dense_v = [rng.standard_normal((n, 3, 64)) for n in lengths]
    for i, n in enumerate(lengths):
        pages = batch.kv_indices[batch.kv_indptr[i]:batch.kv_indptr[i + 1]]
        for t in range(n):
            k[pages[t // 4], t % 4] = dense_k[i][t]
            v[pages[t // 4], t % 4] = dense_v[i][t]
    q = rng.standard_normal((len(lengths), 6, 64))
    out = reference_decode(q, k, v, batch)
    scale = 1 / 8.0
    for i in range(len(lengths)):
        for h in range(6):
            kv_head = h // 2                                   # G = 2 query heads per KV head
            s = dense_k[i][:, kv_head] @ q[i, h] * scale
            p = np.exp(s - s.max())
            expected = (p / p.sum()) @ dense_v[i][:, kv_head]
            np.testing.assert_allclose(out[i, h], expected, rtol=1e-12, atol=1e-14)
    assert default_scale(64) == scale


def test_reference_equals_torch_sdpa():
    torch = pytest.importorskip("torch", reason="torch is not installed; the dense NumPy check covers this")
    spec = AttentionSpec(num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16, dtype="float64")
    batch, q, k, v = setup(spec, [1, 16, 17, 300], 0.5, 9)
    out = reference_decode(q, k, v, batch)
    for i in range(batch.batch_size):
        pages = batch.kv_indices[batch.kv_indptr[i]:batch.kv_indptr[i + 1]]
        n = int(batch.seq_lens[i])
        kr = torch.from_numpy(k[pages].reshape(-1, 2, 128)[:n]).permute(1, 0, 2)   # [Hkv, n, D]
        vr = torch.from_numpy(v[pages].reshape(-1, 2, 128)[:n]).permute(1, 0, 2)
        qr = torch.from_numpy(q[i]).unsqueeze(1)                                   # [Hq, 1, D]
        expected = torch.nn.functional.scaled_dot_product_attention(
            qr, kr.repeat_interleave(4, dim=0), vr.repeat_interleave(4, dim=0))
        np.testing.assert_allclose(out[i], expected.squeeze(1).numpy(), rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------- errors and helpers

def test_input_errors():
    spec = AttentionSpec(num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=8, dtype="float64")
    batch, q, k, v = setup(spec, [10, 20])
    plan = plan_split(batch, 2)
    with pytest.raises(PKVError, match="q has shape"):
        reference_decode(q[:1], k, v, batch)
    with pytest.raises(PKVError, match="k_cache has shape"):
        reference_decode(q, k[:, :4], v, batch)
    with pytest.raises(PKVError, match="v_cache shape"):
        execute_plan(plan, q, k, v[:-1], batch)
    other, _, _, _ = setup(spec, [10, 21])
    with pytest.raises(PKVError, match="different batch"):
        execute_plan(plan_split(other, 2), q, k, v, batch)


def test_relative_error():
    ref = np.ones((2, 3))
    assert relative_error(ref, ref) == 0.0
    assert relative_error(ref * 1.01, ref) == pytest.approx(0.01)
    bad = ref.copy()
    bad[0, 0] = np.nan
    assert relative_error(bad, ref) == np.inf


def test_executor_returns_cache_dtype():
    spec = AttentionSpec(num_qo_heads=2, num_kv_heads=1, head_dim=64, page_size=16)
    batch, q, k, v = setup(spec, [40])
    out = execute_plan(plan_split(batch, 3), q, k, v, batch)
    assert out.dtype == np.float16 and out.shape == (1, 2, 64)


def test_what_the_checks_still_accept():
    """The reference takes any float q (it is the judge); the executor writes a strided out in
    place; relative_error takes integer arrays and lists of one shape."""
    spec = AttentionSpec(num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=8, dtype="float32")
    batch, q, k, v = setup(spec, [10, 20])
    ref = reference_decode(q.astype(np.float64), k, v, batch)
    assert relative_error(reference_decode(q, k, v, batch, scale=np.float32(0.125)), ref) < 1e-6
    wide = np.full((2, 4, 128), np.nan, np.float32)
    out = execute_plan(plan_split(batch, 2), q, k, v, batch, out=wide[:, :, ::2])
    assert out.base is wide and np.isnan(wide[:, :, 1::2]).all()
    assert relative_error(out, ref) < 1e-5
    assert relative_error([1, 2], np.array([1, 2], dtype=np.int8)) == 0.0


def test_a_non_finite_reference_is_refused_not_compared():
    with pytest.raises(PKVError, match="ref holds NaN or inf; a reference must be finite"):
        relative_error(np.ones(2), np.array([1.0, np.inf]))


def test_an_fp8_cache_is_read_through_its_float64_values():
    """dequantized_cache: the exact values of FP8 codes, which the executor and the reference
    take as any float64 cache (per-head scales along the cache's head axis)."""
    from persistentkv import fp8
    from persistentkv.cache import random_fp8_cache
    from persistentkv.reference import dequantized_cache

    spec = AttentionSpec(num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=8, dtype="float64",
                         kv_dtype="float8_e4m3")
    batch = make_batch(spec, [1, 9, 40], 0.5, 2)
    kc, vc, ks, vs = random_fp8_cache(spec, batch.num_pages, 2, per_head=True)
    k, v = dequantized_cache(kc, vc, ks, vs)
    assert k.dtype == np.float64 and np.array_equal(k, fp8.code_values()[kc] * ks.astype(np.float64)[None, None, :, None])
    q = random_queries(spec, batch.batch_size, 2)
    out = execute_plan(make_plan(batch, "workqueue", target_items=5), q, k, v, batch)
    assert gate(out, reference_decode(q, k, v, batch), FP64_RTOL).passed
