"""Small numeric helpers: per-call times, bandwidth, fraction of the read ceiling, medians.

The analysis proper (medians with intervals, ratios) is persistentkv.analysis; the harness
writes raw repeats. These helpers only turn one measurement into its row fields, and
summarise kernel rows for the table ``bench-kernels`` prints.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import require
from ..names import BASELINES, FLOOR_BACKEND, PKV_BACKENDS


def per_call_us(elapsed_ms: float, calls: int) -> float:
    """Device time of one call when ``calls`` calls took ``elapsed_ms`` (CUDA-event time)."""
    require(calls >= 1, f"calls must be >= 1, got {calls}")
    return float(elapsed_ms) * 1e3 / calls


def gbps(num_bytes: float, time_us: float) -> float:
    """GB/s (1e9 bytes per second) for ``num_bytes`` in ``time_us`` microseconds; NaN if unknown."""
    if not (time_us > 0) or not math.isfinite(time_us):
        return math.nan
    return float(num_bytes) / (float(time_us) * 1e-6) / 1e9


def frac_of_ceiling(kv_bytes: float, per_layer_us: float, ceiling_gbps: float) -> float:
    """Achieved K/V read bandwidth of one layer as a fraction of the measured read ceiling.

    Worked number: B=1 x 32K tokens reads 134 MB; in 42.9 us that is 3.13 TB/s, 0.69 of 4.52 TB/s.
    """
    if not (ceiling_gbps > 0) or not math.isfinite(ceiling_gbps):
        return math.nan
    return gbps(kv_bytes, per_layer_us) / float(ceiling_gbps)


def median(values) -> float:
    """Median of the finite values; NaN when there are none."""
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
    arr = arr[np.isfinite(arr)]
    return float(np.median(arr)) if arr.size else math.nan


def kernel_table(rows, index=("trace",)):
    """Median kernel time (us) per case and backend, and ours vs the best baseline.

    ``rows`` is a raw-row DataFrame; ``index`` the columns that name a case (the shapes experiment
    adds the heads). Returns a DataFrame indexed by case with one column per backend plus
    ``best_baseline``, ``best_pkv`` and ``speedup`` = best_baseline / best_pkv (> 1: our best route
    beats the fastest baseline on that case), and where the run timed the one-kernel floor,
    ``frac_of_floor`` = the floor's median over best_pkv (1: as fast as a plain read of the step's
    bytes in one kernel). Missing cells are NaN.
    """
    import pandas as pd

    ok = rows[(rows["protocol"] == "kernel") & (rows["status"] == "ok")]
    if ok.empty:
        return pd.DataFrame()
    table = ok.pivot_table(index=list(index), columns="backend", values="time_us", aggfunc="median", sort=False)
    base = [b for b in BASELINES if b in table.columns]
    ours = [b for b in PKV_BACKENDS if b in table.columns]
    table["best_baseline"] = table[base].min(axis=1) if base else math.nan
    table["best_pkv"] = table[ours].min(axis=1) if ours else math.nan
    table["speedup"] = table["best_baseline"] / table["best_pkv"]
    if FLOOR_BACKEND in table.columns:
        table["frac_of_floor"] = table[FLOOR_BACKEND] / table["best_pkv"]
    return table
