"""8-warp CTAs (128-token stages) against the 4-warp kernel and the baselines, under graph replay.

    python benchmarks/bench_warps.py [--out DIR] [--cases B=1x4096,B=4x8192] [--waves 2,4]

The question: a 4-warp CTA keeps STAGES - 1 = 2 stages of 32 KB in flight, so the chip needs two
CTAs per SM to reach its read bandwidth, and the cluster route's one CTA per SM starves; an
8-warp CTA's 64 KB stages (192 KB of shared memory, one CTA per SM) keep 128 KB in flight. Same
cases, harness and table as bench_cluster.py (bench_common.py): Hq=32, Hkv=8, D=128, fp16,
page 16; every variant checked against float64, then CUDA graphs of --calls calls over rotated
cache copies (cold L2), all variants of a case interleaved, median of --repeats replays. Variants:
  wq            the GPU-planned queue, 4 warps (default target_items: occupancy x SMs)
  wq8           the same queue on the 8-warp module (its own default target_items and min chunk)
  wq-closed     the 4-warp queue with the v2-v6 closed-form chunk (chunk_rule="closed") instead of
                the smallest chunk that fits the wave
  wq@xW, wq8@xW the queues with W times their default target_items (--waves W,...): W waves of
                shorter items, which the hardware hands to SMs as earlier CTAs leave; W < 1, fewer
                and longer items (wq@x0.5: one 4-warp CTA per SM, leaving each SM room for one CTA
                of the next call, which PDL lets start its early K/V loads there)
  wq-poolU, wq8-poolU   the queues with a pool of U sixteenths of each row (--pools, DecodeEngine(pool=U/16))
  wqh, wqh8     (--spare) the same queues planned on the host (route workqueue_host)
  wqh-spareL, wqh8-spareL, wqh-spareF, wqh8-spareF   (--spare) the host queue with its spare slots
                (target_items - items) given to the last (L) or first (F) groups, one more split
                each: the hardware hands out CTAs in block order as SMs free up, so the last ones
                land on the SMs the previous call's merges held and start late (NOTES v16, "Late CTAs")
  wq-nopdl, wq8-nopdl   the queues without programmatic dependent launch (DecodeEngine(pdl=False));
                the others use it where the device has it (sm_90), so consecutive calls of a graph
                overlap one call's start with the last one's end
  cl8, cl16     the cluster route at 4 warps, C = 8 and 16
  cl8w8, cl16w8 the cluster route at 8 warps
  flashinfer-tc, vllm-fa3, trtllm-xqa   through the backend registry when they can run here
  read          not attention: the read-ceiling kernel over a contiguous buffer of the case's KV
                bytes (bench_common.PlainRead), the time a kernel that only streams them takes
Cluster variants run only where B * Hkv * C <= SMs (one CTA per SM, one wave: the case the
8-warp CTA is for). The table gives the floor at the read ceiling measured in this run, each
variant, the best baseline, the best 4-warp and 8-warp variants and the 8-warp speedup (best
4-warp time / best 8-warp time). Writes bench_warps_HHMMSS.parquet to --out ($OUT).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from bench_common import (BASELINES, NOT_ATTENTION, add_baselines, add_plain_read, add_queue, bench_args,  # noqa: E402
                          engine_run, fastest, first_line, load_baselines, planning_adder, queue_name,
                          read_ceiling_gbps, timed_cases, write_rows)
from persistentkv import plan as planner  # noqa: E402
from persistentkv.errors import PKVError  # noqa: E402
from persistentkv.spec import AttentionSpec  # noqa: E402

CLUSTER_SIZES = (8, 16)


def spare_split(host, target_items: int, last: bool):
    """``host`` (a workqueue_host Plan, items in (row, kv head, split) order) with its spare slots,
    target_items - items, given to as many groups of the queue's end (``last``) or start, one
    more split each over the same tokens (plan._items_for_rows' balanced ranges, by that function)."""
    import dataclasses

    import numpy as np

    items = host.items.astype(np.int64)
    spare = target_items - items.shape[0]
    starts = np.flatnonzero((items[:, 3] & 0xFFFF) == 0)
    bounds = list(zip(starts, list(starts[1:]) + [items.shape[0]]))
    chosen = set(range(len(bounds) - spare, len(bounds)) if last else range(spare)) if spare > 0 else set()
    blocks = []
    for g, (a, b) in enumerate(bounds):
        block = items[a:b]
        if g in chosen and block[-1, 2] - block[0, 1] >= planner.TILE_TOKENS * (b - a + 1):
            # one (row, kv head): the planner's items of one row and one head, re-headed
            block = planner._items_for_rows([0], [int(block[-1, 2])], [b - a + 1], 1, True).astype(np.int64)
            block[:, 0] = items[a, 0]
        blocks.append(block)
    new = np.concatenate(blocks).astype(np.int32)
    return dataclasses.replace(host, items=new, merge_groups=planner._merge_groups(new, 0),
                               launches=(planner.Launch("fused", 0, new.shape[0]),))


def add_spare(add, batch, name: str, engine) -> None:
    """Register the host-planned queue (``name``) and its spare-split forms (``name``-spareL/F)."""
    def plan_with(last):
        host = planner.plan_workqueue(batch, target_items=engine.target_items, min_chunk_tiles=engine.min_chunk_tiles)
        if last is not None:
            host = spare_split(host, engine.target_items, last)
        return engine._upload(batch, host, "workqueue_host")
    for suffix, last in (("", None), ("-spareL", True), ("-spareF", False)):
        add(name + suffix, lambda last=last: plan_with(last), engine_run(engine))


def variants_for(engines: dict, batch, baselines: dict, plain_engines: dict | None = None,
                 waves: tuple = (), pool_engines: dict | None = None, spare: bool = False) -> dict:
    """name -> (plan, run(kv, plan, out)) over ``engines`` (warps -> DecodeEngine, PDL where the
    device has it) and ``plain_engines`` (warps -> DecodeEngine(pdl=False)); a variant that cannot
    be planned is reported and left out."""
    runs = {}
    add = planning_adder(runs)
    for warps, engine in engines.items():
        name = queue_name(warps)
        add_queue(add, batch, name, engine)
        for w in waves:  # the queue over w times the engine's default target (w < 1: fewer, longer items)
            add_queue(add, batch, f"{name}@x{w:g}", engine, target_items=max(1, round(w * engine.target_items)))
        if warps == 4:
            add_queue(add, batch, f"{name}-closed", engine, chunk_rule="closed")
        if spare:
            add_spare(add, batch, queue_name(warps, "wqh"), engine)
    for warps, engine in (plain_engines or {}).items():
        add_queue(add, batch, queue_name(warps) + "-nopdl", engine)
    for (warps, units), engine in (pool_engines or {}).items():
        add_queue(add, batch, queue_name(warps) + f"-pool{units}", engine)
    for warps, engine in engines.items():
        suffix = "" if warps == 4 else f"w{warps}"
        one_wave = [c for c in CLUSTER_SIZES if batch.batch_size * batch.spec.num_kv_heads * c <= engine.num_sms]
        for c in one_wave if engine.capability[0] >= 9 else ():
            add(f"cl{c}{suffix}", lambda e=engine, c=c: e.plan(batch, "cluster", cluster_size=c), engine_run(engine))
    add_baselines(add, batch, baselines)
    add_plain_read(add, batch)
    return runs


def is_w8(name: str) -> bool:
    return name.startswith(("wq8", "wqh8")) or name.endswith("w8")


def main() -> int:
    import torch

    from persistentkv.engine import engine_for

    def extra(parser):
        parser.add_argument("--waves", default="", help="comma-separated multiples w of each queue's default "
                            "target_items: adds the variants wq@xw and wq8@xw (w waves of items, shorter items "
                            "on ragged rows)")
        parser.add_argument("--spare", action="store_true", help="adds the host-planned queues and their "
                            "spare-split forms (wqh, wqh-spareL, wqh-spareF and the 8-warp ones)")
        parser.add_argument("--pools", default="", help="comma-separated pool shares (multiples of 1/16): adds "
                            "wq-poolU and wq8-poolU, U = share x 16")

    args = bench_args(extra)
    try:
        waves = tuple(float(w) for w in args.waves.split(",") if w.strip())
    except ValueError:
        raise SystemExit(f"--waves: {args.waves!r} is not comma-separated numbers") from None
    if any(w <= 0 or w == 1 for w in waves):
        raise SystemExit("--waves: each multiple must be > 0 and not 1 (1 is the default queue, wq / wq8)")
    t_start = time.time()
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    engines = {}
    for warps in (4, 8):
        try:
            engines[warps] = engine_for(spec) if warps == 4 else engine_for(spec, warps=warps)
        except Exception as exc:  # e.g. a GPU whose opt-in shared memory is below 192 KB
            print(f"{warps} warps: no engine ({first_line(exc)})")
    plain_engines = {warps: engine_for(spec, warps=warps, pdl=False) for warps in engines}
    try:
        pools = [float(x) for x in args.pools.split(",") if x.strip()]
        pool_engines = {(warps, planner.check_pool(share)): engine_for(spec, warps=warps, pool=share)
                        for warps in engines for share in pools if share > 0}
    except (ValueError, PKVError) as exc:
        raise SystemExit(f"--pools: {exc}") from None
    engine = engines[4]
    ceiling = read_ceiling_gbps()
    print(f"{torch.cuda.get_device_name(0)}: {engine.num_sms} SMs, cc {engine.capability}, read ceiling "
          f"{ceiling:.0f} GB/s")
    for warps, e in engines.items():
        m = e.module
        print(f"  {warps} warps: {m.threads} threads, {m.tile}-token stages x {m.stages}, smem {m.smem_bytes} B, "
              f"{m.occupancy} CTA/SM, target_items {e.target_items}, min chunk {e.min_chunk_tiles} tiles")
    baselines = load_baselines(spec)
    rows, table = [], []
    def variants(batch):
        return variants_for(engines, batch, baselines, plain_engines, waves, pool_engines, args.spare)

    for label, _, med, ok, floor in timed_cases(engine, spec, args, variants, ceiling, rows, "bench_warps", t_start):
        ok = {n: t for n, t in ok.items() if n not in NOT_ATTENTION}
        best = {"base": fastest(ok, lambda n: n in BASELINES),
                "w4": fastest(ok, lambda n: n not in BASELINES and not is_w8(n)), "w8": fastest(ok, is_w8)}
        table.append((label, floor, med, best))
    print(f"\n{'case':<14} {'floor':>6}  variants (us)   best baseline   best 4-warp   best 8-warp   "
          f"8-warp speedup   %ceiling(best 8-warp)")
    for case, floor, med, best in table:
        cells = " ".join(f"{n}={t:.1f}" for n, t in med.items() if n not in BASELINES)
        (bn, bus), (n4, t4), (n8, t8) = best["base"], best["w4"], best["w8"]
        print(f"{case:<14} {floor:6.1f}  {cells}   {bn}={bus:.1f}   {n4}={t4:.1f}   {n8}={t8:.1f}   "
              f"{t4 / t8:.2f}x   {100 * floor / t8:.0f}%")
    write_rows(rows, args.out, "bench_warps", t_start)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
