"""One GPU call that shows what works: every backend once, right or wrong, and how fast.

``persistentkv validate-gpu --smoke [--config ...] [--policy ...]`` runs, for every registered
backend on three small synthetic cases (one row; ragged rows at page boundaries; scattered pages
with holes), the float64 check of persistentkv.measure.validation and a short kernel + eager timing
through the real harness, then the read and copy ceilings on 1 GiB. It prints one compact table and
exits non-zero if any backend that is available fails.
"""

from __future__ import annotations

import math

import numpy as np

from ..cache import compact_batch, make_batch
from ..spec import AttentionSpec
from .harness import BackendFactory, RunContext, Settings, run_case
from .rows import ceiling_rows
from .validation import failing, validate_case
from .workload import Case, Variant

#: (name, lengths, hole fraction): lengths at and around page/tile boundaries, one long row.
SMOKE_CASES = (
    ("B1xN1000", [1000], 0.0),
    ("B4-edges", [1, 15, 17, 4097], 0.0),
    ("B8-holes", [12000, 700, 1500, 33, 9000, 2048, 16, 513], 0.5),
)


def smoke_cases(spec: AttentionSpec, variants: tuple[Variant, ...]) -> list[Case]:
    cases = []
    for name, lengths, rho in SMOKE_CASES:
        batch, _ = compact_batch(make_batch(spec, lengths, rho, seed=7), rho, 7)
        cases.append(Case("smoke", name, 0, 0, batch, rho, variants))
    return cases


def run_smoke(spec: AttentionSpec, variants: tuple[Variant, ...], device, run_id: str, rtols: dict,
              log=print, timing: bool = True, ceilings: bool = True) -> tuple[list[dict], list[dict]]:
    """(validation rows, timing rows) for every variant on the smoke cases; prints the table."""
    factory = BackendFactory()
    vrows: list[dict] = []
    trows: list[dict] = []
    cases = smoke_cases(spec, variants)
    for case in cases:
        vrows += validate_case(case, device, factory, dtypes=("float16", "bfloat16"), rtols=rtols, log=log)
    if ceilings:
        from ..ceiling import measure_ceilings

        samples, failures = measure_ceilings(device, repeats=3, warmup=1, read_bytes=2**30, copy_bytes=2**29,
                                             stream_bytes=2**32, log=log)
        trows += ceiling_rows(samples, failures, run_id, "smoke")
    if timing:
        settings = Settings(repeats=3, warmup=1, calls_per_graph=10, protocols=("kernel", "eager"))
        ctx = RunContext(run_id, log=log)
        for index, case in enumerate(cases):
            trows += run_case(case, device, factory, settings, ctx, case_index=index)
    log(format_table(vrows, trows))
    return vrows, trows


def _median(values) -> float:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.median(values)) if values else math.nan


def format_table(vrows: list[dict], trows: list[dict]) -> str:
    """backend | case | fp16 err | bf16 err (the worst (row, head) error) | kernel us | eager us | status."""
    lines = [f"{'backend':<15} {'case':<9} {'fp16 err':>9} {'bf16 err':>9} {'kernel us':>10} {'eager us':>9}  status"]
    keys, unavailable = [], {}
    for r in vrows:
        if r["status"] == "unavailable":
            unavailable.setdefault(r["backend"], r["reason"])
        elif (r["backend"], r["trace"]) not in keys:
            keys.append((r["backend"], r["trace"]))
    for backend, trace in keys:
        mine = [r for r in vrows if r["backend"] == backend and r["trace"] == trace]
        err = {r["dtype"]: r["max_row_head_err"] for r in mine}
        bad = [r for r in mine if r["status"] != "ok" or not r["passed"]]
        status = "ok" if not bad else f"{bad[0]['status']}: {bad[0]['reason']}"[:110]
        times = {p: _median([t["time_us"] for t in trows if t["backend"] == backend and t["trace"] == trace
                             and t["protocol"] == p and t["status"] == "ok"]) for p in ("kernel", "eager")}
        lines.append(f"{backend:<15} {trace:<9} {err.get('float16', math.nan):>9.2e} {err.get('bfloat16', math.nan):>9.2e} "
                     f"{times['kernel']:>10.1f} {times['eager']:>9.1f}  {status}")
    for backend, reason in unavailable.items():
        lines.append(f"{backend:<15} unavailable: {reason}"[:240])
    for t in trows:
        if t["status"] == "failed" and t["protocol"] in ("kernel", "eager"):
            lines.append(f"  {t['backend']} {t['trace']} {t['protocol']}: {t['status']}: {t['reason']}"[:160])
    for t in trows:
        if t["protocol"] == "ceiling" and t["status"] == "ok" and t["repeat"] == 0:
            lines.append(f"{t['backend']}: {t['read_ceiling_gbps'] if t['backend'] == 'read-ceiling' else t['kv_bytes'] / t['time_us'] / 1e3:.0f} GB/s")
        elif t["protocol"] == "ceiling" and t["status"] != "ok":
            lines.append(f"{t['backend']}: {t['status']}: {t['reason']}")
    bad = failing(vrows)
    lines.append(f"smoke: {len(bad)} failing row(s)" if bad else "smoke: every available backend passed")
    return "\n".join(lines)
