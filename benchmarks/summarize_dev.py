"""Reprint the tables of benchmarks/NOTES.md whose raw files are committed.

    python benchmarks/summarize_dev.py

Reads benchmarks/runs/*.parquet, the development runs that a NOTES row still cites (every other
row names its raw file in git history: `git show <commit>:<path>`), and
results/nvidia-h200/bench_kernels.parquet, the pipeline's bench-kernels run: medians per case and
variant with the paired per-round ratios, the CTA trace's per-call timeline, the host-time
breakdowns, and pkv-workqueue against the best baseline. A file in benchmarks/runs/ that no table
below reads is refused, so that a committed run is never silently left out.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "benchmarks")]

from bench_common import NOT_ATTENTION, print_paired  # noqa: E402
from persistentkv.ceiling import fit_stream  # noqa: E402
from persistentkv.targets import ENGINE_MID_RANGE, eager_case_medians  # noqa: E402
from persistentkv.names import BASELINES  # noqa: E402
from trace_cta import call_table, last_cta_phases  # noqa: E402

RUNS = ROOT / "benchmarks" / "runs"
BENCH_KERNELS = ROOT / "results" / "nvidia-h200" / "bench_kernels.parquet"
VARIANTS = ("wq / wq8 = the GPU-planned work queue at 4 / 8 warps, buckets / split = the other routes, "
            "-closed = the closed-form chunk (v2-v6), -pdl / -nopdl = with / without programmatic dependent "
            "launch, wq@xW = W times the default target_items, -early = K/V loads before the PDL wait (v12's "
            "define), -early_kv0 / -noearly = without them, -combine1 = the one-barrier combine (v16's define), "
            "-fixed_merger = a fixed merger (v16), -addr64 = v16's 64-bit addresses (v17), clN / clNw8 = the "
            "cluster route with C = N (v5), read = a plain read of the case's bytes, not attention; "
            "blank = variant not run for that case")


def print_tune(path: Path, df: pd.DataFrame) -> None:
    med = df.groupby(["case", "variant"], sort=False)["time_us"].median().unstack()
    cols = [c for c in med.columns if c.startswith(("wq264", "wq132", "wq-gpu", "split"))]
    print(f"\n{path.stem} (median us per call, CUDA-graph replay, cold L2)")
    print(med[cols].round(1).to_string())


def print_variants(path: Path, df: pd.DataFrame) -> None:
    med = df.groupby(["case", "variant"], sort=False)["time_us"].median().unstack()
    base = [c for c in BASELINES if c in med]
    table = med[[c for c in med.columns if c not in BASELINES]].copy()
    table.insert(0, "floor", df.groupby("case", sort=False)["floor_us"].first())
    table["best baseline"] = med[base].min(axis=1)
    print(f"\n{path.stem} (median us per call, CUDA-graph replay, cold L2; {VARIANTS})")
    print(table.round(1).to_string())
    checked = df[~df["variant"].isin(NOT_ATTENTION)]
    column = "max_row_head_err" if "max_row_head_err" in checked else "rel_err"  # rows before the per-row gate
    print(f"max rel err vs float64 over the attention variants ({column}): {checked[column].max():.1e}")
    print_paired(df)


def print_stream(path: Path, df: pd.DataFrame) -> None:
    med = df.groupby(["mb", "variant"], sort=False)["time_us"].median().unstack()
    floor = df.groupby("mb", sort=False)["floor_us"].first()
    frac = (100 / med).mul(floor, axis=0).round(0)
    med.index = floor.index = frac.index = med.index.round(1)
    print(f"\n{path.stem} (bench_stream.py of 0390ebd: median us per call to stream the MB, CUDA-graph replay, "
          f"cold buffers; wq8 = the 8-warp queue at B=1 over the same KV bytes; then % of the 1 GB read ceiling)")
    print(pd.concat([floor.rename("floor"), med], axis=1).round(1).to_string())
    print(frac.astype(int).to_string())


def print_ceiling_sizes(path: Path, df: pd.DataFrame) -> None:
    by = df.groupby("gib")["time_us"]
    table = pd.DataFrame({"median us": by.median(), "min": by.min(), "max": by.max()})
    table["GB/s"] = table.index.to_series() * 2**30 / table["median us"] / 1e3
    rate, fixed = fit_stream(df["bytes"], df["time_us"])
    print(f"\n{path.stem} (ceiling_sizes.py of 0390ebd: the read kernel at each size, CUDA events per launch, "
          f"sizes interleaved over rounds)")
    print(table.round(1).to_string())
    print(f"least squares over {len(df)} samples: {rate:.0f} GB/s streaming rate, {fixed:.1f} us fixed")


def print_trace(path: Path, df: pd.DataFrame) -> None:
    rows = []
    for (case, warps, variant), d in df.groupby(["case", "warps", "variant"], sort=False):
        stats = call_table(d, float(d.floor_us.iloc[0]))
        rows.append({"case": case, "warps": warps, "variant": variant, "plain": d.plain_us.iloc[0], **stats,
                     **last_cta_phases(d)})
    print(f"\n{path.stem} (us; per-call medians of the CTA trace, benchmarks/trace_cta.py: period = release to "
          f"next release, gap = previous call's last exit to this release, first = first stage landed, loop = "
          f"last loop done, tail = last loop done to last exit, all from this call's release; the last CTA's "
          f"tail: combine = loop done to state written, arrive = to merge decided, merge = to exit)")
    print(pd.DataFrame(rows).round(2).to_string(index=False))


def print_step_pieces(path: Path, df: pd.DataFrame) -> None:
    med = df.groupby(["case", "backend"], sort=False)[["plan_host", "runs_host", "step", "layers"]].median()
    print(f"\n{path.stem} (us, medians; adaptive_overhead.py of 0390ebd: plan_host / runs_host = host time of "
          f"plan() / of the 32 run() calls, step = plan + 32 layers synchronised, layers = 32 layers alone)")
    print(med.round(1).to_string())


def print_plan_pieces(path: Path, df: pd.DataFrame) -> None:
    print(f"\n{path.stem} (us, median host time of each torch call a GPU plan is made of; "
          f"adaptive_overhead.py --pieces of 0390ebd)")
    print(df.pivot_table(index="piece", columns="case", values="host_us", sort=False).round(1).to_string())


def print_replay_latency(path: Path, df: pd.DataFrame) -> None:
    med = df.pivot_table(index=["case", "backend"], columns="mode", values="time_us", aggfunc="median", sort=False)
    queued = df[df["mode"] == "queued"].groupby(["case", "backend"], sort=False)["time_us"].median()
    asis = df[df["mode"] == "as-is"].set_index(["case", "backend"])["time_us"]
    med["as-is - queued"] = med["as-is"] - med["queued"]
    med["% as-is > queued + 1 us"] = 100 * (asis > queued.reindex(asis.index) + 1).groupby(level=[0, 1],
                                                                                          sort=False).mean()
    med["host us per replay"] = df.groupby(["case", "backend"], sort=False)["replay_host_us"].median()
    print(f"\n{path.stem} (us per call, medians; replay_latency.py of 0390ebd: as-is = the old kernel window, "
          f"queued = behind a GPU spin)")
    print(med.round(2).to_string())


def print_host_overhead(path: Path, df: pd.DataFrame) -> None:
    index = [c for c in ("case", "pdl", "loop_calls") if c in df]  # older runs time PDL on and off (NOTES)
    table = df.pivot_table(index=index, columns="mode", values="median_us", sort=False)
    print(f"\n{path.stem} (us per run() call on the host, median over loops that each start after a "
          f"synchronisation; benchmarks/host_overhead.py: *_cold = host caches flushed before each loop)")
    print(table.round(1).to_string())
    if "max_call_us" in df:
        longest = df.pivot_table(index=index, columns="mode", values="max_call_us",
                                 sort=False)
        print("each loop's longest call (us, median over loops)")
        print(longest.round(0).to_string())


def print_host_percpu(path: Path, df: pd.DataFrame) -> None:
    df = df[df["mode"].str.startswith("run_")]
    print(f"\n{path.stem} (benchmarks/host_overhead.py --per-cpu: us per run() call, B=1 x 4K, loops of 8, median "
          f"over loops, the timing thread pinned to each CPU in turn; cpu -1 = unpinned; columns = passes)")
    print(df.pivot_table(index="cpu", columns="pass_", values="median_us").round(1).to_string())
    if "probe_us" in df:
        print("the harness's CPU probe on the same CPU (us, best of three)")
        print(df.pivot_table(index="cpu", columns="pass_", values="probe_us").round(0).to_string())
        pinned = df[df["cpu"] >= 0]
        print(f"correlation of run() and probe over the pinned loops: "
              f"{pinned['median_us'].corr(pinned['probe_us']):.3f}")


def print_e2e(path: Path, df: pd.DataFrame) -> None:
    from persistentkv.commands.measure_e2e import summary_table

    print(f"\n{path.stem} (persistentkv measure-e2e: the full Llama decode step per backend; median and p99 step "
          f"us, tokens/s, attention's share, the step against the fastest baseline's, the Amdahl prediction from "
          f"the attention times, the rest against its weight-read floor)")
    print(summary_table(df))


def print_step_probe(path: Path, df: pd.DataFrame) -> None:
    """benchmarks/step_probe.py: the step's projections against their weight bytes' read time, its
    kernels, the steps per kernel choice, backends' steps in the same rounds (part paired), and
    (in the runs that have part pdl) the queue's PDL variants."""
    print(f"\n{path.stem} (step_probe.py, parts {', '.join(sorted(df['part'].unique()))})")
    lin = df[df["part"] == "linears"]
    if len(lin):
        med = lin.groupby(["name", "variant"]).agg(us=("us", "median"), bytes=("bytes", "first"),
                                                   read_gbps=("read_gbps", "first"))
        med["of_read_ceiling"] = med["bytes"] / (med["us"] * 1e3) / med["read_gbps"]
        print("each projection at B=1 in a graph over its layers' weights, us per call and its weight bytes' "
              "read-ceiling time / that")
        print(med[["us", "of_read_ceiling"]].round(3).unstack("variant").to_string())
    kernels = df[df["part"] == "kernels"]
    for variant in sorted({v.split("-", 1)[1] if "-" in v else "" for v in kernels["variant"] if v.startswith("eager")}):
        eager, graph = ("eager", "graph") if not variant else (f"eager-{variant}", f"graph-{variant}")
        ker = kernels[kernels["variant"] == eager].sort_values("us", ascending=False)
        step = kernels[kernels["variant"] == graph]["us"]
        print(f"kernels of one {ker['cell'].iloc[0]} step{f' ({variant})' if variant else ''} (GPU us summed per "
              f"kernel name; {ker['us'].sum():.0f} in all, graph-replayed step {step.iloc[0]:.0f})")
        print(ker.head(14).assign(name=ker["name"].str.slice(0, 90))[["us", "repeat", "name"]]
              .rename(columns={"repeat": "count"}).round(1).to_string(index=False))
    steps = df[df["part"] == "steps"]
    if len(steps):
        wide = steps.pivot_table(index=["cell", "repeat"], columns="variant", values="us")
        choices = [c for c in steps["variant"].unique()   # the kernel choices' steps, in the run's order
                   if c not in ("attention", "appends") and not c.startswith("rest-")]
        first = choices[0]
        ratio = wide[choices].div(wide[first], axis=0).drop(columns=first)
        out = wide.groupby("cell").median().join(ratio.groupby("cell").median().add_suffix(f" / {first}"))
        print(f"the graph-replayed step per kernel choice (median us; per-round ratio to {first}, median)")
        print(out.round(4).to_string())
    evict = df[df["part"] == "evict"]
    if len(evict):
        print("attention per step: alone (after each layer's append), alone with a 256 MB read between the append "
              "and the call, and inside the step (step - step without attention); median us")
        print(evict.groupby(["cell", "variant", "name"])["us"].median().unstack("name").round(1).to_string())
    maps = df[df["part"] == "maps"]
    if len(maps):
        med = maps.groupby(["cell", "variant", "name"])["us"].median().unstack("name")
        shifts = sorted((c for c in med.columns if c.startswith("map")), key=lambda c: int(c[3:]))
        out = med[shifts + [c for c in ("in-step",) if c in med]]
        placed = maps[maps["name"].str.startswith("map")]
        out = out.assign(pooled=placed.groupby(["cell", "variant"])["us"].median(),
                         range=med[shifts].max(axis=1) - med[shifts].min(axis=1))
        print("attention per step alone after a no-op kernel of k CTAs between each layer's append and its call "
              "(map<k>), inside the step, the k pooled and their range; median us")
        print(out.round(0).to_string())
    paired = df[df["part"] == "paired"]
    if len(paired):
        order = list(dict.fromkeys(paired["variant"]))  # the backends in the run's order
        first = order[0]
        step = paired[paired["name"] == "step"].pivot_table(index=["cell", "repeat"], columns="variant",
                                                            values="us")[order]
        ratio = step.div(step[first], axis=0).drop(columns=first)
        out = step.groupby("cell").median().join(ratio.groupby("cell").median().add_suffix(f" / {first}"))
        print(f"each backend's graph-replayed step, all in the same rounds (median us; per-round ratio to {first}, "
              "median)")
        print(out.round(4).to_string())
        alone = paired[paired["name"] == "alone"].groupby(["cell", "variant"])["us"].median().unstack("variant")
        print("attention alone after each layer's append, the appends' own time subtracted (median us per step)")
        print(alone[order].round(0).to_string())
    pdl = df[(df["part"] == "pdl") & (df["name"] == "step")]
    if len(pdl):
        wide = pdl.pivot_table(index=["cell", "repeat"], columns="variant", values="us")
        ratio = wide.div(wide["nopdl"], axis=0).drop(columns="nopdl")
        out = wide.groupby("cell").median().join(ratio.groupby("cell").median().add_suffix(" / nopdl"))
        print("the step with the queue's PDL variants (median us; per-round ratio to nopdl, median)")
        print(out.round(4).to_string())


def print_step_probe_ctas(path: Path, df: pd.DataFrame) -> None:
    """benchmarks/step_probe.py part ctas: per traced case, alone and inside the step, the medians
    over layer calls of each call's phases (step_probe._cta_calls) and of its SMs' token loads."""
    import step_probe

    calls = pd.concat(step_probe._cta_calls(g, case, where, r) for (case, where, r), g in
                      df.groupby(["case", "where", "repeat"]))
    cols = ["span", "release", "first", "loop", "spread", "tail", "max_sm_tokens", "mean_sm_tokens",
            "cta_tokens_per_us"]
    print(f"\n{path.stem} (step_probe.py part ctas: the traced queue per layer call, us; medians over the calls)")
    print(calls.groupby(["case", "where"])[cols].median().round(2).to_string())


def print_gemv_tune(path: Path, df: pd.DataFrame) -> None:
    """benchmarks/tune_gemv.py: the step gemv's launch configurations, us per call (medians), and
    each configuration's sum over one step's projections against the first (shipped at the run)."""
    med = df.groupby(["name", "config"])["us"].median().unstack("config")
    print(f"\n{path.stem} (tune_gemv.py: B=1 projections per launch configuration u<unroll>_bw<block warps>_"
          f"mb<min blocks>_tw<target warps per SM>, median us per call)")
    print(med.round(2).to_string())
    layers = pd.Series([32 if n.startswith("8b") else 80 for n in med.index], index=med.index)
    first = df["config"].iloc[0]
    for model in ("8b", "70b"):
        part = med[med.index.str.startswith(model)].mul(layers[layers.index.str.startswith(model)], axis=0).sum()
        print(f"  {model} step's projections, us (/ {first}): "
              + ", ".join(f"{c} {v:.0f} ({v / part[first]:.3f})" for c, v in part.items()))


def print_validate_gpu(path: Path, df: pd.DataFrame) -> None:
    """validate-gpu's rows kept beside a NOTES entry (a run that did not replace the committed
    results/<hw>/validation_gpu.parquet): per backend and dtype, the rows, how many passed per
    (row, head), the worst error and the tolerance, and the backends that did not run and why."""
    ran = df[df["status"] == "ok"]
    table = ran.groupby(["backend", "dtype"]).agg(rows=("passed", "size"), passed=("passed", "sum"),
                                                  worst=("max_row_head_err", "max"), rtol=("rtol", "first"))
    print(f"\n{path.stem} (validate-gpu: per backend and dtype, rows passed per (row, head) against float64)")
    print(table.to_string())
    other = df[df["status"] != "ok"].groupby(["backend", "status"])["reason"].first()
    if not other.empty:
        print(other.to_string())


#: file-name prefix -> its table, tried in this order (bench_stream_ before the variant benches')
PRINTERS = (("tune_", print_tune), ("bench_stream_", print_stream), ("bench_", print_variants),
            ("ceiling_sizes_", print_ceiling_sizes), ("trace_cta_", print_trace),
            ("adaptive_overhead_", print_step_pieces), ("plan_pieces_", print_plan_pieces),
            ("replay_latency_", print_replay_latency), ("host_overhead_", print_host_overhead),
            ("host_percpu_", print_host_percpu), ("e2e_", print_e2e),
            ("step_probe_ctas_", print_step_probe_ctas), ("step_probe_", print_step_probe),
            ("gemv_tune_", print_gemv_tune), ("validate_gpu_", print_validate_gpu))


def printer_for(path: Path):
    """The table function of a file in benchmarks/runs/, or SystemExit naming a file no table reads."""
    for prefix, printer in PRINTERS:
        if path.name.startswith(prefix):
            return printer
    raise SystemExit(f"{path}: no table of summarize_dev.py reads it (file-name prefixes: "
                     f"{', '.join(p for p, _ in PRINTERS)})")


def print_bench_kernels(df: pd.DataFrame) -> None:
    """pkv-workqueue against the best baseline per case of a bench-kernels run, and its mid-range,
    eager-host and pinning summary."""
    k = df[(df.protocol == "kernel") & (df.status == "ok")]
    med = k.groupby(["trace", "backend"])["time_us"].median().unstack()
    base = [c for c in BASELINES if c in med]
    gbps = float(k["read_ceiling_gbps"].median())  # the run's ceiling (measured before and after its cases)
    ratio = med[base].min(axis=1) / med["pkv-workqueue"]
    summary = {"read ceiling GB/s": gbps}
    summary.update({case: ratio.get(case) for case in (f"B{b}xN{n}" for b, n in ENGINE_MID_RANGE)})
    if "host_loop_us" in df:
        loop = eager_case_medians(df, "host_loop_us").loc["pkv-workqueue"]
        summary.update({"host loop us (median of cases)": loop.median(), "worst case": loop.max()})
    summary["pinned"] = bool("host_cpu" in df and (df["host_cpu"] >= 0).any())
    print("\nbench_kernels, the mid range (best baseline / pkv-workqueue, graph-replayed medians) and the eager "
          "loop's host us per run() call")
    print(pd.Series(summary).to_string())
    out = pd.DataFrame({"best_baseline": med[base].min(axis=1), "which": med[base].idxmin(axis=1),
                        "pkv-workqueue": med["pkv-workqueue"]})
    out["speedup"] = out["best_baseline"] / out["pkv-workqueue"]
    kv = k.groupby("trace")["kv_bytes"].first()
    out["pkv % of read ceiling"] = 100 * kv / out["pkv-workqueue"] / 1e3 / gbps
    print(f"\nbench_kernels (all backends interleaved in one run; read ceiling {gbps:.0f} GB/s)")
    print(out.round(2).to_string())
    fastest_other = med.drop(columns=["torch-sdpa", "pkv-workqueue"], errors="ignore").min(axis=1)
    print(f"cases {len(out)}: faster than every baseline in {(out.speedup >= 1).sum()}, within 2 % of the "
          f"fastest backend in {(med['pkv-workqueue'] <= 1.02 * fastest_other).sum()}, lowest ratio "
          f"{out.speedup.min():.3f} ({out.speedup.idxmin()})")


def main(runs: Path = RUNS, bench_kernels: Path = BENCH_KERNELS) -> int:
    pd.set_option("display.width", 200)
    paths = sorted(runs.glob("*.parquet"))
    printers = [printer_for(path) for path in paths]  # an unread file fails before anything is printed
    for path, printer in zip(paths, printers):
        printer(path, pd.read_parquet(path))
    print_bench_kernels(pd.read_parquet(bench_kernels))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
