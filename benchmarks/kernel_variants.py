"""Kernel variants for `bench_engine.py --against`: each a copy of this checkout's kernels/ with one
source patch and of src/persistentkv renamed persistentkv_TAG, so the shipped kernel and the
variants run side by side in one process, on the same batches, checked against float64.

    python benchmarks/kernel_variants.py --out DIR [TAG ...] [--ptxas sm_90]
    python benchmarks/bench_engine.py --kv-dtype float8_e4m3 --routes workqueue \
        --against DIR/lazy,...

Variants (the hypothesis each tests; benchmarks/NOTES.md, "FP8 caches"):
  lazy       O and l rescaled only when a warp's running max grew (one vote per tile): the
             16 x D multiplies of an unchanged max are exact no-ops (a = 2^0 = 1)
The A/B at be4ba01 (NOTES, "Variants"): lazy 0.985-0.995 from 268 MB; each occupancy (occ3, occ4:
the FP8 4-warp modules promised 3 or 4 resident CTAs per SM) won on some cases and lost on others,
and now ships as the engine's own ctas_per_sm modules, chosen per step (bench_engine --ctas, auto);
pagewarp (one page id per warp's 16 rows) was rejected there and removed.
--ptxas ARCH compiles each variant's FP8 decode kernels for ARCH (head_dim 128, 4 and 8 warps) and
prints their registers and spills.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
KERNEL = "pkv_decode.cu"

LAZY = [
    ("""  const float a0 = fast_exp2(ws.m0 - base0), a1 = fast_exp2(ws.m1 - base1);
  ws.m0 = mn0;
  ws.m1 = mn1;""",
     """  // lazy rescale: a warp whose rows' maxima all stayed skips the exp2s and O's multiplies (a = 1)
  const bool grew = __any_sync(0xffffffffu, mn0 != ws.m0 || mn1 != ws.m1);
  float a0 = 1.f, a1 = 1.f;
  if (grew) {
    a0 = fast_exp2(ws.m0 - base0);
    a1 = fast_exp2(ws.m1 - base1);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      ws.o[j][0] *= a0;
      ws.o[j][1] *= a0;
      ws.o[j][2] *= a1;
      ws.o[j][3] *= a1;
    }
  }
  ws.m0 = mn0;
  ws.m1 = mn1;"""),
    ("""  ws.l1 = ws.l1 * a1 + ps1;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    ws.o[j][0] *= a0;
    ws.o[j][1] *= a0;
    ws.o[j][2] *= a1;
    ws.o[j][3] *= a1;
  }
""", "  ws.l1 = ws.l1 * a1 + ps1;\n"),
]
VARIANTS = {"lazy": LAZY}


def patched(text: str, patches) -> str:
    """``text`` with each (old, new) of ``patches`` replaced; each old must occur exactly once."""
    for old, new in patches:
        if text.count(old) != 1:
            raise SystemExit(f"{KERNEL} has {text.count(old)} copies of the patched text "
                             f"{old.strip().splitlines()[0]!r} (the variant needs exactly one)")
        text = text.replace(old, new)
    return text


def build(out: Path, tag: str) -> Path:
    """DIR/TAG with kernels/ (patched) and src/persistentkv_TAG: what --against reads."""
    dest = out / tag
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(ROOT / "kernels", dest / "kernels")
    shutil.copytree(ROOT / "src" / "persistentkv", dest / "src" / f"persistentkv_{tag}",
                    ignore=shutil.ignore_patterns("__pycache__"))
    source = dest / "kernels" / KERNEL
    source.write_text(patched(source.read_text(), VARIANTS[tag]))
    return dest


def ptxas_report(source: Path, arch: str) -> list[dict]:
    """Registers and spills (persistentkv.kernel_build.compile_module's ptxas rows, plus ``warps``)
    of the FP8 decode kernels of ``source`` at head_dim 128, 4 and 8 warps, compiled for ``arch``
    with the engine's own options (launch.compile_options)."""
    import tempfile

    from persistentkv.kernel_build import compile_module
    from persistentkv.launch import compile_options
    from persistentkv.spec import AttentionSpec

    spec = AttentionSpec(1, 1, 128, 16, "float16", kv_dtype="float8_e4m3")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for warps in (4, 8):
            rows += [dict(r, warps=warps) for r in
                     compile_module(arch, source, Path(tmp) / f"w{warps}.cubin", list(compile_options(spec, warps)),
                                    f"{source.parent.parent.name} FP8 D=128 warps={warps}")
                     if r["kernel"].startswith("pkv_decode")]
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tags", nargs="*", help=f"variants to build (default all: {', '.join(VARIANTS)})")
    parser.add_argument("--out", required=True, help="folder for the DIR/TAG trees")
    parser.add_argument("--ptxas", default="", help="also compile each for this arch (e.g. sm_90) and print "
                        "registers and spills")
    args = parser.parse_args(argv)
    bad = [t for t in args.tags if t not in VARIANTS]
    if bad:
        parser.error(f"unknown variant {', '.join(bad)}; known: {', '.join(VARIANTS)}")
    for tag in args.tags or VARIANTS:
        dest = build(Path(args.out), tag)
        print(dest)
        if args.ptxas:
            for r in ptxas_report(dest / "kernels" / KERNEL, args.ptxas):
                print(f"  {r['warps']} warps {r['kernel']}: {r['registers']} registers, "
                      f"{r['spill_store_bytes']} B spill stores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
