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
from ..io import atomic_path, atomic_write_parquet
from ..traces import read_trace

IDENTITY = ("trace", "seed", "step", "batch_size", "max_len", "total_tokens")
BUCKET_COLUMNS = IDENTITY + ("variant", "route", "num_splits", "bucket_tokens") + COUNTER_COLUMNS
SPLIT_COLUMNS = IDENTITY + ("route", "num_splits", "bucket_tokens") + COUNTER_COLUMNS
MIB = 2**20


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


def _save(fig, path: Path) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=path.suffix.lstrip(".") or "svg", bbox_inches="tight")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server or in CI
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="paper")
    return plt, sns


def bucket_figure(frame: pd.DataFrame, path: Path) -> None:
    """Three panels, bars per trace and variant (median over steps; whiskers span the
    25-75% range): launches per step, KV read past the real lengths (% of useful KV), and the
    paper-formula merge state per step (MiB, log)."""
    plt, sns = _pyplot()
    data = frame.assign(padded_pct=100.0 * frame["padded_kv_bytes"] / frame["useful_kv_bytes"],
                        merge_mib=frame["paper_merge_state_bytes"] / MIB)
    panels = [("launches", "launches per step", False),
              ("padded_pct", "KV read past real lengths\n(% of useful KV)", False),
              ("merge_mib", "merge state per step,\npaper formula (MiB, log)", True)]
    order = list(dict.fromkeys(data["variant"]))
    traces = list(dict.fromkeys(data["trace"]))
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(7.0, 1.6 * len(traces)), 2.6 * len(panels)),
                             sharex=True, layout="constrained")
    for ax, (column, label, log) in zip(axes, panels):
        plot = data[data[column] > 0] if log else data  # zero has no place on a log axis
        sns.barplot(data=plot, x="trace", y=column, hue="variant", hue_order=order, order=traces,
                    estimator="median", errorbar=("pi", 50), ax=ax, legend=ax is axes[0])
        ax.set_ylabel(label)
        ax.set_xlabel("")
        if log:
            ax.set_yscale("log")
    handles, labels = axes[0].get_legend_handles_labels()
    axes[0].get_legend().remove()
    fig.legend(handles, labels, title="variant", ncols=min(len(order), 6), loc="outside lower center")
    seed = int(frame["seed"].iloc[0])
    axes[-1].set_xlabel(f"trace (every step, seed {seed})")
    S = int(frame.loc[frame["variant"] == "exact", "num_splits"].iloc[0])
    fig.suptitle(f"Bucketing ablation: exact and padded buckets (S={S} per bucket), balanced work queue, "
                 "published rectangle (trace's S)")
    _save(fig, path)
    plt.close(fig)


def split_figure(frame: pd.DataFrame, path: Path) -> None:
    """Per trace (columns), median over steps against S, one line per route (the
    balanced work queue, which has no S, as a dashed level): launches, and on log axes decode
    CTAs, KV bytes per decode CTA and merge-state bytes."""
    plt, sns = _pyplot()
    data = frame.assign(kib_per_cta=frame["useful_kv_bytes"] / frame["nonempty_items"] / 1024,
                        merge_mib=frame["merge_state_bytes"] / MIB)
    metrics = [("launches", "launches per step", False),
               ("decode_ctas", "decode CTAs per step (log)", True),
               ("kib_per_cta", "KV per decode CTA (KiB, log)", True),
               ("merge_mib", "merge state per step (MiB, log)", True)]
    traces = list(dict.fromkeys(data["trace"]))
    routes = ["split", "buckets", "workqueue_fixed"]
    fixed = data[data["num_splits"] > 0]
    balanced = data[data["num_splits"] < 0]
    medians = fixed.groupby(["trace", "route", "num_splits"], as_index=False)[[m for m, _, _ in metrics]].median()
    fig, axes = plt.subplots(len(metrics), len(traces), figsize=(3.0 * len(traces), 2.4 * len(metrics)),
                             sharex=True, squeeze=False, layout="constrained")
    for col, trace in enumerate(traces):
        for row, (column, label, log) in enumerate(metrics):
            ax = axes[row][col]
            # S=1 writes no merge state: log axes drop the zero.
            points = medians[(medians["trace"] == trace) & (medians[column] > 0)]
            sns.lineplot(data=points, x="num_splits", y=column, hue="route", style="route", hue_order=routes,
                         style_order=routes, markers=True, dashes=False, ax=ax, legend=row == 0 and col == 0)
            level = balanced.loc[balanced["trace"] == trace, column].median()
            if pd.notna(level) and level > 0:
                ax.axhline(level, color="0.3", linestyle="--", linewidth=1, label="workqueue (balanced)")
            ax.set_xscale("log", base=2)
            if log:
                ax.set_yscale("log")
            else:
                ax.set_ylim(bottom=0)
            ax.set_title(trace if row == 0 else "")
            ax.set_xlabel("splits per row S (log2)" if row == len(metrics) - 1 else "")
            ax.set_ylabel(label if col == 0 else "")
    handles, labels = axes[0][0].get_legend_handles_labels()
    if axes[0][0].get_legend() is not None:
        axes[0][0].get_legend().remove()
    fig.legend(handles, labels, ncols=len(labels), loc="outside lower center")
    fig.suptitle(f"Split-count ablation (median over every step, seed {int(frame['seed'].iloc[0])})")
    _save(fig, path)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    config = configuration.load_config(args.config)
    if args.figure is not None:
        require(args.figure.suffix in (".svg", ".png", ".pdf"),
                f"--figure {args.figure}: the extension must be .svg, .png or .pdf")
    if args.kind == "buckets":
        frame = bucket_ablation(config, args.traces_dir, progress=not args.no_progress)
        draw = bucket_figure
    else:
        frame = split_ablation(config, args.traces_dir, progress=not args.no_progress)
        draw = split_figure
    if args.figure is not None:
        draw(frame, args.figure)
    atomic_write_parquet(args.out, frame)
    print(f"{args.out}: {len(frame)} rows" + (f"; {args.figure}" if args.figure is not None else ""))
    return 0
