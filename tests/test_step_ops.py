"""The decode step's own kernels (persistentkv.model.step_ops, kernels/step_ops.cu).

CPU (real everywhere): every entry point compiles with nvcc for sm_80 and sm_90 without spills;
the FP8 append's conversion is cvt.rn.satfinite.e4m3x2 on sm_90 and, on sm_80, integer code that
(compiled for the host and run here) equals fp8.quantize; its round-to-odd quotient makes the
two roundings one; the launch shape covers every row and every K chunk exactly once, with no empty block, and splits
K for small N; every refusal is a PKVError naming its cause, raised before CuPy is imported; the
torch kernels' linear / gate_up_silu / append are today's operations, and kernels=pkv refuses a
CPU device.

GPU (requires_gpu): gemv and gemv_silu_mul against float64 within an elementwise bound
(:func:`error_bound`) for T = 1 (the only T the kernels take), fp16 and bf16, the projections'
shapes; append_kv
bit-identical to index_copy_ on scattered slots; the FP8 append bit-identical to fp8.quantize
(overflow, per-tensor and per-head scales; no NaN code); the three inside one CUDA graph equal to eager;
the pkv kernels' Model.forward on the small GPU model against the torch kernels'.
"""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from gpu_support import requires_gpu
from persistentkv.errors import PKVError
from persistentkv.kernel_build import nvcc_path, parse_ptxas
from persistentkv.model import step_ops
from persistentkv.model.step_ops import (BLOCK_WARPS, ENTRY_POINTS, MIN_BLOCKS_PER_SM, TARGET_WARPS_PER_SM, UNROLL,
                                         WARP, gemv_shape)

torch = pytest.importorskip("torch", reason="the step's kernels take torch tensors")

needs_nvcc = pytest.mark.skipif(nvcc_path() is None, reason="nvcc is not on PATH")

H200_SMS = 132
#: (N, K) of every projection the tests run: Llama-3-8B's qkv, o, down; the 70B shard's qkv and o;
#: a tiny N; an N that leaves the last block part-full; an odd N with a K of 129 chunks (tails).
GEMV_SHAPES = [(4096, 4096), (6144, 4096), (4096, 14336), (1280, 8192), (8192, 1024), (24, 4096), (4104, 4096),
               (1029, 1032)]
#: (2I, K) of the fused gate|up: Llama-3-8B's and the 70B shard's.
GATE_UP_SHAPES = [(2 * 14336, 4096), (2 * 3584, 8192)]
#: Shapes the launch shape is checked on without a GPU (the LM heads included).
PLAN_SHAPES = [(n, k, False) for n, k in GEMV_SHAPES + [(128256, 4096), (16032, 8192), (8192, 3584), (1, 8)]] + \
              [(n, k, True) for n, k in GATE_UP_SHAPES + [(2, 8), (2 * 1024, 512)]]


# -- compile (CPU) --------------------------------------------------------------------------------
@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_entry_point_compiles_without_spills(tmp_path, arch):
    source = step_ops.kernels_dir() / step_ops.KERNEL_FILE
    cmd = [nvcc_path(), "-cubin", f"-arch={arch}", "-O3", "-Xptxas", "-v", "-o", str(tmp_path / "step_ops.cubin"),
           *step_ops.compile_options(), str(source)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["kernel"]: r for r in parse_ptxas(proc.stderr)}
    assert set(rows) == set(ENTRY_POINTS)
    for row in rows.values():
        print(f"{row['kernel']} {arch}: {row['registers']} registers, {row['static_shared_bytes']} B smem")
        assert row["spill_store_bytes"] == 0 and row["spill_load_bytes"] == 0 and row["stack_bytes"] == 0, row
    # the launch bound keeps MIN_BLOCKS_PER_SM full blocks resident (16 warps per SM at 8-warp blocks)
    limit = 65536 // (WARP * BLOCK_WARPS * MIN_BLOCKS_PER_SM)
    assert all(r["registers"] <= limit for name, r in rows.items() if name.startswith("pkv_gemv")), limit


@needs_nvcc
def test_the_kernel_file_refuses_to_compile_without_its_defines(tmp_path):
    source = step_ops.kernels_dir() / step_ops.KERNEL_FILE
    proc = subprocess.run([nvcc_path(), "-cubin", "-arch=sm_90", "-o", str(tmp_path / "x.cubin"), str(source)],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "compile_options" in proc.stderr


@needs_nvcc
@pytest.mark.parametrize("arch, hardware", [("sm_80", False), ("sm_90", True)])
def test_the_fp8_append_uses_the_fp8_cvt_from_sm_89_on(tmp_path, arch, hardware):
    source = step_ops.kernels_dir() / step_ops.KERNEL_FILE
    proc = subprocess.run([nvcc_path(), "-ptx", f"-arch={arch}", "-o", str(tmp_path / "s.ptx"),
                           *step_ops.compile_options(), str(source)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ptx = (tmp_path / "s.ptx").read_text()
    assert ("cvt.rn.satfinite.e4m3x2.f32" in ptx) == hardware
    assert "div.rz.f32" in ptx


def fp8_probe_values() -> np.ndarray:
    """float32 values over e4m3's range and past it: random magnitudes 2^-20 .. 2^12, every code's
    value, every midpoint between neighbouring codes (ties), their float32 neighbours, +-0,
    +-inf, NaN, the saturation edge (448, 464) and float32 subnormals."""
    from persistentkv import fp8

    rng = np.random.default_rng(5)
    grid = fp8.code_values()[:0x7F]
    mids = (grid[:-1] + grid[1:]) / 2
    edges = np.array([448, 449, 463.99, 464, 465, 480, 1e30, 2.0**-10, 2.0**-130, 0.0, np.inf, np.nan])
    base = np.concatenate([rng.standard_normal(100_000) * np.exp2(rng.uniform(-20, 12, 100_000)), grid, mids,
                           edges]).astype(np.float32)
    near = np.concatenate([np.nextafter(base, np.float32(np.inf)), np.nextafter(base, np.float32(-np.inf))])
    values = np.concatenate([base, near])
    return np.concatenate([values, -values]).astype(np.float32)


@needs_nvcc
def test_the_software_e4m3_conversion_is_fp8_quantize(tmp_path):
    """pkv_e4m3_rn_sat (the sm_80 path), compiled for the host from kernels/step_ops.cu itself."""
    from persistentkv import fp8

    driver = tmp_path / "driver.cu"
    driver.write_text('#include "step_ops.cu"\n#include <cstdio>\nint main() {\n  float x;\n'
                      '  while (fread(&x, 4, 1, stdin) == 1) {\n'
                      '    unsigned char c = pkv_e4m3_rn_sat(x);\n    fwrite(&c, 1, 1, stdout);\n  }\n}\n')
    exe = tmp_path / "driver"
    proc = subprocess.run([nvcc_path(), "-O2", "-arch=sm_80", "-I", str(step_ops.kernels_dir()),
                           *step_ops.compile_options(), "-o", str(exe), str(driver)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    x = fp8_probe_values()
    got = np.frombuffer(subprocess.run([str(exe)], input=x.tobytes(), capture_output=True, check=True).stdout,
                        np.uint8)
    want = fp8.quantize(x)
    assert got.size == x.size
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (x[bad[:5]], got[bad[:5]], want[bad[:5]])


def divide_to_odd(x: np.ndarray, s: np.ndarray) -> np.ndarray:
    """The kernel's pkv_div_odd in NumPy: x / s rounded toward zero to float32, the last bit set
    where the remainder x - q s is not zero (float64 holds q s exactly), for |q| < 448."""
    x64, s64 = x.astype(np.float64), s.astype(np.float64)
    q = (x64 / s64).astype(np.float32)
    over = np.abs(q.astype(np.float64)) > np.abs(x64 / s64)   # rounded away from zero: step back
    q = np.where(over, np.nextafter(q, np.float32(0)), q)
    rem = x64 - q.astype(np.float64) * s64
    odd = (rem != 0) & (np.abs(q) < 448)
    return np.where(odd, (q.view(np.uint32) | 1).view(np.float32), q)


def test_rounding_the_quotient_to_odd_first_is_one_rounding():
    """x / s rounded to float32 to nearest, then to e4m3, differs from fp8.quantize(x, s) (double
    rounding onto a tie); rounded to odd first, it never does: the kernel's scheme."""
    from persistentkv import fp8

    rng = np.random.default_rng(11)
    grid = fp8.code_values()[:0x7F]
    scales = np.float32(rng.uniform(0.001, 3.0, 50_000))
    mids = np.float64(rng.choice((grid[:-1] + grid[1:]) / 2, 50_000))
    # fp16 values whose quotient sits within a float32 rounding of a tie
    x = np.float16(mids * scales.astype(np.float64)).astype(np.float32)
    x = np.concatenate([x, np.float16(rng.standard_normal(50_000) * 300).astype(np.float32)])
    s = np.concatenate([scales, scales])
    want = fp8.quantize(x.astype(np.float64) / s.astype(np.float64))
    assert np.array_equal(fp8.quantize(divide_to_odd(x, s)), want)
    nearest = fp8.quantize((x / s).astype(np.float32))          # float32 division, to nearest
    assert not np.array_equal(nearest, want), "no double-rounding case: the test has no teeth"


# -- the launch shape (CPU) -----------------------------------------------------------------------
def covered(n: int, k: int, silu: bool, sm_count: int = H200_SMS):
    """(launch shape, rows each warp of each block owns, K chunks of each slice), walking the
    kernel's index math: warp w of block b takes pair b * pairs_per_block + w // split, rows 2p and
    2p + 1 (silu: p and I + p), chunks lane + 32 (w % split + split i)."""
    pairs = n // 2 if silu else -(-n // 2)
    shape = gemv_shape(pairs, k, sm_count)
    chunks = k // 8
    blocks = []
    for b in range(shape.blocks):
        owned = []
        for w in range(shape.warps):
            p = b * shape.pairs_per_block + w // shape.split
            if p < pairs and w % shape.split == 0:
                rows = [p, n // 2 + p] if silu else [r for r in (2 * p, 2 * p + 1) if r < n]
                owned += rows
        blocks.append(owned)
    slices = [[c for i in range(-(-chunks // WARP)) for lane in range(WARP)
               if (c := lane + WARP * (s + shape.split * i)) < chunks] for s in range(shape.split)]
    return shape, blocks, slices


@pytest.mark.parametrize("n, k, silu", PLAN_SHAPES)
def test_the_launch_shape_covers_every_row_and_chunk_once(n, k, silu):
    shape, blocks, slices = covered(n, k, silu)
    assert all(blocks), "an empty block"
    rows = np.concatenate([np.asarray(b) for b in blocks])
    assert rows.size == n and np.array_equal(np.sort(rows), np.arange(n)), "a row missed or written twice"
    flat = np.concatenate([np.asarray(s) for s in slices])
    assert flat.size == k // 8 and np.array_equal(np.sort(flat), np.arange(k // 8))
    assert shape.threads <= WARP * BLOCK_WARPS  # the kernels' launch bound
    assert shape.split in (1, 2, 4, 8) and shape.warps == shape.split * shape.pairs_per_block
    if shape.split > 1:  # every lane of a split warp still has one whole unrolled step
        assert k // 8 >= WARP * shape.split * UNROLL


@pytest.mark.parametrize("n, k, split", [(1280, 8192, 8), (24, 4096, 4), (4096, 4096, 4), (4096, 14336, 4),
                                         (4104, 4096, 4), (8192, 1024, 1), (6144, 4096, 2), (128256, 4096, 1),
                                         (7168, 8192, 2)])
def test_small_n_splits_k(n, k, split):
    pairs = -(-n // 2)
    shape = gemv_shape(pairs, k, H200_SMS)
    assert shape.split == split
    # a split is taken only while the pairs alone leave the SMs short of their target warps
    assert (shape.split > 1) == (pairs < TARGET_WARPS_PER_SM * H200_SMS and k // 8 >= WARP * 2 * UNROLL)


def test_a_tiny_n_spreads_over_sms():
    shape = gemv_shape(12, 4096, H200_SMS)  # N = 24: 12 pairs
    assert (shape.split, shape.pairs_per_block, shape.blocks) == (4, 1, 12)
    assert gemv_shape(12, 4096, 4).pairs_per_block == 2  # 4 SMs: 6 blocks of 2 pairs fill them


@pytest.mark.parametrize("pairs, k, sms", [(0, 4096, 132), (8, 12, 132), (8, 4096, 0)])
def test_the_launch_shape_refuses_bad_arguments(pairs, k, sms):
    with pytest.raises(PKVError):
        gemv_shape(pairs, k, sms)


def test_append_grid_is_capped_per_sm():
    assert step_ops.append_blocks(2 * 1 * 16, 132) == 1
    assert step_ops.append_blocks(2 * 256 * 128, 132) == 256
    assert step_ops.append_blocks(10**9, 132) == 8 * 132


# -- refusals (CPU tensors: every check before CuPy) ----------------------------------------------
@pytest.fixture
def no_cupy(monkeypatch):
    """``import cupy`` fails: a check that reached CuPy would raise ImportError, not PKVError."""
    monkeypatch.setitem(sys.modules, "cupy", None)


def half(*size, dtype=torch.float16):
    return torch.zeros(size, dtype=dtype)


def misaligned(rows, cols):
    return half(rows * cols + 1)[1:].view(rows, cols)  # 2 bytes past an aligned allocation


GEMV_REFUSALS = {
    "cpu": (lambda: (half(1, 16), half(8, 16)), "CUDA tensors only"),
    "k_not_multiple_of_8": (lambda: (half(1, 12), half(8, 12)), "K = 12 is not a positive multiple of 8"),
    "non_contiguous_w": (lambda: (half(1, 32), half(32, 16).t()), "w is not contiguous"),
    "non_contiguous_x": (lambda: (half(32, 4).t()[:2], half(8, 32)), "x is not contiguous"),
    "float32": (lambda: (half(1, 16, dtype=torch.float32), half(8, 16, dtype=torch.float32)),
                "one dtype in float16, bfloat16, got float32"),
    "mixed_dtypes": (lambda: (half(1, 16), half(8, 16, dtype=torch.bfloat16)), "got float16 and bfloat16"),
    "t_above_1": (lambda: (half(2, 16), half(8, 16)), "takes 1 row of x (T = 1), got T = 2"),
    "k_mismatch": (lambda: (half(1, 16), half(8, 24)), "x has K = 16 columns, w has 24"),
    "three_dim_x": (lambda: (half(1, 1, 16), half(8, 16)), "x [T, K] and w [N, K]"),
    "misaligned_x": (lambda: (misaligned(1, 16), half(8, 16)), "x is not 16-byte aligned"),
}


@pytest.mark.parametrize("case", sorted(GEMV_REFUSALS))
@pytest.mark.parametrize("op", ["gemv", "gemv_silu_mul"])
def test_gemv_refusals_name_what_is_wrong(no_cupy, case, op):
    make, message = GEMV_REFUSALS[case]
    x, w = make()
    assert any(message in r for r in step_ops.gemv_unsupported(x, w, silu=op == "gemv_silu_mul"))
    with pytest.raises(PKVError, match=re.escape(message)):
        getattr(step_ops, op)(x, w)


def test_gemv_silu_mul_refuses_an_odd_gate_up(no_cupy):
    with pytest.raises(PKVError, match=re.escape("gate|up needs an even")):
        step_ops.gemv_silu_mul(half(1, 16), half(7, 16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_valid_input_on_the_cpu_has_only_the_device_reason(dtype):
    for silu in (False, True):
        reasons = step_ops.gemv_unsupported(half(1, 4096, dtype=dtype), half(1030, 4096, dtype=dtype), silu=silu)
        assert len(reasons) == 1 and "CUDA tensors only" in reasons[0], reasons


def append_case(rows=3, slots_dtype=torch.int64, hkv=2, d=64, dtype=torch.float16):
    cache = torch.zeros((2, 40, hkv, d), dtype=dtype)
    k, v = torch.zeros((rows, hkv, d), dtype=dtype), torch.zeros((rows, hkv, d), dtype=dtype)
    return cache[0], cache[1], torch.arange(rows, dtype=slots_dtype), k, v


APPEND_REFUSALS = {
    "cpu": (lambda: append_case(), "runs on CUDA tensors only"),
    "int32_slots": (lambda: append_case(slots_dtype=torch.int32), "slots must be contiguous int64, got int32"),
    "row_of_8_bytes": (lambda: append_case(hkv=1, d=4), "a row of Hkv x D = 1 x 4 is 8 bytes"),
    "dtype_mismatch": (lambda: (*append_case()[:3], *append_case(dtype=torch.bfloat16)[3:]), "must share a dtype"),
    "rows_not_contiguous": (lambda: (*append_case()[:3], torch.zeros(3, 64, 2, dtype=torch.float16).transpose(1, 2),
                                     append_case()[4]), "k's rows are not contiguous"),
    "slots_count": (lambda: (*append_case()[:2], torch.arange(2), *append_case()[3:]), "do not match"),
}


def fp8_append_case(dtype=torch.float16, cache=torch.float8_e4m3fn, hkv=2, d=64, scale_shape=(2,),
                    scale_dtype=torch.float32):
    k_flat, v_flat, slots, k, v = append_case(hkv=hkv, d=d, dtype=dtype)
    caches = torch.zeros((2, 40, hkv, d), dtype=cache)
    scale = torch.ones(scale_shape, dtype=scale_dtype)
    return caches[0], caches[1], slots, k, v, scale, scale.clone()


FP8_APPEND_REFUSALS = {
    "e5m2": (lambda: fp8_append_case(cache=torch.float8_e5m2), "e5m2 is not supported"),
    "float32_rows": (lambda: fp8_append_case(dtype=torch.float32), "an FP8 cache takes float16 or bfloat16 rows"),
    "no_scales": (lambda: fp8_append_case()[:5], "an FP8 cache needs k_scale and v_scale"),
    "float_scale": (lambda: (*fp8_append_case()[:5], 1.0, 1.0), "k_scale and v_scale must be float32 tensors"),
    "scale_of_3_heads": (lambda: fp8_append_case(scale_shape=(3,)),
                         "k_scale must be a contiguous float32 tensor of 1 or 2 (num_kv_heads) values, got float32 [3]"),
    "float16_scale": (lambda: fp8_append_case(scale_dtype=torch.float16), "got float16 [2]"),
    "scales_on_a_plain_cache": (lambda: (*append_case(), torch.ones(1), torch.ones(1)),
                                "k_scale/v_scale are for an FP8 cache (float8_e4m3fn); this cache is float16"),
    "per_tensor_and_per_head": (lambda: (*fp8_append_case()[:5], torch.ones(1), torch.ones(2)),
                                "must both be per tensor or both per KV head, got 1 and 2 values"),
}


APPEND_REFUSALS.update({f"fp8_{name}": case for name, case in FP8_APPEND_REFUSALS.items()})


@pytest.mark.parametrize("case", sorted(APPEND_REFUSALS))
def test_append_kv_refusals_name_what_is_wrong(no_cupy, case):
    make, message = APPEND_REFUSALS[case]
    tensors = make()
    assert any(message in r for r in step_ops.append_kv_unsupported(*tensors))
    with pytest.raises(PKVError, match=re.escape(message)):
        step_ops.append_kv(*tensors)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scale_shape", [(1,), (2,), ()])
def test_a_valid_fp8_append_on_the_cpu_has_only_the_device_reason(dtype, scale_shape):
    reasons = step_ops.append_kv_unsupported(*fp8_append_case(dtype=dtype, scale_shape=scale_shape))
    assert len(reasons) == 1 and "CUDA tensors only" in reasons[0], reasons


def test_append_kv_takes_a_strided_v_of_the_fused_qkv_rows():
    """v as the model passes it (a slice of qkv [T, Q]): only the device reason is left."""
    qkv = torch.zeros((3, (8 + 2 * 2) * 64), dtype=torch.float16)
    v = qkv[:, (8 + 2) * 64:].view(3, 2, 64)
    k_flat, v_flat, slots, k, _ = append_case()
    reasons = step_ops.append_kv_unsupported(k_flat, v_flat, slots, k, v)
    assert len(reasons) == 1 and "CUDA" in reasons[0], reasons


# -- the Kernels choice (CPU) ---------------------------------------------------------------------
def tiny_shape():
    from persistentkv.model import ModelShape

    return ModelShape("tiny", hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=64, num_layers=2,
                      intermediate_size=128, vocab_size=128)


def test_kernels_pkv_refuses_a_cpu_device(no_cupy):
    from persistentkv.model import Kernels

    with pytest.raises(PKVError, match="kernels=pkv needs a CUDA device, got cpu"):
        Kernels("pkv", tiny_shape(), "cpu")


def test_auto_kernels_pick_pkv_on_cuda_where_flashinfer_and_cupy_import():
    from persistentkv.model import KERNEL_CHOICES, Kernels
    from persistentkv.model.llama import auto_kernels

    assert "pkv" in KERNEL_CHOICES
    assert Kernels("auto", tiny_shape(), "cpu").name == "torch"

    def missing(*absent):
        return lambda name: [f"{name} is not installed"] if name in absent else []

    assert auto_kernels("cuda", missing()) == "pkv"
    assert auto_kernels("cuda", missing("cupy")) == "flashinfer"
    assert auto_kernels("cuda", missing("flashinfer")) == "torch"
    assert auto_kernels("cpu", missing()) == "torch"


def test_torch_kernels_run_todays_operations():
    import torch.nn.functional as F

    from persistentkv.model import Kernels

    K = Kernels("torch", tiny_shape(), "cpu")
    gen = torch.Generator().manual_seed(2)
    h, w = torch.randn(3, 64, generator=gen), torch.randn(256, 64, generator=gen)
    assert torch.equal(K.linear(h, w[:96]), F.linear(h, w[:96]))
    assert torch.equal(K.gate_up_silu(h, w), K.silu_mul(F.linear(h, w)))
    k_flat, v_flat, k, v = (torch.randn(s, generator=gen) for s in ((40, 2, 64), (40, 2, 64), (3, 2, 64), (3, 2, 64)))
    slots = torch.tensor([31, 2, 17])
    want_k, want_v = k_flat.clone().index_copy_(0, slots, k), v_flat.clone().index_copy_(0, slots, v)
    K.append(k_flat, v_flat, slots, k, v)
    assert torch.equal(k_flat, want_k) and torch.equal(v_flat, want_v)


# -- GPU ------------------------------------------------------------------------------------------
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
FP32_UNIT = 2.0**-24


def gamma(k: int) -> float:
    """Higham's gamma_K = K u / (1 - K u), u = 2^-24: |fl(sum) - sum| <= gamma_K sum |a_i| for K
    terms added in any order (lanes, shuffle tree, split partials alike)."""
    return k * FP32_UNIT / (1 - k * FP32_UNIT)


def error_bound(ref, magnitude, k: int, dtype: str):
    """Elementwise |y - ref| bound of a gemv (float64 [T, N] each): y = round(s) with s the fp32 sum
    of K exact products (fp16 x fp16 and bf16 x bf16 products fit in fp32's 24 bits, and fmaf
    rounds only the sum), so |s - ref| <= gamma_K |x| @ |w|^T (``magnitude``); the one rounding to
    the output adds u_out |s| (2^-11 fp16, 2^-8 bf16), and half of fp16's smallest subnormal step
    (2^-25) covers results near zero. Random inputs stay far inside it (errors grow like sqrt(K),
    not K), and a wrong index, row or rounding leaves it at once."""
    accumulation = gamma(k) * magnitude
    return UNIT_ROUNDOFF[dtype] * (ref.abs() + accumulation) + accumulation + 2.0**-25


def silu_bound(g, u, mag_g, mag_u, k: int, dtype: str):
    """As :func:`error_bound` for silu(g) * u: g and u carry E = gamma_K |x| |w|^T each; silu's
    slope lies in [-0.1, 1.1], so silu(g) moves by <= 1.1 E_g; the product's error is
    |silu(g)| E_u + 1.1 |u| E_g + 1.1 E_g E_u, plus fp32 rounding in expf (2 ulp), the add, the
    division and the product (16 u32 of the result: twice what they add up to), then the
    output's rounding u_out."""
    e_g, e_u = gamma(k) * mag_g, gamma(k) * mag_u
    silu = g * torch.sigmoid(g)
    ref = silu * u
    inner = silu.abs() * e_u + 1.1 * u.abs() * e_g + 1.1 * e_g * e_u + 16 * FP32_UNIT * ref.abs()
    return ref, UNIT_ROUNDOFF[dtype] * (ref.abs() + inner) + inner + 2.0**-25


def gpu_inputs(rows: int, n: int, k: int, dtype: str, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dt = getattr(torch, dtype)
    x = torch.randn((rows, k), generator=gen, device="cuda", dtype=torch.float32).to(dt)
    w = (torch.randn((n, k), generator=gen, device="cuda", dtype=torch.float32) * k ** -0.5).to(dt)
    return x, w


def assert_within(got, ref, bound, label: str) -> None:
    """Every element of ``got`` within its ``bound`` of the float64 ``ref`` (the worst ratio printed)."""
    err = (got.double() - ref).abs()
    print(f"{label}: max error / bound {float((err / bound).max()):.3f}")
    assert bool((err <= bound).all()), f"{int((err > bound).sum())} elements beyond the bound"


def seed_of(*parts) -> int:
    return int(np.frombuffer(repr(parts).encode(), np.uint8).astype(np.int64).sum() * 7919 % 2**31)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("n, k", GEMV_SHAPES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gemv_matches_float64(dtype, n, k):
    rows = 1
    x, w = gpu_inputs(rows, n, k, dtype, seed_of("gemv", rows, dtype, n, k))
    y = step_ops.gemv(x, w)
    torch.cuda.synchronize()
    assert y.shape == (rows, n) and y.dtype == x.dtype
    ref = x.double() @ w.double().T
    bound = error_bound(ref, x.double().abs() @ w.double().abs().T, k, dtype)
    assert_within(y, ref, bound, f"gemv T={rows} {dtype} {n}x{k}")


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("n2, k", GATE_UP_SHAPES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gemv_silu_mul_matches_float64(dtype, n2, k):
    rows = 1
    x, w = gpu_inputs(rows, n2, k, dtype, seed_of("silu", rows, dtype, n2, k))
    out = step_ops.gemv_silu_mul(x, w)
    torch.cuda.synchronize()
    i = n2 // 2
    assert out.shape == (rows, i) and out.dtype == x.dtype
    xd, wd = x.double(), w.double()
    g, u = xd @ wd[:i].T, xd @ wd[i:].T
    ref, bound = silu_bound(g, u, xd.abs() @ wd[:i].abs().T, xd.abs() @ wd[i:].abs().T, k, dtype)
    assert_within(out, ref, bound, f"gemv_silu_mul T={rows} {dtype} {n2}x{k}")


def gpu_append_case(rows: int, dtype, seed: int, slots_total: int = 1000, hkv: int = 8, d: int = 128):
    """Caches [2, S, Hkv, D] (random), k contiguous, v a slice of a fused qkv (row stride Q), and
    ``rows`` scattered, distinct slots."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cache = torch.randn((2, slots_total, hkv, d), generator=gen, device="cuda").to(dtype)
    qkv = torch.randn((rows, (4 * hkv + 2 * hkv) * d), generator=gen, device="cuda").to(dtype)
    k = torch.randn((rows, hkv, d), generator=gen, device="cuda").to(dtype)
    v = qkv[:, 5 * hkv * d:].view(rows, hkv, d)
    slots = torch.randperm(slots_total, generator=gen, device="cuda")[:rows]
    return cache, slots, k, v


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("rows, hkv", [(1, 8), (3, 8), (64, 8), (5, 1)])
def test_append_kv_is_index_copy(rows, hkv, dtype):
    cache, slots, k, v = gpu_append_case(rows, getattr(torch, dtype), seed_of("append", rows, hkv, dtype), hkv=hkv)
    want = cache.clone()
    want[0].index_copy_(0, slots, k)
    want[1].index_copy_(0, slots, v)
    step_ops.append_kv(cache[0], cache[1], slots, k, v)
    torch.cuda.synchronize()
    assert torch.equal(cache, want)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("rows, hkv", [(1, 8), (3, 8), (64, 8), (5, 1)])
def test_fp8_append_kv_is_fp8_quantize(rows, hkv, dtype, per_head):
    """Codes bit-identical to fp8.quantize(x, scale) of the source values, on rows holding every
    magnitude from e4m3's subnormals to 8x past its largest value (overflow saturates at +-448: no
    NaN code), ties, and fp16/bf16 values a float32-rounded quotient would double-round."""
    from persistentkv import fp8

    torch_dtype = getattr(torch, dtype)
    seed = seed_of("append_fp8", rows, hkv, dtype, per_head)
    _, slots, k, v = gpu_append_case(rows, torch_dtype, seed, hkv=hkv)
    gen = np.random.default_rng(seed)
    scales = [np.float32(gen.uniform(0.01, 2.0, hkv if per_head else 1)) for _ in range(2)]
    for t, scale in zip((k, v), scales):
        per = np.repeat(scale, hkv) if scale.size == 1 else scale
        magnitude = np.exp2(gen.uniform(-12, 12, tuple(t.shape))) * per[None, :, None]
        ties = (fp8.code_values()[gen.integers(0, 126, tuple(t.shape))] + fp8.code_values()[
            gen.integers(0, 126, tuple(t.shape))]) / 2 * per[None, :, None]
        values = np.where(gen.random(tuple(t.shape)) < 0.3, ties, magnitude) * gen.choice([-1.0, 1.0], tuple(t.shape))
        t.copy_(torch.from_numpy(values.astype(np.float32)).to(torch_dtype))
    slots_total = 1000
    caches = torch.full((2, slots_total, hkv, 128), 0x55, dtype=torch.uint8, device="cuda")
    k_flat, v_flat = (c.view(torch.float8_e4m3fn) for c in caches)
    k_scale, v_scale = (torch.from_numpy(s).cuda() for s in scales)
    step_ops.append_kv(k_flat, v_flat, slots, k, v, k_scale, v_scale)
    torch.cuda.synchronize()
    got = caches.cpu().numpy()
    idx = slots.cpu().numpy()
    for c, t, scale in ((0, k, scales[0]), (1, v, scales[1])):
        x = t.float().cpu().numpy()
        assert np.abs(x).max() > 448 * scale.max(), "the rows must overflow e4m3"
        want = fp8.quantize(x, scale, head_axis=1 if per_head else None)
        assert np.array_equal(got[c][idx], want), f"{int((got[c][idx] != want).sum())} codes differ"
        assert not np.isin(got[c][idx], fp8.NAN_CODES).any()
    untouched = np.setdiff1d(np.arange(slots_total), idx)
    assert (got[:, untouched] == 0x55).all()


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_three_kernels_replay_in_a_cuda_graph_as_eager(dtype):
    from gpu_support import run_step

    dt = getattr(torch, dtype)
    x, w = gpu_inputs(1, 1280, 8192, dtype, seed_of("graph-gemv", dtype))         # split K
    h, gate_up = gpu_inputs(1, 2 * 3584, 8192, dtype, seed_of("graph-silu", dtype))
    cache, slots, k, v = gpu_append_case(4, dt, seed_of("graph-append", dtype))
    cache.fill_(float("nan"))
    eager_y, eager_a = step_ops.gemv(x, w), step_ops.gemv_silu_mul(h, gate_up)
    step_ops.append_kv(cache[0], cache[1], slots, k, v)
    eager_cache = cache.clone()
    y, a = torch.empty_like(eager_y), torch.empty_like(eager_a)

    def step():
        y.copy_(step_ops.gemv(x, w))
        a.copy_(step_ops.gemv_silu_mul(h, gate_up))
        step_ops.append_kv(cache[0], cache[1], slots, k, v)

    run_step(step, [y, a, cache], graph=True)  # poisons all three with NaN, then replays
    assert torch.equal(y, eager_y) and torch.equal(a, eager_a)
    assert torch.equal(cache[:, slots], eager_cache[:, slots])
    untouched = torch.ones(cache.shape[1], dtype=torch.bool, device="cuda")
    untouched[slots] = False
    assert bool(cache[:, untouched].isnan().all())


@pytest.mark.gpu
@requires_gpu
def test_kernels_pkv_fall_back_where_the_kernels_refuse():
    import torch.nn.functional as F

    from persistentkv.model import Kernels

    try:
        K = Kernels("pkv", tiny_shape(), "cuda")
    except PKVError as exc:
        pytest.skip(str(exc))
    x, w = gpu_inputs(2, 256, 512, "float16", 1)  # T = 2 > 1: cuBLAS
    assert torch.equal(K.linear(x, w), F.linear(x, w))
    x1 = x[:1]
    assert torch.equal(K.linear(x1, w), step_ops.gemv(x1, w))
    assert torch.equal(K.linear(x1.float(), w.float()), F.linear(x1.float(), w.float()))  # float32: cuBLAS
    with pytest.raises(PKVError, match="w is not contiguous"):
        step_ops.gemv(x1, w.t().contiguous().t())


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("tokens", [1, 2, 3, 4])
def test_pkv_forward_matches_the_torch_kernels(tokens):
    """The small GPU model (tests/test_gpu_model.py's shape, fp16) through Model.forward with each
    kernels choice over the same T tokens, attention a causal SDPA over them after the append: the
    logits agree to fp16 rounding (2e-2 of the largest |logit|: three layers of fp16 activations,
    FlashInfer's norms against torch's) and every row's top-1 is the same."""
    import torch.nn.functional as F

    from persistentkv.model import Model, ModelShape, random_weights

    shape = ModelShape("gpu_small", hidden_size=512, num_heads=8, num_kv_heads=2, head_dim=128, num_layers=3,
                       intermediate_size=1024, vocab_size=256, rope_theta=500000.0, rms_norm_eps=1e-5)
    weights = random_weights(shape, torch.float16, "cuda", seed=20260623)
    try:
        pkv = Model(shape, weights, "pkv", max_position=64)
    except PKVError as exc:
        pytest.skip(str(exc))
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    ids = torch.randint(0, shape.vocab_size, (tokens,), generator=gen, device="cuda")
    positions = torch.arange(5, 5 + tokens, device="cuda")
    slots = torch.randperm(64, generator=gen, device="cuda")[:tokens]

    def run(model):
        cache = torch.zeros((2, 64, shape.num_kv_heads, shape.head_dim), dtype=torch.float16, device="cuda")

        def attend(l, q, k, v):
            model.kernels.append(cache[0], cache[1], slots, k, v)
            o = F.scaled_dot_product_attention(q.transpose(0, 1), cache[0, slots].transpose(0, 1),
                                               cache[1, slots].transpose(0, 1), is_causal=True, enable_gqa=True,
                                               scale=shape.head_dim ** -0.5)
            return o.transpose(0, 1).contiguous()

        with torch.no_grad():
            return model.forward(ids, positions, attend).float()

    got, ref = run(pkv), run(Model(shape, weights, "torch"))
    worst = float((got - ref).abs().max() / ref.abs().max())
    print(f"T={tokens}: pkv logits within {worst:.2e} of the largest |logit|")
    assert worst < 2e-2
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
