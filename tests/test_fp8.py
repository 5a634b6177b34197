"""FP8 e4m3 KV caches on the host: fp8.py against torch's conversion, the spec's kv_dtype, the
NumPy executor on an FP8 cache against float64, and the FP8 bad inputs.

* fp8.code_values is torch CPU's float8_e4m3fn value of all 256 codes; fp8.quantize is torch's
  ``.to(torch.float8_e4m3fn)`` bit for bit over a wide range (subnormals, ties, +-0, overflow
  saturating at +-448, inf, NaN); dequantize with per-head scales; scale_reasons; fit_scale.
* AttentionSpec.kv_dtype: default, FP8, refusals; kv_bytes_per_token; to_dict / from_dict.
* Capabilities.shape_reasons with kv_dtypes; the numpy backend reads an FP8 cache.
* The numpy backend on (K codes, V codes, k_scale, v_scale) against reference_decode on the
  float64 dequantised cache, gated per (row, head) at the query dtype's TOLERANCE: ragged rows,
  page-boundary lengths, scattered pages, per-tensor and per-head scales, every stress kind.
* FP8_BAD_INPUT: the FP8 rows of docs/BAD_INPUT.md (tests/test_bad_input.py's format; the engine's
  rows run its real checks, Engine._check and _check_scales, on CPU tensors).
"""

from __future__ import annotations

from dataclasses import replace

import math
import types

import numpy as np
import pytest

from numerics import KINDS, stress_case
from persistentkv import fp8
from persistentkv.backends.base import Capabilities
from persistentkv.backends.numpy_backend import NumpyBackend
from persistentkv.cache import Batch, make_batch, random_cache, random_fp8_cache, random_queries
from persistentkv.errors import PKVError
from persistentkv.plan import TILE_TOKENS
from persistentkv.reference import TOLERANCE, dequantized_cache, gate, reference_decode
from persistentkv.spec import FP8_KV, AttentionSpec
from test_bad_input import Bad

torch = pytest.importorskip("torch", reason="torch's float8_e4m3fn is the conversion fp8.py is checked against")


def fp8_spec(dtype="float16", hkv=2, group=4, head_dim=64, page_size=16) -> AttentionSpec:
    return AttentionSpec(num_qo_heads=hkv * group, num_kv_heads=hkv, head_dim=head_dim, page_size=page_size,
                         dtype=dtype, kv_dtype=FP8_KV)


def torch_codes(values) -> np.ndarray:
    return torch.from_numpy(np.asarray(values, np.float32)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


# -- fp8.py against torch -------------------------------------------------------------------------
def test_every_codes_value_is_torchs():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = codes.view(torch.float8_e4m3fn).double().numpy()
    got = fp8.code_values()
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(got).sum() == 2
    assert np.array_equal(got[~np.isnan(got)], want[~np.isnan(want)])
    finite = ~np.isnan(got)
    assert np.array_equal(np.signbit(got[finite]), np.signbit(want[finite]))   # 0x80 is -0
    assert got[0x7E] == fp8.E4M3_MAX and got[0x01] == 2.0**-9


def test_quantize_is_torchs_conversion_over_a_wide_range():
    rng = np.random.default_rng(3)
    grid = fp8.code_values()[:0x7F]
    mids = (grid[:-1] + grid[1:]) / 2                                 # every tie, subnormal ones too
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, 448, 449, 464, 465, 1e30, 2.0**-10, 2.0**-11, 2.0**-140]
    values = np.concatenate([rng.standard_normal(200_000) * np.exp2(rng.uniform(-16, 12, 200_000)),
                             grid, mids, special]).astype(np.float32)
    values = np.concatenate([values, -values, np.nextafter(values, np.float32(np.inf)),
                             np.nextafter(values, np.float32(-np.inf))])
    got, want = fp8.quantize(values), torch_codes(values)
    nan = np.isnan(values)                                            # torch keeps NaN's sign (0xFF), fp8.py
    assert np.array_equal(got[~nan], want[~nan])                      # writes 0x7F: both are NaN
    assert np.isin(got[nan], fp8.NAN_CODES).all() and np.isin(want[nan], fp8.NAN_CODES).all()
    assert not np.isin(got[~np.isnan(values)], fp8.NAN_CODES).any()   # overflow saturates, never NaN
    assert fp8.quantize([1e9])[0] == 0x7E and fp8.quantize([-np.inf])[0] == 0xFE


def test_quantize_with_scales_is_torchs_conversion_of_the_quotient():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((6, 4, 3, 8)) * 100                      # [pages, P, Hkv, D]
    scale = np.float32([0.05, 0.5, 2.0])
    want = torch_codes(x / scale.astype(np.float64)[None, None, :, None])
    assert np.array_equal(fp8.quantize(x, scale, head_axis=2), want)
    assert np.array_equal(fp8.quantize(x, np.float32([0.5])), torch_codes(x / 0.5))


def test_dequantize_with_per_head_scales():
    codes = np.arange(256, dtype=np.uint8)[:240].reshape(2, 3, 5, 8)   # head axis 2: 5 heads
    scale = np.float32([1, 0.5, 2, 3, 0.25])
    got = fp8.dequantize(codes, scale, head_axis=2)
    want = fp8.code_values()[codes] * scale.astype(np.float64)[None, None, :, None]
    assert got.dtype == np.float64 and np.array_equal(got, want, equal_nan=True)
    f32 = fp8.dequantize(codes, scale, head_axis=2, dtype=np.float32)
    assert f32.dtype == np.float32 and np.array_equal(f32, want.astype(np.float32), equal_nan=True)
    with pytest.raises(PKVError, match="FP8 codes must be uint8"):
        fp8.dequantize(codes.astype(np.int16))
    with pytest.raises(PKVError, match="per-head scales must be one value per KV head along head_axis"):
        fp8.dequantize(codes, scale)


@pytest.mark.parametrize("scale, reason", [
    (1.0, None), (np.float32([0.5]), None), (np.float32([0.5, 2]), None),
    (np.float32([1, 2, 3]), "k_scale must hold one value or one per KV head (2), got shape [3]"),
    (np.int32([1]), "k_scale must be floating point, got int32"),
    (np.float32([[1, 2]]), "k_scale must hold one value or one per KV head (2), got shape [1, 2]"),
    (float("nan"), "k_scale must be finite and > 0, got nan"),
    (np.float32([1, -1]), "k_scale must be finite and > 0, got -1.0"),
    (0.0, "k_scale must be finite and > 0, got 0.0"),
    (np.float32([np.inf]), "k_scale must be finite and > 0, got inf"),
])
def test_scale_reasons(scale, reason):
    assert fp8.scale_reasons("k_scale", scale, 2) == ([] if reason is None else [reason])


def test_fit_scale_maps_the_largest_magnitude_to_448():
    x = np.zeros((3, 4, 2, 8))
    x[..., 0, :] = np.linspace(-7, 3, 96).reshape(3, 4, 8)           # head 1 stays all zero
    assert fp8.fit_scale(x).tolist() == [np.float32(7 / 448)]
    per_head = fp8.fit_scale(x, head_axis=2)
    assert per_head.dtype == np.float32 and per_head.tolist() == [np.float32(7 / 448), 1.0]
    codes = fp8.quantize(x, per_head, head_axis=2)
    assert np.abs(fp8.dequantize(codes, per_head, head_axis=2)).max() <= 7 * (1 + 2**-20)
    assert fp8.code_values()[codes].max() == 448 or fp8.code_values()[codes].min() == -448


# -- the spec and the capabilities ----------------------------------------------------------------
def test_kv_dtype_defaults_to_the_query_dtype_and_takes_fp8():
    plain = AttentionSpec(dtype="bfloat16")
    assert plain.kv_dtype is None and plain.cache_dtype == "bfloat16" and not plain.fp8_kv and plain.kv_itemsize == 2
    spec = AttentionSpec(kv_dtype=FP8_KV)
    assert spec.fp8_kv and spec.kv_itemsize == 1 and spec.itemsize == 2
    assert spec.kv_bytes_per_token * 2 == AttentionSpec().kv_bytes_per_token == 2 * 8 * 128 * 2
    # the query's dtype spelled out is stored as None, so replace(spec, dtype=) keeps the cache in step
    assert AttentionSpec(kv_dtype="float16") == AttentionSpec()
    assert replace(AttentionSpec(kv_dtype="float16"), dtype="bfloat16").cache_dtype == "bfloat16"


@pytest.mark.parametrize("kv_dtype", ["float8_e5m2", "float32", "int8", ["float8_e4m3"]])
def test_other_kv_dtypes_are_refused_with_one_line(kv_dtype):
    with pytest.raises(PKVError, match=r"^kv_dtype=.*: the cache holds float16 \(the query dtype\) or float8_e4m3$"):
        AttentionSpec(kv_dtype=kv_dtype)


def test_to_dict_omits_kv_dtype_when_it_is_the_query_dtype_and_round_trips_fp8():
    assert "kv_dtype" not in AttentionSpec().to_dict()
    spec = fp8_spec()
    assert spec.to_dict()["kv_dtype"] == FP8_KV
    assert AttentionSpec.from_dict(spec.to_dict()) == spec
    assert AttentionSpec.from_dict(AttentionSpec().to_dict()) == AttentionSpec()


def test_shape_reasons_read_kv_dtypes():
    plain = Capabilities(dtypes=("float16",), graph="none")
    assert plain.shape_reasons(fp8_spec(), "k") == ["k does not read a float8_e4m3 KV cache"]
    fp8_ok = Capabilities(dtypes=("float16",), graph="none", kv_dtypes=(FP8_KV,))
    assert fp8_ok.shape_reasons(fp8_spec(), "k") == []
    assert fp8_ok.shape_reasons(fp8_spec(dtype="float32"), "k") == ["k supports dtype float16, not float32"]
    assert NumpyBackend().unavailable(fp8_spec()) == []
    assert NumpyBackend().unavailable(fp8_spec(dtype="float64")) == []


# -- the NumPy executor on FP8 against float64 ----------------------------------------------------
def fp8_run(spec, batch, q, cache, route="workqueue", **options):
    backend = NumpyBackend(route, **options)
    out = np.full(q.shape, np.nan, dtype=q.dtype)                     # poison: every element written
    backend.run(q, cache, backend.plan(batch), out)
    return out


def judge(spec, batch, q, cache, **run):
    k, v = dequantized_cache(*cache)                                   # float64: the exact values
    ref = reference_decode(q, k, v, batch)
    out = fp8_run(spec, batch, q, cache, **run)
    verdict = gate(out, ref, TOLERANCE[spec.dtype], batch.seq_lens)
    assert verdict.passed, verdict.describe()
    return verdict


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("rho", [0.0, 0.5])
def test_executor_on_fp8_ragged_scattered_rows(dtype, per_head, rho):
    spec = fp8_spec(dtype)
    lengths = [1, 15, 16, 17, 200, 700, 33]
    batch = make_batch(spec, lengths, rho, seed=5)
    cache = random_fp8_cache(spec, batch.num_pages, 5, per_head=per_head)
    q = random_queries(spec, batch.batch_size, 5)
    judge(spec, batch, q, cache)
    judge(spec, batch, q, cache, route="split", num_splits=3)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_executor_on_fp8_at_page_boundaries(page_size):
    spec = fp8_spec(page_size=page_size)
    lengths = sorted({1, max(1, page_size - 1), page_size, page_size + 1, TILE_TOKENS - 1, TILE_TOKENS + 1})
    batch = make_batch(spec, lengths, 0.25, seed=page_size)
    cache = random_fp8_cache(spec, batch.num_pages, page_size, per_head=True)
    judge(spec, batch, random_queries(spec, batch.batch_size, page_size), cache, target_items=7)


def test_executor_dequantises_in_float32_as_the_gpu_multiplies():
    """One rounding of value x scale to float32: the executor's cache; float64: the reference's."""
    spec = fp8_spec("float32")
    batch = make_batch(spec, [40], 0.0, 0)
    codes_k, codes_v, _, _ = random_fp8_cache(spec, batch.num_pages, 0)
    scale = np.float32([0.1])                                          # value x 0.1 is inexact in float32
    k32, _ = dequantized_cache(codes_k, codes_v, scale, scale, dtype=np.float32)
    k64, _ = dequantized_cache(codes_k, codes_v, scale, scale)
    assert np.array_equal(k32, (fp8.code_values()[codes_k].astype(np.float32) * scale[0]))
    assert not np.array_equal(k32.astype(np.float64), k64)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("per_head", [False, True])
def test_executor_on_fp8_stress_inputs(kind, per_head):
    plain = AttentionSpec(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype="float16")
    spec = fp8_spec()
    base, q, k, v = stress_case(kind, plain, [1, 37, 300, 129], seed=9)
    batch = Batch(spec, base.seq_lens, base.kv_indptr, base.kv_indices, base.num_pages)
    axis = 2 if per_head else None
    k_scale, v_scale = fp8.fit_scale(k, axis), fp8.fit_scale(v, axis)
    cache = (fp8.quantize(k, k_scale, axis), fp8.quantize(v, v_scale, axis), k_scale, v_scale)
    judge(spec, batch, q, cache)


def test_random_fp8_cache_quantises_random_cache():
    spec = fp8_spec(dtype="float32")
    plain = AttentionSpec(**{**spec.to_dict(), "kv_dtype": None})
    k, v = random_cache(plain, 5, 3)
    kc, vc, ks, vs = random_fp8_cache(spec, 5, 3)
    assert kc.dtype == vc.dtype == np.uint8 and kc.shape == k.shape and ks.shape == vs.shape == (1,)
    assert ks.dtype == np.float32 and np.array_equal(kc, fp8.quantize(k, ks)) and np.array_equal(vs, fp8.fit_scale(v))
    kc2, _, ks2, _ = random_fp8_cache(spec, 5, 3, per_head=True)
    assert ks2.shape == (2,) and np.array_equal(kc2, fp8.quantize(k, ks2, 2))
    assert np.array_equal(random_fp8_cache(spec, 5, 3)[0], kc)       # seeded
    with pytest.raises(PKVError, match="^random_fp8_cache makes an FP8 cache; this spec's cache is float32$"):
        random_fp8_cache(plain, 5, 3)


def test_dequantized_cache_checks_its_inputs():
    codes = np.zeros((2, 4, 2, 64), np.uint8)
    with pytest.raises(PKVError, match="^v_codes must be uint8 e4m3 codes, got dtype float16$"):
        dequantized_cache(codes, codes.astype(np.float16), 1.0, 1.0)
    with pytest.raises(PKVError, match=r"^v_scale must hold one value or one per KV head \(2\), got shape \[3\]$"):
        dequantized_cache(codes, codes, 1.0, np.float32([1, 1, 1]))
    with pytest.raises(PKVError, match=r"^v_codes shape \(1, 4, 2, 64\) != k_codes shape \(2, 4, 2, 64\)$"):
        dequantized_cache(codes, codes[:1], 1.0, 1.0)


# -- the FP8 bad inputs (docs/BAD_INPUT.md) -------------------------------------------------------
SPEC8 = AttentionSpec(num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=4, dtype="float16", kv_dtype=FP8_KV)
SPEC16 = AttentionSpec(num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=4, dtype="float16")
BATCH8 = make_batch(SPEC8, [5, 9])
CACHE8 = random_fp8_cache(SPEC8, BATCH8.num_pages, 0)
Q8 = random_queries(SPEC8, BATCH8.batch_size, 0)


def numpy_run(q=Q8, cache=CACHE8):
    backend = NumpyBackend()
    out = np.zeros(Q8.shape, np.float16) if q.dtype != np.uint8 else np.zeros(Q8.shape, np.uint8)
    backend.run(q, cache, backend.plan(BATCH8), out)


def engine_check(spec, q_dtype=None, k_dtype=None, v_dtype=None, k_scale=None, v_scale=None, device="cpu"):
    """The engine's own checks (engine.Engine._check, _check_scales) on CPU tensors: an object
    with the attributes they read stands in for an engine (whose constructor needs a GPU)."""
    from persistentkv.engine import DecodeEngine as Engine

    fp8_cache = torch.float8_e4m3fn if spec.fp8_kv else torch.float16
    cuda = types.SimpleNamespace(is_current_stream_capturing=lambda: False)   # no CUDA on a CPU torch
    fake = types.SimpleNamespace(spec=spec, torch=types.SimpleNamespace(**{**vars(torch), "cuda": cuda}),
                                 torch_dtype=torch.float16, cache_dtype=fp8_cache, device=torch.device(device))
    fake._check_scales = lambda ks, vs: Engine._check_scales(fake, ks, vs)
    if q_dtype is None and k_dtype is None and v_dtype is None:
        return Engine._check_scales(fake, k_scale, v_scale)
    q = torch.zeros(2, spec.num_qo_heads, spec.head_dim, dtype=q_dtype or torch.float16)
    kv = (BATCH8.num_pages, spec.page_size, spec.num_kv_heads, spec.head_dim)
    k = torch.zeros(kv, dtype=k_dtype or fp8_cache)
    v = torch.zeros(kv, dtype=v_dtype or fp8_cache)
    plan = types.SimpleNamespace(batch_size=2, num_pages=BATCH8.num_pages)
    return Engine._check(fake, q, k, v, torch.zeros_like(q), None, plan, k_scale, v_scale)


def step_append(**case):
    from persistentkv.model import step_ops

    cache = torch.zeros((2, 8, 2, 64), dtype=case.get("cache", torch.float8_e4m3fn))
    rows = torch.zeros((1, 2, 64), dtype=case.get("rows", torch.float16))
    scale = case.get("scale", torch.ones(1))
    if "no_device" in case:   # the device reason aside (no GPU here): what remains is the FP8 one
        reasons = step_ops.append_kv_unsupported(cache[0], cache[1], torch.zeros(1, dtype=torch.int64), rows, rows,
                                                 scale, scale)
        raise PKVError("; ".join(r for r in reasons if "CUDA" not in r))


ONES = torch.ones(1)
FP8_BAD_INPUT = [
    Bad("silent", "engine.run", "an FP8 cache with a spec whose kv_dtype is float16",
        lambda: engine_check(SPEC16, k_dtype=torch.float8_e4m3fn),
        "k_cache has dtype torch.float8_e4m3fn, expected torch.float16; an FP8 cache needs float8_e4m3fn codes and "
        "AttentionSpec(kv_dtype='float8_e4m3')"),
    Bad("silent", "engine.run", "FP8 K with float16 V",
        lambda: engine_check(SPEC8, v_dtype=torch.float16, k_scale=ONES, v_scale=ONES),
        "v_cache has dtype torch.float16, expected torch.float8_e4m3fn"),
    Bad("silent", "engine.run", "an e5m2 cache",
        lambda: engine_check(SPEC8, k_dtype=torch.float8_e5m2, v_dtype=torch.float8_e5m2),
        "k_cache has dtype torch.float8_e5m2, expected torch.float8_e4m3fn; an FP8 cache needs float8_e4m3fn codes "
        "and AttentionSpec(kv_dtype='float8_e4m3') (e5m2 is not supported)"),
    Bad("silent", "engine.run", "k_scale NaN",
        lambda: engine_check(SPEC8, k_scale=torch.tensor([math.nan]), v_scale=ONES),
        "k_scale must be finite and > 0, got nan"),
    Bad("silent", "engine.run", "v_scale 0",
        lambda: engine_check(SPEC8, k_scale=ONES, v_scale=torch.zeros(1)), "v_scale must be finite and > 0, got 0.0"),
    Bad("raw", "engine.run", "k_scale of 3 values for 2 KV heads",
        lambda: engine_check(SPEC8, k_scale=torch.ones(3), v_scale=ONES),
        "k_scale must be a contiguous float32 tensor of 1 or 2 (num_kv_heads) values on cpu, got torch.float32 [3] "
        "on cpu"),
    Bad("silent", "engine.run", "k_scale float16",
        lambda: engine_check(SPEC8, k_scale=torch.ones(1, dtype=torch.float16), v_scale=ONES),
        "k_scale must be a contiguous float32 tensor of 1 or 2 (num_kv_heads) values on cpu, got torch.float16 [1] "
        "on cpu"),
    Bad("raw", "engine.run", "k_scale on the host, the cache on cuda:0",
        lambda: engine_check(SPEC8, k_scale=ONES, v_scale=ONES, device="cuda:0"),
        "k_scale must be a contiguous float32 tensor of 1 or 2 (num_kv_heads) values on cuda:0, got torch.float32 "
        "[1] on cpu"),
    Bad("accepted", "engine.run", "an FP8 query",
        lambda: engine_check(SPEC8, q_dtype=torch.float8_e4m3fn, k_scale=ONES, v_scale=ONES),
        "q has dtype torch.float8_e4m3fn, expected torch.float16; an FP8 query is not supported (the engine keeps "
        "queries and outputs in fp16/bf16)"),
    Bad("accepted", "spec.AttentionSpec", "kv_dtype 'float8_e5m2'",
        lambda: AttentionSpec(kv_dtype="float8_e5m2"),
        "kv_dtype='float8_e5m2': the cache holds float16 (the query dtype) or float8_e4m3"),
    Bad("accepted", "spec.AttentionSpec", "kv_dtype 'float32' with float16 queries",
        lambda: AttentionSpec(kv_dtype="float32"),
        "kv_dtype='float32': the cache holds float16 (the query dtype) or float8_e4m3"),
    Bad("silent", "numpy backend run", "an FP8 spec's cache as a (K, V) pair (codes read without scales)",
        lambda: numpy_run(cache=CACHE8[:2]),
        "numpy: an FP8 cache is (K codes, V codes, k_scale, v_scale), got a (K, V) pair"),
    Bad("silent", "numpy backend run", "FP8 codes with float16 V",
        lambda: numpy_run(cache=(CACHE8[0], CACHE8[1].astype(np.float16), *CACHE8[2:])),
        "v_codes must be uint8 e4m3 codes, got dtype float16"),
    Bad("silent", "numpy backend run", "k_scale NaN",
        lambda: numpy_run(cache=(*CACHE8[:2], np.float32([np.nan]), CACHE8[3])),
        "k_scale must be finite and > 0, got nan"),
    Bad("raw", "numpy backend run", "v_scale of 3 values for 2 KV heads",
        lambda: numpy_run(cache=(*CACHE8[:3], np.float32([1, 1, 1]))),
        "v_scale must hold one value or one per KV head (2), got shape [3]"),
    Bad("accepted", "numpy backend run", "an FP8 query (uint8 codes)",
        lambda: numpy_run(q=fp8.quantize(Q8)),
        "numpy: q is uint8; an FP8 query is not supported (queries and outputs stay in the spec's dtype, float16)"),
    Bad("accepted", "cache.random_fp8_cache", "a float16 spec",
        lambda: random_fp8_cache(SPEC16, 4, 0),
        "random_fp8_cache makes an FP8 cache; this spec's cache is float16"),
    Bad("silent", "model.step_ops.append_kv", "an e5m2 cache",
        lambda: step_append(cache=torch.float8_e5m2, no_device=True),
        "append_kv: the cache is float8_e5m2; e5m2 is not supported (an FP8 cache holds float8_e4m3fn codes)"),
    Bad("silent", "model.step_ops.append_kv", "float32 rows into an FP8 cache",
        lambda: step_append(rows=torch.float32, no_device=True),
        "append_kv: an FP8 cache takes float16 or bfloat16 rows (k and v of one dtype) into float8_e4m3fn k_flat and "
        "v_flat, got float32, float32, float8_e4m3fn, float8_e4m3fn"),
    Bad("raw", "model.step_ops.append_kv", "k_scale of 3 values for 2 KV heads",
        lambda: step_append(scale=torch.ones(3), no_device=True),
        "append_kv: k_scale must be a contiguous float32 tensor of 1 or 2 (num_kv_heads) values, got float32 [3]; "
        "append_kv: v_scale must be a contiguous float32 tensor of 1 or 2 (num_kv_heads) values, got float32 [3]"),
]


@pytest.mark.parametrize("case", FP8_BAD_INPUT, ids=[case.id for case in FP8_BAD_INPUT])
def test_fp8_bad_input_gives_its_one_line_message(case):
    with pytest.raises(PKVError) as info:
        case.call()
    assert str(info.value) == case.message and "\n" not in case.message
