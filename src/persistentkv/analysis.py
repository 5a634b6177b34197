"""Medians, ratios and intervals over tidy timing rows (``results/{hw}/raw/*.parquet``).

Pure pandas/NumPy, CPU-tested. The estimator, stated once:

* A *cell* is one (experiment, trace, seed, protocol) under one attention spec (:data:`CELL`).
* Within a cell, a backend's time at a step is the **median over repeats**; the backend's cell
  time is the **mean of those step medians over the steps** it shares with whatever it is
  compared to. Every step carries equal weight, so ``tokens / cell time`` is the throughput of
  the measured steps and a ratio of cell times is a ratio of throughputs.
* ``speedup = t_reference / t_backend`` (> 1: the backend is faster).
* Intervals: 95% percentile bootstrap, :data:`N_BOOT` replicates. One replicate resamples the
  cell's steps with replacement (the same steps for every backend, so ratios are paired: all
  backends ran on the same inputs) and, inside each chosen step, each backend's repeats with
  replacement. The generator is seeded from :data:`BOOT_SEED` and the cell's key, so a cell gets
  the same interval whatever else is in the frame.
* Reference ``flashinfer-best``: the faster (point estimate) of ``flashinfer-cc`` and
  ``flashinfer-tc`` in that cell; ``baseline-best``: the fastest of :data:`BASELINES`. The pick is
  made once per cell from the point estimates and recorded in ``ref_backend``.
* Geometric mean across rows (seeds, traces): hierarchical bootstrap: a replicate resamples the
  rows with replacement and takes each chosen row's replicate of the same index, so the interval
  carries both the spread between rows and the noise inside each.
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np
import pandas as pd

from .errors import PKVError, require
from .names import COMPOSITE_REFERENCES

#: Columns that identify one cell: the same inputs for every backend inside it.
CELL = ["experiment", "trace", "seed", "protocol", "num_qo_heads", "num_kv_heads", "head_dim",
        "page_size", "dtype", "hole_fraction"]
N_BOOT = 1000
BOOT_SEED = 20260622
CONFIDENCE = 0.95
METRICS = ("time_us", "wall_us", "per_layer_us", "host_us")
#: Columns :func:`bootstrap_cells` needs from a raw frame.
REQUIRED = ["experiment", "trace", "seed", "step", "repeat", "backend", "protocol", "status"]


def ok_rows(raw: pd.DataFrame, metric: str = "time_us") -> pd.DataFrame:
    """Rows with ``status == 'ok'`` and a finite, positive ``metric``."""
    require(metric in METRICS, f"unknown metric {metric!r}; expected one of {', '.join(METRICS)}")
    if raw.empty:
        return raw
    missing = [c for c in REQUIRED + [metric] if c not in raw.columns]
    require(not missing, f"timing rows lack column(s) {', '.join(missing)}")
    values = pd.to_numeric(raw[metric], errors="coerce")
    return raw[(raw["status"] == "ok") & np.isfinite(values) & (values > 0)]


def _cell_columns(frame: pd.DataFrame) -> list[str]:
    return [c for c in CELL if c in frame.columns]


def _key_seed(key: tuple) -> int:
    return zlib.crc32(repr(tuple(str(k) for k in key)).encode())


@dataclass
class Cell:
    """One cell's per-step medians and their bootstrap replicates, per backend.

    steps:  int64 [n_steps], the step ids present in the cell
    point:  backend -> float64 [n_steps], median over repeats (NaN where the backend has no row)
    sums:   backend -> float64 [n_boot, n_steps]: per replicate, the sum of the resampled step
            medians that landed on each data step (NaN where the backend has no row)
    counts: float64 [n_boot, n_steps]: per replicate, how often each data step was drawn
    tokens: float64 [n_steps], total_tokens of each step (NaN when not recorded)

    Keeping replicates per *data* step lets a comparison restrict itself to the steps both
    backends have, exactly: the replicate mean over ``mask`` is sums[:, mask].sum / counts[:, mask].sum.
    """

    key: dict
    steps: np.ndarray
    point: dict[str, np.ndarray]
    sums: dict[str, np.ndarray]
    counts: np.ndarray
    tokens: np.ndarray
    repeats: dict[str, int] = field(default_factory=dict)
    run_ids: tuple[str, ...] = ()
    info: dict = field(default_factory=dict)      # batch_size / max_len of the cell's first row

    @property
    def backends(self) -> list[str]:
        return sorted(self.point)

    def common(self, *backends: str) -> np.ndarray:
        """bool [n_steps]: steps where every named backend has a time."""
        mask = np.ones(self.steps.size, bool)
        for b in backends:
            mask &= np.isfinite(self.point[b])
        return mask

    def time(self, backend: str, mask: np.ndarray | None = None) -> tuple[float, np.ndarray]:
        """(point, float64 [n_boot]): mean over ``mask`` steps of the backend's step medians."""
        mask = self.common(backend) if mask is None else mask
        if not mask.any():
            return float("nan"), np.full(self.counts.shape[0], np.nan)
        with np.errstate(invalid="ignore", divide="ignore"):
            reps = self.sums[backend][:, mask].sum(axis=1) / self.counts[:, mask].sum(axis=1)
        return float(self.point[backend][mask].mean()), reps

    def resolve(self, reference: str) -> str | None:
        """The backend a reference name stands for here (None when absent)."""
        return self.fastest(COMPOSITE_REFERENCES.get(reference, (reference,)))

    def fastest(self, members) -> str | None:
        """The fastest (point estimate) of the named backends present here; None when none is."""
        present = [b for b in members if b in self.point]
        if not present:
            return None
        return min(present, key=lambda b: self.time(b)[0])


def unlabelled(backend: str) -> str:
    """The backend a :func:`label_splits` name was run by: ``pkv-split/S16`` -> ``pkv-split``."""
    return re.sub(r"/S\d+$", "", backend)


def label_splits(rows: pd.DataFrame) -> pd.DataFrame:
    """Backends run with several split counts in one cell (split_sensitivity) become separate
    backends named ``<backend>/S<n>``, so their times are never pooled into one median."""
    if "num_splits" not in rows.columns or rows.empty:
        return rows
    cols = _cell_columns(rows) + ["backend"]
    many = rows.groupby(cols, dropna=False)["num_splits"].transform("nunique") > 1
    if not many.any():
        return rows
    rows = rows.copy()
    rows.loc[many, "backend"] = rows.loc[many, "backend"] + "/S" + rows.loc[many, "num_splits"].astype(int).astype(str)
    return rows


def _sorted_median(values: np.ndarray, n) -> np.ndarray:
    """Median along the last axis of ``values`` sorted ascending with NaN last, of the first ``n``
    entries (an int, or an int array broadcasting against values.shape[:-1]); NaN where n == 0."""
    n = np.broadcast_to(np.asarray(n), values.shape[:-1])
    lo = np.maximum((n - 1) // 2, 0)[..., None]
    hi = np.maximum(n // 2, 0)[..., None]
    med = (np.take_along_axis(values, lo, -1) + np.take_along_axis(values, hi, -1))[..., 0] / 2
    return np.where(n > 0, med, np.nan)


def bootstrap_cells(raw: pd.DataFrame, metric: str = "time_us", n_boot: int = N_BOOT,
                    seed: int = BOOT_SEED) -> list[Cell]:
    """Group ``ok`` rows into cells and bootstrap each (see the module docstring)."""
    require(isinstance(n_boot, int) and n_boot >= 10, f"n_boot must be an integer >= 10, got {n_boot!r}")
    rows = ok_rows(raw, metric)
    if rows.empty:
        return []
    rows = label_splits(rows)
    cols = _cell_columns(rows)
    cells = []
    for key, group in rows.groupby(cols, dropna=False, sort=True):
        key = key if isinstance(key, tuple) else (key,)
        step_of = group["step"].to_numpy(np.int64)
        steps = np.unique(step_of)
        spos = np.searchsorted(steps, step_of)                    # row -> step position
        rng = np.random.default_rng([seed, _key_seed(key)])
        step_idx = rng.integers(0, steps.size, size=(n_boot, steps.size))       # [n_boot, n_steps]
        boot_row = np.repeat(np.arange(n_boot), steps.size)
        counts = np.zeros((n_boot, steps.size))
        np.add.at(counts, (boot_row, step_idx.ravel()), 1.0)
        tokens = np.full(steps.size, np.nan)
        if "total_tokens" in group.columns:
            tokens[spos] = pd.to_numeric(group["total_tokens"], errors="coerce").to_numpy(float)
        value_of = group[metric].to_numpy(float)
        repeat_of = group["repeat"].to_numpy()
        backend_of = group["backend"].to_numpy(str)
        point, sums, repeats = {}, {}, {}
        for backend in np.unique(backend_of):
            mine = backend_of == backend
            rep_ids, rep_code = np.unique(repeat_of[mine], return_inverse=True)
            n_rep = rep_ids.size
            values = np.full((steps.size, n_rep), np.nan)
            values[spos[mine], rep_code] = value_of[mine]
            values = np.sort(values, axis=1)                      # NaN (missing repeats) last
            n_avail = np.isfinite(values).sum(axis=1)             # [n_steps]
            point[backend] = _sorted_median(values, n_avail)
            # Repeats are drawn among the ones this step has; a step the backend lacks stays NaN.
            u = rng.random((n_boot, steps.size, n_rep))
            rep_idx = (u * np.maximum(n_avail[step_idx], 1)[:, :, None]).astype(np.int64)
            draws = values[step_idx[:, :, None], rep_idx]         # [n_boot, n_steps, n_rep]
            med = _sorted_median(np.sort(draws, axis=2), n_rep)  # NaN only where n_avail == 0
            s = np.zeros((n_boot, steps.size))
            np.add.at(s, (boot_row, step_idx.ravel()), med.ravel())
            sums[str(backend)] = s
            point[str(backend)] = point.pop(backend)
            repeats[str(backend)] = int(n_rep)
        run_ids = tuple(sorted(str(r) for r in group["run_id"].dropna().unique())) if "run_id" in group else ()
        info = {c: group[c].iloc[0] for c in ("batch_size", "max_len") if c in group.columns}
        cells.append(Cell(dict(zip(cols, key)), steps, point, sums, counts, tokens, repeats, run_ids, info))
    return cells


def where(cells: list[Cell], **equal) -> list[Cell]:
    """Cells whose key matches every ``column=value`` (a list/tuple/set value means 'any of')."""
    def match(cell: Cell) -> bool:
        for col, want in equal.items():
            have = cell.key.get(col)
            if isinstance(want, (list, tuple, set, frozenset)):
                if have not in want:
                    return False
            elif have != want:
                return False
        return True

    return [c for c in cells if match(c)]


def run_ids(cells: list[Cell]) -> list[str]:
    """The runs whose rows make up ``cells``, sorted."""
    return sorted({r for c in cells for r in c.run_ids})


def backend_times(cells: list[Cell], confidence: float = CONFIDENCE) -> pd.DataFrame:
    """Per cell and backend: cell time (mean of step medians) with its interval.

    Columns: the cell key, backend, time, lo, hi, n_steps, n_repeats, tokens_per_step.
    """
    out = []
    q = _quantiles(confidence)
    for cell in cells:
        for b in cell.backends:
            t, reps = cell.time(b)
            mask = cell.common(b)
            out.append({**cell.key, "backend": b, "time": t,
                        "lo": float(np.nanquantile(reps, q[0])) if np.isfinite(reps).any() else np.nan,
                        "hi": float(np.nanquantile(reps, q[1])) if np.isfinite(reps).any() else np.nan,
                        "n_steps": int(mask.sum()), "n_repeats": cell.repeats[b],
                        "tokens_per_step": float(np.nanmean(cell.tokens[mask])) if np.isfinite(cell.tokens[mask]).any() else np.nan})
    return pd.DataFrame(out)


def _quantiles(confidence: float) -> tuple[float, float]:
    require(0 < confidence < 1, f"confidence must be in (0, 1), got {confidence}")
    return (1 - confidence) / 2, 1 - (1 - confidence) / 2


def ratio(cell: Cell, backend: str, reference: str) -> dict | None:
    """Speedup of ``backend`` over ``reference`` in one cell (None if either is absent).

    Returns dict(ratio, boot float64 [n_boot], ref_backend, n_steps); steps are those both have.
    """
    ref = cell.resolve(reference)
    if ref is None or backend not in cell.point:
        return None
    mask = cell.common(backend, ref)
    if not mask.any():
        return None
    t_ref, b_ref = cell.time(ref, mask)
    t_b, b_b = cell.time(backend, mask)
    with np.errstate(invalid="ignore", divide="ignore"):
        return {"ratio": t_ref / t_b, "boot": b_ref / b_b, "ref_backend": ref, "n_steps": int(mask.sum())}


def ratios(cells: list[Cell], reference: str = "flashinfer-best", backends=None,
           confidence: float = CONFIDENCE) -> pd.DataFrame:
    """Speedup of every backend (or ``backends``) over ``reference`` in every cell.

    Columns: the cell key, backend, reference, ref_backend, ratio, lo, hi, n_steps, boot
    (object: float64 [n_boot] replicates, for :func:`geomean`). A cell without the reference
    contributes no rows.
    """
    _quantiles(confidence)  # a bad confidence fails here, with rows or without
    out = []
    for cell in cells:
        for b in (cell.backends if backends is None else [x for x in backends if x in cell.point]):
            r = ratio(cell, b, reference)
            if r is None:
                continue
            boot = r["boot"]
            lo, hi = interval(boot, confidence)
            out.append({**cell.key, "backend": b, "reference": reference, "ref_backend": r["ref_backend"],
                        "ratio": r["ratio"], "lo": lo, "hi": hi, "n_steps": r["n_steps"], "boot": boot})
    if not out:
        return pd.DataFrame(columns=CELL + ["backend", "reference", "ref_backend", "ratio", "lo", "hi",
                                            "n_steps", "boot"])
    return pd.DataFrame(out)


def geomean(rows: pd.DataFrame, by: list[str] | None = None, n_boot: int | None = None,
            seed: int = BOOT_SEED, confidence: float = CONFIDENCE) -> pd.DataFrame:
    """Geometric mean of ``ratio`` across rows (per ``by`` group) with a hierarchical bootstrap.

    ``rows`` comes from :func:`ratios` (needs ``ratio`` and ``boot``). Columns: ``by``, ratio, lo,
    hi, n_rows, boot.
    """
    by = list(by or [])
    _quantiles(confidence)  # a bad confidence fails here, with rows or without
    if rows.empty:
        return pd.DataFrame(columns=by + ["ratio", "lo", "hi", "n_rows", "boot"])
    require("boot" in rows.columns and "ratio" in rows.columns, "geomean needs rows from ratios()")
    groups = rows.groupby(by, dropna=False, sort=True) if by else [((), rows)]
    out = []
    for key, group in groups:
        key = key if isinstance(key, tuple) else (key,)
        points = group["ratio"].to_numpy(float)
        boots = np.stack([np.asarray(b, float) for b in group["boot"]])      # [k, n_boot]
        k, nb = boots.shape
        nb = nb if n_boot is None else min(nb, n_boot)
        rng = np.random.default_rng([seed, _key_seed(key), k])
        pick = rng.integers(0, k, size=(nb, k))
        with np.errstate(invalid="ignore", divide="ignore"):
            logs = np.log(boots[pick, np.arange(nb)[:, None]])           # [nb, k]
            rep = np.exp(logs.mean(axis=1))
            point = float(np.exp(np.log(points).mean()))
        lo, hi = interval(rep, confidence)
        out.append({**dict(zip(by, key)), "ratio": point, "lo": lo, "hi": hi, "n_rows": int(k), "boot": rep})
    return pd.DataFrame(out)


def ceiling_fraction(raw: pd.DataFrame, n_boot: int = N_BOOT, seed: int = BOOT_SEED,
                     confidence: float = CONFIDENCE) -> pd.DataFrame:
    """Median fraction of the read ceiling per (cell, backend, kv_bytes), with a bootstrap interval
    of the median over that group's rows (steps x repeats).

    Uses ``frac_of_ceiling``; where it is missing, (kv_bytes / per_layer_us) / read_ceiling_gbps
    (bytes per microsecond / 1e3 = GB/s). Columns: the cell key, backend, kv_bytes, frac, lo, hi, n.
    """
    rows = ok_rows(raw, "per_layer_us" if "per_layer_us" in raw.columns else "time_us")
    if rows.empty:
        return pd.DataFrame(columns=CELL + ["backend", "kv_bytes", "frac", "lo", "hi", "n"])
    require("kv_bytes" in rows.columns, "timing rows lack column kv_bytes")
    rows = rows.copy()
    frac = pd.to_numeric(rows.get("frac_of_ceiling"), errors="coerce") if "frac_of_ceiling" in rows else None
    if frac is None:
        frac = pd.Series(np.nan, index=rows.index)
    if "read_ceiling_gbps" in rows.columns and "per_layer_us" in rows.columns:
        computed = rows["kv_bytes"] / rows["per_layer_us"] / 1e3 / rows["read_ceiling_gbps"]
        frac = frac.fillna(computed)
    rows["_frac"] = frac
    rows = rows[np.isfinite(rows["_frac"])]
    q = _quantiles(confidence)
    cols = _cell_columns(rows) + ["backend", "kv_bytes"]
    out = []
    for key, group in rows.groupby(cols, dropna=False, sort=True):
        key = key if isinstance(key, tuple) else (key,)
        v = group["_frac"].to_numpy(float)
        rng = np.random.default_rng([seed, _key_seed(key)])
        meds = np.median(v[rng.integers(0, v.size, size=(n_boot, v.size))], axis=1)
        out.append({**dict(zip(cols, key)), "frac": float(np.median(v)),
                    "lo": float(np.quantile(meds, q[0])), "hi": float(np.quantile(meds, q[1])), "n": int(v.size)})
    return pd.DataFrame(out)


def corrected_interval(value: float, boot: np.ndarray, tests: int,
                       confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Bonferroni interval of a ratio for one of ``tests`` comparisons judged together.

    Each interval has coverage 1 - (1 - confidence) / tests, so all of them hold at once with
    probability at least ``confidence``. Percentiles of the bootstrap cannot reach that far out
    (over 1000 comparisons, each tail is 0.025 / 1000: beyond the extremes of 1000 replicates),
    so the interval is the normal one on the log scale, log(value) +- z * sd(log replicates),
    with z the normal quantile of that coverage (4.06 for 1000 comparisons at 95 %).

    Parameters
    ----------
    value : float
        The ratio's point estimate (> 0).
    boot : numpy.ndarray
        float64 [n_boot], its bootstrap replicates (non-finite ones are ignored).
    tests : int
        How many comparisons the family-wise ``confidence`` covers (>= 1).

    Returns
    -------
    (lo, hi) : tuple of float
        NaN for both when fewer than two finite replicates remain.
    """
    require(isinstance(tests, int) and tests >= 1, f"tests must be a positive integer, got {tests!r}")
    boot = np.asarray(boot, float)
    logs = np.log(boot[np.isfinite(boot) & (boot > 0)])
    if logs.size < 2 or not (math.isfinite(value) and value > 0):
        return math.nan, math.nan
    z = NormalDist().inv_cdf(1 - (1 - confidence) / (2 * tests))
    half = z * float(logs.std(ddof=1))
    return math.exp(math.log(value) - half), math.exp(math.log(value) + half)


@dataclass(frozen=True)
class PassSpread:
    """What :func:`pass_intervals` pooled: the standard deviation of one pass around its cell's
    mean (log scale), its degrees of freedom, the cells judged together and the quantile used."""

    sd: float
    df: int
    cells: int
    q: float


def pass_intervals(logs: dict, confidence: float = CONFIDENCE) -> tuple[dict, PassSpread | None]:
    """Per cell, the mean of a log-scale figure over independent passes and its interval, from the
    pass-to-pass spread pooled over the cells, the intervals of all cells holding together.

    Every cell with at least two finite passes counts. s^2 is the sum over cells and passes of
    (x - the cell's mean)^2 over the sum of (passes - 1); a cell's interval is
    mean +- q s / sqrt(passes), with q Student's t at 1 - (1 - confidence) / (2 C) on those degrees
    of freedom, for C cells (Bonferroni: the C intervals hold at once with probability at least
    ``confidence``, as :func:`corrected_interval`'s).

    Parameters
    ----------
    logs : dict
        key -> float [passes], one cell's figure in each pass (log scale; non-finite ones dropped).
    confidence : float
        The family-wise coverage of the C intervals.

    Returns
    -------
    (intervals, spread) : tuple
        key -> (mean, lo, hi) for the cells with two or more passes, and the PassSpread (None, and
        no intervals, without any such cell).
    """
    from scipy import stats  # only where passes are judged; the GPU host's commands never need it

    kept = {k: np.asarray(v, float)[np.isfinite(np.asarray(v, float))] for k, v in logs.items()}
    kept = {k: v for k, v in kept.items() if v.size >= 2}
    if not kept:
        return {}, None
    df = sum(v.size - 1 for v in kept.values())
    sd = math.sqrt(sum(float(((v - v.mean()) ** 2).sum()) for v in kept.values()) / df)
    q = float(stats.t.ppf(1 - (1 - confidence) / (2 * len(kept)), df))
    out = {k: (float(v.mean()), float(v.mean() - q * sd / math.sqrt(v.size)), float(v.mean() + q * sd / math.sqrt(v.size)))
           for k, v in kept.items()}
    return out, PassSpread(sd=sd, df=df, cells=len(kept), q=q)


def fmt_ratio(value: float | None, lo: float | None = None, hi: float | None = None, digits: int = 3) -> str:
    """``1.234× [1.200, 1.270]`` (plain text), ``n/m`` for a missing or non-finite value."""
    if value is None or not math.isfinite(value):
        return "n/m"
    text = f"{value:.{digits}f}×"
    if lo is not None and hi is not None and math.isfinite(lo) and math.isfinite(hi):
        text += f" [{lo:.{digits}f}, {hi:.{digits}f}]"
    return text


def pinning(rows: pd.DataFrame) -> dict:
    """Where the timing thread ran for ``rows`` (a frame of raw timing rows; measure.host_cpu pins
    it): ``recorded`` rows that have a host_cpu (runs made before the column have none), of them
    ``pinned`` (host_cpu >= 0), ``unrecorded`` the others, ``cpus`` the distinct CPUs pinned to, and
    ``probe_us`` the probe's [min, max] on them (None without probe times). Shared by the run log,
    the engine's targets and the report."""
    cpu = pd.to_numeric(rows["host_cpu"], errors="coerce") if "host_cpu" in rows else \
        pd.Series(math.nan, index=rows.index, dtype=float)
    pinned = rows[cpu >= 0]
    probe = pd.to_numeric(pinned["host_probe_us"], errors="coerce").dropna() if "host_probe_us" in pinned else \
        pd.Series(dtype=float)
    recorded = int(cpu.notna().sum())
    return {"recorded": recorded, "pinned": int(len(pinned)), "unrecorded": int(len(rows)) - recorded,
            "cpus": int(pinned["host_cpu"].nunique()) if len(pinned) else 0,
            "probe_us": [float(probe.min()), float(probe.max())] if not probe.empty else None}


def check_frame(frame: pd.DataFrame, columns: list[str], what: str) -> None:
    """Raise PKVError naming the first missing column of ``frame``."""
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise PKVError(f"{what} lacks column(s) {', '.join(missing)}")


def paired_medians(values: np.ndarray, key, n_boot: int = N_BOOT, seed: int = BOOT_SEED) -> tuple[np.ndarray, np.ndarray]:
    """Medians of series measured in the same rounds, and their paired bootstrap replicates.

    Each replicate draws the rounds (columns) with replacement once and takes every series'
    median over the same draw, so a ratio or any other function of the series computed replicate
    by replicate keeps the pairing of the rounds (interleaved rounds share the machine's state).
    Rounds where any series lacks a finite value are dropped first. The generator is seeded from
    ``seed`` and ``key`` (as :func:`bootstrap_cells` seeds a cell's), so the same rows give the same
    interval whatever else is judged.

    Parameters
    ----------
    values : numpy.ndarray
        float64 [n_series, n_rounds]; column j of every series is round j.
    key : tuple
        What the series are (a cell's key): seeds the generator.

    Returns
    -------
    (point, boot) : tuple of numpy.ndarray
        float64 [n_series], the medians over the complete rounds, and float64 [n_boot, n_series],
        their replicates; both NaN where no round is complete.
    """
    require(isinstance(n_boot, int) and n_boot >= 10, f"n_boot must be an integer >= 10, got {n_boot!r}")
    values = np.asarray(values, float)
    require(values.ndim == 2, f"paired_medians wants [n_series, n_rounds], got shape {values.shape}")
    values = values[:, np.isfinite(values).all(axis=0)]
    n_series, n_rounds = values.shape
    if n_rounds == 0:
        return np.full(n_series, np.nan), np.full((n_boot, n_series), np.nan)
    rng = np.random.default_rng([seed, _key_seed(tuple(key))])
    draw = rng.integers(0, n_rounds, size=(n_boot, n_rounds))             # [n_boot, n_rounds]
    boot = np.median(values[:, draw], axis=2).T                           # [n_boot, n_series]
    return np.median(values, axis=1), boot


def interval(boot: np.ndarray, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The percentile interval of bootstrap replicates (non-finite ones ignored); NaN, NaN without any."""
    boot = np.asarray(boot, float)
    boot = boot[np.isfinite(boot)]
    if not boot.size:
        return math.nan, math.nan
    q = _quantiles(confidence)
    return float(np.quantile(boot, q[0])), float(np.quantile(boot, q[1]))
