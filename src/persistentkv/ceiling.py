"""Bandwidth ceilings measured in the same process as the timings they scale.

read ceiling   kernels/ceiling.cu: a grid-stride kernel of 16-byte loads that XOR-reduces what it
               reads (so no load can be dropped), timed over 4 GiB and over 16 GiB; the ceiling
               is the median GB/s of the largest size (:func:`ceiling_gbps`). The read kernel has
               a fixed part of its own (launch, ramp-up, tail: ~12 us on one H200, the intercept
               of its time over 1-32 GiB), 1.2 % of a 4 GiB read but 0.3 % of a 16 GiB one
               (benchmarks/NOTES.md, "The read ceiling's fixed cost"). The 4 GiB samples are kept
               (rows) and logged with the least-squares fit over both sizes (:func:`stream_fit`),
               which is not the ceiling: with five samples per size, a slow spell of the smaller
               size tilts the slope (one run's fit gave 4614 GB/s and 83 us fixed, against 4516
               and 12 from 120 samples over 1-32 GiB). A GPU without room for the second size
               gets the median of the first (logged).
copy ceiling   a device-to-device copy (torch ``dst.copy_(src)``, cudaMemcpyAsync D2D);
               bytes moved = read + written = 2 x buffer size.

Each repeat is timed with CUDA events after warm-up launches; the rows (measure.rows.ceiling_rows:
backend ``read-ceiling`` / ``copy-ceiling``, protocol ``ceiling``, kv_bytes = bytes moved) go into
every GPU output. A GPU
command measures both ceilings before its cases and again after them (the later repeats numbered
on from the earlier ones), and the run's read ceiling, ``read_ceiling_gbps`` of every row, is the
higher of the two measurements (:func:`run_read_gbps`): what the GPU streamed when it streamed
best in that run. Measured once, at the start, it varied between 4146 and 4504 GB/s from run to
run on one H200 while the attention kernels' times did not, and one run's kernels read faster
than it (benchmarks/NOTES.md, "Where v15 stands").

The kernel is compiled with CuPy (RawModule, NVRTC) and launched on torch's current stream, on
memory torch owns (shared through DLPack, no copy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from .errors import PKVError, require

KERNEL_FILE = "ceiling.cu"
KERNEL_NAME = "read_ceiling"
READ_BYTES = 4 * 2**30      # >= 4 GB: 70x the H200's 60 MB L2, so L2 hits are negligible
STREAM_BYTES = 16 * 2**30   # the ceiling's size: the read kernel's fixed part is ~0.3 % of it
COPY_BYTES = 2 * 2**30      # per buffer; 4 GiB moved per copy
THREADS = 256
BLOCKS_PER_SM = 8           # 2048 resident threads per SM on sm_80/sm_90


def kernels_dir() -> Path:
    """The repository's kernels/ folder (src/persistentkv/ceiling.py -> ../../kernels)."""
    return Path(__file__).resolve().parents[2] / "kernels"


def kernel_source() -> str:
    path = kernels_dir() / KERNEL_FILE
    require(path.is_file(), f"{path} is missing (the read-ceiling kernel lives in the repository's kernels/)")
    return path.read_text()


@dataclass(frozen=True)
class CeilingSample:
    backend: str        # read-ceiling | copy-ceiling
    repeat: int
    bytes_moved: int
    time_us: float

    @property
    def gbps(self) -> float:
        return self.bytes_moved / (self.time_us * 1e-6) / 1e9 if self.time_us > 0 else math.nan


_MODULE_CACHE: dict = {}


def _read_kernel():
    import cupy

    if "read" not in _MODULE_CACHE:
        module = cupy.RawModule(code=kernel_source(), options=("--std=c++17",))
        _MODULE_CACHE["read"] = module.get_function(KERNEL_NAME)
    return _MODULE_CACHE["read"]


def cupy_stream(torch_stream, cupy_module=None):
    """A CuPy stream on ``torch_stream`` (no new stream: launches inside it go where torch's work
    goes, captured graphs included). CuPy 14 supersedes ``cupy.cuda.ExternalStream`` (deprecated)
    with ``Stream.from_external`` over the CUDA stream protocol (``__cuda_stream__``), which torch
    streams implement; older CuPy, or a stream without the protocol, gets ``ExternalStream`` with
    its device id. ``cupy_module``: the module to use (tests pass a stand-in), else cupy."""
    if cupy_module is None:
        import cupy as cupy_module
    from_external = getattr(cupy_module.cuda.Stream, "from_external", None)
    if from_external is not None and hasattr(torch_stream, "__cuda_stream__"):
        return from_external(torch_stream)
    return cupy_module.cuda.ExternalStream(torch_stream.cuda_stream, torch_stream.device_index)


def measure_read(device, nbytes: int = READ_BYTES, repeats: int = 5, warmup: int = 2) -> list[CeilingSample]:
    """``repeats`` timed launches of the read kernel over ``nbytes`` (a multiple of 16)."""
    import cupy
    import torch

    require(nbytes >= 16 and nbytes % 16 == 0, f"read size must be a positive multiple of 16 bytes, got {nbytes}")
    kernel = _read_kernel()
    buf = torch.full((nbytes,), 0x5A, dtype=torch.uint8, device=device.device)
    sink = torch.zeros(1, dtype=torch.int32, device=device.device)
    src_c, sink_c = cupy.from_dlpack(buf), cupy.from_dlpack(sink)
    grid = (device.sm_count * BLOCKS_PER_SM,)
    n_vec = np.uint64(nbytes // 16)
    stream = cupy_stream(torch.cuda.current_stream(device.device))
    samples = []
    with stream:
        for r in range(warmup + repeats):
            start, end = device.event(), device.event()
            start.record()
            kernel(grid, (THREADS,), (src_c, n_vec, sink_c))
            end.record()
            device.synchronize()
            if r >= warmup:
                samples.append(CeilingSample("read-ceiling", r - warmup, nbytes, start.elapsed_ms(end) * 1e3))
    del buf, sink, src_c, sink_c
    return samples


def measure_copy(device, nbytes: int = COPY_BYTES, repeats: int = 5, warmup: int = 2) -> list[CeilingSample]:
    import torch

    src = torch.full((nbytes,), 0x33, dtype=torch.uint8, device=device.device)
    dst = torch.empty_like(src)
    samples = []
    for r in range(warmup + repeats):
        start, end = device.event(), device.event()
        start.record()
        dst.copy_(src)
        end.record()
        device.synchronize()
        if r >= warmup:
            samples.append(CeilingSample("copy-ceiling", r - warmup, 2 * nbytes, start.elapsed_ms(end) * 1e3))
    del src, dst
    return samples


def median_gbps(samples: list[CeilingSample], backend: str = "read-ceiling") -> float:
    values = [s.gbps for s in samples if s.backend == backend and math.isfinite(s.gbps)]
    return float(np.median(values)) if values else math.nan


def fit_stream(nbytes, times_us) -> tuple[float, float]:
    """(GB/s of the least-squares slope, intercept in us) of time = intercept + bytes / rate;
    a PKVError below two distinct sizes."""
    x, y = np.asarray(nbytes, dtype=float), np.asarray(times_us, dtype=float)
    require(len(set(x.tolist())) >= 2, "fit_stream needs samples at two or more sizes")
    slope, intercept = np.polyfit(x, y, 1)  # us per byte, us
    require(slope > 0, f"read times do not grow with the bytes read (slope {slope:.3g} us/B)")
    return float(1e-3 / slope), float(intercept)  # 1/slope bytes per us = 1e-3/slope GB/s


def stream_fit(samples: list[CeilingSample]) -> tuple[float, float] | None:
    """(rate GB/s, fixed us) of the read-ceiling samples when they span two or more sizes, else None."""
    reads = [s for s in samples if s.backend == "read-ceiling" and math.isfinite(s.gbps)]
    if len({s.bytes_moved for s in reads}) < 2:
        return None
    return fit_stream([s.bytes_moved for s in reads], [s.time_us for s in reads])


def ceiling_gbps(samples: list[CeilingSample]) -> float:
    """The read ceiling of one measurement: the median GB/s of its read-ceiling samples at the
    largest size among them (NaN without samples)."""
    reads = [s for s in samples if s.backend == "read-ceiling" and math.isfinite(s.gbps)]
    if not reads:
        return math.nan
    largest = max(s.bytes_moved for s in reads)
    return median_gbps([s for s in reads if s.bytes_moved == largest])


def run_read_gbps(phases) -> float:
    """The run's read ceiling from the samples of each of its ceiling measurements (``phases``: one
    list of samples per measurement): the highest :func:`ceiling_gbps`, NaN when no phase has one."""
    rates = [m for m in (ceiling_gbps(list(p)) for p in phases) if math.isfinite(m)]
    return max(rates) if rates else math.nan


def renumbered(samples, first: int) -> list[CeilingSample]:
    """``samples`` with their repeats moved on to start at ``first`` (a later phase of one run)."""
    return [replace(s, repeat=s.repeat + first) for s in samples]


def measure_ceilings(device, repeats: int = 5, warmup: int = 2, read_bytes: int = READ_BYTES,
                     copy_bytes: int = COPY_BYTES, stream_bytes: int | None = STREAM_BYTES,
                     log=print) -> tuple[list[CeilingSample], dict[str, str]]:
    """(samples, {backend: reason}) - a ceiling that cannot be measured gives a reason, not a crash.
    The read kernel runs over ``read_bytes`` and then ``stream_bytes`` (None: the first size only);
    the ceiling is the larger size's median (:func:`ceiling_gbps`). A second size that does not fit
    in memory is skipped, logged, and the first size's median stands."""
    samples: list[CeilingSample] = []
    failures: dict[str, str] = {}
    for backend, fn, nbytes in (("read-ceiling", measure_read, read_bytes), ("copy-ceiling", measure_copy, copy_bytes)):
        try:
            samples += fn(device, nbytes, repeats, warmup)
        except ImportError as exc:
            failures[backend] = f"cupy cannot be imported ({exc})" if "cupy" in str(exc) else str(exc)
        except PKVError as exc:
            failures[backend] = str(exc)
        except Exception as exc:
            failures[backend] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            device.empty_cache()
    if "read-ceiling" not in failures and stream_bytes and stream_bytes != read_bytes:
        try:
            first = 1 + max((x.repeat for x in samples if x.backend == "read-ceiling"), default=-1)
            samples += renumbered(measure_read(device, stream_bytes, repeats, warmup), first)
        except Exception as exc:  # most likely out of memory; the first size still gives a ceiling
            device.empty_cache()
            log(f"read-ceiling over {stream_bytes / 2**30:g} GiB: not measured ({type(exc).__name__}: "
                f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}); the ceiling is the "
                f"{read_bytes / 2**30:g} GiB median")
    for backend in ("read-ceiling", "copy-ceiling"):
        if backend in failures:
            log(f"{backend}: not measured ({failures[backend]})")
        elif backend == "read-ceiling" and (fit := stream_fit(samples)) is not None:
            small = median_gbps([x for x in samples if x.bytes_moved == read_bytes])
            log(f"read-ceiling: {ceiling_gbps(samples):.0f} GB/s over {stream_bytes / 2**30:g} GiB (median of "
                f"{repeats}; {read_bytes / 2**30:g} GiB: {small:.0f} GB/s; least squares over both: "
                f"{fit[0]:.0f} GB/s + {fit[1]:.1f} us fixed)")
        else:
            log(f"{backend}: {median_gbps(samples, backend):.0f} GB/s (median of {repeats})")
    return samples, failures
