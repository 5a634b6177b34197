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
    with pytest.raises(SystemExit):
        kernel_variants.main(["--out", str(tmp_path), "nope"])


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc is not on PATH")
@pytest.mark.slow
def test_the_ptxas_report_gives_each_fp8_decode_kernels_registers(tmp_path):
    """--ptxas: the lazy variant's FP8 decode kernels at 4 and 8 warps, their registers within the
    shipped launch bounds (255 at 2 CTAs of 4 warps or 1 of 8) and no spills."""
    rows = kernel_variants.ptxas_report(kernel_variants.build(tmp_path, "lazy") / "kernels" / "pkv_decode.cu", "sm_90")
    assert sorted((r["warps"], r["kernel"]) for r in rows) == [(w, k) for w in (4, 8)
                                                               for k in ("pkv_decode", "pkv_decode_fused")]
    assert all(r["registers"] <= 255 and r["spill_store_bytes"] == 0 for r in rows), rows
