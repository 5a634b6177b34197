"""The adaptive policy: which backend runs a decode step, and its calibration from timings.

Three policies, each a pure function of the step (a :class:`~persistentkv.cache.Batch`):

``paper``
    The published rules as the artifact had them (PAPER.md, "Policy"): G != 4 -> FlashInfer;
    N_max < 16384 -> FlashInfer; B == 1 -> length buckets with S = 32; B >= 8 -> work queue;
    B = 2..7 -> FlashInfer. "FlashInfer" is the tensor-core decode, ``flashinfer-tc``.
``thresholds``
    The same rule shape re-fitted on calibration timings: per group size and batch-size class
    (1, 2-7, >= 8) one PKV route and the N_max at or above which it replaces the class's best
    baseline, chosen to maximise the summed speedup over the calibration cells (ties go to the
    baseline).
``cost_model``
    Per candidate backend a non-negative linear model of the time of one layer, fitted on the
    calibration timings; the step goes to the candidate with the least predicted time among
    those available here. Its features come from the Batch alone (see :func:`cost_features`).

:func:`calibrate` fits the last two from a raw timing table (docs/DATA.md) into the dict that is
written, frozen, as ``results/<hw>/policy.json``; :func:`load_policy` reads it back.
Decisions never name a backend outside ``available`` (the backends that can run here).
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Callable, Collection, Iterable, Mapping, Sequence

import numpy as np

from .cache import Batch, make_batch
from .errors import PKVError, require
from .names import PKV_BACKENDS
from .plan import (PARTIAL_FLOATS_EXTRA, TILE_TOKENS, balanced_chunk_tiles, balanced_row_splits, length_buckets,
                   num_tiles)
from .spec import AttentionSpec

POLICY_FORMAT = "persistentkv-policy/1"
POLICIES = ("paper", "thresholds", "cost_model")
#: The published baseline: FlashInfer's tensor-core decode.
PAPER_BASELINE = "flashinfer-tc"
#: The published PKV kernels existed for G = 4 only; other group sizes went to FlashInfer.
PAPER_GROUP_SIZE = 4
PAPER_LONG_CONTEXT_THRESHOLD = 16384
PAPER_BUCKET_SPLITS = 32
#: Published batch-size classes: B == 1 (buckets), 2..7 (FlashInfer), >= 8 (work queue).
BATCH_CLASSES: tuple[tuple[int, int | None], ...] = ((1, 1), (2, 7), (8, None))
#: Used only when no config is given (tests, paper_policy()); config planner.target_items rules.
DEFAULT_TARGET_ITEMS = 264
#: Features of the cost model, in coefficient order (units of the coefficient in brackets):
#: intercept [us], kv_bytes [us/B], launches [us/launch], merge_state_bytes [us/B],
#: critical_bytes [us/B], batch_size [us/row].
COST_FEATURES = ("intercept", "kv_bytes", "launches", "merge_state_bytes", "critical_bytes", "batch_size")
#: Synthetic calibration cases are named like "B4xN8192" (B rows of N tokens), seed 0, step 0.
SYNTHETIC_TRACE = re.compile(r"^B(\d+)xN(\d+)$")
PROTOCOL_PREFERENCE = ("step", "kernel", "eager")
TIMING_COLUMNS = ("experiment", "trace", "seed", "step", "batch_size", "max_len", "total_tokens",
                  "num_qo_heads", "num_kv_heads", "head_dim", "page_size", "dtype", "backend",
                  "num_splits", "protocol", "per_layer_us", "status")


def is_pkv(backend: str) -> bool:
    return backend in PKV_BACKENDS


# --------------------------------------------------------------------------- the step and a decision

@dataclass(frozen=True)
class StepFeatures:
    """What the rule policies look at: one decode step's shape."""

    batch_size: int
    max_len: int
    total_tokens: int
    distinct_lengths: int
    group_size: int
    kv_bytes: int

    @classmethod
    def from_batch(cls, batch: Batch) -> "StepFeatures":
        return cls(batch.batch_size, batch.max_len, batch.total_tokens,
                   int(np.unique(batch.seq_lens).size), batch.spec.group_size, batch.kv_bytes)


@dataclass(frozen=True)
class Decision:
    """The backend a step goes to, the options its constructor takes, and why (one line)."""

    backend: str
    options: dict = field(default_factory=dict)
    reason: str = ""


def _options_text(options: Mapping) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(options.items())) or "defaults"


# --------------------------------------------------------------------------- the published rules

def paper_decision(features: StepFeatures, long_context_threshold: int = PAPER_LONG_CONTEXT_THRESHOLD,
                   bucket_splits: int = PAPER_BUCKET_SPLITS, workqueue_options: Mapping | None = None,
                   baseline: str = PAPER_BASELINE) -> Decision:
    """The published rules (no availability check; :meth:`Policy.decide` adds it).

    Worked numbers: bucketed_b1 at seed 20260623 is request 0 for all 64 steps, N_max 8192..8255
    < 16384, so every step goes to FlashInfer under these rules; bimodal_b8 steps with a long
    request (N_max >= 24576) and 8 rows go to the work queue.
    """
    f = features
    if f.group_size != PAPER_GROUP_SIZE:
        return Decision(baseline, {}, f"paper: G={f.group_size} != {PAPER_GROUP_SIZE}, the only group "
                                      f"size the published kernels served -> {baseline}")
    if f.max_len < long_context_threshold:
        return Decision(baseline, {}, f"paper: N_max={f.max_len} < {long_context_threshold} (short "
                                      f"context: launch and merge overhead dominate) -> {baseline}")
    if f.batch_size == 1:
        return Decision("pkv-buckets", {"num_splits": bucket_splits},
                        f"paper: B=1, N_max={f.max_len} >= {long_context_threshold} -> length buckets, "
                        f"S={bucket_splits}")
    if f.batch_size >= 8:
        options = dict(workqueue_options or {})
        return Decision("pkv-workqueue", options,
                        f"paper: B={f.batch_size} >= 8, N_max={f.max_len} >= {long_context_threshold} "
                        f"-> work queue ({_options_text(options)})")
    return Decision(baseline, {}, f"paper: B={f.batch_size} in 2..7 (split/merge overhead lost at B=4) "
                                  f"-> {baseline}")


# --------------------------------------------------------------------------- re-fitted thresholds

@dataclass(frozen=True)
class ThresholdRule:
    """For steps with this G and B in [min_batch, max_batch]: ``route`` when N_max >= min_max_len,
    else ``baseline``. ``route`` None means the baseline always (no threshold paid off)."""

    group_size: int
    min_batch: int
    max_batch: int | None
    baseline: str
    route: str | None = None
    min_max_len: int | None = None
    options: dict = field(default_factory=dict)
    cells: int = 0
    summed_speedup: float = 0.0
    note: str = ""

    def covers(self, f: StepFeatures) -> bool:
        return (f.group_size == self.group_size and f.batch_size >= self.min_batch
                and (self.max_batch is None or f.batch_size <= self.max_batch))

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def batch_class(batch_size: int) -> tuple[int, int | None]:
    for low, high in BATCH_CLASSES:
        if batch_size >= low and (high is None or batch_size <= high):
            return low, high
    raise PKVError(f"batch size {batch_size} is in no batch-size class")


def _class_label(low: int, high: int | None) -> str:
    return f"B={low}" if high == low else (f"B>={low}" if high is None else f"B={low}..{high}")


def fit_threshold(max_lens: Sequence[int], speedups: Sequence[float]) -> tuple[int | None, float]:
    """The N_max threshold that maximises the summed speedup of "route when N_max >= threshold".

    ``speedups[i]`` = baseline time / route time on cell i. Returns (threshold, summed speedup over
    all cells, 1.0 for each cell left on the baseline). Candidates are the observed N_max values;
    ties go to the larger threshold (fewer steps leave the baseline), and None (never route) wins
    unless routing strictly gains. Worked number: cells at 16384/20480/24576 with speedups
    0.9/1.1/1.3 give gains -0.1+0.1+0.3 = 0.3 from 16384, 0.4 from 20480, 0.3 from 24576, so the
    threshold is 20480 and the summed speedup 3.4.
    """
    n = np.asarray(max_lens, dtype=np.int64)
    s = np.asarray(speedups, dtype=np.float64)
    require(n.shape == s.shape, "max_lens and speedups differ in length")
    best, best_gain = None, 0.0
    for value in sorted(set(n.tolist()), reverse=True):
        gain = float((s[n >= value] - 1.0).sum())
        if gain > best_gain + 1e-12 * max(1.0, abs(best_gain)):
            best, best_gain = int(value), gain
    return best, float(n.size) + best_gain


def threshold_decision(features: StepFeatures, rules: Sequence[ThresholdRule], default_baseline: str) -> Decision:
    """The re-fitted rules (no availability check; :meth:`Policy.decide` adds it)."""
    f = features
    for rule in rules:
        if not rule.covers(f):
            continue
        label = _class_label(rule.min_batch, rule.max_batch)
        if rule.route is not None and rule.min_max_len is not None and f.max_len >= rule.min_max_len:
            return Decision(rule.route, dict(rule.options),
                            f"thresholds: G={f.group_size}, {label}, N_max={f.max_len} >= "
                            f"{rule.min_max_len} -> {rule.route}")
        why = (f"N_max={f.max_len} < {rule.min_max_len}" if rule.min_max_len is not None
               else "no PKV route beat the baseline in calibration")
        return Decision(rule.baseline, {}, f"thresholds: G={f.group_size}, {label}, {why} -> {rule.baseline}")
    return Decision(default_baseline, {}, f"thresholds: G={f.group_size}, B={f.batch_size} was not "
                                          f"calibrated -> {default_baseline}")


# --------------------------------------------------------------------------- the cost model

def cost_features(backend: str, batch: Batch, options: Mapping | None = None) -> np.ndarray:
    """float64 [len(COST_FEATURES)]: the model's inputs for ``backend`` on ``batch``.

    kv_bytes: K+V bytes the backend reads (our routes: useful + padded, as the plan counts them).
    launches, merge_state_bytes: our plan's counters; a baseline counts 1 launch and 0 merge bytes
    (its internals are not ours to count; the intercept absorbs them).
    critical_bytes: the bytes the busiest CTA reads, summed over launches that run one after
    another: the time floor when there are too few CTAs to fill the GPU. A baseline is charged
    one CTA per (row, kv head) over the longest row (unsplit), and its fitted coefficient says
    how much of that it really pays.
    Worked number (Hkv=8, D=128, FP16: 512 B per token per kv head): B=1 at 32768 tokens reads
    kv_bytes = 128 MiB; buckets with S=32 have items of 1024 tokens, so critical_bytes = 512 KiB,
    while an unsplit baseline is charged 16 MiB.

    Our routes' numbers are the planner's (persistentkv.plan), computed per (row, split) without
    materialising the per-head item arrays: this runs on every adaptive step, inside the timed
    plan, so it must cost tens of microseconds, not the milliseconds a full plan of every
    candidate route would (tests hold it equal to ``make_plan(...).counters()``).
    """
    return np.array(_features(backend, _StepShape.of(batch), options), dtype=np.float64)


@dataclass(frozen=True)
class _StepShape:
    """What the cost features need from a Batch, as Python numbers, taken once per decision."""

    lens: list
    total: int
    max_len: int
    spec: AttentionSpec

    @classmethod
    def of(cls, batch: Batch) -> "_StepShape":
        lens = [int(x) for x in batch.seq_lens.tolist()]
        return cls(lens, sum(lens), max(lens), batch.spec)


def _features(backend: str, shape: _StepShape, options: Mapping | None = None) -> tuple:
    """cost_features as a tuple of floats (the decision's hot path; no array per backend)."""
    spec = shape.spec
    head_bytes = 2 * spec.head_dim * spec.itemsize
    route = PKV_BACKENDS.get(backend)
    if route is None:
        return (1.0, float(shape.total * spec.kv_bytes_per_token), 1.0, 0.0, float(shape.max_len * head_bytes),
                float(len(shape.lens)))
    kv_tokens, launches, partials, critical_tokens = route_shape(route, shape.lens, spec.num_kv_heads,
                                                                 dict(options or {}))
    merge_bytes = partials * spec.group_size * 4 * (spec.head_dim + PARTIAL_FLOATS_EXTRA)
    return (1.0, float(kv_tokens * spec.kv_bytes_per_token), float(launches), float(merge_bytes),
            float(critical_tokens * head_bytes), float(len(shape.lens)))


def _split_tokens(span: np.ndarray, splits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of every (row, split) under the row-local bound, and each split's row."""
    owner = np.repeat(np.arange(span.size), splits)
    s = np.arange(owner.size) - np.repeat(np.cumsum(splits) - splits, splits)
    n, S = span[owner], splits[owner]
    T = -(-n // TILE_TOKENS)
    lo = np.minimum(T * s // S * TILE_TOKENS, n)
    hi = np.minimum(T * (s + 1) // S * TILE_TOKENS, n)
    return hi - lo, owner


#: route_shape works in plain Python up to this many rows: on the few rows of a decode step,
#: NumPy's per-call overhead, not arithmetic, is the cost (the adaptive backend evaluates this for
#: every candidate inside each step's timed plan).
PY_SHAPE_MAX_ROWS = 256


def _max_split_tokens(n: int, tiles: int, splits: int) -> int:
    """Largest (hi - lo) over the splits of one row of ``n`` tokens (``_split_tokens``' bounds),
    in closed form. Split s holds tiles [floor(s T / S), floor((s + 1) T / S)): q = T // S or q + 1
    of them, the r = T % S larger ones being the last split (when r > 0) and r - 1 others. Only the
    last split is cut short by n (the others end at or before tile T - 1)."""
    if splits <= 0 or tiles <= 0:
        return 0
    q, r = divmod(tiles, splits)
    last_tiles = q + (r > 0)
    last = n - TILE_TOKENS * (tiles - last_tiles)
    if splits == 1:
        return last
    return max(last, TILE_TOKENS * (q + (r >= 2)))


def _route_shape_py(route: str, lens: list, num_kv_heads: int, options: dict, fused: bool):
    """route_shape in plain Python (the same numbers)."""
    tiles = [-(-x // TILE_TOKENS) for x in lens]
    if route == "workqueue":
        if "num_splits" in options:
            splits = [min(int(options["num_splits"]), t) for t in tiles]
        else:
            chunk = balanced_chunk_tiles(tiles, num_kv_heads, int(options["target_items"]),
                                         int(options.get("min_chunk_tiles", 1)))
            splits = [-(-t // chunk) for t in tiles]
        multi = [S for S in splits if S > 1]
        launches = 1 if fused else 1 + int(bool(multi))
        critical = max(_max_split_tokens(x, t, S) for x, t, S in zip(lens, tiles, splits))
        return sum(lens), launches, num_kv_heads * sum(multi), critical
    S = int(options["num_splits"])
    per_launch = 1 if (fused or S == 1) else 2
    partials = num_kv_heads * len(lens) * S if S > 1 else 0
    if route == "split":
        return sum(lens), per_launch, partials, max(_max_split_tokens(x, -(-x // TILE_TOKENS), S) for x in set(lens))
    bucket = options.get("bucket_tokens")
    if bucket is not None:
        require(bucket >= 1, f"bucket_tokens must be >= 1, got {bucket}")
    counts: dict[int, int] = {}
    for x in lens:
        key = x if bucket is None else -(-x // bucket) * bucket
        counts[key] = counts.get(key, 0) + 1
    critical = sum(_max_split_tokens(span, -(-span // TILE_TOKENS), S) for span in counts)
    return sum(span * rows for span, rows in counts.items()), per_launch * len(counts), partials, critical


def route_shape(route: str, seq_lens: np.ndarray, num_kv_heads: int, options: dict,
                use_numpy: bool = False) -> tuple[int, int, int, int]:
    """(tokens read, launches, partial states per query group, summed per-launch max item tokens)
    of ``make_plan(batch, route, **options)``, from the row lengths alone. Small steps are
    computed in plain Python (``use_numpy`` forces the array path; tests hold both equal)."""
    fused = bool(options.get("fused_merge", route == "workqueue"))
    if route == "workqueue":
        require(("target_items" in options) != ("num_splits" in options),
                "pkv-workqueue options need exactly one of target_items and num_splits")
    else:
        require("num_splits" in options, f"the {route} route needs num_splits")
        require(route in ("split", "buckets", "padded_buckets"), f"unknown route {route!r}")
    if not use_numpy:
        lens = seq_lens if isinstance(seq_lens, list) else [int(x) for x in np.asarray(seq_lens).reshape(-1).tolist()]
        if len(lens) <= PY_SHAPE_MAX_ROWS:
            return _route_shape_py(route, lens, num_kv_heads, options, fused)
    n = np.asarray(seq_lens, dtype=np.int64)
    if route == "workqueue":
        if "num_splits" in options:
            splits = np.minimum(int(options["num_splits"]), num_tiles(n))
        else:
            splits = balanced_row_splits(n, num_kv_heads, int(options["target_items"]),
                                         int(options.get("min_chunk_tiles", 1))).astype(np.int64)
        tokens, _ = _split_tokens(n, splits)
        multi = splits > 1
        launches = 1 if fused else 1 + int(multi.any())
        return int(n.sum()), launches, num_kv_heads * int(splits[multi].sum()), int(tokens.max())
    S = int(options["num_splits"])
    per_launch = 1 if (fused or S == 1) else 2
    partials = num_kv_heads * n.size * S if S > 1 else 0
    if route == "split":
        tokens, _ = _split_tokens(n, np.full(n.size, S, np.int64))
        return int(n.sum()), per_launch, partials, int(tokens.max())
    buckets = length_buckets(n, options.get("bucket_tokens"))
    spans = np.array([key for key, _ in buckets], dtype=np.int64)
    rows_per_bucket = np.array([rows.size for _, rows in buckets], dtype=np.int64)
    tokens, _ = _split_tokens(spans, np.full(spans.size, S, np.int64))
    per_bucket = tokens.reshape(spans.size, S).max(axis=1)   # one launch (pair) per bucket, in turn
    return int((spans * rows_per_bucket).sum()), per_launch * spans.size, partials, int(per_bucket.sum())


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0, exactly, for a few columns.

    The optimum is the unconstrained least-squares solution on its own support, so trying every
    support (2**k - 1 small solves; k <= 6 here) and keeping the best non-negative one is exact.
    Among equal residuals the smaller support wins (fewer terms to explain the same data).
    """
    k = a.shape[1]
    best_x, best_r = np.zeros(k), float(np.linalg.norm(b))
    for size in range(1, k + 1):
        for support in itertools.combinations(range(k), size):
            cols = list(support)
            x_s = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
            if (x_s < 0).any():
                continue
            r = float(np.linalg.norm(a[:, cols] @ x_s - b))
            if r < best_r * (1 - 1e-9) - 1e-15:
                best_x = np.zeros(k)
                best_x[cols] = x_s
                best_r = r
    return best_x


@dataclass(frozen=True)
class CostModel:
    """t(batch) = sum_j coefficients[j] * cost_features(backend, batch, options)[j], in us per layer."""

    backend: str
    coefficients: dict
    options: dict = field(default_factory=dict)
    rows: int = 0
    residuals: dict = field(default_factory=dict)
    #: features that can vary for this backend but did not vary in its calibration rows: their
    #: cost is folded into the intercept, so predictions where they differ are extrapolations
    unidentified: tuple = ()

    @cached_property
    def _coefficient_tuple(self) -> tuple:
        return tuple(float(self.coefficients.get(name, 0.0)) for name in COST_FEATURES)

    def predict(self, batch: Batch) -> float:
        return self._predict(_StepShape.of(batch))

    def _predict(self, shape: _StepShape) -> float:
        x = _features(self.backend, shape, self.options)
        return sum(c * v for c, v in zip(self._coefficient_tuple, x))

    def to_dict(self) -> dict:
        c = self.coefficients
        derived = {"read_gbps": (1e-3 / c["kv_bytes"]) if c.get("kv_bytes", 0) > 0 else None}
        return {"coefficients": c, "options": self.options, "rows": self.rows,
                "residuals": self.residuals, "unidentified": list(self.unidentified), "derived": derived}


def fit_cost_model(backend: str, features: np.ndarray, times_us: np.ndarray,
                   options: Mapping | None = None) -> CostModel:
    """Fit one backend's model: NNLS on relative residuals.

    Why this form: every coefficient is a physical cost (us per launch, 1/bandwidth, ...), so it
    must not be negative, and a non-negative linear model never predicts less time for more
    bytes when it extrapolates past the calibration grid - a per-backend isotonic or piecewise
    fit would be flat (or worse) outside it and needs many more cells per batch-size class than a
    calibration run measures. Rows are weighted by 1/t so a 10 us step counts as much as a
    10 ms one (the decision is about ratios). Columns that are all zero, or constant and so
    indistinguishable from the intercept, are dropped before the fit (coefficient 0).
    """
    x = np.asarray(features, dtype=np.float64)
    y = np.asarray(times_us, dtype=np.float64)
    require(x.ndim == 2 and x.shape[1] == len(COST_FEATURES) and x.shape[0] == y.size,
            "features must be [rows, len(COST_FEATURES)] and match the times")
    require(y.size >= 1 and bool(np.all(np.isfinite(y))) and bool(np.all(y > 0)),
            f"{backend}: times must be positive and finite")
    keep = [0] + [j for j in range(1, x.shape[1])
                  if np.any(x[:, j] != 0) and not np.all(x[:, j] == x[0, j])]
    unidentified = tuple(COST_FEATURES[j] for j in range(1, x.shape[1])
                         if j not in keep and COST_FEATURES[j] not in _fixed_features(backend))
    cols = x[:, keep]
    scale = np.abs(cols).max(axis=0)
    scale[scale == 0] = 1.0
    a = cols / scale / y[:, None]
    coef_scaled = nnls(a, np.ones(y.size))
    coefficients = {name: 0.0 for name in COST_FEATURES}
    for j, c in zip(keep, coef_scaled / scale):
        coefficients[COST_FEATURES[j]] = float(c)
    predicted = x @ np.array([coefficients[n] for n in COST_FEATURES])
    rel = (predicted - y) / y
    residuals = {"rms_rel": float(np.sqrt(np.mean(rel ** 2))), "median_abs_rel": float(np.median(np.abs(rel))),
                 "max_abs_rel": float(np.abs(rel).max()), "rows": int(y.size)}
    return CostModel(backend, coefficients, dict(options or {}), int(y.size), residuals, unidentified)


def _fixed_features(backend: str) -> tuple[str, ...]:
    """Features constant for ``backend`` by construction (not a gap in the calibration)."""
    if not is_pkv(backend):
        return ("launches", "merge_state_bytes")
    return ("launches",) if backend == "pkv-workqueue" else ()


def cost_model_decision(batch: Batch, models: Mapping[str, CostModel], available: Collection[str] | None = None) -> Decision:
    """argmin of the predicted time over the available backends that have a model."""
    names = [b for b in models if available is None or b in available]
    require(names, "no available backend has a fitted cost model")
    shape = _StepShape.of(batch)
    predicted = sorted(((models[b]._predict(shape), b) for b in names), key=lambda pair: pair[0])
    best_time, best = predicted[0]
    ranking = " < ".join(f"{b} {t:.1f} us" for t, b in predicted[:3])
    return Decision(best, dict(models[best].options),
                    f"cost model: B={len(shape.lens)}, N_max={shape.max_len}: {ranking}")


#: Bins per octave of the memo's step signature: 32 bins make each bin ~2.2 % wide.
MEMO_BINS_PER_OCTAVE = 32
MEMO_MAX_ENTRIES = 4096


def step_signature(batch: Batch, bins_per_octave: int = MEMO_BINS_PER_OCTAVE) -> tuple:
    """(spec, B, total, longest and shortest row, each length on a log scale of
    ``bins_per_octave`` bins per doubling): the key under which a cost-model decision is reused.

    Why these: every cost feature is a function of the row lengths that moves by at most about
    one bin's width (2.2 %) while the total, longest and shortest row stay in their bins, far
    below the models' own error (their median relative residual is 2-10 %). A decode step grows
    every row by one token, so consecutive steps share a signature for about 1/45 of their length
    (a 9000-token row keeps one for ~200 steps)."""
    return (batch.spec,) + _length_bins(batch.seq_lens.tolist(), bins_per_octave)


def _length_bins(lens: list, q: int) -> tuple:
    """step_signature without the spec: (B, total, longest, shortest bins) of the row lengths."""
    if len(lens) == 1:  # total = longest = shortest: one logarithm (this runs on every step's host path)
        b = round(math.log2(lens[0]) * q)
        return (1, b, b, b)
    return (len(lens), round(math.log2(sum(lens)) * q), round(math.log2(max(lens)) * q),
            round(math.log2(min(lens)) * q))


@lru_cache(maxsize=4096)
def length_bin_bounds(b: int, bins_per_octave: int = MEMO_BINS_PER_OCTAVE) -> tuple[int, int]:
    """[lo, hi): every row length n >= 1 whose bin (round(log2(n) * bins_per_octave), as in
    :func:`step_signature`) is ``b``; empty (lo == hi) when no integer falls in that bin. The bin is
    monotonic in n, so the bounds come from the closed form, corrected by the formula itself."""
    q = bins_per_octave

    def bin_of(n: int) -> int:
        return round(math.log2(n) * q)

    lo = max(1, math.ceil(2 ** ((b - 0.5) / q)))
    while lo > 1 and bin_of(lo - 1) >= b:
        lo -= 1
    while bin_of(lo) < b:
        lo += 1
    hi = max(lo, math.ceil(2 ** ((b + 0.5) / q)))
    while hi > lo and bin_of(hi - 1) > b:
        hi -= 1
    while bin_of(hi) <= b:
        hi += 1
    return lo, hi


class DecisionMemo:
    """The cost-model decision, reused for steps with the same :func:`step_signature`.

    The full decision (features of every candidate route) costs tens of microseconds of Python
    per step; under the step protocol that host time sits in front of the first launch. The memo
    makes the steady-state cost that of the signature (a few microseconds): a serving loop's
    consecutive steps share a signature, so the model runs once every few hundred steps. The
    first batch of a signature decides for all of it (``misses`` counts those; the decision's
    reason names that batch's B and N_max), and the memo is emptied when it reaches
    ``max_entries``."""

    def __init__(self, policy: "Policy", available: Collection[str] | None = None,
                 bins_per_octave: int = MEMO_BINS_PER_OCTAVE, max_entries: int = MEMO_MAX_ENTRIES):
        require(bins_per_octave >= 1, f"bins_per_octave must be >= 1, got {bins_per_octave}")
        require(max_entries >= 1, f"max_entries must be >= 1, got {max_entries}")
        self.policy = policy
        self.available = None if available is None else tuple(available)
        self.bins_per_octave = int(bins_per_octave)
        self.max_entries = int(max_entries)
        self.hits = 0
        self.misses = 0
        #: (spec number, B, total, longest, shortest bins) -> decision: step_signature with the
        #: spec replaced by a small number, so a hit hashes five ints, not the spec dataclass
        self._decisions: dict[tuple, Decision] = {}
        self._spec_numbers: dict = {}
        self._last_spec: Any = None
        self._last_number = -1
        #: (spec number, lo, hi, decision, spec) of the last single-row signature: a one-row step
        #: whose length lies in [lo, hi) has that signature, which two comparisons tell (no logarithm)
        self._row: tuple | None = None

    def decide(self, batch: Batch) -> Decision:
        spec = batch.spec
        if spec is not self._last_spec:  # a serving loop's batches share one spec object
            self._last_number = self._spec_numbers.setdefault(spec, len(self._spec_numbers))
            self._last_spec = spec
        lens = batch.seq_lens.tolist()
        decision = self._row_hit(lens)
        if decision is not None:
            return decision
        key = (self._last_number,) + _length_bins(lens, self.bins_per_octave)
        decision = self._decisions.get(key)
        if decision is not None:
            self.hits += 1
        else:
            self.misses += 1
            if len(self._decisions) >= self.max_entries:
                self._decisions.clear()
                self._row = None
            decision = self._decisions[key] = self.policy.decide(batch, "cost_model", self.available)
        if len(lens) == 1:
            self._row = (self._last_number, *length_bin_bounds(key[2], self.bins_per_octave), decision, spec)
        return decision

    def last_row(self) -> tuple | None:
        """(spec, lo, hi, decision) of the last one-row signature decided: a one-row step of that
        spec object whose length lies in [lo, hi) is decided ``decision`` by decide and
        fast_decision (which count it a hit); None when no one-row step has been decided since the
        memo was last emptied."""
        row = self._row
        return None if row is None else (row[4], row[1], row[2], row[3])

    def fast_decision(self, batch: Batch) -> Decision | None:
        """``decide(batch)`` when decide would answer by its one-row fast path (one row, of the
        spec and in the bin of the last one-row signature decided), counted as a hit; else None,
        counting nothing. For a caller that handles cheap and expensive decisions differently
        (the adaptive backend decides the first in plan() and defers the second)."""
        if self._row is None:
            return None
        spec = batch.spec
        if spec is not self._last_spec:  # as decide: the spec's number, without numbering a new one
            number = self._spec_numbers.get(spec)
            if number is None:
                return None
            self._last_spec, self._last_number = spec, number
        return self._row_hit(batch.seq_lens.tolist())

    def _row_hit(self, lens: list) -> Decision | None:
        """The last one-row signature's decision when ``lens`` is one row of the current spec in
        its bin (two comparisons, counted as a hit); else None, counting nothing."""
        row = self._row
        if row is not None and len(lens) == 1 and row[0] == self._last_number and row[1] <= lens[0] < row[2]:
            self.hits += 1
            return row[3]
        return None


# --------------------------------------------------------------------------- the frozen policy

@dataclass(frozen=True)
class Policy:
    """A calibrated policy (policy.json) that decides steps by any of :data:`POLICIES`."""

    candidates: tuple[str, ...]
    long_context_threshold: int = PAPER_LONG_CONTEXT_THRESHOLD
    route_options: dict = field(default_factory=dict)
    baseline: str = PAPER_BASELINE
    rules: tuple[ThresholdRule, ...] = ()
    models: dict = field(default_factory=dict)

    def choosable(self, kind: str) -> tuple[str, ...]:
        """Candidates ``kind`` can ever return (the cost model needs a fitted model)."""
        _check_kind(kind)
        if kind == "cost_model":
            return tuple(b for b in self.candidates if b in self.models)
        return self.candidates

    def rule_decision(self, batch: Batch, kind: str) -> Decision:
        """The policy's choice before availability is considered."""
        _check_kind(kind)
        features = StepFeatures.from_batch(batch)
        if kind == "paper":
            return paper_decision(features, self.long_context_threshold, PAPER_BUCKET_SPLITS,
                                  self.route_options.get("pkv-workqueue"), PAPER_BASELINE)
        if kind == "thresholds":
            return threshold_decision(features, self.rules, self.baseline)
        return cost_model_decision(batch, self.models)

    def decide(self, batch: Batch, kind: str = "cost_model", available: Collection[str] | None = None) -> Decision:
        """Decide ``batch`` by ``kind``; the result always names a backend in ``available``
        (all candidates when None). A rule's choice that cannot run here falls back to the
        cheapest available backend by the cost model, else to the first available candidate."""
        _check_kind(kind)
        usable = [b for b in self.candidates if available is None or b in available]
        require(usable, f"none of the policy's candidates ({', '.join(self.candidates)}) is available")
        if kind == "cost_model":
            return cost_model_decision(batch, self.models, usable)
        decision = self.rule_decision(batch, kind)
        if decision.backend in usable:
            return decision
        modelled = [b for b in usable if b in self.models]
        if modelled:
            fallback = cost_model_decision(batch, self.models, modelled)
            return Decision(fallback.backend, fallback.options,
                            f"{decision.reason}; {decision.backend} is unavailable here, so {fallback.reason}")
        backend = usable[0]
        return Decision(backend, dict(self.route_options.get(backend, {})),
                        f"{decision.reason}; {decision.backend} is unavailable here -> {backend} "
                        f"(first available candidate)")

    @classmethod
    def from_dict(cls, data: Mapping) -> "Policy":
        require(isinstance(data, Mapping), "a policy must be a JSON object")
        require(data.get("format") == POLICY_FORMAT,
                f"not a persistentkv policy (format {data.get('format')!r}, expected {POLICY_FORMAT!r})")
        try:
            candidates = tuple(str(c) for c in data["candidates"])
            rules = tuple(ThresholdRule(**rule) for rule in data["thresholds"]["rules"])
            models = {}
            for backend, entry in data["cost_model"]["models"].items():
                coefficients = {name: float(entry["coefficients"][name]) for name in COST_FEATURES}
                require(all(math.isfinite(v) and v >= 0 for v in coefficients.values()),
                        f"cost model of {backend} has a negative or non-finite coefficient")
                models[backend] = CostModel(backend, coefficients, dict(entry.get("options", {})),
                                            int(entry.get("rows", 0)), dict(entry.get("residuals", {})),
                                            tuple(entry.get("unidentified", ())))
            policy = cls(candidates, int(data["long_context_threshold"]),
                         {k: dict(v) for k, v in data.get("route_options", {}).items()},
                         str(data["baseline"]), rules, models)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, PKVError):
                raise
            raise PKVError(f"malformed policy ({type(exc).__name__}: {exc})") from None
        require(candidates, "the policy lists no candidates")
        return policy


def _check_kind(kind: str) -> None:
    require(kind in POLICIES, f"unknown policy {kind!r}; expected one of {', '.join(POLICIES)}")


def paper_policy(candidates: Sequence[str] = (PAPER_BASELINE, "pkv-buckets", "pkv-workqueue"),
                 long_context_threshold: int = PAPER_LONG_CONTEXT_THRESHOLD,
                 target_items: int = DEFAULT_TARGET_ITEMS) -> Policy:
    """The published rules without any calibration (no thresholds or cost model)."""
    return Policy(tuple(candidates), long_context_threshold,
                  {"pkv-buckets": {"num_splits": PAPER_BUCKET_SPLITS},
                   "pkv-workqueue": {"target_items": target_items}})


def load_policy(path: str | Path) -> Policy:
    path = Path(path)
    require(path.is_file(), f"policy file {path} does not exist (run persistentkv calibrate)")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PKVError(f"policy file {path} is not valid JSON ({exc})") from None
    try:
        return Policy.from_dict(data)
    except PKVError as exc:
        raise PKVError(f"policy file {path}: {exc}") from None


# --------------------------------------------------------------------------- calibration

def route_options_for(backend: str, num_splits: int, target_items: int = DEFAULT_TARGET_ITEMS) -> dict:
    """Constructor options of ``backend`` (backends/pkv.py) for a timing row's ``num_splits``.

    pkv-workqueue takes only ``target_items`` (the balanced queue, planner.min_chunk_tiles left
    at the planner's default of 1), so its rows' ``num_splits`` does not change its options.
    """
    if backend == "pkv-workqueue":
        return {"target_items": int(target_items)}
    if backend in ("pkv-buckets", "pkv-split"):
        return {"num_splits": int(num_splits) if num_splits > 0 else PAPER_BUCKET_SPLITS}
    return {}


class CellResolver:
    """Rebuilds the batch a timing row measured, from its trace name, seed and step.

    Config traces are regenerated (file traces read relative to ``base_dir``); synthetic names
    ``B<b>xN<n>`` are b rows of n tokens. Row lengths decide every feature; page placement does not.
    """

    def __init__(self, trace_entries: Iterable[Mapping] = (), base_dir: str | Path = "."):
        self.entries = {e["name"]: dict(e) for e in trace_entries}
        self.base_dir = Path(base_dir)
        self._traces: dict = {}

    def lengths(self, trace: str, seed: int, step: int) -> list[int]:
        match = SYNTHETIC_TRACE.match(trace)
        if match:
            b, n = int(match.group(1)), int(match.group(2))
            require(b >= 1 and n >= 1, f"synthetic case {trace!r} needs B >= 1 and N >= 1")
            return [n] * b
        require(trace in self.entries,
                f"timing rows name trace {trace!r}, which is neither in the config's traces "
                f"({', '.join(sorted(self.entries)) or 'none given'}) nor a synthetic B<b>xN<n> case")
        key = (trace, seed)
        if key not in self._traces:
            from .traces import build

            built = build(self.entries[trace], seed, self.base_dir)
            self._traces[key] = {s.index: list(s.lengths) for s in built.steps}
        steps = self._traces[key]
        require(step in steps, f"trace {trace!r} seed {seed} has no step {step}")
        return steps[step]


@dataclass
class _Cell:
    key: tuple
    batch: Batch
    times: dict            # (backend, options json) -> median us
    max_len: int


def _options_key(options: Mapping) -> str:
    return json.dumps(dict(options), sort_keys=True)


def check_timings(frame, source: str = "timings") -> None:
    """One-line errors for a timing table that is empty or lacks the columns calibration reads."""
    require(len(frame) > 0, f"{source} has no rows")
    missing = [c for c in TIMING_COLUMNS if c not in frame.columns]
    require(not missing, f"{source} lacks column(s) {', '.join(missing)} (docs/DATA.md, raw timing rows)")
    import pandas as pd

    for column in ("seed", "step", "batch_size", "max_len", "total_tokens", "num_qo_heads", "num_kv_heads",
                   "head_dim", "page_size", "num_splits", "per_layer_us"):
        require(pd.api.types.is_numeric_dtype(frame[column]),
                f"{source}: column {column} must be numeric, got {frame[column].dtype}")


def calibrate(timings, candidates: Sequence[str], *, trace_entries: Iterable[Mapping] = (),
              base_dir: str | Path = ".", calibration_seed: int | None = None,
              holdout_seeds: Collection[int] = (), long_context_threshold: int = PAPER_LONG_CONTEXT_THRESHOLD,
              target_items: int = DEFAULT_TARGET_ITEMS,
              protocol: str | None = None, source: str = "timings") -> dict:
    """Fit the ``thresholds`` and ``cost_model`` policies on raw calibration timings.

    ``timings``: a DataFrame in the raw format of docs/DATA.md; rows with experiment
    ``calibration``, status ``ok`` and one protocol (``step`` if present, else ``kernel``, else
    ``eager``) are used, target ``per_layer_us`` (median over repeats per cell and backend).
    Returns the policy.json dict (see :class:`Policy.from_dict`).
    """
    check_timings(timings, source)
    candidates = list(dict.fromkeys(candidates))
    require(candidates, "no candidate backends given")
    frame = timings[timings["experiment"] == "calibration"]
    require(len(frame) > 0, f"{source} has no rows of experiment 'calibration' "
                            f"(found: {', '.join(sorted(map(str, timings['experiment'].unique())))})")
    leaked = sorted(set(int(s) for s in frame["seed"].unique()) & set(int(s) for s in holdout_seeds))
    require(not leaked, f"{source} has calibration rows at holdout seed(s) {leaked}; "
                        f"the policy must never see a holdout seed")
    protocols = [str(p) for p in frame["protocol"].unique()]
    if protocol is None:
        preferred = [p for p in PROTOCOL_PREFERENCE if p in protocols]
        require(preferred, f"{source} has no rows of protocol {', '.join(PROTOCOL_PREFERENCE)} "
                           f"(found: {', '.join(sorted(protocols))})")
        protocol = preferred[0]
    require(protocol in protocols, f"{source} has no calibration rows of protocol {protocol!r}")
    ok = frame[(frame["protocol"] == protocol) & (frame["status"] == "ok")
               & frame["backend"].isin(candidates)]
    ok = ok[np.isfinite(ok["per_layer_us"].astype(float)) & (ok["per_layer_us"].astype(float) > 0)].copy()
    # baselines may leave num_splits empty rather than -1; groupby would silently drop NaN keys
    ok["num_splits"] = ok["num_splits"].fillna(-1).astype(np.int64)
    require(len(ok) > 0, f"{source}: no 'ok' calibration rows of protocol {protocol!r} for any candidate "
                         f"({', '.join(candidates)})")

    # one cell per measured workload; rebuild its batch and check it against the row
    resolver = CellResolver(trace_entries, base_dir)
    spec_cols = ["num_qo_heads", "num_kv_heads", "head_dim", "page_size", "dtype"]
    # cells at different hole fractions are different measurements even with equal lengths
    cell_cols = ["trace", "seed", "step"] + spec_cols + (["hole_fraction"] if "hole_fraction" in ok.columns else [])
    cells: list[_Cell] = []
    route_counts: dict[str, dict[str, int]] = {}
    for key, rows in ok.groupby(cell_cols, sort=True):
        trace, seed, step = str(key[0]), int(key[1]), int(key[2])
        require(calibration_seed is None or SYNTHETIC_TRACE.match(trace) or seed == calibration_seed,
                f"{source}: calibration rows of trace {trace!r} use seed {seed}, not the calibration "
                f"seed {calibration_seed}")
        spec = AttentionSpec(int(key[3]), int(key[4]), int(key[5]), int(key[6]), str(key[7]))
        lengths = resolver.lengths(trace, seed, step)
        first = rows.iloc[0]
        got = (len(lengths), max(lengths), sum(lengths))
        want = (int(first["batch_size"]), int(first["max_len"]), int(first["total_tokens"]))
        require(got == want, f"trace {trace!r} seed {seed} step {step}: the timings say (batch_size, max_len, "
                             f"total_tokens) = {want} but the trace gives {got}")
        times = {}
        for (backend, splits), group in rows.groupby(["backend", "num_splits"], sort=True):
            options = route_options_for(str(backend), int(splits), target_items)
            times[(str(backend), _options_key(options))] = float(np.median(group["per_layer_us"].astype(float)))
            counts = route_counts.setdefault(str(backend), {})
            counts[_options_key(options)] = counts.get(_options_key(options), 0) + 1
        cells.append(_Cell(tuple(key), make_batch(spec, lengths), times, max(lengths)))

    # each backend's most-measured options are the ones the policy will pass
    route_options = {b: json.loads(max(c.items(), key=lambda kv: (kv[1], kv[0]))[0])
                     for b, c in route_counts.items() if is_pkv(b)}
    chosen = {b: _options_key(route_options.get(b, {})) for b in candidates}

    # ---- cost model: one fit per backend over all its rows (any options)
    models, unfitted = {}, {}
    for backend in candidates:
        xs, ys = [], []
        for cell in cells:
            for (b, okey), t in cell.times.items():
                if b == backend:
                    xs.append(cost_features(backend, cell.batch, json.loads(okey)))
                    ys.append(t)
        if not ys:
            unfitted[backend] = f"no 'ok' calibration rows of protocol {protocol!r}"
            continue
        models[backend] = fit_cost_model(backend, np.array(xs), np.array(ys), route_options.get(backend, {}))

    # ---- thresholds: per G and batch-size class, the best (route, N_max threshold) over a baseline
    def time_of(cell: _Cell, backend: str) -> float | None:
        return cell.times.get((backend, chosen[backend]))

    baselines = [b for b in candidates if not is_pkv(b) and b in models]
    require(baselines, f"{source}: no baseline backend has 'ok' calibration rows (candidates: "
                       f"{', '.join(candidates)}); the thresholds need one to beat")
    global_baseline = _best_baseline(cells, baselines, time_of)
    rules = []
    for group in sorted({c.batch.spec.group_size for c in cells}):
        for low, high in BATCH_CLASSES:
            members = [c for c in cells if c.batch.spec.group_size == group
                       and batch_class(c.batch.batch_size) == (low, high)]
            present = [b for b in baselines if any(time_of(c, b) is not None for c in members)]
            if not present:
                continue
            base = _best_baseline(members, present, time_of)
            measured = sum(time_of(c, base) is not None for c in members)
            best = ThresholdRule(group, low, high, base, cells=measured, summed_speedup=float(measured),
                                 note="no PKV route beat the baseline")
            best_gain = 0.0
            for route in [b for b in candidates if is_pkv(b) and b in models]:
                pairs = [(c.max_len, time_of(c, base) / time_of(c, route)) for c in members
                         if time_of(c, base) is not None and time_of(c, route) is not None]
                if not pairs:
                    continue
                threshold, summed = fit_threshold([p[0] for p in pairs], [p[1] for p in pairs])
                gain = summed - len(pairs)
                if threshold is not None and gain > best_gain + 1e-12:
                    best_gain = gain
                    best = ThresholdRule(group, low, high, base, route, threshold, route_options.get(route, {}),
                                         len(pairs), summed, f"{route} from N_max >= {threshold}")
            rules.append(best)

    policy = Policy(tuple(candidates), int(long_context_threshold), route_options, global_baseline,
                    tuple(rules), models)
    run_ids = sorted(str(r) for r in ok["run_id"].unique()) if "run_id" in ok.columns else []
    return {
        "format": POLICY_FORMAT,
        "calibration_seed": calibration_seed,
        "fitted_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "run_id": ",".join(run_ids),
        "protocol": protocol,
        "target": "per_layer_us",
        "candidates": list(candidates),
        "cells": len(cells),
        "long_context_threshold": int(long_context_threshold),
        "baseline": global_baseline,
        "route_options": route_options,
        "thresholds": {"batch_classes": [list(c) for c in BATCH_CLASSES],
                       "rules": [r.to_dict() for r in rules]},
        "cost_model": {"features": list(COST_FEATURES),
                       "form": "t_us = sum_j c_j * feature_j, c_j >= 0 (NNLS on relative residuals)",
                       "models": {b: m.to_dict() for b, m in models.items()},
                       "unfitted": unfitted},
        "evaluation": evaluate(policy, cells, time_of),
    }


def _best_baseline(cells: Sequence[_Cell], baselines: Sequence[str], time_of: Callable) -> str:
    """The baseline measured in the most cells; among those, the lowest geometric-mean time
    relative to the best baseline of each cell (ties: candidate order)."""
    def score(b: str):
        ratios = []
        for c in cells:
            t = time_of(c, b)
            others = [time_of(c, o) for o in baselines if time_of(c, o) is not None]
            if t is not None:
                ratios.append(math.log(t / min(others)))
        return (-len(ratios), float(np.mean(ratios)) if ratios else 0.0)

    return min(baselines, key=lambda b: (score(b), baselines.index(b)))


def evaluate(policy: Policy, cells: Sequence[_Cell], time_of: Callable) -> dict:
    """In-sample check of each policy on the calibration cells: how often it picks the fastest
    measured backend, and its geometric-mean time relative to that oracle and to the baseline."""
    out = {}
    for kind in POLICIES:
        picked = hits = 0
        to_oracle, to_baseline = [], []
        for cell in cells:
            measured = [b for b in policy.candidates if time_of(cell, b) is not None]
            if not measured or (kind == "cost_model" and not any(b in policy.models for b in measured)):
                continue
            if kind == "cost_model":
                decision = cost_model_decision(cell.batch, policy.models, measured)
            else:
                decision = policy.decide(cell.batch, kind, measured)
            t = time_of(cell, decision.backend)
            if t is None:
                continue
            oracle = min(time_of(cell, b) for b in measured)
            picked += 1
            hits += t <= oracle * (1 + 1e-9)
            to_oracle.append(math.log(t / oracle))
            base = time_of(cell, policy.baseline)
            if base is not None:
                to_baseline.append(math.log(base / t))
        out[kind] = {
            "cells": picked,
            "picked_fastest": hits,
            "geomean_time_over_oracle": float(math.exp(np.mean(to_oracle))) if to_oracle else None,
            "geomean_speedup_over_baseline": float(math.exp(np.mean(to_baseline))) if to_baseline else None,
        }
    return out


def describe(policy_dict: Mapping) -> str:
    """A few lines summarising a calibrated policy (for the calibrate command)."""
    lines = [f"protocol {policy_dict['protocol']}, {policy_dict['cells']} cells, baseline {policy_dict['baseline']}"]
    for rule in policy_dict["thresholds"]["rules"]:
        label = _class_label(rule["min_batch"], rule["max_batch"])
        what = (f"{rule['route']} from N_max >= {rule['min_max_len']}" if rule["route"] else f"always {rule['baseline']}")
        lines.append(f"  thresholds G={rule['group_size']} {label}: {what} (summed speedup "
                     f"{rule['summed_speedup']:.3f} over {rule['cells']} cells)")
    for backend, model in policy_dict["cost_model"]["models"].items():
        r = model["residuals"]
        gaps = f"; not identified: {', '.join(model['unidentified'])}" if model.get("unidentified") else ""
        lines.append(f"  cost model {backend}: {model['rows']} rows, rms rel residual {r['rms_rel']:.3f}, "
                     f"max {r['max_abs_rel']:.3f}{gaps}")
    for backend, why in policy_dict["cost_model"]["unfitted"].items():
        lines.append(f"  cost model {backend}: not fitted ({why})")
    for kind, ev in policy_dict["evaluation"].items():
        if ev["cells"]:
            lines.append(f"  {kind}: fastest in {ev['picked_fastest']}/{ev['cells']} cells, "
                         f"geomean time / oracle {ev['geomean_time_over_oracle']:.3f}")
    return "\n".join(lines)
