"""The one load and launch path (persistentkv.launch) without a GPU: CuPy, torch's stream reader and
the driver replaced by recorders, so what every module hands the compiler and the driver is
checked byte for byte (compile options, the parameter values a launch points at, grid, block,
shared memory, stream)."""

from __future__ import annotations

import ctypes
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest

from persistentkv import launch
from persistentkv.errors import PKVError


class FakeCupy:
    """The CuPy calls load_cuda_module makes, recording the device each happens on."""

    def __init__(self, fail: str | None = None):
        self.current, self.log, self.fail = 0, [], fail
        cupy = self

        class Device:
            def __init__(self, index):
                self.index = index

            def __enter__(self):
                self.before, cupy.current = cupy.current, self.index

            def __exit__(self, *exc):
                cupy.current = self.before

        class RawKernel:
            def __init__(self, name):
                self.name = name

            @property
            def kernel(self):
                return SimpleNamespace(ptr=(cupy.current, self.name))

            @property
            def max_dynamic_shared_size_bytes(self):
                raise AssertionError("only set")

            @max_dynamic_shared_size_bytes.setter
            def max_dynamic_shared_size_bytes(self, value):
                cupy.log.append(("smem", cupy.current, self.name, value))

        class RawModule:
            def __init__(self, code, options):
                self.code, self.options = code, options

            def compile(self):
                cupy.log.append(("compile", cupy.current, self.options))
                if cupy.fail:
                    raise RuntimeError(cupy.fail)

            def get_function(self, name):
                return RawKernel(name)

        self.cuda = SimpleNamespace(Device=Device)
        self.RawModule = RawModule


@pytest.fixture
def fake_cupy(monkeypatch):
    cupy = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    launch._compiled_module.cache_clear()
    yield cupy
    launch._compiled_module.cache_clear()


def test_load_cuda_module_compiles_once_per_source_options_and_device(fake_cupy, tmp_path):
    source = tmp_path / "k.cu"
    source.write_text("extern \"C\" __global__ void f() {}")
    options = ("--std=c++17", "-DX=1")
    first = launch.load_cuda_module(source, options, ("f", "g"), 1, {"g": 4096})
    again = launch.load_cuda_module(source, options, ("f",), 1)
    assert first.raw is again.raw and first.raw.options == options  # the options as given, in order
    assert first.raw.code == source.read_text()
    # functions fetched on the module's device, max dynamic shared memory only where asked
    assert first.functions["f"].ptr == (1, "f") and first.functions["g"].ptr == (1, "g")
    assert fake_cupy.log == [("compile", 1, options), ("smem", 1, "g", 4096)]
    other = launch.load_cuda_module(source, options, (), 2)
    assert other.raw is not first.raw and fake_cupy.log[-1] == ("compile", 2, options)
    launch.load_cuda_module(source, (*options, "-DY"), (), 1)
    assert len([e for e in fake_cupy.log if e[0] == "compile"]) == 3
    assert fake_cupy.current == 0  # every device context left


def test_a_failed_compile_is_one_line_and_not_cached(fake_cupy, tmp_path):
    source = tmp_path / "k.cu"
    source.write_text("broken")
    fake_cupy.fail = "log line\nk.cu(1): error: expected a declaration"
    with pytest.raises(PKVError, match=r"^compiling k.cu for float16/x failed: k.cu\(1\): error: expected a "
                                       r"declaration$"):
        launch.load_cuda_module(source, (), ("f",), 0, what="float16/x")
    with pytest.raises(PKVError, match=r"^compiling k.cu failed: "):
        launch.load_cuda_module(source, (), ("f",), 0)
    fake_cupy.fail = None
    assert launch.load_cuda_module(source, (), ("f",), 0).functions["f"].ptr == (0, "f")


def param_values(params: int, ctypes_types: list) -> list:
    """The values a cuLaunchKernel parameter array at ``params`` points at, read as ``ctypes_types``."""
    pointers = (ctypes.c_void_p * len(ctypes_types)).from_address(params)
    return [t.from_address(p).value for t, p in zip(ctypes_types, pointers)]


def recording_driver(seen: list, types_: list):
    def launch_kernel(function, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        seen.append((function, (gx, gy, gz), (bx, by, bz), smem, stream, param_values(params, types_), extra))

    return SimpleNamespace(launchKernel=launch_kernel)


def test_launch_kernel_points_the_driver_at_each_value(monkeypatch):
    seen = []
    kinds = [ctypes.c_uint64, ctypes.c_int32, ctypes.c_int64, ctypes.c_float]
    monkeypatch.setattr(launch, "cuda_driver", lambda: recording_driver(seen, kinds))
    launch.launch_kernel(7, 12, 256, (ctypes.c_uint64(2**40 + 16), ctypes.c_int32(-3), ctypes.c_int64(2**35),
                                      ctypes.c_float(0.5)), 99, smem=1024)
    launch.launch_kernel(7, 0, 0, (ctypes.c_uint64(1), ctypes.c_int32(2), ctypes.c_int64(3), ctypes.c_float(4)), 0)
    assert seen == [(7, (12, 1, 1), (256, 1, 1), 1024, 99, [2**40 + 16, -3, 2**35, 0.5], 0),
                    (7, (1, 1, 1), (1, 1, 1), 0, 0, [1, 2, 3, 4.0], 0)]  # at least 1, as CuPy launches


def test_the_engine_block_and_the_convenience_reach_the_same_launch(monkeypatch):
    """arg_block(...).address (the engine's) and launch_kernel's own block hand the driver the same
    values for the same parameters."""
    seen = []
    kinds = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
             ctypes.c_int32, ctypes.c_uint64, ctypes.c_uint64]
    monkeypatch.setattr(launch, "cuda_driver", lambda: recording_driver(seen, kinds))
    values = [0x1000, 0x2000, 3, 8, 264, 2, 77, 0x3000, 0x4000]
    block = launch.arg_block(launch.PlanArgs, *values)
    launch.kernel_launcher()(5, 1, 1, 1, 1024, 1, 1, 0, 11, block.address, 0)
    launch.launch_kernel(5, 1, 1024, tuple(t(v) for t, v in zip(kinds, values)), 11)
    assert seen[0] == seen[1] and seen[0][5] == values


def install_cupy_driver(monkeypatch, driver) -> None:
    api = types.ModuleType("cupy_backends.cuda.api")
    api.driver = driver
    for name, module in (("cupy_backends", types.ModuleType("cupy_backends")),
                         ("cupy_backends.cuda", types.ModuleType("cupy_backends.cuda")),
                         ("cupy_backends.cuda.api", api), ("cupy_backends.cuda.api.driver", driver)):
        monkeypatch.setitem(sys.modules, name, module)


def test_cuda_driver_is_cupys_binding_or_a_one_line_refusal(monkeypatch):
    launch.cuda_driver.cache_clear()
    try:
        private = types.ModuleType("cupy_backends.cuda.api.driver")
        private.launchKernel = private.occupancyMaxActiveBlocksPerMultiprocessor = print
        install_cupy_driver(monkeypatch, private)
        assert launch.cuda_driver() is private and launch.kernel_launcher() is print
        launch.cuda_driver.cache_clear()
        install_cupy_driver(monkeypatch, types.ModuleType("cupy_backends.cuda.api.driver"))  # no launchKernel
        with pytest.raises(PKVError, match="this CuPy has no cupy_backends.cuda.api.driver.launchKernel"):
            launch.cuda_driver()
    finally:
        launch.cuda_driver.cache_clear()


def test_raw_stream_reader_is_torchs_private_call_else_the_public_one(monkeypatch):
    private = lambda index: 1000 + index  # noqa: E731
    public = SimpleNamespace(_C=SimpleNamespace(), cuda=SimpleNamespace(
        current_stream=lambda index: SimpleNamespace(cuda_stream=2000 + index)))
    launch.raw_stream_reader.cache_clear()
    try:
        monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(_C=SimpleNamespace(_cuda_getCurrentRawStream=private)))
        assert launch.raw_stream_reader() is private and launch.current_raw_stream(1) == 1001
        launch.raw_stream_reader.cache_clear()
        monkeypatch.setitem(sys.modules, "torch", public)
        assert launch.current_raw_stream(1) == 2001
    finally:
        launch.raw_stream_reader.cache_clear()


# ----------------------------------------------------------------------------- the modules that launch
def recording_launch(seen: list):
    def launch_kernel(function, grid, threads, args, stream, smem=0):
        seen.append((function, grid, threads, [(type(a), a.value) for a in args], stream, smem))

    return launch_kernel


def test_step_ops_launch_the_kernels_parameters_in_their_types(monkeypatch):
    """gemv: (x, w, y pointers; int n, chunks, split); append_kv: (k, v, k_flat, v_flat, slots
    pointers; int rows, row_chunks; long long strides and slot count), kernels/step_ops.cu."""
    torch = pytest.importorskip("torch")
    from persistentkv.model import step_ops

    seen = []
    monkeypatch.setitem(sys.modules, "cupy", FakeCupy())
    monkeypatch.setattr(step_ops, "_function", lambda index, name: name)
    monkeypatch.setattr(step_ops, "_sm_count", lambda index: 132)
    monkeypatch.setattr(step_ops, "current_raw_stream", lambda index: 42)
    monkeypatch.setattr(step_ops, "launch_kernel", recording_launch(seen))
    x, w = torch.zeros((1, 4096), dtype=torch.float16), torch.zeros((4096, 4096), dtype=torch.float16)
    out = step_ops.launch_gemv(x, w)
    shape = step_ops.gemv_shape(2048, 4096, 132)
    u64, i32, i64 = ctypes.c_uint64, ctypes.c_int32, ctypes.c_int64
    assert seen.pop() == ("pkv_gemv_float16_t1", shape.blocks, shape.threads,
                          [(u64, x.data_ptr()), (u64, w.data_ptr()), (u64, out.data_ptr()), (i32, 4096), (i32, 512),
                           (i32, shape.split)], 42, 0)
    k_flat, v_flat = torch.zeros((64, 8, 128), dtype=torch.float16), torch.zeros((64, 8, 128), dtype=torch.float16)
    qkv = torch.zeros((2, 3, 8, 128), dtype=torch.float16)
    k, v, slots = qkv[:, 1], qkv[:, 2], torch.tensor([3, 9], dtype=torch.int64)
    step_ops.launch_append_kv(k_flat, v_flat, slots, k, v)
    assert seen.pop() == ("pkv_append_kv", step_ops.append_blocks(2 * 2 * 128, 132), step_ops.APPEND_THREADS,
                          [(u64, k.data_ptr()), (u64, v.data_ptr()), (u64, k_flat.data_ptr()),
                           (u64, v_flat.data_ptr()), (u64, slots.data_ptr()), (i32, 2), (i32, 128), (i64, 384),
                           (i64, 384), (i64, 128), (i64, 64)], 42, 0)


def test_the_floor_reader_points_each_launch_at_its_slot(monkeypatch):
    """read_ceiling(src, n_vec, sink), kernels/ceiling.cu: slot c starts c x n_vec x 16 bytes in."""
    torch = pytest.importorskip("torch")
    from persistentkv import ceiling

    seen = []
    monkeypatch.setattr(ceiling, "_device_index", lambda device: 0)
    monkeypatch.setattr(ceiling, "_read_function", lambda index: 0xF00)
    monkeypatch.setattr(ceiling, "current_raw_stream", lambda index: 7)
    monkeypatch.setattr(ceiling, "launch_kernel", recording_launch(seen))
    reader = ceiling.CupyReader(SimpleNamespace(device=torch.device("cpu")), 3, 100, seed=1)
    reader.launch(264, 2)
    base, u64 = reader.buffer.data_ptr(), ctypes.c_uint64
    assert seen == [(0xF00, 264, ceiling.THREADS, [(u64, base + 2 * 1600), (u64, 100),
                                                   (u64, reader.sink.data_ptr())], 7, 0)]
    assert np.array_equal(reader.slot_bytes(2).numpy(), reader.buffer[3200:4800].numpy())
