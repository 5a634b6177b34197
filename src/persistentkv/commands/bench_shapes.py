"""``persistentkv bench-shapes``: the shapes experiment, every installed baseline, our routes and the
one-kernel floor per case (GPU).

    persistentkv bench-shapes --config config/config.yaml --out results/nvidia-h200/bench_shapes.parquet
    persistentkv bench-shapes --config config/config.yaml --kv-dtype float8_e4m3 \
        --out results/nvidia-h200/bench_shapes_fp8.parquet

Cases (config ``measure.bench_shapes``): Hkv in {1, 2, 8} x G in {4, 8} (Hq = G x Hkv; head_dim,
dtype and page from ``spec``) x B in {1, 2, 4, 8, 16, 64}, each B at the tokens per row that make the
step read 4, 16, 64, 256 and 1024 MiB: rows of 16 tokens (Hkv=8, B=64 at 4 MiB) to 1M (Hkv=2, B=1 at
1 GiB); the two cells whose rows would pass max_tokens_per_row (Hkv=1, B=1 at 1 GiB) are skipped, 178
cases. Kernel rows only (CUDA-graph replay, cold L2, ``measure.bench_repeats`` rounds), every
backend and the floor interleaved in each round; the read ceiling before and after. Prints per
case each backend's kernel time, our best route against the best baseline and against the floor.

``--kv-dtype float8_e4m3``: the same cells (the same rows of the same tokens, sized by the spec's
dtype, so each reads half the MiB its fp16 twin does) on e4m3 caches with per-tensor scales; the
kv_bytes and the floor are the FP8 bytes; a backend that does not read such a cache gives one
``unavailable`` row per shape with its reason.

Time on one H200: the 72 cases of the earlier grid (B in {1, 4, 16}, up to 256 MiB) were estimated
at ~1-3 s each; the log's progress bar says what this grid takes.
"""

from __future__ import annotations

import argparse

from ..measure.device import require_cuda
from .measure import add_kv_dtype, parse_backends, parse_kv_dtype


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="config/config.yaml")
    parser.add_argument("--out", required=True, help="results/{hw}/bench_shapes.parquet")
    parser.add_argument("--backends", default=None,
                        help="comma-separated subset (default: our routes and the baselines of config measure.backends)")
    parser.add_argument("--quick", action="store_true",
                        help="2 repeats, the grid's ends (Hkv, B, sizes) and its first G: a smoke run")
    add_kv_dtype(parser, "results/{hw}/bench_shapes_fp8.parquet")


def run(args: argparse.Namespace) -> int:
    kv_dtype = parse_kv_dtype(args.kv_dtype)
    backends = parse_backends(args.backends)
    require_cuda()
    from ..measure.runner import run_shapes  # the harness and pandas: loaded to run, not for --help

    return run_shapes(args.config, args.out, backends, args.quick, kv_dtype)
