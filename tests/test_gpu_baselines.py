"""Baselines and the harness on a CUDA GPU (skipped, with the reason, anywhere else).

Each installed baseline against the float64 reference, gated per (row, query head) (fp16 and
bf16; ragged rows at page boundaries; scattered pages with holes; G = 1, 4, 8; a contiguous cache
and K/V as strided views into one [pages, 2, P, Hkv, D] buffer, vLLM's layout), with a poisoned
output so an unwritten element fails; the same on every stress kind of tests/numerics.py (large scores, a one-hot
softmax, equal keys, the maximum in the last page or at the first token, large values, zero
queries); one plan serving two cache copies; CUDA-graph replay equal to eager; the harness end
to end on a small case; the ceilings; GPU validation rows.
"""

from __future__ import annotations

import pytest

from gpu_support import LAYOUTS, assert_rows_close, torch_dtype
from gpu_support import device_case as device_inputs
from gpu_support import reference_torch64 as reference64
from numerics import KINDS, stress_case
from persistentkv.backends import registry
from persistentkv.errors import PKVError
from persistentkv.measure.rows import one_line
from persistentkv.reference import reference_decode
from persistentkv.spec import AttentionSpec

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)"),
]

BASELINES = ("flashinfer-cc", "flashinfer-tc", "vllm-fa3", "trtllm-xqa", "flashinfer-cudnn", "torch-sdpa")
LENGTHS = [1, 15, 16, 17, 1000, 4097]


def backend_or_skip(name: str, spec: AttentionSpec, **options):
    backend = registry.create(name, **options)
    reasons = backend.unavailable(spec)
    if reasons:
        pytest.skip(f"{name} unavailable: {'; '.join(reasons)}")
    return backend


def run_or_skip(backend, q, cache, plan, out, layout: str) -> None:
    """``backend.run`` and a synchronise. On a strided (kv_interleaved) cache, a baseline whose
    library refuses strided K/V (raises) is skipped with what it said, never fed a copy; on a
    contiguous cache an error fails the test."""
    try:
        backend.run(q, cache, plan, out)
        torch.cuda.synchronize()
    except Exception as exc:
        if layout == "contiguous":
            raise
        pytest.skip(f"{backend.name} does not take a {layout} (strided) K/V cache: {one_line(exc)}")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("name", BASELINES)
def test_baseline_matches_float64(name, group, dtype, layout):
    spec = AttentionSpec(num_qo_heads=8 * group, num_kv_heads=8, head_dim=128, page_size=16, dtype=dtype)
    backend = backend_or_skip(name, spec)
    batch, q, k, v = device_inputs(spec, LENGTHS, seed=group, layout=layout)
    plan = backend.plan(batch)
    out = torch.full_like(q, float("nan"))
    run_or_skip(backend, q, (k, v), plan, out, layout)
    assert_rows_close(out, reference64(batch, q, k, v), dtype, f"{name} G={group} {dtype} {layout}",
                      seq_lens=batch.seq_lens)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", BASELINES)
def test_baseline_under_stress_matches_float64(name, kind, group, dtype):
    spec = AttentionSpec(num_qo_heads=8 * group, num_kv_heads=8, head_dim=128, page_size=16, dtype=dtype)
    backend = backend_or_skip(name, spec)
    batch, *host = stress_case(kind, spec, LENGTHS, seed=group)
    q, k, v = (torch.from_numpy(a).to(device="cuda", dtype=torch_dtype(dtype)) for a in host)
    plan = backend.plan(batch)
    out = torch.full_like(q, float("nan"))
    backend.run(q, (k, v), plan, out)
    torch.cuda.synchronize()
    assert bool(torch.isfinite(out).all()), f"{name} wrote NaN or inf on {kind}"
    assert_rows_close(out, torch.from_numpy(reference_decode(*host, batch)), dtype, f"{name} {kind} G={group} {dtype}",
                      seq_lens=batch.seq_lens)


@pytest.mark.parametrize("name", BASELINES)
def test_one_plan_serves_two_cache_copies(name):
    spec = AttentionSpec(dtype="float16")
    backend = backend_or_skip(name, spec)
    batch, q, k, v = device_inputs(spec, [300, 5000, 33], seed=3)
    plan = backend.plan(batch)
    for kk, vv in ((k, v), (-k, v * 0.5)):
        out = torch.full_like(q, float("nan"))
        backend.run(q, (kk.contiguous(), vv.contiguous()), plan, out)
        torch.cuda.synchronize()
        assert_rows_close(out, reference64(batch, q, kk, vv), "float16", name, seq_lens=batch.seq_lens)


@pytest.mark.parametrize("name", BASELINES)
def test_graph_replay_equals_eager(name):
    spec = AttentionSpec(dtype="float16")
    backend = backend_or_skip(name, spec)
    if backend.capabilities.graph == "none":
        pytest.skip(f"{name} is not graph-safe")
    batch, q, k, v = device_inputs(spec, [1, 17, 9000], seed=5)
    plan = backend.plan(batch)
    eager = torch.empty_like(q)
    backend.run(q, (k, v), plan, eager)
    torch.cuda.synchronize()
    out = torch.full_like(q, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.run(q, (k, v), plan, out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_harness_end_to_end_on_a_small_case():
    from persistentkv.measure.device import TorchDevice
    from persistentkv.measure.harness import BackendFactory, RunContext, Settings, run_case
    from persistentkv.measure.rows import raw_frame
    from persistentkv.measure.workload import Variant, synthetic_case

    spec = AttentionSpec(dtype="float16")
    case = synthetic_case("test", "B2-ragged", [4096, 700], spec, tuple(Variant(n) for n in BASELINES))
    rows = run_case(case, TorchDevice("cuda"), BackendFactory(), Settings(layers=4, repeats=2, warmup=1),
                    RunContext("gpu-test", 4000.0, log=print))
    frame = raw_frame(rows)
    available = [n for n in BASELINES if not registry.create(n).unavailable(spec)]
    assert available, "no baseline is available on this GPU"
    for name in available:
        mine = frame[frame["backend"] == name]
        assert (mine["status"] == "ok").all(), mine[mine["status"] != "ok"]["reason"].tolist()
        assert set(mine["protocol"]) == {"kernel", "eager", "step", "published"}
        assert (mine["time_us"] > 0).all()


def test_ceilings_are_plausible():
    from persistentkv.ceiling import ceiling_gbps, measure_ceilings, median_gbps, stream_fit
    from persistentkv.measure.device import TorchDevice

    samples, failures = measure_ceilings(TorchDevice("cuda"), repeats=3, warmup=1, read_bytes=2**30,
                                         copy_bytes=2**29, stream_bytes=2**32, log=print)
    if "read-ceiling" in failures:
        pytest.skip(f"read ceiling not measurable here: {failures['read-ceiling']}")
    assert 100 < median_gbps(samples) < 20_000
    assert 50 < median_gbps(samples, "copy-ceiling") < 20_000
    reads = [s for s in samples if s.backend == "read-ceiling"]
    assert sorted({s.bytes_moved for s in reads}) == [2**30, 2**32] and len({s.repeat for s in reads}) == len(reads)
    rate, fixed = stream_fit(samples)
    big = median_gbps([s for s in reads if s.bytes_moved == 2**32])
    assert ceiling_gbps(samples) == big and 0.8 * big < rate < 1.2 * big and fixed > -50.0


def test_validation_rows_pass_for_available_baselines():
    from persistentkv.measure.device import TorchDevice
    from persistentkv.measure.harness import BackendFactory
    from persistentkv.measure.validation import failing, validate_case
    from persistentkv.measure.workload import Variant, synthetic_case

    spec = AttentionSpec(dtype="float16")
    case = synthetic_case("v", "B3", [1, 16, 2049], spec, tuple(Variant(n) for n in BASELINES), hole_fraction=0.5)
    rows = validate_case(case, TorchDevice("cuda"), BackendFactory())
    assert not failing(rows), failing(rows)
    assert any(r["status"] == "ok" for r in rows)


# -- FP8 KV caches (kv_dtype float8_e4m3) ----------------------------------------------------------------
#: Baselines that read an FP8 cache, and the error class each is gated at per (row, query head)
#: against float64 on the dequantised cache: an fp16/bf16 query keeps TOLERANCE[dtype]
#: (FlashInfer converts the codes in registers; torch-sdpa dequantises into the query dtype);
#: XQA (sm90: its kernel rounds the query and the softmax weights to e4m3) and vLLM FA3 (an e4m3
#: query, P.V in FP8) are FP8-query baselines. Their error is a property of their arithmetic, reported
#: as measured by validate-gpu (rows with fp8_query, gated at the dtype's tolerance, a miss listed
#: with its error); here FP8_QUERY_TOL only checks the adapter's wiring: a scale lost or applied
#: twice moves a (row, head) by 0.5 or more. Measured worst (row, head) errors of XQA's query
#: rounding: 5.4e-2 to 9.2e-2 in bench_engine, 1.1e-1 here (H100 at c54e365, G=4, bfloat16, the
#: 4097-token row), above the 1e-1 this bound was first estimated at.
FP8_QUERY_TOL = 2e-1
FP8_TOLERANCE = {"flashinfer-cc": None, "flashinfer-tc": None, "torch-sdpa": None,
                 "trtllm-xqa": FP8_QUERY_TOL, "vllm-fa3": FP8_QUERY_TOL}
#: the baselines that take one K and one V scale per tensor (per-KV-head values are refused)
PER_TENSOR_ONLY = ("flashinfer-cc", "flashinfer-tc", "trtllm-xqa")


def fp8_device_case(spec: AttentionSpec, lengths, per_head: bool, seed: int = 0):
    """(batch, q, cache, k64, v64) on the GPU: a fresh random cache quantised to e4m3 (saturating,
    round to nearest even) with scales fitted per tensor or per KV head (heads of different
    magnitudes), cache = (K, V, k_scale, v_scale) as the backends take it, and its dequantised
    float64 values (code x scale) for the reference."""
    batch, q, k, v = device_inputs(spec, lengths, seed=seed)
    gain = torch.linspace(0.5, 2.0, spec.num_kv_heads, device="cuda").view(1, 1, -1, 1)
    cache, dequantised = [], []
    for x in (k.float() * gain, v.float() * gain):
        amax = x.abs().amax(dim=(0, 1, 3)) if per_head else x.abs().amax().reshape(1)
        scale = (amax / 448.0).float().contiguous()
        codes = (x / scale.view(1, 1, -1, 1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        cache.append((codes, scale))
        dequantised.append(codes.double() * scale.double().view(1, 1, -1, 1))
    (kc, ks), (vc, vs) = cache
    return batch, q, (kc, vc, ks, vs), dequantised[0], dequantised[1]


@pytest.mark.parametrize("per_head", [False, True], ids=["per-tensor", "per-head"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("name", list(FP8_TOLERANCE))
def test_baseline_on_an_fp8_cache_matches_float64(name, group, dtype, per_head):
    spec = AttentionSpec(num_qo_heads=8 * group, num_kv_heads=8, head_dim=128, page_size=16, dtype=dtype,
                         kv_dtype="float8_e4m3")
    backend = backend_or_skip(name, spec)
    batch, q, cache, k64, v64 = fp8_device_case(spec, LENGTHS, per_head, seed=group)
    plan = backend.plan(batch)
    out = torch.full_like(q, float("nan"))
    if per_head and name in PER_TENSOR_ONLY:
        with pytest.raises(PKVError, match="one K and one V scale per tensor"):
            backend.run(q, cache, plan, out)
        return
    backend.run(q, cache, plan, out)
    torch.cuda.synchronize()
    tol = FP8_TOLERANCE[name] or dtype
    worst = assert_rows_close(out, reference64(batch, q, k64, v64), tol,
                              f"{name} FP8 cache G={group} {dtype} {'per-head' if per_head else 'per-tensor'}",
                              seq_lens=batch.seq_lens)
    print(f"{name} FP8 cache G={group} {dtype} per_head={per_head}: worst (row, head) rel err {worst:.2e} "
          f"(gate {tol})")


@pytest.mark.parametrize("name", list(FP8_TOLERANCE))
def test_fp8_graph_replay_equals_eager(name):
    spec = AttentionSpec(dtype="bfloat16", kv_dtype="float8_e4m3")
    backend = backend_or_skip(name, spec)
    if backend.capabilities.graph == "none":
        pytest.skip(f"{name} is not graph-safe")
    batch, q, cache, _, _ = fp8_device_case(spec, [1, 17, 9000], per_head=False, seed=5)
    plan = backend.plan(batch)
    eager = torch.empty_like(q)
    backend.run(q, cache, plan, eager)  # also where host-float adapters read the scales
    torch.cuda.synchronize()
    out = torch.full_like(q, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.run(q, cache, plan, out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
