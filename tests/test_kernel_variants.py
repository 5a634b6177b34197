"""benchmarks/kernel_variants.py: every variant's patch applies to today's kernel exactly once, its
tree is what bench_engine --against reads (kernels/ and an importable persistentkv_TAG), and its
FP8 decode kernels compile with the registers its hypothesis names."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from persistentkv.kernel_build import nvcc_path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import kernel_variants  # noqa: E402


@pytest.mark.parametrize("tag", sorted(kernel_variants.VARIANTS))
def test_each_variant_patches_todays_kernel_once_and_builds_an_against_tree(tmp_path, tag):
    dest = kernel_variants.build(tmp_path, tag)
    source = (dest / "kernels" / "pkv_decode.cu").read_text()
    shipped = (ROOT / "kernels" / "pkv_decode.cu").read_text()
    assert source != shipped
    for old, new in kernel_variants.VARIANTS[tag]:
        assert new in source and (old not in source or old in new)
    sys.path.insert(0, str(dest / "src"))
    try:
        engine = importlib.import_module(f"persistentkv_{tag}.engine")
        assert Path(engine.__file__).is_relative_to(dest)
        launch = importlib.import_module(f"persistentkv_{tag}.launch")
        assert launch.kernels_dir() == dest / "kernels"  # the variant compiles its own source
    finally:
        sys.path.remove(str(dest / "src"))


def test_a_patch_whose_text_moved_is_refused_by_name(tmp_path):
    with pytest.raises(SystemExit, match="0 copies of the patched text 'no such line'"):
        kernel_variants.patched("int x;\n", [("no such line\n", "")])
    assert kernel_variants.main(["--out", str(tmp_path), "lazy"]) == 0
    with pytest.raises(SystemExit, match="unknown or repeated variant in 'nope'"):
        kernel_variants.main(["--out", str(tmp_path), "nope"])
    with pytest.raises(SystemExit, match="unknown or repeated variant in 'lazy_lazy'"):
        kernel_variants.build(tmp_path, "lazy_lazy")


def test_variants_joined_by_an_underscore_apply_every_patch_in_one_tree(tmp_path):
    dest = kernel_variants.build(tmp_path, "t32_lazy")
    source = (dest / "kernels" / "pkv_decode.cu").read_text()
    for old, new in kernel_variants.VARIANTS["t32"] + kernel_variants.VARIANTS["lazy"]:
        assert new in source
    assert (dest / "src" / "persistentkv_t32_lazy" / "engine.py").is_file()


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc is not on PATH")
@pytest.mark.slow
def test_the_ptxas_report_gives_each_fp8_decode_kernels_registers(tmp_path):
    """--ptxas: the lazy variant's FP8 decode kernels at 4 and 8 warps, their registers within the
    shipped launch bounds (255 at 2 CTAs of 4 warps or 1 of 8) and no spills."""
    rows = kernel_variants.ptxas_report(kernel_variants.build(tmp_path, "lazy") / "kernels" / "pkv_decode.cu", "sm_90")
    assert sorted((r["warps"], r["kernel"]) for r in rows) == [(w, k) for w in (4, 8)
                                                               for k in ("pkv_decode", "pkv_decode_fused")]
    assert all(r["registers"] <= 255 and r["spill_store_bytes"] == 0 for r in rows), rows


SASS = """
        Function : pkv_decode_fused
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDSM.16.M88.4 R4, [R2] ;
        /*0020*/                   HMMA.16816.F32 R8, R4, R6, RZ ;
        /*0030*/                   PRMT R4, R4, 0x3120, RZ ;
        /*0040*/               @P0 HMMA.16816.F32 R8, R4, R6, R8 ;
        /*0050*/              @!P1 BRA 0x10 ;
        /*0060*/                   HMMA.16816.F32 R8, R4, R6, R8 ;
        /*0070*/                   BRA 0x60 ;
        Function : pkv_merge
        /*0000*/                   EXIT ;
"""


def test_the_sass_loop_mix_counts_the_largest_loop_with_enough_mma():
    funcs = kernel_variants.sass_functions(SASS)
    assert list(funcs) == ["pkv_decode_fused", "pkv_merge"]
    assert funcs["pkv_decode_fused"][1] == (0x10, "LDSM.16.M88.4 R4, [R2]")
    # the loop 0x10-0x50 (predicates and modifiers dropped); the one-instruction loop at 0x60-0x70
    # has a single HMMA, and no loop has three
    mix = kernel_variants.loop_mix(funcs["pkv_decode_fused"], min_hmma=2)
    assert dict(mix) == {"LDSM": 1, "HMMA": 2, "PRMT": 1, "BRA": 1}
    assert kernel_variants.loop_mix(funcs["pkv_decode_fused"], min_hmma=3) is None
    assert kernel_variants.loop_mix(funcs["pkv_merge"]) is None


@pytest.mark.skipif(nvcc_path() is None or kernel_variants.cuobjdump_path() is None,
                    reason="needs nvcc on PATH, cuobjdump and nvdisasm (the toolkit's, or NVIDIA's pip wheels)")
@pytest.mark.slow
def test_the_fp8_loop_converts_k_without_byte_permutes_and_t32_halves_its_cost_per_token(tmp_path):
    """--sass: the shipped FP8 loop (fp16 query, sm_90) converts K's codes in the pairs they arrive
    in (K_PAIRS): per warp and tile of 16 tokens 32 mma, 68 conversions, 8 async loads and 17 byte
    permutes (V's 16 and one), none for K, in every FP8 module. t32's 2-CTA modules take 32 tokens per
    warp and tile (twice the mma, conversions and loads) for fewer instructions per token; its 3-
    and 4-CTA modules keep the shipped loop."""
    shipped = {r["module"]: r for r in kernel_variants.sass_report(ROOT / "kernels" / "pkv_decode.cu", "sm_90")}
    assert sorted(shipped) == sorted(kernel_variants.SASS_MODULES)
    for s in shipped.values():
        assert (s["HMMA"], s["F2FP"], s["LDGSTS"], s["PRMT"], s["tokens"]) == (32, 68, 8, 17, 16), s
    t32 = {r["module"]: r for r in
           kernel_variants.sass_report(kernel_variants.build(tmp_path, "t32") / "kernels" / "pkv_decode.cu", "sm_90")}
    assert sorted(t32) == sorted(shipped)
    for name, r in t32.items():
        s = shipped[name]
        if name in ("3 CTAs", "4 CTAs"):
            assert r == s
        else:
            assert r["tokens"] == 32 and (r["HMMA"], r["F2FP"], r["LDGSTS"]) == (64, 136, 16)
            assert r["instructions"] / r["tokens"] < 0.9 * s["instructions"] / s["tokens"]


def test_t32_patches_its_own_launch_check_and_smallest_item_for_the_doubled_tile(tmp_path):
    dest = kernel_variants.build(tmp_path, "t32")
    launch = (dest / "src" / "persistentkv_t32" / "launch.py").read_text()
    assert "require(tile in (stage_tokens(warps), 2 * stage_tokens(warps)), " in launch
    engine = (dest / "src" / "persistentkv_t32" / "engine.py").read_text()
    assert "self.min_chunk_tiles = int(min_chunk_tiles or self.module.tile // 32)" in engine
    assert "constexpr int TPW = PKV_FP8 ? 32 : 16;" in (dest / "kernels" / "pkv_decode.cu").read_text()
    shipped = (ROOT / "src" / "persistentkv" / "launch.py").read_text()
    assert "require(tile == stage_tokens(warps), " in shipped  # the shipped package is left as it is
