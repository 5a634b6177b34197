"""Stress numerics on the CPU (tests/numerics.py): each stress kind holds what it claims, and the
NumPy executor (every route the engine runs) and torch-sdpa (torch on the CPU) meet float64 within
their dtype's tolerance on every kind, with no NaN or inf."""

from __future__ import annotations

import numpy as np
import pytest

from numerics import (
    KINDS, LARGE_VALUE, MAX_MARGIN, ONE_HOT_MARGIN, SCORE_SPREAD, TOLERANCE, round_to, row_tokens, scores,
    stress_case,
)
from persistentkv.backends.numpy_backend import NumpyBackend
from persistentkv.reference import gate, reference_decode
from persistentkv.spec import AttentionSpec

#: Page boundaries (15, 16, 17 at P = 16), one token, and rows long enough to split.
LENGTHS = [1, 15, 16, 17, 300, 1000]
#: G = 4 at head_dim 64, and G = 1 at head_dim 128.
SHAPES = {"G4": (8, 2, 64), "G1": (4, 4, 128)}
#: The engine's routes as the host planner makes them, with enough splits that rows merge.
ROUTES = {"workqueue": {"target_items": 16}, "buckets": {"num_splits": 8}, "split": {"num_splits": 8}}


def spec_for(shape: str, dtype: str) -> AttentionSpec:
    hq, hkv, d = SHAPES[shape]
    return AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=16, dtype=dtype)


def all_scores(batch, q, k):
    """(row, kv head, [G, N] float64 scores) over the batch."""
    return [(row, h, scores(batch, q, k, row, h))
            for row in range(batch.batch_size) for h in range(batch.spec.num_kv_heads)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("kind", KINDS)
def test_each_stress_kind_holds_what_it_claims(kind, dtype):
    spec = spec_for("G4", dtype)
    batch, q, k, v = stress_case(kind, spec, LENGTHS, seed=1)
    for a in (q, k, v):
        assert a.dtype == (np.float32 if dtype == "bfloat16" else np.dtype(dtype)) and np.isfinite(a).all()
        np.testing.assert_array_equal(round_to(a, dtype), a)                 # values of the dtype already
    again = stress_case(kind, spec, LENGTHS, seed=1)
    assert all(np.array_equal(x, y) for x, y in zip((q, k, v), again[1:]))  # same seed, same arrays
    per_head = all_scores(batch, q, k)
    P = spec.page_size
    if kind == "large_scores":
        spread = max(np.ptp(s) for _, _, s in per_head)
        assert 0.9 * SCORE_SPREAD <= spread <= 1.1 * SCORE_SPREAD
    elif kind in ("one_hot", "max_last_page", "max_first_token"):
        margin = ONE_HOT_MARGIN if kind == "one_hot" else MAX_MARGIN
        for row, _, s in per_head:
            n = s.shape[1]
            top = s.argmax(axis=1)
            assert len(set(top.tolist())) == 1                                # one key wins for the whole group
            if n > 1:
                gap = s.max(axis=1) - np.sort(s, axis=1)[:, -2]
                assert (gap >= margin - 0.5).all(), (row, gap)               # rounding moves it a little
            if kind == "max_last_page":
                assert top[0] >= (n - 1) // P * P
            if kind == "max_first_token":
                assert top[0] == 0
    elif kind == "equal_keys":
        assert all(np.ptp(s, axis=1).max() == 0 for _, _, s in per_head)
    elif kind == "large_values":
        assert np.abs(v).max() == pytest.approx(LARGE_VALUE[dtype], rel=1e-2)
    elif kind == "zero_queries":
        assert not q.any()


def test_max_last_page_puts_the_max_past_the_first_page_of_long_rows():
    batch, q, k, _ = stress_case("max_last_page", spec_for("G4", "float32"), LENGTHS, seed=2)
    for row, _, s in all_scores(batch, q, k):
        pages, _ = row_tokens(batch, row)
        if pages.size > 16:
            assert s.argmax(axis=1).min() >= 16


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="unknown stress kind 'huge'"):
        stress_case("huge", spec_for("G4", "float32"), [4], seed=0)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("kind", KINDS)
def test_numpy_executor_under_stress(kind, dtype, route, shape):
    spec = spec_for(shape, dtype)
    batch, q, k, v = stress_case(kind, spec, LENGTHS, seed=3)
    backend = NumpyBackend(route, **ROUTES[route])
    plan = backend.plan(batch)
    assert plan[0].merge_groups.shape[0] > 0                 # rows split and merge on this case
    out = np.full(q.shape, np.nan, dtype=q.dtype)
    backend.run(q, (k, v), plan, out)
    assert np.isfinite(out).all()
    verdict = gate(out, reference_decode(q, k, v, batch), TOLERANCE[dtype], batch.seq_lens)
    assert verdict.passed, verdict.describe()


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("kind", KINDS)
def test_torch_sdpa_on_the_cpu_under_stress(kind, dtype, shape):
    torch = pytest.importorskip("torch", reason="torch-sdpa needs torch")
    from persistentkv.backends.torch_sdpa import TorchSdpaBackend

    spec = spec_for(shape, dtype)
    batch, q, k, v = stress_case(kind, spec, LENGTHS, seed=4)
    backend = TorchSdpaBackend(device="cpu")
    want = getattr(torch, dtype)
    qt, kt, vt = (torch.from_numpy(a).to(want) for a in (q, k, v))
    out = torch.full_like(qt, float("nan"))
    backend.run(qt, (kt, vt), backend.plan(batch), out)
    out64 = out.double().numpy()
    assert np.isfinite(out64).all()
    verdict = gate(out64, reference_decode(q, k, v, batch), TOLERANCE[dtype], batch.seq_lens)
    assert verdict.passed, verdict.describe()
