"""The engine's host side without a GPU: plans' uploads and the addresses their launches get
(DecodeEngine with a NumPy stand-in for torch), run()'s checks, per-call stores and launches.

The kernels read these addresses blind, so a wrong offset would be a silent wrong answer on the
GPU; here every pointer in the planner's and the decode kernel's parameter blocks is checked
against the named views of the plan, and the uploaded bytes against the batch."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

from persistentkv import plan as planner
from persistentkv.cache import make_batch
from persistentkv.errors import PKVError
from persistentkv.spec import AttentionSpec

H200_SMS = 132


def cpu_engine(capability=(9, 0), num_sms=H200_SMS, warps=4):
    """A DecodeEngine with its device facts filled in by hand: plan() refusals run before any GPU use.
    warps=8 gets the 8-warp module's facts (256 threads, 128-token stages, 192 KB, 1 CTA per SM)."""
    from persistentkv.engine import DecodeEngine
    from persistentkv.launch import Module, min_chunk_tiles_for, stage_tokens

    engine = object.__new__(DecodeEngine)
    engine.spec = AttentionSpec(32, 8, 128, 16, "float16")
    engine.capability = capability
    engine.num_sms = num_sms
    occupancy = 2 if warps == 4 else 1
    engine.target_items = occupancy * num_sms
    engine.warps = warps
    engine.scale_log2 = 1.0
    engine.sm_scale = 1.0
    engine._log2_page = 4
    engine._plan_function = 0
    engine.min_chunk_tiles = min_chunk_tiles_for(warps)
    engine.module = Module({}, 3 * 2 * stage_tokens(warps) * 128 * 2, 32 * warps, stage_tokens(warps), 3, occupancy,
                           plan_threads=1024, plan_max_rows=4096)
    return engine


class FakeTensor:
    """The few torch.Tensor methods _plan_device and DevicePlan.view use, over a NumPy array."""

    def __init__(self, array: np.ndarray, log: list):
        self.a, self.log = array, log

    def numpy(self):
        return self.a

    def data_ptr(self) -> int:
        return self.a.ctypes.data

    def numel(self) -> int:
        return self.a.size

    def __getitem__(self, index):
        return FakeTensor(self.a[index], self.log)

    def view(self, shape_or_dtype):
        if isinstance(shape_or_dtype, type):  # a dtype: reinterpret the bytes, as torch does
            return FakeTensor(self.a.view(shape_or_dtype), self.log)
        return FakeTensor(self.a.reshape(shape_or_dtype), self.log)

    def copy_(self, src, non_blocking=False):
        self.log.append(("copy", src.data_ptr(), self.data_ptr(), src.numel(), non_blocking))
        self.a[...] = src.a
        return self


class FakeTorch:
    int32, float32 = np.int32, np.float32

    def __init__(self):
        self.log = []

    def empty(self, shape, dtype, device=None, pin_memory=False):
        self.log.append(("pinned" if pin_memory else "device", dtype, shape))
        fill = -7 if dtype == np.int32 else np.nan  # garbage: anything the plan relies on is written
        return FakeTensor(np.full(shape, fill, dtype=dtype), self.log)

    def zeros(self, shape, dtype, device=None):
        self.log.append(("zeros", dtype, shape))
        return FakeTensor(np.zeros(shape, dtype=dtype), self.log)


def fake_engine(warps=4):
    engine = cpu_engine(warps=warps)
    engine.torch = FakeTorch()
    engine.device, engine._device_index = SimpleNamespace(index=0), 0
    engine.module.functions = {name: SimpleNamespace(ptr=i + 1) for i, name in
                               enumerate(("pkv_decode", "pkv_decode_fused", "pkv_merge", "pkv_plan"))}
    engine._plan_function = 4
    engine._raw_stream = lambda index: 0
    launched = []
    engine._launch = lambda launch, stream: launched.append(launch)
    return engine, launched


def args_of(block) -> dict:
    return {name: getattr(block, name) for name, _ in block._fields_ if name != "_params"}


@pytest.mark.parametrize("lengths,hole_fraction", [([8200], 0.0), ([4096] * 8, 0.5), ([1, 17, 16, 300, 2049], 0.3)])
def test_gpu_plan_uploads_once_and_points_every_launch_at_its_views(lengths, hole_fraction):
    engine, launched = fake_engine()
    batch = make_batch(engine.spec, lengths, hole_fraction=hole_fraction, seed=3)
    B, spec = batch.batch_size, engine.spec
    plan = engine.plan(batch, "workqueue")
    log = engine.torch.log

    # one pinned staging block, one device allocation, one asynchronous copy, nothing else
    assert [entry[0] for entry in log] == ["pinned", "device", "copy"]
    copy = log[2]
    workspace = plan.buffers["workspace"]
    assert copy[4] is True and copy[2] == workspace.data_ptr()
    assert copy[3] == plan.buffers["upload"].numel()
    max_items = planner.max_workqueue_items(B, spec.num_kv_heads, engine.target_items)

    # what was uploaded: lengths, indptr and block table, then zeros (index pad, counters)
    packed = plan.view("packed").numpy()
    assert packed.tolist() == [*batch.seq_lens, *batch.kv_indptr, *batch.kv_indices]
    assert plan.view("kv_indices").numpy().tolist() == batch.kv_indices.tolist()
    assert (plan.view("counters").numpy() == 0).all() and plan.view("counters").numel() == max_items
    upload = plan.buffers["upload"].numpy()
    assert (upload[packed.size:] == 0).all()
    assert plan.counters()["h2d_bytes"] == upload.size * 4

    # the planner's launch (made by plan(), before any run) writes items and num_items
    assert launched == [plan.launches[0]] and plan.launches[0].kind == "plan"
    p = args_of(plan.launches[0].args)
    assert p["seq_lens"] == plan.view("packed").data_ptr()
    assert p["kv_indptr"] == plan.view("packed").data_ptr() + 4 * B
    assert (p["batch"], p["num_kv_heads"], p["max_items"]) == (B, spec.num_kv_heads, max_items)
    assert (p["target_items"], p["min_chunk_tiles"]) == (engine.target_items, engine.min_chunk_tiles)
    assert p["items"] == plan.view("items").data_ptr() and p["num_items"] == plan.view("num_items").data_ptr()
    assert plan.view("items").numpy().shape == (max_items, 8)

    # the fused decode launch reads the same views
    (decode,) = [l for l in plan.launches if l.kind == "fused"]
    d = args_of(decode.args)
    assert decode.grid == max_items
    for name in ("kv_indices", "items", "num_items", "part_o", "part_lse", "counters"):
        assert d[name] == plan.view(name).data_ptr(), name
    assert (d["slot_offset"], d["num_kv_heads"], d["group_size"], d["log2_page"]) == \
        (0, spec.num_kv_heads, spec.group_size, 4)

    # alignment the kernel assumes (items read as int4) and no overlap between the parts
    base = workspace.data_ptr()
    for name in ("items", "counters", "part_o", "part_lse"):
        assert (d[name] - base) % 16 == 0, name
    parts = ("packed", "counters", "num_items", "items", "part_o", "part_lse")
    spans = sorted((plan.view(n).data_ptr(), plan.view(n).data_ptr() + 4 * plan.view(n).numel()) for n in parts)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] == base + 4 * workspace.numel()  # the states end the workspace, nothing unused after
    assert plan.view("part_o").numpy().shape == (max_items, spec.group_size, spec.head_dim)
    assert plan.view("part_o").numpy().dtype == np.float32 and plan.view("part_lse").numpy().shape == \
        (max_items, spec.group_size)
    assert plan.view("part_lse").data_ptr() == plan.view("part_o").data_ptr() + plan.view("part_o").numel() * 4
    assert plan.engine is engine

    # the parameter block's pointer array points at its own values
    block = decode.args
    pointers = list(block._params)
    assert pointers[0] == ctypes.addressof(block) and block.address == ctypes.addressof(block._params)
    names = [name for name, _ in block._fields_ if name != "_params"]
    assert ctypes.c_int32.from_address(pointers[names.index("slot_offset")]).value == 0 and \
        ctypes.c_int32.from_address(pointers[names.index("num_kv_heads")]).value == spec.num_kv_heads


def test_run_writes_the_call_values_into_the_plans_blocks():
    engine, launched = fake_engine()
    plan = engine.plan(make_batch(engine.spec, [4096], seed=1), "workqueue")
    launched.clear()
    engine._last_check = None
    tensor = SimpleNamespace(data_ptr=lambda: 0x1000, stride=lambda: (4096, 128, 1))
    cache = SimpleNamespace(data_ptr=lambda: 0x20000, stride=lambda: (16384, 1024, 128, 1))
    engine.run(tensor, (cache, cache), plan, tensor, check=False)
    (decode,) = launched
    d = args_of(decode.args)
    assert (d["q"], d["k"], d["v"], d["out"], d["lse"]) == (0x1000, 0x20000, 0x20000, 0x1000, 0)
    assert (d["kv_sp"], d["kv_st"], d["q_sb"], d["q_sh"], d["o_sb"], d["o_sh"]) == (16384, 1024, 4096, 128, 4096, 128)
    # an LSE output is this call's only: the next call without one writes a null pointer again
    lse = SimpleNamespace(data_ptr=lambda: 0x5000)
    engine.run(tensor, (cache, cache), plan, tensor, lse=lse, check=False)
    assert args_of(decode.args)["lse"] == 0x5000
    engine.run(tensor, (cache, cache), plan, tensor, check=False)
    assert args_of(decode.args)["lse"] == 0


def test_sm_scale_is_the_plans():
    """plan(sm_scale=) sets the scale its decode launches apply (in log2 units), for that plan only;
    the engine's default is 1 / sqrt(head_dim); a scale that is not finite and > 0 is refused."""
    import math

    from persistentkv.engine import LOG2E

    engine, _ = fake_engine()
    engine.sm_scale, engine.scale_log2 = 1 / math.sqrt(128), np.float32(LOG2E / math.sqrt(128))
    batch = make_batch(engine.spec, [300, 5000], seed=2)
    for route in ("workqueue", "split", "buckets"):
        scaled = engine.plan(batch, route, sm_scale=0.05)
        default = engine.plan(batch, route)
        decodes = [l for l in scaled.launches if l.kind in ("decode", "fused")]
        assert decodes and all(l.args.scale_log2 == pytest.approx(0.05 * LOG2E, rel=1e-6) for l in decodes)
        assert scaled.sm_scale == 0.05 and default.sm_scale == pytest.approx(1 / math.sqrt(128))
        assert all(l.args.scale_log2 == pytest.approx(LOG2E / math.sqrt(128), rel=1e-6)
                   for l in default.launches if l.kind in ("decode", "fused"))
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(PKVError, match="sm_scale must be finite and > 0"):
            engine.plan(batch, "workqueue", sm_scale=bad)


def test_merge_launches_write_the_lse_of_the_call():
    """A host-planned plan's separate merge launch gets the call's output and LSE pointers."""
    engine, launched = fake_engine()
    plan = engine.plan(make_batch(engine.spec, [4096, 70], seed=1), "split", num_splits=8)
    launched.clear()
    tensor = SimpleNamespace(data_ptr=lambda: 0x1000, stride=lambda: (4096, 128, 1))
    cache = SimpleNamespace(data_ptr=lambda: 0x20000, stride=lambda: (16384, 1024, 128, 1))
    engine.run(tensor, (cache, cache), plan, tensor, lse=SimpleNamespace(data_ptr=lambda: 0x7000), check=False)
    merges = [l for l in launched if l.kind == "merge"]
    assert merges and all((l.args.out, l.args.lse, l.args.num_kv_heads) == (0x1000, 0x7000, engine.spec.num_kv_heads)
                          for l in merges)


class FakeWorkspace(FakeTensor):
    """A caller's workspace as plan(workspace=) sees it: a contiguous tensor on the engine's device."""

    def __init__(self, nbytes: int, log: list, device):
        super().__init__(np.zeros(nbytes // 4, dtype=np.int32), log)
        self.device, self.nbytes = device, nbytes

    def is_contiguous(self):
        return True

    def element_size(self):
        return 4

    def view(self, shape_or_dtype):
        if shape_or_dtype in (np.uint8, np.int32):
            return FakeTensor(self.a.view(shape_or_dtype), self.log)
        return super().view(shape_or_dtype)


def test_a_callers_workspace_holds_the_plan_at_the_same_addresses():
    """plan(workspace=) allocates nothing on the device and puts every part of the plan into the
    caller's buffer; two plans of the same shape into it share every launch address (what a
    captured graph needs); workspace_bytes is exactly what a plan uses; too small a buffer, or one
    for a host-planned route, is refused with one line."""
    engine, _ = fake_engine()
    engine.torch.Tensor, engine.torch.uint8 = FakeWorkspace, np.uint8
    engine.device = "cuda:0"
    first = make_batch(engine.spec, [4096, 300, 9000], seed=1)
    second = make_batch(engine.spec, [4090, 290, 8995], seed=2)   # as many pages, other lengths
    assert first.kv_indices.size == second.kv_indices.size
    need = engine.workspace_bytes(3, first.kv_indices.size)
    own = engine.plan(first, "workqueue")
    assert need == 4 * own.buffers["workspace"].numel()
    ws = FakeWorkspace(need + 64, engine.torch.log, "cuda:0")
    engine.torch.log.clear()
    a = engine.plan(first, "workqueue", workspace=ws)
    assert [entry[0] for entry in engine.torch.log] == ["pinned", "copy"]  # no device allocation
    assert a.buffers["workspace"].data_ptr() == ws.data_ptr()
    b = engine.plan(second, "workqueue", workspace=ws)
    for la, lb in zip(a.launches, b.launches):
        assert args_of(la.args) == args_of(lb.args) or la.kind == "plan"
    assert args_of(a.launches[0].args)["items"] == args_of(b.launches[0].args)["items"]
    assert b.view("packed").numpy()[:3].tolist() == [4090, 290, 8995]
    with pytest.raises(PKVError, match=f"workspace holds {need - 4} bytes; this plan needs {need}"):
        engine.plan(first, "workqueue", workspace=FakeWorkspace(need - 4, [], "cuda:0"))
    with pytest.raises(PKVError, match="workspace must be a contiguous torch tensor on cuda:0"):
        engine.plan(first, "workqueue", workspace=FakeWorkspace(need, [], "cuda:1"))
    with pytest.raises(PKVError, match="workspace= is for the workqueue route"):
        engine.plan(first, "split", workspace=ws)


def test_update_lengths_replans_on_the_device_or_refuses():
    """update_lengths writes the rows' lengths into a workqueue plan and launches its planner again
    (nothing on the host); a host-planned plan refuses with one line."""
    engine, launched = fake_engine()
    plan = engine.plan(make_batch(engine.spec, [4096, 300], seed=1), "workqueue")
    launched.clear()
    plan.update_lengths(FakeTensor(np.array([4000, 299], dtype=np.int32), []))
    assert launched == [plan.launches[0]]
    assert plan.view("packed").numpy()[:2].tolist() == [4000, 299]
    with pytest.raises(PKVError, match="a split plan is planned on the host and cannot follow lengths"):
        engine.plan(make_batch(engine.spec, [300], seed=1), "split").update_lengths(None)


def test_a_second_stream_waits_for_the_plans_last_launch():
    """run() on a stream other than the plan's last one orders it after that stream first (one
    event, only on a change, none inside a capture); the plan then belongs to the new stream."""
    engine, launched = fake_engine()
    calls = []

    class Event:
        def record(self, stream):
            calls.append(("record", stream))

    cuda = SimpleNamespace(Event=Event, ExternalStream=lambda ptr, device=None: ("stream", ptr),
                           is_current_stream_capturing=lambda: capturing[0],
                           current_stream=lambda device=None: SimpleNamespace(
                               wait_event=lambda event: calls.append(("wait", current[0]))))
    engine.torch.cuda = cuda
    current, capturing = [11], [False]
    engine._raw_stream = lambda index: current[0]
    plan = engine.plan(make_batch(engine.spec, [4096], seed=1), "workqueue")
    assert plan.stream == 11
    tensor = SimpleNamespace(data_ptr=lambda: 0x1000, stride=lambda: (4096, 128, 1))
    cache = SimpleNamespace(data_ptr=lambda: 0x20000, stride=lambda: (16384, 1024, 128, 1))
    engine.run(tensor, (cache, cache), plan, tensor, check=False)
    assert calls == []                                   # the planner's stream: nothing to wait for
    current[0] = 22
    engine.run(tensor, (cache, cache), plan, tensor, check=False)
    engine.run(tensor, (cache, cache), plan, tensor, check=False)
    assert calls == [("record", ("stream", 11)), ("wait", 22)] and plan.stream == 22
    calls.clear()
    current[0], capturing[0] = 33, True                  # a capture: no wait recorded, the stream followed
    engine.run(tensor, (cache, cache), plan, tensor, check=False)
    assert calls == [] and plan.stream == 33


def test_view_names_what_a_plan_has():
    engine, _ = fake_engine()
    plan = engine.plan(make_batch(engine.spec, [100], seed=1), "workqueue")
    with pytest.raises(PKVError, match="has no buffer 'merge_groups'; it has .*items.*part_o"):
        plan.view("merge_groups")


def test_engine_spec_is_the_one_planned():
    engine, _ = fake_engine()
    other = make_batch(AttentionSpec(32, 8, 64, 16, "float16"), [100])
    with pytest.raises(PKVError, match="batch spec .* != engine spec"):
        engine.plan(other, "workqueue")


def torch_engine(lengths=(300, 17), fp8=False):
    """A fake engine with torch CPU tensors as the caller's q, cache and out (launches recorded);
    ``fp8``: its spec's cache is FP8 e4m3 (k, v float8_e4m3fn)."""
    torch = pytest.importorskip("torch")
    engine, launched = fake_engine()
    if fp8:
        engine.spec = AttentionSpec(32, 8, 128, 16, "float16", kv_dtype="float8_e4m3")
    engine.torch_dtype = torch.float16
    engine.cache_dtype = torch.float8_e4m3fn if fp8 else torch.float16
    engine.device = torch.device("cpu")
    engine._last_check = None
    batch = make_batch(engine.spec, list(lengths), seed=2)
    plan = engine.plan(batch, "workqueue")
    if fp8:
        engine.torch = torch  # the scales' checks on real (CPU) tensors; planning is done
    spec = engine.spec
    q = torch.zeros((batch.batch_size, spec.num_qo_heads, spec.head_dim), dtype=torch.float16)
    k = torch.zeros((batch.num_pages, spec.page_size, spec.num_kv_heads, spec.head_dim), dtype=engine.cache_dtype)
    return torch, engine, launched, plan, q, k, torch.zeros_like(k), torch.zeros_like(q)


def test_run_refuses_what_the_kernels_cannot_run():
    torch, engine, launched, plan, q, k, v, out = torch_engine()
    launched.clear()
    engine.run(q, (k, v), plan, out)
    assert len(launched) == 1
    cases = {
        "has dtype torch.float32": (q.float(), k, v, out),
        r"q has shape \(2, 32, 64\)": (q[:, :, :64], k, v, out),
        "k_cache has 3 pages; the plan's block table addresses page ids up to": (q, k[:3], v[:3], out),
        "v_cache must have k_cache's shape": (q, k, v[:-1], out),
        "k_cache strides .* unsupported": (q, *(t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v)), out),
    }
    for message, (qq, kk, vv, oo) in cases.items():
        with pytest.raises(PKVError, match=message):
            engine.run(qq, (kk, vv), plan, oo)
    assert len(launched) == 1  # nothing launched for a refused call


def test_fp8_cache_scales_reach_the_parameter_block_and_bad_ones_are_refused():
    """An FP8 engine's run() writes the scale pointers and the per-head stride (0: one scale per
    tensor, 1: one per kv head) into the decode block; what the kernels cannot read right is
    refused in one line before any launch."""
    torch, engine, launched, plan, q, k, v, out = torch_engine(fp8=True)
    per_tensor, per_head = torch.full((1,), 0.5), torch.linspace(0.1, 0.8, 8)
    for scale, stride in ((per_tensor, 0), (per_head, 1)):
        launched.clear()
        engine.run(q, (k, v), plan, out, k_scale=scale, v_scale=scale * 2)
        args = launched[0].args
        assert args.k_scale == scale.data_ptr() and args.s_sh == stride and args.v_scale != 0
        launched.clear()
        engine.run(q, (k, v, scale, scale), plan, out)  # the backend interface's 4-tuple
        assert launched[0].args.k_scale == scale.data_ptr() == launched[0].args.v_scale
    cases = {
        "needs k_scale": ((k, v), {}),
        "e5m2 is not supported": ((k.to(torch.float8_e5m2), v.to(torch.float8_e5m2)),
                                  {"k_scale": per_tensor, "v_scale": per_tensor}),
        "v_cache has dtype torch.float16": ((k, v.to(torch.float16)), {"k_scale": per_tensor, "v_scale": per_tensor}),
        "must be finite and > 0, got inf": ((k, v), {"k_scale": torch.tensor([float("inf")]), "v_scale": per_tensor}),
        "must be finite and > 0, got -1.0": ((k, v), {"k_scale": per_tensor, "v_scale": -per_tensor * 2}),
        r"1 or 8 \(num_kv_heads\) values": ((k, v), {"k_scale": torch.ones(3), "v_scale": per_tensor}),
        "got torch.float64": ((k, v), {"k_scale": per_tensor.double(), "v_scale": per_tensor}),
        "a Python number would be baked": ((k, v), {"k_scale": 0.5, "v_scale": per_tensor}),
        "must both be per tensor or both per KV head": ((k, v), {"k_scale": per_tensor, "v_scale": per_head}),
        "given once": ((k, v, per_tensor, per_tensor), {"k_scale": per_tensor}),
    }
    launched.clear()
    for message, (cache, scales) in cases.items():
        engine._last_check = None
        with pytest.raises(PKVError, match=message) as info:
            engine.run(q, cache, plan, out, **scales)
        assert "\n" not in str(info.value)
    engine._last_check = None
    with pytest.raises(PKVError, match="an FP8 query is not supported"):
        engine.run(q.to(torch.float8_e4m3fn), (k, v), plan, out, k_scale=per_tensor, v_scale=per_tensor)
    assert not launched  # nothing launched for a refused call
    # the fp16 engine: an FP8 cache is named, and scales are refused
    torch, engine16, launched, plan16, q, k16, v16, out = torch_engine()
    with pytest.raises(PKVError, match="k_cache has dtype torch.float8_e4m3fn, expected torch.float16; an FP8 "
                                       "cache needs"):
        engine16.run(q, (k, v), plan16, out)
    engine16._last_check = None
    with pytest.raises(PKVError, match="k_scale/v_scale are for an FP8 cache"):
        engine16.run(q, (k16, v16), plan16, out, k_scale=per_tensor, v_scale=per_tensor)


def test_fp8_token_rows_need_16_byte_strides():
    """An FP8 token row starts every 16 bytes: a token stride of 8 codes is refused."""
    torch, engine, launched, plan, q, k, v, out = torch_engine(fp8=True)
    launched.clear()
    base = torch.zeros((k.shape[0] * k.shape[1] * 8 * 128 + 8 * k.shape[0] * k.shape[1],), dtype=torch.float8_e4m3fn)
    kk = base.as_strided(k.shape, (k.shape[1] * (8 * 128 + 8), 8 * 128 + 8, 128, 1))
    with pytest.raises(PKVError, match=r"need \[\*, 16k, head_dim, 1\]"):
        engine.run(q, (kk, kk), plan, out, k_scale=torch.ones(1), v_scale=torch.ones(1))
    launched.clear()
    engine._last_check = None
    engine.run(q, (k, v), plan, out, k_scale=torch.ones(1), v_scale=torch.ones(1))  # 16-byte rows run
    assert len(launched) == 1


class _PageStride:
    """A cache tensor seen with another page stride (elements), without storage for it: the
    kernels' 32-bit byte offsets are checked from the strides alone."""

    def __init__(self, tensor, page_stride: int):
        self._t, self._s0 = tensor, page_stride

    def __getattr__(self, name):
        return getattr(self._t, name)

    def stride(self, dim=None):
        strides = (self._s0, *self._t.stride()[1:])
        return strides if dim is None else strides[dim]


def test_run_refuses_a_page_stride_of_4_gib_and_takes_one_just_below():
    torch, engine, launched, plan, q, k, v, out = torch_engine()
    launched.clear()
    with pytest.raises(PKVError, match=r"page stride x 2 B must stay below 4 GiB"):
        engine.run(q, (_PageStride(k, 2**31), _PageStride(v, 2**31)), plan, out)
    assert not launched
    engine.run(q, (_PageStride(k, 2**31 - 8), _PageStride(v, 2**31 - 8)), plan, out)
    assert len(launched) == 1 and launched[0].args.kv_sp == 2**31 - 8


def test_run_rechecks_a_misaligned_view_of_the_same_shape():
    """The full checks are skipped while nothing they look at changes; a view with the same shape
    and strides but a pointer off the kernels' alignment is a change."""
    torch, engine, launched, plan, q, k, v, out = torch_engine()
    engine.run(q, (k, v), plan, out)
    flat = torch.zeros(k.numel() + 8, dtype=torch.float16)
    shifted = flat[1:1 + k.numel()].view(k.shape)  # 2 bytes off a 16-byte boundary, same strides
    assert shifted.stride() == k.stride() and shifted.data_ptr() % 16 != 0
    with pytest.raises(PKVError, match="k/v 16-byte aligned"):
        engine.run(q, (shifted, v), plan, out)
    q_flat = torch.zeros(q.numel() + 2, dtype=torch.float16)
    with pytest.raises(PKVError, match="q and out must be 4-byte"):
        engine.run(q, (k, v), plan, q_flat[1:1 + q.numel()].view(q.shape))
    engine.run(q, (k, v), plan, out)  # and the good call still runs


@pytest.mark.parametrize("route", ["workqueue", "buckets", "split"])
def test_run_writes_every_per_call_value_into_each_launch(route):
    """run() stores the tensors' pointers and strides into the launches' parameter blocks with two
    struct stores per decode block and named stores per merge block; every per-call field must then
    read back as the tensors' own values (views with distinct strides, so a swapped field shows)."""
    torch, engine, launched, plan, q, k, v, out = torch_engine(lengths=(300, 17, 4100))
    if route != "workqueue":
        plan = engine.plan(make_batch(engine.spec, [300, 17, 4100], seed=2), route)
    qq = torch.zeros((q.shape[0], q.shape[1] + 2, q.shape[2] + 6), dtype=q.dtype)[:, 1:-1, 2:-4]
    oo = torch.zeros((q.shape[0] + 1, q.shape[1] + 4, q.shape[2] + 4), dtype=q.dtype)[1:, :-4, 4:]
    kk, vv = (torch.zeros((k.shape[0] + 1, *k.shape[1:]), dtype=k.dtype)[1:] for _ in range(2))
    assert len({qq.stride(), oo.stride()}) == 2 and kk.data_ptr() % 16 == 0
    launched.clear()
    engine.run(qq, (kk, vv), plan, oo)
    kinds = [launch.kind for launch in launched]
    assert kinds == [launch.kind for launch in plan.run_launches] and kinds
    for launch in launched:
        a = launch.args
        assert (a.out, a.o_sb, a.o_sh) == (oo.data_ptr(), oo.stride(0), oo.stride(1))
        if launch.kind != "merge":
            assert (a.q, a.k, a.v) == (qq.data_ptr(), kk.data_ptr(), vv.data_ptr())
            assert (a.kv_sp, a.kv_st, a.q_sb, a.q_sh) == (kk.stride(0), kk.stride(1), qq.stride(0), qq.stride(1))
    if route == "buckets":
        assert "merge" in kinds


@pytest.mark.parametrize("route", ["buckets", "split"])
def test_host_routes_upload_through_pinned_memory_without_a_sync(route):
    """The host-planned routes' three int32 uploads (items, block table, merge groups) each go
    pinned staging -> device through one non-blocking copy (no pageable .to(), which waits for
    the stream), and carry the host plan's bytes; the launches point at them."""
    engine, launched = fake_engine()
    batch = make_batch(engine.spec, [1, 17, 16, 300, 2049, 8200], hole_fraction=0.3, seed=5)
    plan = engine.plan(batch, route)
    host = plan.host_plan
    log = engine.torch.log
    uploads = [i for i, entry in enumerate(log) if entry[0] == "pinned"]
    assert len(uploads) == 3
    for i in uploads:  # pinned staging, then its device tensor, then the asynchronous copy
        assert log[i + 1][0] == "device" and log[i + 2][0] == "copy" and log[i + 2][4] is True
        assert log[i][1:] == log[i + 1][1:]
    items = plan.buffers["items"].numpy()
    assert items[:host.num_items, :4].tolist() == host.items.tolist()
    assert items[:host.num_items, 4].tolist() == batch.kv_indptr[host.items[:, 0] & 0xFFFF].tolist()
    assert not items[:, 5:].any()  # words 5 to 7 are 0
    assert plan.buffers["kv_indices"].numpy().tolist() == batch.kv_indices.tolist()
    groups = plan.buffers["merge_groups"].numpy()
    if host.merge_groups.size:
        assert groups.tolist() == host.merge_groups.tolist()
    decodes = [l for l in plan.launches if l.kind in ("decode", "fused")]
    assert decodes and all(args_of(l.args)["items"] == plan.buffers["items"].data_ptr() for l in decodes)
    assert all(args_of(l.args)["kv_indices"] == plan.buffers["kv_indices"].data_ptr() for l in decodes)
    assert launched == []  # host plans launch nothing before run()


def test_host_overhead_times_the_key_run_builds():
    """benchmarks/host_overhead.key_of restates run()'s check key (run() builds it inline, where a
    call would cost host time); it must stay the key run() stores, or python_key times something else."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import host_overhead

    torch, engine, launched, plan, q, k, v, out = torch_engine()
    engine.run(q, (k, v), plan, out)
    assert engine._last_check == host_overhead.key_of(q, k, v, out, (plan.batch_size, plan.num_pages))
    assert engine._last_check != host_overhead.key_of(q, k, v, out, (plan.batch_size, plan.num_pages + 1))


def test_engine_refuses_a_removed_route():
    engine, _ = fake_engine()
    with pytest.raises(PKVError, match="unknown route 'cluster'; expected one of workqueue, buckets, split"):
        engine.plan(make_batch(engine.spec, [100]), "cluster")


# --------------------------------------------------------------------------- launches, without a GPU
def test_run_launches_the_plans_kernels_in_order_and_replan_only_the_planner():
    """run() makes one driver launch per run launch, in the plan's order, with this call's pointers
    and strides written into each block (the merge's output too); the GPU planner's launch is
    replan_device's, never run()'s."""
    from persistentkv.engine import DevicePlan
    from persistentkv.launch import DecodeArgs, KernelLaunch, MergeArgs, PlanArgs, arg_block

    engine = cpu_engine()
    engine.device, engine._device_index = SimpleNamespace(index=0), 0
    engine._raw_stream = lambda index: 0
    seen = []
    engine._launch_kernel = lambda function, *rest: seen.append(function)
    decode = [KernelLaunch("decode", 4, arg_block(DecodeArgs, *[0] * 22), f) for f in (1, 2)]
    merge = KernelLaunch("merge", 2, arg_block(MergeArgs, *[0] * 9), 9)
    fake = SimpleNamespace(data_ptr=lambda: 64, stride=lambda: (24, 12, 8, 1))
    plan = DevicePlan("workqueue", engine.spec, 1, [KernelLaunch("plan", 1, arg_block(PlanArgs, *[0] * 9), 5),
                                                   decode[0], merge, decode[1]])
    engine.run(fake, (fake, fake), plan, fake, check=False)
    assert seen == [1, 9, 2]
    assert decode[1].args.q == decode[1].args.out == 64 and decode[1].args.kv_sp == 24
    assert merge.args.out == 64 and (merge.args.o_sb, merge.args.o_sh) == (24, 12)
    seen.clear()
    engine.replan_device(plan)
    engine.run(fake, (fake, fake), plan, fake, check=False)
    assert seen == [5, 1, 9, 2]


def test_replan_is_for_gpu_planned_plans_only():
    engine, _ = fake_engine()
    plan = engine.plan(make_batch(engine.spec, [300]), "split")
    with pytest.raises(PKVError, match="only GPU-planned"):
        engine.replan_device(plan)


def test_parameter_blocks_follow_the_kernels_signatures():
    """The ctypes layouts name the kernels' parameters in the kernel's order (kernels/pkv_decode.cu):
    a field out of place would hand a kernel the wrong value with no error."""
    import re
    from pathlib import Path

    from persistentkv.launch import DecodeArgs, MergeArgs, PlanArgs

    source = (Path(__file__).resolve().parents[1] / "kernels" / "pkv_decode.cu").read_text()

    def params(text: str) -> list[str]:
        return [re.findall(r"(\w+)\s*$", p.strip())[0] for p in text.replace("\\\n", " ").split(",") if p.strip()]

    decode = re.search(r"#define PKV_DECODE_ARGS\s*\\\n(.*?)\n\n", source, re.S).group(1)
    merge = re.search(r"pkv_merge\((.*?)\) \{", source, re.S).group(1)
    plan = re.search(r"pkv_plan\((.*?)\) \{", source, re.S).group(1)
    for layout, text in ((DecodeArgs, decode), (MergeArgs, merge), (PlanArgs, plan)):
        names = [n for n, _ in layout._fields_ if n != "_params"]
        assert names == params(text), layout.__name__


def test_engines_are_cached_per_device_and_options(monkeypatch):
    """engine_for keys its cache on the device as well as the spec and options: an engine made on
    one GPU is never handed out for another."""
    from persistentkv import engine as engine_module

    made = []

    class Recorder:
        def __init__(self, spec, device, **options):
            made.append((device, options))

    monkeypatch.setattr(engine_module, "DecodeEngine", Recorder)
    monkeypatch.setattr(engine_module, "_ENGINES", {})
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    a, b, c = (engine_module.engine_for(spec, device=d) for d in (0, 1, 0))
    assert a is c and a is not b
    assert engine_module.engine_for(spec, device=1, warps=8) is not b
    assert made == [(0, {}), (1, {}), (1, {"warps": 8})]
