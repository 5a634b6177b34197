"""Fitting the adaptive policy offline, from calibration timings, into policy.json.

:func:`calibrate` takes a raw timing table (docs/DATA.md; rows of experiment ``calibration``),
rebuilds each measured step (:class:`CellResolver`), and fits the ``thresholds`` rules (per group
size and batch-size class, the N_max from which a PKV route replaces the best baseline:
:func:`fit_threshold`) and one non-negative linear ``cost_model`` per candidate (:func:`nnls`,
:func:`fit_cost_model`) on persistentkv.policy's cost features. The dict it returns is written,
frozen, as ``results/<hw>/policy.json``; persistentkv.policy decides steps from it at run time.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Collection, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

from .cache import Batch, make_batch
from .errors import require
from .names import EQUAL_ROWS
from .policy import (BATCH_CLASSES, COST_FEATURES, DEFAULT_TARGET_ITEMS, PAPER_BUCKET_SPLITS,
                     PAPER_LONG_CONTEXT_THRESHOLD, POLICIES, POLICY_FORMAT, CostModel, Policy, ThresholdRule,
                     batch_class, class_label, cost_features, cost_model_decision, is_pkv)
from .spec import AttentionSpec
from .traces import build

#: Protocols calibration reads, most preferred first: the step protocol is what the policy decides.
PROTOCOL_PREFERENCE = ("step", "kernel", "eager")
#: Columns of the raw timing rows that calibration reads.
TIMING_COLUMNS = ("experiment", "trace", "seed", "step", "batch_size", "max_len", "total_tokens",
                  "num_qo_heads", "num_kv_heads", "head_dim", "page_size", "dtype", "backend",
                  "num_splits", "protocol", "per_layer_us", "status")


# --------------------------------------------------------------------------- the fits

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
        match = EQUAL_ROWS.match(trace)
        if match:
            b, n = int(match.group(1)), int(match.group(2))
            require(b >= 1 and n >= 1, f"synthetic case {trace!r} needs B >= 1 and N >= 1")
            return [n] * b
        require(trace in self.entries,
                f"timing rows name trace {trace!r}, which is neither in the config's traces "
                f"({', '.join(sorted(self.entries)) or 'none given'}) nor a synthetic B<b>xN<n> case")
        key = (trace, seed)
        if key not in self._traces:
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
        require(calibration_seed is None or EQUAL_ROWS.match(trace) or seed == calibration_seed,
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
        label = class_label(rule["min_batch"], rule["max_batch"])
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
