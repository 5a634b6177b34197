"""The GPU engine on an FP8 e4m3 cache against float64 over the dequantised cache.

The engine reads K/V codes (torch.float8_e4m3fn) and dequantises them in registers as
code x scale, the scale per tensor or per KV head (float32 device tensors read at each launch).
Its queries and outputs stay fp16/bf16, so it is held to the same per-(row, query head) gate as
an fp16/bf16 cache (reference.TOLERANCE of the query dtype): the reference attends over exactly
the dequantised values, in float64, and never looks at a plan. The matrix runs every shipped
configuration (4- and 8-warp modules x every route, and the workqueue of the 4-warp modules built
for 3 and 4 resident CTAs per SM, which pkv-workqueue picks per step) over dtypes, head dims, group sizes, page
sizes with page- and stage-boundary lengths, ragged batches over scattered pages, strided (K/V
interleaved) caches, per-tensor and per-head scales, the numerics stress kinds, subnormal codes,
a 1M-token row and graph replay with scales changed between replays; then the bad inputs.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_support import LAYOUTS, assert_rows_close, kv_layout, reference_torch64, requires_gpu, torch_dtype
from numerics import KINDS, stress_case
from persistentkv import fp8
from persistentkv.cache import make_batch
from persistentkv.errors import PKVError
from persistentkv.names import ENGINE_ROUTES
from persistentkv.spec import FP8_KV, AttentionSpec

pytestmark = [pytest.mark.gpu, requires_gpu]


def module_id(module) -> str:
    """4, 8, or 4c3 for (4, 3): a module's name in test ids and messages."""
    return f"{module[0]}c{module[1]}" if isinstance(module, tuple) else str(module)


#: the modules: warps, or (4, CTAs per SM) for the FP8 4-warp modules built for 3 or 4 resident CTAs
MODULES = (4, 8, (4, 3), (4, 4))
CONFIGS = [(w, r) for w in (4, 8) for r in ENGINE_ROUTES] + [(m, "workqueue") for m in MODULES[2:]]
CONFIG_IDS = [f"w{module_id(w)}-{r}" for w, r in CONFIGS]
SCALES = ("tensor", "head")


def fp8_spec(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype="float16") -> AttentionSpec:
    return AttentionSpec(num_qo_heads, num_kv_heads, head_dim, page_size, dtype, kv_dtype=FP8_KV)


def engine_of(spec, warps=4):
    """The engine of module ``warps`` (4, 8, or (4, CTAs per SM)) for ``spec``."""
    from persistentkv.engine import engine_for

    warps, ctas = warps if isinstance(warps, tuple) else (warps, None)
    if warps == 8 and spec.head_dim > 128:
        pytest.skip("no 8-warp module at head_dim > 128")
    if ctas is not None and spec.head_dim > 128:
        pytest.skip(f"no module for {ctas} CTAs per SM at head_dim > 128")
    return engine_for(spec, warps=warps, **({"ctas_per_sm": ctas} if ctas else {}))


def quantized(values, spec, per_head: bool):
    """(codes float8_e4m3fn, scale float32 [1] or [Hkv], dequantised float32) of ``values``
    [pages, P, Hkv, D] (a float tensor on the GPU): scales map each tensor's (or head's) largest
    magnitude to 448, the codes round to nearest even."""
    import torch

    hkv = spec.num_kv_heads
    if per_head:
        amax = values.abs().permute(2, 0, 1, 3).reshape(hkv, -1).amax(dim=1).float()
    else:
        amax = values.abs().amax().float().reshape(1)
    scale = torch.where(amax > 0, amax / fp8.E4M3_MAX, torch.ones_like(amax)).contiguous()
    view = scale.view(1, 1, -1, 1) if per_head else scale
    codes = (values.float() / view).to(torch.float8_e4m3fn)
    return codes, scale, codes.float() * view


def fp8_case(spec, lengths, hole_fraction=0.25, seed=0, layout="contiguous", per_head=False, spread=True):
    """(batch, q, (k, v, k_scale, v_scale), (k_deq, v_deq)) on the GPU: standard-normal values whose
    kv heads differ in magnitude by up to 2^6 when ``spread`` (so per-head scales matter), quantised
    to FP8; the codes in ``layout`` (kv_layout)."""
    import torch

    batch = make_batch(spec, lengths, hole_fraction=hole_fraction, seed=seed)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    shape = (batch.num_pages, spec.page_size, spec.num_kv_heads, spec.head_dim)
    heads = 2.0 ** torch.linspace(-3, 3, spec.num_kv_heads, device="cuda") if spread else torch.ones(
        spec.num_kv_heads, device="cuda")
    k = torch.randn(shape, generator=gen, device="cuda") * heads.view(1, 1, -1, 1)
    v = torch.randn(shape, generator=gen, device="cuda") * heads.flip(0).view(1, 1, -1, 1)
    q = torch.randn((batch.batch_size, spec.num_qo_heads, spec.head_dim), generator=gen, device="cuda").to(
        torch_dtype(spec.dtype))
    kc, ks, kd = quantized(k, spec, per_head)
    vc, vs, vd = quantized(v, spec, per_head)
    kc, vc = kv_layout(kc, vc, layout)
    return batch, q, (kc, vc, ks, vs), (kd, vd)


def run_fp8(spec, lengths, warps=4, route="workqueue", seed=0, hole_fraction=0.25, what="", layout="contiguous",
            per_head=False, **options):
    """One run on fresh FP8 inputs, gated per (row, head) at the query dtype's tolerance."""
    import torch

    engine = engine_of(spec, warps)
    batch, q, (kc, vc, ks, vs), (kd, vd) = fp8_case(spec, lengths, hole_fraction, seed, layout, per_head)
    plan = engine.plan(batch, route, **options)
    out = torch.full_like(q, float("nan"))
    engine.run(q, (kc, vc), plan, out, k_scale=ks, v_scale=vs)
    torch.cuda.synchronize()
    err = assert_rows_close(out, reference_torch64(batch, q, kd, vd), spec.dtype, what, seq_lens=batch.seq_lens)
    return err, engine, plan, batch, q, (kc, vc, ks, vs)


@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("warps, route", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_dtype_headdim(warps, route, dtype, head_dim, layout, scales):
    spec = fp8_spec(head_dim=head_dim, dtype=dtype)
    run_fp8(spec, [1, 15, 16, 17, 300, 4096, 777], warps, route, seed=head_dim, layout=layout,
            per_head=scales == "head", what=f"fp8 {dtype} D={head_dim} w{module_id(warps)} {route} {layout} {scales}")


@pytest.mark.parametrize("warps, route", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("group", [1, 2, 4, 7, 8, 16])
def test_group_sizes(warps, route, group):
    spec = fp8_spec(4 * group, 4)
    run_fp8(spec, [5, 64, 2000, 513], warps, route, seed=group, per_head=True, what=f"fp8 G={group} w{module_id(warps)} {route}")


@pytest.mark.parametrize("warps, route", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("page_size", [1, 8, 16, 32, 64, 128, 256])
def test_page_sizes_and_boundaries(warps, route, page_size):
    spec = fp8_spec(page_size=page_size, dtype="bfloat16")
    lengths = sorted({1, 2, max(page_size - 1, 1), page_size, page_size + 1, 31, 32, 33, 63, 64, 65, 127, 128,
                      129, 255, 256, 257, 3 * page_size + 5, 1000, 1025, 3001})
    run_fp8(spec, lengths, warps, route, seed=page_size, hole_fraction=0.5, layout="kv_interleaved",
            what=f"fp8 P={page_size} w{module_id(warps)} {route}")


@pytest.mark.parametrize("warps, route", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("batch_size", [2, 64, 256])
def test_ragged_batches(warps, route, batch_size):
    lengths = np.random.default_rng(batch_size).integers(1, 9000, size=batch_size)
    run_fp8(fp8_spec(), lengths, warps, route, seed=batch_size, per_head=batch_size % 2 == 0,
            what=f"fp8 B={batch_size} w{module_id(warps)} {route}")


@pytest.mark.parametrize("warps", MODULES, ids=module_id)
def test_million_token_row(warps):
    run_fp8(fp8_spec(), [1 << 20], warps, "workqueue", seed=7, hole_fraction=0.0, per_head=True,
            what=f"fp8 1M tokens w{module_id(warps)}")


@pytest.mark.parametrize("warps, route", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_numerics_stress(warps, route, kind, dtype):
    """The stress kinds of tests/numerics.py with K and V quantised to FP8 (per-head scales fitted to
    the stressed values), against float64 over the dequantised values."""
    import torch

    spec = fp8_spec(32, 8, 128, 16, dtype)
    engine = engine_of(spec, warps)
    batch, q, k, v = stress_case(kind, spec, [1, 15, 16, 17, 63, 129, 1000, 4097], seed=3)
    q = torch.from_numpy(q).to(device="cuda", dtype=torch_dtype(dtype))
    kc, ks, kd = quantized(torch.from_numpy(k).cuda(), spec, per_head=True)
    vc, vs, vd = quantized(torch.from_numpy(v).cuda(), spec, per_head=True)
    plan = engine.plan(batch, route)
    out = torch.full_like(q, float("nan"))
    engine.run(q, (kc, vc), plan, out, k_scale=ks, v_scale=vs)
    torch.cuda.synchronize()
    assert_rows_close(out, reference_torch64(batch, q, kd, vd), dtype, f"fp8 {kind} {dtype} w{module_id(warps)} {route}",
                      seq_lens=batch.seq_lens)


@pytest.mark.parametrize("warps", MODULES, ids=module_id)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_subnormal_codes(warps, dtype):
    """Every K and V code subnormal (exponent field 0: m/8 x 2^-6), with scales of 2^6 so that their
    values are m/8: a kernel that flushed subnormal inputs (the tensor cores' or the dequantiser's)
    would see zero keys and values and miss by the whole output."""
    import torch

    spec = fp8_spec(dtype=dtype)
    engine = engine_of(spec, warps)
    batch = make_batch(spec, [1, 33, 1000, 4097], hole_fraction=0.25, seed=9)
    gen = torch.Generator(device="cuda").manual_seed(9)
    shape = (batch.num_pages, spec.page_size, spec.num_kv_heads, spec.head_dim)
    codes = [(torch.randint(1, 8, shape, generator=gen, device="cuda")
              | (torch.randint(0, 2, shape, generator=gen, device="cuda") << 7)).to(torch.uint8)
             for _ in range(2)]
    kc, vc = (c.view(torch.float8_e4m3fn) for c in codes)
    scale = torch.full((1,), 64.0, device="cuda")
    q = torch.randn((batch.batch_size, spec.num_qo_heads, spec.head_dim), generator=gen, device="cuda").to(
        torch_dtype(dtype))
    plan = engine.plan(batch)
    out = torch.full_like(q, float("nan"))
    engine.run(q, (kc, vc), plan, out, k_scale=scale, v_scale=scale)
    torch.cuda.synchronize()
    kd, vd = kc.float() * 64.0, vc.float() * 64.0
    assert float(kd.abs().min()) >= 1 / 8 and float(kd.abs().max()) <= 7 / 8
    assert_rows_close(out, reference_torch64(batch, q, kd, vd), dtype, f"subnormal codes {dtype} w{module_id(warps)}",
                      seq_lens=batch.seq_lens)


@pytest.mark.parametrize("warps, route", CONFIGS, ids=CONFIG_IDS)
def test_graph_replay_follows_new_scales(warps, route):
    """A run captured once; the scale tensors rewritten in place between replays (per head, then
    other values): each replay matches the reference over the codes at the new scales."""
    import torch

    spec = fp8_spec()
    _, engine, plan, batch, q, (kc, vc, ks, vs) = run_fp8(spec, [1000, 20000, 77], warps, route, seed=5,
                                                          per_head=True, what=f"fp8 eager w{module_id(warps)} {route}")
    out = torch.full_like(q, float("nan"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        engine.run(q, (kc, vc), plan, out, k_scale=ks, v_scale=vs)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        engine.run(q, (kc, vc), plan, out, k_scale=ks, v_scale=vs)
    gen = torch.Generator(device="cuda").manual_seed(17)
    for replay in range(3):
        ks.copy_(torch.rand(ks.shape, generator=gen, device="cuda") * 0.02 + 1e-3)
        vs.copy_(torch.rand(vs.shape, generator=gen, device="cuda") * 4 + 0.1)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        view = (1, 1, -1, 1)
        ref = reference_torch64(batch, q, kc.float() * ks.view(view), vc.float() * vs.view(view))
        assert_rows_close(out, ref, spec.dtype, f"replay {replay} w{module_id(warps)} {route}", seq_lens=batch.seq_lens)


@pytest.mark.parametrize("lengths, ctas_want", [
    ([131072], 3), ([8192] * 64, 4), ([32768], None), ([4096] * 64, 4),
    ([15000] * 2 + [600] * 30, 3),     # ragged, 8 warps picked: 3 CTAs balance it (CTAS_RAGGED_MAX_IMBALANCE)
    ([15000] * 2 + [600] * 22, 4),     # the same where only 4 CTAs do
    ([16384] * 2 + [2048] * 62, 3),    # the same at 3 CTAs, where 4 do not
], ids=["1x128K", "64x8K", "1x32K", "64x4K", "ragged-32", "ragged-24", "ragged-64"])
def test_auto_picks_the_module_per_step(lengths, ctas_want):
    """pkv-workqueue (warps="auto") on an FP8 cache runs the module choose_warps and
    choose_ctas_per_sm name for the step (the CPU's answer, ``ctas_want``, on 132 SMs), and its
    output passes the per-(row, head) gate."""
    import torch

    from persistentkv.backends.pkv import PKVWorkqueue
    from persistentkv.choose import choose_ctas_per_sm, choose_warps

    spec = fp8_spec()
    backend = PKVWorkqueue()
    batch, q, (kc, vc, ks, vs), (kd, vd) = fp8_case(spec, lengths, seed=len(lengths), per_head=True)
    plan = backend.plan(batch)
    w4 = backend.engine(spec)
    warps = choose_warps(batch.seq_lens, spec.head_dim, num_kv_heads=spec.num_kv_heads,
                         queue4=(w4.target_items, w4.min_chunk_tiles), queue8=(w4.num_sms, 4))
    ctas = choose_ctas_per_sm(batch.seq_lens, spec.num_kv_heads, w4.num_sms,
                              (w4.target_items, 2) if warps == 4 else (w4.num_sms, 4), picked_warps=warps)
    if w4.num_sms == 132:  # H100 and H200: the worked answer
        assert ctas == ctas_want
    assert (plan.engine.warps, plan.engine.ctas_per_sm) == ((4, ctas) if ctas else (warps, None))
    out = torch.full_like(q, float("nan"))
    backend.run(q, (kc, vc, ks, vs), plan, out)
    torch.cuda.synchronize()
    assert_rows_close(out, reference_torch64(batch, q, kd, vd), spec.dtype, f"auto {len(lengths)}x{lengths[0]}",
                      seq_lens=batch.seq_lens)


@pytest.mark.parametrize("lengths, heads, unsplit", [([512] * 8, (64, 8), True), ([256] * 64, (8, 1), True),
                                                     ([512] * 7 + [300], (32, 8), True), ([768] * 8, (64, 8), False),
                                                     ([512] * 4, (64, 8), False)],
                         ids=["G8-8x512", "Hkv1-64x256", "G4-ragged-8", "G8-8x768", "G8-4x512"])
def test_auto_gives_many_short_groups_one_item_each(lengths, heads, unsplit):
    """choose.unsplit_min_chunk on the GPU: an 8-warp step of >= 64 groups and rows <= 512 tokens
    plans exactly one item per (row, kv head) group (the GPU planner's num_items), longer rows or
    fewer groups keep the split queue, and the output passes the per-(row, head) gate."""
    import torch

    from persistentkv.backends.pkv import PKVWorkqueue

    spec = fp8_spec(num_qo_heads=heads[0], num_kv_heads=heads[1])
    backend = PKVWorkqueue()
    batch, q, (kc, vc, ks, vs), (kd, vd) = fp8_case(spec, lengths, seed=len(lengths), per_head=True)
    plan = backend.plan(batch)
    out = torch.full_like(q, float("nan"))
    backend.run(q, (kc, vc, ks, vs), plan, out)
    torch.cuda.synchronize()
    groups = len(lengths) * spec.num_kv_heads
    items = int(plan.view("num_items")[0])
    assert plan.engine.warps == 8 and plan.engine.ctas_per_sm is None
    assert (items == groups) == unsplit, (items, groups)
    assert_rows_close(out, reference_torch64(batch, q, kd, vd), spec.dtype, f"unsplit {len(lengths)}x{lengths[0]}",
                      seq_lens=batch.seq_lens)


def test_lse_of_an_fp8_cache():
    """The LSE output over an FP8 cache: logsumexp(sm_scale q.k) over the dequantised keys."""
    import math

    import torch

    spec = fp8_spec()
    engine = engine_of(spec)
    batch, q, (kc, vc, ks, vs), (kd, vd) = fp8_case(spec, [1, 500, 9000], per_head=True, seed=4)
    plan = engine.plan(batch)
    out, lse = torch.empty_like(q), torch.full((batch.batch_size, spec.num_qo_heads), float("nan"), device="cuda")
    engine.run(q, (kc, vc), plan, out, lse, k_scale=ks, v_scale=vs)
    torch.cuda.synchronize()
    G, D = spec.group_size, spec.head_dim
    for i in range(batch.batch_size):
        pages = torch.from_numpy(batch.kv_indices[batch.kv_indptr[i]:batch.kv_indptr[i + 1]].astype(np.int64)).cuda()
        n = int(batch.seq_lens[i])
        for h in range(spec.num_kv_heads):
            kh = kd[pages, :, h].reshape(-1, D)[:n].double()
            want = torch.logsumexp(q[i, h * G:(h + 1) * G].double() @ kh.T / math.sqrt(D), dim=-1)
            torch.testing.assert_close(lse[i, h * G:(h + 1) * G].double(), want, rtol=0, atol=2e-3)


def test_bad_fp8_inputs_are_refused_in_one_line():
    import torch

    spec = fp8_spec()
    engine = engine_of(spec)
    batch, q, (kc, vc, ks, vs), _ = fp8_case(spec, [100, 200], seed=1)
    plan = engine.plan(batch)
    out = torch.empty_like(q)

    def refused(match, *args, **kwargs):
        engine._last_check = None
        with pytest.raises(PKVError, match=match) as info:
            engine.run(*args, **kwargs)
        assert "\n" not in str(info.value)

    refused("needs k_scale", q, (kc, vc), plan, out)
    refused("e5m2 is not supported", q, (kc.to(torch.float8_e5m2), vc.to(torch.float8_e5m2)), plan, out,
            k_scale=ks, v_scale=vs)
    refused("v_cache has dtype torch.float16", q, (kc, vc.to(torch.float16)), plan, out, k_scale=ks, v_scale=vs)
    refused("FP8 query is not supported", q.to(torch.float8_e4m3fn), (kc, vc), plan, out, k_scale=ks, v_scale=vs)
    refused("finite and > 0", q, (kc, vc), plan, out, k_scale=torch.tensor([float("inf")], device="cuda"),
            v_scale=vs)
    refused("finite and > 0", q, (kc, vc), plan, out, k_scale=ks, v_scale=torch.zeros(1, device="cuda"))
    refused("1 or 8", q, (kc, vc), plan, out, k_scale=torch.ones(3, device="cuda"), v_scale=vs)
    refused("float32", q, (kc, vc), plan, out, k_scale=ks.double(), v_scale=vs)
    refused("float32 tensor", q, (kc, vc), plan, out, k_scale=1.0, v_scale=vs)
    refused("must both be per tensor or both per KV head", q, (kc, vc), plan, out, k_scale=ks,
            v_scale=torch.ones(8, device="cuda"))
    refused("on cuda:0", q, (kc, vc), plan, out, k_scale=ks.cpu(), v_scale=vs)
    # an FP8 cache handed to an fp16 engine
    fp16 = engine_of(AttentionSpec(32, 8, 128, 16, "float16"))
    fp16_plan = fp16.plan(make_batch(AttentionSpec(32, 8, 128, 16, "float16"), [100, 200], 0.25, 1))
    fp16._last_check = None
    with pytest.raises(PKVError, match="k_cache has dtype torch.float8_e4m3fn, expected torch.float16"):
        fp16.run(q, (kc, vc), fp16_plan, out)
