"""The adaptive policy at run time: which backend runs a decode step, from the frozen policy.json.

Three policies, each a pure function of the step (a :class:`~persistentkv.cache.Batch`):

``paper``
    The published rules as the artifact had them (docs/PAPER.md, "Policy"): G != 4 -> FlashInfer;
    N_max < 16384 -> FlashInfer; B == 1 -> length buckets with S = 32; B >= 8 -> work queue;
    B = 2..7 -> FlashInfer. "FlashInfer" is the tensor-core decode, ``flashinfer-tc``.
``thresholds``
    The same rule shape re-fitted on calibration timings: per group size and batch-size class
    (1, 2-7, >= 8) one PKV route and the N_max at or above which it replaces the class's best
    baseline.
``cost_model``
    Per candidate backend a non-negative linear model of the time of one layer; the step goes to
    the candidate with the least predicted time among those available here. Its features come
    from the Batch alone (see :func:`cost_features`).

persistentkv.calibration fits the last two offline, from a raw timing table (docs/DATA.md), into
the dict written, frozen, as ``results/<hw>/policy.json``; :func:`load_policy` reads it back.
Decisions never name a backend outside ``available`` (the backends that can run here).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Collection, Mapping, Sequence

import numpy as np

from .cache import Batch
from .errors import PKVError, require
from .names import PKV_BACKENDS
from .plan import PARTIAL_FLOATS_EXTRA, TILE_TOKENS, balanced_chunk_tiles, split_tile_bounds
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


def class_label(low: int, high: int | None) -> str:
    return f"B={low}" if high == low else (f"B>={low}" if high is None else f"B={low}..{high}")


def threshold_decision(features: StepFeatures, rules: Sequence[ThresholdRule], default_baseline: str) -> Decision:
    """The re-fitted rules (no availability check; :meth:`Policy.decide` adds it)."""
    f = features
    for rule in rules:
        if not rule.covers(f):
            continue
        label = class_label(rule.min_batch, rule.max_batch)
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
    head_bytes = 2 * spec.head_dim * spec.kv_itemsize
    route = PKV_BACKENDS.get(backend)
    if route is None:
        return (1.0, float(shape.total * spec.kv_bytes_per_token), 1.0, 0.0, float(shape.max_len * head_bytes),
                float(len(shape.lens)))
    kv_tokens, launches, partials, critical_tokens = route_shape(route, shape.lens, spec.num_kv_heads,
                                                                 dict(options or {}))
    merge_bytes = partials * spec.group_size * 4 * (spec.head_dim + PARTIAL_FLOATS_EXTRA)
    return (1.0, float(kv_tokens * spec.kv_bytes_per_token), float(launches), float(merge_bytes),
            float(critical_tokens * head_bytes), float(len(shape.lens)))


def _longest_split(n: int, tiles: int, splits: int) -> int:
    """The most tokens one of ``splits`` splits of a row of ``n`` tokens (``tiles`` tiles) holds
    under the planner's row-local bound (plan.split_tile_bounds), in closed form: a split holds
    q = T // S or q + 1 tiles; the last ends at n, and another holds q + 1 when r = T % S >= 2.
    Worked number: n = 1000 (32 tiles), S = 5 gives 6, 6, 7, 6, 7 tiles; the last covers tokens
    800-1000 (200) and the third 7 whole tiles (224), so 224."""
    if splits == 1:
        return n
    last_lo, _ = split_tile_bounds(tiles, splits, splits - 1)
    q, r = divmod(tiles, splits)
    return max(n - last_lo * TILE_TOKENS, TILE_TOKENS * (q + (r >= 2)))


def route_shape(route: str, seq_lens, num_kv_heads: int, options: Mapping) -> tuple[int, int, int, int]:
    """What ``plan.make_plan(batch, route, **options)`` would count, from the row lengths alone.

    Parameters
    ----------
    route : str
        ``workqueue`` (options: ``target_items`` [+ ``min_chunk_tiles``] or ``num_splits``),
        ``split`` or ``buckets`` / ``padded_buckets`` (``num_splits`` [+ ``bucket_tokens``]);
        ``fused_merge`` as the planner takes it.
    seq_lens : list of int, or array-like of int, shape [B]
        The rows' real lengths.
    num_kv_heads : int
    options : mapping

    Returns
    -------
    tuple of int
        (tokens read, launches, partial states per query group, the longest item's tokens summed
        over launches that run one after another).

    Plain Python over the planner's own functions (balanced_chunk_tiles, the row-local bound):
    on the few rows of a decode step NumPy's per-call overhead, not arithmetic, is the cost, and
    the adaptive backend evaluates this for every candidate inside each step's timed plan.
    """
    fused = bool(options.get("fused_merge", route == "workqueue"))
    lens = seq_lens if isinstance(seq_lens, list) else [int(x) for x in np.asarray(seq_lens).reshape(-1).tolist()]
    if route == "workqueue":
        require(("target_items" in options) != ("num_splits" in options),
                "pkv-workqueue options need exactly one of target_items and num_splits")
        tiles = [-(-x // TILE_TOKENS) for x in lens]
        if "num_splits" in options:
            splits = [min(int(options["num_splits"]), t) for t in tiles]
        else:
            chunk = balanced_chunk_tiles(tiles, num_kv_heads, int(options["target_items"]),
                                         int(options.get("min_chunk_tiles", 1)))
            splits = [-(-t // chunk) for t in tiles]
        multi = [S for S in splits if S > 1]
        launches = 1 if fused else 1 + int(bool(multi))
        critical = max(_longest_split(x, t, S) for x, t, S in zip(lens, tiles, splits))
        return sum(lens), launches, num_kv_heads * sum(multi), critical
    require("num_splits" in options, f"the {route} route needs num_splits")
    require(route in ("split", "buckets", "padded_buckets"), f"unknown route {route!r}")
    S = int(options["num_splits"])
    require(S >= 1, f"num_splits must be >= 1, got {S}")
    per_launch = 1 if (fused or S == 1) else 2
    partials = num_kv_heads * len(lens) * S if S > 1 else 0
    if route == "split":
        return sum(lens), per_launch, partials, max(_longest_split(x, -(-x // TILE_TOKENS), S) for x in set(lens))
    bucket = options.get("bucket_tokens")
    if bucket is not None:
        require(bucket >= 1, f"bucket_tokens must be >= 1, got {bucket}")
    counts: dict[int, int] = {}  # plan.length_buckets' spans, counted without its row arrays
    for x in lens:
        key = x if bucket is None else -(-x // bucket) * bucket
        counts[key] = counts.get(key, 0) + 1
    critical = sum(_longest_split(span, -(-span // TILE_TOKENS), S) for span in counts)
    return sum(span * rows for span, rows in counts.items()), per_launch * len(counts), partials, critical


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
