"""Print the kernel-development tables of benchmarks/NOTES.md from the committed raw runs.

    python benchmarks/summarize_dev.py

Reads results/nvidia-h200/kernel_dev/*.parquet (benchmarks/tune_engine.py and bench_engine.py runs)
and results/nvidia-h200/bench_kernels.parquet (persistentkv bench-kernels): medians per case.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_common import print_paired  # noqa: E402
from persistentkv.analysis import BASELINES  # noqa: E402
from persistentkv.ceiling import fit_stream  # noqa: E402
from persistentkv.claims import ENGINE_MID_RANGE, eager_case_medians  # noqa: E402
from trace_cta import call_table  # noqa: E402
DEV = ROOT / "results" / "nvidia-h200" / "kernel_dev"


def kernel_medians(bench: pd.DataFrame):
    """A bench_kernels run's ok kernel rows, their median us per (trace x backend), and the
    baselines present."""
    k = bench[(bench.protocol == "kernel") & (bench.status == "ok")]
    med = k.groupby(["trace", "backend"])["time_us"].median().unstack()
    return k, med, [c for c in BASELINES if c in med]


def main() -> int:
    pd.set_option("display.width", 200)
    for path in sorted(DEV.glob("tune_*.parquet")):
        df = pd.read_parquet(path)
        med = df.groupby(["case", "variant"], sort=False)["time_us"].median().unstack()
        cols = [c for c in med.columns if c.startswith(("wq264", "wq132", "wq-gpu", "split"))]
        print(f"\n{path.stem} (median us per call, CUDA-graph replay, cold L2)")
        print(med[cols].round(1).to_string())
    for path in sorted(DEV.glob("bench_cluster_*.parquet")) + sorted(DEV.glob("bench_warps_*.parquet")) + \
            sorted(DEV.glob("bench_tma_*.parquet")) + sorted(DEV.glob("bench_early_*.parquet")) + \
            sorted(DEV.glob("bench_pages_*.parquet")) + sorted(DEV.glob("bench_defines_*.parquet")):
        df = pd.read_parquet(path)
        med = df.groupby(["case", "variant"], sort=False)["time_us"].median().unstack()
        floor = df.groupby("case", sort=False)["floor_us"].first()
        base = [c for c in ("flashinfer-tc", "flashinfer-cc", "vllm-fa3", "trtllm-xqa") if c in med]
        ours = [c for c in med.columns if c.startswith(("wq", "cl", "pages", "read"))]
        table = med[ours].copy()
        table.insert(0, "floor", floor)
        table["best baseline"] = med[base].min(axis=1)
        print(f"\n{path.stem} (median us per call, CUDA-graph replay, cold L2; clN = cluster route with C=N, "
              f"-1cta = one CTA per SM, w8/wq8 = 8-warp CTAs, -closed = closed-form chunk, -pdl / -nopdl = with / without "
              f"programmatic dependent launch, -np = no L2 prefetch, -tma = K/V by TMA boxes (PKV_TMA=1), -early = first stages' K/V loaded before the PDL wait (PKV_EARLY=1), pagesN = the v11 prototype with N slab buffers, read-pages4-decode = its decode kernel without the merge (not attention), read = a plain read of the case's bytes, not "
              f"attention (variant names per file: benchmarks/NOTES.md); blank = variant not run for that case)")
        print(table.round(1).to_string())
        checked = df[~df["variant"].str.startswith("read")]  # read*: not attention, never checked
        print(f"max rel err vs float64 over the attention variants: {checked['rel_err'].max():.1e}")
        if path.stem.startswith("bench_defines_") and "repeat" in df:
            print_paired(df)
    for path in sorted(DEV.glob("bench_stream_*.parquet")):
        df = pd.read_parquet(path)
        med = df.groupby(["mb", "variant"], sort=False)["time_us"].median().unstack()
        floor = df.groupby("mb", sort=False)["floor_us"].first()
        frac = (100 / med).mul(floor, axis=0).round(0)
        med.index = floor.index = med.index.round(1)
        frac.index = med.index
        print(f"\n{path.stem} (benchmarks/bench_stream.py: median us per call to stream the MB, CUDA-graph replay, "
              f"cold buffers; wq8 = the 8-warp queue at B=1 over the same KV bytes; then % of the 1 GB read ceiling)")
        print(pd.concat([floor.rename("floor"), med], axis=1).round(1).to_string())
        print(frac.astype(int).to_string())
    for path in sorted(DEV.glob("ceiling_sizes_*.parquet")):
        df = pd.read_parquet(path)
        by = df.groupby("gib")["time_us"]
        table = pd.DataFrame({"median us": by.median(), "min": by.min(), "max": by.max()})
        table["GB/s"] = table.index.to_series() * 2**30 / table["median us"] / 1e3
        rate, fixed = fit_stream(df["bytes"], df["time_us"])
        print(f"\n{path.stem} (benchmarks/ceiling_sizes.py: the read kernel at each size, CUDA events per launch, "
              f"sizes interleaved over rounds)")
        print(table.round(1).to_string())
        print(f"least squares over {len(df)} samples: {rate:.0f} GB/s streaming rate, {fixed:.1f} us fixed")
    for path in sorted(DEV.glob("trace_cta_*.parquet")):
        df = pd.read_parquet(path)
        if "variant" not in df:  # the first trace run had one module per warp count
            df["variant"] = "base"
        rows = []
        for (case, warps, variant), d in df.groupby(["case", "warps", "variant"], sort=False):
            stats = call_table(d, float(d.floor_us.iloc[0]))
            rows.append({"case": case, "warps": warps, "variant": variant, "plain": d.plain_us.iloc[0], **stats})
        print(f"\n{path.stem} (us; per-call medians of the CTA trace, benchmarks/trace_cta.py: period = release to "
              f"next release, gap = previous call's last exit to this release, first = first stage landed, loop = "
              f"last loop done, tail = last loop done to last exit, all from this call's release)")
        print(pd.DataFrame(rows).round(2).to_string(index=False))
    for path in sorted(DEV.glob("adaptive_overhead_*.parquet")):
        df = pd.read_parquet(path)
        med = df.groupby(["case", "backend"], sort=False)[["plan_host", "runs_host", "step", "layers"]].median()
        print(f"\n{path.stem} (us, medians; benchmarks/adaptive_overhead.py: plan_host / runs_host = host time of "
              f"plan() / of the 32 run() calls, step = plan + 32 layers synchronised, layers = 32 layers alone)")
        print(med.round(1).to_string())
    for path in sorted(DEV.glob("plan_pieces_*.parquet")):
        df = pd.read_parquet(path)
        print(f"\n{path.stem} (us, median host time of each torch call a GPU plan is made of; "
              f"benchmarks/adaptive_overhead.py --pieces)")
        print(df.pivot_table(index="piece", columns="case", values="host_us", sort=False).round(1).to_string())
    for path in sorted(DEV.glob("replay_latency_*.parquet")):
        df = pd.read_parquet(path)
        med = df.pivot_table(index=["case", "backend"], columns="mode", values="time_us", aggfunc="median", sort=False)
        if {"as-is", "queued"} <= set(med.columns):
            queued = df[df["mode"] == "queued"].groupby(["case", "backend"], sort=False)["time_us"].median()
            asis = df[df["mode"] == "as-is"].set_index(["case", "backend"])["time_us"]
            med["as-is - queued"] = med["as-is"] - med["queued"]
            med["% as-is > queued + 1 us"] = 100 * (asis > queued.reindex(asis.index) + 1).groupby(level=[0, 1],
                                                                                                  sort=False).mean()
        med["host us per replay"] = df.groupby(["case", "backend"], sort=False)["replay_host_us"].median()
        print(f"\n{path.stem} (us per call, medians; benchmarks/replay_latency.py: as-is = the old kernel window, "
              f"queued = behind a GPU spin)")
        print(med.round(2).to_string())
    for path in sorted(DEV.glob("host_overhead_*.parquet")):
        df = pd.read_parquet(path)
        table = df.pivot_table(index=["case", "pdl", "loop_calls"], columns="mode", values="median_us", sort=False)
        print(f"\n{path.stem} (us per run() call on the host, median over loops that each start after a "
              f"synchronisation; benchmarks/host_overhead.py: *_cold = host caches flushed before each loop)")
        print(table.round(1).to_string())
        if "max_call_us" in df:
            longest = df.pivot_table(index=["case", "pdl", "loop_calls"], columns="mode", values="max_call_us",
                                     sort=False)
            print("each loop's longest call (us, median over loops)")
            print(longest.round(0).to_string())
    for path in sorted(DEV.glob("host_percpu_*.parquet")):
        df = pd.read_parquet(path)
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
    runs = {p.stem: pd.read_parquet(p) for p in sorted(DEV.glob("bench_kernels_*.parquet"))}
    runs["bench_kernels (committed)"] = pd.read_parquet(ROOT / "results" / "nvidia-h200" / "bench_kernels.parquet")
    rows = []
    for name, df in runs.items():
        k, med, base = kernel_medians(df)
        ratio = med[base].min(axis=1) / med["pkv-workqueue"]
        row = {"run": name, "read ceiling GB/s": float(k["read_ceiling_gbps"].median())}
        row.update({case: ratio.get(case) for case in (f"B{b}xN{n}" for b, n in ENGINE_MID_RANGE)})
        if "host_loop_us" in df:
            loop = eager_case_medians(df, "host_loop_us").loc["pkv-workqueue"]
            row.update({"host loop us (median of cases)": loop.median(), "worst case": loop.max()})
        row["pinned"] = bool("host_cpu" in df and (df["host_cpu"] >= 0).any())
        rows.append(row)
    print("\nbench_kernels runs side by side (pkv-workqueue: best baseline / ours, graph-replayed medians; "
          "the eager loop's host us per run() call)")
    print(pd.DataFrame(rows).set_index("run").round(3).to_string())
    alone = [pd.read_parquet(p) for p in sorted(DEV.glob("baseline_alone_*.parquet"))]
    if alone:
        df = pd.concat(alone)
        print("\nbaselines, one process each (median us per call)")
        print(df.groupby(["case", "backend"], sort=False)["time_us"].median().unstack().round(1).to_string())
    k, med, base = kernel_medians(runs["bench_kernels (committed)"])
    out = pd.DataFrame({"best_baseline": med[base].min(axis=1), "which": med[base].idxmin(axis=1),
                        "pkv-workqueue": med["pkv-workqueue"]})
    out["speedup"] = out["best_baseline"] / out["pkv-workqueue"]
    gbps = float(k["read_ceiling_gbps"].median())  # the run's ceiling (measured before and after its cases)
    kv = k.groupby("trace")["kv_bytes"].first()
    out["pkv % of read ceiling"] = 100 * kv / out["pkv-workqueue"] / 1e3 / gbps
    print(f"\nbench_kernels (all backends interleaved in one run; read ceiling {gbps:.0f} GB/s)")
    print(out.round(2).to_string())
    fastest_other = med.drop(columns=["torch-sdpa", "pkv-workqueue"], errors="ignore").min(axis=1)
    print(f"cases {len(out)}: faster than every baseline in {(out.speedup >= 1).sum()}, within 2 % of the "
          f"fastest backend in {(med['pkv-workqueue'] <= 1.02 * fastest_other).sum()}, lowest ratio "
          f"{out.speedup.min():.3f} ({out.speedup.idxmin()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
