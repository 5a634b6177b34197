"""Workload counters: plan every step of a trace with several routes and tabulate ``plan.StepCounters``.

The counters are what a route would launch and move per layer, computed by the real planner, so
they hold on any machine: launches, decode and merge CTAs, non-empty items, useful and padded KV
bytes, merge-state bytes (ours, (D + 1) floats per query head and split, and the paper's
(D + 2)), and host-to-device metadata bytes.

Counters depend on the rows' lengths only, never on which physical pages hold them, so each step
is planned on a batch with identity page ids (no page allocation, no cache).

Worked number, bimodal B8 at the calibration seed, step 0 (8 rows, 8 distinct lengths, Hq=32,
D=128): exact-length buckets with S=32 make 8 decode + 8 merge launches = 16, and keep all
8 x 32 x 32 partial states of (128 + 2) float32 = 4,259,840 B (4.06 MiB); the published queue,
the full rectangle with S=20, makes 2 launches and 8 x 32 x 20 x 130 x 4 B = 2.54 MiB.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from .cache import Batch
from .errors import require
from .plan import Plan, StepCounters, make_plan
from .spec import AttentionSpec
from .traces import Step, Trace

#: StepCounters fields, in DATA.md order.
COUNTER_COLUMNS = tuple(StepCounters.__dataclass_fields__)
#: build/counters/{trace}_s{seed}.parquet columns (docs/DATA.md).
COLUMNS = ("trace", "seed", "step", "batch_size", "max_len", "total_tokens", "route", "num_splits",
           "bucket_tokens") + COUNTER_COLUMNS
#: -1 marks "not applicable" in the integer columns num_splits and bucket_tokens.
NOT_APPLICABLE = -1


@dataclass(frozen=True)
class Variant:
    """One way to plan a step: the label written to the table and the planner call behind it.

    route:        label in the ``route`` column (``workqueue_fixed`` plans as ``workqueue``)
    plan_route:   ``plan.make_plan`` route name
    options:      keyword arguments of ``make_plan``
    """

    route: str
    plan_route: str
    options: dict = field(default_factory=dict)
    num_splits: int = NOT_APPLICABLE
    bucket_tokens: int = NOT_APPLICABLE

    def plan(self, batch: Batch) -> Plan:
        return make_plan(batch, self.plan_route, **self.options)


def split_variant(num_splits: int) -> Variant:
    """The published rectangle: every (row, kv head, split), empty splits included; decode + merge."""
    return Variant("split", "split", {"num_splits": num_splits}, num_splits=num_splits)


def buckets_variant(num_splits: int) -> Variant:
    """Exact-length buckets, S splits each: one decode + merge launch pair per distinct length."""
    return Variant("buckets", "buckets", {"num_splits": num_splits}, num_splits=num_splits)


def padded_buckets_variant(num_splits: int, bucket_tokens: int) -> Variant:
    return Variant("padded_buckets", "padded_buckets", {"num_splits": num_splits, "bucket_tokens": bucket_tokens},
                   num_splits=num_splits, bucket_tokens=bucket_tokens)


def workqueue_variant(target_items: int, min_chunk_tiles: int) -> Variant:
    """Balanced compact queue: split counts sized for ``target_items`` items, merge fused."""
    return Variant("workqueue", "workqueue", {"target_items": target_items, "min_chunk_tiles": min_chunk_tiles})


def workqueue_fixed_variant(num_splits: int) -> Variant:
    """The published queue with its empty items dropped: min(S, T_i) splits per row, merge fused."""
    return Variant("workqueue_fixed", "workqueue", {"num_splits": num_splits}, num_splits=num_splits)


def published_variants(num_splits: int, planner: dict) -> list[Variant]:
    """The four routes of build/counters: split, buckets and workqueue_fixed with the trace's
    published S, and the balanced workqueue with config ``planner`` settings."""
    return [split_variant(num_splits), buckets_variant(num_splits),
            workqueue_variant(int(planner["target_items"]), int(planner["min_chunk_tiles"])),
            workqueue_fixed_variant(num_splits)]


def lengths_batch(spec: AttentionSpec, lengths) -> Batch:
    """A batch with the given row lengths on identity page ids (rows' pages back to back).

    lengths: int [B] -> Batch with kv_indptr int32 [B + 1], kv_indices int32 [sum ceil(N_i / P)]
    """
    seq = np.asarray(lengths, dtype=np.int64)
    pages = -(-seq // spec.page_size)
    indptr = np.zeros(seq.size + 1, dtype=np.int64)
    np.cumsum(pages, out=indptr[1:])
    nnz = int(indptr[-1])
    return Batch(spec, seq.astype(np.int32), indptr.astype(np.int32), np.arange(nnz, dtype=np.int32), max(nnz, 1))


def step_rows(trace: Trace, step: Step, spec: AttentionSpec, variants, label_column: str = "route",
              labels=None) -> list[dict]:
    """One row per variant for ``step``: identity columns + ``StepCounters``.

    ``labels`` (one per variant) fills ``label_column`` instead of each variant's route name.
    """
    batch = lengths_batch(spec, step.lengths)
    base = {"trace": trace.name, "seed": int(trace.seed), "step": int(step.index),
            "batch_size": batch.batch_size, "max_len": batch.max_len, "total_tokens": batch.total_tokens}
    rows = []
    for index, variant in enumerate(variants):
        row = dict(base)
        if labels is not None:
            row[label_column] = labels[index]
        row.update(route=variant.route, num_splits=int(variant.num_splits), bucket_tokens=int(variant.bucket_tokens))
        row.update(variant.plan(batch).counters().to_dict())
        rows.append(row)
    return rows


def to_frame(rows: list[dict], columns) -> pd.DataFrame:
    """Rows -> DataFrame with ``columns`` in order: int64 for integers, str for labels."""
    require(bool(rows), "no rows to write (the trace has no steps?)")
    frame = pd.DataFrame.from_records(rows, columns=list(columns))
    for column in frame.columns:
        series = frame[column]
        if pd.api.types.is_bool_dtype(series):
            continue
        if pd.api.types.is_integer_dtype(series):
            frame[column] = series.astype("int64")
        elif not pd.api.types.is_numeric_dtype(series):
            frame[column] = series.astype(str)
    return frame


def count_trace(trace: Trace, spec: AttentionSpec, num_splits: int, planner: dict,
                progress: bool = True) -> pd.DataFrame:
    """build/counters/{trace}_s{seed}.parquet: every step x the four published routes (DATA.md)."""
    from tqdm import tqdm

    variants = published_variants(num_splits, planner)
    rows: list[dict] = []
    for step in tqdm(trace.steps, desc=f"counters {trace.name} s{trace.seed}", unit="step", disable=not progress):
        rows.extend(step_rows(trace, step, spec, variants))
    return to_frame(rows, COLUMNS)
