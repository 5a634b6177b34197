"""``persistentkv counters``: plan every step of a trace with every route; write the counters
table (build/counters/{trace}_s{seed}.parquet, docs/DATA.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import configuration
from ..counters import count_trace
from ..errors import PKVError, require
from ..io import atomic_write_parquet
from ..traces import read_trace


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace-json", type=Path, required=True, metavar="JSON",
                        help="a trace written by 'persistentkv traces'")
    configuration.add_config_argument(parser)
    parser.add_argument("--splits", type=int, default=None,
                        help="S for split, buckets and workqueue_fixed (default: the config entry's splits)")
    parser.add_argument("--out", type=Path, required=True, help="output parquet")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    config = configuration.load_config(args.config)
    trace = read_trace(args.trace_json)
    if args.splits is None:
        if trace.name not in configuration.trace_names(config):
            raise PKVError(f"trace {trace.name!r} ({args.trace_json}) is not in {args.config}; pass --splits")
        splits = int(configuration.trace_entry(config, trace.name)["splits"])
    else:
        require(args.splits >= 1, f"--splits must be >= 1, got {args.splits}")
        splits = args.splits
    frame = count_trace(trace, configuration.spec(config), splits, config["planner"], progress=not args.no_progress)
    atomic_write_parquet(args.out, frame)
    print(f"{args.out}: {len(frame)} rows ({trace.name} seed {trace.seed}, {len(trace.steps)} steps, S={splits})")
    return 0
