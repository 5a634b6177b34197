"""The GPU commands' bodies: config -> cases -> ceilings -> rows -> parquet + provenance sidecar.

Called by persistentkv.commands.{measure, bench_kernels, bench_shapes, validate_gpu} after they
have checked that a CUDA device is present. Every output is written atomically (persistentkv.io).
While a run is under way its finished cases' rows are kept in ``partial/`` beside its output
(PartialRows), so a run stopped part-way leaves them there; the output itself is written only
when the run completes.
"""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path

from .. import configuration
from ..analysis import pinning
from ..backends import registry
from ..ceiling import ceiling_gbps, measure_ceilings, renumbered, run_read_gbps
from ..io import atomic_write_parquet
from ..names import CPU_ONLY, SHAPES_EXPERIMENT, synthetic_name
from ..provenance import collect, new_run_id, sidecar_path, utc_now, write_sidecar
from ..reference import TOLERANCE
from ..spec import AttentionSpec
from ..traces import sampled_steps
from .device import TorchDevice
from .harness import BackendFactory, RunContext, Settings, experiment_protocols, one_kernel_floor, run_cases
from .rows import ceiling_rows, one_line, raw_frame, validation_frame
from .smoke import run_smoke
from .statistics import frac_of_ceiling, kernel_table
from .validation import failing, validate_case
from .workload import (Variant, bench_grid, default_splits, experiment_cases, load_trace, on_cache, seeds_of,
                       shapes_cases, synthetic_case, trace_cases, variant_for, variants)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _device():
    device = TorchDevice("cuda")
    log(f"device: {device.name}, {device.sm_count} SMs, L2 {device.l2_bytes / 2**20:.0f} MiB, "
        f"{device.total_bytes / 2**30:.0f} GiB")
    return device


def _ceilings(device, quick: bool):
    """One measurement of both ceilings: (samples, {backend: why not measured})."""
    return measure_ceilings(device, repeats=3 if quick else 5, warmup=2, log=log)


#: PartialRows writes the rows so far at most this often (s): a frame of 40k rows takes ~0.4 s to
#: build and write, and an experiment runs hundreds of cases.
PARTIAL_EVERY_S = 30.0


class PartialRows:
    """A GPU run's finished rows kept on disk while it runs: ``save(rows, done)`` after every case
    keeps them, and writes them (after ``prefix``, the ceiling rows measured before the cases) to
    ``partial/<name>`` beside ``out`` when ``every_s`` seconds have passed since the last write,
    with a sidecar whose record says ``complete: false`` and ``cases: {done, total}``;
    ``stopped(exc)`` writes the rows of every finished case with ``stopped_by`` in the sidecar and
    says where they are; ``finish()``, once the run's output is written, removes both. The pipeline never reads
    ``partial/`` (results.load_results reads the output's own folder, not below it), so a stopped
    run's rows are kept without ever being taken for a finished run's. ``frame_of(rows)``: the
    DataFrame the output would hold (raw_frame, validation_frame); ``provenance()``: the sidecar's
    record, collected at the first write (the run's own output collects its record after the
    cases, when the GPU's clocks are those it ran at)."""

    def __init__(self, out: str, run_id: str, provenance, total: int, frame_of, every_s: float | None = None):
        import time

        self.out = Path(out)
        self.path = self.out.parent / "partial" / self.out.name
        self.run_id, self.provenance, self.total, self.frame_of = run_id, provenance, int(total), frame_of
        self.record: dict | None = None
        self.prefix: list[dict] = []
        self.rows: list[dict] = []
        self.done = 0
        self.every_s, self.clock = float(PARTIAL_EVERY_S if every_s is None else every_s), time.monotonic
        self.written_at = self.clock()

    def _write(self, extra: dict | None = None) -> None:
        if self.record is None:
            self.record = dict(self.provenance())
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_parquet(self.path, self.frame_of(self.prefix + self.rows))
        write_sidecar(self.path, self.run_id, {**self.record, "complete": False,
                                               "cases": {"done": self.done, "total": self.total}, **(extra or {})})

    def save(self, rows: list[dict], done: int) -> None:
        """Keep ``rows`` (the caller's list, only ever appended to) and write them when due. A
        write that fails (a full disk) is said once and never stops the run: later saves only
        keep the rows, for ``stopped`` to try again."""
        self.rows, self.done = rows, int(done)
        if self.every_s == math.inf or self.clock() - self.written_at < self.every_s:
            return
        try:
            self._write()
        except Exception as exc:
            log(f"could not keep the rows so far in {self.path}: {type(exc).__name__}: {exc}; the run goes on")
            self.every_s = math.inf
        self.written_at = self.clock()

    def stopped(self, exc: BaseException) -> None:
        """The run stopped on ``exc``: the finished cases' rows stay, the sidecar says why (the
        write itself may fail after a device fault; that is said without hiding ``exc``)."""
        why = one_line(exc)
        try:
            self._write({"stopped_by": why})
        except Exception as write_exc:
            log(f"could not keep the finished rows: {type(write_exc).__name__}: {write_exc}")
            return
        log(f"stopped after {self.done} of {self.total} cases ({why}); their rows are in {self.path} "
            f"(not read by the pipeline)")

    def finish(self) -> None:
        """The run's output is written: its partial files go (an error here is said, never raised)."""
        try:
            for path in (self.path, sidecar_path(self.path)):
                path.unlink(missing_ok=True)
            if self.path.parent.is_dir() and not any(self.path.parent.iterdir()):
                self.path.parent.rmdir()
        except OSError as exc:
            log(f"could not remove {self.path}: {exc}")


def _bracketed(device, run_id: str, experiment: str, quick: bool, body, partial: PartialRows | None = None) -> list[dict]:
    """The ceilings measured before and after ``body(ceiling_gbps)`` (which runs the cases and
    returns their rows, scaled by the first measurement's read ceiling); the rows, rescaled to the
    run's read ceiling (ceiling.run_read_gbps: the higher of the two), after the ceiling rows of both
    measurements. A ceiling fails only if neither measurement has it. ``partial``: the run's
    PartialRows, given the first measurement's ceiling rows and told if the run stops before the
    second measurement is in."""
    before, failed_before = _ceilings(device, quick)
    if partial is not None:
        partial.prefix = ceiling_rows(before, failed_before, run_id, experiment)
    try:
        rows = body(ceiling_gbps(before))
        after, failed_after = _ceilings(device, quick)
    except BaseException as exc:  # in the cases or in the ceilings after them: keep the finished rows
        if partial is not None:
            partial.stopped(exc)
        raise
    after = renumbered(after, 1 + max((s.repeat for s in before), default=-1))
    read = run_read_gbps([before, after])
    log(f"read ceiling: {ceiling_gbps(before):.0f} GB/s before the cases, {ceiling_gbps(after):.0f} after; "
        f"the run's: {read:.0f}")
    measured = {s.backend for s in before + after}
    failures = {b: why for b, why in {**failed_after, **failed_before}.items() if b not in measured}
    for row in rows:
        row["read_ceiling_gbps"] = read
        if row.get("status") == "ok":
            row["frac_of_ceiling"] = frac_of_ceiling(row["kv_bytes"], row["per_layer_us"], read)
    return ceiling_rows(before + after, failures, run_id, experiment, read_gbps=read) + rows


def _write(frame, partial: PartialRows) -> None:
    """The run's output and its sidecar, whose record is collected now, after the cases (the GPU's
    clocks those it ran at); then its partial files go."""
    atomic_write_parquet(partial.out, frame)
    sidecar = write_sidecar(partial.out, partial.run_id, partial.provenance())
    partial.finish()
    log(f"wrote {partial.out} ({len(frame)} rows) and {sidecar}")


def _summary(frame) -> None:
    timed = frame[(frame["status"] == "ok") & (frame["protocol"] != "ceiling")]
    p = pinning(timed)
    if p["pinned"]:
        probe = f"; probe {p['probe_us'][0]:.0f}-{p['probe_us'][1]:.0f} us there" if p["probe_us"] else ""
        log(f"  timing thread pinned in {p['pinned']} of {len(timed)} timing rows, on {p['cpus']} CPU(s){probe}")
    bad = frame[frame["status"] != "ok"]
    for (backend, status), group in bad.groupby(["backend", "status"], sort=True):
        log(f"  {backend}: {len(group)} {status} row(s), e.g. {group['reason'].iloc[0]}")


def run_experiment(config_path: str, experiment: str, traces_dir: str, out: str, policy: str | None,
                   backends: list[str] | None, quick: bool, kv_dtype: str | None = None) -> int:
    """One experiment's raw rows into ``out``, on caches of ``kv_dtype`` (None: the spec's dtype)."""
    config = configuration.load_config(config_path)
    cases = experiment_cases(experiment, config, traces_dir, policy, backends, quick, kv_dtype)
    device = _device()
    started = utc_now()
    run_id = new_run_id(experiment, started)
    settings = Settings.from_config(config, protocols=experiment_protocols(config, experiment), quick=quick,
                                    seed=int(config["seeds"]["calibration"]))
    log(f"{experiment}: {len(cases)} cases, protocols {', '.join(settings.protocols)}, "
        f"{settings.repeats} repeats ({settings.repeats_of('step')} of step rows) after {settings.warmup} "
        f"warm-up rounds")
    partial = PartialRows(out, run_id, lambda: collect(config, seeds_of(cases), started, device), len(cases),
                          raw_frame)
    rows = _bracketed(device, run_id, experiment, quick,
                      lambda ceiling: run_cases(cases, device, BackendFactory(), settings,
                                                RunContext(run_id, ceiling, log=log), on_case=partial.save),
                      partial)
    frame = raw_frame(rows)
    _write(frame, partial)
    _summary(frame)
    return 0


def bench_cases(config: dict, policy: str | None, backends: list[str] | None, quick: bool,
                kv_dtype: str | None = None):
    """bench-kernels' cases (names.BENCH_*), on caches of ``kv_dtype`` (None: the spec's dtype)."""
    spec = on_cache(configuration.spec(config), kv_dtype)
    names = list(backends) if backends else list(config["measure"]["backends"])
    vs = variants(names, config, default_splits(config), policy)
    grid = bench_grid()
    if quick:
        grid = [g for g in grid if g[0] in ("B1xN1024", "B1xN131072", "B64xN1024", "B8-ragged")]
    return [synthetic_case("bench_kernels", name, lengths, spec, vs) for name, lengths in grid]


def run_bench(config_path: str, out: str, policy: str | None, backends: list[str] | None, quick: bool,
              kv_dtype: str | None = None) -> int:
    config = configuration.load_config(config_path)
    return _run_kernel_grid(config, out, bench_cases(config, policy, backends, quick, kv_dtype), "bench_kernels",
                            ("kernel", "eager"), quick, ("trace",))


def _run_kernel_grid(config: dict, out: str, cases, experiment: str, protocols: tuple, quick: bool,
                     index: tuple) -> int:
    """bench-kernels' and bench-shapes' run: ``cases`` under ``protocols`` with the one-kernel floor
    in every case's rounds, between the two ceiling measurements; the rows to ``out``, then the
    summary and the kernel table per case (``index``: the columns that name one)."""
    device = _device()
    started = utc_now()
    run_id = new_run_id(experiment, started)
    settings = Settings.from_config(config, protocols=protocols, quick=quick,
                                    seed=int(config["seeds"]["calibration"]), bench=True)
    caches = sorted({c.spec.cache_dtype for c in cases})
    log(f"{experiment}: {len(cases)} cases on {'/'.join(caches)} caches, {' and '.join(protocols)} rows, "
        f"{settings.repeats} repeats after {settings.warmup} warm-up rounds, the one-kernel floor in every round")
    partial = PartialRows(out, run_id, lambda: collect(config, [0], started, device), len(cases), raw_frame)
    rows = _bracketed(device, run_id, experiment, quick,
                      lambda ceiling: run_cases(cases, device, BackendFactory(), settings,
                                                RunContext(run_id, ceiling, log=log, floor=one_kernel_floor),
                                                on_case=partial.save),
                      partial)
    frame = raw_frame(rows)
    _write(frame, partial)
    _summary(frame)
    _print_table(frame, index)
    return 0


def _print_table(frame, index=("trace",)) -> None:
    table = kernel_table(frame, index)
    if not table.empty:
        import pandas as pd

        with pd.option_context("display.width", 220, "display.max_columns", 30, "display.float_format", "{:.2f}".format):
            print("kernel time per call (us, median); speedup = best baseline / best pkv route; frac_of_floor = "
                  "the one-kernel floor / best pkv route")
            print(table.to_string())


def run_shapes(config_path: str, out: str, backends: list[str] | None, quick: bool,
               kv_dtype: str | None = None) -> int:
    """The shapes experiment (config measure.bench_shapes): kernel rows of every backend and the
    one-kernel floor per case, between the two ceiling measurements; on caches of ``kv_dtype``
    (None: the spec's dtype; workload.shapes_cases)."""
    config = configuration.load_config(config_path)
    cases, skipped = shapes_cases(config, backends, quick, kv_dtype)
    for why in skipped:
        log(f"bench_shapes: skipped {why}")
    return _run_kernel_grid(config, out, cases, SHAPES_EXPERIMENT, ("kernel",), quick,
                            ("num_kv_heads", "num_qo_heads", "trace"))


def run_validation(config_path: str, traces_dir: str, out: str, policy: str | None,
                   backends: list[str] | None, kv_dtype: str | None = None) -> int:
    """validate-gpu's run; ``kv_dtype`` float8_e4m3: every case over an FP8 cache
    (measure.validation)."""
    from tqdm import tqdm

    config = configuration.load_config(config_path)
    spec = replace(configuration.spec(config), kv_dtype=kv_dtype)
    names = list(backends) if backends else list(config["measure"]["backends"])
    seed = int(config["seeds"]["calibration"])
    gpu = config["validation"]["gpu"]
    rtols = {"float16": float(gpu["rtol_float16"]), "bfloat16": float(gpu["rtol_bfloat16"])}
    cases = []
    for entry in config["traces"]:
        trace = load_trace(traces_dir, entry["name"], seed)
        steps = sampled_steps(trace, int(gpu["steps_per_trace"]))
        cases += trace_cases("validation", trace, spec, 0.0, steps,
                             variants(names, config, int(entry["splits"]), policy), entry["name"])
    if gpu.get("long_row"):  # the longest row the engine addresses, its pages scattered
        lengths = [int(gpu["long_row"])]
        cases.append(synthetic_case("validation", synthetic_name(lengths), lengths, spec,
                                    variants(names, config, default_splits(config), policy), hole_fraction=0.5))
    device = _device()
    started = utc_now()
    run_id = new_run_id("validation_gpu", started)
    factory = BackendFactory()
    partial = PartialRows(out, run_id, lambda: collect(config, [seed], started, device), len(cases),
                          validation_frame)
    rows = []
    try:
        for index, case in enumerate(tqdm(cases, desc="validate", unit="step")):
            rows += validate_case(case, device, factory, rtols=rtols, log=log)
            partial.save(rows, index + 1)
    except BaseException as exc:
        partial.stopped(exc)
        raise
    frame = validation_frame(rows)
    _write(frame, partial)
    bad = failing(rows)
    reported = [r for r in rows if r["fp8_query"] and r["status"] == "ok" and not r["passed"]]
    for row in reported[:20]:
        log(f"reported {row['backend']} {row['dtype']} {row['trace']} step {row['step']}: {row['reason']}")
    for row in bad[:20]:
        log(f"FAIL {row['backend']} {row['dtype']} {row['trace']} step {row['step']}: {row['status']}: {row['reason']}")
    if bad:
        log(f"validate-gpu: {len(bad)} failing row(s) of {len(rows)}")
        return 1
    log(f"validate-gpu: every backend that ran passed ({len(rows)} rows)")
    return 0


def run_smoke_command(config_path: str | None, out: str | None, policy: str | None,
                      backends: list[str] | None) -> int:
    config = configuration.load_config(config_path) if config_path else None
    spec = configuration.spec(config) if config else AttentionSpec()
    names = list(backends) if backends else [n for n in registry.names() if n not in CPU_ONLY]
    if config:
        vs = tuple(variant_for(n, config, default_splits(config), policy) for n in names)
    else:
        vs = tuple(Variant(n, (("num_splits", 32),)) if n in ("pkv-buckets", "pkv-split")
                   else Variant(n, (("policy_path", policy),)) if n == "adaptive" and policy else Variant(n)
                   for n in names)
    rtols = ({"float16": float(config["validation"]["gpu"]["rtol_float16"]),
              "bfloat16": float(config["validation"]["gpu"]["rtol_bfloat16"])} if config
             else {dtype: TOLERANCE[dtype] for dtype in ("float16", "bfloat16")})
    device = _device()
    started = utc_now()
    run_id = new_run_id("smoke", started)
    vrows, trows = run_smoke(spec, vs, device, run_id, rtols, log=print)
    if out:
        atomic_write_parquet(out, validation_frame(vrows))
        timing = Path(out).with_name(Path(out).stem + "_timing.parquet")
        atomic_write_parquet(timing, raw_frame(trows))
        write_sidecar(out, run_id, collect(config or {}, [0], started, device))
        log(f"wrote {out}, {timing}")
    return 1 if failing(vrows) else 0
