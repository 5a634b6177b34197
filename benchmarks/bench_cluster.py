"""Kernel v5: the cluster route against the work queue and the baselines, under graph replay.

    python benchmarks/bench_cluster.py [--out DIR] [--cases B=1x4096,B=4x8192]

Per case (B=1 at 1K-128K, B=2 x 16K, B=4 x 8K, B=8 x 4K, B=4 x 32K; Hq=32, Hkv=8, D=128, fp16,
page 16): every variant is first checked against float64 (rel err printed), then timed by CUDA
graphs of 10 calls over rotated cache copies (cold L2), all variants of a case interleaved,
median of --repeats replays. Variants:
  wq            the GPU-planned balanced queue with its fused merge (v4)
  clC           the cluster route with C CTAs per cluster: the default C, C/2 and 2C where valid
  clC-1cta      the default C with one CTA per SM (dynamic shared memory raised to the opt-in limit)
  flashinfer-tc, vllm-fa3, trtllm-xqa   through the backend registry when they can run here
A variant that fails prints its reason and the bench goes on. The table gives the floor at the
read ceiling measured in this run, each variant, the best baseline, what plan.choose_route picks
("rule") and its speedup over the best baseline. Writes bench_cluster_HHMMSS.parquet to --out.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from graph_timing import capture, rotated_copies, time_replays  # noqa: E402
from persistentkv.cache import make_batch  # noqa: E402
from persistentkv.spec import AttentionSpec  # noqa: E402

CASES = [(1, 1024), (1, 4096), (1, 8192), (1, 16384), (1, 32768), (1, 65536), (1, 131072),
         (2, 16384), (4, 8192), (8, 4096), (4, 32768)]
BASELINES = ("flashinfer-tc", "vllm-fa3", "trtllm-xqa")


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def read_ceiling_gbps() -> float:
    from persistentkv.ceiling import measure_read, median_gbps
    from persistentkv.measure.device import TorchDevice

    try:
        return median_gbps(measure_read(TorchDevice("cuda"), nbytes=2**30, repeats=5, warmup=2))
    except Exception as exc:  # the bench still runs; the floor column says nan
        print(f"read ceiling: not measured ({first_line(exc)})")
        return math.nan


def variants_for(engine, batch, baselines: dict) -> dict:
    """name -> (plan, run(kv, plan, out)); a variant that cannot be planned is reported and left out."""
    from persistentkv.plan import CLUSTER_SIZES

    runs = {}

    def add(name, make_plan, run):
        try:
            runs[name] = (make_plan(), run)
        except Exception as exc:
            print(f"  {name}: not planned ({first_line(exc)})")

    ours = lambda q: (lambda kv, p, o: engine.run(q, kv, p, o))  # noqa: E731
    add("wq", lambda: engine.plan(batch, "workqueue"), ours)
    C = engine.cluster_size_for(batch.batch_size) if engine.capability[0] >= 9 else 1
    for c in sorted({C // 2, C, 2 * C} & set(CLUSTER_SIZES)):
        add(f"cl{c}", lambda c=c: engine.plan(batch, "cluster", cluster_size=c), ours)
    add(f"cl{C}-1cta", lambda: engine.plan(batch, "cluster", cluster_size=C,
                                           cluster_smem_bytes=engine.module.smem_optin), ours)
    for name, backend in baselines.items():
        add(name, lambda b=backend: b.plan(batch), lambda q, b=backend: (lambda kv, p, o: b.run(q, kv, p, o)))
    return runs


def main() -> int:
    import torch

    from gpu_support import TOLERANCE, reference_torch64, rel_err
    from persistentkv.backends import registry
    from persistentkv.engine import DevicePlan, engine_for
    from persistentkv.plan import choose_route

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--cases", default="", help="comma-separated BxN (e.g. 1x4096,4x8192); default all")
    args = parser.parse_args()
    cases = CASES if not args.cases else [tuple(int(x) for x in c.lower().replace("b=", "").split("x"))
                                          for c in args.cases.split(",")]
    t_start = time.time()
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    engine = engine_for(spec)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    ceiling = read_ceiling_gbps()
    print(f"{torch.cuda.get_device_name(0)}: {engine.num_sms} SMs, cc {engine.capability}, read ceiling "
          f"{ceiling:.0f} GB/s; kernel smem {engine.module.smem_bytes} B (opt-in max {engine.module.smem_optin})")
    baselines = {}
    for name in BASELINES:
        try:
            backend = registry.create(name)
            reasons = backend.unavailable(spec)
        except Exception as exc:
            reasons = [first_line(exc)]
        if reasons:
            print(f"{name}: skipped ({'; '.join(reasons)})")
        else:
            baselines[name] = backend
    rows, table = [], []
    for B, N in cases:
        case = f"B={B} N={N}"
        batch = make_batch(spec, [N] * B, seed=1)
        copies, q = rotated_copies(spec, batch, l2)
        ref = reference_torch64(batch, q, *copies[0])
        floor = batch.kv_bytes / (ceiling * 1e3) if ceiling > 0 else math.nan
        print(f"{case}: {batch.kv_bytes / 1e6:.1f} MB, floor {floor:.2f} us, {len(copies)} copies", flush=True)
        graphs, info = {}, {}
        for name, (plan, make_run) in variants_for(engine, batch, baselines).items():
            try:
                run = make_run(q)
                out = torch.full_like(q, float("nan"))
                run(copies[0], plan, out)
                torch.cuda.synchronize()
                err = rel_err(out, ref)
                occ = engine.occupancy(plan.launches[-1]) if isinstance(plan, DevicePlan) else -1
                graphs[name] = capture(lambda kv, r=run, p=plan, o=out: r(kv, p, o), copies, args.calls)
                info[name] = (err, occ)
                print(f"  {name}: rel err {err:.1e}{'' if err <= TOLERANCE['float16'] else '  WRONG'}"
                      + (f", {occ} CTA/SM" if occ >= 0 else ""))
            except Exception as exc:
                print(f"  {name}: failed ({first_line(exc)})")
                torch.cuda.synchronize()
        times = time_replays(graphs, args.repeats, args.calls) if graphs else {}
        med = {name: statistics.median(ts) for name, ts in times.items()}
        for name, ts in times.items():
            err, occ = info[name]
            rows += [{"case": case, "batch_size": B, "seq_len": N, "variant": name, "repeat": i, "time_us": t,
                      "rel_err": err, "ctas_per_sm": occ, "kv_bytes": batch.kv_bytes, "floor_us": floor,
                      "read_ceiling_gbps": ceiling} for i, t in enumerate(ts)]
        route, C = choose_route(batch.seq_lens, spec.num_kv_heads, engine.num_sms)
        rule = f"cl{C}" if route == "cluster" and engine.capability[0] >= 9 else "wq"
        ok = {n: t for n, t in med.items() if info[n][0] <= TOLERANCE["float16"]}
        base = {n: t for n, t in ok.items() if n in BASELINES}
        best_base = min(base.items(), key=lambda kv: kv[1]) if base else (None, math.nan)
        rule_us = ok.get(rule, math.nan)
        table.append((case, floor, med, rule, rule_us, best_base))
        del graphs, copies
        torch.cuda.empty_cache()
    print(f"\n{'case':<14} {'floor':>6}  variants (us; * = rule's pick)   best baseline   rule speedup   %ceiling(rule)")
    for case, floor, med, rule, rule_us, (bname, bus) in table:
        cells = " ".join(f"{'*' if n == rule else ''}{n}={t:.1f}" for n, t in med.items() if n not in BASELINES)
        print(f"{case:<14} {floor:6.1f}  {cells}   {bname}={bus:.1f}   {bus / rule_us:.2f}x   "
              f"{100 * floor / rule_us:.0f}%")
    import pandas as pd

    path = Path(args.out) / f"bench_cluster_{time.strftime('%H%M%S')}.parquet"
    pd.DataFrame(rows).to_parquet(path, index=False)
    print(f"wrote {path} ({time.time() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
