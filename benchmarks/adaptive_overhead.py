"""Where the adaptive backend's step rows lose time against the backend it routes to.

    python benchmarks/adaptive_overhead.py [--policy results/nvidia-h200/policy.json] [--repeats 40]

The published run has adaptive ~4 % behind pkv-workqueue on bucketed_b1 step rows (plan once +
32 layers, eager) while both run the same route and their kernel rows are equal. This times, per
case and interleaved (a shuffled order per repeat), the pieces of one step of each backend:
  plan_host   host time of plan() (the decision plus the delegate's plan)
  runs_host   host time of the 32 run() calls (before the closing synchronisation)
  step        synchronised wall time of plan + 32 runs (the step protocol's number)
  layers      synchronised wall time of 32 runs with the plan made before (no plan in the window)
Medians in us, with adaptive - pkv-workqueue per piece. Layers cycle over cold cache copies as in
the other benches. Writes adaptive_overhead_HHMMSS.parquet to --out ($OUT).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "benchmarks")]

import numpy as np  # noqa: E402

from bench_common import write_rows  # noqa: E402
from graph_timing import rotated_copies  # noqa: E402

CASES = {"B=1 N=8200": [8200], "B=1 N=32768": [32768], "B=8 N=4096": [4096] * 8}
LAYERS = 32


def one(backend, batch, q, copies, out, sync) -> dict:
    sync()
    t0 = time.perf_counter()
    plan = backend.plan(batch)
    t1 = time.perf_counter()
    for layer in range(LAYERS):
        backend.run(q, copies[layer % len(copies)], plan, out)
    t2 = time.perf_counter()
    sync()
    t3 = time.perf_counter()
    for layer in range(LAYERS):
        backend.run(q, copies[layer % len(copies)], plan, out)
    sync()
    t4 = time.perf_counter()
    return {"plan_host": (t1 - t0) * 1e6, "runs_host": (t2 - t1) * 1e6, "step": (t3 - t0) * 1e6,
            "layers": (t4 - t3) * 1e6}


def main() -> int:
    import pandas as pd
    import torch

    from persistentkv.backends import registry
    from persistentkv.cache import make_batch
    from persistentkv.spec import AttentionSpec

    parser = argparse.ArgumentParser()
    parser.add_argument("--policy", default=str(ROOT / "results" / "nvidia-h200" / "policy.json"))
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    t_start = time.time()
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    backends = {"adaptive": registry.create("adaptive", policy_path=args.policy),
                "pkv-workqueue": registry.create("pkv-workqueue")}
    rng = np.random.default_rng(0)
    rows = []
    for label, lengths in CASES.items():
        batch = make_batch(spec, lengths, seed=1)
        copies, q = rotated_copies(spec, batch, torch.cuda.get_device_properties(0).L2_cache_size)
        out = torch.empty_like(q)
        for name, b in backends.items():  # warm-up: modules, memo, allocator
            for _ in range(3):
                one(b, batch, q, copies, out, torch.cuda.synchronize)
        for r in range(args.repeats):
            for name in rng.permutation(list(backends)):
                rows.append({"case": label, "backend": name, "repeat": r,
                             **one(backends[name], batch, q, copies, out, torch.cuda.synchronize)})
        route = backends["adaptive"].last_decision.backend
        med = pd.DataFrame([x for x in rows if x["case"] == label]).groupby("backend").median(numeric_only=True)
        diff = med.loc["adaptive"] - med.loc["pkv-workqueue"]
        print(f"{label} (adaptive routes to {route}):")
        print(med.drop(columns="repeat").round(1).to_string())
        print("adaptive - pkv-workqueue: " + ", ".join(f"{k} {v:+.1f}" for k, v in diff.drop("repeat").items()),
              flush=True)
        del copies
        torch.cuda.empty_cache()
    write_rows(rows, args.out, "adaptive_overhead", t_start)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
