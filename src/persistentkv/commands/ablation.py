"""``persistentkv ablation buckets|splits``: what bucketing and the split count cost, per step.

buckets -> results/counters/ablation_buckets.parquet + .svg: for each trace of
    ``ablations.buckets.traces`` at the calibration seed, each step planned as exact-length buckets
    (``exact``), padded buckets of each ``bucket_tokens`` (``padded_<T>``), both with
    ``ablations.buckets.splits`` splits per bucket, the balanced work queue (``workqueue``) and the
    published rectangle with the trace's published S (``split_rect``).
splits  -> results/counters/ablation_splits.parquet + .svg: for each trace of
    ``ablations.splits.traces`` at the calibration seed, the split, buckets and workqueue_fixed routes at
    each S of ``ablations.splits.values``, plus the balanced work queue (num_splits -1) as the
    S-free reference.

Counters only (docs/DATA.md): the planner's launches, CTAs, padded and merge-state bytes; no GPU.
The command computes the tables; persistentkv.render.figures draws them (``--figure``).
The calibration seed is the one the paper's counter claims were made on; build/counters/ holds the
published routes at every seed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from .. import configuration
from ..counters import (COUNTER_COLUMNS, buckets_variant, padded_buckets_variant, split_variant, step_rows,
                        to_frame, workqueue_fixed_variant, workqueue_variant)
from ..errors import require
from ..io import atomic_write_parquet
from ..render import FIGURE_FORMATS
from ..traces import read_trace

IDENTITY = ("trace", "seed", "step", "batch_size", "max_len", "total_tokens")
BUCKET_COLUMNS = IDENTITY + ("variant", "route", "num_splits", "bucket_tokens") + COUNTER_COLUMNS
SPLIT_COLUMNS = IDENTITY + ("route", "num_splits", "bucket_tokens") + COUNTER_COLUMNS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kind", choices=("buckets", "splits"), help="which ablation")
    configuration.add_config_argument(parser)
    parser.add_argument("--traces-dir", type=Path, default=Path("build/traces"),
                        help="where {trace}_s{seed}.json live (default: build/traces)")
    parser.add_argument("--out", type=Path, required=True, help="output parquet")
    parser.add_argument("--figure", type=Path, default=None, help="output figure (.svg, .png or .pdf)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _load(config: dict, names: list[str], traces_dir: Path):
    """(trace, config entry) for every named trace at the calibration seed."""
    seed = configuration.calibration_seed(config)
    loaded = []
    for name in names:
        entry = configuration.trace_entry(config, name)
        path = traces_dir / f"{name}_s{seed}.json"
        require(path.is_file(), f"trace {path} does not exist (make it with: persistentkv traces "
                                f"--trace {name} --seed {seed} --out {path})")
        loaded.append((read_trace(path), entry))
    return loaded


def bucket_ablation(config: dict, traces_dir: Path, progress: bool = True) -> pd.DataFrame:
    from tqdm import tqdm

    settings = config["ablations"]["buckets"]
    S = int(settings["splits"])
    rows: list[dict] = []
    loaded = _load(config, settings["traces"], traces_dir)
    planner = config["planner"]
    spec = configuration.spec(config)
    for trace, entry in tqdm(loaded, desc="ablation buckets", unit="trace", disable=not progress):
        variants = ([buckets_variant(S)]
                    + [padded_buckets_variant(S, int(T)) for T in settings["bucket_tokens"]]
                    + [workqueue_variant(int(planner["target_items"]), int(planner["min_chunk_tiles"])),
                       split_variant(int(entry["splits"]))])
        labels = ["exact"] + [f"padded_{int(T)}" for T in settings["bucket_tokens"]] + ["workqueue", "split_rect"]
        for step in trace.steps:
            rows.extend(step_rows(trace, step, spec, variants, label_column="variant", labels=labels))
    return to_frame(rows, BUCKET_COLUMNS)


def split_ablation(config: dict, traces_dir: Path, progress: bool = True) -> pd.DataFrame:
    from tqdm import tqdm

    settings = config["ablations"]["splits"]
    planner = config["planner"]
    spec = configuration.spec(config)
    variants = [workqueue_variant(int(planner["target_items"]), int(planner["min_chunk_tiles"]))]
    for S in settings["values"]:
        variants += [split_variant(int(S)), buckets_variant(int(S)), workqueue_fixed_variant(int(S))]
    rows: list[dict] = []
    for trace, _ in tqdm(_load(config, settings["traces"], traces_dir), desc="ablation splits", unit="trace",
                         disable=not progress):
        for step in trace.steps:
            rows.extend(step_rows(trace, step, spec, variants))
    return to_frame(rows, SPLIT_COLUMNS)


def run(args: argparse.Namespace) -> int:
    config = configuration.load_config(args.config)
    if args.figure is not None:
        require(args.figure.suffix.lstrip(".") in FIGURE_FORMATS,
                f"--figure {args.figure}: the extension must be one of {', '.join('.' + f for f in FIGURE_FORMATS)}")
    ablation = bucket_ablation if args.kind == "buckets" else split_ablation
    frame = ablation(config, args.traces_dir, progress=not args.no_progress)
    if args.figure is not None:
        from ..render import figures  # matplotlib and seaborn load only when a figure is asked for

        draw = figures.fig_bucket_ablation if args.kind == "buckets" else figures.fig_split_ablation
        figures.save(draw(frame), args.figure)
    atomic_write_parquet(args.out, frame)
    print(f"{args.out}: {len(frame)} rows" + (f"; {args.figure}" if args.figure is not None else ""))
    return 0
