"""The FP8 KV cache's targets, judged from the kernel grids on e4m3 caches: the ``fp8`` entry of claims.json.

bench_kernels_fp8.parquet and bench_shapes_fp8.parquet (rules bench_kernels_fp8, bench_shapes_fp8:
the two kernel grids with ``--kv-dtype float8_e4m3``) are judged on their kernel rows (CUDA-graph
replay, cold L2), per cell the mean of the steps' medians with the 95 % bootstrap interval of
persistentkv.analysis, as the engine's and the floor's targets are. Every rule and constant below
was fixed before any FP8 grid was measured; a check without rows is "not measured", never guessed.

Worked numbers (Hkv=8, D=128): a token is 4 KiB of fp16 K/V and 2 KiB of e4m3 codes, so B=1 x 128K
reads 537 MB in fp16 and 268 MB in FP8, and a read-bound kernel should take about half the time
(FP8_OVER_FP16 asks 1.8x where the fp16 step reads at least 537 MB).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from . import analysis
from .names import BASELINES, FLOOR_BACKEND, FP8_KV, SHAPES_EXPERIMENT, kv_grid_name
from .results import Results
from .targets import (E2E_CELL, E2E_STEP_MIN_RATIO, ENGINE_BACKEND, FAILS, HOLDS, NOT_MEASURED, MiB, _case,
                      _kernel_cells, _verdict, e2e_verdicts, floor_band)

#: The composite reference: per cell the fastest of BASELINES (FlashInfer CUDA-core and tensor-core,
#: vLLM FA3, TensorRT-LLM XQA) that ran on the FP8 cache (ok kernel rows, whether or not validate-gpu
#: covered it; FA3 and XQA quantise the query too and are compared all the same).
FP8_REFERENCE = "baseline-best"
#: In every cell of both FP8 grids the fastest baseline's time over ours: its whole 95 % interval
#: at least this (the interval's lower end, not only the point).
FP8_MIN_SPEEDUP = 1.0
#: The FP8 grids' rows are resampled with this seed, not analysis.BOOT_SEED: the fp16 twin of a cell
#: has the same cell key (kv_dtype is not in analysis.CELL), and the two runs are independent, so
#: their replicates must not reuse one stream of draws.
FP8_BOOT_SEED = analysis.BOOT_SEED + 1


@dataclass(frozen=True)
class SpeedupTarget:
    """A named cell's speedup over the fastest FP8 baseline (point estimate at least ``target``)."""

    label: str
    grid: str                       # names.KV_GRIDS: the FP8 file it is read from
    trace: str
    target: float
    heads: tuple[int, int] | None   # (Hkv, G) in bench_shapes; None: bench_kernels' one shape
    note: str = ""


FP8_SPEEDUPS = (
    SpeedupTarget("B=1 x 128K", "bench_kernels", "B1xN131072", 1.35, None),
    SpeedupTarget("B=8 bimodal", "bench_kernels", "B8-bimodal", 1.35, None),
    SpeedupTarget("B=64 x 8K", "bench_kernels", "B64xN8192", 1.15, None),
    SpeedupTarget("Hq=4/Hkv=1 B=1 x 32K", SHAPES_EXPERIMENT, "B1xN32768", 1.5, (1, 4),
                  "bench_shapes_fp8's cell of one row of 32768 tokens at Hkv=1, G=4 (the fp16 grid's 16 MiB "
                  "cell, 8 MiB of e4m3 codes): the grid holds that 32K cell exactly"),
)
#: Ours as a fraction of the FP8 one-kernel floor (the floor's time over ours; the floor reads the
#: case's e4m3 bytes): at least ``target`` for steps of [lo, hi) FP8 bytes (hi None: no end).
FP8_FLOOR_BANDS = ((64 * MiB, 256 * MiB, 0.80),   # from 67 MB
                   (256 * MiB, None, 0.90))        # from 268 MB
#: Our fp16 time (the committed bench_kernels.parquet, the same case) over our FP8 time: at least
#: FP8_OVER_FP16 where the fp16 step reads at least FP8_OVER_FP16_BYTES (537 MB).
FP8_OVER_FP16 = 1.8
FP8_OVER_FP16_BYTES = 512 * MiB
#: What measures the FP8 grids (the report and the paper name it when they are absent).
FP8_COMMAND = "snakemake bench_kernels_fp8 --cores all"
#: The full decode step over an FP8 cache (results.e2e_fp8, measure-e2e --kv-dtype float8_e4m3): in
#: every cell our step at least this fraction of the fastest FP8 baseline's speed (targets.e2e_verdicts'
#: step rule, the same minimum as on fp16 caches).
FP8_E2E_MIN_RATIO = E2E_STEP_MIN_RATIO
#: What measures the rest of the FP8 evidence: validate-gpu, the full step, the logits.
FP8_RUNS_COMMAND = "snakemake validate_gpu_fp8 measure_e2e_fp8 fp8_logits --cores all"
#: The FP8 policy (results/<hw>/policy_fp8.json, `persistentkv calibrate` on the calibration rows of an
#: FP8 cache) judged as the fp16 policy is (claims.adaptive_verdicts on the FP8 holdout rows: the
#: published traces at the holdout seeds and the long-context rows, step rows): the adaptive backend
#: at least FP8_POLICY_MIN_RATIO of each cell's best single backend and a geometric mean at least
#: FP8_POLICY_GEOMEAN over the faster FlashInfer (claims.ADAPTIVE_MIN_RATIO and ADAPTIVE_GEOMEAN;
#: tests/test_fp8_pipeline.py holds them equal).
FP8_POLICY_MIN_RATIO = 0.98
FP8_POLICY_GEOMEAN = 1.15
FP8_POLICY_PROTOCOL = "step"
#: What measures the FP8 policy's rows and fits it.
FP8_POLICY_COMMAND = "snakemake measure_fp8_published measure_fp8_long_context --cores all"


def fp8_rules() -> list[str]:
    """The rules, in words, from the constants (claims.json, the report and the paper quote them)."""
    named = "; ".join(f"{t.target:g}x at {t.label}" for t in FP8_SPEEDUPS)
    bands = "; ".join(f"{target:g} from {lo / 1e6:.0f} MB" + (f" (under {hi / 1e6:.0f} MB)" if hi else "")
                      for lo, hi, target in FP8_FLOOR_BANDS)
    return [f"{ENGINE_BACKEND} against the fastest FP8 baseline ({', '.join(BASELINES)} on the {FP8_KV} cache): "
            f"the speedup's 95 % interval at least {FP8_MIN_SPEEDUP:g} in every cell of bench_kernels_fp8 and "
            f"bench_shapes_fp8",
            f"the speedup over the fastest FP8 baseline at least {named}",
            f"the FP8 one-kernel floor's time over ours at least {bands} of FP8 bytes",
            f"our fp16 time (bench_kernels.parquet, the same case) over our FP8 time at least {FP8_OVER_FP16:g} "
            f"where the fp16 step reads at least {FP8_OVER_FP16_BYTES / 1e6:.0f} MB",
            f"the full decode step over an FP8 cache (measure-e2e --kv-dtype {FP8_KV}): our step at least "
            f"{FP8_E2E_MIN_RATIO:g}x the fastest FP8 baseline's speed in every cell",
            f"validate-gpu --kv-dtype {FP8_KV}: every backend that ran within its dtype's tolerance per (row, head) "
            f"against float64 over the dequantised cache, except a backend that rounds the query to e4m3, whose "
            f"error is reported",
            f"the FP8 policy (fitted on calibration rows over an FP8 cache) on the FP8 holdout rows (published "
            f"traces at the holdout seeds, long-context rows; {FP8_POLICY_PROTOCOL} rows): the adaptive backend "
            f"at least {FP8_POLICY_MIN_RATIO:g}x of each cell's best single backend, and its geometric mean at "
            f"least {FP8_POLICY_GEOMEAN:g}x the faster FlashInfer"]


def fp8_verdicts(results: Results, adaptive: dict | None = None) -> dict:
    """ENGINE_BACKEND on an FP8 e4m3 cache (results.kv_grid(..., FP8_KV)) against the rules of this
    module; every entry has ``verdict`` (holds, does not hold, not measured):

    every_cell  per cell of both FP8 grids, the fastest FP8 baseline's time over ours (``ratio``,
                ``lo``, ``hi``, ``baseline``): holds when ``lo`` >= FP8_MIN_SPEEDUP;
    speedups    FP8_SPEEDUPS: per named cell the same ratio, holds when the point reaches its target
                (``interval_clears`` when ``lo`` does too); a named cell without rows is listed as not
                measured, and the check holds only when all are measured and hold;
    floor       per case of at least FP8_FLOOR_BANDS' first bytes, the FP8 floor's time over ours;
    fp16        per bench_kernels case whose fp16 twin reads at least FP8_OVER_FP16_BYTES, our fp16
                time over our FP8 time (the two runs resampled independently);
    policy      the FP8 policy on the FP8 holdout rows: ``adaptive``, claims.adaptive_verdicts of the
                FP8 rows (results.raw_fp8; None where there are none), judged by fp8_policy.

    ``verdict``: "not measured" when nothing over an FP8 cache is present, else "does not hold" when a check
    does not hold, "holds" when every check holds, "not measured" otherwise; ``summary`` says it with
    the hardware."""
    frames = {grid: results.kv_grid(grid, FP8_KV) for grid in ("bench_kernels", SHAPES_EXPERIMENT)}
    frames = {grid: f[f["kv_dtype"] == FP8_KV] if "kv_dtype" in f.columns else f.iloc[:0]
              for grid, f in frames.items()}
    sources = {kv_grid_name(grid, FP8_KV): _kernel_cells(f, FP8_BOOT_SEED) for grid, f in frames.items()}
    out = {"backend": ENGINE_BACKEND, "kv_dtype": FP8_KV, "reference": FP8_REFERENCE, "baselines": list(BASELINES),
           "files": {kv_grid_name(g, FP8_KV): not f.empty for g, f in frames.items()}, "command": FP8_COMMAND,
           "rules": fp8_rules()}
    out["measured"] = any(out["files"].values())
    speedups = _speedups(sources)
    out["every_cell"] = {"target": FP8_MIN_SPEEDUP, "verdict": _verdict(speedups), "cases": speedups,
                         "below": [e["case"] for e in speedups if not e["holds"]]}
    out["speedups"] = _named(speedups)
    out["floor"] = _floor(sources)
    out["fp16"] = _over_fp16(sources[kv_grid_name("bench_kernels", FP8_KV)], results.bench)
    out["e2e"] = fp8_e2e(results)
    out["validation"] = fp8_validation(results)
    out["logits"] = fp8_logits(results)
    out["policy"] = fp8_policy(adaptive, results.policy_fp8)
    out["runs_command"] = FP8_RUNS_COMMAND
    out["measured"] = out["measured"] or out["e2e"]["measured"] or bool(out["validation"]["backends"]) \
        or out["policy"]["measured"]
    checks = [out[k]["verdict"] for k in ("every_cell", "speedups", "floor", "fp16", "e2e", "validation", "policy")]
    out["verdict"] = (NOT_MEASURED if not out["measured"] else FAILS if FAILS in checks
                      else HOLDS if all(c == HOLDS for c in checks) else NOT_MEASURED)
    out["summary"] = f"{out['verdict']} on {results.hw}"
    out["run_ids"] = sorted({r for cells, _ in sources.values() for r in analysis.run_ids(cells)})
    out["sentences"] = _sentences(out, results.hw)
    return out


def fp8_policy(adaptive: dict | None, policy: dict | None) -> dict:
    """The FP8 policy's check from ``adaptive`` (claims.adaptive_verdicts over the FP8 rows) on its
    FP8_POLICY_PROTOCOL rows: holds when no cell is below FP8_POLICY_MIN_RATIO of its best single
    backend and the geometric mean reaches FP8_POLICY_GEOMEAN; not measured without holdout cells;
    ``fitted_on`` names the calibration run of ``policy`` (policy_fp8.json) where there is one."""
    entry = ((adaptive or {}).get("protocols") or {}).get(FP8_POLICY_PROTOCOL) or {}
    measured = bool(entry.get("cells"))
    out = {"measured": measured, "protocol": FP8_POLICY_PROTOCOL, "min_ratio": FP8_POLICY_MIN_RATIO,
           "geomean_target": FP8_POLICY_GEOMEAN, "fitted_on": (policy or {}).get("run_id"),
           "command": FP8_POLICY_COMMAND}
    if not measured:
        return {**out, "verdict": NOT_MEASURED}
    holds = bool(entry.get("holds_floor")) and bool(entry.get("holds_geomean"))
    return {**out, "verdict": HOLDS if holds else FAILS, "cells": entry["cells"], "min": entry.get("min"),
            "below": entry.get("below_floor", []), "geomean": entry.get("geomean"), "sentence": entry.get("sentence"),
            "run_ids": entry.get("run_ids", [])}


def fp8_e2e(results: Results) -> dict:
    """The full decode step over an FP8 cache: targets.e2e_verdicts' step rule on results.e2e_fp8
    (our step against the fastest FP8 baseline's per cell, over the passes), and per cell our fp16
    step (results.e2e, the same cell) over our FP8 step: the FP8 gain in a whole step (reported)."""
    if results.e2e_fp8.empty:
        return {"verdict": NOT_MEASURED, "measured": False, "target": FP8_E2E_MIN_RATIO, "cells": [], "gain": []}
    judged = e2e_verdicts(replace(results, e2e=results.e2e_fp8))
    step = judged.get("step") or {}
    verdict = NOT_MEASURED if not step else HOLDS if step["holds"] else FAILS
    fp16 = {tuple(c[k] for k in E2E_CELL): c for c in e2e_verdicts(results)["cells"]} if not results.e2e.empty else {}
    gain = []
    for cell in judged["cells"]:
        twin = fp16.get(tuple(cell[k] for k in E2E_CELL))
        if twin is not None:
            gain.append({"label": cell["label"], "fp16_step_us": twin["our_step_us"], "fp8_step_us": cell["our_step_us"],
                         "gain": twin["our_step_us"] / cell["our_step_us"],
                         "fp16_attention_us": twin["our_attention_us"], "fp8_attention_us": cell["our_attention_us"]})
    cells = [{k: c[k] for k in ("label", "baseline", "our_step_us", "best_step_us", "ratio", "lo", "hi", "holds",
                                "passes")} for c in judged["cells"]]
    return {"verdict": verdict, "measured": bool(judged["measured"]), "target": FP8_E2E_MIN_RATIO, "cells": cells,
            "below": step.get("below", []), "gain": gain, "not_run": judged["not_run"],
            "run_ids": judged["run_ids"]}


def fp8_validation(results: Results) -> dict:
    """validate-gpu over an FP8 cache (results.validation_gpu_fp8), per backend: its rows, how many
    passed, its worst (row, head) error and whether it rounds the query to e4m3 (``fp8_query``,
    reported, not gated); holds when every backend that ran without an FP8 query passed every row."""
    rows = results.validation_gpu_fp8
    backends = []
    if not rows.empty:
        ran = rows[rows["status"] == "ok"]
        for backend, part in ran.groupby("backend", sort=True):
            worst = part.loc[part["max_row_head_err"].idxmax()]
            backends.append({"backend": str(backend), "rows": int(len(part)), "passed": int(part["passed"].sum()),
                             "fp8_query": bool(part["fp8_query"].any()), "max_err": float(worst["max_row_head_err"]),
                             "worst": f"{worst['trace']} step {int(worst['step'])} {worst['dtype']}",
                             "rtol": float(worst["rtol"])})
        failed = rows[rows["status"] == "failed"]
        for backend, part in failed.groupby("backend", sort=True):
            backends.append({"backend": str(backend), "rows": int(len(part)), "passed": 0, "fp8_query": False,
                             "max_err": float("nan"), "worst": str(part["reason"].iloc[0]), "rtol": float("nan"),
                             "failed": True})
    gated = [b for b in backends if not b["fp8_query"]]
    verdict = (NOT_MEASURED if not gated else
               HOLDS if all(b["passed"] == b["rows"] and not b.get("failed") for b in gated) else FAILS)
    return {"verdict": verdict, "backends": backends,
            "unavailable": sorted(rows.loc[rows["status"] == "unavailable", "backend"].unique().tolist())
            if not rows.empty else []}


def fp8_logits(results: Results) -> dict:
    """fp8-logits' rows (results.fp8_logits) per model and scales: the largest and the median
    relative logit error and the top-1 agreement over the steps and rows. A measurement, no rule."""
    rows = results.fp8_logits
    out = []
    if not rows.empty:
        for (model, scales), part in rows.groupby(["model", "scales"], sort=True):
            out.append({"model": str(model), "scales": str(scales), "backend": str(part["backend"].iloc[0]),
                        "dtype": str(part["dtype"].iloc[0]), "steps": int(part["step"].nunique()),
                        "rows": int(part["row"].nunique()), "max_context": int(part["context"].max()),
                        "max_rel_err": float(part["rel_err"].max()), "median_rel_err": float(part["rel_err"].median()),
                        "top1": float(part["top1"].mean())})
    return {"measured": bool(out), "cases": out}


def _source_cells(sources: dict):
    """(file stem, cell, kv_bytes) of every FP8 cell that has ENGINE_BACKEND."""
    for stem, (cells, sizes) in sources.items():
        for cell in cells:
            if ENGINE_BACKEND in cell.point:
                yield stem, cell, sizes[id(cell)]


def _speedups(sources: dict) -> list[dict]:
    entries = []
    for stem, cell, nbytes in _source_cells(sources):
        r = analysis.ratio(cell, ENGINE_BACKEND, FP8_REFERENCE)
        if r is None:
            continue
        lo, hi = analysis.interval(r["boot"])
        at_floor = analysis.ratio(cell, FLOOR_BACKEND, FP8_REFERENCE)
        entries.append({**_case(stem, cell, nbytes), "ratio": float(r["ratio"]), "lo": lo, "hi": hi,
                        "baseline": str(r["ref_backend"]), "holds": bool(lo >= FP8_MIN_SPEEDUP),
                        "at_floor": None if at_floor is None else float(at_floor["ratio"])})
    entries.sort(key=lambda e: (e["source"], e["num_kv_heads"], e["group_size"], e["batch_size"], e["kv_bytes"]))
    return entries


def _named(speedups: list[dict]) -> dict:
    cases = []
    for t in FP8_SPEEDUPS:
        row = {"case": t.label, "source": kv_grid_name(t.grid, FP8_KV), "trace": t.trace, "target": t.target,
               "note": t.note}
        found = [e for e in speedups if e["source"] == row["source"] and e["trace"] == t.trace
                 and (t.heads is None or (e["num_kv_heads"], e["group_size"]) == t.heads)]
        if not found:
            cases.append({**row, "measured": False})
            continue
        e = found[0]
        # what a kernel at the FP8 floor's time would reach over the same baseline: reported beside the
        # verdict (a target above it is out of reach on this GPU), never part of the rule
        cases.append({**row, "measured": True, "ratio": e["ratio"], "lo": e["lo"], "hi": e["hi"],
                      "baseline": e["baseline"], "holds": bool(e["ratio"] >= t.target),
                      "interval_clears": bool(e["lo"] >= t.target), "at_floor": e["at_floor"],
                      "reachable": e["at_floor"] is None or bool(e["at_floor"] >= t.target)})
    measured = [c for c in cases if c["measured"]]
    verdict = (FAILS if any(not c["holds"] for c in measured) else
               HOLDS if measured and len(measured) == len(cases) else NOT_MEASURED)
    return {"verdict": verdict, "cases": cases, "below": [c["case"] for c in measured if not c["holds"]],
            "not_measured": [c["case"] for c in cases if not c["measured"]]}


def _floor(sources: dict) -> dict:
    cases = []
    for stem, cell, nbytes in _source_cells(sources):
        target = floor_band(nbytes, FP8_FLOOR_BANDS)
        r = analysis.ratio(cell, ENGINE_BACKEND, FLOOR_BACKEND) if target is not None else None
        if r is None:
            continue
        lo, hi = analysis.interval(r["boot"])
        cases.append({**_case(stem, cell, nbytes), "frac": float(r["ratio"]), "lo": lo, "hi": hi, "target": target,
                      "ours_us": cell.time(ENGINE_BACKEND)[0], "floor_us": cell.time(FLOOR_BACKEND)[0],
                      "holds": bool(r["ratio"] >= target), "interval_clears": bool(lo >= target)})
    cases.sort(key=lambda e: (e["source"], e["num_kv_heads"], e["group_size"], e["batch_size"], e["kv_bytes"]))
    return {"verdict": _verdict(cases), "bands": [{"lo_bytes": lo, "hi_bytes": hi, "target": t}
                                                  for lo, hi, t in FP8_FLOOR_BANDS],
            "cases": cases, "below": [e["case"] for e in cases if not e["holds"]]}


def _over_fp16(fp8: tuple, fp16_frame: pd.DataFrame) -> dict:
    """Per bench_kernels_fp8 cell, our fp16 twin's time (the cell of the same key in the committed
    bench_kernels.parquet, whose rows are of the query's dtype) over our FP8 time."""
    fp16_rows = fp16_frame[fp16_frame["kv_dtype"] == fp16_frame["dtype"]] \
        if {"kv_dtype", "dtype"} <= set(fp16_frame.columns) else fp16_frame.iloc[:0]
    cells16, sizes16 = _kernel_cells(fp16_rows)
    twins = {tuple(sorted(c.key.items())): c for c in cells16 if ENGINE_BACKEND in c.point}
    cases = []
    stem = kv_grid_name("bench_kernels", FP8_KV)
    for _, cell, nbytes in _source_cells({stem: fp8}):
        twin = twins.get(tuple(sorted(cell.key.items())))
        if twin is None or sizes16[id(twin)] < FP8_OVER_FP16_BYTES:
            continue
        t8, boot8 = cell.time(ENGINE_BACKEND)
        t16, boot16 = twin.time(ENGINE_BACKEND)
        with np.errstate(invalid="ignore", divide="ignore"):
            lo, hi = analysis.interval(boot16 / boot8)
        ratio = t16 / t8
        cases.append({**_case(stem, cell, nbytes), "fp16_bytes": sizes16[id(twin)], "fp16_us": t16,
                      "fp8_us": t8, "ratio": ratio, "lo": lo, "hi": hi, "holds": bool(ratio >= FP8_OVER_FP16),
                      "interval_clears": bool(lo >= FP8_OVER_FP16)})
    cases.sort(key=lambda e: (e["batch_size"], e["fp16_bytes"], e["trace"]))
    return {"verdict": _verdict(cases), "target": FP8_OVER_FP16, "min_fp16_bytes": FP8_OVER_FP16_BYTES,
            "cases": cases, "below": [e["case"] for e in cases if not e["holds"]]}


def _sentences(entry: dict, hw: str) -> list[str]:
    if not entry["measured"]:
        files = " nor ".join(f"{stem}.parquet" for stem in entry["files"])
        return [f"The FP8 ({FP8_KV}) grid: not measured on {hw} (neither {files} is in results/{hw}/; "
                f"{FP8_COMMAND} and snakemake bench_shapes_fp8 --cores all on a GPU measure them); nor the "
                f"full step, validate-gpu and the logits over an FP8 cache ({FP8_RUNS_COMMAND})."]
    return _grid_sentences(entry) + _run_sentences(entry)


def _run_sentences(entry: dict) -> list[str]:
    """The full step, validate-gpu and the logits over an FP8 cache, in words."""
    said = []
    e2e = entry["e2e"]
    if not e2e["cells"]:
        said.append(f"The full decode step over an FP8 cache: not measured ({FP8_RUNS_COMMAND}).")
    else:
        low = min(e2e["cells"], key=lambda c: c["ratio"])
        said.append(f"The full decode step over an FP8 cache: our step at least {FP8_E2E_MIN_RATIO:g}x the fastest "
                    f"FP8 baseline's speed in {len(e2e['cells']) - len(e2e['below'])} of {len(e2e['cells'])} cells "
                    f"(lowest {low['label']} {analysis.fmt_ratio(low['ratio'], low['lo'], low['hi'])} against "
                    f"{low['baseline']}): {e2e['verdict']}.")
    if e2e["gain"]:
        gains = [g["gain"] for g in e2e["gain"]]
        said.append(f"Our fp16 step over our FP8 step, per cell: median {np.median(gains):.3f}x, from "
                    f"{min(gains):.3f}x to {max(gains):.3f}x over {len(gains)} cells.")
    val = entry["validation"]
    if not val["backends"]:
        said.append(f"validate-gpu over an FP8 cache: not measured ({FP8_RUNS_COMMAND}).")
    else:
        gated = [f"{b['backend']} {b['passed']}/{b['rows']}" for b in val["backends"] if not b["fp8_query"]]
        reported = [f"{b['backend']} {b['max_err']:.1e} (tolerance {b['rtol']:g})" for b in val["backends"]
                    if b["fp8_query"]]
        said.append(f"validate-gpu over an FP8 cache, rows within tolerance per (row, head): {', '.join(gated)}"
                    + (f"; rounding the query to e4m3, worst error reported: {', '.join(reported)}" if reported else "")
                    + f": {val['verdict']}.")
    policy = entry["policy"]
    fitted = f" (fitted on {policy['fitted_on']})" if policy["fitted_on"] else ""
    said.append(f"The FP8 policy{fitted} on the FP8 holdout rows: "
                + (f"{policy['sentence']} The policy check: {policy['verdict']}." if policy["measured"]
                   else f"not measured ({policy['command']})."))
    for c in entry["logits"]["cases"]:
        said.append(f"The logits over an FP8 cache ({c['model']}, {c['scales']} scales, {c['steps']} steps x "
                    f"{c['rows']} rows): max |d logit| / max |logit| {c['max_rel_err']:.2e} (median "
                    f"{c['median_rel_err']:.2e}), top-1 agreement {c['top1']:.3f}.")
    return said


def _grid_sentences(entry: dict) -> list[str]:
    if not any(entry["files"].values()):
        files = " nor ".join(f"{stem}.parquet" for stem in entry["files"])
        return [f"The FP8 kernel grids: not measured (neither {files}; {FP8_COMMAND})."]
    said = []
    every = entry["every_cell"]
    if every["cases"]:
        low = min(every["cases"], key=lambda e: e["lo"])
        said.append(f"Against the fastest FP8 baseline in every cell: {len(every['cases']) - len(every['below'])} of "
                    f"{len(every['cases'])} cells with the interval at or above {FP8_MIN_SPEEDUP:g} (lowest "
                    f"{low['case']} {analysis.fmt_ratio(low['ratio'], low['lo'], low['hi'])} against "
                    f"{low['baseline']}): {every['verdict']}.")
    named = entry["speedups"]
    parts = [f"{c['case']} {analysis.fmt_ratio(c['ratio'], c['lo'], c['hi'])} against {c['target']:g}"
             + ("" if c["reachable"] else f" (a kernel at the FP8 floor would reach {c['at_floor']:.3f}x here)")
             if c["measured"] else f"{c['case']} not measured" for c in named["cases"]]
    said.append(f"Named FP8 speedups: {'; '.join(parts)}: {named['verdict']}.")
    for key, what, value in (("floor", "the FP8 one-kernel floor's time over ours", "frac"),
                             ("fp16", "our fp16 time over our FP8 time", "ratio")):
        e = entry[key]
        if not e["cases"]:
            said.append(f"{what[0].upper() + what[1:]}: not measured (no case of that size with both rows).")
            continue
        low = min(e["cases"], key=lambda c: c[value] / (c.get("target") or e.get("target")))
        said.append(f"{what[0].upper() + what[1:]}: {len(e['cases']) - len(e['below'])} of {len(e['cases'])} cases "
                    f"reach their target (lowest {low['case']} "
                    f"{analysis.fmt_ratio(low[value], low['lo'], low['hi'])}): {e['verdict']}.")
    return said
