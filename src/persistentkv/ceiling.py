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

one-kernel floor   the same read kernel over exactly a case's K/V bytes, in ONE launch per call, cold
               in L2 (the buffer rotated over copies spanning >= cold_l2_factor x L2, as the cases'
               caches are: :func:`cold_copies`), replayed from CUDA graphs of several launches (time
               per launch), the best of a few grid shapes (:data:`FLOOR_BLOCKS_PER_SM`): what one
               kernel that only streams the step's bytes costs, launch, ramp-up and tail included
               (:class:`OneKernelFloor`). The harness times it per case beside the case's backends
               (backend ``one-kernel-floor``, protocol ``kernel``; persistentkv.measure.harness).
               The read ceiling says what the GPU streams at length; the floor says what a step of
               these bytes can cost at best in one kernel, so a kernel row reads as a fraction of it.

The kernel is compiled with CuPy (RawModule, NVRTC; persistentkv.launch.load_cuda_module) and
launched through the driver (persistentkv.launch.launch_kernel) on torch's current stream, on
memory torch owns (its device pointers, no copy).
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from .errors import PKVError, require
from .launch import current_raw_stream, kernels_dir, launch_kernel, load_cuda_module

KERNEL_FILE = "ceiling.cu"
KERNEL_NAME = "read_ceiling"
READ_BYTES = 4 * 2**30      # >= 4 GB: 70x the H200's 60 MB L2, so L2 hits are negligible
STREAM_BYTES = 16 * 2**30   # the ceiling's size: the read kernel's fixed part is ~0.3 % of it
COPY_BYTES = 2 * 2**30      # per buffer; 4 GiB moved per copy
THREADS = 256
BLOCKS_PER_SM = 8           # 2048 resident threads per SM on sm_80/sm_90


#: The options ceiling.cu compiles with.
COMPILE_OPTIONS = ("--std=c++17",)


def kernel_path() -> Path:
    path = kernels_dir() / KERNEL_FILE
    require(path.is_file(), f"{path} is missing (the read-ceiling kernel lives in kernels/ with the others)")
    return path


def kernel_source() -> str:
    return kernel_path().read_text()


@dataclass(frozen=True)
class CeilingSample:
    backend: str        # read-ceiling | copy-ceiling
    repeat: int
    bytes_moved: int
    time_us: float

    @property
    def gbps(self) -> float:
        return self.bytes_moved / (self.time_us * 1e-6) / 1e9 if self.time_us > 0 else math.nan


def _read_function(device_index: int) -> int:
    """The read kernel's CUfunction on CUDA device ``device_index`` (compiled once per device)."""
    return load_cuda_module(kernel_path(), COMPILE_OPTIONS, (KERNEL_NAME,), device_index).functions[KERNEL_NAME].ptr


def _read_kernel():
    """The read kernel as a CuPy RawKernel of the same compiled module, for a caller that launches
    it through CuPy with CuPy arrays (benchmarks/bench_common.PlainRead); the library launches
    :func:`_read_function`'s CUfunction."""
    import cupy

    module = load_cuda_module(kernel_path(), COMPILE_OPTIONS, (), cupy.cuda.runtime.getDevice()).raw
    return module.get_function(KERNEL_NAME)


def _device_index(torch_device) -> int:
    """The index of a torch CUDA device ("cuda" alone: torch's current device)."""
    import torch

    return torch_device.index if torch_device.index is not None else torch.cuda.current_device()


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
    import torch

    require(nbytes >= 16 and nbytes % 16 == 0, f"read size must be a positive multiple of 16 bytes, got {nbytes}")
    index = _device_index(device.device)
    function = _read_function(index)
    buf = torch.full((nbytes,), 0x5A, dtype=torch.uint8, device=device.device)
    sink = torch.zeros(1, dtype=torch.int32, device=device.device)
    args = (ctypes.c_uint64(buf.data_ptr()), ctypes.c_uint64(nbytes // 16), ctypes.c_uint64(sink.data_ptr()))
    grid = device.sm_count * BLOCKS_PER_SM
    stream = current_raw_stream(index)
    samples = []
    for r in range(warmup + repeats):
        start, end = device.event(), device.event()
        start.record()
        launch_kernel(function, grid, THREADS, args, stream)
        end.record()
        device.synchronize()
        if r >= warmup:
            samples.append(CeilingSample("read-ceiling", r - warmup, nbytes, start.elapsed_ms(end) * 1e3))
    del buf, sink
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


# -- the one-kernel floor -----------------------------------------------------------------------
#: Grids the floor tries, in resident blocks per SM (x the SM count, THREADS threads each): one block
#: per SM keeps 8 warps per SM, eight fill every SM (2048 threads); a small step reads fastest with
#: fewer blocks (less ramp-up), a large one with more (more loads in flight). The floor is the best.
FLOOR_BLOCKS_PER_SM = (1, 2, 4, 8)
VECTOR_BYTES = 16           # the read kernel loads uint4
FLOOR_HEADROOM = 0.6        # the floor's copies take at most this share of the free memory


def cold_copies(read_bytes: int, l2_bytes: int, factor: float) -> int:
    """Copies R with R x read_bytes >= factor x L2 (at least 1): how many copies of what a call reads
    keep every call's bytes out of L2 when the calls walk the copies in turn (the cases' caches,
    persistentkv.measure.rotation, and the floor's buffer)."""
    require(read_bytes > 0, f"a case must read some bytes, got {read_bytes}")
    require(l2_bytes >= 0, f"L2 size must be >= 0, got {l2_bytes}")
    require(factor >= 1, f"cold_l2_factor must be >= 1, got {factor}")
    return max(1, math.ceil(factor * l2_bytes / read_bytes))


def floor_vectors(nbytes: int) -> int:
    """16-byte vectors the read kernel loads to read ``nbytes``: ceil(nbytes / 16). A step's K/V
    bytes are whole vectors for every head_dim the engine takes (64 fp16 = 128 B per head and
    token), so the floor reads exactly them; an odd count is rounded up, never down."""
    require(int(nbytes) > 0, f"the floor needs a positive byte count, got {nbytes}")
    return -(-int(nbytes) // VECTOR_BYTES)


def floor_grids(sm_count: int, n_vec: int, blocks_per_sm=FLOOR_BLOCKS_PER_SM, threads: int = THREADS) -> list[int]:
    """Grid sizes (blocks of ``threads``) the floor tries: k x ``sm_count`` for each k of
    ``blocks_per_sm``, each capped at the blocks that have a vector to load (ceil(n_vec / threads)),
    ascending, without repeats. Worked number: 4 MiB is 262144 vectors, 1024 blocks' worth; on 132
    SMs the grids are 132, 264, 528 and 1024 (8 x 132 = 1056, capped)."""
    require(int(sm_count) >= 1, f"the floor needs the device's SM count, got {sm_count}")
    require(int(n_vec) >= 1, f"the floor needs at least one vector to read, got {n_vec}")
    require(len(blocks_per_sm) >= 1 and all(int(k) >= 1 for k in blocks_per_sm),
            f"blocks per SM must be positive integers, got {list(blocks_per_sm)}")
    useful = -(-int(n_vec) // threads)
    return sorted({min(int(k) * int(sm_count), useful) for k in blocks_per_sm})


def floor_launches(copies: int, calls_per_graph: int) -> int:
    """Launches captured per floor graph: the smallest multiple of ``copies`` that is at least
    ``calls_per_graph``, so that every replay walks the copies whole and the next one starts where it
    ended: a copy is re-read only after all the others. Worked numbers (60 MiB of L2, factor 3,
    10 calls per graph): 67 MB has 3 copies -> 12 launches; 4 MiB has 45 -> 45; 268 MB has 1 -> 10."""
    require(int(copies) >= 1, f"copies must be >= 1, got {copies}")
    require(int(calls_per_graph) >= 1, f"calls_per_graph must be >= 1, got {calls_per_graph}")
    return int(copies) * -(-int(calls_per_graph) // int(copies))


def floor_copies(slot_bytes: int, l2_bytes: int, factor: float, free_bytes: int, max_copies: int,
                 headroom: float = FLOOR_HEADROOM) -> int:
    """Copies of the floor's buffer: :func:`cold_copies`, capped at ``max_copies`` and at what
    ``headroom`` x ``free_bytes`` holds; a PKVError when not even one copy fits (fewer copies than a
    cold L2 wants leave the floor warmer, and faster, than the cases: never silently)."""
    wanted = min(cold_copies(slot_bytes, l2_bytes, factor), int(max_copies))
    fit = int(headroom * free_bytes // slot_bytes)
    require(fit >= 1, f"the one-kernel floor needs {slot_bytes / 2**30:.2f} GiB for one copy of its buffer, "
                      f"{free_bytes / 2**30:.2f} GiB is free")
    require(fit >= wanted, f"the one-kernel floor wants {wanted} copies of {slot_bytes / 2**20:.1f} MiB for a cold "
                           f"L2, memory holds {fit}")
    return wanted


def best_grid(samples: dict) -> int:
    """The grid whose samples (us per launch) have the lowest median; the smaller grid on a tie."""
    timed = {int(g): float(np.median(v)) for g, v in samples.items() if len(v)}
    require(bool(timed), "the floor has no timed grid")
    return min(timed, key=lambda g: (timed[g], g))


@dataclass(frozen=True)
class FloorResult:
    """What :class:`OneKernelFloor` measured for one byte count.

    samples: grid (blocks) -> us per launch, one per recorded round, in round order (with a
    separator: the graph's time per launch less the separators' own, timed right before)
    separator_samples: grid -> the separators' us per launch of the same rounds ({}: no separator)
    """

    nbytes: int
    n_vec: int
    copies: int
    launches: int
    samples: dict
    separator_samples: dict = field(default_factory=dict)

    @property
    def grid(self) -> int:
        return best_grid(self.samples)

    @property
    def medians(self) -> dict:
        return {g: float(np.median(v)) for g, v in sorted(self.samples.items()) if len(v)}

    @property
    def median_us(self) -> float:
        return self.medians[self.grid]

    def summary(self) -> str:
        """One line: the chosen grid among the others, their medians, the rotation."""
        medians = ", ".join(f"{g}: {us:.2f}" for g, us in self.medians.items())
        after = ", each after a separator kernel (its time subtracted)" if self.separator_samples else ""
        return (f"best of grids x{THREADS} threads (median us per launch, blocks: {medians}); {self.copies} "
                f"cold-L2 copies of {self.n_vec * VECTOR_BYTES} bytes, {self.launches} launches per graph{after}")


class CupyReader:
    """The read kernel over ``copies`` slots of ``n_vec`` vectors of one device buffer (GPU only).

    The buffer holds random bytes, so the sink's XOR (:attr:`sink`, XOR-ed by every launch) depends on
    every word a launch read: tests/test_gpu_floor.py checks it. ``launch`` queues one launch on
    torch's current stream (inside a capture: into the graph)."""

    def __init__(self, device, copies: int, n_vec: int, seed: int = 0):
        import torch

        self.device = device.device
        self._index = _device_index(self.device)
        self.function = _read_function(self._index)
        slot = int(n_vec) * VECTOR_BYTES
        self.buffer = torch.empty(int(copies) * slot, dtype=torch.uint8, device=self.device)
        gen = torch.Generator(device=self.device)
        gen.manual_seed(int(seed))
        self.buffer.random_(0, 256, generator=gen)
        self.sink = torch.zeros(1, dtype=torch.int32, device=self.device)
        base = self.buffer.data_ptr()
        self._slots = [ctypes.c_uint64(base + c * slot) for c in range(int(copies))]
        self._sink = ctypes.c_uint64(self.sink.data_ptr())
        self._n_vec = ctypes.c_uint64(n_vec)

    def launch(self, grid: int, slot: int) -> None:
        launch_kernel(self.function, grid, THREADS, (self._slots[slot], self._n_vec, self._sink),
                      current_raw_stream(self._index))

    def slot_bytes(self, slot: int):
        """The bytes of one slot (a torch uint8 view)."""
        n = self.buffer.numel() // len(self._slots)
        return self.buffer[slot * n:(slot + 1) * n]


class OneKernelFloor:
    """The one-kernel floor of ``nbytes``, ready to time: the buffer's cold-L2 copies
    (:func:`floor_copies`), and per grid (:func:`floor_grids`) one CUDA graph of
    :func:`floor_launches` launches walking the copies in turn. :meth:`round` replays every grid's
    graph once (in an order rotated each round), each between two events queued behind a spin of
    ``queue_cycles`` GPU cycles as the kernel rows are (persistentkv.measure.protocols.kernel_once),
    and keeps the time per launch; :meth:`result` gives every grid's samples and the best.

    ``device`` is a persistentkv.measure.device.TorchDevice (or a stand-in with ``sm_count``,
    ``l2_bytes``, ``free_bytes()``, ``event()``, ``queue_ahead()``, ``capture()``,
    ``synchronize()``); ``reader(device, copies, n_vec)`` makes the object whose
    ``launch(grid, slot)`` queues one read (:class:`CupyReader`; the tests pass a fake).

    ``separator``: a launcher of one small kernel that every read follows, as every attention call
    of the kernel protocol follows one (persistentkv.measure.protocols); then a graph of as many
    separators alone is replayed right before each grid's, and its time per launch subtracted."""

    def __init__(self, device, nbytes: int, *, cold_l2_factor: float, calls_per_graph: int,
                 queue_cycles: int = 0, max_copies: int = 64, blocks_per_sm=FLOOR_BLOCKS_PER_SM, reader=CupyReader,
                 separator=None):
        self.device = device
        self.nbytes = int(nbytes)
        self.n_vec = floor_vectors(nbytes)
        slot = self.n_vec * VECTOR_BYTES
        self.copies = floor_copies(slot, device.l2_bytes, cold_l2_factor, device.free_bytes(), max_copies)
        self.launches = floor_launches(self.copies, calls_per_graph)
        self.grids = floor_grids(device.sm_count, self.n_vec, blocks_per_sm)
        self.queue_cycles = int(queue_cycles)
        self.reader = reader(device, self.copies, self.n_vec)
        slots = [i % self.copies for i in range(self.launches)]
        self.separators = None
        if separator is not None:
            separator()
            device.synchronize()

            def separators_alone():
                for _ in slots:
                    separator()

            self.separators = device.capture(separators_alone)
        self.replays = {}
        for grid in self.grids:
            self.reader.launch(grid, 0)  # loads the module and runs the grid once, outside any capture
            device.synchronize()

            def launches(grid=grid):
                for s in slots:
                    if separator is not None:
                        separator()
                    self.reader.launch(grid, s)

            self.replays[grid] = device.capture(launches)
        self.samples = {g: [] for g in self.grids}
        self.separator_samples = {g: [] for g in self.grids} if separator is not None else {}
        self.rounds = 0

    def round(self, record: bool = True) -> None:
        """Every grid's graph replayed once; ``record``: keep the times (False: a warm-up round)."""
        k = self.rounds % len(self.grids)
        for grid in self.grids[k:] + self.grids[:k]:
            alone = self._per_launch_us(self.separators) if self.separators is not None else 0.0
            us = self._per_launch_us(self.replays[grid]) - alone
            if record:
                self.samples[grid].append(us)
                if self.separators is not None:
                    self.separator_samples[grid].append(alone)
        self.rounds += 1

    def _per_launch_us(self, replay) -> float:
        return timed_replay_ms(self.device, replay, self.queue_cycles) * 1e3 / self.launches

    def result(self) -> FloorResult:
        return FloorResult(self.nbytes, self.n_vec, self.copies, self.launches,
                           {g: list(v) for g, v in self.samples.items()},
                           {g: list(v) for g, v in self.separator_samples.items()})

    def close(self) -> None:
        """Drop the graphs and the buffer (the caller's allocator keeps the memory for the next case)."""
        self.replays.clear()
        self.separators = None
        self.reader = None


def timed_replay_ms(device, replay, queue_cycles: int = 0) -> float:
    """Milliseconds of one ``replay()`` between two events, both queued behind a ``queue_cycles``
    spin (none at 0), so that the window holds GPU time only: the floor's graphs and the kernel
    rows (persistentkv.measure.protocols.kernel_once) are timed by it."""
    start, end = device.event(), device.event()
    device.queue_ahead(queue_cycles)
    start.record()
    replay()
    end.record()
    device.synchronize()
    return start.elapsed_ms(end)


def measure_floor(device, nbytes: int, repeats: int = 5, warmup: int = 2, **options) -> FloorResult:
    """The one-kernel floor of ``nbytes`` on its own: ``warmup`` discarded rounds, then ``repeats``
    recorded ones (``options``: those of :class:`OneKernelFloor`; cold_l2_factor defaults to 3 and
    calls_per_graph to 10, the config's values)."""
    require(int(repeats) >= 1, f"repeats must be >= 1, got {repeats}")
    options = {"cold_l2_factor": 3.0, "calls_per_graph": 10, **options}
    floor = OneKernelFloor(device, nbytes, **options)
    try:
        for r in range(int(warmup) + int(repeats)):
            floor.round(record=r >= warmup)
        return floor.result()
    finally:
        floor.close()
