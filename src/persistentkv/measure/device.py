"""The device under the harness: torch on a CUDA GPU, or torch on the CPU for the tests.

Everything the protocols need from a device, and nothing more:

    synchronize()          wait for all queued work
    event()                a timestamp recorded in stream order (CUDA event; host clock on CPU)
    queue_ahead(cycles)    keep the stream busy for ``cycles`` GPU cycles (a spin kernel), so what
                           the host queues next starts without waiting for the host (no-op on CPU)
    capture(fn)            record ``fn``'s launches into a CUDA graph; returns a replay callable
                           (on the CPU: ``fn`` is run once, as capture runs it, and replay runs it);
                           :func:`capture_graph` below, which every graph of the library shares
    l2_bytes, name, sm_count, free_bytes(), empty_cache(), is_oom(exc)
    make_copies(batch, copies, seed)   R copies of a case's K/V as views of one tensor
    queries(spec, B, seed), empty_out(spec, B)

Hardware facts are read from the device once (STYLE: defined once).
"""

from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..cache import Batch
from ..env import torch_dtype
from ..errors import PKVError, require
from ..fp8 import E4M3_MAX
from ..spec import AttentionSpec
from ..traces import KV_SEED_OFFSET, Q_SEED_OFFSET

#: Fallback when a CPU "device" is used without telling it an L2 size (tests pass their own).
CPU_L2_BYTES = 0


class _HostEvent:
    def __init__(self):
        self.t = None

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_ms(self, end: "_HostEvent") -> float:
        return (end.t - self.t) * 1e3


class _CudaEvent:
    def __init__(self):
        import torch

        self._e = torch.cuda.Event(enable_timing=True)

    def record(self) -> None:
        self._e.record()

    def elapsed_ms(self, end: "_CudaEvent") -> float:
        return float(self._e.elapsed_time(end._e))


@dataclass
class Copies:
    """R copies of one case's cache: k[r], v[r] are [num_pages, P, Hkv, D] views of ``storage``;
    an FP8 cache's ``scales`` (k_scale, v_scale) are shared by every copy."""

    storage: Any
    k: list
    v: list
    scales: tuple = ()

    def __len__(self) -> int:
        return len(self.k)

    def pair(self, index: int):
        """Copy ``index`` as a backend's run() takes it: (K, V), or (K, V, k_scale, v_scale)."""
        return (self.k[index], self.v[index], *self.scales)


def no_cuda_message() -> str:
    """Why the GPU commands cannot run here, in one line."""
    try:
        import torch
    except Exception as exc:
        return f"no CUDA device (torch cannot be imported: {type(exc).__name__}: {exc})"
    if not torch.cuda.is_available():
        return f"no CUDA device visible to torch {torch.__version__} (this command needs a GPU)"
    return ""


def require_cuda() -> None:
    message = no_cuda_message()
    if message:
        raise PKVError(message)


@contextlib.contextmanager
def cycle_collector_off():
    """Python's cycle collector off inside the block (for every thread), back as it was after it."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def capture_graph(fn: Callable[[], None], device=None, *, warmup: Callable[[], None] | None = None,
                  stream=None, free_cached: bool = True) -> Callable[[], None]:
    """A CUDA graph of ``fn``'s launches on ``device``; returns its replay (every graph of the
    library and the benchmarks is captured here; the tests keep their own).

    warmup       run first on the capture stream, which waits for the current stream and which
                 the current stream then waits for: lazy initialisation (cuBLAS handles, JIT
                 modules, seeded inputs) must not happen inside a capture (None: no warm-up)
    stream       the side stream to capture on (None: a new one)
    free_cached  True: capture inside the ``torch.cuda.graph`` context, which synchronises and
                 frees the allocator's cached memory first (the decode loop's graphs, the
                 benchmarks'); False: ``capture_begin``/``capture_end`` between two
                 synchronisations, nothing freed (the harness's many graphs per case:
                 TorchDevice.capture). Either way the graph gets its own private memory pool
                 (replays come in any order).

    Python's cycle collector is off during the capture: a collection there can destroy another
    CUDA graph that became garbage in a reference cycle (measure-e2e's attention-alone bodies close
    over their loop, and a decode loop kept its own bodies as bound methods until b8496de), and
    destroying a graph while a stream captures invalidates the capture (torch's ``graph`` context no
    longer collects first).
    """
    import torch

    stream = torch.cuda.Stream(device) if stream is None else stream
    if warmup is not None:
        current = torch.cuda.current_stream(device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            warmup()
        current.wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    if free_cached:
        with cycle_collector_off(), torch.cuda.graph(graph, stream=stream):
            fn()
        return graph.replay
    torch.cuda.synchronize(device)
    with cycle_collector_off(), torch.cuda.stream(stream):
        graph.capture_begin()
        try:
            fn()
        except BaseException:
            try:
                graph.capture_end()
            except Exception:
                pass
            raise
        graph.capture_end()
    torch.cuda.synchronize(device)
    return graph.replay


class TorchDevice:
    """torch on ``device`` ("cuda" or "cpu"). ``l2_bytes`` overrides the device's L2 size."""

    def __init__(self, device: str = "cuda", l2_bytes: int | None = None):
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self._capture_stream = None
        if self.is_cuda:
            require(torch.cuda.is_available(), no_cuda_message() or "no CUDA device")
            props = torch.cuda.get_device_properties(self.device)
            self.name = props.name
            self.sm_count = int(props.multi_processor_count)
            self.l2_bytes = int(l2_bytes if l2_bytes is not None else getattr(props, "L2_cache_size", 0))
            self.total_bytes = int(props.total_memory)
        else:
            self.name = "cpu"
            self.sm_count = 0
            self.l2_bytes = int(l2_bytes if l2_bytes is not None else CPU_L2_BYTES)
            self.total_bytes = 0

    # -- timing ---------------------------------------------------------------------------
    def synchronize(self) -> None:
        if self.is_cuda:
            self.torch.cuda.synchronize(self.device)

    def event(self):
        return _CudaEvent() if self.is_cuda else _HostEvent()

    def queue_ahead(self, cycles: int) -> None:
        require(cycles >= 0, f"queue_ahead cycles must be >= 0, got {cycles}")
        if self.is_cuda and cycles:
            spin = getattr(self.torch.cuda, "_sleep", None)  # torch's own spin kernel (its tests use it)
            require(spin is not None, f"torch {self.torch.__version__} has no torch.cuda._sleep to queue kernel rows "
                                      "behind; set measure.kernel_queue_cycles: 0 to time them without it")
            spin(int(cycles))

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        """A CUDA graph of ``fn``'s launches, captured on a side stream; returns its replay."""
        if not self.is_cuda:
            fn()
            return fn
        # capture_begin/end on our own side stream rather than the torch.cuda.graph context, which
        # frees the allocator's cache per capture: a case captures up to copies x backends graphs.
        if self._capture_stream is None:
            self._capture_stream = self.torch.cuda.Stream(self.device)
        return capture_graph(fn, self.device, stream=self._capture_stream, free_cached=False)

    def separator(self, nbytes: int) -> Callable[[], None]:
        """A launcher of one small copy kernel (``nbytes``, at least 16, from one buffer into another
        of this device): what each timed call of the kernel protocol follows
        (persistentkv.measure.protocols, ``kernel_separator``)."""
        src = self.torch.zeros(max(16, int(nbytes)), dtype=self.torch.uint8, device=self.device)
        dst = self.torch.empty_like(src)
        return lambda: dst.copy_(src)

    # -- memory ---------------------------------------------------------------------------
    def free_bytes(self) -> int:
        if self.is_cuda:
            free, _ = self.torch.cuda.mem_get_info(self.device)
            return int(free) + int(self.torch.cuda.memory_reserved(self.device) - self.torch.cuda.memory_allocated(self.device))
        return 1 << 62

    def empty_cache(self) -> None:
        if self.is_cuda:
            self.torch.cuda.empty_cache()

    def is_oom(self, exc: BaseException) -> bool:
        oom = getattr(self.torch.cuda, "OutOfMemoryError", None)
        return (oom is not None and isinstance(exc, oom)) or "out of memory" in str(exc).lower()

    # -- tensors --------------------------------------------------------------------------
    def dtype(self, spec: AttentionSpec):
        return torch_dtype(spec.dtype)

    def cache_dtype(self, spec: AttentionSpec):
        """The cache's torch dtype: the query's, or float8_e4m3fn for an FP8 spec."""
        return self.torch.float8_e4m3fn if spec.fp8_kv else self.dtype(spec)

    def generator(self, seed: int):
        gen = self.torch.Generator(device=self.device)
        gen.manual_seed(int(seed))
        return gen

    def make_copies(self, batch: Batch, copies: int, seed: int, source=None) -> Copies:
        """R copies of the case's K and V, all with the same bytes.

        One tensor ``[R, 2, pages, P, Hkv, D]`` holds them, so copy r's K is ``storage[r, 0]``
        (a contiguous view). Copy 0 is standard-normal (seeded ``seed + 7``) or ``source`` (a
        (K, V) pair of host tensors, for validation; an FP8 spec's (K, V, k_scale, v_scale), the
        codes as float8_e4m3fn or uint8); the others are device-side copies of it. An FP8 spec's
        normals are quantised to e4m3 with one scale per tensor (its largest magnitude / 448), the
        scale every FP8 baseline takes.
        """
        torch = self.torch
        spec = batch.spec
        require(copies >= 1, f"copies must be >= 1, got {copies}")
        shape = (copies, 2, batch.num_pages, spec.page_size, spec.num_kv_heads, spec.head_dim)
        storage = torch.empty(shape, dtype=self.cache_dtype(spec), device=self.device)
        scales = ()
        if spec.fp8_kv:
            if source is None:
                values = torch.empty(shape[1:], dtype=torch.float32, device=self.device)
                values.normal_(generator=self.generator(seed + KV_SEED_OFFSET))
                scales = tuple((values[i].abs().amax() / E4M3_MAX).reshape(1) for i in range(2))
                for i in range(2):
                    storage[0, i].copy_((values[i] / scales[i]).to(torch.float8_e4m3fn))
                del values
            else:
                require(len(source) == 4, "an FP8 copy's source is (K codes, V codes, k_scale, v_scale)")
                for i in range(2):
                    codes = torch.as_tensor(source[i])
                    codes = codes if codes.dtype == torch.float8_e4m3fn else codes.view(torch.float8_e4m3fn)
                    storage[0, i].copy_(codes)
                scales = tuple(torch.as_tensor(s, dtype=torch.float32).reshape(-1).to(self.device) for s in source[2:])
        elif source is None:
            storage[0].normal_(generator=self.generator(seed + KV_SEED_OFFSET))
        else:
            storage[0, 0].copy_(source[0])
            storage[0, 1].copy_(source[1])
        for r in range(1, copies):
            storage[r].copy_(storage[0])
        return Copies(storage, [storage[r, 0] for r in range(copies)], [storage[r, 1] for r in range(copies)], scales)

    def queries(self, spec: AttentionSpec, batch_size: int, seed: int):
        """q [B, Hq, D], standard-normal seeded ``seed + 2026``."""
        q = self.torch.empty((batch_size, spec.num_qo_heads, spec.head_dim), dtype=self.dtype(spec), device=self.device)
        q.normal_(generator=self.generator(seed + Q_SEED_OFFSET))
        return q

    def empty_out(self, spec: AttentionSpec, batch_size: int):
        return self.torch.empty((batch_size, spec.num_qo_heads, spec.head_dim), dtype=self.dtype(spec), device=self.device)

    def index(self, values):
        """An int64 index tensor on the device (the published protocol's Q gather)."""
        return self.torch.as_tensor(values, dtype=self.torch.int64, device=self.device)


def copies_fit(copy_bytes: int, copies: int, free_bytes: int, headroom: float = 0.8) -> int:
    """How many of ``copies`` fit in ``headroom`` x free memory (0 when not even one does)."""
    if copy_bytes <= 0:
        return copies
    return int(min(copies, (headroom * free_bytes) // copy_bytes))


def check_fits(copy_bytes: int, free_bytes: int, headroom: float = 0.8) -> None:
    if copy_bytes > headroom * free_bytes:
        raise PKVError(f"the case needs {copy_bytes / 2**30:.1f} GiB for one copy of its cache, "
                       f"{free_bytes / 2**30:.1f} GiB is free")
