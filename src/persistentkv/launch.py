"""The launch layer: loading every CUDA module the library uses and launching its kernels.

* ``load_cuda_module``: THE way a CUDA source of kernels/ is compiled (CuPy RawModule, NVRTC) and
  its functions fetched on a device, cached per (source path, options, device); the engine's
  pkv_decode.cu, model.step_ops' step_ops.cu and ceiling's ceiling.cu all load through it.
* ``compile_options`` / ``load_module``: the engine's module per (dtype, head_dim, warps, CTAs per SM, trace,
  source file), on top of ``load_cuda_module``; the module's own launch facts (shared memory,
  threads, stage tokens, stages) are read from it (``pkv_config``), never restated here.
* ``kernel_launcher``: THE launch, the driver's cuLaunchKernel over a parameter block;
  ``launch_kernel`` builds the block from a tuple of ctypes values for launches off the hot path
  (step_ops, ceiling). ``cuda_driver`` and ``raw_stream_reader`` are the only places that touch
  CuPy's and torch's private APIs.
* ``arg_block`` and the ``*Args`` layouts: a kernel's parameter values in one ctypes Structure
  kept alive between launches, so a launch rewrites only its per-call values (tensor pointers and
  strides) and makes one driver call.

Nothing here decides what to launch: the engine does (engine.py).
"""

from __future__ import annotations

import ctypes
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from .errors import PKVError, require
from .plan import TILE_TOKENS
from .spec import FP8_KV, AttentionSpec

KERNEL_FILE = "pkv_decode.cu"
#: Warps per decode CTA the kernel compiles for (PKV_WARPS); 4 is the default module.
ENGINE_WARPS = (4, 8)
DEFAULT_WARPS = 4
#: Largest head_dim of an 8-warp module: 3 stages of 128 tokens fill 192 KB at 128 (the kernel's
#: static_assert; 256 would need 256 KB).
WARPS8_MAX_HEAD_DIM = 128
#: Resident CTAs per SM a module is built for (PKV_CTAS_PER_SM, __launch_bounds__' min blocks), by
#: warps: the default first. 3 and 4 are the FP8 4-warp modules' at head_dim <= 128 (48 KB of
#: stages at 128 leave room for them, in <= 168 and <= 128 registers; an fp16 cache's 96 KB fits
#: two, and FP8 at 256 would spill and fit 3 CTAs at most); choose.choose_ctas_per_sm picks per step.
ENGINE_CTAS_PER_SM = {4: (2, 3, 4), 8: (1,)}
CTAS_MAX_HEAD_DIM = 128
#: Query heads per kv head the kernels take: the 16 rows of one mma tile.
MAX_GROUP_SIZE = 16
#: Query, cache and output dtypes the kernels compile for (PKV_BF16).
ENGINE_DTYPES = ("float16", "bfloat16")
#: Cache dtypes besides the query's: FP8 e4m3 codes with per-tensor or per-kv-head scales (PKV_FP8).
ENGINE_KV_DTYPES = (FP8_KV,)
#: The kernels' functions the engine launches.
FUNCTIONS = ("pkv_decode", "pkv_decode_fused", "pkv_merge", "pkv_plan")
CUDA_DEV_ATTR_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97  # cudaDevAttrMaxSharedMemoryPerBlockOptin


def kernels_dir() -> Path:
    """The folder of the CUDA sources (pkv_decode.cu, step_ops.cu, ceiling.cu, pkv_trace.cuh), the
    first of: $PERSISTENTKV_KERNELS; the installed package's kernels/ (a wheel or ``pip install .``
    carries them as persistentkv/kernels: setup.py); the source checkout's top-level kernels/ (an
    editable install, or src/ on PYTHONPATH). Every kernel user (the engine, kernel_build,
    ceiling, model.step_ops) finds its source here."""
    from importlib.resources import files

    env = os.environ.get("PERSISTENTKV_KERNELS")
    if env:
        require((Path(env) / KERNEL_FILE).is_file(), f"PERSISTENTKV_KERNELS={env} holds no {KERNEL_FILE}")
        return Path(env)
    searched = [Path(str(files("persistentkv") / "kernels")), Path(__file__).resolve().parents[2] / "kernels"]
    for path in searched:
        if (path / KERNEL_FILE).is_file():
            return path
    raise PKVError(f"kernel sources not found: no {KERNEL_FILE} in {' or in '.join(map(str, searched))} "
                   "(set PERSISTENTKV_KERNELS to the kernels/ folder)")


def stage_tokens(warps: int) -> int:
    """Tokens per pipeline stage of a ``warps``-warp module (the kernel's TILE: 16 per warp)."""
    return 16 * warps


def min_chunk_tiles_for(warps: int) -> int:
    """Default smallest work item, in planner tiles: one pipeline stage (2 tiles = 64 tokens at
    4 warps, 4 tiles = 128 tokens at 8); a smaller item leaves warps of its CTA without tokens."""
    return stage_tokens(warps) // TILE_TOKENS


def warps_unsupported(spec: AttentionSpec, warps: int) -> list[str]:
    """Reasons a ``warps``-warp module cannot be built for ``spec`` (empty when it can)."""
    if isinstance(warps, bool) or warps not in ENGINE_WARPS:
        return [f"warps must be one of {', '.join(map(str, ENGINE_WARPS))}, got {warps!r}"]
    if warps == 8 and spec.head_dim > WARPS8_MAX_HEAD_DIM:
        return [f"warps=8 needs head_dim <= {WARPS8_MAX_HEAD_DIM} (3 stages of 128 tokens), "
                f"got head_dim {spec.head_dim}; use warps=4"]
    return []


def ctas_unsupported(spec: AttentionSpec, warps: int, ctas_per_sm: int | None) -> list[str]:
    """Reasons a ``warps``-warp module cannot be built for ``ctas_per_sm`` resident CTAs per SM
    (None: the default; empty when it can)."""
    if ctas_per_sm is None or warps not in ENGINE_CTAS_PER_SM:
        return []
    allowed = ENGINE_CTAS_PER_SM[warps]
    if isinstance(ctas_per_sm, bool) or ctas_per_sm not in allowed:
        return [f"ctas_per_sm must be one of {', '.join(map(str, allowed))} at {warps} warps, got {ctas_per_sm!r}"]
    if ctas_per_sm != allowed[0] and (not spec.fp8_kv or spec.head_dim > CTAS_MAX_HEAD_DIM):
        return [f"ctas_per_sm={ctas_per_sm} is built for an FP8 cache at head_dim <= {CTAS_MAX_HEAD_DIM} (got "
                f"{'an FP8' if spec.fp8_kv else f'a {spec.cache_dtype}'} cache at head_dim {spec.head_dim}); "
                f"use the default, {allowed[0]}"]
    return []


def compile_options(spec: AttentionSpec, warps: int = DEFAULT_WARPS, trace: bool = False,
                    ctas_per_sm: int | None = None) -> tuple[str, ...]:
    """Compiler options of the module for ``spec``'s (dtype, kv_dtype, head_dim) with ``warps`` warps per
    decode CTA and ``ctas_per_sm`` resident CTAs per SM (None: the warps' default), and the CTA
    trace stamps when ``trace`` (kernels/pkv_trace.cuh); shared with ``persistentkv
    compile-kernels``. The default module gets no PKV_WARPS or PKV_CTAS_PER_SM define, so its
    options (and CuPy's cache key) are those of before either existed."""
    reasons = warps_unsupported(spec, warps) or ctas_unsupported(spec, warps, ctas_per_sm)
    require(not reasons, "; ".join(reasons))
    options = ("-std=c++17", "--use_fast_math", f"-DPKV_HEAD_DIM={spec.head_dim}",
               f"-DPKV_BF16={1 if spec.dtype == 'bfloat16' else 0}")
    options = (*options, "-DPKV_FP8=1") if spec.fp8_kv else options
    options = options if warps == DEFAULT_WARPS else (*options, f"-DPKV_WARPS={warps}")
    if ctas_per_sm is not None and ctas_per_sm != ENGINE_CTAS_PER_SM[warps][0]:
        options = (*options, f"-DPKV_CTAS_PER_SM={ctas_per_sm}")
    return (*options, "-DPKV_TRACE=1") if trace else options


@dataclass
class Module:
    """One compiled module: its CUfunctions by name and the launch facts it reports."""

    functions: dict
    smem_bytes: int
    threads: int
    tile: int
    stages: int
    occupancy: int
    #: the GPU planner's threads per block and the most rows it plans (PKV_PLAN_THREADS, _MAX_ROWS)
    plan_threads: int
    plan_max_rows: int
    #: the CuPy RawModule (its globals, e.g. pkv_trace of a trace build)
    raw: Any = field(default=None, repr=False)


def load_module(spec: AttentionSpec, warps: int, device: int, trace: bool = False,
                ctas_per_sm: int | None = None) -> Module:
    """The module for ``spec``'s (dtype, head_dim), ``warps`` and ``ctas_per_sm`` on CUDA ``device``,
    compiled from kernels_dir() (once per process and source file; CuPy caches the binary on disk).
    A module built for more resident CTAs than the device holds is refused with one line."""
    source = kernels_dir() / KERNEL_FILE
    return _load_module(spec.dtype, spec.kv_dtype, spec.head_dim, warps, device, trace, str(source.resolve()),
                        ctas_per_sm)


@lru_cache(maxsize=None)
def _load_module(dtype: str, kv_dtype: str | None, head_dim: int, warps: int, device: int, trace: bool,
                 source: str, ctas_per_sm: int | None = None) -> Module:
    import cupy  # the engine's only CuPy use; imported when a module is first built

    spec = AttentionSpec(num_qo_heads=1, num_kv_heads=1, head_dim=head_dim, dtype=dtype, kv_dtype=kv_dtype)
    path = Path(source)
    options = (*compile_options(spec, warps, trace, ctas_per_sm), f"-I{path.parent}")
    cuda_path = cupy.cuda.get_cuda_path()
    if cuda_path:
        options += (f"-I{Path(cuda_path) / 'include'}",)
    what = (f"{dtype}{f' with a {kv_dtype} cache' if kv_dtype else ''}/head_dim {head_dim}/warps {warps}"
            f"{f'/{ctas_per_sm} CTAs per SM' if ctas_per_sm else ''}")
    with cupy.cuda.Device(device):
        # compiled first: the decode kernels' shared memory (their max dynamic shared memory below)
        # is the module's own fact, read from it
        module = load_cuda_module(path, options, (), device, what=what).raw
        raw = module.get_global("pkv_config")
        smem, threads, tile, stages, plan_tile, plan_threads, plan_max_rows = cupy.ndarray(
            (7,), dtype=cupy.int32, memptr=raw).get().tolist()
        require(plan_tile == TILE_TOKENS, f"kernel planner tile {plan_tile} != plan.TILE_TOKENS {TILE_TOKENS}")
        require(tile == stage_tokens(warps), f"kernel tile {tile} != {stage_tokens(warps)} tokens for {warps} warps")
        optin = int(cupy.cuda.runtime.deviceGetAttribute(CUDA_DEV_ATTR_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, device))
        require(smem <= optin, f"the {warps}-warp kernel for head_dim {head_dim} needs {smem} B of shared "
                               f"memory per CTA; this device allows {optin}")
        functions = load_cuda_module(path, options, FUNCTIONS, device,
                                     {name: smem for name in FUNCTIONS if name.startswith("pkv_decode")},
                                     what=what).functions
        occupancy = kernel_occupancy(functions["pkv_decode_fused"].ptr, threads, smem)
        require(ctas_per_sm is None or occupancy >= ctas_per_sm,
                f"the {what} module holds {occupancy} CTAs per SM on this device ({smem} B of shared memory "
                f"each), not {ctas_per_sm}; use fewer")
    return Module(functions, smem, threads, tile, stages, max(1, occupancy), plan_threads, plan_max_rows, module)


# ----------------------------------------------------------------------------- loading any module
@dataclass(frozen=True)
class CudaModule:
    """One compiled CUDA source on one device (:func:`load_cuda_module`)."""

    #: the CuPy RawModule (its globals: pkv_config, a trace build's pkv_trace)
    raw: Any = field(repr=False)
    #: name -> CuPy Function of the device: ``.ptr`` is the CUfunction; each keeps the module loaded
    functions: dict


def load_cuda_module(source: Path | str, options: tuple[str, ...], functions: tuple[str, ...], device: int,
                     max_dynamic_smem: Mapping[str, int] | None = None, what: str = "") -> CudaModule:
    """``source`` (a .cu file of kernels/) compiled with ``options`` on CUDA ``device`` and its
    ``functions`` fetched there, each of ``max_dynamic_smem``'s allowed that many bytes of dynamic
    shared memory. The compiled module is cached per (source path, options, device) for the
    process (CuPy caches the binary on disk, keyed on the source text and the options: they are
    passed through exactly as given). A failed compile is a one-line PKVError naming the file and
    ``what`` (the build: "float16/head_dim 128/warps 4")."""
    import cupy

    path = Path(source)
    device = int(device)
    try:
        module = _compiled_module(str(path.resolve()), tuple(options), device)
    except Exception as exc:
        text = str(exc).strip()
        raise PKVError(f"compiling {path.name}{f' for {what}' if what else ''} failed: "
                       f"{text.splitlines()[-1] if text else type(exc).__name__}") from exc
    fetched = {}
    with cupy.cuda.Device(device):
        for name in functions:
            kernel = module.get_function(name)
            if max_dynamic_smem and name in max_dynamic_smem:
                kernel.max_dynamic_shared_size_bytes = max_dynamic_smem[name]
            fetched[name] = kernel.kernel  # this device's Function (a RawKernel resolves per device)
    return CudaModule(module, fetched)


@lru_cache(maxsize=None)
def _compiled_module(source: str, options: tuple[str, ...], device: int):
    import cupy

    with cupy.cuda.Device(device):
        module = cupy.RawModule(code=Path(source).read_text(), options=options)
        module.compile()
    return module


# ----------------------------------------------------------------------------- the driver and the stream
# The two private APIs the library uses live here and nowhere else, each with a public fallback.
@lru_cache(maxsize=None)
def cuda_driver():
    """CuPy's driver binding, ``cupy_backends.cuda.api.driver``: PRIVATE to CuPy. Used because its
    ``launchKernel`` takes a CUfunction and the address of a parameter block we keep alive, one C
    call per launch: one eager run() with a reused plan costs ~8.9 us of host time through it
    against ~28 us through CuPy's public ``RawKernel.__call__``, which builds every argument per
    call (benchmarks/NOTES.md, "What ships": "direct driver launches with a persistent parameter
    block"). A CuPy without it is refused with one line."""
    try:
        from cupy_backends.cuda.api import driver
    except ImportError:
        driver = None
    require(driver is not None and hasattr(driver, "launchKernel")
            and hasattr(driver, "occupancyMaxActiveBlocksPerMultiprocessor"),
            "this CuPy has no cupy_backends.cuda.api.driver.launchKernel (the engine launches through it)")
    return driver


def kernel_launcher():
    """THE launch: ``launch(function, grid_x, grid_y, grid_z, block_x, block_y, block_z, smem,
    stream, params, 0)`` (cuLaunchKernel: ``function`` a CUfunction, ``stream`` a raw stream,
    ``params`` the address of the array of pointers to the parameter values, e.g.
    ``arg_block(...).address``). The engine keeps it bound and calls it directly, so a launch
    pays no Python frame of ours beyond its own."""
    return cuda_driver().launchKernel


def launch_kernel(function: int, grid: int, threads: int, args: tuple, stream: int, smem: int = 0) -> None:
    """One launch of ``function`` (a CUfunction) over ``grid`` blocks of ``threads`` threads with
    ``smem`` bytes of dynamic shared memory on the raw ``stream``; ``args``: the kernel's
    parameters as ctypes values (``ctypes.c_uint64(tensor.data_ptr())``, ``ctypes.c_int32(n)``...)
    in its order, pointed at from a block made for this call (the driver copies the values at
    launch). For launches off the engine's hot path (model.step_ops, ceiling). Grid and block are
    at least 1, as CuPy's RawKernel launches them."""
    params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
    kernel_launcher()(function, max(1, int(grid)), 1, 1, max(1, int(threads)), 1, 1, int(smem), int(stream),
                      ctypes.addressof(params), 0)


def kernel_occupancy(function: int, threads: int, smem: int) -> int:
    """CTAs of ``function`` resident per SM with ``threads`` threads and ``smem`` bytes of dynamic
    shared memory (the driver's occupancy calculator)."""
    return int(cuda_driver().occupancyMaxActiveBlocksPerMultiprocessor(function, threads, smem))


@lru_cache(maxsize=None)
def raw_stream_reader():
    """``read(device_index) -> int``: the raw pointer of torch's current stream on a device (the
    capture stream inside a CUDA-graph capture). ``torch._C._cuda_getCurrentRawStream`` is PRIVATE
    to torch; used because the public ``torch.cuda.current_stream(index).cuda_stream`` builds a
    torch.cuda.Stream object per call, a few microseconds more per run() (not measured here). A
    torch without it gets the public call."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw if raw is not None else (lambda index: torch.cuda.current_stream(index).cuda_stream)


def current_raw_stream(device_index: int) -> int:
    """The raw pointer of torch's current stream on CUDA device ``device_index``."""
    return raw_stream_reader()(device_index)


# ----------------------------------------------------------------------------- parameter blocks
_PTR, _I32, _I64, _F32 = ctypes.c_uint64, ctypes.c_int32, ctypes.c_int64, ctypes.c_float


def _arg_layout(name: str, fields: list) -> type:
    """A ctypes Structure holding one kernel's parameter values (``fields``: (name, ctype) in the
    kernel's order) followed by ``_params``, the array of pointers to each value that
    cuLaunchKernel takes. Field names are the kernel's parameter names, so ``run`` rewrites its
    per-call values by name (``args.out = ...``)."""
    layout = type(name, (ctypes.Structure,), {"_fields_": [*fields, ("_params", ctypes.c_void_p * len(fields))]})
    layout.offsets = np.array([getattr(layout, f).offset for f, _ in fields], dtype=np.uint64)
    layout.params_offset = layout._params.offset
    # run() writes a decode block's per-call values with two struct stores (PTRS at 0, STRIDES6
    # at strides_offset), so those fields must lie where the stores put them
    names = [f for f, _ in fields]
    if "kv_sp" in names:
        assert names[:7] == ["q", "k", "v", "out", "lse", "k_scale", "v_scale"] and layout.q.offset == 0, name
        stride_names = [n for n, _ in _STRIDES]
        start = names.index("kv_sp")
        assert names[start:start + len(stride_names)] == stride_names, name
        layout.strides_offset = layout.kv_sp.offset
        assert [getattr(layout, n).offset for n in stride_names] == [layout.strides_offset + 8 * i
                                                                     for i in range(len(stride_names))]
    return layout


#: run()'s per-call stores into a decode parameter block: the q, k, v, out, lse, k_scale, v_scale
#: pointers (its first seven fields; lse 0 when not asked for, the scales 0 without an FP8 cache)
#: and the seven strides (kv_sp, kv_st, q_sb, q_sh, o_sb, o_sh, s_sh; at layout.strides_offset)
PTRS = struct.Struct("<7Q")
STRIDES = struct.Struct("<7q")


def arg_block(layout: type, *values):
    """A kernel's parameter block, kept alive between launches (a ``layout`` instance).

    cuLaunchKernel copies parameter values at launch (and a graph capture records them), so one
    block per launch is built at plan time and ``run`` only rewrites the per-call values (tensor
    pointers and strides) before handing ``block.address`` (its pointer array) to the driver: a
    launch costs two struct stores (pointers, strides) and one driver call."""
    block = layout(*values)
    base = ctypes.addressof(block)
    np.add(layout.offsets, base, out=np.frombuffer(block._params, dtype=np.uint64))
    block.address = base + layout.params_offset
    return block


_STRIDES = [(n, _I64) for n in ("kv_sp", "kv_st", "q_sb", "q_sh", "o_sb", "o_sh", "s_sh")]
#: pkv_decode / pkv_decode_fused (kernels/pkv_decode.cu, PKV_DECODE_ARGS)
DecodeArgs = _arg_layout("DecodeArgs", [
    ("q", _PTR), ("k", _PTR), ("v", _PTR), ("out", _PTR), ("lse", _PTR), ("k_scale", _PTR), ("v_scale", _PTR),
    ("kv_indices", _PTR), ("items", _PTR),
    ("num_items", _PTR), ("part_o", _PTR), ("part_lse", _PTR), ("counters", _PTR), ("slot_offset", _I32),
    ("num_kv_heads", _I32), ("group_size", _I32), ("log2_page", _I32), *_STRIDES, ("scale_log2", _F32)])
#: pkv_merge
MergeArgs = _arg_layout("MergeArgs", [
    ("groups", _PTR), ("part_o", _PTR), ("part_lse", _PTR), ("out", _PTR), ("lse", _PTR), ("group_size", _I32),
    ("num_kv_heads", _I32), ("o_sb", _I64), ("o_sh", _I64)])
#: pkv_plan
PlanArgs = _arg_layout("PlanArgs", [
    ("seq_lens", _PTR), ("kv_indptr", _PTR), ("batch", _I32), ("num_kv_heads", _I32), ("target_items", _I32),
    ("min_chunk_tiles", _I32), ("max_items", _I32), ("items", _PTR),
    ("num_items", _PTR)])


# ----------------------------------------------------------------------------- launches
@dataclass
class KernelLaunch:
    """One kernel launch of a plan: ``kind`` decode | fused | merge | plan, its grid, its parameter
    block (per-call values rewritten by run())."""

    kind: str
    grid: int
    args: Any
    function: int = 0  # CUfunction
    threads: int = 0
    smem: int = 0
