"""``persistentkv validate-gpu``: every backend against float64 at sampled steps of every trace (GPU).

    persistentkv validate-gpu --config config/config.yaml --traces-dir build/traces \
        --out results/nvidia-h200/validation_gpu.parquet [--policy ...] [--backends ...]
    persistentkv validate-gpu --smoke [--config config/config.yaml] [--out smoke.parquet]

The full run checks validation.gpu.steps_per_trace steps of every config trace (calibration seed)
in float16 and bfloat16, each (row, query head) against the rtol of each dtype
(measure.validation.compare), writes the table, then exits 1 if any backend that ran failed. ``--smoke`` is the one call that shows what works on a new machine: every
backend on three small cases (correctness in both dtypes + a short kernel/eager timing) and the
ceilings, as one printed table.

``--kv-dtype float8_e4m3`` runs the same cases over an FP8 cache (e4m3 codes, one scale per
tensor; the reference reads their dequantised values) at the same tolerances; a backend whose
FP8 path rounds the query to e4m3 is reported with its error, not failed on it
(persistentkv.measure.validation).
"""

from __future__ import annotations

import argparse

from ..errors import require
from ..measure.device import require_cuda
from .measure import add_kv_dtype, parse_backends, parse_kv_dtype


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="config/config.yaml (required without --smoke)")
    parser.add_argument("--traces-dir", default="build/traces", help="folder of {trace}_s{seed}.json")
    parser.add_argument("--out", default=None, help="results/{hw}/validation_gpu.parquet (required without --smoke)")
    parser.add_argument("--policy", default=None, help="policy.json for the adaptive backend (else it is unavailable)")
    parser.add_argument("--backends", default=None, help="comma-separated subset (default: config measure.backends)")
    add_kv_dtype(parser, "results/{hw}/validation_gpu_fp8.parquet")
    parser.add_argument("--smoke", action="store_true", help="every backend once on small cases; print what works")


def run(args: argparse.Namespace) -> int:
    kv_dtype = parse_kv_dtype(args.kv_dtype)  # bad values are one line before any GPU is looked for
    require(not (args.smoke and kv_dtype), "validate-gpu --smoke runs the query's dtype only; drop --kv-dtype")
    require_cuda()
    from ..measure.runner import run_smoke_command, run_validation  # the harness and pandas: loaded to run

    backends = parse_backends(args.backends)
    if args.smoke:
        return run_smoke_command(args.config, args.out, args.policy, backends)
    require(args.config is not None, "validate-gpu needs --config (or --smoke)")
    require(args.out is not None, "validate-gpu needs --out (or --smoke)")
    return run_validation(args.config, args.traces_dir, args.out, args.policy, backends, kv_dtype)
