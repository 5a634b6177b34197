"""Every kernel compiles for sm_80 and sm_90 with nvcc (no GPU needed), without spills, in the
default 4-warp modules, the 8-warp ones and the trace build; unsupported warp counts are refused
before nvcc; the pkv backends hand the engine the options it takes."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from persistentkv.cli import main
from persistentkv.engine import DecodeEngine, engine_unsupported
from persistentkv.errors import PKVError
from persistentkv.kernel_build import (CTAS4_MAX_SPILL_BYTES, FP8_MODULES, MODULES, check_arch, cubin_name, nvcc_path,
                                       parse_ptxas)
from persistentkv.model import step_ops
from persistentkv.launch import compile_options, kernels_dir, min_chunk_tiles_for, stage_tokens
from persistentkv.plan import TILE_TOKENS
from persistentkv.spec import FP8_KV, AttentionSpec

needs_nvcc = pytest.mark.skipif(nvcc_path() is None, reason="nvcc is not on PATH")

PTXAS_SAMPLE = """ptxas info    : Compiling entry function 'pkv_decode' for 'sm_90'
ptxas info    : Function properties for pkv_decode
    8 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 158 registers, used 1 barriers, 37136 bytes smem
"""


def test_parse_ptxas_reads_every_field():
    (row,) = parse_ptxas(PTXAS_SAMPLE)
    assert row == {"kernel": "pkv_decode", "arch": "sm_90", "stack_bytes": 8, "spill_store_bytes": 8,
                   "spill_load_bytes": 4, "registers": 158, "static_shared_bytes": 37136}


@pytest.mark.parametrize("arch", ["sm_75", "sm90", "compute_90", "sm_9"])
def test_bad_architectures_are_refused(arch):
    with pytest.raises(PKVError):
        check_arch(arch)


@needs_nvcc
@pytest.mark.slow
def test_every_kernel_compiles_for_sm80_and_sm90_without_spills(tmp_path):
    out = tmp_path / "report.json"
    assert main(["compile-kernels", "--arch", "sm_80", "--arch", "sm_90", "--out", str(out),
                 "--cubin-dir", str(tmp_path / "cubins")]) == 0
    report = json.loads(out.read_text())
    assert report["status"] == "ok"
    kernels = {(r["kernel"], r["arch"], r["dtype"], r.get("kv_dtype"), r["head_dim"], r["warps"], r.get("ctas_per_sm"))
               for r in report["kernels"]}
    decode = ("pkv_decode", "pkv_decode_fused", "pkv_merge", "pkv_plan")
    expected = {(k, a, d, d, h, w, None) for k in decode for a in ("sm_80", "sm_90") for d, h, w in MODULES} | \
        {(k, a, d, "float8_e4m3", h, w, c) for k in decode for a in ("sm_80", "sm_90") for d, h, w, c in FP8_MODULES}
    step = {(k, a, next((d for d in step_ops.DTYPES if f"_{d}_" in k), ""), None, 0, step_ops.BLOCK_WARPS, None)
            for k in step_ops.ENTRY_POINTS for a in ("sm_80", "sm_90")}   # the decode step's own kernels
    assert kernels == expected | step
    assert {d for _, _, d, _, _, _, _ in step} == {"float16", "bfloat16", ""}  # pkv_append_kv takes any dtype
    assert set(MODULES) == {(d, h, 4) for d in ("float16", "bfloat16") for h in (64, 128, 256)} | \
        {(d, h, 8) for d in ("float16", "bfloat16") for h in (64, 128)}
    assert set(FP8_MODULES) == {(*m, None) for m in MODULES} | \
        {(d, h, 4, c) for d in ("float16", "bfloat16") for h in (64, 128) for c in (3, 4)}
    for row in report["kernels"]:
        # 4 CTAs per SM cap a thread at 128 registers: a few words spill at head_dim 128
        spills = CTAS4_MAX_SPILL_BYTES if row.get("ctas_per_sm") == 4 else 0
        assert row["spill_store_bytes"] <= spills and row["spill_load_bytes"] <= spills, row
        assert row["registers"] <= 65536 // (128 * (row.get("ctas_per_sm") or 2)) // 8 * 8 or \
            row["kernel"] not in ("pkv_decode", "pkv_decode_fused"), row
        assert row["registers"] <= 255, row
    assert {p.name for p in (tmp_path / "cubins").glob("*.cubin")} == \
        {cubin_name(d, h, w, a) for d, h, w in MODULES for a in ("sm_80", "sm_90")} | \
        {cubin_name(d, h, w, a, "float8_e4m3", c) for d, h, w, c in FP8_MODULES for a in ("sm_80", "sm_90")} | \
        {step_ops.cubin_name(a) for a in ("sm_80", "sm_90")}


def test_cubin_names_keep_the_default_and_suffix_w8():
    assert cubin_name("float16", 128, 4, "sm_90") == "pkv_float16_d128_sm_90.cubin"
    assert cubin_name("bfloat16", 64, 8, "sm_80") == "pkv_bfloat16_d64_sm_80_w8.cubin"
    assert cubin_name("float16", 128, 4, "sm_90", "float8_e4m3") == "pkv_float16_fp8_d128_sm_90.cubin"
    assert cubin_name("bfloat16", 128, 4, "sm_90", "float8_e4m3", 3) == "pkv_bfloat16_fp8_d128_sm_90_c3.cubin"


def test_compile_options_define_warps_only_for_8():
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    default = compile_options(spec)
    assert compile_options(spec, 4) == default and not any("PKV_WARPS" in o for o in default)
    assert compile_options(spec, 8) == (*default, "-DPKV_WARPS=8")


def test_compile_options_define_ctas_only_off_the_default():
    spec = AttentionSpec(32, 8, 128, 16, "float16", kv_dtype=FP8_KV)
    default = compile_options(spec)
    assert compile_options(spec, 4, ctas_per_sm=2) == default
    assert compile_options(spec, 8, ctas_per_sm=1) == compile_options(spec, 8)
    assert compile_options(spec, 4, ctas_per_sm=3) == (*default, "-DPKV_CTAS_PER_SM=3")
    assert compile_options(spec, 4, ctas_per_sm=4, trace=True) == (*default, "-DPKV_CTAS_PER_SM=4", "-DPKV_TRACE=1")


@pytest.mark.parametrize("spec, warps, ctas, message", [
    (AttentionSpec(32, 8, 128, 16, "float16"), 4, 3, "ctas_per_sm=3 is built for an FP8 cache at head_dim <= 128 "
                                                    "(got a float16 cache at head_dim 128); use the default, 2"),
    (AttentionSpec(32, 8, 256, 16, "bfloat16", kv_dtype=FP8_KV), 4, 4, "got an FP8 cache at head_dim 256"),
    (AttentionSpec(32, 8, 128, 16, "float16", kv_dtype=FP8_KV), 8, 2, "ctas_per_sm must be one of 1 at 8 warps, got 2"),
    (AttentionSpec(32, 8, 128, 16, "float16", kv_dtype=FP8_KV), 4, 5, "must be one of 2, 3, 4 at 4 warps, got 5"),
    (AttentionSpec(32, 8, 128, 16, "float16", kv_dtype=FP8_KV), 4, True, "got True"),
])
def test_unsupported_ctas_are_refused_before_any_compile(spec, warps, ctas, message):
    assert any(message in r for r in engine_unsupported(spec, warps, ctas))
    with pytest.raises(PKVError, match=re.escape(message)):
        compile_options(spec, warps, ctas_per_sm=ctas)
    with pytest.raises(PKVError, match=re.escape(message)):  # before the GPU checks, compile or launch
        DecodeEngine(spec, warps=warps, ctas_per_sm=ctas)


@needs_nvcc
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("ctas", [3, 4])
def test_fp8_modules_for_more_ctas_fit_their_register_cap(tmp_path, dtype, head_dim, ctas):
    """The FP8 4-warp modules built for 3 and 4 CTAs per SM (sm_90) stay within 65536 / (ctas x 128)
    registers, so the occupancy the engine's queue assumes is what the SM can hold; at 3 CTAs they do
    not spill, at 4 (128 registers) at most a few words at head_dim 128 (8-20 bytes on sm_90)."""
    spec = AttentionSpec(32, 8, head_dim, 16, dtype, kv_dtype=FP8_KV)
    cmd = [nvcc_path(), "-cubin", "-arch=sm_90", "-O3", "-Xptxas", "-v", "-o", str(tmp_path / "x.cubin"),
           *compile_options(spec, 4, ctas_per_sm=ctas), str(kernels_dir() / "pkv_decode.cu")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["kernel"]: r for r in parse_ptxas(proc.stderr)}
    for name in ("pkv_decode", "pkv_decode_fused"):
        assert rows[name]["registers"] <= 65536 // (ctas * 128) // 8 * 8, rows[name]
        assert rows[name]["spill_store_bytes"] <= (0 if ctas == 3 or head_dim == 64 else CTAS4_MAX_SPILL_BYTES), \
            rows[name]


@needs_nvcc
def test_the_kernel_itself_refuses_ctas_off_the_4_warp_range(tmp_path):
    cmd = [nvcc_path(), "-cubin", "-arch=sm_90", "-o", str(tmp_path / "x.cubin"), "-DPKV_HEAD_DIM=128",
           "-DPKV_WARPS=8", "-DPKV_CTAS_PER_SM=2", str(kernels_dir() / "pkv_decode.cu")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode != 0 and "PKV_CTAS_PER_SM: 2-4 CTAs of 4 warps" in proc.stderr


def test_the_trace_build_adds_one_define():
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    assert compile_options(spec, 8, trace=True) == (*compile_options(spec, 8), "-DPKV_TRACE=1")


@pytest.mark.parametrize("option", ["trace"])
@pytest.mark.parametrize("bad", ["yes", 1])
def test_engine_flags_must_be_bools_before_any_gpu_check(option, bad):
    with pytest.raises(PKVError, match=f"{option} must be"):
        DecodeEngine(AttentionSpec(32, 8, 128, 16, "float16"), **{option: bad})



@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_trace_build_compiles_without_spills(tmp_path, arch):
    """PKV_TRACE=1 (benchmarks/trace_cta.py) adds its stamps without spilling the decode kernels."""
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    cmd = [nvcc_path(), "-cubin", f"-arch={arch}", "-O3", "-Xptxas", "-v", "-o", str(tmp_path / "x.cubin"),
           *compile_options(spec, 8, trace=True), str(kernels_dir() / "pkv_decode.cu")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["kernel"]: r for r in parse_ptxas(proc.stderr)}
    for name in ("pkv_decode", "pkv_decode_fused"):
        assert rows[name]["spill_store_bytes"] == 0 and rows[name]["registers"] <= 255, rows[name]
        assert rows[name]["static_shared_bytes"] >= 16 * 8  # the CTA's trace record


@pytest.mark.parametrize("head_dim, warps, message", [
    (256, 8, "warps=8 needs head_dim <= 128"),
    (128, 6, "warps must be one of 4, 8, got 6"),
    (64, True, "warps must be one of 4, 8, got True"),
])
def test_unsupported_warps_are_refused_before_any_compile(head_dim, warps, message):
    spec = AttentionSpec(32, 8, head_dim, 16, "float16")
    assert any(message in r for r in engine_unsupported(spec, warps))
    with pytest.raises(PKVError, match=message):
        compile_options(spec, warps)
    with pytest.raises(PKVError, match=message):  # before the GPU checks, compile or launch
        DecodeEngine(spec, warps=warps)


@needs_nvcc
@pytest.mark.parametrize("head_dim, warps, message", [(256, 8, "PKV_WARPS=8 needs head_dim <= 128"),
                                                      (128, 6, "PKV_WARPS must be 4 or 8")])
def test_the_kernel_itself_refuses_unsupported_warps(tmp_path, head_dim, warps, message):
    """The kernel's static_asserts stand behind the engine's checks (nvcc stops in the front end)."""
    cmd = [nvcc_path(), "-cubin", "-arch=sm_90", "-o", str(tmp_path / "x.cubin"), f"-DPKV_HEAD_DIM={head_dim}",
           f"-DPKV_WARPS={warps}", str(kernels_dir() / "pkv_decode.cu")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode != 0 and message in proc.stderr


def test_stage_and_min_chunk_follow_warps():
    assert stage_tokens(4) == 64 and stage_tokens(8) == 128
    assert min_chunk_tiles_for(4) == 64 // TILE_TOKENS == 2
    assert min_chunk_tiles_for(8) == 128 // TILE_TOKENS == 4


def test_unsupported_specs_have_reasons():
    assert engine_unsupported(AttentionSpec(32, 8, 128, 16, "float16")) == []
    assert "G=32" in engine_unsupported(AttentionSpec(32, 1, 128, 16, "float16"))[0]
    assert "float32" in engine_unsupported(AttentionSpec(32, 8, 128, 16, "float32"))[0]


def test_pkv_backends_explain_why_they_cannot_run_here():
    pytest.importorskip("torch")
    import torch

    from persistentkv.backends.pkv import PKVBuckets, PKVSplit, PKVWorkqueue

    if torch.cuda.is_available():
        pytest.skip("a GPU is present; the GPU tests cover these backends")
    for backend in (PKVWorkqueue(), PKVBuckets(), PKVSplit()):
        reasons = backend.unavailable(AttentionSpec())
        assert reasons and any("CUDA" in r or "cupy" in r for r in reasons), reasons


def test_pkv_backends_pass_their_options_to_engine_plan(monkeypatch):
    """The route options a backend is built with reach DecodeEngine.plan under names it accepts."""
    import inspect

    from persistentkv import engine as engine_module
    from persistentkv.backends import pkv
    from persistentkv.backends.pkv import PKVBuckets, PKVSplit, PKVWorkqueue
    from persistentkv.cache import make_batch

    calls = []

    class FakeEngine:
        spec = AttentionSpec()
        num_sms = 132
        capability = (9, 0)
        target_items, min_chunk_tiles = 264, 2  # the queue the warps choice weighs (choose.choose_warps)

        def plan(self, batch, route, **options):
            inspect.signature(engine_module.DecodeEngine.plan).bind(self, batch, route, **options)
            calls.append((route, options))
            return "plan"

    monkeypatch.setattr(pkv, "engine_for", lambda spec, **options: FakeEngine())
    batch = make_batch(AttentionSpec(), [100, 2000])
    assert PKVWorkqueue(target_items=100, min_chunk_tiles=2).plan(batch) == "plan"
    PKVWorkqueue().plan(batch)
    PKVBuckets(num_splits=8).plan(batch)
    PKVSplit(num_splits=20).plan(batch)
    assert calls == [("workqueue", {"target_items": 100, "min_chunk_tiles": 2}), ("workqueue", {}),
                     ("buckets", {"num_splits": 8}), ("split", {"num_splits": 20})]


def test_pkv_workqueue_passes_warps_to_engine_for(monkeypatch):
    """warps shapes the engine (engine_for), never a plan; unset, the default engine is shared."""
    from persistentkv.backends import pkv
    from persistentkv.backends.pkv import PKVBuckets, PKVWorkqueue

    engines = []
    monkeypatch.setattr(pkv, "engine_for", lambda spec, **options: engines.append(options))
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    for backend in (PKVWorkqueue(warps=8), PKVWorkqueue(warps=4), PKVWorkqueue(), PKVBuckets()):
        backend.engine(spec)
    assert engines == [{"warps": 8}, {}, {}, {}]  # 4 and "auto" share the default (4-warp) engine
    assert any("warps=8 needs head_dim <= 128" in r
               for r in PKVWorkqueue(warps=8).unavailable(AttentionSpec(32, 8, 256, 16, "float16")))


def test_pkv_workqueue_auto_warps_picks_the_module_per_step(monkeypatch):
    """warps="auto": balanced rows plan on the 8-warp engine with its own defaults, ragged rows
    (whose 8-warp queue balances worse, choose.choose_warps) on the 4-warp engine with the
    backend's options; run() goes to the engine that planned; a device without the 8-warp module
    falls back to 4 warps for good."""
    from types import SimpleNamespace

    from persistentkv.backends import pkv
    from persistentkv.backends.pkv import PKVWorkqueue
    from persistentkv.cache import make_batch
    from persistentkv.errors import PKVError

    calls, refuse8 = [], []

    def engine_for(spec, warps=4):
        if warps == 8 and refuse8:
            raise PKVError("no 192 KB of shared memory here")

        engine = SimpleNamespace(spec=spec, capability=(9, 0), num_sms=132, target_items=132 * (12 - warps) // 4,
                                 min_chunk_tiles=warps // 2,  # H200 queues: (264, 2) at 4 warps, (132, 4) at 8
                                 run=lambda q, cache, p, out: calls.append((warps, "run")))

        def plan(batch, route, **options):
            calls.append((warps, route, options))
            return SimpleNamespace(warps=warps, spec=spec, engine=engine)  # a plan runs on its engine

        engine.plan = plan
        return engine

    monkeypatch.setattr(pkv, "engine_for", engine_for)
    spec = AttentionSpec()
    backend = PKVWorkqueue(target_items=264, min_chunk_tiles=2)
    balanced, ragged = make_batch(spec, [8192, 8000]), make_batch(spec, [8192, 1000])
    many_short = make_batch(spec, [1024] * 64)  # 512 groups > the 8-warp engine's 132 slots
    for batch in (balanced, ragged, many_short):
        backend.run(None, None, backend.plan(batch), None)
    assert calls == [(8, "workqueue", {}), (8, "run"),
                     (4, "workqueue", {"target_items": 264, "min_chunk_tiles": 2}), (4, "run"),
                     (4, "workqueue", {"target_items": 264, "min_chunk_tiles": 2}), (4, "run")]
    calls.clear()
    refuse8.append(True)
    fallback = PKVWorkqueue()
    fallback.plan(balanced)
    assert calls == [(4, "workqueue", {})] and "192 KB" in fallback._warps8_error
    for bad in (6, True, "8"):
        with pytest.raises(PKVError, match="warps must be one of auto, 4, 8"):
            PKVWorkqueue(warps=bad)


def test_pkv_workqueue_auto_builds_more_ctas_for_long_fp8_steps(monkeypatch):
    """On an FP8 cache, after choose_warps, choose_ctas_per_sm may move the step to the 4-warp
    module built for 3 or 4 CTAs per SM (engine_for(..., ctas_per_sm=K), planned with its own
    defaults, as the 8-warp module is: explicit queue options, the config's planner values, are
    the default 4-warp module's); an fp16 cache and short split steps never do; a module the device
    cannot hold falls back to choose_warps' module."""
    from types import SimpleNamespace

    from persistentkv.backends import pkv
    from persistentkv.backends.pkv import PKVWorkqueue
    from persistentkv.cache import make_batch

    built, refuse = [], set()

    def engine_for(spec, warps=4, ctas_per_sm=None):
        if ctas_per_sm in refuse:
            raise PKVError(f"holds 2 CTAs per SM, not {ctas_per_sm}")
        built.append((warps, ctas_per_sm))
        ctas = ctas_per_sm or (2 if warps == 4 else 1)
        engine = SimpleNamespace(spec=spec, warps=warps, ctas_per_sm=ctas_per_sm, num_sms=132,
                                 target_items=132 * ctas, min_chunk_tiles=warps // 2)
        engine.plan = lambda batch, route, **options: (engine, options)
        return engine

    monkeypatch.setattr(pkv, "engine_for", engine_for)
    fp8, fp16 = AttentionSpec(kv_dtype=FP8_KV), AttentionSpec()

    def module(backend, spec, lens):
        engine, options = backend.plan(make_batch(spec, lens))
        return engine.warps, engine.ctas_per_sm, options

    auto = PKVWorkqueue()
    assert module(auto, fp8, [131072]) == (4, 3, {})
    assert module(auto, fp8, [8192] * 64) == (4, 4, {})
    assert module(auto, fp8, [32768]) == (8, None, {})
    assert module(auto, fp8, [1024] * 64) == (4, 4, {})  # 512 one-item groups: no item floor
    assert module(auto, fp8, [4096]) == (8, None, {})     # 32 groups split into 83-token items
    assert module(auto, fp16, [131072]) == (8, None, {}) and module(auto, fp16, [8192] * 64) == (8, None, {})
    assert module(auto, fp8, [131072]) == (4, 3, {})
    assert built.count((4, 3)) == 1 and built.count((4, 4)) == 1  # each module built once per spec
    pinned = PKVWorkqueue(target_items=264, min_chunk_tiles=2)  # the pipeline's backend (config planner)
    assert module(pinned, fp8, [131072]) == (4, 3, {}) and module(pinned, fp8, [8192] * 64) == (4, 4, {})
    bimodal = [49152, 1024, 1024, 1024] * 2  # 4 warps, then 3 CTAs per SM
    assert module(auto, fp8, bimodal) == (4, 3, {}) and module(pinned, fp8, bimodal) == (4, 3, {})
    assert module(pinned, fp8, [1024] * 32) == (4, None, {"target_items": 264, "min_chunk_tiles": 2})
    assert module(pinned, fp16, [8192, 1000] * 4) == (4, None, {"target_items": 264, "min_chunk_tiles": 2})
    assert module(PKVWorkqueue(warps=8), fp8, [131072]) == (8, None, {})
    refuse.add(3)
    assert module(PKVWorkqueue(), fp8, [131072]) == (8, None, {})  # 3 CTAs do not fit: choose_warps' 8 warps
