"""The cluster route on the CPU: its decision rule, the host-equivalent items of the kernel's own
ranges, its counters, and the refusals that need no GPU."""

from __future__ import annotations

import numpy as np
import pytest

from persistentkv import plan as planner
from persistentkv.cache import make_batch
from persistentkv.errors import PKVError
from persistentkv.plan import (CLUSTER_TILE_TOKENS, choose_route, cluster_split_bounds, default_cluster_size,
                               plan_cluster, unpack_items)
from persistentkv.reference import execute_plan, reference_decode, relative_error
from persistentkv.spec import AttentionSpec

H200_SMS = 132


@pytest.mark.parametrize("batch_size, expected", [(1, 8), (2, 8), (3, 4), (4, 4), (8, 2), (16, 1), (64, 1)])
def test_default_cluster_size_fills_one_wave(batch_size, expected):
    C = default_cluster_size(batch_size, 8, H200_SMS)
    assert C == expected
    assert batch_size * 8 * C <= H200_SMS or C == 1


@pytest.mark.parametrize("lengths, expected", [
    ([2048], ("cluster", 8)),              # 256 tokens per CTA: the window's top (C <= 8 by default)
    ([2049], ("workqueue", None)),         # 257 per CTA
    ([4096], ("workqueue", None)),         # 512 per CTA: the queue reads faster (bench v5)
    ([65536], ("workqueue", None)),
    ([1500], ("cluster", 8)),              # 188 per CTA
    ([1024], ("cluster", 8)),              # halved to keep 128 tokens per CTA
    ([256], ("cluster", 2)),
    ([200], ("workqueue", None)),          # C would be 1
    ([2048, 2048], ("cluster", 8)),        # B=2: C <= 8
    ([1024] * 4, ("cluster", 4)),
    ([512] * 8, ("cluster", 2)),
    ([8192] * 4, ("workqueue", None)),     # 2048 per CTA
    ([1024] * 16, ("workqueue", None)),    # B * Hkv = 128: no room for C >= 2
    ([2048, 512], ("workqueue", None)),    # ragged: max 1.6 x mean
    ([2000, 1900], ("cluster", 8)),        # max 1.03 x mean
])
def test_choose_route(lengths, expected):
    assert choose_route(np.asarray(lengths), 8, H200_SMS) == expected


def test_choose_route_skew_threshold_is_inclusive():
    # mean 1000, max 1250 = 1.25 x mean: still cluster; 1260 is not
    assert choose_route([750, 1250], 4, 132, min_tokens_per_cta=1, max_tokens_per_cta=4096)[0] == "cluster"
    assert choose_route([740, 1260], 4, 132, min_tokens_per_cta=1, max_tokens_per_cta=4096)[0] == "workqueue"


def test_choose_route_refuses_an_empty_window():
    with pytest.raises(PKVError, match="min_tokens_per_cta <= max_tokens_per_cta"):
        choose_route([4096], 8, H200_SMS, min_tokens_per_cta=512, max_tokens_per_cta=256)


def check_cover(plan, seq_lens, num_kv_heads, C, tile=CLUSTER_TILE_TOKENS):
    cols = unpack_items(plan.items)
    assert plan.num_items == len(seq_lens) * num_kv_heads * C
    for index in range(plan.num_items):  # grid order: blockIdx.x = (row * Hkv + head) * C + rank
        row, rest = divmod(index, num_kv_heads * C)
        head, rank = divmod(rest, C)
        assert (cols["row"][index], cols["head"][index], cols["split"][index], cols["num_splits"][index]) == \
            (row, head, rank, C)
        assert (cols["tok_lo"][index], cols["tok_hi"][index]) == cluster_split_bounds(seq_lens[row], C, rank, tile)
    lo = cols["tok_lo"].reshape(len(seq_lens), num_kv_heads, C)
    hi = cols["tok_hi"].reshape(len(seq_lens), num_kv_heads, C)
    for row, n in enumerate(seq_lens):
        for head in range(num_kv_heads):
            covered = np.zeros(n, int)
            for rank in range(C):
                a, b = int(lo[row, head, rank]), int(hi[row, head, rank])
                assert 0 <= a <= n and 0 <= b <= n  # empty when lo >= hi
                if a < b:
                    assert a % tile == 0
                    covered[a:b] += 1
            assert (covered == 1).all(), (n, head)


@pytest.mark.parametrize("page_size", [8, 16, 128])
@pytest.mark.parametrize("C", [1, 2, 4, 8, 16])
def test_cluster_items_cover_every_token_once(page_size, C):
    P = page_size
    lengths = [1, P - 1, P, P + 1, 63, 64, 65, 127, 128, 129, 3 * P + 5, 1000, 64 * C - 1, 64 * C, 64 * C + 1, 4096]
    batch = make_batch(AttentionSpec(8, 2, 64, P, "float16"), lengths)
    check_cover(plan_cluster(batch, C), lengths, 2, C)


@pytest.mark.parametrize("page_size", [8, 128])
@pytest.mark.parametrize("C", [1, 2, 8, 16])
def test_cluster_items_over_128_token_stages_cover_every_token_once(page_size, C):
    """An 8-warp module's stage (128 tokens): bounds fall on multiples of 128."""
    P = page_size
    lengths = [1, P + 1, 127, 128, 129, 255, 256, 257, 128 * C - 1, 128 * C, 128 * C + 1, 5000]
    batch = make_batch(AttentionSpec(8, 2, 64, P, "float16"), lengths)
    plan = plan_cluster(batch, C, tile=128)
    assert plan.params == {"cluster_size": C, "tile": 128}
    check_cover(plan, lengths, 2, C, tile=128)


def test_cluster_bounds_with_128_token_stages():
    assert cluster_split_bounds(100, 2, 0, tile=128) == (0, 0)     # one stage: rank 0 is empty
    assert cluster_split_bounds(100, 2, 1, tile=128) == (0, 100)
    assert cluster_split_bounds(1000, 8, 7, tile=128) == (896, 1000)
    assert cluster_split_bounds(1000, 8, 7) == (896, 1000)          # 64-token stages: 16 tiles, 2 per rank
    assert cluster_split_bounds(300, 4, 1, tile=128) == (0, 128)    # 3 stages of 128 over 4 ranks
    assert cluster_split_bounds(300, 4, 1) == (64, 128)             # 5 stages of 64


@pytest.mark.parametrize("bad", [0, 48, -128, 128.0, True])
def test_bad_cluster_tiles_are_refused(bad):
    with pytest.raises(PKVError, match="cluster tile must be a positive multiple of 32"):
        plan_cluster(make_batch(AttentionSpec(), [100]), 2, tile=bad)


def test_short_rows_leave_empty_splits():
    batch = make_batch(AttentionSpec(8, 2, 64, 16, "float16"), [100, 64 * 16])
    cols = unpack_items(plan_cluster(batch, 16).items)
    row0 = cols["row"] == 0
    nonempty = cols["tok_hi"] > cols["tok_lo"]
    assert (nonempty & row0).sum() == 2 * 2      # 100 tokens = 2 tiles: 2 splits per head
    assert (nonempty & ~row0).sum() == 16 * 2    # 1024 tokens: one tile per split
    assert cluster_split_bounds(100, 16, 15) == (64, 100)
    assert cluster_split_bounds(100, 16, 0) == (0, 0)


def test_cluster_counters_have_no_global_merge_traffic():
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    batch = make_batch(spec, [4096, 4000])
    counters = plan_cluster(batch, 8).counters()
    assert counters.launches == 1
    assert counters.decode_ctas == 2 * 8 * 8
    assert counters.merge_ctas == 0
    assert counters.merge_state_bytes == 0 and counters.paper_merge_state_bytes == 0
    assert counters.nonempty_items == 2 * 8 * 8
    assert counters.padded_kv_bytes == 0
    assert counters.useful_kv_bytes == (4096 + 4000) * spec.kv_bytes_per_token
    assert counters.h2d_bytes == (2 * 2 + 1) * 4
    # the work queue of the same step does move partial states through global memory
    assert planner.plan_workqueue(batch, target_items=264).counters().merge_state_bytes > 0


@pytest.mark.parametrize("C", [1, 4, 16])
def test_cluster_plan_executes_to_the_reference(C):
    spec = AttentionSpec(8, 2, 64, 16, "float32")
    lengths = [1, 65, 300, 1100]
    batch = make_batch(spec, lengths, hole_fraction=0.3, seed=C)
    rng = np.random.default_rng(C)
    shape = (batch.num_pages, spec.page_size, spec.num_kv_heads, spec.head_dim)
    k, v = rng.standard_normal(shape), rng.standard_normal(shape)
    q = rng.standard_normal((batch.batch_size, spec.num_qo_heads, spec.head_dim))
    out = execute_plan(plan_cluster(batch, C), q, k, v, batch)
    assert relative_error(out, reference_decode(q, k, v, batch)) < 1e-12


@pytest.mark.parametrize("bad", [0, 3, 32, True, 2.0])
def test_bad_cluster_sizes_are_refused(bad):
    batch = make_batch(AttentionSpec(), [100])
    with pytest.raises(PKVError, match="cluster_size must be one of"):
        plan_cluster(batch, bad)


# --------------------------------------------------------------------------- engine, without a GPU
def cpu_engine(capability=(9, 0), cluster16_error=None, num_sms=H200_SMS, warps=4):
    """A DecodeEngine with its device facts filled in by hand: plan() refusals run before any GPU use.
    warps=8 gets the 8-warp module's facts (256 threads, 128-token stages, 192 KB, 1 CTA per SM)."""
    from persistentkv.engine import DecodeEngine, _Module, min_chunk_tiles_for, stage_tokens

    engine = object.__new__(DecodeEngine)
    engine.spec = AttentionSpec(32, 8, 128, 16, "float16")
    engine.capability = capability
    engine.num_sms = num_sms
    occupancy = 2 if warps == 4 else 1
    engine.target_items = occupancy * num_sms
    engine.warps = warps
    engine.tma = False
    engine.early_kv, engine._early_bits = True, 3  # as DecodeEngine sets them under PDL
    engine.pool_units = 0
    engine.scale_log2 = 1.0
    engine._log2_page = 4
    engine._plan_function = 0
    engine.min_chunk_tiles = min_chunk_tiles_for(warps)
    engine.module = _Module({}, 3 * 2 * stage_tokens(warps) * 128 * 2, 32 * warps, stage_tokens(warps), 3, occupancy,
                            {c: 0 for c in planner.CLUSTER_SIZES}, cluster16_error, 232448, {})
    return engine


class HostArray(np.ndarray):
    """A host int32 array standing in for the engine's device tensors (data_ptr, numel)."""

    def data_ptr(self) -> int:
        return self.ctypes.data

    def numel(self) -> int:
        return self.size


@pytest.mark.parametrize("warps", [4, 8])
def test_cluster_device_plan_counts_the_modules_stages(warps):
    """The device plan's host equivalent (its counters) splits rows over the module's tile, as
    the kernel does: 64 tokens at 4 warps, 128 at 8."""
    engine = cpu_engine(warps=warps)
    engine._i32 = lambda array: np.ascontiguousarray(array, dtype=np.int32).view(HostArray)
    batch = make_batch(engine.spec, [300, 1000])
    plan = engine.plan(batch, "cluster", cluster_size=8)
    host = plan._host_equivalent()
    assert host.params["tile"] == 64 * warps // 4
    expected = plan_cluster(batch, 8, tile=64 * warps // 4)
    assert (host.items == expected.items).all()
    # 300 tokens: 5 stages of 64 at 4 warps (5 of 8 splits busy), 3 of 128 at 8 warps
    assert plan.counters()["nonempty_items"] == 8 * ((5 if warps == 4 else 3) + 8)


def test_engine_refuses_cluster_route_before_sm90():
    engine = cpu_engine(capability=(8, 0))
    with pytest.raises(PKVError, match=r"compute capability >= 9.0\); this device is 8.0"):
        engine.plan(make_batch(engine.spec, [4096]), "cluster")


def test_engine_refuses_bad_cluster_options():
    engine = cpu_engine()
    batch = make_batch(engine.spec, [4096])
    with pytest.raises(PKVError, match="cluster_size must be one of 1, 2, 4, 8, 16, got 6"):
        engine.plan(batch, "cluster", cluster_size=6)
    with pytest.raises(PKVError, match=r"cluster_smem_bytes must be in \[98304, 232448\]"):
        engine.plan(batch, "cluster", cluster_smem_bytes=1 << 20)
    with pytest.raises(PKVError, match=r"cluster_smem_bytes must be in"):
        engine.plan(batch, "cluster", cluster_smem_bytes=1024)
    with pytest.raises(PKVError, match="apply to route cluster, not workqueue"):
        engine.plan(batch, "workqueue", cluster_size=4)


def test_engine_refuses_cluster16_when_the_attribute_could_not_be_set():
    reason = "cluster size 16 is unavailable: setting NON_PORTABLE_CLUSTER_SIZE_ALLOWED failed (x); use cluster_size <= 8"
    engine = cpu_engine(cluster16_error=reason)
    with pytest.raises(PKVError, match="cluster size 16 is unavailable"):
        engine.cluster_size_for(1, 16)
    assert engine.cluster_size_for(1, 8) == 8
    assert engine.cluster_size_for(1) == 8  # the default never asks for 16
    assert cpu_engine().cluster_size_for(1, 16) == 16


def test_backend_route_option():
    from persistentkv.backends.pkv import PKVWorkqueue

    with pytest.raises(PKVError, match="route must be one of workqueue, cluster, auto"):
        PKVWorkqueue(route="fast")


# --------------------------------------------------------------------------- PDL's early reads, without a GPU
@pytest.mark.parametrize("early_kv", [True, False])
def test_pdl_reads_items_early_only_after_a_decode_launch_followed_the_plan(early_kv):
    """DecodeEngine.run sets the decode kernels' `early` argument: 0 on the first decode launch
    after plan / replan_device (the plan kernel or upload may be the preceding operation), after
    that 3 (items and the first stages' K/V early) with early_kv, else 1 (items only); launches
    without PDL never set it."""
    from types import SimpleNamespace

    from persistentkv.engine import DecodeArgs, DevicePlan, MergeArgs, PlanArgs, _arg_block, _Launch

    engine = cpu_engine()
    if not early_kv:
        engine.early_kv, engine._early_bits = False, 1
    e = engine._early_bits
    engine.device, engine._device_index = SimpleNamespace(index=0), 0
    engine._raw_stream = lambda index: 0
    seen = []
    engine._driver = SimpleNamespace(launchKernel=lambda function, *rest: seen.append((function, None)))

    def decode(function, pdl=True):
        args = _arg_block(DecodeArgs, *[0] * 21, 7)
        launch = _Launch("decode", 4, args, function)
        if pdl:
            launch.pdl = lambda stream, l=launch: seen.append((l.function, l.args.early))
        return launch

    merge = _Launch("merge", 2, _arg_block(MergeArgs, *[0] * 7), 9)
    fake = SimpleNamespace(data_ptr=lambda: 0, stride=lambda: (0, 0, 0, 0))
    plan = DevicePlan("workqueue", engine.spec, 1, [_Launch("plan", 1, _arg_block(PlanArgs, *[0] * 11), 5), decode(1), merge,
                                                   decode(2)])
    engine.run(fake, (fake, fake), plan, fake, check=False)
    assert seen == [(1, 0), (9, None), (2, e)]
    seen.clear()
    engine.run(fake, (fake, fake), plan, fake, check=False)
    assert seen == [(1, e), (9, None), (2, e)]
    seen.clear()
    engine.replan_device(plan)  # the plan kernel precedes the next decode launch again
    engine.run(fake, (fake, fake), plan, fake, check=False)
    assert seen == [(5, None), (1, 0), (9, None), (2, e)]
    plain = DevicePlan("workqueue_host", engine.spec, 1, [decode(3, pdl=False)])
    seen.clear()
    engine.run(fake, (fake, fake), plain, fake, check=False)
    assert seen == [(3, None)] and plain.launches[0].args.early == 7


def test_pdl_launch_api_is_absent_without_a_driver(monkeypatch):
    """Where libcuda or its cuLaunchKernelEx is missing, the helper says so (None) instead of
    raising from ctypes, so DecodeEngine's automatic PDL stays off there."""
    import ctypes

    from persistentkv import engine as engine_module

    def no_driver(name):
        raise OSError(f"{name}: cannot open shared object file")

    lookup = engine_module._launch_kernel_ex.__wrapped__  # the lookup itself, without the per-process cache
    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    assert lookup() is None

    class OldDriver:  # a libcuda without the symbol
        def __getattr__(self, name):
            raise AttributeError(name)

    monkeypatch.setattr(ctypes, "CDLL", lambda name: OldDriver())
    assert lookup() is None
    launched = []

    class NewDriver:
        cuLaunchKernelEx = staticmethod(lambda *args: launched.append(args) or 0)

    monkeypatch.setattr(ctypes, "CDLL", lambda name: NewDriver())
    assert lookup() is not None


def test_pdl_launch_fills_the_launch_config(monkeypatch):
    """_PDLLaunch hands cuLaunchKernelEx one programmatic-serialization attribute, the grid, block,
    shared memory, the call's stream and the parameter block; a nonzero CUresult and a driver
    without the function are one-line errors."""
    import ctypes

    from persistentkv import engine as engine_module

    calls = []

    def launch_ex(config_ref, function, params, extra):
        config = ctypes.cast(config_ref, ctypes.POINTER(engine_module._LaunchConfig)).contents
        attr = config.attrs[0]
        calls.append((config.gridDimX, config.blockDimX, config.sharedMemBytes, config.hStream, config.numAttrs,
                      attr.id, attr.value[0], function.value, params.value, extra))
        return len(calls) - 1  # CUDA_SUCCESS on the first call, an error after

    monkeypatch.setattr(engine_module, "_launch_kernel_ex", lambda: launch_ex)
    launch = engine_module._PDLLaunch(0x1234, 264, 128, 98304, 0x5678)
    launch(0xABC)
    assert calls == [(264, 128, 98304, 0xABC, 1, engine_module.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                      1, 0x1234, 0x5678, None)]
    with pytest.raises(PKVError, match="cuLaunchKernelEx .* returned CUresult 1"):
        launch(0xABC)
    monkeypatch.setattr(engine_module, "_launch_kernel_ex", lambda: None)
    with pytest.raises(PKVError, match="pdl needs cuLaunchKernelEx"):
        engine_module._PDLLaunch(0x1234, 264, 128, 98304, 0x5678)
