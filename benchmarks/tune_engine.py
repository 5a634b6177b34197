"""Where our fixed cost goes: split counts, the merge, and decode alone, under graph replay.

    python benchmarks/tune_engine.py [--out DIR]

Per case (B=1 at 1K-32K, B=4 x 32K, B=16 x 4K): the balanced queue at several targets (items per
step), and, at the default target, the rectangular route with the same S timed three ways:
decode alone (merge launch dropped: output not valid, timing only), decode + merge launch, and
the fused queue. Differences between them place the fixed cost (benchmarks/NOTES.md).
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

CASES = [(1, 1024), (1, 4096), (1, 8192), (1, 16384), (1, 32768), (4, 32768), (16, 4096)]


def main() -> int:
    import torch

    from gpu_support import reference_torch64, rel_err
    from persistentkv.engine import engine_for

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=12)
    args = parser.parse_args()
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    engine = engine_for(spec)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"target_items default {engine.target_items} (occupancy {engine.module.occupancy} x {engine.num_sms} SMs)")
    rows = []
    for B, N in CASES:
        batch = make_batch(spec, [N] * B, seed=1)
        copies, q = rotated_copies(spec, batch, l2)
        ref = reference_torch64(batch, q, *copies[0])
        variants = {}
        for target in (33, 66, 132, 264, 396, 528):
            variants[f"wq{target}"] = engine.plan(batch, "workqueue_host", target_items=target)
        variants["wq-gpu"] = engine.plan(batch, "workqueue")
        S = int(variants[f"wq{engine.target_items}"].host_plan.row_splits.max()) if f"wq{engine.target_items}" in variants \
            else 32
        variants[f"split{S}"] = engine.plan(batch, "split", num_splits=S)
        decode_only = engine.plan(batch, "split", num_splits=S)
        decode_only.launches = [l for l in decode_only.launches if l.kind != "merge"]
        variants[f"split{S}-decode-only"] = decode_only
        graphs, info = {}, {}
        for name, plan in variants.items():
            out = torch.full_like(q, float("nan"))
            engine.run(q, copies[0], plan, out)
            torch.cuda.synchronize()
            err = rel_err(out, ref) if "decode-only" not in name else float("nan")
            graphs[name] = capture(lambda kv, p=plan, o=out: engine.run(q, kv, p, o), copies, args.calls)
            info[name] = (out, err, len(plan.host_plan.items) if plan.host_plan else -1)
        times = time_replays(graphs, args.repeats, args.calls)
        floor = batch.kv_bytes / 4.5e6
        line = [f"B={B} N={N} ({batch.kv_bytes / 1e6:.1f} MB, floor@4.5TB/s {floor:.1f} us):"]
        for name in graphs:
            med = statistics.median(times[name])
            out, err, items = info[name]
            line.append(f"{name}={med:.1f}" + (f"[{items}it]" if items >= 0 else "") +
                        ("" if math.isnan(err) or err < 2e-3 else f"(ERR {err:.1e})"))
            rows += [{"case": f"B={B} N={N}", "variant": name, "repeat": i, "time_us": t, "items": items,
                      "kv_bytes": batch.kv_bytes, "rel_err": err} for i, t in enumerate(times[name])]
        print("  ".join(line), flush=True)
        del graphs, info, copies
        torch.cuda.empty_cache()
    import pandas as pd

    path = Path(args.out) / f"tune_engine_{time.strftime('%H%M%S')}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path, index=False)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
