"""The raw timing rows of docs/DATA.md (results/{hw}/raw/{experiment}.parquet, bench_kernels) and
the GPU validation rows (validation_gpu.parquet): column order, dtypes, and row builders.

Every frame the harness writes goes through :func:`raw_frame` / :func:`validation_frame`, so the
columns and their dtypes are fixed in one place. Ceiling rows use backend ``read-ceiling`` /
``copy-ceiling``, protocol ``ceiling`` and kv_bytes = bytes moved.
"""

from __future__ import annotations

import math

from ..ceiling import THREADS, ceiling_gbps
from ..errors import PKVError, require
from ..io import round_columns
from ..names import FLOOR_BACKEND
from .statistics import frac_of_ceiling

#: column -> pandas dtype, in the order of docs/DATA.md.
RAW_COLUMNS: dict[str, str] = {
    "run_id": "string",
    "experiment": "string",
    "trace": "string",
    "seed": "int64",
    "step": "int64",
    "batch_size": "int64",
    "max_len": "int64",
    "total_tokens": "int64",
    "kv_bytes": "int64",
    "num_qo_heads": "int64",
    "num_kv_heads": "int64",
    "head_dim": "int64",
    "page_size": "int64",
    "dtype": "string",
    "kv_dtype": "string",
    "hole_fraction": "float64",
    "backend": "string",
    "route": "string",
    "num_splits": "int64",
    "protocol": "string",
    "repeat": "int64",
    "time_us": "float64",
    "wall_us": "float64",
    "host_us": "float64",
    "host_loop_us": "float64",
    "host_loop_max_us": "float64",
    "host_cpu": "int64",
    "host_probe_us": "float64",
    "separator_us": "float64",
    "layers": "int64",
    "per_layer_us": "float64",
    "read_ceiling_gbps": "float64",
    "frac_of_ceiling": "float64",
    "launches": "float64",
    "decode_ctas": "float64",
    "merge_state_bytes": "float64",
    "status": "string",
    "reason": "string",
}

VALIDATION_COLUMNS: dict[str, str] = {
    "trace": "string",
    "seed": "int64",
    "step": "int64",
    "backend": "string",
    "dtype": "string",
    "kv_dtype": "string",
    "fp8_query": "bool",
    "rel_err": "float64",
    "max_row_head_err": "float64",
    "worst_row": "int64",
    "worst_head": "int64",
    "row_heads_failing": "int64",
    "max_abs_err": "float64",
    "rtol": "float64",
    "passed": "bool",
    "nan_count": "int64",
    "unwritten": "int64",
    "status": "string",
    "reason": "string",
}

STATUSES = ("ok", "unavailable", "failed")
#: The relative errors of a validation row (GPU and CPU), published as io.PRECISION["error"] says.
ERROR_COLUMNS = ("rel_err", "max_row_head_err", "max_abs_err")

_NAN_DEFAULTS = ("time_us", "wall_us", "host_us", "host_loop_us", "host_loop_max_us", "host_probe_us", "separator_us",
                 "per_layer_us", "read_ceiling_gbps", "frac_of_ceiling", "launches", "decode_ctas", "merge_state_bytes")


def one_line(text: object) -> str:
    """An exception or message as one line (the first non-empty line, trimmed to 300 chars)."""
    if isinstance(text, BaseException):
        body = str(text).strip()
        first = next((line.strip() for line in body.splitlines() if line.strip()), "")
        text = f"{type(text).__name__}: {first}" if first else type(text).__name__
    line = " ".join(str(text).split())
    return line if len(line) <= 300 else line[:297] + "..."


def availability(factory, variant, spec, host_only_reason: str) -> tuple[object | None, list[str]]:
    """(backend, reasons): the variant's backend and why it cannot run ``spec`` here ([] when it
    can). Host-only backends (``capabilities.host_arrays``: run() takes NumPy arrays) get
    ``host_only_reason``; a backend whose creation or check raises gets that exception as its
    reason, never a crash."""
    try:
        backend = factory.get(variant)
        if backend.capabilities.host_arrays:
            return None, [host_only_reason]
        return backend, [one_line(r) for r in backend.unavailable(spec)]
    except Exception as exc:
        return None, [one_line(exc)]


def raw_row(**fields) -> dict:
    """A raw row with every column present: unknown names are an error, missing times are NaN."""
    unknown = sorted(set(fields) - set(RAW_COLUMNS))
    require(not unknown, f"unknown raw-row column(s): {', '.join(unknown)}")
    row = {name: (math.nan if name in _NAN_DEFAULTS else None) for name in RAW_COLUMNS}
    row.update(layers=1, num_splits=-1, repeat=-1, host_cpu=-1, reason="", status="ok")
    row.update(fields)
    if row["kv_dtype"] is None:  # K and V in the query's dtype (AttentionSpec.cache_dtype)
        row["kv_dtype"] = row["dtype"]
    require(row["status"] in STATUSES, f"status must be one of {STATUSES}, got {row['status']!r}")
    require(row["status"] == "ok" or row["reason"], "a row that is not ok needs a reason")
    return row


def case_fields(case) -> dict:
    """The workload and spec columns of a case (persistentkv.measure.workload.Case)."""
    b, s = case.batch, case.batch.spec
    return dict(experiment=case.experiment, trace=case.trace, seed=int(case.seed), step=int(case.step),
                batch_size=b.batch_size, max_len=b.max_len, total_tokens=b.total_tokens, kv_bytes=b.kv_bytes,
                num_qo_heads=s.num_qo_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                page_size=s.page_size, dtype=s.dtype, kv_dtype=s.cache_dtype, hole_fraction=float(case.hole_fraction))


def ceiling_rows(samples: list, failures: dict[str, str], run_id: str, experiment: str,
                 read_gbps: float | None = None) -> list[dict]:
    """Raw rows for the ceilings (``samples``: ceiling.CeilingSample): one per repeat, or one
    ``failed`` row per ceiling of ``failures`` ({backend: reason}). ``read_gbps``: the run's read
    ceiling (default ceiling.ceiling_gbps of ``samples``)."""
    read = ceiling_gbps(samples) if read_gbps is None else float(read_gbps)
    common = dict(run_id=run_id, experiment=experiment, seed=0, step=0, batch_size=0, max_len=0, total_tokens=0,
                  num_qo_heads=0, num_kv_heads=0, head_dim=0, page_size=0, dtype="", hole_fraction=0.0,
                  protocol="ceiling", layers=1, read_ceiling_gbps=read)
    rows = []
    for s in samples:
        rows.append(raw_row(**common, trace=s.backend, kv_bytes=s.bytes_moved, backend=s.backend, route=s.backend,
                            repeat=s.repeat, time_us=s.time_us, per_layer_us=s.time_us,
                            frac_of_ceiling=(s.gbps / read) if read > 0 else math.nan))
    for backend, reason in failures.items():
        rows.append(raw_row(**common, trace=backend, kv_bytes=0, backend=backend, route=backend,
                            status="failed", reason=reason))
    return rows


def floor_rows(result, base: dict, read_gbps: float) -> list[dict]:
    """The one-kernel floor of a case as raw rows (``result``: ceiling.FloorResult; ``base``: the
    case's fields, run_id and read ceiling): backend FLOOR_BACKEND, protocol ``kernel``, one row per
    recorded round of the best grid, ``route`` naming that grid (``read-1056x256``: blocks x
    threads), ``reason`` every grid's median; kv_bytes stays the case's (``base``)."""
    grid = result.grid
    route = f"read-{grid}x{THREADS}"
    rows = []
    separators = result.separator_samples.get(grid, [])
    for repeat, us in enumerate(result.samples[grid]):
        rows.append(raw_row(**base, backend=FLOOR_BACKEND, route=route, protocol="kernel", repeat=repeat,
                            time_us=us, per_layer_us=us, layers=1, reason=result.summary(),
                            separator_us=separators[repeat] if repeat < len(separators) else math.nan,
                            frac_of_ceiling=frac_of_ceiling(base["kv_bytes"], us, read_gbps)))
    return rows


def raw_frame(rows):
    """DataFrame with exactly RAW_COLUMNS, in order, with their dtypes."""
    return _frame(rows, RAW_COLUMNS)


def validation_frame(rows):
    """DataFrame with exactly VALIDATION_COLUMNS, its errors at their published precision."""
    return round_columns(_frame(rows, VALIDATION_COLUMNS), ERROR_COLUMNS, "error")


def _frame(rows, columns: dict[str, str]):
    import pandas as pd

    rows = list(rows)
    for row in rows:
        unknown = sorted(set(row) - set(columns))
        require(not unknown, f"unknown column(s): {', '.join(unknown)}")
    frame = pd.DataFrame(rows, columns=list(columns))
    for name, dtype in columns.items():
        if dtype in ("int64", "bool") and frame[name].isna().any():
            raise PKVError(f"column {name} has missing values in {int(frame[name].isna().sum())} row(s)")
        frame[name] = frame[name].astype(dtype)
    return frame
