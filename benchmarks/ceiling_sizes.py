"""The read-ceiling kernel at several sizes: how far below the streaming rate is one size's rate?

    python benchmarks/ceiling_sizes.py [--gib 1,4,16,32] [--repeats 10] [--rounds 2] [--out F.parquet]

Until 69acc25 bench_kernels scaled every time by the read kernel's median over 4 GiB, and a kernel
that reads much more (B=64 x 128K: 34 GB) was measured above it by 0.1-0.3 % in two runs. This
prints each size's median time and GB/s and the least-squares line through all samples: its slope
(the streaming rate without fixed costs) and intercept. At 69acc25 the intercept was ~12 us and
the slope 1.1 % above the 4 GiB rate, so the run's ceiling is now the read kernel's median over
16 GiB, where those ~12 us are 0.3 % (persistentkv.ceiling.ceiling_gbps; a slope fitted per run
over five samples a size proved unsteady). Sizes run in interleaved rounds so drift hits all.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", default="1,4,16,32", help="comma-separated sizes in GiB")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sizes = [int(s) for s in args.gib.split(",")]
    from persistentkv.ceiling import fit_stream, measure_read
    from persistentkv.measure.device import TorchDevice

    device = TorchDevice()
    rows = []
    for rnd in range(args.rounds):
        for gib in sizes:
            for s in measure_read(device, gib * 2**30, repeats=args.repeats, warmup=2):
                rows.append({"round": rnd, "gib": gib, "bytes": s.bytes_moved, "time_us": s.time_us})
    for gib in sizes:
        ts = [r["time_us"] for r in rows if r["gib"] == gib]
        t = statistics.median(ts)
        print(f"{gib:3d} GiB  median {t:9.1f} us  {gib * 2**30 / t / 1e3:7.1f} GB/s  "
              f"(min {min(ts):.1f}, max {max(ts):.1f})")
    rate, intercept = fit_stream([r["bytes"] for r in rows], [r["time_us"] for r in rows])
    print(f"least squares over {len(rows)} samples: {rate:.1f} GB/s, intercept {intercept:.2f} us")
    if args.out:
        import pandas as pd

        pd.DataFrame(rows).to_parquet(args.out, index=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
