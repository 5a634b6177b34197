"""The GPU engine: kernels/pkv_decode.cu through CuPy, on torch tensors, in plan/run shape.

    engine = DecodeEngine(spec)                     # compiles (once, cached by CuPy) and loads
    plan = engine.plan(batch, route="workqueue")   # once per decode step
    engine.run(q, (k_cache, v_cache), plan, out)   # once per layer; graph-capturable

``run`` takes torch tensors and passes their device pointers straight to the kernels: no copies,
no allocation, no host synchronisation, launched on torch's current stream, so a step can be
captured in a CUDA graph. Routes:

* ``workqueue`` (default): the balanced compact queue, planned ON THE GPU by ``pkv_plan`` from
  the device sequence lengths (no host round trip), one fused launch (the last CTA of each
  (row, kv head) merges).
* ``workqueue_host``: the same queue planned by plan.py on the host and uploaded.
* ``buckets``: one decode + merge launch pair per exact-length bucket, as published.
* ``split``: the rectangular B x Hkv x S grid with its empty splits, decode + merge.
* ``cluster`` (sm_90+): exactly C splits per (row, kv head), one thread-block cluster of C CTAs
  each, which merges on chip through distributed shared memory: one launch, no items, no
  counters, no partial states in global memory. The kernel reads the lengths and page table from
  one uploaded tensor (``plan.view('packed')`` = seq_lens | kv_indptr | kv_indices) and
  computes its own ranges, and its grid (B * Hkv * C) depends only on B: lengths may be changed
  on the device between replays of a captured graph, within the pages of the table.

Supported: fp16 and bf16; head_dim 64/128/256; G = Hq/Hkv from 1 to 16; page sizes 1-256
(powers of two; 8-128 are the tested range); batch up to 4096 rows on the GPU planner (65535
on the host planner). Anything else is refused in ``DecodeEngine.__init__`` or ``plan``.

``warps`` (default 4) picks the module's CTA shape: 8 warps stream 128-token pipeline stages
(192 KB of shared memory at head_dim 128, one CTA per SM) instead of 64-token ones (two CTAs per
SM), so that a grid of one CTA per SM (the cluster route) keeps as many bytes in flight as two
4-warp CTAs. head_dim <= 128 only; every route runs with either.

``pdl`` (sm_90+) launches the decode kernels with programmatic dependent launch: a kernel's CTAs
start while the preceding kernel on the stream finishes, read their work item and page ids,
then wait (``griddepcontrol.wait``) for the preceding kernel's completion before they read Q, the
cache or the partial-state buffers. The item and
page ids are read early only when the plan's items were written before the preceding kernel:
the first ``run`` after ``plan`` or ``replan_device`` waits first (``DevicePlan.early_ok``).
The cluster route and the separate merge always launch without it. Default (``pdl=None``): on
where the device (sm_90+) and the driver (cuLaunchKernelEx) have it, as FlashInfer's and
TensorRT-LLM's decode kernels are launched there.

``early_kv`` (default True; with PDL only): with the item read early, the K/V loads of the first
pipeline stages are issued before the wait as well, for every page but the item's last, so they
overlap the preceding kernel's tail (benchmarks/NOTES.md, v12: 4-16 % per call at B=1 up to 32K
tokens, 1-3 % on 500 MB steps). The kernel skips them for an item of 2 to STAGES - 1 stages in
a group of 8 or more splits (B=1 at 3-4K tokens), where loading the whole item early made the
step slower (7 % at B=1 x 4K; benchmarks/NOTES.md, v16). The contract: the kernel before each
run() on the stream may write the cache only in each row's last page, as a one-token decode
step's append does; pass
``early_kv=False`` when another kernel (e.g. a page copy) writes pages that a plan reads right
before its run().

``pool`` (default 0; a multiple of 1/16 below 1): in a fused work queue of one wave, each row
split two or more ways keeps this share of its tiles out of its items' ranges, as a pool that
the row's CTAs of each kv head claim a stage at a time (an atomic cursor, the second counter of
the group) once their own stages are issued, so CTAs that stream faster take more of it
(plan.pooled_items; benchmarks/NOTES.md, v15). Pool stages are loaded after the wait, never early.
A pooled engine builds its own module (PKV_POOL=1: the shipped one has no pool code), and its
sums run in an order that changes from run to run (rounding-level differences between runs).
Opt-in: on the H200 it has not been faster (NOTES v15).
"""

from __future__ import annotations

import ctypes
import math
import re
import struct
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from . import plan as planner
from .cache import Batch
from .env import cuda_reasons, missing_module
from .errors import PKVError, require
from .spec import AttentionSpec

KERNEL_FILE = "pkv_decode.cu"
GPU_PLAN_MAX_ROWS = 4096  # PKV_PLAN_MAX_ROWS in the kernel
PLAN_THREADS = 1024       # PKV_PLAN_THREADS in the kernel
#: Warps per decode CTA the kernel compiles for (PKV_WARPS); 4 is the default module.
ENGINE_WARPS = (4, 8)
DEFAULT_WARPS = 4
#: Largest head_dim of an 8-warp module: 3 stages of 128 tokens fill 192 KB at 128 (the kernel's
#: static_assert; 256 would need 256 KB).
WARPS8_MAX_HEAD_DIM = 128
MAX_GROUP_SIZE = 16       # query heads per kv head: the 16 rows of one mma tile
ENGINE_DTYPES = ("float16", "bfloat16")
ROUTES = ("workqueue", "workqueue_host", "buckets", "split", "cluster")
# cuda.h: CUlaunchAttributeID of programmatic dependent launch (cuLaunchKernelEx).
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
#: Compute capability (major) with programmatic dependent launch (griddepcontrol).
PDL_MIN_MAJOR = 9
# cuda.h CUfunction_attribute values set on the cluster kernels.
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
CUDA_DEV_ATTR_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97  # cudaDevAttrMaxSharedMemoryPerBlockOptin
LOG2E = 1.4426950408889634


def kernels_dir() -> Path:
    """kernels/ at the repository root (src layout), or $PERSISTENTKV_KERNELS."""
    import os

    env = os.environ.get("PERSISTENTKV_KERNELS")
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "kernels"
    require((path / KERNEL_FILE).is_file(),
            f"kernel source {path / KERNEL_FILE} not found (set PERSISTENTKV_KERNELS to the kernels/ folder)")
    return path


def stage_tokens(warps: int) -> int:
    """Tokens per pipeline stage of a ``warps``-warp module (the kernel's TILE: 16 per warp)."""
    return 16 * warps


def min_chunk_tiles_for(warps: int) -> int:
    """Default smallest work item, in planner tiles: one pipeline stage (2 tiles = 64 tokens at
    4 warps, 4 tiles = 128 tokens at 8); a smaller item leaves warps of its CTA without tokens."""
    return stage_tokens(warps) // planner.TILE_TOKENS


def warps_unsupported(spec: AttentionSpec, warps: int) -> list[str]:
    """Reasons a ``warps``-warp module cannot be built for ``spec`` (empty when it can)."""
    if isinstance(warps, bool) or warps not in ENGINE_WARPS:
        return [f"warps must be one of {', '.join(map(str, ENGINE_WARPS))}, got {warps!r}"]
    if warps == 8 and spec.head_dim > WARPS8_MAX_HEAD_DIM:
        return [f"warps=8 needs head_dim <= {WARPS8_MAX_HEAD_DIM} (3 stages of 128 tokens), "
                f"got head_dim {spec.head_dim}; use warps=4"]
    return []


#: Macros of kernels/pkv_decode.cu that the engine sets itself (from the spec and ``warps``).
_ENGINE_MACROS = ("PKV_HEAD_DIM", "PKV_BF16", "PKV_WARPS")
_DEFINE = re.compile(r"PKV_[A-Z0-9_]+(=[A-Za-z0-9_]+)?")


def check_defines(defines) -> tuple[str, ...]:
    """``defines`` as a tuple of ``PKV_NAME[=VALUE]`` strings, or a PKVError saying what is wrong.
    They are development switches of the kernel source (e.g. ``PKV_TRACE=1``,
    benchmarks/trace_cta.py), never the macros the engine derives from the spec."""
    require(not isinstance(defines, str), f"defines must be a sequence of PKV_NAME[=VALUE], not the string {defines!r}")
    defines = tuple(defines)
    for d in defines:
        require(isinstance(d, str) and _DEFINE.fullmatch(d) is not None,
                f"define {d!r} is not PKV_NAME or PKV_NAME=VALUE (letters, digits, underscores)")
        require(d.split("=")[0] not in _ENGINE_MACROS,
                f"define {d!r} sets {d.split('=')[0]}, which the engine derives from the spec and warps")
    return defines


def with_pool_code(defines: tuple[str, ...], pool_units: int) -> tuple[str, ...]:
    """``defines`` plus PKV_POOL=1 when the engine pools (pool_units > 0): the shipped kernel has
    no pool code (it would read a pooled item's own range only), so a pooled engine builds its
    own module; a define that turns the pool code off is refused."""
    if not pool_units:
        return defines
    require(all(d.split("=")[0] != "PKV_POOL" or d == "PKV_POOL=1" for d in defines),
            f"pool needs the kernel's pool code (PKV_POOL=1); defines {defines!r} turn it off")
    return defines if "PKV_POOL=1" in defines else (*defines, "PKV_POOL=1")


def compile_options(spec: AttentionSpec, warps: int = DEFAULT_WARPS, defines=()) -> tuple[str, ...]:
    """Compiler options for the module of ``spec``'s (dtype, head_dim) with ``warps`` warps per
    decode CTA and the development ``defines`` (check_defines); shared with compile-kernels. The
    default module gets no PKV_WARPS define, so its options (and CuPy's cache key) are those of
    before the option existed."""
    reasons = warps_unsupported(spec, warps)
    require(not reasons, "; ".join(reasons))
    options = ("-std=c++17", "--use_fast_math", f"-DPKV_HEAD_DIM={spec.head_dim}",
               f"-DPKV_BF16={1 if spec.dtype == 'bfloat16' else 0}")
    options = options if warps == DEFAULT_WARPS else (*options, f"-DPKV_WARPS={warps}")
    return (*options, *(f"-D{d}" for d in check_defines(defines)))


def engine_unsupported(spec: AttentionSpec, warps: int = DEFAULT_WARPS) -> list[str]:
    """Reasons our kernels cannot run ``spec`` with ``warps``-warp CTAs (empty when they can);
    checked before any compile or launch."""
    reasons = warps_unsupported(spec, warps)
    if spec.dtype not in ENGINE_DTYPES:
        reasons.append(f"the PersistentKV kernels take {'/'.join(ENGINE_DTYPES)}, not {spec.dtype}")
    if spec.group_size > MAX_GROUP_SIZE:
        reasons.append(f"group size G={spec.group_size} exceeds {MAX_GROUP_SIZE} query heads per kv head")
    if spec.layout != "NHD":
        reasons.append(f"layout {spec.layout} is not NHD")
    return reasons


def gpu_reasons() -> list[str]:
    """Why the engine cannot run on this machine ([] when torch + CUDA + CuPy are usable)."""
    return cuda_reasons() or missing_module("cupy")


_PTR, _I32, _I64, _F32 = ctypes.c_uint64, ctypes.c_int32, ctypes.c_int64, ctypes.c_float


def _arg_layout(name: str, fields: list) -> type:
    """A ctypes Structure holding one kernel's parameter values (``fields``: (name, ctype) in the
    kernel's order) followed by ``_params``, the array of pointers to each value that
    cuLaunchKernel takes. Field names are the kernel's parameter names, so ``run`` rewrites its
    per-call values by name (``args.q = ...``)."""
    layout = type(name, (ctypes.Structure,), {"_fields_": [*fields, ("_params", ctypes.c_void_p * len(fields))]})
    layout.offsets = np.array([getattr(layout, f).offset for f, _ in fields], dtype=np.uint64)
    layout.params_offset = layout._params.offset
    # run() writes a decode block's per-call values with two struct stores (_PTRS at 0, _STRIDES6
    # at strides_offset), so those fields must lie where the stores put them
    names = [f for f, _ in fields]
    if "kv_sp" in names:
        assert names[:4] == ["q", "k", "v", "out"] and layout.q.offset == 0, name
        stride_names = [n for n, _ in _STRIDES]
        start = names.index("kv_sp")
        assert names[start:start + 6] == stride_names, name
        layout.strides_offset = layout.kv_sp.offset
        assert [getattr(layout, n).offset for n in stride_names] == [layout.strides_offset + 8 * i for i in range(6)]
    return layout


#: run()'s per-call stores into a decode parameter block: the q, k, v, out pointers (its first four
#: fields) and the six strides (kv_sp, kv_st, q_sb, q_sh, o_sb, o_sh; at layout.strides_offset)
_PTRS = struct.Struct("<4Q")
_STRIDES6 = struct.Struct("<6q")


def _arg_block(layout: type, *values):
    """A kernel's parameter block, kept alive between launches (a ``layout`` instance).

    cuLaunchKernel copies parameter values at launch (and a graph capture records them), so one
    block per launch is built at plan time and ``run`` only rewrites the per-call values (tensor
    pointers and strides) before handing ``block.address`` (its pointer array) to the driver: a
    launch costs two struct stores (pointers, strides) and one driver call. Building a block is
    one Structure and one vector add for the pointer array (a plan builds two of them on its host
    path)."""
    block = layout(*values)
    base = ctypes.addressof(block)
    np.add(layout.offsets, base, out=np.frombuffer(block._params, dtype=np.uint64))
    block.address = base + layout.params_offset
    return block


_DECODE_COMMON = [("q", _PTR), ("k", _PTR), ("v", _PTR), ("out", _PTR), ("kv_indices", _PTR)]
_STRIDES = [(n, _I64) for n in ("kv_sp", "kv_st", "q_sb", "q_sh", "o_sb", "o_sh")]
#: pkv_decode / pkv_decode_fused (kernels/pkv_decode.cu, PKV_DECODE_ARGS)
_DECODE_FIELDS = [
    *_DECODE_COMMON, ("items", _PTR), ("num_items", _PTR), ("part_o", _PTR), ("part_lse", _PTR),
    ("counters", _PTR), ("slot_offset", _I32), ("num_kv_heads", _I32), ("group_size", _I32), ("log2_page", _I32),
    *_STRIDES, ("scale_log2", _F32), ("early", _I32)]
DecodeArgs = _arg_layout("DecodeArgs", _DECODE_FIELDS)
_TMAP = ctypes.c_uint64 * 16  # a CUtensorMap: 128 opaque bytes
#: the same with PKV_TMA=1 (development): the K and V tensor maps after them, by value
DecodeArgsTMA = _arg_layout("DecodeArgsTMA", [*_DECODE_FIELDS, ("tmk", _TMAP), ("tmv", _TMAP)])
#: pkv_decode_cluster{C} (PKV_CLUSTER_ARGS): the same per-call names as DecodeArgs
ClusterArgs = _arg_layout("ClusterArgs", [
    *_DECODE_COMMON, ("seq_lens", _PTR), ("kv_indptr", _PTR), ("num_kv_heads", _I32), ("group_size", _I32),
    ("log2_page", _I32), *_STRIDES, ("scale_log2", _F32)])
#: pkv_merge
MergeArgs = _arg_layout("MergeArgs", [
    ("groups", _PTR), ("part_o", _PTR), ("part_lse", _PTR), ("out", _PTR), ("group_size", _I32),
    ("o_sb", _I64), ("o_sh", _I64)])
#: pkv_plan
PlanArgs = _arg_layout("PlanArgs", [
    ("seq_lens", _PTR), ("kv_indptr", _PTR), ("batch", _I32), ("num_kv_heads", _I32), ("target_items", _I32),
    ("min_chunk_tiles", _I32), ("chunk_rule", _I32), ("max_items", _I32), ("pool_units", _I32), ("items", _PTR),
    ("num_items", _PTR)])


class _LaunchAttribute(ctypes.Structure):  # cuda.h CUlaunchAttribute
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int32 * 16)]


class _LaunchConfig(ctypes.Structure):  # cuda.h CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


NO_LAUNCH_EX = "pdl needs cuLaunchKernelEx, which this CUDA driver lacks (CUDA 12 drivers have it)"

# cuda.h enums of cuTensorMapEncodeTiled (PKV_TMA, development)
_TMAP_DTYPE = {"float16": 6, "bfloat16": 9}   # CU_TENSOR_MAP_DATA_TYPE_FLOAT16 / _BFLOAT16
_TMAP_SWIZZLE_128B, _TMAP_L2_PROMOTION_256B = 3, 3


@lru_cache(maxsize=None)
def _encode_tiled():
    """libcuda's cuTensorMapEncodeTiled with its argument types (None where the driver lacks it)."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    except (OSError, AttributeError):
        return None
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def kv_tensor_map(ptr: int, dtype: str, head_dim: int, num_kv_heads: int, page_size: int, num_pages: int,
                  page_stride: int, token_stride: int) -> Any:
    """The 4-d tensor map (head_dim, Hkv, page_size, pages) of one K or V cache whose strides are
    given in elements, with 64-element x 1 x 16-token x 1 boxes and the 128-byte swizzle that
    kernels/pkv_decode.cu's PKV_TMA path reads (swz_tma). Returns the 128 bytes as a ctypes array."""
    fn = _encode_tiled()
    require(fn is not None, "PKV_TMA needs cuTensorMapEncodeTiled, which this CUDA driver lacks")
    esize = 2
    raw = ctypes.create_string_buffer(128 + 64)
    at = (ctypes.addressof(raw) + 63) & ~63  # the map must be 64-byte aligned
    dims = (ctypes.c_uint64 * 4)(head_dim, num_kv_heads, page_size, num_pages)
    strides = (ctypes.c_uint64 * 3)(head_dim * esize, token_stride * esize, page_stride * esize)
    box = (ctypes.c_uint32 * 4)(64, 1, 16, 1)
    ones = (ctypes.c_uint32 * 4)(1, 1, 1, 1)
    status = fn(at, _TMAP_DTYPE[dtype], 4, ptr, dims, strides, box, ones, 0, _TMAP_SWIZZLE_128B,
                _TMAP_L2_PROMOTION_256B, 0)
    require(status == 0, f"cuTensorMapEncodeTiled returned CUresult {status} (dims {list(dims)}, strides "
                         f"{list(strides)} bytes)")
    return _TMAP.from_buffer_copy(ctypes.string_at(at, 128))


@lru_cache(maxsize=None)
def _launch_kernel_ex():
    """libcuda's cuLaunchKernelEx, or None where the driver lacks it (looked up once per process).

    It has no ``argtypes``: its only caller, _PDLLaunch, passes ctypes objects of the C types
    (a byref to a CUlaunchConfig, two c_void_p, None for the extra array), which ctypes hands over
    as they are; declared argument types would convert each of them again on every call (~0.7 us
    of a run() on the development CPU)."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    return fn


class _PDLLaunch:
    """cuLaunchKernelEx with programmatic stream serialization, its config built once per launch;
    a call rewrites only the stream."""

    __slots__ = ("launch_ex", "attr", "config", "config_ref", "function", "params")

    def __init__(self, function: int, grid: int, threads: int, smem: int, params: int):
        self.launch_ex = _launch_kernel_ex()
        require(self.launch_ex is not None, NO_LAUNCH_EX)
        self.attr = _LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
        self.attr.value[0] = 1
        self.config = _LaunchConfig(grid, 1, 1, threads, 1, 1, smem, None, ctypes.pointer(self.attr), 1)
        self.config_ref = ctypes.byref(self.config)  # kept: the config lives as long as this launch
        self.function = ctypes.c_void_p(function)
        self.params = ctypes.c_void_p(params)

    def __call__(self, stream: int) -> None:
        self.config.hStream = stream
        status = self.launch_ex(self.config_ref, self.function, self.params, None)
        if status != 0:
            raise PKVError(f"cuLaunchKernelEx (programmatic dependent launch) returned CUresult {status}")


@dataclass
class _Module:
    functions: dict
    smem_bytes: int
    threads: int
    tile: int
    stages: int
    occupancy: int
    #: cluster size -> CUfunction of pkv_decode_cluster{C}
    cluster_functions: dict = field(default_factory=dict)
    #: why C = 16 cannot be launched here (setting the non-portable attribute failed), or None
    cluster16_error: str | None = None
    #: largest dynamic shared memory a CTA may opt in to on this device
    smem_optin: int = 0
    #: CUfunction -> dynamic shared memory it is currently allowed (raised on demand)
    smem_allowed: dict = field(default_factory=dict)
    #: the CuPy RawModule (its globals, e.g. pkv_trace of a PKV_TRACE build)
    raw: Any = None


def _set_function_attribute(function: int, attribute: int, value: int) -> None:
    """cuFuncSetAttribute through CuPy's driver wrapper, or libcuda directly if CuPy lacks it."""
    from cupy_backends.cuda.api import driver

    setter = getattr(driver, "funcSetAttribute", None)
    if setter is not None:
        setter(function, attribute, value)
        return
    libcuda = ctypes.CDLL("libcuda.so.1")
    status = libcuda.cuFuncSetAttribute(ctypes.c_void_p(function), ctypes.c_int(attribute), ctypes.c_int(value))
    if status != 0:
        raise RuntimeError(f"cuFuncSetAttribute({attribute}, {value}) returned CUresult {status}")


@lru_cache(maxsize=None)
def _load_module(dtype: str, head_dim: int, warps: int, device: int, defines: tuple[str, ...] = ()) -> _Module:
    import cupy

    spec = AttentionSpec(num_qo_heads=1, num_kv_heads=1, head_dim=head_dim, dtype=dtype)
    source = (kernels_dir() / KERNEL_FILE).read_text()
    options = compile_options(spec, warps, defines)
    cuda_path = cupy.cuda.get_cuda_path()
    if cuda_path:
        options += (f"-I{Path(cuda_path) / 'include'}",)
    with cupy.cuda.Device(device):
        try:
            module = cupy.RawModule(code=source, options=options)
            module.compile()
        except Exception as exc:
            raise PKVError(f"compiling {KERNEL_FILE} for {dtype}/head_dim {head_dim}/warps {warps} failed: "
                           f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__}") from exc
        raw = module.get_global("pkv_config")
        config = cupy.ndarray((5,), dtype=cupy.int32, memptr=raw).get().tolist()
        smem, threads, tile, stages, plan_tile = config
        require(plan_tile == planner.TILE_TOKENS,
                f"kernel planner tile {plan_tile} != plan.TILE_TOKENS {planner.TILE_TOKENS}")
        require(tile == stage_tokens(warps), f"kernel tile {tile} != {stage_tokens(warps)} tokens for {warps} warps")
        smem_optin = int(cupy.cuda.runtime.deviceGetAttribute(CUDA_DEV_ATTR_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, device))
        require(smem <= smem_optin, f"the {warps}-warp kernel for head_dim {head_dim} needs {smem} B of shared "
                                    f"memory per CTA; this device allows {smem_optin}")
        functions = {}
        cluster_names = [f"pkv_decode_cluster{c}" for c in planner.CLUSTER_SIZES]
        for name in ("pkv_decode", "pkv_decode_fused", "pkv_merge", "pkv_plan", *cluster_names):
            kernel = module.get_function(name)
            if name.startswith("pkv_decode"):
                kernel.max_dynamic_shared_size_bytes = smem
            functions[name] = kernel.kernel  # keeps the module loaded; .ptr is the CUfunction
        from cupy_backends.cuda.api import driver

        occupancy = driver.occupancyMaxActiveBlocksPerMultiprocessor(functions["pkv_decode_fused"].ptr, threads, smem)
        _ensure_launch_api()
        cluster16_error = None
        try:  # 16 CTAs per cluster exceeds the portable 8: the function must opt in
            _set_function_attribute(functions["pkv_decode_cluster16"].ptr,
                                    CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
        except Exception as exc:
            cluster16_error = (f"cluster size 16 is unavailable: setting NON_PORTABLE_CLUSTER_SIZE_ALLOWED failed "
                               f"({str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}); "
                               f"use cluster_size <= 8")
    cluster_functions = {c: functions[f"pkv_decode_cluster{c}"].ptr for c in planner.CLUSTER_SIZES}
    return _Module(functions, smem, threads, tile, stages, max(1, occupancy), cluster_functions, cluster16_error,
                   smem_optin, {ptr: smem for ptr in cluster_functions.values()}, module)


@dataclass
class _Launch:
    kind: str          # decode | fused | merge | plan | cluster
    grid: int
    args: Any          # parameter block (_arg_block); per-call values are rewritten by run()
    function: int = 0  # CUfunction
    threads: int = 0
    smem: int = 0
    pdl: Any = None    # a _PDLLaunch when this launch uses programmatic dependent launch


def _ensure_launch_api():
    from cupy_backends.cuda.api import driver

    require(hasattr(driver, "launchKernel"), "this CuPy has no cupy_backends.cuda.api.driver.launchKernel")


@dataclass
class DevicePlan:
    """Device-side metadata of one step; holds every buffer its launches touch.

    items:       int32 [max_items, 8] on the device (row|head<<16, lo, hi, split|nsplit<<16, page_base, pool_lo,
                 pool_hi, 0)
    num_items:   int32 [1] device count (GPU-planned) or None
    part_o/lse:  float32 partial states [slots, G, D] / [slots, G]
    counters:    int32 [2 * B * Hkv], zero between launches: per (row, kv head) its fused merge's arrivals,
                 then its pool's cursor
    packed:      int32 [2B + 1 + pages], seq_lens | kv_indptr | kv_indices (GPU-planned and cluster routes)

    ``view(name)`` returns any of these. A GPU-planned plan keeps them all in one device tensor,
    ``buffers['workspace']`` (one allocation on the host path of a step; the views are made when
    asked for, since each costs microseconds of host time), beside ``upload`` (what one pinned
    copy uploaded: ``packed`` and the counters' zeros). Route ``cluster`` holds only ``packed``
    (= ``upload``); its host equivalent is plan.plan_cluster. ``engine`` is the DecodeEngine that
    planned it, whose module its launches run on.
    """

    route: str
    spec: AttentionSpec
    batch_size: int
    launches: list
    buffers: dict = field(default_factory=dict)
    host_plan: planner.Plan | None = None
    #: recomputes the host plan this device plan is equal to (for counters; never on the hot path)
    _host_equivalent: Any = None
    #: the items were written before the kernel that precedes the next decode launch, so a PDL
    #: launch may read them before griddepcontrol.wait (False after plan and replan_device until
    #: a decode launch has followed)
    early_ok: bool = False
    #: warps per CTA of the module that planned it (its launches run only on that module)
    warps: int = DEFAULT_WARPS
    #: name -> (first int32 element of buffers['workspace'], element count, shape, dtype or None for
    #: int32) of the views made on demand
    regions: dict = field(default_factory=dict)
    #: builds ``regions`` at the first view() (the table costs ~1 us, and a step's hot path never
    #: asks for a view)
    _make_regions: Any = field(default=None, repr=False, compare=False)
    engine: Any = field(default=None, repr=False, compare=False)
    #: pages the block table addresses (Batch.num_pages): the cache passed to run() must hold them
    num_pages: int = 0

    def __post_init__(self):
        #: what run() launches, in order (the GPU planner's launch is plan()'s and replan_device()'s)
        self.run_launches = tuple(l for l in self.launches if l.kind != "plan")

    @property
    def num_launches(self) -> int:
        return len(self.run_launches)

    def view(self, name: str):
        """The named buffer (``items``, ``num_items``, ``counters``, ``part_o``, ``part_lse``,
        ``packed``, ...) as a tensor on the device, or a PKVError naming those this plan has."""
        if name in self.buffers:
            return self.buffers[name]
        if self._make_regions is not None:
            self.regions, self._make_regions = self._make_regions(), None
        require(name in self.regions, f"a {self.route} plan has no buffer {name!r}; it has "
                                      f"{', '.join(sorted({*self.buffers, *self.regions}))}")
        start, count, shape, dtype = self.regions[name]
        flat = self.buffers["workspace"][start:start + count]
        return (flat if dtype is None else flat.view(dtype)).view(shape)

    def counters(self) -> dict:
        """Workload counters (plan.StepCounters) of this step; computed on demand on the host."""
        host = self.host_plan if self.host_plan is not None else self._host_equivalent()
        counters = host.counters().to_dict()
        if "upload" in self.buffers:  # GPU-planned and cluster: what one copy uploaded
            counters["h2d_bytes"] = int(self.buffers["upload"].numel() * 4)
        return counters


class DecodeEngine:
    """Our decode kernels for one AttentionSpec on one CUDA device."""

    def __init__(self, spec: AttentionSpec, device: int | None = None, target_items: int | None = None,
                 min_chunk_tiles: int | None = None, warps: int = DEFAULT_WARPS, pdl: bool | None = None,
                 early_kv: bool = True, pool: float = 0.0, defines=()):
        defines = check_defines(defines)
        require(isinstance(early_kv, bool), f"early_kv must be True or False, got {early_kv!r}")
        #: the fused queue's pool share, in sixteenths (plan.pooled_items; 0: every item owns its range)
        self.pool_units = planner.check_pool(pool)
        defines = with_pool_code(defines, self.pool_units)
        reasons = engine_unsupported(spec, warps) + gpu_reasons()
        if reasons:
            raise PKVError("; ".join(reasons))
        require(pdl is None or isinstance(pdl, bool), f"pdl must be None (auto), True or False, got {pdl!r}")
        import torch

        self.spec = spec
        self.warps = warps
        self.torch = torch
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None else device)
        #: development switches of the kernel source (check_defines); () in every shipped use
        self.defines = defines
        self.module = _load_module(spec.dtype, spec.head_dim, warps, self.device.index, defines)
        props = torch.cuda.get_device_properties(self.device)
        #: PKV_TMA=1 (development): decode launches load K/V by TMA through per-cache tensor maps
        self.tma = any(d.split("=")[0] == "PKV_TMA" and d != "PKV_TMA=0" for d in defines)
        require(not self.tma or (props.major >= 9 and spec.head_dim == 128 and spec.page_size >= 16),
                "PKV_TMA needs sm_90+, head_dim 128 and page_size >= 16")
        self._tmaps: dict = {}
        self.num_sms = props.multi_processor_count
        self.capability = (props.major, props.minor)
        require(not pdl or props.major >= PDL_MIN_MAJOR,
                f"pdl needs programmatic dependent launch (compute capability >= {PDL_MIN_MAJOR}.0); this device is "
                f"{props.major}.{props.minor}")
        has_api = _launch_kernel_ex() is not None if pdl is not False else False
        require(not pdl or has_api, NO_LAUNCH_EX)
        #: auto (None): on where both the device (sm_90+) and the driver (cuLaunchKernelEx) have it
        self.pdl = (props.major >= PDL_MIN_MAJOR and has_api) if pdl is None else pdl
        #: under PDL, also load the first stages' K/V (all but each item's last page) before the wait
        self.early_kv = early_kv and self.pdl
        #: the decode launches' ``early`` word once a plan's items may be read early (kernel Params)
        self._early_bits = 3 if self.early_kv else 1
        # Balanced queue: one wave of resident CTAs (occupancy read from the compiled kernel).
        self.target_items = int(target_items or self.module.occupancy * self.num_sms)
        self.min_chunk_tiles = int(min_chunk_tiles or min_chunk_tiles_for(warps))
        self.torch_dtype = torch.float16 if spec.dtype == "float16" else torch.bfloat16
        from cupy_backends.cuda.api import driver

        self._driver = driver
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._raw_stream = raw if raw is not None else (
            lambda index: torch.cuda.current_stream(index).cuda_stream)
        self.scale_log2 = float(np.float32(LOG2E / math.sqrt(spec.head_dim)))
        self._log2_page = int(math.log2(spec.page_size))
        self._plan_function = self.module.functions["pkv_plan"].ptr
        self._last_check = None
        self._device_index = self.device.index

    # ------------------------------------------------------------------ planning
    def _i32(self, array) -> Any:
        """An int32 device copy of ``array`` through pinned memory, asynchronous on the current
        stream: no synchronisation (a pageable ``.to(device)`` waits for the stream, ~14 us on the
        H200 host). torch's caching host allocator keeps the staging block until the copy is done,
        and the kernels that read the copy run after it on the same stream."""
        torch = self.torch
        host = np.ascontiguousarray(array, dtype=np.int32)
        staging = torch.empty(host.shape, dtype=torch.int32, pin_memory=True)
        staging.numpy()[...] = host
        dev = torch.empty(host.shape, dtype=torch.int32, device=self.device)
        dev.copy_(staging, non_blocking=True)
        return dev

    def _workspace(self, slots: int, batch_size: int) -> dict:
        torch, spec = self.torch, self.spec
        G, D = spec.group_size, spec.head_dim
        return {
            "part_o": torch.empty((max(slots, 1), G, D), dtype=torch.float32, device=self.device),
            "part_lse": torch.empty((max(slots, 1), G), dtype=torch.float32, device=self.device),
            "counters": torch.zeros((2 * batch_size * spec.num_kv_heads,), dtype=torch.int32, device=self.device),
        }

    def plan(self, batch: Batch, route: str = "workqueue", *, num_splits: int = 32, target_items: int | None = None,
             min_chunk_tiles: int | None = None, cluster_size: int | None = None,
             cluster_smem_bytes: int | None = None, chunk_rule: str = "min") -> DevicePlan:
        """Plan one step: ``num_splits`` for buckets/split; ``target_items`` and ``min_chunk_tiles``
        for the queues (defaults: one wave of resident CTAs, one pipeline stage), and their
        ``chunk_rule`` (plan.balanced_chunk_tiles: ``"min"``, the smallest chunk that fits the
        waves, or ``"closed"``, the closed form of v2-v6, kept for side-by-side benches); ``cluster_size``
        (default plan.default_cluster_size) and ``cluster_smem_bytes`` (dynamic shared memory per
        CTA, default the kernel's; ask for more than half an SM's to force one CTA per SM) for
        the cluster route."""
        # A serving loop pays this method's host time before every step's first launch: the
        # checks build their messages only when they fail.
        if route not in ROUTES:
            raise PKVError(f"unknown route {route!r}; expected one of {', '.join(ROUTES)}")
        if batch.spec != self.spec:
            raise PKVError(f"batch spec {batch.spec} != engine spec {self.spec}")
        if route == "cluster":
            return self._plan_cluster(batch, cluster_size, cluster_smem_bytes)
        if cluster_size is not None or cluster_smem_bytes is not None:
            raise PKVError(f"cluster_size and cluster_smem_bytes apply to route cluster, not {route}")
        target = int(target_items or self.target_items)
        min_chunk = int(min_chunk_tiles or self.min_chunk_tiles)
        if chunk_rule not in planner.CHUNK_RULES:
            raise PKVError(f"chunk_rule must be one of {', '.join(planner.CHUNK_RULES)}, got {chunk_rule!r}")
        if route == "workqueue":
            return self._plan_device(batch, target, min_chunk, chunk_rule)
        require(chunk_rule == "min" or route == "workqueue_host",
                f"chunk_rule applies to the workqueue routes, not {route}")
        if route == "workqueue_host":
            host = planner.plan_workqueue(batch, target_items=target, min_chunk_tiles=min_chunk, fused_merge=True,
                                          chunk_rule=chunk_rule)
        elif route == "buckets":
            host = planner.plan_buckets(batch, num_splits=int(num_splits))
        else:
            host = planner.plan_split(batch, num_splits=int(num_splits))
        return self._upload(batch, host, route)

    def _decode_launch(self, kind: str, grid: int, kv_indices: int, items: int, num_items: int, part_o: int,
                       part_lse: int, counters: int, slot_offset: int) -> _Launch:
        """A decode launch over the given device addresses (its q/k/v/out and strides are run()'s)."""
        spec, mod = self.spec, self.module
        args = _arg_block(DecodeArgsTMA if self.tma else DecodeArgs, 0, 0, 0, 0, kv_indices, items, num_items,
                          part_o, part_lse, counters,
                          slot_offset, spec.num_kv_heads, spec.group_size, self._log2_page, 0, 0, 0, 0, 0, 0,
                          self.scale_log2, 0)
        function = mod.functions["pkv_decode_fused" if kind == "fused" else "pkv_decode"].ptr
        pdl = _PDLLaunch(function, grid, mod.threads, mod.smem_bytes, args.address) if self.pdl else None
        return _Launch(kind, grid, args, function, mod.threads, mod.smem_bytes, pdl=pdl)

    def _upload(self, batch: Batch, host: planner.Plan, route: str) -> DevicePlan:
        items8 = np.zeros((max(host.num_items, 1), 8), dtype=np.int32)
        if route == "workqueue_host" and self.pool_units:  # the pooled queue: ranges and pools as the kernel reads them
            pooled = planner.pooled_items(host.items, batch.seq_lens, self.pool_units, host.params["target_items"])
            items8[:host.num_items, :4], items8[:host.num_items, 5:7] = pooled[:, :4], pooled[:, 4:]
        else:  # no pool: the items as planned, pool words (0, 0)
            items8[:host.num_items, :4] = host.items
        items8[:host.num_items, 4] = batch.kv_indptr[host.items[:, 0] & 0xFFFF]
        buffers = self._workspace(host.num_items, batch.batch_size)
        buffers.update(items=self._i32(items8), kv_indices=self._i32(batch.kv_indices if batch.kv_indices.size else [0]),
                       merge_groups=self._i32(host.merge_groups if host.merge_groups.size else np.zeros((1, 4))))
        ptr = {name: t.data_ptr() for name, t in buffers.items()}
        launches = []
        for launch in host.launches:
            if launch.kind == "merge":
                args = _arg_block(MergeArgs, ptr["merge_groups"] + 16 * launch.start, ptr["part_o"], ptr["part_lse"],
                                  0, self.spec.group_size, 0, 0)
                launches.append(_Launch("merge", launch.size, args, self.module.functions["pkv_merge"].ptr,
                                        self.module.threads, 0))
            elif launch.size:
                launches.append(self._decode_launch(launch.kind, launch.size, ptr["kv_indices"], ptr["items"], 0,
                                                    ptr["part_o"], ptr["part_lse"], ptr["counters"], launch.start))
        return DevicePlan(route, self.spec, batch.batch_size, launches, buffers, host, warps=self.warps, engine=self,
                          num_pages=batch.num_pages)

    def _plan_device(self, batch: Batch, target_items: int, min_chunk: int, chunk_rule: str = "min") -> DevicePlan:
        """The GPU-planned queue. Its host work is what a serving loop pays before each step's
        first launch, so it makes one device allocation, one asynchronous copy from pinned memory
        (torch's caching host allocator keeps the staging block until the copy is done), no fill
        kernel and no tensor views, then launches the planner. Layout of the workspace, in int32
        elements, each part 16-byte aligned (items are read as int4, states as float4):
            seq_lens | indptr | indices (one 0 when empty) | counters (zeros) || num_items | items | states
        everything before || uploaded in that one copy; the planner writes num_items and items,
        the decode kernel the float32 states (part_o [max_items, G, D], then part_lse [max_items, G])."""
        B, nnz, spec, torch = batch.batch_size, int(batch.kv_indices.size), self.spec, self.torch
        if B > GPU_PLAN_MAX_ROWS:
            raise PKVError(f"batch size {B} exceeds the GPU planner's {GPU_PLAN_MAX_ROWS} rows; "
                           f"use route workqueue_host")
        max_items = planner.max_workqueue_items(B, spec.num_kv_heads, target_items)
        G, D = spec.group_size, spec.head_dim
        n_packed = 2 * B + 1 + nnz
        o_counters = (n_packed + 4) & ~3  # at least one index slot, rounded up to 4 ints
        n_counters = 2 * B * spec.num_kv_heads  # per (row, kv head): merge arrivals, pool cursor
        o_num = (o_counters + n_counters + 3) & ~3
        o_items = o_num + 4
        o_states = o_items + 8 * max_items
        n_part_o = max_items * G * D
        staging = torch.empty((o_num,), dtype=torch.int32, pin_memory=True)
        host = staging.numpy()
        np.concatenate((batch.seq_lens, batch.kv_indptr, batch.kv_indices), out=host[:n_packed])
        host[n_packed:] = 0
        workspace = torch.empty((o_states + n_part_o + max_items * G,), dtype=torch.int32, device=self.device)
        upload = workspace[:o_num]
        upload.copy_(staging, non_blocking=True)
        base = workspace.data_ptr()
        items, num_items, states = base + 4 * o_items, base + 4 * o_num, base + 4 * o_states
        plan_args = _arg_block(PlanArgs, base, base + 4 * B, B, spec.num_kv_heads, target_items, min_chunk,
                               planner.CHUNK_RULES.index(chunk_rule), max_items, self.pool_units, items, num_items)
        launches = [_Launch("plan", 1, plan_args, self._plan_function, PLAN_THREADS, 0),
                    self._decode_launch("fused", max_items, base + 4 * (2 * B + 1), items, num_items, states,
                                        states + 4 * n_part_o, base + 4 * o_counters, 0)]
        f32 = torch.float32

        def regions() -> dict:
            return {"packed": (0, n_packed, (n_packed,), None),
                    "kv_indices": (2 * B + 1, max(nnz, 1), (max(nnz, 1),), None),
                    "counters": (o_counters, n_counters, (n_counters,), None),
                    "num_items": (o_num, 1, (1,), None), "items": (o_items, 8 * max_items, (max_items, 8), None),
                    "part_o": (o_states, n_part_o, (max_items, G, D), f32),
                    "part_lse": (o_states + n_part_o, max_items * G, (max_items, G), f32)}

        plan = DevicePlan("workqueue", spec, B, launches, {"workspace": workspace, "upload": upload}, None,
                          warps=self.warps, _make_regions=regions, engine=self, num_pages=batch.num_pages,
                          _host_equivalent=lambda: planner.plan_workqueue(
                              batch, target_items=target_items, min_chunk_tiles=min_chunk, chunk_rule=chunk_rule))
        self._launch(launches[0], self._stream())
        return plan

    def cluster_size_for(self, batch_size: int, cluster_size: int | None = None) -> int:
        """The cluster route's C for ``batch_size`` rows on this device, or a one-line PKVError."""
        major, minor = self.capability
        require(major >= planner.CLUSTER_MIN_MAJOR,
                f"route cluster needs thread-block clusters (compute capability >= {planner.CLUSTER_MIN_MAJOR}.0); "
                f"this device is {major}.{minor}")
        C = (planner.default_cluster_size(batch_size, self.spec.num_kv_heads, self.num_sms) if cluster_size is None
             else planner.check_cluster_size(cluster_size))
        require(not (C == 16 and self.module.cluster16_error), str(self.module.cluster16_error))
        return C

    def _cluster_smem(self, function: int, smem_bytes: int | None) -> int:
        mod = self.module
        smem = mod.smem_bytes if smem_bytes is None else int(smem_bytes)
        require(mod.smem_bytes <= smem <= max(mod.smem_bytes, mod.smem_optin),
                f"cluster_smem_bytes must be in [{mod.smem_bytes}, {mod.smem_optin}] (the kernel's need, the device's "
                f"opt-in limit), got {smem}")
        if smem > mod.smem_allowed.get(function, mod.smem_bytes):
            _set_function_attribute(function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
            mod.smem_allowed[function] = smem
        return smem

    def _plan_cluster(self, batch: Batch, cluster_size: int | None, smem_bytes: int | None) -> DevicePlan:
        spec, B = self.spec, batch.batch_size
        C = self.cluster_size_for(B, cluster_size)
        function = self.module.cluster_functions[C]
        smem = self._cluster_smem(function, smem_bytes)
        packed = np.concatenate([batch.seq_lens, batch.kv_indptr, batch.kv_indices]).astype(np.int32)
        dev = self._i32(packed)
        buffers = {"packed": dev, "upload": dev, "kv_indices": dev[2 * B + 1:] if batch.kv_indices.size else dev[:1]}
        base = dev.data_ptr()
        args = _arg_block(ClusterArgs, 0, 0, 0, 0, buffers["kv_indices"].data_ptr(), base, base + 4 * B,
                          spec.num_kv_heads, spec.group_size, self._log2_page, 0, 0, 0, 0, 0, 0, self.scale_log2)
        launch = _Launch("cluster", B * spec.num_kv_heads * C, args, function, self.module.threads, smem)
        return DevicePlan("cluster", spec, B, [launch], buffers, None,
                          lambda: planner.plan_cluster(batch, C, self.module.tile), warps=self.warps, engine=self,
                          num_pages=batch.num_pages)

    def occupancy(self, launch: _Launch) -> int:
        """CTAs of ``launch``'s kernel resident per SM at its shared memory (clusters aside)."""
        return int(self._driver.occupancyMaxActiveBlocksPerMultiprocessor(launch.function, launch.threads, launch.smem))

    def replan_device(self, plan: DevicePlan) -> None:
        """Re-run the GPU planner of a ``workqueue`` plan (after the caller updated its lengths in
        ``plan.view('packed')`` on the device): no host work, graph-capturable. A ``cluster``
        plan needs none (its kernel reads the lengths at launch): a no-op."""
        require(plan.route in ("workqueue", "cluster"),
                "only GPU-planned (workqueue) and cluster plans follow lengths changed on the device")
        if plan.route == "workqueue":
            self._launch(plan.launches[0], self._stream())
            plan.early_ok = False

    def _launch(self, launch: _Launch, stream: int) -> None:
        if launch.pdl is not None:
            launch.pdl(stream)
            return
        self._driver.launchKernel(launch.function, launch.grid, 1, 1, launch.threads, 1, 1, launch.smem,
                                  stream, launch.args.address, 0)

    # ------------------------------------------------------------------ running
    def _stream(self) -> int:
        """The raw pointer of torch's current stream on this device (the capture stream inside
        torch.cuda.graph)."""
        return self._raw_stream(self._device_index)

    def _check(self, q, k, v, out, plan: DevicePlan) -> None:
        """Refuse what the kernels cannot run right (run() calls it when its key changes)."""
        spec = self.spec
        expect_q = (plan.batch_size, spec.num_qo_heads, spec.head_dim)
        require(tuple(q.shape) == expect_q, f"q has shape {tuple(q.shape)}, expected {expect_q}")
        require(tuple(out.shape) == expect_q, f"out has shape {tuple(out.shape)}, expected {expect_q}")
        for name, t in (("q", q), ("k_cache", k), ("v_cache", v), ("out", out)):
            require(t.dtype == self.torch_dtype, f"{name} has dtype {t.dtype}, expected {self.torch_dtype}")
            require(t.device == self.device, f"{name} is on {t.device}, expected {self.device}")
        kv_shape = (spec.page_size, spec.num_kv_heads, spec.head_dim)
        require(tuple(k.shape[1:]) == kv_shape and k.dim() == 4,
                f"k_cache has shape {tuple(k.shape)}, expected [num_pages, {', '.join(map(str, kv_shape))}]")
        require(tuple(v.shape) == tuple(k.shape) and v.stride() == k.stride(),
                "v_cache must have k_cache's shape and strides")
        require(k.shape[0] >= plan.num_pages,
                f"k_cache has {k.shape[0]} pages; the plan's block table addresses page ids up to "
                f"{plan.num_pages - 1} (the batch's num_pages is {plan.num_pages})")
        require(k.stride(3) == 1 and k.stride(2) == spec.head_dim and k.stride(1) % 8 == 0 and k.stride(0) % 8 == 0,
                f"k_cache strides {k.stride()} unsupported: need [*, 8k, head_dim, 1]")
        for name, t in (("q", q), ("out", out)):
            require(t.stride(2) == 1 and t.stride(1) % 2 == 0 and t.stride(0) % 2 == 0,
                    f"{name} strides {t.stride()} unsupported: need an even-strided [B, H, D] with contiguous D")
        require(q.data_ptr() % 4 == 0 and out.data_ptr() % 4 == 0 and k.data_ptr() % 16 == 0
                and v.data_ptr() % 16 == 0, "q and out must be 4-byte and k/v 16-byte aligned")
        esize, ks = k.element_size(), k.stride()
        require(ks[0] * esize < 2**32 and ((spec.page_size - 1) * ks[1] + spec.head_dim) * esize < 2**32,
                f"k_cache strides {ks} unsupported: the kernels address a page and a token row in it with "
                f"32-bit byte offsets (page stride x {esize} B must stay below 4 GiB)")

    def run(self, q, cache, plan: DevicePlan, out, check: bool = True) -> None:
        """out[B, Hq, D] = decode attention of q[B, Hq, D] over cache = (K, V), each [pages, P, Hkv, D]."""
        k, v = cache
        q_ptr, k_ptr, v_ptr, o_ptr = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
        qs, os_, ks = q.stride(), out.stride(), k.stride()
        if check:  # full checks only when anything they look at differs from the last call's
            key = (q.shape, qs, q.dtype, q.device, k.shape, ks, k.dtype, k.device, v.shape, v.stride(), v.dtype,
                   v.device, out.shape, os_, out.dtype, out.device, plan.batch_size, plan.num_pages,
                   (q_ptr | o_ptr) & 3, (k_ptr | v_ptr) & 15)
            if key != self._last_check:
                self._check(q, k, v, out, plan)
                self._last_check = key
        stream = self._raw_stream(self._device_index)
        maps = self._kv_maps(k, v, k_ptr, v_ptr, ks) if self.tma else None
        for launch in plan.run_launches:
            args = launch.args
            if launch.kind == "merge":
                args.out = o_ptr
                args.o_sb, args.o_sh = os_[0], os_[1]
                self._launch(launch, stream)
                continue
            _PTRS.pack_into(args, 0, q_ptr, k_ptr, v_ptr, o_ptr)
            _STRIDES6.pack_into(args, args.strides_offset, ks[0], ks[1], qs[0], qs[1], os_[0], os_[1])
            if maps is not None and launch.kind != "cluster":
                args.tmk, args.tmv = maps
            if launch.pdl is not None:
                args.early = self._early_bits if plan.early_ok else 0
                launch.pdl(stream)
                plan.early_ok = True
            else:
                self._launch(launch, stream)

    def _kv_maps(self, k, v, k_ptr: int, v_ptr: int, ks) -> tuple:
        """(K map, V map) of this cache (PKV_TMA), made once per (pointers, pages, strides)."""
        key = (k_ptr, v_ptr, k.shape[0], ks[0], ks[1])
        maps = self._tmaps.get(key)
        if maps is None:
            spec = self.spec
            if len(self._tmaps) >= 4096:
                self._tmaps.clear()
            maps = self._tmaps[key] = tuple(
                kv_tensor_map(ptr, spec.dtype, spec.head_dim, spec.num_kv_heads, spec.page_size, k.shape[0], ks[0],
                              ks[1]) for ptr in (k_ptr, v_ptr))
        return maps

    def device_items(self, plan: DevicePlan, pools: bool = False) -> np.ndarray:
        """The plan's items as the kernels see them (host copy, int32 [n, 4]; with ``pools``, [n, 6]:
        plan.pooled_items' layout, the pool's token range after the item words); synchronises."""
        require(plan.route != "cluster", "a cluster plan has no item buffer (its kernel computes the ranges of "
                                         "plan.plan_cluster); use plan.counters() or plan.plan_cluster")
        items = plan.view("items").cpu().numpy()
        n = plan.host_plan.num_items if plan.host_plan is not None else int(plan.view("num_items").item())
        return np.concatenate([items[:n, :4], items[:n, 5:7]], axis=1) if pools else items[:n, :4]


_ENGINES: dict = {}


def engine_for(spec: AttentionSpec, **options) -> DecodeEngine:
    """A cached engine per (spec, options) on the current device."""
    key = (spec, tuple(sorted(options.items())))
    engine = _ENGINES.get(key)
    if engine is None:
        engine = _ENGINES[key] = DecodeEngine(spec, **options)
    return engine
