"""A representative set of engine launches for compute-sanitizer (memcheck, racecheck, synccheck).

    compute-sanitizer --tool memcheck --kernel-name kns=pkv python benchmarks/sanitize_cases.py
    compute-sanitizer --tool synccheck python benchmarks/sanitize_cases.py --cluster-sizes 2,4,8
    compute-sanitizer --tool racecheck python benchmarks/sanitize_cases.py --warps 4,8

Small shapes (the tools slow kernels down by 100x or more) covering every kernel: the GPU planner,
fused and separate decode, the merge, the cluster route (C = 2 and 16), Q in registers and in shared memory, G = 1/4/7/16, page
sizes 8/16/128, empty splits, page-boundary lengths. Exits non-zero if any output is wrong.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from gpu_support import TOLERANCE, device_case, reference_torch64, rel_err  # noqa: E402
from persistentkv.engine import engine_for  # noqa: E402
from persistentkv.spec import AttentionSpec  # noqa: E402

CASES = [
    (AttentionSpec(32, 8, 128, 16, "float16"), [1, 15, 16, 17, 200, 1500], {}),
    (AttentionSpec(8, 8, 64, 8, "float16"), [7, 64, 65, 300], {}),
    (AttentionSpec(28, 4, 128, 128, "bfloat16"), [127, 128, 129, 900], {}),
    (AttentionSpec(64, 4, 256, 16, "bfloat16"), [33, 700], {}),
]


def main(argv: list[str] | None = None) -> int:
    import argparse

    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster-sizes", default="2,16",
                        help="comma-separated cluster sizes of the cluster route to launch (default 2,16)")
    parser.add_argument("--warps", default="4",
                        help="comma-separated CTA widths, 4 and/or 8 (8 runs only where head_dim <= 128; default 4)")
    parser.add_argument("--pdl", action="store_true",
                        help="also launch the queue routes with programmatic dependent launch (sm_90), twice each "
                             "(the second call reads its items before griddepcontrol.wait)")
    parser.add_argument("--pool", type=float, default=0.0,
                        help="also launch the GPU-planned queue with this pool share (DecodeEngine(pool=...)), three "
                             "times (with --pdl as well under PDL)")
    parser.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                        help="a preprocessor define for every module (development builds, e.g. PKV_L2HINT=256); "
                             "repeatable")
    args = parser.parse_args(argv)
    for define in args.define:
        if not re.fullmatch(r"PKV_[A-Z0-9_]+=\w+", define):
            parser.error(f"--define takes PKV_NAME=VALUE, got {define!r}")
    defines = tuple(args.define)
    sizes = [int(c) for c in args.cluster_sizes.split(",") if c.strip()]
    widths = [int(w) for w in args.warps.split(",") if w.strip()]
    if not widths or any(w not in (4, 8) for w in widths):
        parser.error(f"--warps takes 4 and/or 8, got {args.warps!r}")

    failures = 0

    def check(engine, batch, q, k, v, ref, route: str, options: dict, label: str, calls: int = 1) -> None:
        """``calls`` runs of one plan of ``route``, each into a NaN-poisoned output; the worst error
        against float64 is printed and counted."""
        nonlocal failures
        spec = engine.spec
        plan = engine.plan(batch, route, **options)
        outs = [torch.full_like(q, float("nan")) for _ in range(calls)]
        for out in outs:
            engine.run(q, (k, v), plan, out)
        torch.cuda.synchronize()
        err = max(rel_err(out, ref) for out in outs)
        ok = err <= TOLERANCE[spec.dtype]
        failures += not ok
        print(f"{spec.dtype} D={spec.head_dim} G={spec.group_size} P={spec.page_size} w{engine.warps} {label}: "
              f"rel err {err:.2e} {'ok' if ok else 'FAIL'}", flush=True)

    for (spec, lengths, _), warps in ((case, w) for case in CASES for w in widths):
        if warps == 8 and spec.head_dim > 128:
            continue
        engine = engine_for(spec, warps=warps, pdl=False, defines=defines)  # PDL: --pdl
        batch, q, k, v = device_case(spec, lengths, hole_fraction=0.5, seed=len(lengths))
        ref = reference_torch64(batch, q, k, v)
        for route, options in (("workqueue", {}), ("workqueue", {"chunk_rule": "closed"}), ("workqueue_host", {}),
                               ("buckets", {"num_splits": 4}), ("split", {"num_splits": 48}),
                               *(("cluster", {"cluster_size": c}) for c in sizes)):
            label = f"{route}{options.get('cluster_size', '')}{'-closed' if 'chunk_rule' in options else ''}"
            check(engine, batch, q, k, v, ref, route, options, label)
        if args.pdl:
            pdl = engine_for(spec, warps=warps, pdl=True, defines=defines)
            for route, options in (("workqueue", {}), ("buckets", {"num_splits": 4})):
                # two calls: the first waits before reading its items, the second does not
                check(pdl, batch, q, k, v, ref, route, options, f"{route}-pdl", calls=2)
        if args.pool:
            for pdl in (False, True) if args.pdl else (False,):
                pooled = engine_for(spec, warps=warps, pdl=pdl, pool=args.pool, defines=defines)
                check(pooled, batch, q, k, v, ref, "workqueue", {}, f"workqueue-pool{pooled.pool_units}"
                      f"{'-pdl' if pdl else ''}", calls=3)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
