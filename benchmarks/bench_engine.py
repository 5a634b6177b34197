"""Kernel development bench: our routes beside the baselines, CUDA-graph replay, cold L2.

    python benchmarks/bench_engine.py [--cases quick|full] [--out DIR]

For each case (B rows x N tokens, scattered pages) every backend is checked against float64 once,
then timed: CALLS calls cycling over R rotated copies of the KV pages (R x bytes >= 3 x L2) are
captured in one CUDA graph and replayed REPEATS times, interleaved across backends; the median per
call is reported with the read ceiling measured in the same process. This is the quick loop used
while tuning kernels (numbers go to benchmarks/NOTES.md); the artifact's measurements come from
`persistentkv bench-kernels` / `persistentkv measure`, which follow the full protocol.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from graph_timing import capture, rotated_copies, time_replays  # noqa: E402
from persistentkv.cache import make_batch  # noqa: E402
from persistentkv.spec import AttentionSpec  # noqa: E402

CASES = {
    "quick": [(1, 1024), (1, 4096), (1, 8192), (1, 16384), (1, 32768), (1, 65536), (1, 131072), (2, 16384),
              (4, 8192), (4, 32768), (16, 4096), (64, 8192), ("ragged8", None)],
}
CASES["full"] = CASES["quick"] + [(1, 262144), (2, 8192), (8, 8192), (8, 32768), (16, 16384), (64, 1024),
                                  (64, 4096), (2, 1024), (4, 1024), (8, 1024), (16, 1024), (4, 4096), (8, 4096)]
OURS = ["pkv-workqueue", "pkv-workqueue-host", "pkv-buckets", "pkv-split"]
BASELINES = ["flashinfer-tc", "flashinfer-cc", "vllm-fa3", "trtllm-xqa"]


def lengths_for(case):
    B, N = case
    if B == "ragged8":
        return [65536, 65536, 65536, 3000, 9000, 12000, 2500, 20000]
    return [N] * B


def read_ceiling_gbps(torch, nbytes=8 << 30) -> float:
    """A plain read: sum over a large fp16 buffer via a vectorised torch reduction (lower bound)."""
    x = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").uniform_()
    for _ in range(2):
        x.sum(dtype=torch.float32)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        x.sum(dtype=torch.float32)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    del x
    return nbytes / min(times) / 1e9


def make_backend(name):
    from persistentkv.backends import pkv

    table = {"pkv-workqueue": pkv.PKVWorkqueue, "pkv-workqueue-host": pkv.PKVWorkqueueHost,
             "pkv-buckets": pkv.PKVBuckets, "pkv-split": pkv.PKVSplit}
    if name in table:
        return table[name]()
    from persistentkv.backends import registry  # engineer B's adapters

    return registry.create(name)


def summarize(paths) -> int:
    """Median per (case, backend) across files, and ours / best baseline per case."""
    import pandas as pd

    df = pd.concat([pd.read_parquet(p) for p in paths])
    med = df.groupby(["case", "backend"], sort=False)["time_us"].median().unstack()
    order = df.drop_duplicates("case").sort_values(["batch_size", "max_len"])["case"]
    med = med.loc[[c for c in order if c in med.index]]
    ours = [c for c in med.columns if c.startswith("pkv")]
    base = [c for c in med.columns if c in BASELINES]
    kv = df.groupby("case")["kv_bytes"].first()
    ceiling = df["read_ceiling_gbps"].median()
    med["floor_us"] = kv.reindex(med.index) / ceiling / 1e3
    if ours and base:
        med["speedup"] = med[base].min(axis=1) / med[ours].min(axis=1)
    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.float_format", "{:.1f}".format):
        print(med)
    return 0


def main() -> int:
    import torch

    from gpu_support import reference_torch64, rel_err

    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="quick", choices=sorted(CASES))
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--backends", default=",".join(OURS + BASELINES))
    parser.add_argument("--summarize", nargs="*", help="print the comparison table of these parquet files and exit")
    args = parser.parse_args()
    if args.summarize is not None:
        return summarize(args.summarize)

    spec = AttentionSpec(32, 8, 128, 16, "float16")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    ceiling = read_ceiling_gbps(torch)
    print(f"GPU {torch.cuda.get_device_name()}  L2 {l2 >> 20} MB  read ceiling {ceiling:.0f} GB/s", flush=True)
    backends = {}
    for name in args.backends.split(","):
        try:
            b = make_backend(name)
            reasons = b.unavailable(spec)
            if reasons:
                print(f"  {name}: unavailable: {'; '.join(reasons)}")
                continue
            backends[name] = b
        except Exception as exc:  # a missing adapter must not stop the bench
            print(f"  {name}: unavailable: {type(exc).__name__}: {exc}")
    rows = []
    for case in CASES[args.cases]:
        lengths = lengths_for(case)
        base = make_batch(spec, lengths, hole_fraction=0.0, seed=1)
        case_bytes = base.kv_bytes
        copies, q = rotated_copies(spec, base, l2)
        R = len(copies)
        ref = reference_torch64(base, q, *copies[0])
        graphs, errors, keep = {}, {}, []
        for name, backend in backends.items():
            try:
                plan = backend.plan(base)
                out = torch.full_like(q, float("nan"))
                backend.run(q, copies[0], plan, out)
                torch.cuda.synchronize()
                errors[name] = rel_err(out, ref)
                graphs[name] = capture(lambda kv, b=backend, p=plan, o=out: b.run(q, kv, p, o), copies, args.calls)
                keep.append((plan, out))  # the graph reads the plan and writes into out: keep both alive
            except Exception as exc:
                print(f"  {case} {name}: failed: {type(exc).__name__}: {str(exc)[:300]}")
        times = time_replays(graphs, args.repeats, args.calls)
        label = f"B={case[0]} N={case[1]}" if case[1] else str(case[0])
        best_base = min((statistics.median(times[n]) for n in times if n in BASELINES), default=float("nan"))
        line = [f"{label:<16} {case_bytes / 1e6:7.1f} MB  floor {case_bytes / ceiling / 1e3:6.1f} us"]
        for name in graphs:
            med = statistics.median(times[name])
            err = errors[name]
            line.append(f"{name}={med:.1f}us({case_bytes / med / 1e3 / ceiling * 100:.0f}%{'' if err < 2e-3 else ' ERR %.1e' % err})")
            for rep, t in enumerate(times[name]):
                rows.append({"case": label, "batch_size": len(lengths), "max_len": max(lengths),
                             "kv_bytes": case_bytes, "backend": name, "repeat": rep, "time_us": t,
                             "rel_err": err, "read_ceiling_gbps": ceiling, "copies": R})
        ours = min((statistics.median(times[n]) for n in times if n.startswith("pkv")), default=float("nan"))
        line.append(f"| ours/best-baseline speedup {best_base / ours:.2f}x")
        print("  ".join(line), flush=True)
        del copies, graphs, keep
        torch.cuda.empty_cache()
    if rows:
        import pandas as pd

        tag = args.backends.replace(",", "_").replace("-", "") if len(args.backends) < 60 else "all"
        out = Path(args.out) / f"bench_engine_{tag}_{time.strftime('%H%M%S')}.parquet"
        out.parent.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(rows).to_parquet(out, index=False)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
