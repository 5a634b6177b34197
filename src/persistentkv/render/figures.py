"""Seaborn figures: SVG for the HTML report, PDF for the paper, one style throughout.

Each ``fig_*`` function takes tidy frames and returns a matplotlib :class:`Figure` (no pyplot
state); each ``data_*`` function derives those frames from :class:`Results`. A figure whose rows
are absent renders as a placeholder that says "not measured on <hw> yet", never as an empty or
invented plot. :func:`render_all` writes every figure of :data:`FIGURES` atomically; the
ablation command writes its two (:func:`fig_bucket_ablation`, :func:`fig_split_ablation`)
through the same :func:`save`.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import matplotlib

matplotlib.use("Agg", force=False)   # headless: the renderers never open a window

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from .. import analysis, claims, targets
from ..errors import PKVError, require
from ..io import atomic_path
from ..names import BASELINES, EQUAL_ROWS, FLASHINFER, FLOOR_BACKEND, FP8_KV
from ..results import Results
from . import FIGURE_FORMATS
from . import FIGURE_NAMES as _NAMES

WIDTH = 6.8     # inches: the paper's text width and a comfortable report width
#: One colour per backend in every figure (colour-blind-safe base palette).
BACKEND_ORDER = ("pkv-workqueue", "pkv-buckets", "pkv-split", "adaptive", "flashinfer-tc", "flashinfer-cc",
                 "vllm-fa3", "trtllm-xqa", "torch-sdpa", "flashinfer-cudnn")
_PALETTE = sns.color_palette("colorblind", 10)
#: Ours in blues/greens, FlashInfer in oranges/browns, other baselines purple/grey/yellow.
BACKEND_COLORS = {b: _PALETTE[i] for b, i in zip(BACKEND_ORDER, (0, 2, 9, 3, 1, 5, 4, 7, 8, 6))}
PROTOCOL_LABELS = {"published": "published protocol (CUDA events)",
                   "step": "fair protocol (step: plan + L layers)"}
#: Tick values offered on ratio axes (log scale): readable numbers rather than powers of ten.
RATIO_TICKS = (0.1, 0.2, 0.3, 0.5, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2, 3, 4, 5, 7, 10, 20, 30, 50)
#: A ratio axis shows at most this many ticks, spread evenly in log space (see ratio_ticks).
RATIO_TICK_COUNT = 7


@contextlib.contextmanager
def style():
    """The house style, scoped: nothing leaks into the caller's matplotlib state."""
    rc = {"svg.fonttype": "none", "svg.hashsalt": "persistentkv", "pdf.fonttype": 42,
          "axes.spines.top": False, "axes.spines.right": False, "axes.titlesize": 9,
          "axes.labelsize": 8.5, "xtick.labelsize": 7.5, "ytick.labelsize": 7.5, "legend.fontsize": 7.5,
          "legend.title_fontsize": 8, "font.family": "DejaVu Sans", "grid.linewidth": 0.5}
    with sns.axes_style("whitegrid"), sns.plotting_context("paper"), matplotlib.rc_context(rc):
        yield


def color(backend: str):
    base = backend.split("/")[0]
    return BACKEND_COLORS.get(base, (0.4, 0.4, 0.4))


def _order(names) -> list[str]:
    names = list(dict.fromkeys(names))
    rank = {b: i for i, b in enumerate(BACKEND_ORDER)}
    return sorted(names, key=lambda b: (rank.get(b.split("/")[0], 99), b))


def placeholder(title: str, message: str, height: float = 1.6) -> Figure:
    """A figure that states what is missing (used wherever the rows are absent)."""
    with style():
        fig = Figure(figsize=(WIDTH, height), layout="constrained")
        ax = fig.subplots()
        ax.set_axis_off()
        ax.text(0.5, 0.62, title, ha="center", va="center", fontsize=10, weight="bold", transform=ax.transAxes)
        ax.text(0.5, 0.32, message, ha="center", va="center", fontsize=9, color="#b03030", transform=ax.transAxes)
    return fig


def not_measured(hw: str, what: str) -> str:
    return f"{what}: not measured on {hw} yet"


def ratio_ticks(lo: float, hi: float, count: int = RATIO_TICK_COUNT) -> list[float]:
    """The RATIO_TICKS inside [lo, hi] that keep at least 1/count of the axis's log span apart,
    chosen outwards from the one nearest 1 (1 itself when in range), so labels never crowd: from
    0.07 to 30 (2.6 decades) they are 0.1, 0.3, 1, 3, 10, 30; from 0.8 to 1.6, 0.8, 0.9, 1, 1.25, 1.5."""
    inside = [t for t in RATIO_TICKS if lo <= t <= hi]
    if not inside:
        return []
    gap = (math.log10(hi) - math.log10(lo)) / count
    start = min(inside, key=lambda t: abs(math.log10(t)))
    keep = [start]
    for side in (sorted(t for t in inside if t > start), sorted((t for t in inside if t < start), reverse=True)):
        last = start
        for t in side:
            if abs(math.log10(t) - math.log10(last)) >= gap:
                keep.append(t)
                last = t
    return sorted(keep)


def ratio_axis(ax) -> None:
    """Log-scaled ratio axis with plain tick labels (0.8, 1, 1.25, ...) inside the data range."""
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(matplotlib.ticker.FixedLocator(ratio_ticks(*ax.get_ylim())))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())


def _decimal(v: float, _=None) -> str:
    """A log tick's label: plain below 1e4 and above 1e-2 (0.05, 20, 500), else short scientific (2e-4)."""
    if 1e-2 <= abs(v) < 1e4:
        return f"{v:g}"
    mantissa, exponent = f"{v:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def log_axis(ax, axis: str = "x") -> None:
    """Log axis labelled only at 1, 2, 5 x 10^k when it spans under two decades (at 10^k when more),
    with minor ticks unlabelled: matplotlib labels minor ticks on short log axes, and their labels
    (2x10^-4, 3x10^-4, 4x10^-4 ...) run into each other."""
    getattr(ax, f"set_{axis}scale")("log")
    lo, hi = sorted(getattr(ax, f"get_{axis}lim")())
    subs = (1.0, 2.0, 5.0) if math.log10(hi / lo) < 2 else (1.0,)
    target = getattr(ax, f"{axis}axis")
    target.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=subs))
    target.set_major_formatter(matplotlib.ticker.FuncFormatter(_decimal))
    target.set_minor_formatter(matplotlib.ticker.NullFormatter())


def pow2_axis(ax, axis: str = "x", tokens: bool = False) -> None:
    """Log2 axis labelled 1, 2, 4 ... (or 4K, 32K ... for token counts)."""
    getattr(ax, f"set_{axis}scale")("log", base=2)
    fmt = (lambda v, _: f"{v / 1024:g}K" if v >= 1024 else f"{v:g}") if tokens else (lambda v, _: f"{v:g}")
    getattr(ax, f"{axis}axis").set_major_formatter(matplotlib.ticker.FuncFormatter(fmt))


def _dodged(ax, frame: pd.DataFrame, x: str, order: list, hue: str, hue_order: list, y="ratio",
            lo="lo", hi="hi", width: float = 0.7, marker="o", label=True) -> None:
    """Points with precomputed interval bars, dodged by ``hue`` within each ``x`` category."""
    n = max(len(hue_order), 1)
    step = width / n
    for j, h in enumerate(hue_order):
        part = frame[frame[hue] == h]
        if part.empty:
            continue
        xs = np.array([order.index(v) for v in part[x]]) - width / 2 + step * (j + 0.5)
        yv = part[y].to_numpy(float)
        err = np.vstack([yv - part[lo].to_numpy(float), part[hi].to_numpy(float) - yv])
        ax.errorbar(xs, yv, yerr=np.where(np.isfinite(err), err, 0), fmt=marker, ms=4, lw=1.1, capsize=2,
                    color=color(h), label=h if label else None)
    ax.set_xticks(range(len(order)), order)


# ---------------------------------------------------------------------------------------------
# 1. Throughput ratio vs best FlashInfer per trace, both protocols

def data_trace_ratios(results: Results) -> pd.DataFrame:
    """Per (protocol, trace, backend): geometric mean over holdout seeds of the speedup over the
    faster FlashInfer, published experiment. Columns: protocol, trace, backend, ratio, lo, hi, seeds."""
    out = []
    for protocol in PROTOCOL_LABELS:
        cells = results.cells("published", protocol)
        per = analysis.ratios(cells, claims.REFERENCE)
        per = per[~per["backend"].isin(FLASHINFER)]
        if per.empty:
            continue
        g = analysis.geomean(per, by=["trace", "backend"])
        g["protocol"] = protocol
        out.append(g.drop(columns="boot").rename(columns={"n_rows": "seeds"}))
    return pd.concat(out, ignore_index=True) if out else pd.DataFrame(
        columns=["protocol", "trace", "backend", "ratio", "lo", "hi", "seeds"])


def fig_trace_ratios(frame: pd.DataFrame, hw: str) -> Figure:
    title = "Speedup over the faster FlashInfer, per trace"
    if frame.empty:
        return placeholder(title, not_measured(hw, "published-trace timings"))
    traces = [r.trace for r in claims.PUBLISHED_ROWS if r.trace in set(frame["trace"])]
    traces += sorted(set(frame["trace"]) - set(traces))
    backends = _order(frame["backend"])
    with style():
        fig = Figure(figsize=(WIDTH, 3.0), layout="constrained")
        axes = fig.subplots(1, 2, sharey=True)
        for ax, protocol in zip(axes, PROTOCOL_LABELS):
            part = frame[frame["protocol"] == protocol]
            ax.axhline(1.0, color="0.3", lw=0.8, ls="--")
            ax.set_title(PROTOCOL_LABELS[protocol])
            if part.empty:
                ax.text(0.5, 0.5, f"not measured on {hw} yet", transform=ax.transAxes, ha="center",
                        color="#b03030")
                ax.set_xticks(range(len(traces)), traces)
            else:
                _dodged(ax, part, "trace", traces, "backend", backends, label=protocol == "step" or
                        frame[frame["protocol"] == "step"].empty)
            if protocol == "published":
                pts = [(traces.index(r.trace), r.event) for r in claims.PUBLISHED_ROWS if r.trace in traces]
                if pts:
                    ax.scatter(*zip(*pts), marker="x", color="black", s=28, zorder=5,
                               label=f"paper ({claims.PAPER_GPU})")
            ax.tick_params(axis="x", rotation=25)
            ax.set_xlabel("")
        axes[0].set_ylabel("speedup vs faster FlashInfer (×)")
        ratio_axis(axes[0])
        handles, labels = [], []
        for ax in axes:
            for h, l in zip(*ax.get_legend_handles_labels()):
                if l not in labels:
                    handles.append(h)
                    labels.append(l)
        fig.legend(handles, labels, loc="outside right center", frameon=False)
    return fig


# ---------------------------------------------------------------------------------------------
# 2. Fraction of the read ceiling vs KV bytes per step

def data_ceiling(results: Results) -> pd.DataFrame:
    """Kernel rows (device time per call) of every experiment: median fraction of the read ceiling
    per (trace, backend, kv_bytes)."""
    timing = results.timing
    if timing.empty:
        return pd.DataFrame()
    rows = timing[timing["protocol"] == "kernel"]
    # The synthetic grids (equal-length rows) place each point cleanly; trace steps only where
    # no grid was measured, so the figure never goes blank while kernel rows exist.
    grid = rows[rows["experiment"].isin(["bench_kernels", "long_context", "batch_sweep"])]
    return analysis.ceiling_fraction(grid if not grid.empty else rows)


def fig_ceiling(frame: pd.DataFrame, hw: str) -> Figure:
    title = "Fraction of the measured read ceiling"
    if frame.empty:
        return placeholder(title, not_measured(hw, "kernel timings"))
    with style():
        fig = Figure(figsize=(WIDTH, 3.0), layout="constrained")
        ax = fig.subplots()
        for b in _order(frame["backend"]):
            part = frame[frame["backend"] == b].sort_values("kv_bytes")
            x = part["kv_bytes"].to_numpy(float) / 1e6
            y = part["frac"].to_numpy(float)
            err = np.vstack([y - part["lo"].to_numpy(float), part["hi"].to_numpy(float) - y])
            ax.errorbar(x, y, yerr=err, fmt="o", ms=3.5, lw=0.9, capsize=1.5, color=color(b), label=b, alpha=0.85)
        ax.axhline(1.0, color="0.3", lw=0.8, ls="--")
        log_axis(ax, "x")
        ax.set_xlabel("KV bytes read per step and layer (MB, log scale)")
        ax.set_ylabel("fraction of read ceiling")
        ax.set_ylim(0, max(1.05, float(np.nanmax(frame["hi"])) * 1.05))
        ax.set_title(title)
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    return fig


# ---------------------------------------------------------------------------------------------
# 3. Launch fan-out and merge traffic (counters)

def fig_fanout_merge(ablation: pd.DataFrame, hw: str) -> Figure:
    title = "Launch fan-out and merge-state traffic per step (planner counters)"
    need = {"trace", "variant", "launches", "paper_merge_state_bytes"}
    if ablation.empty or not need <= set(ablation.columns):
        return placeholder(title, "bucket ablation counters not computed yet (results/counters/ablation_buckets.parquet)")
    frame = ablation.copy()
    frame["merge MB"] = frame["paper_merge_state_bytes"] / 1e6
    def rank(v: str):
        size = v.split("_")[-1]
        return (v != "exact", not v.startswith("padded"), v != "split_rect",
                int(size) if size.isdigit() else 0, v)

    variants = sorted(frame["variant"].unique(), key=rank)
    traces = [r.trace for r in claims.PUBLISHED_ROWS if r.trace in set(frame["trace"])]
    traces += sorted(set(frame["trace"]) - set(traces))
    with style():
        fig = Figure(figsize=(WIDTH, 2.8), layout="constrained")
        axes = fig.subplots(1, 2)
        pal = dict(zip(variants, sns.color_palette("crest", len(variants))))
        if "workqueue" in pal:
            pal["workqueue"] = BACKEND_COLORS["pkv-workqueue"]
        for ax, col, label in ((axes[0], "launches", "launches per step"), (axes[1], "merge MB", "merge state, MB per step")):
            sns.barplot(frame, x="trace", y=col, hue="variant", order=traces, hue_order=variants, ax=ax,
                        estimator="median", errorbar=("pi", 100), palette=pal, err_kws={"linewidth": 0.8},
                        legend=ax is axes[1])
            ax.set_xlabel("")
            ax.set_ylabel(label)
            ax.tick_params(axis="x", rotation=25)
        log_axis(axes[0], "y")
        axes[1].legend(title="plan", loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
        fig.suptitle("median over steps, bars span min to max; merge bytes use the paper's (D+2)-float count",
                     fontsize=7.5, color="0.35")
    return fig


# ---------------------------------------------------------------------------------------------
# 4. Split sensitivity

def data_split_times(results: Results) -> pd.DataFrame:
    """Measured split_sensitivity rows: per (trace, route, num_splits) the speed of that S relative
    to the route's fastest S in the same cell (<= 1; fair step protocol, else kernel), geometric
    mean over holdout seeds. The sweep times only our split routes, so each route is its own
    reference: the figure says how much a wrong S costs, not how S compares with FlashInfer."""
    for protocol in ("step", "kernel"):
        cells = results.cells("split_sensitivity", protocol)
        parts = []
        for cell in cells:
            labels = [b for b in cell.backends if b.startswith("pkv") and "/S" in b]
            for route in sorted({b.split("/")[0] for b in labels}):
                mine = [b for b in labels if b.split("/")[0] == route]
                best = min(mine, key=lambda b: cell.time(b)[0])
                per = analysis.ratios([cell], best, backends=mine)
                per["route"] = route
                parts.append(per)
        per = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
        if per.empty:
            continue
        per["num_splits"] = per["backend"].str.extract(r"/S(\d+)$")[0].astype(float)
        g = analysis.geomean(per.dropna(subset=["num_splits"]), by=["trace", "route", "num_splits"])
        g["protocol"] = protocol
        return g.drop(columns="boot")
    return pd.DataFrame()


def fig_split_sensitivity(times: pd.DataFrame, splits: pd.DataFrame, hw: str) -> Figure:
    title = "Split sensitivity"
    have_counts = not splits.empty and {"num_splits", "merge_state_bytes", "route", "trace"} <= set(splits.columns)
    if times.empty and not have_counts:
        return placeholder(title, not_measured(hw, "split sensitivity") + "; split counters not computed yet")
    with style():
        fig = Figure(figsize=(WIDTH, 2.8), layout="constrained")
        axes = fig.subplots(1, 2)
        ax = axes[0]
        if times.empty:
            ax.text(0.5, 0.5, f"timings: not measured on {hw} yet", ha="center", va="center",
                    transform=ax.transAxes, color="#b03030")
            ax.set_axis_off()
        else:
            for (trace, route), part in times.groupby(["trace", "route"]):
                part = part.sort_values("num_splits")
                y = part["ratio"].to_numpy(float)
                ax.errorbar(part["num_splits"], y, yerr=[y - part["lo"], part["hi"] - y], marker="o", ms=3,
                            lw=1, capsize=1.5, label=f"{trace} ({route})")
            ax.axhline(1.0, color="0.3", lw=0.8, ls="--")
            pow2_axis(ax)
            ratio_axis(ax)
            ax.set_xlabel("splits S")
            ax.set_ylabel("speed vs the route's best S (×)")
            ax.set_title(f"measured ({times['protocol'].iloc[0]} rows, holdout seeds)")
            ax.legend(frameon=False, fontsize=6.5)
        ax = axes[1]
        if not have_counts:
            ax.text(0.5, 0.5, "split counters not computed yet", ha="center", va="center", transform=ax.transAxes,
                    color="#b03030")
            ax.set_axis_off()
        else:
            part = splits[splits["route"] == "split"] if (splits["route"] == "split").any() else splits
            agg = part.groupby(["trace", "num_splits"], as_index=False)["merge_state_bytes"].mean()
            agg["merge MB"] = agg["merge_state_bytes"] / 1e6
            agg = agg[agg["merge MB"] > 0]        # S = 1 writes no merge state: nothing to draw on a log axis
            sns.lineplot(agg, x="num_splits", y="merge MB", hue="trace", marker="o", ax=ax, markersize=4)
            pow2_axis(ax)
            log_axis(ax, "y")
            ax.set_xlabel("splits S")
            ax.set_ylabel("merge state, MB per step (mean)")
            ax.set_title("planner counters (rectangular split)")
            ax.legend(frameon=False, fontsize=6.5)
    return fig


# ---------------------------------------------------------------------------------------------
# 5. Batch-size sweep

def data_batch_sweep(results: Results) -> pd.DataFrame:
    """Speedup over the faster FlashInfer per (length, batch size, backend) for batch_sweep rows
    (kernel protocol; step rows where no kernel rows exist)."""
    rows = results.experiment("batch_sweep")
    if rows.empty:
        return pd.DataFrame()
    protocol = "kernel" if (rows["protocol"] == "kernel").any() else "step"
    rows = rows[rows["protocol"] == protocol]
    per = analysis.ratios(results.cells("batch_sweep", protocol, holdout=False), claims.REFERENCE)
    per = per[~per["backend"].isin(FLASHINFER)]
    if per.empty:
        return pd.DataFrame()
    shape = rows.drop_duplicates("trace").set_index("trace")[["batch_size", "max_len"]]
    per = per.join(shape, on="trace")
    per["protocol"] = protocol
    return per.drop(columns="boot")


def fig_batch_sweep(frame: pd.DataFrame, hw: str) -> Figure:
    title = "Batch-size sweep"
    if frame.empty:
        return placeholder(title, not_measured(hw, "batch-size sweep"))
    lengths = sorted(frame["max_len"].unique())
    ncol = min(3, len(lengths))
    nrow = math.ceil(len(lengths) / ncol)
    with style():
        fig = Figure(figsize=(WIDTH, 1.1 + 1.9 * nrow), layout="constrained")
        axes = np.atleast_1d(fig.subplots(nrow, ncol, sharey=True, squeeze=False)).ravel()
        for ax, n in zip(axes, lengths):
            part = frame[frame["max_len"] == n]
            for b in _order(part["backend"]):
                p = part[part["backend"] == b].sort_values("batch_size")
                y = p["ratio"].to_numpy(float)
                ax.errorbar(p["batch_size"], y, yerr=[y - p["lo"], p["hi"] - y], marker="o", ms=3, lw=1,
                            capsize=1.5, color=color(b), label=b)
            ax.axhline(1.0, color="0.3", lw=0.8, ls="--")
            pow2_axis(ax)
            n = int(n)
            ax.set_title(f"{n / 1024:g}K tokens per row" if n >= 1024 else f"{n} tokens per row")
            ax.set_xlabel("batch size B")
        for ax in axes[len(lengths):]:
            ax.set_axis_off()
        ratio_axis(axes[0])                # shared y: once, after every panel has set its limits
        axes[0].set_ylabel("speedup vs faster FlashInfer (×)")
        handles, labels = axes[0].get_legend_handles_labels()
        for ax in axes[1:]:
            for h, l in zip(*ax.get_legend_handles_labels()):
                if l not in labels:
                    handles.append(h)
                    labels.append(l)
        fig.legend(handles, labels, loc="outside right center", frameon=False)
        fig.suptitle(f"{frame['protocol'].iloc[0]} protocol; geometric scale", fontsize=7.5, color="0.35")
    return fig


# ---------------------------------------------------------------------------------------------
# 6. Policy decisions

def data_policy(results: Results) -> pd.DataFrame:
    """One row per step the adaptive backend ran: experiment, trace, seed, step, batch_size,
    max_len, route (the delegate it chose)."""
    timing = results.timing
    if timing.empty or "route" not in timing.columns:
        return pd.DataFrame()
    rows = timing[(timing["backend"] == "adaptive") & (timing["status"] == "ok")]
    if rows.empty:
        return pd.DataFrame()
    cols = ["experiment", "trace", "seed", "step", "batch_size", "max_len", "route"]
    return rows.drop_duplicates(["experiment", "trace", "seed", "step", "num_qo_heads", "hole_fraction"])[cols]


def fig_policy(frame: pd.DataFrame, hw: str) -> Figure:
    title = "Adaptive policy: the route chosen per step"
    if frame.empty:
        return placeholder(title, not_measured(hw, "adaptive-backend runs"))
    rng = np.random.default_rng(0)   # jitter only separates overlapping markers; fixed for byte-stable output
    with style():
        fig = Figure(figsize=(WIDTH, 2.9), layout="constrained")
        ax = fig.subplots()
        for route in _order(frame["route"]):
            part = frame[frame["route"] == route]
            jitter = np.exp(rng.uniform(-0.08, 0.08, len(part)))
            ax.scatter(part["max_len"], part["batch_size"] * jitter, s=12, alpha=0.7, color=color(route),
                       label=f"{route} ({len(part)})", edgecolors="none")
        pow2_axis(ax, "x", tokens=True)
        pow2_axis(ax, "y")
        ax.set_xlabel("N_max: longest row of the step (tokens)")
        ax.set_ylabel("batch size B")
        ax.set_title(title)
        ax.legend(title="route (steps)", loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    return fig


# ---------------------------------------------------------------------------------------------
# 7. Validation status per backend

#: The cache dtype of the CPU validation's rows (validate-cpu runs the NumPy executor on float16
#: caches) where its file predates a dtype column.
CPU_VALIDATION_DTYPE = "float16"
#: The order of the validation figure's panels, one per cache dtype (others follow by name).
DTYPE_ORDER = ("float16", "bfloat16")
#: The validation metric the gates judge, and its label: the worst (row, query head) error.
GATED_ERROR = "max_row_head_err"
GATED_LABEL = "worst (row, head) ‖out − ref‖ / ‖ref‖"


def data_validation(results: Results) -> pd.DataFrame:
    """GPU validation rows plus CPU (NumPy executor) rows as backend ``cpu:<route>``.
    Columns: backend, dtype, rel_err, max_row_head_err, err, whole_batch, rtol, passed, status,
    reason, source. ``err`` is the gated metric, max_row_head_err; a row written before that
    column existed falls back to its whole-batch rel_err there, with ``whole_batch`` True."""
    parts = []
    v = results.validation_gpu
    if not v.empty:
        p = v.copy()
        p["source"] = "gpu"
        parts.append(p)
    c = results.validation_cpu
    if not c.empty:
        p = c.copy()
        p["backend"] = "cpu:" + p["route"].astype(str)
        p["source"] = "cpu"
        p["status"] = p.get("status", "ok")
        p["reason"] = p.get("reason", "")
        p["dtype"] = p.get("dtype", CPU_VALIDATION_DTYPE)
        parts.append(p)
    if not parts:
        return pd.DataFrame()
    frame = pd.concat(parts, ignore_index=True)
    for col, default in (("status", "ok"), ("reason", ""), ("rtol", np.nan), ("passed", False), ("dtype", ""),
                         (GATED_ERROR, np.nan)):
        if col not in frame.columns:
            frame[col] = default
    frame["dtype"] = frame["dtype"].fillna("").astype(str)
    gated = pd.to_numeric(frame[GATED_ERROR], errors="coerce")
    whole = pd.to_numeric(frame["rel_err"], errors="coerce")
    frame["whole_batch"] = gated.isna() & whole.notna()
    frame["err"] = gated.where(~frame["whole_batch"], whole)
    return frame[["backend", "dtype", "rel_err", GATED_ERROR, "err", "whole_batch", "rtol", "passed", "status",
                  "reason", "source"]]


def dtype_order(dtypes) -> list[str]:
    """The cache dtypes present, in DTYPE_ORDER (others after them, by name)."""
    present = set(dtypes)
    return [d for d in DTYPE_ORDER if d in present] + sorted(present - set(DTYPE_ORDER))


def fig_validation(frame: pd.DataFrame, hw: str) -> Figure:
    title = "Validation against the float64 reference"
    if frame.empty:
        return placeholder(title, not_measured(hw, "validation"))
    backends = _order(frame["backend"])
    dtypes = dtype_order(frame["dtype"])
    ok = frame[(frame["status"] == "ok") & np.isfinite(pd.to_numeric(frame["err"], errors="coerce"))]
    floor = 1e-8
    with style():
        fig = Figure(figsize=(WIDTH, 1.2 + 0.26 * len(backends)), layout="constrained")
        axes = np.atleast_1d(fig.subplots(1, len(dtypes), sharey=True, squeeze=False)).ravel()
        for ax, dtype in zip(axes, dtypes):
            mine = ok[ok["dtype"] == dtype]
            for i, b in enumerate(backends):
                part = mine[mine["backend"] == b]
                if part.empty:
                    bad = frame[(frame["backend"] == b) & (frame["dtype"] == dtype) & (frame["status"] != "ok")]
                    if not bad.empty:
                        ax.text(0.98, i, f"{bad['status'].iloc[0]}", transform=ax.get_yaxis_transform(),
                                ha="right", va="center", fontsize=7, color="#b03030")
                    continue
                y = i + np.linspace(-0.18, 0.18, len(part)) if len(part) > 1 else np.array([i])
                passed = part["passed"].astype(bool).to_numpy()
                whole = part["whole_batch"].astype(bool).to_numpy()
                err = np.maximum(part["err"].to_numpy(float), floor)
                gated = passed & ~whole
                ax.scatter(err[gated], y[gated], s=10, color=color(b), alpha=0.8, edgecolors="none")
                ax.scatter(err[passed & whole], y[passed & whole], s=12, facecolors="none", edgecolors=color(b),
                           linewidths=0.8)
                ax.scatter(err[~passed], y[~passed], s=22, marker="x", color="#c0392b")
                rtol = pd.to_numeric(part["rtol"], errors="coerce").dropna()
                if not rtol.empty:
                    ax.plot([rtol.max()] * 2, [i - 0.35, i + 0.35], color="0.2", lw=1.2)
            tolerances = sorted(set(pd.to_numeric(mine["rtol"], errors="coerce").dropna()))
            label = ", ".join(f"{t:g}" for t in tolerances) if tolerances else "none recorded"
            ax.set_title(f"{dtype or 'dtype not recorded'} (tolerance {label})")
            log_axis(ax, "x")
            ax.set_xlabel(f"{GATED_LABEL} (log)")
        axes[0].set_yticks(range(len(backends)), backends)
        axes[0].set_ylim(len(backends) - 0.5, -0.5)
        older = "\n○ = whole-batch ‖out − ref‖ / ‖ref‖ (a row from before the per-(row, head) gate)" \
            if ok["whole_batch"].astype(bool).any() else ""
        fig.suptitle(f"{title}\n{GATED_LABEL}; bar = the dtype's tolerance; × = failed{older}", fontsize=9)
    return fig


# ---------------------------------------------------------------------------------------------
# 8. The engine against its targets: the bench_kernels grid, and run()'s host cost

def data_engine_grid(results: Results) -> pd.DataFrame:
    """bench_kernels' equal-length cases (traces ``B{b}xN{n}``): targets.ENGINE_BACKEND's speedup
    over the fastest baseline (kernel protocol, 95 % bootstrap interval) and the mid-range target
    of the cell where the engine issue sets one. Columns: batch_size, tokens, ratio, lo, hi,
    baseline, target (NaN where none)."""
    cells = [c for c in results.cells("bench_kernels", "kernel", holdout=False)
             if targets.ENGINE_BACKEND in c.point]
    per = analysis.ratios(cells, "baseline-best", backends=[targets.ENGINE_BACKEND])
    out = []
    for r in per.itertuples():
        m = EQUAL_ROWS.match(str(r.trace))
        if m is None:  # ragged cases (B8-ragged, B8-bimodal) have no place in the grid
            continue
        b, n = int(m.group(1)), int(m.group(2))
        out.append({"batch_size": b, "tokens": n, "ratio": float(r.ratio), "lo": float(r.lo), "hi": float(r.hi),
                    "baseline": str(r.ref_backend), "target": targets.ENGINE_MID_RANGE.get((b, n), np.nan)})
    return pd.DataFrame(out, columns=["batch_size", "tokens", "ratio", "lo", "hi", "baseline", "target"])


def data_engine_host(results: Results) -> pd.DataFrame:
    """bench_kernels' eager rows: the per-case median host time per run() call of the back-to-back
    loop (host_loop_us) of every backend (targets.eager_case_medians). Columns: backend, trace,
    host_loop_us (empty for runs made before the column existed)."""
    return targets.eager_case_medians(results.bench, "host_loop_us").rename("host_loop_us").reset_index()


def fig_engine(grid: pd.DataFrame, host: pd.DataFrame, hw: str) -> Figure:
    title = f"{targets.ENGINE_BACKEND} against the fastest baseline, and run()'s host cost"
    if grid.empty and host.empty:
        return placeholder(title, not_measured(hw, "bench_kernels"))
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.patches import Rectangle

    with style():
        fig = Figure(figsize=(WIDTH, 3.3), layout="constrained")
        left, right = fig.subplots(1, 2, width_ratios=(1.45, 1))
        if grid.empty:
            left.set_axis_off()
            left.text(0.5, 0.5, not_measured(hw, "kernel rows"), ha="center", va="center", color="#b03030",
                      fontsize=8, transform=left.transAxes)
        else:
            table = grid.pivot_table(index="batch_size", columns="tokens", values="ratio")
            lo, hi = float(np.nanmin(table.to_numpy())), float(np.nanmax(table.to_numpy()))
            norm = TwoSlopeNorm(vcenter=1.0, vmin=min(lo, 0.95), vmax=max(hi, 1.05))
            sns.heatmap(table, ax=left, annot=True, fmt=".2f", cmap="RdBu", norm=norm, cbar=False,
                        annot_kws={"fontsize": 6.5}, linewidths=0.5, linecolor="white")
            cols, rows = list(table.columns), list(table.index)
            for r in grid.dropna(subset=["target"]).itertuples():
                x, y = cols.index(r.tokens), rows.index(r.batch_size)
                met = r.ratio >= r.target
                left.add_patch(Rectangle((x, y), 1, 1, fill=False, lw=1.6, ec="black" if met else "#b03030"))
            left.set_xticklabels([f"{c // 1024}K" if c >= 1024 else str(c) for c in cols], rotation=0)
            left.set_yticklabels([str(b) for b in rows], rotation=0)
            left.grid(False)
            left.set_xlabel("tokens per row")
            left.set_ylabel("batch size B")
            left.set_title("speedup over the fastest baseline (kernel time)")
        if host.empty:
            right.set_axis_off()
            right.text(0.5, 0.5, not_measured(hw, "host_loop_us"), ha="center", va="center", color="#b03030",
                       fontsize=8, transform=right.transAxes)
        else:
            order = _order(host["backend"])
            for i, b in enumerate(order):  # one point per case, spread evenly across the column (no random
                ys = np.sort(host.loc[host["backend"] == b, "host_loop_us"].to_numpy(float))  # jitter: byte-stable)
                xs = i + (np.linspace(-0.25, 0.25, ys.size) if ys.size > 1 else np.zeros(1))
                right.scatter(xs, ys, s=9, color=color(b), linewidths=0)
            right.set_xticks(range(len(order)), order)
            right.grid(axis="x", visible=False)
            right.axhline(targets.ENGINE_HOST_US, color="0.3", lw=0.8, ls="--")
            log_axis(right, "y")
            right.set_xlabel("")
            right.set_ylabel("host us per run() call")
            right.tick_params(axis="x", rotation=60)
            for label in right.get_xticklabels():
                label.set_ha("right")
            right.set_title(f"eager host cost (target < {targets.ENGINE_HOST_US:g} us)")
        fig.suptitle(title, fontsize=9)
    return fig


# ---------------------------------------------------------------------------------------------
# 9. The ablations' own figures (``persistentkv ablation --figure``; results/counters/ablation_*.svg)

def fig_bucket_ablation(frame: pd.DataFrame) -> Figure:
    """Three panels, bars per trace and variant (median over steps; whiskers span the 25-75% range)
    of ablation_buckets.parquet: launches per step, KV read past the real lengths (% of useful KV),
    and the paper-formula merge state per step (MiB, log)."""
    data = frame.assign(padded_pct=100.0 * frame["padded_kv_bytes"] / frame["useful_kv_bytes"],
                        merge_mib=frame["paper_merge_state_bytes"] / 2**20)
    panels = [("launches", "launches per step", False),
              ("padded_pct", "KV read past real lengths\n(% of useful KV)", False),
              ("merge_mib", "merge state per step,\npaper formula (MiB, log)", True)]
    order = list(dict.fromkeys(data["variant"]))
    traces = list(dict.fromkeys(data["trace"]))
    with style():
        fig = Figure(figsize=(max(7.0, 1.6 * len(traces)), 2.6 * len(panels)), layout="constrained")
        axes = fig.subplots(len(panels), 1, sharex=True)
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
        axes[-1].set_xlabel(f"trace (every step, seed {int(frame['seed'].iloc[0])})")
        S = int(frame.loc[frame["variant"] == "exact", "num_splits"].iloc[0])
        fig.suptitle(f"Bucketing ablation: exact and padded buckets (S={S} per bucket), balanced work queue, "
                     "published rectangle (trace's S)", fontsize=9)
    return fig


def fig_split_ablation(frame: pd.DataFrame) -> Figure:
    """Per trace (columns) of ablation_splits.parquet, median over steps against S, one line per
    route (the balanced work queue, which has no S, as a dashed level): launches, and on log axes
    decode CTAs, KV bytes per decode CTA and merge-state bytes."""
    data = frame.assign(kib_per_cta=frame["useful_kv_bytes"] / frame["nonempty_items"] / 1024,
                        merge_mib=frame["merge_state_bytes"] / 2**20)
    metrics = [("launches", "launches per step", False),
               ("decode_ctas", "decode CTAs per step (log)", True),
               ("kib_per_cta", "KV per decode CTA (KiB, log)", True),
               ("merge_mib", "merge state per step (MiB, log)", True)]
    traces = list(dict.fromkeys(data["trace"]))
    routes = ["split", "buckets", "workqueue_fixed"]
    balanced = data[data["num_splits"] < 0]
    medians = data[data["num_splits"] > 0].groupby(["trace", "route", "num_splits"], as_index=False)[
        [m for m, _, _ in metrics]].median()
    with style():
        fig = Figure(figsize=(3.0 * len(traces), 2.4 * len(metrics)), layout="constrained")
        axes = fig.subplots(len(metrics), len(traces), sharex=True, squeeze=False)
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
        fig.suptitle(f"Split-count ablation (median over every step, seed {int(frame['seed'].iloc[0])})", fontsize=9)
    return fig


# ---------------------------------------------------------------------------------------------
# 10. The full decode step (results/<hw>/e2e/pass*.parquet): where each backend's step goes, and whether
#     the attention gain survives it



def e2e_cell_name(trace: str, step: int, batch_size: int, context: int) -> str:
    """A cell's short name on an axis: 'B=4 x 32K' for a B x context cell, 'zipf_b8@8' for a trace step."""
    if trace == "cases":
        return f"B={batch_size} x {context // 1024}K" if context >= 1024 else f"B={batch_size} x {context}"
    return f"{trace}@{step}"


def _e2e_caches(results: Results) -> list[tuple[str, Results]]:
    """(cache, results) per cache the full step was measured over: "" for the fp16/bf16 passes
    (results.e2e) and, where they exist, FP8_KV for the FP8 cache's (results.e2e_fp8, as e2e)."""
    out = [("", results)]
    if not results.e2e_fp8.empty:
        out.append((FP8_KV, replace(results, e2e=results.e2e_fp8)))
    return out


def data_e2e_split(results: Results) -> pd.DataFrame:
    """Per model, kernels variant, cache, cell and backend of the ok e2e rows: the median step_us
    and attention_us over rounds, their difference (the rest), and the step's floor (floor_us, its
    weights and K/V read once at the run's read ceiling); cache is "" for the fp16/bf16 passes and
    FP8_KV for the FP8 cache's. Columns: model, kernels, cache, cell, backend, step_us, attention_us,
    rest_us, floor_us."""
    columns = ["model", "kernels", "cache", "cell", "backend", "step_us", "attention_us", "rest_us", "floor_us"]
    parts = []
    for cache, res in _e2e_caches(results):
        frame = res.e2e
        if frame.empty or "status" not in frame:
            continue
        ok = frame[(frame["status"] == "ok") & frame["model"].fillna("").ne("")]
        if ok.empty:
            continue
        keys = targets.E2E_CELL + ["backend"]
        med = ok.groupby(keys, sort=True)[["step_us", "attention_us", "floor_us"]].median().reset_index()
        med["cell"] = [e2e_cell_name(r.trace, int(r.step), int(r.batch_size), int(r.context))
                       for r in med.itertuples()]
        med["rest_us"] = med["step_us"] - med["attention_us"]
        med["cache"] = cache
        parts.append(med[columns])
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=columns)


def data_e2e_gain(results: Results) -> pd.DataFrame:
    """Per cell of targets.e2e_verdicts (per cache, as data_e2e_split): the measured end-to-end
    speedup over the fastest baseline and the Amdahl prediction from the same pass's attention
    times, each with its interval (over the passes, or a single pass's paired bootstrap over its
    rounds; the verdicts say which). Columns: model, kernels, cache, cell, ratio, lo, hi, amdahl,
    amdahl_lo, amdahl_hi."""
    columns = ["model", "kernels", "cache", "cell", "ratio", "lo", "hi", "amdahl", "amdahl_lo", "amdahl_hi"]
    rows = []
    for cache, res in _e2e_caches(results):
        rows += [{**{k: c[k] for k in columns if k not in ("cell", "cache")}, "cache": cache,
                  "cell": e2e_cell_name(c["trace"], c["step"], c["batch_size"], c["context"])}
                 for c in targets.e2e_verdicts(res)["cells"]]
    return pd.DataFrame(rows, columns=columns)


#: fig_e2e's step axis shows the backends within this many times each cell's fastest step whole.
E2E_AXIS_SPAN = 1.5
#: fig_e2e: inches of height per cell label of the speedup panel.
E2E_ROW_IN = 0.16


def fig_e2e(split: pd.DataFrame, gain: pd.DataFrame, hw: str) -> Figure:
    title = "The full decode step: attention and the rest, and the gain against its Amdahl prediction"
    if split.empty:
        return placeholder(title, not_measured(hw, "the full decode step (e2e/pass*.parquet)"))
    groups = list(split.groupby(["model", "kernels", "cache"], sort=True))
    # each row of panels tall enough for its cells' labels on the right (E2E_ROW_IN per cell)
    heights = [max(2.5, E2E_ROW_IN * part["cell"].nunique() + 0.9) for _, part in groups]
    with style():
        fig = Figure(figsize=(WIDTH, sum(heights) + 0.6), layout="constrained")
        axes = fig.subplots(len(groups), 2, width_ratios=(2.2, 1), height_ratios=heights, squeeze=False)
        handles = {}
        for (left, right), ((model, kernels, cache), part) in zip(axes, groups):
            cells = list(dict.fromkeys(part["cell"]))
            backends = _order(part["backend"])
            width = 0.8 / len(backends)
            for j, b in enumerate(backends):
                mine = part[part["backend"] == b].set_index("cell").reindex(cells)
                x = np.arange(len(cells)) - 0.4 + width * (j + 0.5)
                shade = color(b)
                handles[b] = left.bar(x, mine["attention_us"] / 1e3, width, color=shade, linewidth=0)
                left.bar(x, mine["rest_us"] / 1e3, width, bottom=mine["attention_us"] / 1e3, color=shade,
                         alpha=0.35, linewidth=0)
            # the axis ends above the backends within E2E_AXIS_SPAN of each cell's fastest step; a bar
            # past it (torch-sdpa's, several times the others) is cut there and labelled with its time
            steps = (part["attention_us"] + part["rest_us"]) / 1e3
            fastest = steps.groupby(part["cell"]).transform("min")
            top = 1.15 * float(steps[steps <= E2E_AXIS_SPAN * fastest].max())
            if np.isfinite(top) and (steps > top).any():
                left.set_ylim(0, top)
                for j, b in enumerate(backends):
                    mine = part[part["backend"] == b].set_index("cell").reindex(cells)
                    total = (mine["attention_us"] + mine["rest_us"]) / 1e3
                    for i, t in enumerate(total):
                        if np.isfinite(t) and t > top:
                            left.text(i - 0.4 + width * (j + 0.5), top * 0.99, f"{t:.0f}", rotation=90,
                                      ha="center", va="top", fontsize=6, color="0.2")
            floors = part.groupby("cell", sort=False)["floor_us"].median().reindex(cells) / 1e3
            for i, f in enumerate(floors):
                if np.isfinite(f):
                    handles["floor"] = left.hlines(f, i - 0.45, i + 0.45, color="black", lw=1.0, ls="--")
            left.set_xticks(range(len(cells)), cells)
            left.tick_params(axis="x", rotation=30)
            for label in left.get_xticklabels():
                label.set_ha("right")
            left.grid(axis="x", visible=False)
            left.set_ylabel("ms per step")
            left.set_title(f"{model} ({kernels} kernels) over an FP8 e4m3 cache" if cache == FP8_KV else
                           f"{model} ({kernels} kernels): attention (solid) + the rest (light)")
            mine = gain[(gain["model"] == model) & (gain["kernels"] == kernels) & (gain["cache"] == cache)]
            if mine.empty:
                right.set_axis_off()
                right.text(0.5, 0.5, "no cell with ours and a baseline", ha="center", va="center",
                           color="#b03030", fontsize=8, transform=right.transAxes)
                continue
            y = np.arange(len(mine))
            m_err = [mine["ratio"] - mine["lo"], mine["hi"] - mine["ratio"]]
            a_err = [mine["amdahl"] - mine["amdahl_lo"], mine["amdahl_hi"] - mine["amdahl"]]
            handles["measured"] = right.errorbar(mine["ratio"], y - 0.12, xerr=m_err, fmt="o", ms=3.5, lw=1,
                                                 color=color(targets.ENGINE_BACKEND))
            handles["Amdahl"] = right.errorbar(mine["amdahl"], y + 0.12, xerr=a_err, fmt="D", ms=3, lw=1,
                                               color="0.35", mfc="white")
            right.axvline(1.0, color="0.5", lw=0.8)
            right.axvline(targets.E2E_STEP_MIN_RATIO, color="#b03030", lw=0.8, ls=":")
            right.set_yticks(y, mine["cell"])
            right.set_ylim(len(mine) - 0.5, -0.5)
            right.grid(axis="y", visible=False)
            right.set_xlabel("speedup vs fastest baseline")
            right.set_title("measured vs predicted")
        labels = {"floor": "bytes at the read ceiling", "measured": "measured speedup",
                  "Amdahl": "Amdahl prediction"}
        order = [b for b in _order([k for k in handles if k not in labels])] + [k for k in labels if k in handles]
        fig.legend([handles[k] for k in order], [labels.get(k, k) for k in order], loc="outside lower center",
                   ncols=min(4, len(order)), frameon=False)
        fig.suptitle(title, fontsize=9)
    return fig


# ---------------------------------------------------------------------------------------------
# Registry and writing

@dataclass(frozen=True)
class FigureSpec:
    name: str
    title: str
    how_to_read: str
    build: Callable[[Results], Figure]


FIGURES: tuple[FigureSpec, ...] = (
    FigureSpec("trace_ratios", "Speedup over FlashInfer per published trace",
               "Each point is a geometric mean over holdout seeds of FlashInfer's time over the backend's "
               "(above the dashed line = faster than the faster FlashInfer configuration), with its 95% bootstrap "
               "interval; left: the paper's timed region, right: the fair step protocol; crosses: the paper's RTX 3060 figures.",
               lambda r: fig_trace_ratios(data_trace_ratios(r), r.hw)),
    FigureSpec("read_ceiling", "Fraction of the read ceiling",
               "Achieved KV read bandwidth of each kernel call (CUDA-graph device time) as a fraction of the read "
               "ceiling measured in the same run; the closer to 1, the less there is left to gain.",
               lambda r: fig_ceiling(data_ceiling(r), r.hw)),
    FigureSpec("fanout_merge", "Launch fan-out and merge-state traffic",
               "Planner counters per step (hardware-independent): exact-length buckets launch a decode and a merge "
               "per distinct length; the work queue launches once; padded buckets trade launches for padded reads.",
               lambda r: fig_fanout_merge(r.ablation_buckets, r.hw)),
    FigureSpec("split_sensitivity", "Split sensitivity",
               "Left: measured speed of each split count S relative to the same route's fastest S in the same "
               "step set (geometric mean over holdout seeds, 95% interval; 1 = the best S); right: merge-state "
               "bytes the rectangular split writes per step as S grows.",
               lambda r: fig_split_sensitivity(data_split_times(r), r.ablation_splits, r.hw)),
    FigureSpec("batch_sweep", "Batch-size sweep",
               "Speedup over the faster FlashInfer for B rows of equal length; one panel per length.",
               lambda r: fig_batch_sweep(data_batch_sweep(r), r.hw)),
    FigureSpec("policy", "Policy decisions",
               "Every step the adaptive backend ran, placed by its longest row and batch size, coloured by the route "
               "the frozen policy chose.",
               lambda r: fig_policy(data_policy(r), r.hw)),
    FigureSpec("engine", "The engine against its targets",
               "Left: pkv-workqueue's speedup over the fastest baseline on each equal-length case of bench_kernels "
               "(median kernel time under CUDA-graph replay, cold L2; blue = faster, red = slower); outlined cells "
               "carry the mid-range targets ("
               + ", ".join(f"{t:g}x at B={b} x {n // 1024}K" for (b, n), t in targets.ENGINE_MID_RANGE.items())
               + "), black where the speedup reaches it, red where it falls short. Right: host time per run() call "
               f"in a loop of back-to-back calls with a reused plan, one point per case and backend; the dashed "
               f"line is the {targets.ENGINE_HOST_US:g} us target.",
               lambda r: fig_engine(data_engine_grid(r), data_engine_host(r), r.hw)),
    FigureSpec("validation", "Validation status",
               "Relative error of every backend against the float64 reference at sampled steps (GPU) and of the "
               "NumPy executor per route (cpu:...), one panel per cache dtype (float16 left, bfloat16 right), each "
               "with that dtype's tolerance named in its title and drawn as the bar on every backend's row.",
               lambda r: fig_validation(data_validation(r), r.hw)),
)
FIGURES += (
    FigureSpec("shapes", "The shapes experiment",
               "bench_shapes: pkv-workqueue's kernel time (median under CUDA-graph replay, cold L2) against the step's "
               "K/V bytes, one solid line per shape (Hkv, G), one panel per batch size; dashed in the same colour the "
               "fastest baseline of that shape at each size; black the one-kernel floor measured in the same cases "
               "(one plain read of the step's bytes in one kernel, the best of its grids; the median over the "
               "panel's shapes at each size). Both axes log scale.",
               lambda r: fig_shapes(data_shapes(r), r.hw)),
    FigureSpec("shapes_floor", "The shapes against the one-kernel floor",
               f"bench_shapes: the one-kernel floor's median time over {targets.ENGINE_BACKEND}'s in each case "
               "(1 = as fast as one plain read of the step's K/V bytes in one kernel; above 1, faster), one line per "
               "shape (Hkv, G), one "
               "panel per batch size; the black segments are the floor targets, each over the step sizes it covers "
               "(fixed before the data; none below "
               f"{targets.FLOOR_BANDS[0][0] // targets.MiB} MiB).",
               lambda r: fig_shapes_floor(data_shapes(r), r.hw)),
    FigureSpec("e2e", "The full decode step",
               "Per model and kernels variant, each backend's step (median over interleaved rounds of the "
               "captured Llama decode step) split into its attention (solid, timed alone in the same round) "
               "and the rest (light); the dashed line is the step's floor, its weights and K/V read once at "
               "the run's read ceiling; a bar more than "
               f"{E2E_AXIS_SPAN:g}x its cell's fastest step is cut at the top of the axis and labelled with its "
               "time in ms. Right: pkv-workqueue's measured speedup over the fastest baseline "
               "(dots) against the Amdahl prediction from the same run's attention times (diamonds), 95 % "
               "paired bootstrap intervals; the dotted line is the "
               f"{targets.E2E_STEP_MIN_RATIO:g}x step floor. Where the step was also measured over an FP8 e4m3 "
               "cache (e2e_fp8), each model's FP8 panels follow its own, against the baselines that read FP8.",
               lambda r: fig_e2e(data_e2e_split(r), data_e2e_gain(r), r.hw)),
    FigureSpec("fp8", "FP8 e4m3 caches",
               f"bench_kernels on the fp16 cache and on FP8 e4m3 codes (bench_kernels_fp8, the same cases), one "
               f"colour per cache. Left: {targets.ENGINE_BACKEND}'s kernel time (filled) and the fastest baseline's "
               "on the same cache (open) against the case's size in fp16 bytes, so each case's two caches stand one "
               "above the other; each cache's one-kernel floor as a line (solid FP8, dashed fp16). Right: the "
               "floor's time over ours against the bytes the cache holds (an FP8 case holds half its fp16 twin's); "
               "the black segments are the FP8 targets over the sizes they cover.",
               lambda r: fig_fp8(data_fp8(r), r.hw)),
)
FIGURE_NAMES = tuple(f.name for f in FIGURES)
assert FIGURE_NAMES == _NAMES, "render/__init__.py FIGURE_NAMES must list FIGURES in order"


def save(fig: Figure, path: str | Path) -> None:
    """Write ``fig`` atomically; the format follows the suffix; output is byte-stable."""
    path = Path(path)
    fmt = path.suffix.lstrip(".")
    require(fmt in FIGURE_FORMATS, f"figure format {fmt!r} (from {path}) is not one of {', '.join(FIGURE_FORMATS)}")
    metadata = {"svg": {"Date": None}, "pdf": {"CreationDate": None, "ModDate": None}, "png": {}}[fmt]
    # svg.fonttype and svg.hashsalt are read when saving: the style must be active here too.
    with style(), atomic_path(path) as tmp:
        fig.savefig(tmp, format=fmt, metadata=metadata, dpi=200 if fmt == "png" else None)


def render_all(results: Results, out_dir: str | Path, fmt: str = "svg", only=None) -> list[Path]:
    """Build and write every figure (or the ``only`` names) as ``out_dir/<name>.<fmt>``."""
    require(fmt in FIGURE_FORMATS, f"figure format {fmt!r} is not one of {', '.join(FIGURE_FORMATS)}")
    names = list(only) if only else list(FIGURE_NAMES)
    unknown = [n for n in names if n not in FIGURE_NAMES]
    if unknown:
        raise PKVError(f"unknown figure {unknown[0]!r}; expected one of {', '.join(FIGURE_NAMES)}")
    from tqdm import tqdm

    written = []
    for spec in tqdm([f for f in FIGURES if f.name in names], desc="figures", unit="fig", leave=False):
        fig = spec.build(results)
        path = Path(out_dir) / f"{spec.name}.{fmt}"
        save(fig, path)
        written.append(path)
    return written


# ---------------------------------------------------------------------------------------------
# 10. The shapes experiment: time against bytes per shape, the fastest baseline, the one-kernel floor

def _medians_by_case(ok: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Per ``keys`` group of ok kernel rows, the median time (us) of targets.ENGINE_BACKEND
    (``ours``), of the fastest baseline there (``baseline``, by median; which one in
    ``baseline_name``) and of the one-kernel floor (``floor``), NaN where absent; ``keys`` as columns."""
    med = ok.groupby(keys + ["backend"])["time_us"].median().unstack("backend")
    base = [b for b in BASELINES if b in med.columns]
    return pd.DataFrame({
        "ours": med[targets.ENGINE_BACKEND] if targets.ENGINE_BACKEND in med else np.nan,
        "baseline": med[base].min(axis=1) if base else np.nan,
        "baseline_name": med[base].idxmin(axis=1, skipna=True) if base and med[base].notna().any().any() else "",
        "floor": med[FLOOR_BACKEND] if FLOOR_BACKEND in med else np.nan}).reset_index()


def data_shapes(results: Results) -> pd.DataFrame:
    """bench_shapes' kernel rows: per case (Hkv, G, B, kv_bytes) the median time (us) of
    targets.ENGINE_BACKEND (``ours``), of the fastest baseline there (``baseline``, by median; which one
    in ``baseline_name``) and of the one-kernel floor (``floor``); NaN where absent."""
    columns = ["num_kv_heads", "group_size", "batch_size", "kv_bytes", "ours", "baseline", "baseline_name", "floor"]
    shapes = results.shapes
    if shapes.empty or "protocol" not in shapes:
        return pd.DataFrame(columns=columns)
    ok = shapes[(shapes["protocol"] == "kernel") & (shapes["status"] == "ok")]
    if ok.empty:
        return pd.DataFrame(columns=columns)
    out = _medians_by_case(ok, ["num_kv_heads", "num_qo_heads", "batch_size", "kv_bytes"])
    out["group_size"] = out["num_qo_heads"] // out["num_kv_heads"]
    return out[columns].sort_values(["batch_size", "num_kv_heads", "group_size", "kv_bytes"]).reset_index(drop=True)


def _shape_panels(frame: pd.DataFrame, title: str, ylabel: str, draw) -> Figure:
    """bench_shapes' figures: one panel per batch size (two rows of three when there are more
    than three), sharing both axes, x the step's K/V bytes in MB on a log scale; ``draw(ax,
    panel, shapes, palette)`` draws one batch size's rows (``shapes``: the (Hkv, G) pairs in
    legend order, ``palette``: one colour each) and returns extra (handle, label) pairs for the
    legend, which lists the first panel's labelled lines, then those."""
    shapes = sorted({(int(h), int(g)) for h, g in zip(frame["num_kv_heads"], frame["group_size"])})
    palette = sns.color_palette("colorblind", max(len(shapes), 3))
    batches = sorted(frame["batch_size"].unique())
    with style():
        nrows = 1 if len(batches) <= 3 else 2          # six batch sizes: two rows of three panels
        ncols = -(-len(batches) // nrows)
        fig = Figure(figsize=(WIDTH, 2.9 if nrows == 1 else 5.0), layout="constrained")
        grid = fig.subplots(nrows, ncols, sharex=True, sharey=True, squeeze=False)
        for ax in grid.flat[len(batches):]:
            ax.set_visible(False)
        axes = grid.flat[:len(batches)]
        extra = []
        for ax, b in zip(axes, batches):
            extra = draw(ax, frame[frame["batch_size"] == b], shapes, palette)
            log_axis(ax, "x")
            ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0,)))  # narrow panels
            ax.set_title(f"B = {b}")
            ax.set_xlabel("")
        fig.supxlabel("K/V bytes per step (MB, log scale)", fontsize=8)
        for row in grid:
            row[0].set_ylabel(ylabel)
        handles, labels = axes[0].get_legend_handles_labels()
        handles += [handle for handle, _ in extra]
        labels += [label for _, label in extra]
        fig.legend(handles, labels, loc="outside right center", frameon=False, fontsize=7)
        fig.suptitle(title, fontsize=9)
    return fig


def _shape_rows(panel: pd.DataFrame, h: int, g: int) -> tuple[pd.DataFrame, np.ndarray]:
    part = panel[(panel["num_kv_heads"] == h) & (panel["group_size"] == g)].sort_values("kv_bytes")
    return part, part["kv_bytes"].to_numpy(float) / 1e6


def fig_shapes(frame: pd.DataFrame, hw: str) -> Figure:
    title = f"{targets.ENGINE_BACKEND} across shapes, the fastest baseline and the one-kernel floor"
    if frame.empty or frame["ours"].isna().all():
        return placeholder(title, not_measured(hw, "bench_shapes"))
    from matplotlib.lines import Line2D

    def draw(ax, panel, shapes, palette):
        for (h, g), c in zip(shapes, palette):
            part, x = _shape_rows(panel, h, g)
            ax.plot(x, part["ours"].to_numpy(float), marker="o", ms=3, lw=1.1, color=c, label=f"Hkv={h}, G={g}")
            ax.plot(x, part["baseline"].to_numpy(float), ls="--", lw=0.9, color=c, alpha=0.8)
        fl = panel.groupby("kv_bytes")["floor"].median().dropna()
        if not fl.empty:
            ax.plot(fl.index.to_numpy(float) / 1e6, fl.to_numpy(float), color="black", lw=1.6,
                    label="one-kernel floor")
        log_axis(ax, "y")
        return [(Line2D([], [], color="0.4", ls="--", lw=0.9), "fastest baseline (dashed, per shape)")]

    return _shape_panels(frame, title, "kernel time (us)", draw)


def fig_shapes_floor(frame: pd.DataFrame, hw: str) -> Figure:
    """Per bench_shapes case the one-kernel floor's time over ours (1 = as fast as one plain read of
    the step's bytes), one line per shape, and targets.FLOOR_BANDS drawn over the sizes they
    cover."""
    title = f"{targets.ENGINE_BACKEND} as a fraction of the one-kernel floor, per shape"
    frame = frame.assign(frac=frame["floor"] / frame["ours"]).dropna(subset=["frac"])
    if frame.empty:
        return placeholder(title, not_measured(hw, "bench_shapes"))
    from matplotlib.lines import Line2D

    x_hi = float(frame["kv_bytes"].max()) / 1e6 * 1.5

    def draw(ax, panel, shapes, palette):
        for (h, g), c in zip(shapes, palette):
            part, x = _shape_rows(panel, h, g)
            ax.plot(x, part["frac"].to_numpy(float), marker="o", ms=3, lw=1.1, color=c, label=f"Hkv={h}, G={g}")
        for lo, hi, target in targets.FLOOR_BANDS:
            ax.hlines(target, lo / 1e6, hi / 1e6 if hi else x_hi, color="black", lw=1.4)
        ax.axhline(1.0, color="0.5", lw=0.6, ls=":")
        ax.set_ylim(0, 1.05)
        return [(Line2D([], [], color="black", lw=1.4), "target for the sizes it spans")]

    return _shape_panels(frame, title, "floor time / ours", draw)


# ---------------------------------------------------------------------------------------------
# 11. The FP8 cache: bench_kernels on e4m3 caches beside the fp16 grid (targets_fp8)

#: The two caches of the FP8 figure, in legend order, with their colours.
KV_DTYPE_COLORS = {"float16": _PALETTE[0], "float8_e4m3": _PALETTE[3]}


def data_fp8(results: Results) -> pd.DataFrame:
    """bench_kernels' kernel rows on the fp16 cache (bench_kernels.parquet) and on the FP8 one
    (bench_kernels_fp8.parquet), per (kv_dtype, trace): kv_bytes (the cache's own bytes),
    fp16_bytes (the case's bytes in fp16: twice an FP8 case's) and the median time (us) of
    targets.ENGINE_BACKEND (``ours``), of the fastest baseline there (``baseline``, by median) and
    of the one-kernel floor (``floor``), NaN where absent. Empty when there are no FP8 rows: the
    figure is drawn only from an FP8 run."""
    columns = ["kv_dtype", "trace", "kv_bytes", "fp16_bytes", "ours", "baseline", "baseline_name", "floor"]
    fp8 = results.kv_grid("bench_kernels", FP8_KV)
    parts = [f for f in (results.bench, fp8) if not f.empty and {"kv_dtype", "protocol", "status"} <= set(f.columns)]
    rows = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=columns)
    ok = rows[(rows["protocol"] == "kernel") & (rows["status"] == "ok")] if not rows.empty else rows
    if ok.empty or not (ok["kv_dtype"] == FP8_KV).any():
        return pd.DataFrame(columns=columns)
    out = _medians_by_case(ok, ["kv_dtype", "trace", "kv_bytes"])
    out["fp16_bytes"] = out["kv_bytes"] * np.where(out["kv_dtype"] == FP8_KV, 2, 1)
    return out[columns].sort_values(["kv_dtype", "kv_bytes", "trace"]).reset_index(drop=True)


def fig_fp8(frame: pd.DataFrame, hw: str) -> Figure:
    """Left: kernel time per case against the case's size (its fp16 bytes, so a case's two caches
    stand one above the other), one colour per cache dtype: ours filled, the fastest baseline on
    that cache open, each cache's one-kernel floor as a line (its median over the cases of one
    size). Right: the floor's time over ours against the bytes the cache holds, per dtype, with
    targets_fp8.FP8_FLOOR_BANDS drawn over the FP8 sizes they cover."""
    from .. import targets_fp8

    title = f"{targets.ENGINE_BACKEND} on fp16 and FP8 e4m3 caches (bench_kernels)"
    if frame.empty or not (frame["kv_dtype"] == FP8_KV).any():
        return placeholder(title, not_measured(hw, "bench_kernels_fp8"))
    with style():
        fig = Figure(figsize=(WIDTH, 3.4), layout="constrained")
        left, right = fig.subplots(1, 2, width_ratios=(1.35, 1))
        for kv_dtype in sorted(frame["kv_dtype"].unique(), key=lambda d: (d != "float16", d)):
            part = frame[frame["kv_dtype"] == kv_dtype]
            c = KV_DTYPE_COLORS.get(kv_dtype, (0.4, 0.4, 0.4))
            x = part["fp16_bytes"].to_numpy(float) / 1e6
            left.scatter(x, part["ours"].to_numpy(float), s=14, color=c, label=f"ours, {kv_dtype}", zorder=3)
            left.scatter(x, part["baseline"].to_numpy(float), s=16, facecolors="none", edgecolors=[c],
                         label=f"fastest baseline, {kv_dtype}", zorder=3)
            fl = part.groupby("fp16_bytes")["floor"].median().dropna()
            if not fl.empty:
                left.plot(fl.index.to_numpy(float) / 1e6, fl.to_numpy(float), color=c, lw=1.2,
                          ls="-" if kv_dtype == FP8_KV else "--", label=f"one-kernel floor, {kv_dtype}")
            frac = part.assign(frac=part["floor"] / part["ours"]).dropna(subset=["frac"])
            right.scatter(frac["kv_bytes"].to_numpy(float) / 1e6, frac["frac"].to_numpy(float), s=14, color=c,
                          label=kv_dtype, zorder=3)
        x_hi = float(frame["kv_bytes"].max()) / 1e6 * 1.5
        for lo, hi, target in targets_fp8.FP8_FLOOR_BANDS:
            right.hlines(target, lo / 1e6, hi / 1e6 if hi else x_hi, color="black", lw=1.4)
        right.axhline(1.0, color="0.5", lw=0.6, ls=":")
        right.set_ylim(0, 1.05)
        for ax in (left, right):
            log_axis(ax, "x")
        log_axis(left, "y")
        left.set_xlabel("the case: its fp16 K/V bytes (MB, log scale)")
        left.set_ylabel("kernel time (us, log scale)")
        left.legend(loc="upper left", frameon=False, fontsize=6.5)
        right.set_xlabel("K/V bytes in the cache (MB, log scale)")
        right.set_ylabel("floor time / ours")
        from matplotlib.lines import Line2D

        handles, labels = right.get_legend_handles_labels()
        right.legend([*handles, Line2D([], [], color="black", lw=1.4)], [*labels, "FP8 target"], loc="lower right",
                     frameon=False, fontsize=6.5)
        fig.suptitle(title)
    return fig
