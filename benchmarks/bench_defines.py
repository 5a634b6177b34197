"""A development define of kernels/pkv_decode.cu against the shipped kernel and the baselines,
under graph replay.

    python benchmarks/bench_defines.py [--define PKV_TMA=1[,PKV_X=1...]] [--out DIR] [--cases B=1x4096,B=4x8192]
                                       [--repeats 15] [--warps 4,8]

The defines (benchmarks/NOTES.md):
  PKV_TMA=1    (v10) K/V tiles by TMA, one tensor-map box per lane of warp 0 (16 tokens x 64 dims
               of one page and head, 2 KB, 128-byte swizzle)
  PKV_EARLY=1  (v12, at commit 6b2f02b only: since then the engine's default, early_kv) the
               first stages' K/V loads of every page but each item's last issued before
               griddepcontrol.wait, overlapping the preceding kernel's tail
  PKV_POOL=1   (v15) the fused queue with its pool code (items unpooled: what the code alone costs)
  PKV_RING_STATIC=1  (v15) the pool's ring in static shared memory (before the pipeline)
  PKV_EARLY_ALL=1    (at commits aea7892-09eb4bd only) early K/V loads of all STAGES first tiles
                     instead of STAGES - 1
  PKV_EARLY_L2=N     (the same) with early K/V loads, the next N tiles prefetched into L2
  PKV_COMBINE1=1     (at 09eb4bd only; the kernel's combine since) the cross-warp combine with one barrier
  PKV_FIXED_MERGER=1 (at 09eb4bd only) each group's last split merges after the others' release adds
  PKV_EARLY_STAGES=N early K/V loads of the first min(N, STAGES - 1) tiles only
  PKV_L2HINT=128|256 K/V loads (cp.async) with that L2 prefetch size
  PKV_DEEP_K=1       (at 8ee897f-dff547b only) K's ring one stage deeper than V's (4 and 3 stages;
                     measured 4-16 % slower)
  PKV_FULLRING=1     (at 76b02aa-dff547b only) tile t + STAGES loaded right after tile t's compute
                     (a second barrier), every stage of the ring in flight; measured 1-9 % slower
  PKV_WARPRING=1     (at 21a364f only) each warp loads its own 16 token rows and waits only for
                     them (cp.async.wait_group + __syncwarp), no CTA barrier per tile; neutral
  PKV_ADDR64=1       (at 21873eb only) K/V addresses by v16's 64-bit math
  PKV_PAGES32=1      (at 0ee8c07 only) page-id loads by unsigned offsets off a 64-bit table address
  PKV_SMEM_PAD=N     (at 76bb9c9-0ee8c07 only) N more bytes of unused shared memory per CTA
  PKV_CARVEOUT=N     (the same) not a kernel define: the decode kernels' preferred carveout, N %
  PKV_LLMERGE=1      (at 551b618-6d7ae78 only) the fused merge without a fence: every split stores its
                     state with relaxed stores, the last to arrive polls the states, which hold a
                     sentinel until written; measured no faster (v21)
  heads=N            (v20; measured slower, closed) not a define alone: PKV_HEADSPLIT=N built in,
                     and the queue planned for Hkv * N virtual kv heads of G / N query heads each
                     (N CTAs per kv head and token range, sharing its K/V bytes through L2), run
                     without the engine's checks (they would refuse the real cache's Hkv)
Several defines, comma-separated, are compared side by side (one variant pair each); '+' joins
defines built into one module (PKV_POOL=1+PKV_POOL_NOCLAIM=1). A part without the PKV_ prefix is
an engine option instead, NAME=0|1 for DecodeEngine's switches (early_kv=0: the shipped kernel
without early K/V loads; PKV_EARLY_ALL=1+early_kv=0 is allowed but loads nothing early), or
pool=U, DecodeEngine(pool=U/16): the pooled queue (PKV_POOL=1+PKV_POOL_NOPROLOGUE=1+pool=2: its
claims from the loop only; correct only while every pooled item has more than STAGES stages), or
heads=N (above).
Same cases, harness and table as bench_warps.py (bench_common.py): every variant checked against
float64, then CUDA graphs over rotated cold copies, all interleaved:
  wq, wq8           the GPU-planned queue, 4 and 8 warps (the shipped kernel)
  wq-TAG, wq8-TAG   the same queues built with the define (TAG: its name after PKV_, lower case)
  flashinfer-tc, vllm-fa3, trtllm-xqa   the baselines, where they run here
  read              the read-ceiling kernel over the case's bytes (not attention)
Writes bench_TAG_HHMMSS.parquet to --out ($OUT).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from bench_common import (add_baselines, add_plain_read, add_queue, bench_args, comparison_row,  # noqa: E402
                          first_line, load_baselines, planning_adder, print_comparison, print_paired,
                          queue_name, read_ceiling_gbps, timed_cases, write_rows)
from persistentkv.spec import AttentionSpec  # noqa: E402


ENGINE_SWITCHES = ("early_kv", "pdl")
HEAD_SPLITS = (2, 4, 8, 16)  # heads=N: virtual kv heads per kv head; head_split_spec refuses an N that does not
                             # divide the group (G = 4 here: 2 and 4)


def head_split_spec(spec: AttentionSpec, heads: int) -> AttentionSpec:
    """The spec the heads=N queue is planned for: Hkv * N kv heads of G / N query heads each."""
    group = spec.num_qo_heads // spec.num_kv_heads
    if heads < 1 or group % heads:
        raise ValueError(f"heads={heads} does not divide the group of {group} query heads per kv head")
    return AttentionSpec(spec.num_qo_heads, spec.num_kv_heads * heads, spec.head_dim, spec.page_size, spec.dtype)


def head_split_batch(batch, vspec: AttentionSpec):
    """``batch`` on the virtual spec: the same rows, pages and page table."""
    from persistentkv.cache import Batch

    return Batch(vspec, batch.seq_lens, batch.kv_indptr, batch.kv_indices, batch.num_pages)


def variant_build(entry: str) -> tuple[tuple[str, ...], dict]:
    """A '+'-joined --define entry as (kernel defines, DecodeEngine switches): PKV_* parts are
    defines, NAME=0|1 parts (NAME in ENGINE_SWITCHES) engine switches, pool=U the pool share U/16,
    heads=N (N in HEAD_SPLITS) the define PKV_HEADSPLIT=N plus option ``heads`` (main() plans it for
    Hkv * N virtual kv heads); anything else a ValueError."""
    defines, options = [], {}
    for part in entry.split("+"):
        if part.startswith("PKV_HEADSPLIT"):
            raise ValueError(f"{part!r}: say heads=N, which also plans for the virtual kv heads")
        if part.startswith("PKV_"):
            defines.append(part)
            continue
        name, _, value = part.partition("=")
        if name == "pool" and value.isdigit() and 0 < int(value) < 16:
            options["pool"] = int(value) / 16
            continue
        if name == "heads" and value.isdigit() and int(value) in HEAD_SPLITS:
            options["heads"] = int(value)
            defines.append(f"PKV_HEADSPLIT={value}")
            continue
        if name not in ENGINE_SWITCHES or value not in ("0", "1"):
            raise ValueError(f"{part!r} is neither PKV_NAME[=VALUE], pool=U (1..15), heads=N "
                             f"({', '.join(map(str, HEAD_SPLITS))}) nor one of {', '.join(ENGINE_SWITCHES)} =0|1")
        options[name] = value == "1"
    return tuple(defines), options


def variant_tag(part: str) -> str:
    """A part's name in variant names: PKV_EARLY_ALL=1 -> early_all, PKV_EARLY_L2=4 -> early_l2v4,
    early_kv=0 -> early_kv0."""
    if part.startswith("PKV_"):
        name, _, value = part.partition("=")
        return name.removeprefix("PKV_").lower() + (f"v{value}" if value not in ("", "1") else "")
    return part.replace("=", "")


def main() -> int:
    import torch

    from persistentkv.engine import engine_for

    def extra(parser):
        parser.add_argument("--define", default="PKV_TMA=1",
                            help="the development defines to compare (PKV_NAME[=VALUE], comma-separated)")
        parser.add_argument("--warps", default="4,8", help="the modules' warps, comma-separated (4, 8)")

    args = bench_args(extra)
    warps_list = tuple(int(w) for w in args.warps.split(",") if w.strip())
    if not warps_list or any(w not in (4, 8) for w in warps_list):
        raise SystemExit(f"--warps: {args.warps!r} is not a comma-separated list of 4 and 8")
    defines = [d.strip() for d in args.define.split(",") if d.strip()]
    try:
        builds = {d: variant_build(d) for d in defines}
    except ValueError as exc:
        raise SystemExit(f"--define: {exc}") from None
    tags = {d: "+".join(variant_tag(x) for x in d.split("+")) for d in defines}
    tag = "_".join(tags.values())
    file_tag = tag.replace("+", "-")  # the device host returns no file whose name holds a plus sign
    t_start = time.time()
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    engines, split_heads = {}, {}  # split_heads: name -> the virtual spec of a heads=N queue
    for warps in warps_list:
        for define in (None, *defines):
            name = queue_name(warps) + (f"-{tags[define]}" if define else "")
            try:
                kernel_defines, options = builds[define] if define else ((), {})
                options = dict(options)
                heads = options.pop("heads", 1)
                engine_spec = head_split_spec(spec, heads) if heads > 1 else spec
                engines[name] = engine_for(engine_spec, warps=warps, defines=kernel_defines, **options)
                if heads > 1:
                    split_heads[name] = engine_spec
            except Exception as exc:
                print(f"{name}: no engine ({first_line(exc)})")
    ceiling = read_ceiling_gbps()
    print(f"{torch.cuda.get_device_name(0)}: read ceiling {ceiling:.0f} GB/s")
    for name, e in engines.items():
        m = e.module
        print(f"  {name}: {m.threads} threads, {m.tile}-token stages x {m.stages}, smem {m.smem_bytes} B, "
              f"{m.occupancy} CTA/SM, target_items {e.target_items}")
    baselines = load_baselines(spec)

    def variants_for(batch):
        runs = {}
        add = planning_adder(runs)
        for name, engine in engines.items():
            if name in split_heads:  # planned on the virtual kv heads; the real cache fails the checks' shapes
                add(name, lambda e=engine, v=split_heads[name]: e.plan(head_split_batch(batch, v), "workqueue"),
                    lambda q, e=engine: (lambda kv, p, o: e.run(q, kv, p, o, check=False)))
            else:
                add_queue(add, batch, name, engine)
        add_baselines(add, batch, baselines)
        add_plain_read(add, batch)
        return runs

    rows, table = [], []
    any_engine = next((e for n, e in engines.items() if n not in split_heads), next(iter(engines.values())))
    for label, _, med, ok, floor in timed_cases(any_engine, spec, args, variants_for, ceiling, rows, f"bench_{file_tag}",
                                                t_start):
        table.append(comparison_row(label, floor, med, ok, lambda n: any(n.endswith(f"-{t}") for t in tags.values())))
    print_comparison(table, tag)
    write_rows(rows, args.out, f"bench_{file_tag}", t_start)
    print_paired(pd.DataFrame(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
