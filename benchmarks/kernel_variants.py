"""Kernel variants for `bench_engine.py --against`: each a copy of this checkout's kernels/ with one
source patch and of src/persistentkv renamed persistentkv_TAG, so the shipped kernel and the
variants run side by side in one process, on the same batches, checked against float64.

    python benchmarks/kernel_variants.py --out DIR [TAG ...] [--ptxas sm_90] [--sass sm_90]
    python benchmarks/bench_engine.py --kv-dtype float8_e4m3 --routes workqueue \
        --against DIR/lazy,...

Variants (the hypothesis each tests; benchmarks/NOTES.md, "FP8 caches"); several joined by '_'
(t32_lazy) make one:
  lazy       O and l rescaled only when a warp's running max grew (one vote per tile): the
             16 x D multiplies of an unchanged max are exact no-ops (a = 2^0 = 1)
  t32        32 tokens per warp and tile in the FP8 modules of 2 CTAs per SM (4 warps) or 1 (8
             warps): the fp16 module's bytes per stage and in flight, one softmax update and O
             rescale per 32 tokens (23.5 instructions per token against 28.3); the 3- and 4-CTA
             modules keep 16 (they cannot hold its stages)
The A/B at be4ba01 (NOTES, "Variants"): lazy 0.985-0.995 from 268 MB; each occupancy (occ3, occ4:
the FP8 4-warp modules promised 3 or 4 resident CTAs per SM) won on some cases and lost on others,
and now ships as the engine's own ctas_per_sm modules, chosen per step (bench_engine --ctas, auto);
pagewarp (one page id per warp's 16 rows) was rejected there and removed. The A/B at 3748346: kpair
(K's codes converted in the pairs they arrive in) won every case by 0.5-4.4 % and ships; st6 (six
FP8 stages) lost nearly every case and was removed; t32, then also in the 3- and 4-CTA modules'
place, beat the 2-CTA modules by 2-13 % on the six Hq=32 cases, lost 3.5 % at Hq=64 B=64 x 64, and
as a whole tied or lost where the 3- and 4-CTA modules win: it now leaves those to them. So built,
on an H100 at 69e5b3d, auto-t32 lost 2-3 % at B=1 x 32K and B=8 x 8K and won on small and ragged
steps: it fails the rule there, and the H200's run of the same build decides whether it goes.
--ptxas ARCH compiles each variant's FP8 decode kernels for ARCH (head_dim 128, 4 and 8 warps) and
prints their registers and spills; --sass ARCH the static instruction count and mix of each FP8
module's per-tile loop (pkv_decode_fused; 16 tokens per warp, 32 under t32) beside the shipped
kernel's, per tile and per token.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from collections import Counter
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
# 32 tokens per warp and tile on an FP8 cache (T32; fp16 keeps 16, and so do the 3- and 4-CTA
# modules, which cannot hold its stages): a 4-warp stage of 128 tokens, the fp16 module's bytes per
# stage and in flight (96 KB of stages: 2 CTAs of 4 warps, 1 of 8), and one softmax update, O
# rescale and load section per 32 tokens instead of per 16. Its package's launch check takes the
# doubled tile, and its smallest item is one such stage.
T32 = [
    ("constexpr int TILE = 16 * WARPS;                 // tokens per pipeline stage",
     "#ifdef PKV_CTAS_PER_SM\nconstexpr int TPW = 16;\n#else\n"
     "constexpr int TPW = PKV_FP8 ? 32 : 16;           // tokens per warp and tile (t32)\n#endif\n"
     "constexpr int TILE = TPW * WARPS;                // tokens per pipeline stage"),
    ("  float s[2][4];\n#pragma unroll\n  for (int j = 0; j < 2; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;",
     "  float s[TPW / 8][4];\n#pragma unroll\n  for (int j = 0; j < TPW / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;"),
    ("""    for (int kk = 0; kk < D / 16; kk += 2) {  // matrices: tokens 0-7 | 8-15 of code chunks kk | kk + 1
      const int tk = warp * 16 + (mi & 1) * 8 + r;""",
     """    for (int hh = 0; hh < TPW / 16; ++hh)
#pragma unroll
    for (int kk = 0; kk < D / 16; kk += 2) {  // matrices: tokens 0-7 | 8-15 of code chunks kk | kk + 1
      const int tk = warp * TPW + hh * 16 + (mi & 1) * 8 + r;"""),
    ("""        mma16816(s[0], a, e0, o0);
        mma16816(s[1], a, e1, o1);""",
     """        mma16816(s[2 * hh], a, e0, o0);
        mma16816(s[2 * hh + 1], a, e1, o1);"""),
    ("""  for (int j = 0; j < 2; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {""",
     """  for (int j = 0; j < TPW / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {"""),
    ("""  for (int j = 0; j < 2; ++j) {
    s[j][0] = fast_exp2(s[j][0] - base0);""",
     """  for (int j = 0; j < TPW / 8; ++j) {
    s[j][0] = fast_exp2(s[j][0] - base0);"""),
    ("""  unsigned pa[4];
  pa[0] = pack2(s[0][0], s[0][1]);
  pa[1] = pack2(s[0][2], s[0][3]);
  pa[2] = pack2(s[1][0], s[1][1]);
  pa[3] = pack2(s[1][2], s[1][3]);""",
     """  unsigned pa[TPW / 16][4];
#pragma unroll
  for (int hh = 0; hh < TPW / 16; ++hh) {
    pa[hh][0] = pack2(s[2 * hh][0], s[2 * hh][1]);
    pa[hh][1] = pack2(s[2 * hh][2], s[2 * hh][3]);
    pa[hh][2] = pack2(s[2 * hh + 1][0], s[2 * hh + 1][1]);
    pa[hh][3] = pack2(s[2 * hh + 1][2], s[2 * hh + 1][3]);
  }"""),
    ("""    for (int dc = 0; dc < D / 16; dc += 2) {  // matrices: tokens 0-7 | 8-15 of code chunks dc | dc + 1
      const int tv = warp * 16 + (mi & 1) * 8 + r;""",
     """    for (int hh = 0; hh < TPW / 16; ++hh)
#pragma unroll
    for (int dc = 0; dc < D / 16; dc += 2) {  // matrices: tokens 0-7 | 8-15 of code chunks dc | dc + 1
      const int tv = warp * TPW + hh * 16 + (mi & 1) * 8 + r;"""),
    ("""        mma16816(ws.o[2 * (dc + h)], pa, e0, e1);
        mma16816(ws.o[2 * (dc + h) + 1], pa, o0, o1);""",
     """        mma16816(ws.o[2 * (dc + h)], pa[hh], e0, e1);
        mma16816(ws.o[2 * (dc + h) + 1], pa[hh], o0, o1);"""),
    ("""      mma16816(ws.o[2 * dp], pa, b0, b1);
      mma16816(ws.o[2 * dp + 1], pa, b2, b3);""",
     """      mma16816(ws.o[2 * dp], pa[0], b0, b1);
      mma16816(ws.o[2 * dp + 1], pa[0], b2, b3);"""),
    ("    const int tok0 = it.lo + t * TILE + warp * 16;", "    const int tok0 = it.lo + t * TILE + warp * TPW;"),
]
#: t32's patches of its own package: the module's tile may be twice 16 per warp (launch.py), and
#: the smallest item is one of its stages, 128 tokens at 4 warps (engine.py; planner tiles of 32).
T32_PY = {"launch.py": [("        require(tile == stage_tokens(warps), ",
                         "        require(tile in (stage_tokens(warps), 2 * stage_tokens(warps)), ")],
          "engine.py": [("        self.min_chunk_tiles = int(min_chunk_tiles or min_chunk_tiles_for(warps))",
                         "        self.min_chunk_tiles = int(min_chunk_tiles or self.module.tile // 32)")]}
VARIANTS = {"lazy": LAZY, "t32": T32}
#: patches of a variant's own package, per file under src/persistentkv_TAG
PY_PATCHES = {"t32": T32_PY}


def patched(text: str, patches) -> str:
    """``text`` with each (old, new) of ``patches`` replaced; each old must occur exactly once."""
    for old, new in patches:
        if text.count(old) != 1:
            raise SystemExit(f"{KERNEL} has {text.count(old)} copies of the patched text "
                             f"{old.strip().splitlines()[0]!r} (the variant needs exactly one)")
        text = text.replace(old, new)
    return text


def variant_patches(tag: str) -> list:
    """The patches of ``tag``: one variant, or several joined by '_' (t32_lazy), applied in turn."""
    names = tag.split("_")
    bad = [n for n in names if n not in VARIANTS]
    if bad or len(set(names)) != len(names):
        raise SystemExit(f"unknown or repeated variant in {tag!r}; known: {', '.join(VARIANTS)} "
                         "(combine them with '_', e.g. t32_lazy)")
    return [patch for n in names for patch in VARIANTS[n]]


def build(out: Path, tag: str) -> Path:
    """DIR/TAG with kernels/ (patched) and src/persistentkv_TAG: what --against reads."""
    patches = variant_patches(tag)
    dest = out / tag
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(ROOT / "kernels", dest / "kernels")
    shutil.copytree(ROOT / "src" / "persistentkv", dest / "src" / f"persistentkv_{tag}",
                    ignore=shutil.ignore_patterns("__pycache__"))
    source = dest / "kernels" / KERNEL
    source.write_text(patched(source.read_text(), patches))
    for name in tag.split("_"):
        for rel, py in PY_PATCHES.get(name, {}).items():
            target = dest / "src" / f"persistentkv_{tag}" / rel
            target.write_text(patched(target.read_text(), py))
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


def sass_functions(text: str) -> dict[str, list[tuple[int, str]]]:
    """cuobjdump -sass text -> {function: [(address, instruction without the trailing ;)]}."""
    funcs, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"\s+Function : (\S+)", line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), m.group(2)))
    return funcs


def loop_mix(instructions: list[tuple[int, str]], min_hmma: int = 16) -> Counter | None:
    """Opcode counts (predicates and modifiers dropped) of the largest loop, a backward branch's
    span, with at least ``min_hmma`` HMMA: the decode kernel's per-tile loop (16 tokens per warp, 32
    under t32); None if there is none."""
    best = None
    for addr, text in instructions:
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
        if not m or int(m.group(1), 16) > addr:
            continue
        lo = int(m.group(1), 16)
        mix = Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]
                      for a, t in instructions if lo <= a <= addr)
        if mix["HMMA"] >= min_hmma and (best is None or sum(mix.values()) > sum(best.values())):
            best = mix
    return best


def cuda_tool(name: str) -> str | None:
    """``name`` (cuobjdump, nvdisasm) on PATH, else the one of NVIDIA's pip wheels
    (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm: nvidia/cu*/bin)."""
    found = shutil.which(name)
    if found:
        return found
    try:
        import nvidia  # the namespace package of NVIDIA's CUDA wheels
    except ImportError:
        return None
    return next((str(p) for base in nvidia.__path__ for p in sorted(Path(base).glob(f"cu*/bin/{name}"))), None)


def cuobjdump_path() -> str | None:
    """cuobjdump and the nvdisasm it runs, both found (cuda_tool); None if either is missing."""
    cuobjdump, nvdisasm = cuda_tool("cuobjdump"), cuda_tool("nvdisasm")
    return cuobjdump if cuobjdump and nvdisasm else None


SASS_MODULES = {"4 warps": [], "8 warps": ["-DPKV_WARPS=8"], "3 CTAs": ["-DPKV_CTAS_PER_SM=3"],
                "4 CTAs": ["-DPKV_CTAS_PER_SM=4"]}
SASS_OPS = ("HMMA", "F2FP", "PRMT", "FMUL", "MUFU", "LDSM", "LDGSTS")


def sass_report(source: Path, arch: str) -> list[dict]:
    """The per-tile loop of pkv_decode_fused in each FP8 module (head_dim 128, fp16 query) of
    ``source`` compiled for ``arch`` (cuobjdump and nvdisasm: cuobjdump_path): its instruction count
    and mix per warp and tile, and the tile's tokens per warp. A module that does not compile is left
    out; one that compiles may still not load (more stages than its shared memory holds)."""
    import os
    import subprocess
    import tempfile

    from persistentkv.kernel_build import compile_module
    from persistentkv.launch import compile_options
    from persistentkv.spec import AttentionSpec

    cuobjdump = cuobjdump_path()
    if cuobjdump is None:
        raise SystemExit("--sass needs cuobjdump and nvdisasm: the CUDA toolkit's on PATH, or pip install "
                         "nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")
    env = dict(os.environ, NVDISASM_PATH=str(Path(cuda_tool("nvdisasm")).parent))
    spec = AttentionSpec(1, 1, 128, 16, "float16", kv_dtype="float8_e4m3")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in SASS_MODULES.items():
            cubin = Path(tmp) / f"{name.replace(' ', '_')}.cubin"
            try:
                compile_module(arch, source, cubin, [*compile_options(spec, 4), *extra], f"FP8 D=128 {name}")
            except RuntimeError:
                continue
            text = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True,
                                  env=env).stdout
            fused = [ins for f, ins in sass_functions(text).items() if "pkv_decode_fused" in f]
            mix = loop_mix(fused[0]) if fused else None
            if mix is not None:  # head_dim 128: 2 HMMA per token of a warp's tile (QK and PV, 16 dims each)
                rows.append({"module": name, "instructions": sum(mix.values()), "tokens": mix["HMMA"] // 2,
                             **{op: mix[op] for op in SASS_OPS}})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tags", nargs="*", help=f"variants to build (default all: {', '.join(VARIANTS)}; "
                        "several joined by '_' make one, e.g. t32_lazy)")
    parser.add_argument("--out", required=True, help="folder for the DIR/TAG trees")
    parser.add_argument("--ptxas", default="", help="also compile each for this arch (e.g. sm_90) and print "
                        "registers and spills")
    parser.add_argument("--sass", default="", help="also print, for this arch, the instruction count and mix of "
                        "each FP8 module's per-tile loop beside the shipped kernel's (needs cuobjdump)")
    args = parser.parse_args(argv)
    for tag in args.tags:
        variant_patches(tag)  # an unknown name stops here, before any tree is built
    shipped = sass_report(ROOT / "kernels" / KERNEL, args.sass) if args.sass else []
    for tag in args.tags or VARIANTS:
        dest = build(Path(args.out), tag)
        print(dest)
        if args.sass:
            base = {r["module"]: r for r in shipped}
            for r in sass_report(dest / "kernels" / KERNEL, args.sass):
                mix = ", ".join(f"{op} {r[op]}" for op in SASS_OPS)
                b = base.get(r["module"])
                was = f"{b['instructions'] / b['tokens']:.1f}" if b else "-"
                print(f"  {r['module']}: {r['instructions']} instructions per warp and tile of {r['tokens']} tokens, "
                      f"{r['instructions'] / r['tokens']:.1f} per token (shipped {was}): {mix}")
        if args.ptxas:
            for r in ptxas_report(dest / "kernels" / KERNEL, args.ptxas):
                print(f"  {r['warps']} warps {r['kernel']}: {r['registers']} registers, "
                      f"{r['spill_store_bytes']} B spill stores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
