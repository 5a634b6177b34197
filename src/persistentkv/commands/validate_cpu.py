"""``persistentkv validate-cpu``: our routes, run by the NumPy executor, against float64.

For each config trace at the calibration seed, ``validation.cpu.steps_per_trace`` steps
(traces.sampled_steps, as validate-gpu samples them: the first, the longest, then evenly spaced)
are planned with the workqueue, buckets and split routes and executed by
``reference.execute_plan`` on an FP16 cache laid out on the trace's real (scattered) pages;
``reference.reference_decode`` (float64, plan-free) is the judge, per (row, query head)
(``reference.gate``: a run passes when every ||out[b, h] - ref[b, h]|| / ||ref[b, h]|| is within
``validation.cpu.rtol`` and nothing is NaN; the whole-batch ``rel_err`` is recorded too). Writes
results/counters/validation_cpu.parquet (docs/DATA.md) and exits 1 after writing it when any row
fails, so the workflow stops on a wrong plan.

``--jobs N`` runs the sampled steps in N worker processes (the rule passes its threads), each
with one BLAS thread: every step is seeded on its own, so the rows, in trace and step order, do
not depend on N. A workflow job is pinned to its threads' CPUs, so one process would run the 42
steps of the published config on one CPU (153 s on the H100 host of the first reproduce run).

Cost, napkin math: the longest published step (homogeneous B8) holds 8 x 32.8K = 262K tokens, so
its K and V are 262K x 8 heads x 128 x 2 B = 0.54 GB each in FP16. Only the pages the step
uses are materialised (cache.compact_batch: renumbered densely, physical order kept), never the
trace's whole page universe (1.6 GB of FP16 for bimodal B8), and ``cache.random_cache`` draws them in chunks of
:data:`CACHE_CHUNK_PAGES` pages because it draws float64 first (4x the FP16 bytes at once).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from .. import configuration
from ..cache import allocate, batch_for_step, compact_batch, random_cache, random_queries
from ..counters import buckets_variant, split_variant, to_frame, workqueue_variant
from ..errors import require
from ..io import atomic_write_parquet, round_columns
from ..measure.rows import ERROR_COLUMNS
from ..measure.validation import compare
from ..reference import execute_plan, reference_decode
from ..spec import AttentionSpec
from ..traces import Trace, read_trace, sampled_steps

#: Pages per random_cache call: a 64 MB float64 draw per chunk instead of 2 GB for the longest step.
CACHE_CHUNK_PAGES = 512
#: results/counters/validation_cpu.parquet: DATA.md's columns, plus the step's shape and S.
COLUMNS = ("trace", "seed", "step", "route", "num_splits", "batch_size", "max_len", "total_tokens",
           "rel_err", "max_row_head_err", "worst_row", "worst_head", "row_heads_failing", "max_abs_err", "rtol",
           "passed", "nan_count", "reason")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    configuration.add_config_argument(parser)
    parser.add_argument("--traces-dir", type=Path, default=Path("build/traces"),
                        help="where {trace}_s{seed}.json live (default: build/traces)")
    parser.add_argument("--out", type=Path, required=True, help="output parquet")
    parser.add_argument("--trace", action="append", default=None, metavar="NAME",
                        help="validate only this config trace (repeatable; default: all)")
    parser.add_argument("--steps", type=int, default=None,
                        help="sampled steps per trace (default: validation.cpu.steps_per_trace)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="worker processes for the sampled steps (default: 1, this process)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def step_cache(spec: AttentionSpec, num_pages: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """K and V, each [num_pages, page_size, Hkv, D] in ``spec.dtype``, standard-normal values from
    ``cache.random_cache`` drawn :data:`CACHE_CHUNK_PAGES` pages at a time (chunk c seeded seed + c)."""
    shape = (num_pages, spec.page_size, spec.num_kv_heads, spec.head_dim)
    k_cache = np.empty(shape, dtype=np.dtype(spec.dtype))
    v_cache = np.empty_like(k_cache)
    for chunk, start in enumerate(range(0, num_pages, CACHE_CHUNK_PAGES)):
        stop = min(start + CACHE_CHUNK_PAGES, num_pages)
        k_cache[start:stop], v_cache[start:stop] = random_cache(spec, stop - start, seed + chunk)
    return k_cache, v_cache


def errors(out: np.ndarray, ref: np.ndarray, rtol: float, seq_lens=None) -> dict:
    """The error columns of out [B, Hq, D] against float64 ref, as validate-gpu's
    (measure.validation.compare) but for an output that was not poisoned: rel_err (whole batch,
    not a gate), the per-(row, query head) gate (max_row_head_err, worst_row, worst_head,
    row_heads_failing), max_abs_err, nan_count, passed (no NaN, every (row, head) within
    ``rtol``) and reason ('' when passed, else the worst (row, head); ``seq_lens`` adds its row's
    length)."""
    return compare(out, ref, rtol, seq_lens, poison=None)


#: The routes validate_step runs on each sampled step (workqueue, buckets, split): one row, and one
#: tick of the progress bar, each.
ROUTES_PER_STEP = 3


def validate_step(trace: Trace, index: int, spec: AttentionSpec, num_splits: int, planner: dict,
                  rtol: float, allocation=None) -> list[dict]:
    """Rows of validation_cpu.parquet for step ``index`` of ``trace``: (workqueue, buckets, split).
    ``allocation``: the trace's page allocation where the caller made it once for all its steps (a
    worker process, given one step, makes it here)."""
    spec16 = dataclasses.replace(spec, dtype="float16")
    variants = [workqueue_variant(int(planner["target_items"]), int(planner["min_chunk_tiles"])),
                buckets_variant(num_splits), split_variant(num_splits)]
    if allocation is None:
        allocation = allocate(trace.requests, spec16.page_size, 0.0, trace.seed)
    step = trace.steps[index]
    batch, _ = compact_batch(batch_for_step(spec16, allocation, step))
    k_cache, v_cache = step_cache(spec16, batch.num_pages, trace.seed)
    q = random_queries(spec16, batch.batch_size, trace.seed)
    ref = reference_decode(q, k_cache, v_cache, batch)
    rows = []
    for variant in variants:
        out = execute_plan(variant.plan(batch), q, k_cache, v_cache, batch)
        rows.append({"trace": trace.name, "seed": int(trace.seed), "step": int(step.index),
                     "route": variant.route, "num_splits": int(variant.num_splits),
                     "batch_size": batch.batch_size, "max_len": batch.max_len,
                     "total_tokens": batch.total_tokens, "rtol": float(rtol),
                     **errors(out, ref, rtol, batch.seq_lens)})
    return rows


def validate_trace(trace: Trace, spec: AttentionSpec, num_splits: int, planner: dict, steps: int,
                   rtol: float, progress=None) -> list[dict]:
    """Rows of validation_cpu.parquet for ``trace``: each sampled step x (workqueue, buckets, split),
    one step's cache at a time."""
    rows = []
    allocation = allocate(trace.requests, spec.page_size, 0.0, trace.seed)
    for index in sampled_steps(trace, steps):
        step_rows = validate_step(trace, index, spec, num_splits, planner, rtol, allocation)
        rows.extend(step_rows)
        if progress is not None:
            progress.update(len(step_rows))
    return rows


#: The BLAS and OpenMP thread counts a worker process starts with (one each: the workers are the parallelism).
ONE_THREAD = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
#: Host memory one worker may need: the published config's longest step peaked at 2.4 GB in one process.
WORKER_BYTES = 3 << 30


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) * 1024
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def workers_for(jobs: int, tasks: int, available: int | None) -> int:
    """Worker processes for ``tasks`` steps: at most ``jobs``, and no more than ``available`` bytes of
    host memory hold at :data:`WORKER_BYTES` each (None: not known, not capped); at least 1."""
    by_memory = jobs if available is None else max(1, available // WORKER_BYTES)
    return max(1, min(jobs, tasks, by_memory))


@contextmanager
def _environment(values: dict):
    """os.environ with ``values`` set inside the block (worker processes started there inherit them)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


#: What validate-cpu says before it runs the steps in its own process after its workers died.
WORKERS_DIED = ("warning: validate-cpu's worker processes died before returning their rows (one killed for "
                "memory, or an entry script that calls the command without an `if __name__ == \"__main__\":` "
                "guard, which each spawned worker runs again); running the steps in this process instead, "
                "as --jobs 1 does (same rows)")


def validate_parallel(loaded: list, spec: AttentionSpec, planner: dict, steps: int, rtol: float, jobs: int,
                      progress=None) -> list[dict]:
    """Every (trace, sampled step) of ``loaded`` [(trace, splits)] in up to ``jobs`` worker processes
    (:func:`workers_for`); the rows in trace and step order, as :func:`validate_trace` gives them one
    trace after another."""
    import multiprocessing

    tasks = [(trace, index, splits) for trace, splits in loaded for index in sampled_steps(trace, steps)]
    workers = workers_for(jobs, len(tasks), available_memory())
    with _environment(ONE_THREAD), ProcessPoolExecutor(max_workers=workers,
                                                       mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(validate_step, trace, index, spec, splits, planner, rtol)
                   for trace, index, splits in tasks]
        rows = []
        for future in futures:
            step_rows = future.result()
            rows.extend(step_rows)
            if progress is not None:
                progress.update(len(step_rows))
    return rows


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    config = configuration.load_config(args.config)
    names = args.trace or configuration.trace_names(config)
    entries = [configuration.trace_entry(config, name) for name in names]
    steps = config["validation"]["cpu"]["steps_per_trace"] if args.steps is None else args.steps
    require(steps >= 1, f"--steps must be >= 1, got {steps}")
    require(args.jobs >= 1, f"--jobs must be >= 1, got {args.jobs}")
    rtol = float(config["validation"]["cpu"]["rtol"])
    seed = configuration.calibration_seed(config)
    spec = configuration.spec(config)
    loaded = []
    for entry in entries:
        path = args.traces_dir / f"{entry['name']}_s{seed}.json"
        require(path.is_file(), f"trace {path} does not exist (make it with: persistentkv traces "
                                f"--trace {entry['name']} --seed {seed} --out {path})")
        loaded.append((read_trace(path), int(entry["splits"])))

    total = sum(ROUTES_PER_STEP * min(steps, len(trace.steps)) for trace, _ in loaded)
    rows = None
    with tqdm(total=total, desc="validate-cpu", unit="run", disable=args.no_progress) as progress:
        if args.jobs > 1:
            try:
                rows = validate_parallel(loaded, spec, config["planner"], steps, rtol, args.jobs, progress)
            except BrokenProcessPool:
                print(WORKERS_DIED, file=sys.stderr)
                progress.reset()
        if rows is None:  # --jobs 1, or workers that died
            rows = [row for trace, splits in loaded
                    for row in validate_trace(trace, spec, splits, config["planner"], steps, rtol, progress)]
    frame = round_columns(to_frame(rows, COLUMNS), ERROR_COLUMNS, "error")
    atomic_write_parquet(args.out, frame)
    failed = frame[~frame["passed"]]
    print(f"{args.out}: {len(frame)} runs, {len(frame) - len(failed)} passed, worst (row, head) "
          f"rel err {frame['max_row_head_err'].max():.3g} (rtol {rtol:g})")
    for row in failed.itertuples():
        print(f"FAILED {row.trace} seed {row.seed} step {row.step} {row.route}: {row.reason}", file=sys.stderr)
    return 1 if len(failed) else 0
