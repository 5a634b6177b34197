"""``persistentkv bench-shapes``: the shapes experiment, every installed baseline, our routes and the
one-kernel floor per case (GPU).

    persistentkv bench-shapes --config config/config.yaml --out results/nvidia-h200/bench_shapes.parquet

Cases (config ``measure.bench_shapes``): Hkv in {1, 2, 8} x G in {4, 8} (Hq = G x Hkv; head_dim,
dtype and page from ``spec``) x B in {1, 4, 16}, each B at the tokens per row that make the step
read 4, 16, 64 and 256 MiB (72 cases). Kernel rows only (CUDA-graph replay, cold L2,
``measure.bench_repeats`` rounds), every backend and the floor interleaved in each round; the read
ceiling before and after. Prints per case each backend's kernel time, our best route against the
best baseline and against the floor.

Time on one H200 (estimate, not measured): per case ~1-3 s (plans, up to 45 graphs per backend at
4 MiB, 18 rounds of ~10 graph replays each queued behind a ~0.5 ms spin), so ~2-4 min for the
72 cases plus the two ceiling measurements (~20 s) and any kernel compilation a new head shape
needs in a baseline's cache.
"""

from __future__ import annotations

import argparse

from ..measure.device import require_cuda
from .measure import parse_backends


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="config/config.yaml")
    parser.add_argument("--out", required=True, help="results/{hw}/bench_shapes.parquet")
    parser.add_argument("--backends", default=None,
                        help="comma-separated subset (default: our routes and the baselines of config measure.backends)")
    parser.add_argument("--quick", action="store_true",
                        help="2 repeats, the grid's ends (Hkv, B, sizes) and its first G: a smoke run")


def run(args: argparse.Namespace) -> int:
    require_cuda()
    from ..measure.runner import run_shapes  # the harness and pandas: loaded to run, not for --help

    return run_shapes(args.config, args.out, parse_backends(args.backends), args.quick)
