"""A representative set of engine launches for compute-sanitizer (memcheck, racecheck, synccheck).

    compute-sanitizer --tool memcheck --kernel-name kns=pkv python benchmarks/sanitize_cases.py --warps 4,8
    compute-sanitizer --tool racecheck python benchmarks/sanitize_cases.py --warps 4,8
    compute-sanitizer --tool synccheck python benchmarks/sanitize_cases.py --warps 4,8
    compute-sanitizer --tool racecheck --kernel-name kns=pkv python benchmarks/sanitize_cases.py --warps 4,8 \
        --kv-dtype float8_e4m3 --ctas 3,4

Small shapes (the tools slow kernels down by 100x or more) covering every kernel of the shipped
routes: the GPU planner, the fused work queue, the separate decode and merge of buckets and split,
Q in registers and in shared memory, G = 1/4/7/8/16, head dims 64/128/256, page sizes 8/16/128,
empty splits, page-boundary lengths, groups split past the merge's fan-in (the two-level merge:
one kv head, one long row), at 4 and 8 warps per CTA. Each launch writes into a
NaN-poisoned output checked against float64; exits non-zero if any output is wrong.

``--kv-dtype float8_e4m3``: the same cases over e4m3 codes (the FP8 modules), K and V scaled per KV
head (heads of different magnitudes, so a scale read for the wrong head shows) and quantised with
per-KV-head scales; the reference reads the codes' values (code x scale) in float64. ``--ctas 3,4``
adds the FP8 4-warp modules built for 3 and 4 resident CTAs per SM (head_dim <= 128). With an FP8
cache, give racecheck ``--kernel-name kns=pkv``: the script's per-head scales come from torch's amax,
whose reduce_kernel racecheck reports (14 hazards at a66ff0e, none in ours).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from gpu_support import TOLERANCE, device_case, reference_torch64, row_head_errors_torch  # noqa: E402
from persistentkv.engine import engine_for  # noqa: E402
from persistentkv.launch import ENGINE_CTAS_PER_SM  # noqa: E402
from persistentkv.spec import AttentionSpec  # noqa: E402

CASES = [
    (AttentionSpec(32, 8, 128, 16, "float16"), [1, 15, 16, 17, 200, 1500]),
    (AttentionSpec(8, 8, 64, 8, "float16"), [7, 64, 65, 300]),
    (AttentionSpec(28, 4, 128, 128, "bfloat16"), [127, 128, 129, 900]),
    (AttentionSpec(64, 4, 256, 16, "bfloat16"), [33, 700]),
    # one kv head and one long row: the work queue splits the one group past MERGE_FANIN (two-level merge)
    (AttentionSpec(4, 1, 128, 16, "float16"), [20000]),
    (AttentionSpec(16, 2, 128, 16, "bfloat16"), [1, 6000, 257]),
]
#: every shipped route, with split counts that leave some splits empty on these short rows
ROUTES = (("workqueue", {}), ("buckets", {"num_splits": 4}), ("split", {"num_splits": 48}))
FP8_KV = "float8_e4m3"


def fp8_cache(k, v):
    """((K codes, V codes, k_scale, v_scale), K64, V64): K and V scaled per KV head by 0.5-2, then
    e4m3 codes with per-KV-head scales (largest magnitude / 448, saturating) and their values."""
    import torch

    gain = torch.linspace(0.5, 2.0, k.shape[2], device=k.device).view(1, 1, -1, 1)
    out, values = [], []
    for x in (k.float() * gain, v.float() * gain):
        scale = (x.abs().amax(dim=(0, 1, 3)) / 448.0).float().contiguous()
        codes = (x / scale.view(1, 1, -1, 1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        out.append((codes, scale))
        values.append(codes.double() * scale.double().view(1, 1, -1, 1))
    (kc, ks), (vc, vs) = out
    return (kc, vc, ks, vs), values[0], values[1]


def main(argv: list[str] | None = None) -> int:
    import argparse

    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warps", default="4",
                        help="comma-separated CTA widths, 4 and/or 8 (8 runs only where head_dim <= 128; default 4)")
    parser.add_argument("--kv-dtype", default=None, choices=[FP8_KV],
                        help=f"the cache's dtype when it is not the query's: {FP8_KV} (per-KV-head scales)")
    parser.add_argument("--ctas", default="",
                        help="comma-separated resident CTAs per SM, 3 and/or 4, of the FP8 4-warp modules "
                             "(needs --kv-dtype; head_dim <= 128)")
    args = parser.parse_args(argv)
    try:
        widths = [int(w) for w in args.warps.split(",")]
    except ValueError:
        widths = []
    if not widths or any(w not in (4, 8) for w in widths):
        parser.error(f"--warps takes 4 and/or 8, got {args.warps!r}")
    try:
        ctas = [int(c) for c in args.ctas.split(",") if c.strip()]
    except ValueError:
        ctas = [0]
    if any(c not in ENGINE_CTAS_PER_SM[4][1:] for c in ctas) or (ctas and not args.kv_dtype):
        parser.error(f"--ctas takes 3 and/or 4 with --kv-dtype {FP8_KV}, got {args.ctas!r}")
    modules = [(w, None) for w in widths] + [(4, c) for c in ctas]

    failures = 0

    def check(engine, batch, q, cache, ref, route: str, options: dict, label: str, calls: int = 1) -> None:
        """``calls`` runs of one plan of ``route``, each into a NaN-poisoned output; the worst error
        against float64 is printed and counted."""
        nonlocal failures
        spec = engine.spec
        plan = engine.plan(batch, route, **options)
        outs = [torch.full_like(q, float("nan")) for _ in range(calls)]
        for out in outs:
            engine.run(q, cache, plan, out)
        torch.cuda.synchronize()
        err = max(float(row_head_errors_torch(out, ref).max()) for out in outs)
        ok = err <= TOLERANCE[spec.dtype]
        failures += not ok
        print(f"{spec.dtype}/{spec.cache_dtype} D={spec.head_dim} G={spec.group_size} P={spec.page_size} "
              f"w{engine.warps}{f'c{engine.ctas_per_sm}' if engine.ctas_per_sm else ''} {label}: "
              f"worst (row, head) rel err {err:.2e} {'ok' if ok else 'FAIL'}", flush=True)

    for (spec, lengths), (warps, per_sm) in ((case, m) for case in CASES for m in modules):
        if (warps == 8 or per_sm) and spec.head_dim > 128:
            continue
        batch, q, k, v = device_case(spec, lengths, hole_fraction=0.5, seed=len(lengths))
        cache = (k, v)
        if args.kv_dtype:
            spec = replace(spec, kv_dtype=args.kv_dtype)
            batch = replace(batch, spec=spec)
            cache, k, v = fp8_cache(k, v)
        engine = engine_for(spec, warps=warps, **({"ctas_per_sm": per_sm} if per_sm else {}))
        ref = reference_torch64(batch, q, k, v)
        for route, options in ROUTES:
            check(engine, batch, q, cache, ref, route, options, route)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
