"""build/counters tables: columns as docs/DATA.md says, and counts that follow from the routes'
definitions (launch pairs per bucket, rectangle sizes, bytes per token)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persistentkv import configuration, counters, traces
from persistentkv.cache import allocate, batch_for_step
from persistentkv.plan import PAPER_PARTIAL_FLOATS_EXTRA, TILE_TOKENS, make_plan
from persistentkv.spec import AttentionSpec

ROOT = Path(__file__).resolve().parents[1]
CONFIG = configuration.load_config(ROOT / "config" / "config.yaml", base_dir=ROOT)
SPEC = configuration.spec(CONFIG)
SEED = configuration.calibration_seed(CONFIG)


@pytest.fixture(scope="module")
def bimodal_b8() -> tuple[traces.Trace, pd.DataFrame]:
    entry = configuration.trace_entry(CONFIG, "bimodal_b8")
    trace = traces.build(entry, SEED)
    return trace, counters.count_trace(trace, SPEC, entry["splits"], CONFIG["planner"], progress=False)


def test_columns_and_types_follow_data_md(bimodal_b8):
    trace, frame = bimodal_b8
    assert tuple(frame.columns) == counters.COLUMNS == (
        "trace", "seed", "step", "batch_size", "max_len", "total_tokens", "route", "num_splits", "bucket_tokens",
        "launches", "decode_ctas", "merge_ctas", "nonempty_items", "useful_kv_bytes", "padded_kv_bytes",
        "merge_state_bytes", "paper_merge_state_bytes", "h2d_bytes")
    for column in counters.COLUMNS:
        if column in ("trace", "route"):
            assert not pd.api.types.is_numeric_dtype(frame[column]), column
        else:
            assert frame[column].dtype == np.int64, column
    assert len(frame) == 4 * len(trace.steps)
    assert set(frame["route"]) == {"split", "buckets", "workqueue", "workqueue_fixed"}
    assert (frame.loc[frame["route"] == "workqueue", "num_splits"] == -1).all()
    assert (frame.loc[frame["route"] != "workqueue", "num_splits"] == 20).all()
    assert (frame["bucket_tokens"] == -1).all()
    assert (frame["trace"] == "bimodal_b8").all() and (frame["seed"] == SEED).all()


def test_counts_follow_the_route_definitions(bimodal_b8):
    trace, frame = bimodal_b8
    steps = {s.index: s for s in trace.steps}
    H, S = SPEC.num_kv_heads, 20
    for row in frame.itertuples():
        step = steps[row.step]
        lengths = np.array(step.lengths)
        assert row.batch_size == len(lengths) and row.max_len == lengths.max() and row.total_tokens == lengths.sum()
        assert row.useful_kv_bytes == lengths.sum() * SPEC.kv_bytes_per_token
        assert row.padded_kv_bytes == 0
        tiles = -(-lengths // TILE_TOKENS)
        if row.route == "buckets":  # one decode + merge pair per distinct length (S > 1)
            assert row.launches == 2 * len(set(step.lengths))
            assert row.decode_ctas == len(lengths) * H * S
        elif row.route == "split":  # the rectangle, empty splits included
            assert row.launches == 2 and row.decode_ctas == len(lengths) * H * S
        elif row.route == "workqueue_fixed":  # empty items dropped, merge fused
            assert row.launches == 1 and row.merge_ctas == 0
            assert row.decode_ctas == row.nonempty_items == H * np.minimum(S, tiles).sum()
        else:
            assert row.launches == 1 and row.decode_ctas == row.nonempty_items
            # balanced: about target_items items, never more than target + B * Hkv
            assert row.decode_ctas <= CONFIG["planner"]["target_items"] + len(lengths) * H


def test_paper_fanout_and_merge_numbers_on_bimodal_b8():
    """docs/PAPER.md: 16 launches/step with exact buckets -> 2 with the published queue, and merge state
    4.06 MiB (S=32 per bucket) -> 2.54 MiB (the B x Hq x 20 rectangle), at 8 active rows."""
    trace = traces.build(configuration.trace_entry(CONFIG, "bimodal_b8"), SEED)
    full = [s for s in trace.steps if s.batch_size == 8]
    assert full
    paper_state = lambda splits: 8 * SPEC.num_qo_heads * splits * (SPEC.head_dim + PAPER_PARTIAL_FLOATS_EXTRA) * 4
    assert paper_state(32) / 2**20 == pytest.approx(4.0625) and paper_state(20) / 2**20 == pytest.approx(2.5390625)
    for step in full:
        rows = {r["route"]: r for r in counters.step_rows(trace, step, SPEC, [
            counters.buckets_variant(32), counters.split_variant(20),
            counters.workqueue_variant(CONFIG["planner"]["target_items"], 1)])}
        assert rows["buckets"]["launches"] == 2 * len(set(step.lengths))
        assert rows["split"]["launches"] == 2 and rows["workqueue"]["launches"] == 1
        assert rows["buckets"]["paper_merge_state_bytes"] == paper_state(32)
        assert rows["split"]["paper_merge_state_bytes"] == paper_state(20)
    assert any(len(set(s.lengths)) == 8 for s in full)  # the 16-launch steps exist


def test_identity_pages_give_the_same_counters_as_the_real_allocation(bimodal_b8):
    """Counters depend on lengths only, so planning on identity page ids is exact."""
    trace, _ = bimodal_b8
    allocation = allocate(trace.requests, SPEC.page_size, 0.5, trace.seed)
    for step in trace.steps[::11]:
        real = batch_for_step(SPEC, allocation, step)
        light = counters.lengths_batch(SPEC, step.lengths)
        for variant in counters.published_variants(20, CONFIG["planner"]):
            assert variant.plan(light).counters() == variant.plan(real).counters()


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 5000), min_size=1, max_size=12), S=st.integers(1, 40),
       heads=st.sampled_from([(8, 8), (32, 8), (16, 2)]))
def test_bucket_launches_and_merge_bytes_for_any_lengths(lengths, S, heads):
    spec = AttentionSpec(num_qo_heads=heads[0], num_kv_heads=heads[1], head_dim=64, page_size=16)
    batch = counters.lengths_batch(spec, lengths)
    exact = counters.buckets_variant(S).plan(batch).counters()
    distinct = len(set(lengths))
    assert exact.launches == (2 if S > 1 else 1) * distinct
    # every row of a bucket keeps all S splits, so with S > 1 each (row, query head, split) has a state
    expected_states = len(lengths) * spec.num_qo_heads * S if S > 1 else 0
    assert exact.paper_merge_state_bytes == expected_states * (spec.head_dim + PAPER_PARTIAL_FLOATS_EXTRA) * 4
    fixed = counters.workqueue_fixed_variant(S).plan(batch).counters()
    tiles = [math.ceil(n / TILE_TOKENS) for n in lengths]
    assert fixed.nonempty_items == fixed.decode_ctas == spec.num_kv_heads * sum(min(S, t) for t in tiles)
    padded = counters.padded_buckets_variant(S, 1024).plan(batch).counters()
    assert padded.padded_kv_bytes == sum(-(-n // 1024) * 1024 - n for n in lengths) * spec.kv_bytes_per_token


def test_make_plan_agrees_with_variant_labels():
    batch = counters.lengths_batch(SPEC, [100, 3000, 3000])
    fixed = counters.workqueue_fixed_variant(4)
    assert fixed.route == "workqueue_fixed" and fixed.plan_route == "workqueue"
    assert fixed.plan(batch).counters() == make_plan(batch, "workqueue", num_splits=4).counters()
