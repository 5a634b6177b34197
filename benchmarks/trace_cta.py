"""Where a step's time goes: a per-CTA timeline of our routes under CUDA-graph replay.

    python benchmarks/trace_cta.py [--cases 1x4096,4x8192] [--warps 4,8] [--routes workqueue,split]
                                   [--calls 10] [--repeats 9] [--heads 32:8] [--out DIR]

Builds the decode module with PKV_TRACE=1 (DecodeEngine(spec, trace=True); the engine's own
modules never trace): thread 0 of every decode CTA stamps %globaltimer (ns, one clock for the GPU)
and clock64 at its phases - 0 entry, 1 prologue issued (item and first page ids), 2 first stage landed, 3 K/V loop
done, 4 state written, 5 merge decided, 6 exit - and appends a record as it exits. A graph of
--calls calls over rotated cache copies (cold L2, as bench_common.py makes them) is replayed, then
replayed once more with the trace reset.

CTAs of call k+1 start only after call k has completed, so records come in call order: call =
record index // items. Per call (the first of the graph excluded: nothing precedes it in the
graph), relative to that call's release (the first CTA past its prologue), the table gives:
  period     release to the next call's release (the time per call under replay)
  gap        the previous call's last exit to this call's release (completion -> dependents; for
             the routes with a separate merge kernel, buckets and split, that kernel is in it)
  first      release to the first stage landed (median over CTAs): the first K/V round trip
  loop       release to the last CTA's loop done; floor = KV bytes / read ceiling of this run
  spread     the first CTA's loop done to the last's
  tail       the last loop done to the last exit (state written, atomic, merge, exit)
  skew       spread of the CTAs' releases (max - min)
and the untraced engine's time per call in the same process (the trace's own cost is the
difference; the untraced variants of a case are replayed interleaved, as bench_engine.py does).
Variants are named as in bench_engine.py (wq, wq8, buckets8, ...). Writes trace_cta_HHMMSS.parquet
(one row per record) to --out ($OUT) after every case.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "benchmarks")]

import numpy as np  # noqa: E402

from bench_common import (WARPS, add_out_option, capture, first_line, parse_cases, read_ceiling_gbps,  # noqa: E402
                          rotated_copies, time_replays, variant_name, write_rows)
from persistentkv.names import ENGINE_ROUTES  # noqa: E402

STAMPS = 7
FIELDS = 16  # the kernel's TRACE_FIELDS: 7 ns stamps, 7 cycle stamps, 2 meta words
PHASES = ("entry", "released", "first", "loop", "written", "decided", "exit")
CASES = "1x4096,1x16384,1x32768,1x65536,2x16384,4x8192,4x32768"


def parse_args(argv=None):
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out_option(parser)
    parser.add_argument("--calls", type=int, default=10, help="calls per CUDA graph (default 10)")
    parser.add_argument("--warps", default=",".join(map(str, WARPS)),
                        help="comma-separated warps per CTA (default 4,8)")
    parser.add_argument("--routes", default="workqueue", help=f"comma-separated routes ({', '.join(ENGINE_ROUTES)}; "
                        "default workqueue)")
    parser.add_argument("--cases", default=CASES, help=f"as bench_engine.py's (default {CASES})")
    parser.add_argument("--repeats", type=int, default=9, help="interleaved rounds of the untraced graphs (default 9)")
    parser.add_argument("--heads", default="32:8", help="query heads and kv heads, HQ:HKV (default 32:8; 4:1 is a "
                        "TP=8 shard of Llama-3-8B)")
    args = parser.parse_args(argv)
    try:
        args.warps = [int(w) for w in args.warps.split(",") if w.strip()]
    except ValueError:
        args.warps = []
    if not args.warps or any(w not in WARPS for w in args.warps):
        parser.error(f"--warps takes {' and/or '.join(map(str, WARPS))}")
    args.routes = [r.strip() for r in args.routes.split(",") if r.strip()]
    if not args.routes or any(r not in ENGINE_ROUTES for r in args.routes):
        parser.error(f"--routes takes some of {', '.join(ENGINE_ROUTES)}")
    parse_cases(args.cases)  # a bad case fails before any GPU work
    from bench_engine import parse_heads

    args.spec = parse_heads(args.heads)
    return args


def graph_us(replay, calls: int, repeats: int = 7) -> float:
    """Median us per call of ``repeats`` replays of one graph (bench_common.time_replays)."""
    return statistics.median(time_replays({"graph": replay}, repeats, calls)["graph"])


def read_trace(engine) -> np.ndarray:
    """The records of the last replay, [n, FIELDS] uint64."""
    import cupy

    raw = engine.module.raw
    count = int(cupy.ndarray((1,), dtype=cupy.uint32, memptr=raw.get_global("pkv_trace_count")).get()[0])
    buf = cupy.ndarray((1 << 16, FIELDS), dtype=cupy.uint64, memptr=raw.get_global("pkv_trace"))
    return buf[:min(count, 1 << 16)].get()


def reset_trace(engine) -> None:
    import cupy

    cupy.ndarray((1,), dtype=cupy.uint32, memptr=engine.module.raw.get_global("pkv_trace_count")).fill(0)


def records_frame(rec: np.ndarray, items: int, case: str, warps: int):
    import pandas as pd

    ns = rec[:, :STAMPS].astype(np.int64)
    cyc = rec[:, STAMPS:2 * STAMPS].astype(np.int64)
    meta0, meta1 = rec[:, 2 * STAMPS], rec[:, 2 * STAMPS + 1]
    df = pd.DataFrame({f"ns_{p}": ns[:, i] for i, p in enumerate(PHASES)})
    for i, p in enumerate(PHASES):
        df[f"cyc_{p}"] = cyc[:, i]
    df["sm"] = (meta0 & 0xFFFF).astype(np.int32)
    df["block"] = ((meta0 >> 16) & 0xFFFFFF).astype(np.int32)
    df["slot"] = (meta0 >> 40).astype(np.int32)
    df["merged"] = (meta1 & 0xFF).astype(np.int32)
    df["tokens"] = (meta1 >> 8).astype(np.int64)
    df["call"] = np.arange(len(df)) // items
    df.insert(0, "warps", warps)
    df.insert(0, "case", case)
    return df


def call_table(df, floor_us: float) -> dict:
    """Medians over the calls after the first of the phase figures of the module docstring (us)."""
    rows = []
    calls = sorted(df.call.unique())
    for k in calls[1:-1]:  # the period needs the next call's release
        cur, prev, nxt = (df[df.call == c] for c in (k, k - 1, k + 1))
        rel = cur.ns_released.min()
        done = cur.ns_loop.max()
        rows.append({
            "period": (nxt.ns_released.min() - rel) / 1e3,
            "gap": (rel - prev.ns_exit.max()) / 1e3,
            "first": float(np.median(cur.ns_first[cur.ns_first > 0] - rel)) / 1e3,
            "loop": (done - rel) / 1e3,
            "tail": (cur.ns_exit.max() - done) / 1e3,
            "skew": (cur.ns_released.max() - rel) / 1e3,
            "loop_spread": (done - cur.ns_loop.min()) / 1e3,
        })
    out = {key: statistics.median(r[key] for r in rows) for key in rows[0]} if rows else {}
    out["floor"] = floor_us
    return out


def last_cta_phases(df) -> dict:
    """Medians over the calls after the first of the last-exiting CTA's end phases (us): loop done to
    state written (``combine``: the cross-warp combine and the state's stores), written to merge
    decided (``arrive``: the arrival, and in a two-level merge the subgroup's fold and the second
    arrival), decided to exit (``merge``: the final fold and the output)."""
    rows = []
    for _, cur in df[df.call > df.call.min()].groupby("call"):
        last = cur.loc[cur.ns_exit.idxmax()]
        rows.append({"combine": (last.ns_written - last.ns_loop) / 1e3,
                     "arrive": (last.ns_decided - last.ns_written) / 1e3,
                     "merge": (last.ns_exit - last.ns_decided) / 1e3})
    return {key: statistics.median(r[key] for r in rows) for key in rows[0]} if rows else {}


def trace_variant(engine, batch, route: str, q, copies, calls: int):
    """One traced variant of a case: (items, traced us per call, records of one replay)."""
    import torch

    plan = engine.plan(batch, route)
    out = torch.empty_like(q)
    replay = capture(lambda kv: engine.run(q, kv, plan, out), copies, calls)
    traced_us = graph_us(replay, calls)
    items = len(engine.device_items(plan))
    reset_trace(engine)
    replay()
    torch.cuda.synchronize()
    return items, traced_us, read_trace(engine)


def main(argv=None) -> int:
    import pandas as pd
    import torch

    from persistentkv.cache import make_batch
    from persistentkv.engine import DecodeEngine, engine_for
    args = parse_args(argv)
    t_start = time.time()
    spec = args.spec
    ceiling = read_ceiling_gbps()
    print(f"{torch.cuda.get_device_name(0)}: read ceiling {ceiling:.0f} GB/s", flush=True)
    engines = {}
    for w in args.warps:
        try:
            engines[w] = (DecodeEngine(spec, warps=w, trace=True), engine_for(spec, warps=w))
        except Exception as exc:
            print(f"{w} warps: no engine ({first_line(exc)})")
    frames, table = [], []
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    for label, lengths in parse_cases(args.cases):
        batch = make_batch(spec, lengths, seed=1)
        copies, q = rotated_copies(spec, batch, l2)
        floor = batch.kv_bytes / (ceiling * 1e3)
        plain_graphs, traced, keep = {}, {}, []
        for (w, (tr_engine, plain)), route in ((e, r) for e in engines.items() for r in args.routes):
            name = variant_name(route, w)
            try:
                items, traced_us, rec = trace_variant(tr_engine, batch, route, q, copies, args.calls)
                pplan, pout = plain.plan(batch, route), torch.empty_like(q)
                keep.append((pplan, pout))  # the graph reads the plan and writes into out: both outlive it
                plain_graphs[name] = capture(lambda kv, e=plain, p=pplan, o=pout: e.run(q, kv, p, o), copies,
                                             args.calls)
            except Exception as exc:
                print(f"{label} {name}: failed ({first_line(exc)})", flush=True)
                torch.cuda.synchronize()
                continue
            if len(rec) != items * args.calls:
                print(f"{label} {name}: {len(rec)} records for {items} items x {args.calls} calls; skipped")
                continue
            traced[name] = (w, items, traced_us, rec)
        replays = time_replays(plain_graphs, args.repeats, args.calls) if plain_graphs else {}
        plain_us = {k: statistics.median(v) for k, v in replays.items()}
        for name, (w, items, traced_us, rec) in traced.items():
            df = records_frame(rec, items, label, w)
            df.insert(2, "variant", name)
            bad = [k for k, g in df.groupby("call") if sorted(g.slot) != list(range(items))]
            if bad:
                print(f"{label} {name}: calls {bad} do not hold each item once; records out of call order")
            times = {"plain": plain_us.get(name, float("nan")), "traced": traced_us}
            df["floor_us"], df["plain_us"], df["traced_us"] = floor, times["plain"], times["traced"]
            frames.append(df)
            stats = call_table(df, floor)
            ratio = np.median((df.cyc_exit - df.cyc_entry) / np.maximum(df.ns_exit - df.ns_entry, 1))
            table.append((label, name, items, times, stats, ratio))
            print(f"{label} {name}: {items} items, plain {times['plain']:.1f} us, traced "
                  f"{times['traced']:.1f} us, " + ", ".join(f"{k} {v:.2f}" for k, v in stats.items()), flush=True)
        if frames:
            write_rows(pd.concat(frames).to_dict("records"), args.out, "trace_cta", t_start, final=False)
        del copies, plain_graphs, keep
        torch.cuda.empty_cache()
    print(f"\n{'case':<14} {'variant':<9} {'items':>5} {'plain':>6} {'traced':>6} {'period':>6} {'floor':>6} "
          f"{'gap':>5} {'skew':>5} {'first':>5} {'loop':>6} {'spread':>6} {'tail':>5}  GHz")
    for label, name, items, times, s, ratio in table:
        print(f"{label:<14} {name:<9} {items:>5} {times['plain']:6.1f} {times['traced']:6.1f} {s['period']:6.1f} "
              f"{s['floor']:6.1f} {s['gap']:5.2f} {s['skew']:5.2f} {s['first']:5.2f} {s['loop']:6.1f} "
              f"{s['loop_spread']:6.2f} {s['tail']:5.2f}  {ratio:.2f}")
    if frames:
        write_rows(pd.concat(frames).to_dict("records"), args.out, "trace_cta", t_start)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
