"""The decode step's one-row projections and its K/V append as our own kernels (kernels/step_ops.cu).

    y = gemv(x, w)                              # F.linear(x, w) for x [1, K]
    a = gemv_silu_mul(h, gate_up)               # silu(h gate^T) * (h up^T), one kernel
    append_kv(k_flat, v_flat, slots, k, v)      # both index_copy_ calls of a layer, one kernel, which
                                                # lets a PDL-launched attention after it start at its entry
    append_kv(k_flat, v_flat, slots, k, v, k_scale, v_scale)   # into an FP8 e4m3 cache: x / scale[h]
                                                # rounded to nearest even, saturating at +-448
                                                # (fp8.quantize is the spec, bit for bit)

Why: at B = 1 on an H200, cuBLAS reads the projections' weights at 0.55 (o_proj 4096 x 4096) to
0.92 (gate_up, lm_head) of their bytes' read time, adds split-K reduce kernels (108 us per step),
and the step runs a separate SiLU-and-mul (113 us) and two index_copy_ per layer (146 us).

Design and napkin math (the kernel file's header has the device side):

* A projection of one row (T = 1, a B = 1 decode step) is a stream of W's bytes (Llama-3-8B:
  15.0 GB per step, x is K x 2 bytes, at most 28 KiB), so the kernel is shaped by bytes in flight. Little's law on an H200:
  4.5 TB/s x ~1.5 us = 6.8 MB in flight, 52 KiB per SM over 132 SMs.
* A warp owns a pair of rows (gemv: 2p and 2p+1; silu: gate p and up I+p) and each lane keeps
  :data:`UNROLL` 16-byte chunks of both rows in flight: 32 x 2 x 4 x 16 B = 4 KiB per warp, so
  >= 13 warps per SM cover the latency. The kernels' launch bound (256 threads, 2 blocks per SM:
  <= 128 registers) keeps at least 16 resident; :data:`TARGET_WARPS_PER_SM` = 32 warps per SM
  of work is what the split aims at, measured against 16 (benchmarks/runs/gemv_tune_739ebad:
  the B=1 step's projections 0.985x of 16's time on Llama-3-8B, 0.935x on the 70B shard).
* When the pairs alone give fewer warps than that, ``split`` warps share a pair's K (reduced in
  shared memory inside the block): :func:`gemv_shape`. No split across blocks (no second kernel,
  no atomics), so every output is written once, in a fixed summation order.

Everything is checked on the host from shapes, strides, dtypes and pointers before a launch
(:func:`gemv_unsupported`, :func:`append_kv_unsupported`: reasons, [] when the kernel takes it;
:func:`launch_gemv` and :func:`launch_append_kv` launch without checking again, for a caller that
checked, as llama.Kernels does); the launches go on torch's current stream
(persistentkv.launch.launch_kernel), outputs are torch allocations, and nothing reads the device,
so a CUDA graph captures them. The kernels compile through CuPy (RawModule, NVRTC;
persistentkv.launch.load_cuda_module) on first use, one module per device holding every entry
point. CuPy is imported only when a kernel launches, after every check.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..errors import PKVError, require
from ..launch import current_raw_stream, kernels_dir, launch_kernel, load_cuda_module

KERNEL_FILE = "step_ops.cu"
#: dtypes of the gemv entry points (``pkv_gemv_<dtype>_t<T>``).
DTYPES = ("float16", "bfloat16")
#: Rows of x a gemv takes: one. The kernel is a template over T, but T = 4 (the B = 4 step) lost
#: to cuBLAS in measure-e2e (benchmarks/NOTES.md, "Tried and rejected"; T = 2, 3 were never run
#: by any configured target), so only T = 1 is instantiated and larger T goes to F.linear.
MAX_ROWS = 1
#: Chunk steps a lane keeps in flight per row (-DPKV_GEMV_UNROLL): 2 rows x 4 x 16 B = 128 B per
#: lane, 4 KiB per warp.
UNROLL = 4
#: Warps of a full gemv block (-DPKV_GEMV_THREADS = 32 x this, the kernels' launch bound).
BLOCK_WARPS = 8
#: Blocks per SM the launch bound guarantees (-DPKV_GEMV_MIN_BLOCKS: <= 65536 / (256 x 2) = 128
#: registers per thread; ptxas reports 72-124 on sm_90).
MIN_BLOCKS_PER_SM = 2
#: Warps of work per SM the split aims at: twice what the launch bound keeps resident (16 x 4 KiB =
#: 64 KiB per SM in flight against Little's 52 KiB), so the SMs stay full while blocks retire;
#: measured against 16 in benchmarks/runs/gemv_tune_739ebad (module docstring).
TARGET_WARPS_PER_SM = 32
VECTOR_BYTES = 16
#: Elements per 16-byte chunk of W and x (both 2-byte dtypes).
CHUNK_ELEMENTS = 8
WARP = 32
APPEND_THREADS = 256
#: append_kv's grid cap in blocks per SM (a grid-stride loop covers the rest).
APPEND_BLOCKS_PER_SM = 8
_INT32_MAX = 2**31 - 1


def compile_options() -> tuple[str, ...]:
    """The options kernels/step_ops.cu compiles with (CuPy here, nvcc in the tests)."""
    return ("--std=c++17", f"-DPKV_GEMV_UNROLL={UNROLL}", f"-DPKV_GEMV_THREADS={WARP * BLOCK_WARPS}",
            f"-DPKV_GEMV_MIN_BLOCKS={MIN_BLOCKS_PER_SM}", f"-DPKV_APPEND_THREADS={APPEND_THREADS}")


def gemv_entry(dtype: str, rows: int, silu: bool) -> str:
    """The entry point of one (op, dtype, T): ``pkv_gemv[_silu_mul]_<dtype>_t<T>``."""
    return f"pkv_gemv{'_silu_mul' if silu else ''}_{dtype}_t{rows}"


def append_e4m3_entry(dtype: str) -> str:
    """The FP8 append of fp16/bf16 rows: ``pkv_append_kv_<dtype>_e4m3``."""
    return f"pkv_append_kv_{dtype}_e4m3"


#: Every extern "C" entry point of kernels/step_ops.cu.
ENTRY_POINTS = tuple(gemv_entry(d, t, s) for s in (False, True) for d in DTYPES
                     for t in range(1, MAX_ROWS + 1)) + ("pkv_append_kv",) + tuple(append_e4m3_entry(d)
                                                                                  for d in DTYPES)


def kernel_path() -> Path:
    path = kernels_dir() / KERNEL_FILE
    require(path.is_file(), f"{path} is missing (the step's kernels live in kernels/ with the others)")
    return path


def kernel_source() -> str:
    return kernel_path().read_text()


def cubin_name(arch: str) -> str:
    """The ahead-of-time build's cubin of this module (rule kernels, persistentkv compile-kernels)."""
    return f"pkv_step_ops_{arch}.cubin"


def compile_report(archs: list[str], out_dir: Path) -> list[dict]:
    """kernels/step_ops.cu compiled with nvcc for every arch to ``out_dir`` (no GPU needed), as the
    compile report's rows (persistentkv.kernel_build.compile_module): ``head_dim`` 0, ``warps`` a
    gemv block's (BLOCK_WARPS), ``dtype`` from each entry point's name ("" for pkv_append_kv,
    which takes any; the FP8 appends' names carry their source dtype)."""
    from ..kernel_build import compile_module

    rows = []
    for arch in archs:
        for row in compile_module(arch, kernels_dir() / KERNEL_FILE, Path(out_dir) / cubin_name(arch),
                                  list(compile_options()), KERNEL_FILE):
            dtype = next((d for d in DTYPES if f"_{d}_" in row["kernel"]), "")
            rows.append({**row, "dtype": dtype, "head_dim": 0, "warps": BLOCK_WARPS})
    return rows


# -- the launch shape (pure) ----------------------------------------------------------------------
@dataclass(frozen=True)
class GemvShape:
    """How a gemv launch covers its rows: block b's warp w takes pair ``b * pairs_per_block +
    w // split`` and K slice ``w % split`` (chunks ``lane + 32 (slice + split i)``).

    split:           warps sharing one pair's K (1, 2, 4, 8)
    pairs_per_block: pairs of a block; a block has ``split * pairs_per_block`` warps
    blocks:          ceil(pairs / pairs_per_block): only the last block may hold idle warps
    """

    split: int
    pairs_per_block: int
    blocks: int

    @property
    def warps(self) -> int:
        return self.split * self.pairs_per_block

    @property
    def threads(self) -> int:
        return WARP * self.warps


@lru_cache(maxsize=None)
def gemv_shape(pairs: int, k: int, sm_count: int) -> GemvShape:
    """The launch shape of a gemv over ``pairs`` row pairs of ``k`` columns on ``sm_count`` SMs.

    1. ``split``: the smallest power of two (<= BLOCK_WARPS) giving pairs x split >=
       TARGET_WARPS_PER_SM x sm_count warps (32 x 132 = 4224 on an H200), as long as each warp's
       slice still gives every lane one whole unrolled step (k / 8 >= 32 x split x UNROLL: at most
       4 at K = 4096, 8 at K >= 8192, 1 at K = 1024).
    2. ``pairs_per_block``: BLOCK_WARPS / split (256-thread blocks), halved while the grid has fewer
       blocks than SMs (a tiny N spreads over SMs rather than filling a few).

    Worked numbers on 132 SMs (pairs = N / 2; gate_up: I):

    ======================  ======  =====  ==============  ======
    shape (N x K)           pairs   split  pairs/block     blocks
    ======================  ======  =====  ==============  ======
    qkv 6144 x 4096         3072    2      4               768
    o 4096 x 4096           2048    4      2               1024
    gate_up 2x14336 x 4096  14336   1      8               1792
    down 4096 x 14336       2048    4      2               1024
    lm_head 128256 x 4096   64128   1      8               8016
    70B/8 qkv 1280 x 8192   640     8      1               640
    70B/8 o 8192 x 1024     4096    1      8               512
    70B/8 gate_up 2x3584    3584    2      4               896
    70B/8 down 8192 x 3584  4096    2      4               1024
    24 x 4096               12      4      1               12
    ======================  ======  =====  ==============  ======

    o_proj: 2048 pairs are 15.5 warps per SM, short of 32, so four warps share each row pair's K
    (8192 warps, each lane 4 chunks = one unrolled step). The 70B shard's QKV (1280
    rows) would be 4.8 warps per SM, 20 KiB in flight per SM; split 8 makes it 39 warps of work per SM.
    """
    require(int(pairs) >= 1, f"a gemv needs at least one row, got {pairs} row pairs")
    require(int(k) >= CHUNK_ELEMENTS and int(k) % CHUNK_ELEMENTS == 0, f"K = {k} must be a positive multiple of 8")
    require(int(sm_count) >= 1, f"the launch shape needs the device's SM count, got {sm_count}")
    pairs, chunks, want = int(pairs), int(k) // CHUNK_ELEMENTS, TARGET_WARPS_PER_SM * int(sm_count)
    split = 1
    while 2 * split <= BLOCK_WARPS and pairs * split < want and chunks >= WARP * 2 * split * UNROLL:
        split *= 2
    per_block = BLOCK_WARPS // split
    while per_block > 1 and -(-pairs // per_block) < sm_count:
        per_block //= 2
    return GemvShape(split, per_block, -(-pairs // per_block))


def append_blocks(chunks: int, sm_count: int) -> int:
    """append_kv's grid: one thread per 16-byte chunk of k and v (``chunks`` = 2 T x row chunks),
    at most APPEND_BLOCKS_PER_SM x SMs blocks (a decode step has <= 256 x 2 x 128 = 64 Ki chunks:
    256 blocks, under the cap of 1056 on 132 SMs)."""
    require(int(chunks) >= 1 and int(sm_count) >= 1, f"append_kv needs chunks and SMs, got {chunks}, {sm_count}")
    return min(-(-int(chunks) // APPEND_THREADS), APPEND_BLOCKS_PER_SM * int(sm_count))


# -- the checks (host only: shapes, strides, dtypes, pointers) -----------------------------------
# Each check is a handful of tensor attribute reads (~3 us for a gemv, in an eager step's every
# projection); the messages are built only for a refusal.
def _dtype_name(t) -> str:
    return str(t.dtype).removeprefix("torch.")


def _device_reasons(what: str, tensors: dict) -> list[str]:
    if all(t.is_cuda for t in tensors.values()):
        first = next(iter(tensors.values())).device
        if all(t.device == first for t in tensors.values()):
            return []
        return [f"{what} needs every tensor on one device, got {', '.join(f'{n}: {t.device}' for n, t in tensors.items())}"]
    off = [f"{name} is on {t.device}" for name, t in tensors.items() if not t.is_cuda]
    return [f"{what} runs on CUDA tensors only ({', '.join(off)})"]


def _aligned_reasons(what: str, tensors: dict) -> list[str]:
    return [f"{what}: {name} is not 16-byte aligned (data_ptr % 16 = {t.data_ptr() % VECTOR_BYTES})"
            for name, t in tensors.items() if t.data_ptr() % VECTOR_BYTES]


def gemv_unsupported(x, w, silu: bool = False) -> list[str]:
    """Why :func:`gemv` (``silu``: :func:`gemv_silu_mul`) cannot take ``x`` and ``w``; [] when it can.

    Parameters
    ----------
    x : torch.Tensor
        [1, K] (T = MAX_ROWS), float16 or bfloat16, contiguous, 16-byte aligned, on CUDA.
    w : torch.Tensor
        [N, K] (``silu``: [2I, K], gate rows then up rows) of x's dtype, contiguous, aligned, on
        x's device; K % 8 == 0.

    Returns
    -------
    list of str
        Every reason that applies, each naming the value at fault.
    """
    import torch

    what = "gemv_silu_mul" if silu else "gemv"
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
        return [f"{what} takes torch tensors, got {type(x).__name__} and {type(w).__name__}"]
    tensors = {"x": x, "w": w}
    reasons = _device_reasons(what, tensors)
    if x.dtype != w.dtype or x.dtype not in _torch_dtypes():
        reasons.append(f"{what} takes x and w of one dtype in {', '.join(DTYPES)}, got {_dtype_name(x)} and "
                       f"{_dtype_name(w)}")
    if x.dim() != 2 or w.dim() != 2:
        return reasons + [f"{what} takes x [T, K] and w [N, K], got {list(x.shape)} and {list(w.shape)}"]
    (rows, k), (n, kw) = x.shape, w.shape
    if not 1 <= rows <= MAX_ROWS:
        reasons.append(f"{what} takes {MAX_ROWS} row of x (T = {MAX_ROWS}), got T = {rows}")
    if k != kw:
        reasons.append(f"{what}: x has K = {k} columns, w has {kw}")
    if k % CHUNK_ELEMENTS or k == 0:
        reasons.append(f"{what}: K = {k} is not a positive multiple of 8 (16-byte chunks)")
    if n == 0 or (silu and n % 2):
        reasons.append(f"{what}: w has {n} rows; {'gate|up needs an even, positive count' if silu else 'none'}")
    if n > _INT32_MAX or k > _INT32_MAX:
        reasons.append(f"{what}: N = {n} or K = {k} exceeds int32")
    for name, t in tensors.items():
        if not t.is_contiguous():
            reasons.append(f"{what}: {name} is not contiguous (strides {list(t.stride())})")
    return reasons + _aligned_reasons(what, tensors)


@lru_cache(maxsize=None)
def _torch_dtypes() -> tuple:
    import torch

    return tuple(getattr(torch, d) for d in DTYPES)


def append_kv_unsupported(k_flat, v_flat, slots, k, v, k_scale=None, v_scale=None) -> list[str]:
    """Why :func:`append_kv` cannot take these tensors; [] when it can.

    Parameters
    ----------
    k_flat, v_flat : torch.Tensor
        [S, Hkv, D], one dtype, the same strides, rows contiguous (strides [r, D, 1]): k's dtype,
        or float8_e4m3fn (an FP8 cache; k and v then float16 or bfloat16, D % 8 == 0).
    slots : torch.Tensor
        int64 [T], contiguous (values are not checked: the host never reads them).
    k, v : torch.Tensor
        [T, Hkv, D] of one dtype, rows contiguous (the row stride is free: v may be a slice of the
        fused qkv output).
    k_scale, v_scale : torch.Tensor, optional
        An FP8 cache's scales (required there, refused otherwise): contiguous float32 tensors of
        1 (per tensor) or Hkv (per KV head) values, both alike, on the cache's device. Their values
        are not checked (the host never reads them; finite and > 0 is the caller's).

    Every tensor on one CUDA device; a row, every row stride and every pointer a multiple of 16
    bytes.
    """
    import torch

    tensors = {"k_flat": k_flat, "v_flat": v_flat, "slots": slots, "k": k, "v": v}
    if not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        return ["append_kv takes torch tensors"]
    fp8 = k_flat.dtype == torch.float8_e4m3fn
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    reasons = []
    other_fp8 = "float8" in str(k_flat.dtype) and not fp8
    if other_fp8:
        reasons.append(f"append_kv: the cache is {_dtype_name(k_flat)}; e5m2 is not supported (an FP8 cache holds "
                       "float8_e4m3fn codes)")
    elif fp8:
        if k_scale is None or v_scale is None:
            reasons.append("append_kv: an FP8 cache needs k_scale and v_scale (float32 tensors of 1 or Hkv values)")
        elif not all(isinstance(t, torch.Tensor) for t in scales.values()):
            reasons.append(f"append_kv: k_scale and v_scale must be float32 tensors, got {type(k_scale).__name__} and "
                           f"{type(v_scale).__name__}")
        else:
            tensors.update(scales)
    elif k_scale is not None or v_scale is not None:
        reasons.append(f"append_kv: k_scale/v_scale are for an FP8 cache (float8_e4m3fn); this cache is "
                       f"{_dtype_name(k_flat)}")
    reasons = _device_reasons("append_kv", tensors) + reasons
    rows = {"k_flat": k_flat, "v_flat": v_flat, "k": k, "v": v}
    if any(t.dim() != 3 for t in rows.values()) or slots.dim() != 1:
        return reasons + [f"append_kv takes [S, Hkv, D] caches, [T, Hkv, D] k and v and [T] slots, got "
                          f"{', '.join(f'{n} {list(tensors[n].shape)}' for n in ('k_flat', 'v_flat', 'slots', 'k', 'v'))}"]
    if slots.dtype != torch.int64 or not slots.is_contiguous():
        reasons.append(f"append_kv: slots must be contiguous int64, got {_dtype_name(slots)}")
    shape, strides = k_flat.shape, k_flat.stride()
    if v_flat.shape != shape or v_flat.stride() != strides:
        reasons.append(f"append_kv: k_flat {list(shape)} strides {list(strides)} and v_flat "
                       f"{list(v_flat.shape)} strides {list(v_flat.stride())} differ")
    if k.shape != v.shape or k.shape[1:] != shape[1:] or k.shape[0] != slots.shape[0]:
        reasons.append(f"append_kv: k {list(k.shape)}, v {list(v.shape)}, slots {list(slots.shape)} do not match "
                       f"rows of {list(shape[1:])}")
    if fp8:
        if not (k.dtype == v.dtype and k.dtype in _torch_dtypes() and v_flat.dtype == k_flat.dtype):
            reasons.append(f"append_kv: an FP8 cache takes float16 or bfloat16 rows (k and v of one dtype) into "
                           f"float8_e4m3fn k_flat and v_flat, got {', '.join(_dtype_name(t) for t in (k, v, k_flat, v_flat))}")
        if shape[2] % CHUNK_ELEMENTS:
            reasons.append(f"append_kv: D = {shape[2]} is not a multiple of 8 (an FP8 chunk of 8 elements lies in "
                           "one KV head)")
        if "k_scale" in tensors:
            hkv = shape[1]
            for name, t in scales.items():
                if not (t.dtype == torch.float32 and t.dim() <= 1 and t.numel() in (1, hkv)
                        and (t.dim() == 0 or t.stride(0) == 1)):
                    reasons.append(f"append_kv: {name} must be a contiguous float32 tensor of 1 or {hkv} (num_kv_heads) "
                                   f"values, got {_dtype_name(t)} {list(t.shape)}")
            if k_scale.numel() != v_scale.numel():
                reasons.append(f"append_kv: k_scale and v_scale must both be per tensor or both per KV head, got "
                               f"{k_scale.numel()} and {v_scale.numel()} values")
    elif not other_fp8 and not (v_flat.dtype == k.dtype == v.dtype == k_flat.dtype):
        reasons.append(f"append_kv: k, v and the caches must share a dtype, got "
                       f"{', '.join(_dtype_name(t) for t in (k, v, k_flat, v_flat))}")
    for name, t in rows.items():
        row, head, one = t.stride()
        if one != 1 or head != t.shape[2]:
            reasons.append(f"append_kv: {name}'s rows are not contiguous (strides {list(t.stride())})")
        elif row * t.element_size() % VECTOR_BYTES:
            reasons.append(f"append_kv: {name}'s row stride ({row * t.element_size()} bytes) is not a multiple of 16")
    row_bytes = shape[1] * shape[2] * k_flat.element_size()
    src_bytes = shape[1] * shape[2] * k.element_size()
    if row_bytes % VECTOR_BYTES or row_bytes == 0 or src_bytes % VECTOR_BYTES:
        reasons.append(f"append_kv: a row of Hkv x D = {shape[1]} x {shape[2]} is {row_bytes} bytes, "
                       "not a positive multiple of 16")
    elif 2 * k.shape[0] * (src_bytes // VECTOR_BYTES) > _INT32_MAX:
        reasons.append(f"append_kv: {k.shape[0]} rows exceed the kernel's int32 chunk count")
    return reasons + _aligned_reasons("append_kv", rows)


def _require(reasons: list[str]) -> None:
    if reasons:
        raise PKVError("; ".join(reasons))


# -- the launches -------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    import torch

    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


@lru_cache(maxsize=None)
def _module(device_index: int):
    """The compiled kernels/step_ops.cu on one device with every entry point (launch.CudaModule;
    CuPy caches the binary)."""
    return load_cuda_module(kernel_path(), compile_options(), ENTRY_POINTS, device_index)


@lru_cache(maxsize=None)
def _function(device_index: int, name: str) -> int:
    """The CUfunction of entry point ``name`` on one device."""
    return _module(device_index).functions[name].ptr


def _launch(device, name: str, grid: int, threads: int, args: tuple) -> None:
    """One launch of ``name`` on torch's current stream of ``device`` (captured inside a graph);
    ``args``: ctypes values in the kernel's order."""
    import cupy

    function = _function(device.index, name)  # a tensor's device always has its index
    with cupy.cuda.Device(device.index):
        launch_kernel(function, grid, threads, args, current_raw_stream(device.index))


def _pointer(t) -> ctypes.c_uint64:
    return ctypes.c_uint64(t.data_ptr())


def launch_gemv(x, w, silu: bool = False):
    """:func:`gemv` (``silu``: :func:`gemv_silu_mul`) without its checks, for a caller that has
    :func:`gemv_unsupported` empty in hand (Kernels.linear: one check per projection)."""
    import torch

    rows, k = x.shape
    n = w.shape[0] // 2 if silu else w.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    shape = gemv_shape(n if silu else (n + 1) // 2, k, _sm_count(x.device.index))
    _launch(x.device, gemv_entry(_dtype_name(x), rows, silu), shape.blocks, shape.threads,
            (_pointer(x), _pointer(w), _pointer(out), ctypes.c_int32(n), ctypes.c_int32(k // CHUNK_ELEMENTS),
             ctypes.c_int32(shape.split)))
    return out


def launch_append_kv(k_flat, v_flat, slots, k, v, k_scale=None, v_scale=None) -> None:
    """:func:`append_kv` without its checks (the caller has :func:`append_kv_unsupported` empty)."""
    rows = int(k.shape[0])
    if rows == 0:
        return
    if k_scale is not None:  # an FP8 cache: 16-byte chunks of k and v, 8-byte chunks of codes
        row_chunks = k_flat.shape[1] * k_flat.shape[2] // CHUNK_ELEMENTS
        blocks = append_blocks(2 * rows * row_chunks, _sm_count(k.device.index))
        _launch(k.device, append_e4m3_entry(_dtype_name(k)), blocks, APPEND_THREADS,
                (_pointer(k), _pointer(v), _pointer(k_flat), _pointer(v_flat), _pointer(slots), _pointer(k_scale),
                 _pointer(v_scale), ctypes.c_int32(1 if k_scale.numel() > 1 else 0),
                 ctypes.c_int32(k_flat.shape[2] // CHUNK_ELEMENTS), ctypes.c_int32(rows), ctypes.c_int32(row_chunks),
                 ctypes.c_int64(k.stride(0) // CHUNK_ELEMENTS), ctypes.c_int64(v.stride(0) // CHUNK_ELEMENTS),
                 ctypes.c_int64(k_flat.stride(0) // CHUNK_ELEMENTS), ctypes.c_int64(k_flat.shape[0])))
        return
    chunk = VECTOR_BYTES // k_flat.element_size()  # elements per 16-byte chunk of this dtype
    row_chunks = k_flat.shape[1] * k_flat.shape[2] // chunk
    blocks = append_blocks(2 * rows * row_chunks, _sm_count(k.device.index))
    _launch(k.device, "pkv_append_kv", blocks, APPEND_THREADS,
            (_pointer(k), _pointer(v), _pointer(k_flat), _pointer(v_flat), _pointer(slots), ctypes.c_int32(rows),
             ctypes.c_int32(row_chunks), ctypes.c_int64(k.stride(0) // chunk), ctypes.c_int64(v.stride(0) // chunk),
             ctypes.c_int64(k_flat.stride(0) // chunk), ctypes.c_int64(k_flat.shape[0])))


def gemv(x, w):
    """``F.linear(x, w)`` for a few rows: y = x @ w^T, fp32 sums, one rounding.

    Parameters
    ----------
    x : torch.Tensor
        [1, K], float16 or bfloat16, contiguous, 16-byte aligned, CUDA.
    w : torch.Tensor
        [N, K] of x's dtype (F.linear's layout), contiguous, aligned, K % 8 == 0.

    Returns
    -------
    torch.Tensor
        [T, N] in x's dtype (a new torch allocation), written on torch's current stream.

    Raises
    ------
    PKVError
        Naming every constraint x or w breaks (:func:`gemv_unsupported`); checked before CuPy is
        imported. Callers fall back to F.linear.
    """
    _require(gemv_unsupported(x, w))
    return launch_gemv(x, w)


def gemv_silu_mul(x, w):
    """``silu(x @ gate^T) * (x @ up^T)`` for w = [gate | up] (llama.py's fused gate_up).

    The warp that sums gate row j also sums up row I + j; silu(g) * u in fp32, one rounding.

    Parameters
    ----------
    x : torch.Tensor
        [1, K], float16 or bfloat16, contiguous, 16-byte aligned, CUDA.
    w : torch.Tensor
        [2I, K] of x's dtype: gate rows 0 .. I-1, up rows I .. 2I-1; contiguous, aligned, K % 8 == 0.

    Returns
    -------
    torch.Tensor
        [T, I] in x's dtype.

    Raises
    ------
    PKVError
        As :func:`gemv` (and for an odd row count of w).
    """
    _require(gemv_unsupported(x, w, silu=True))
    return launch_gemv(x, w, silu=True)


def append_kv(k_flat, v_flat, slots, k, v, k_scale=None, v_scale=None) -> None:
    """``k_flat[slots] = k`` and ``v_flat[slots] = v`` in one kernel of 16-byte copies; into an
    FP8 cache, the e4m3 codes of ``k / k_scale[h]`` and ``v / v_scale[h]``.

    Parameters
    ----------
    k_flat, v_flat : torch.Tensor
        [S, Hkv, D] cache rows (PagedKV.flat), written in place: k's dtype, or float8_e4m3fn.
    slots : torch.Tensor
        int64 [T] on the device; a slot outside [0, S) is skipped.
    k, v : torch.Tensor
        [T, Hkv, D], rows contiguous (any row stride that is a multiple of 16 bytes).
    k_scale, v_scale : torch.Tensor, optional
        An FP8 cache's scales: float32 [1] (per tensor) or [Hkv] (per KV head) on the device, read
        there at every launch (a captured graph follows new values). The codes are
        ``persistentkv.fp8.quantize(x, scale)`` bit for bit: the exact quotient rounded to the
        nearest e4m3 value, ties to even, saturating at +-448 (never inf or NaN from an overflow).

    Raises
    ------
    PKVError
        Naming every constraint broken (:func:`append_kv_unsupported`); checked before CuPy is
        imported. Callers fall back to index_copy_.
    """
    _require(append_kv_unsupported(k_flat, v_flat, slots, k, v, k_scale, v_scale))
    launch_append_kv(k_flat, v_flat, slots, k, v, k_scale, v_scale)
