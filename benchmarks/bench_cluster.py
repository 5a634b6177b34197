"""Kernel v5: the cluster route against the work queue and the baselines, under graph replay.

    python benchmarks/bench_cluster.py [--out DIR] [--cases B=1x4096,B=4x8192] [--warps 4|8]

Per case (B=1 at 1K-128K, B=2 x 16K, B=4 x 8K, B=8 x 4K, B=4 x 32K; Hq=32, Hkv=8, D=128, fp16,
page 16): every variant is first checked against float64 (rel err printed), then timed by CUDA
graphs of 10 calls over rotated cache copies (cold L2), all variants of a case interleaved,
median of --repeats replays. Variants:
  wq            the GPU-planned balanced queue with its fused merge (v4)
  clC           the cluster route with C CTAs per cluster: the default C, C/2 and 2C where valid
  clC-1cta      the default C with one CTA per SM (dynamic shared memory raised to the opt-in limit;
                at 4 warps only: an 8-warp CTA already has one SM to itself)
--warps picks the engine's CTA (default 4, as v5 measured; 8: the one CTA per SM of the shipped
one-row queue, so clusters of 16 need 16 SMs of one GPC).
  flashinfer-tc, vllm-fa3, trtllm-xqa   through the backend registry when they can run here
A variant that fails prints its reason and the bench goes on. The table gives the floor at the
read ceiling measured in this run, each variant, the best baseline, what plan.choose_route picks
("rule") and its speedup over the best baseline. Writes bench_cluster_HHMMSS.parquet to --out.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from bench_common import (BASELINES, add_baselines, bench_args, engine_run, fastest, load_baselines,  # noqa: E402
                          planning_adder, read_ceiling_gbps, timed_cases, write_rows)
from persistentkv.spec import AttentionSpec  # noqa: E402


def variants_for(engine, batch, baselines: dict) -> dict:
    """name -> (plan, run(kv, plan, out)); a variant that cannot be planned is reported and left out."""
    from persistentkv.plan import CLUSTER_SIZES

    runs = {}
    add = planning_adder(runs)
    ours = engine_run(engine)
    add("wq", lambda: engine.plan(batch, "workqueue"), ours)
    C = engine.cluster_size_for(batch.batch_size) if engine.capability[0] >= 9 else 1
    for c in sorted({C // 2, C, 2 * C} & set(CLUSTER_SIZES)):
        add(f"cl{c}", lambda c=c: engine.plan(batch, "cluster", cluster_size=c), ours)
    if engine.warps == 4:
        add(f"cl{C}-1cta", lambda: engine.plan(batch, "cluster", cluster_size=C,
                                               cluster_smem_bytes=engine.module.smem_optin), ours)
    add_baselines(add, batch, baselines)
    return runs


def main() -> int:
    import torch

    from persistentkv.engine import engine_for
    from persistentkv.plan import choose_route

    args = bench_args(lambda parser: parser.add_argument("--warps", type=int, choices=(4, 8), default=4))
    t_start = time.time()
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    engine = engine_for(spec, warps=args.warps)
    ceiling = read_ceiling_gbps()
    print(f"{torch.cuda.get_device_name(0)}: {engine.num_sms} SMs, cc {engine.capability}, read ceiling "
          f"{ceiling:.0f} GB/s; kernel smem {engine.module.smem_bytes} B (opt-in max {engine.module.smem_optin})")
    baselines = load_baselines(spec)
    rows, table = [], []
    for label, batch, med, ok, floor in timed_cases(engine, spec, args,
                                                     lambda batch: variants_for(engine, batch, baselines),
                                                     ceiling, rows, "bench_cluster", t_start):
        route, C = choose_route(batch.seq_lens, spec.num_kv_heads, engine.num_sms)
        rule = f"cl{C}" if route == "cluster" and engine.capability[0] >= 9 else "wq"
        table.append((label, floor, med, rule, ok.get(rule, math.nan), fastest(ok, lambda n: n in BASELINES)))
    print(f"\n{'case':<14} {'floor':>6}  variants (us; * = rule's pick)   best baseline   rule speedup   %ceiling(rule)")
    for case, floor, med, rule, rule_us, (bname, bus) in table:
        cells = " ".join(f"{'*' if n == rule else ''}{n}={t:.1f}" for n, t in med.items() if n not in BASELINES)
        print(f"{case:<14} {floor:6.1f}  {cells}   {bname}={bus:.1f}   {bus / rule_us:.2f}x   "
              f"{100 * floor / rule_us:.0f}%")
    write_rows(rows, args.out, "bench_cluster", t_start)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
