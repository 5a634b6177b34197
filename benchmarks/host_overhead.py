"""Host cost of one eager run() call with a reused plan (the issue's budget: < 15 us).

    python benchmarks/host_overhead.py

Times N back-to-back run() calls on a small problem whose kernels are shorter than the host
work, so the wall time per call is the host's; reports the median of several batches of calls.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from gpu_support import device_case  # noqa: E402
from persistentkv.engine import engine_for  # noqa: E402
from persistentkv.spec import AttentionSpec  # noqa: E402


def main() -> int:
    import torch

    spec = AttentionSpec(32, 8, 128, 16, "float16")
    batch, q, k, v = device_case(spec, [4096], hole_fraction=0.0)
    out = torch.empty_like(q)
    pdl_choices = (True, False) if torch.cuda.get_device_capability()[0] >= 9 else (False,)
    for route, pdl in ((r, p) for r in ("workqueue", "buckets") for p in pdl_choices):
        engine = engine_for(spec, pdl=pdl)  # PDL: cuLaunchKernelEx through ctypes; else CuPy's launchKernel
        plan = engine.plan(batch, route)
        for check in (True, False):
            samples = []
            for _ in range(20):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(200):
                    engine.run(q, (k, v), plan, out, check=check)
                samples.append((time.perf_counter() - t0) / 200 * 1e6)
            torch.cuda.synchronize()
            print(f"{route:10s} pdl={pdl!s:5s} check={check!s:5s} host us per run(): median {statistics.median(samples):.2f} "
                  f"min {min(samples):.2f}  launches {plan.num_launches}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
