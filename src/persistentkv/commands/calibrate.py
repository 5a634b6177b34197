"""``persistentkv calibrate``: fit the policy on calibration timings into results/<hw>/policy.json.

    persistentkv calibrate --config config/config.yaml \\
        --timings results/nvidia-h200/raw/calibration.parquet --out results/nvidia-h200/policy.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from ..calibration import PROTOCOL_PREFERENCE, calibrate, describe
from ..configuration import add_config_argument, load_config
from ..errors import PKVError, require
from ..io import atomic_write_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_argument(parser)
    parser.add_argument("--timings", required=True, type=Path,
                        help="raw calibration timings (results/<hw>/raw/calibration.parquet)")
    parser.add_argument("--out", required=True, type=Path, help="policy JSON to write (results/<hw>/policy.json)")
    parser.add_argument("--protocol", choices=PROTOCOL_PREFERENCE, default=None,
                        help="timing protocol to fit (default: step if measured, else kernel, else eager)")
    parser.add_argument("--base-dir", type=Path, default=Path("."),
                        help="folder that the config's trace file paths are relative to (default: .)")


def read_timings(path: Path):
    require(path.is_file(), f"timings file {path} does not exist")
    try:
        frame = pd.read_parquet(path)
    except Exception as exc:  # pyarrow raises several types for a truncated or foreign file
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise PKVError(f"timings file {path} is not a readable parquet table ({type(exc).__name__}: {first})") from None
    require(len(frame) > 0, f"timings file {path} has no rows")
    return frame


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.base_dir)
    timings = read_timings(args.timings)
    policy = calibrate(
        timings, config["policy"]["candidates"],
        trace_entries=config["traces"], base_dir=args.base_dir,
        calibration_seed=int(config["seeds"]["calibration"]),
        holdout_seeds=[int(s) for s in config["seeds"]["holdout"]],
        long_context_threshold=int(config["policy"]["long_context_threshold"]),
        target_items=int(config["planner"]["target_items"]),
        protocol=args.protocol, source=f"timings file {args.timings}",
    )
    atomic_write_json(args.out, policy)
    print(f"wrote {args.out}: {describe(policy)}")
    return 0
