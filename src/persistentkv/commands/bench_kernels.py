"""``persistentkv bench-kernels``: the synthetic kernel grid, every installed backend, the ceilings (GPU).

    persistentkv bench-kernels --config config/config.yaml --out results/nvidia-h200/bench_kernels.parquet
    persistentkv bench-kernels --config config/config.yaml --kv-dtype float8_e4m3 \
        --out results/nvidia-h200/bench_kernels_fp8.parquet

Cases: B in {1, 2, 4, 8, 16, 64} x {1K, 4K, 8K, 16K, 32K, 128K} tokens per row, plus B=1 at 64K and
256K, a B=8 bimodal-like row set and a B=8 ragged one (3 x 65536 + 5 short). Protocols: kernel
(CUDA-graph replay) and eager; per case, in the same rounds, the one-kernel floor (the read kernel
over exactly the case's bytes in one launch, cold L2, the best of four grids; backend
``one-kernel-floor``). Prints per case the kernel time of each backend, our best route against the
best baseline and the floor's time over ours. ``--kv-dtype float8_e4m3``: the same grid on e4m3
caches (per-tensor scales, the query in the spec's dtype); the kv_bytes and the floor are the FP8
bytes, and a backend that does not read such a cache gives one ``unavailable`` row with its reason.
"""

from __future__ import annotations

import argparse

from ..measure.device import require_cuda
from .measure import add_kv_dtype, parse_backends, parse_kv_dtype


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="config/config.yaml")
    parser.add_argument("--out", required=True, help="results/{hw}/bench_kernels.parquet")
    parser.add_argument("--policy", default=None, help="policy.json for the adaptive backend (else it is unavailable)")
    parser.add_argument("--backends", default=None, help="comma-separated subset (default: config measure.backends)")
    parser.add_argument("--quick", action="store_true", help="2 repeats and the grid's corners only: a smoke run")
    add_kv_dtype(parser, "results/{hw}/bench_kernels_fp8.parquet")


def run(args: argparse.Namespace) -> int:
    kv_dtype = parse_kv_dtype(args.kv_dtype)
    backends = parse_backends(args.backends)
    require_cuda()
    from ..measure.runner import run_bench  # the harness and pandas: loaded to run, not for --help

    return run_bench(args.config, args.out, args.policy, backends, args.quick, kv_dtype)
