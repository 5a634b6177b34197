"""The backend interface: five members, one file per backend.

    name                      short identifier used in results ("flashinfer-tc", "pkv-workqueue")
    capabilities              a Capabilities record: the dtypes, head dims and page sizes it runs,
                              how a captured step follows growing lengths (``graph``), whether
                              run() takes NumPy arrays on the host (``host_arrays``), whether its
                              plans carry the engine that runs them (``plan_engine``)
    unavailable(spec)         reasons (strings) this backend cannot run ``spec`` here; [] when usable
    plan(batch)               per-step metadata, made once per decode step (may upload to the GPU)
    run(q, cache, plan, out)  one layer: q [B, Hq, D], cache = (K, V) each [pages, P, Hkv, D], or
                              (K, V, k_scale, v_scale) for an FP8 cache (spec.cache_dtype float8_e4m3:
                              K, V float8_e4m3fn codes, the scales float32 [1] or [Hkv] on the
                              device, value = code x scale), out [B, Hq, D] preallocated by the
                              caller; no allocation and no host synchronisation inside, so GPU
                              backends can be captured in a CUDA graph

A plan of a backend whose ``capabilities.graph`` is ``"device"`` has one method more:

    plan.update_lengths(lengths)  lengths: int32 [B] on the plan's device, each row's new length
                                  within the pages the plan was made for; the plan follows them
                                  with device work only (capturable in a CUDA graph)

Nothing else of a backend is read by the decode loop (persistentkv.model.loop), the measurement
harness (persistentkv.measure.harness) or measure-e2e. Optional plan members, for the timing
rows only: ``counters()`` (workload counters of our routes) and ``route`` (a backend that
delegates each step, adaptive: the registered name of the backend that runs this plan).

A backend is registered by name with :func:`persistentkv.backends.registry.register` (the
package's own are listed in registry.py). A backend never copies the KV cache; every backend
reads the same cache bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ..cache import Batch
from ..env import dtype_reasons
from ..errors import require
from ..spec import AttentionSpec

#: How a captured decode step follows the rows' growing lengths (Capabilities.graph):
#: ``device``: the plan is made once for the rows' reserved pages and ``plan.update_lengths``
#: runs inside the graph (no host work between replays); ``host``: ``plan(batch)`` on the host
#: rewrites the buffers the graph captured, in place; ``replan``: the host plans again and the
#: step is re-captured whenever the lengths change; ``none``: run() is not capturable (eager only).
GRAPH_MODES = ("device", "host", "replan", "none")


@dataclass(frozen=True)
class Capabilities:
    """What a backend runs and how it runs it; every backend declares one as ``capabilities``.

    Attributes
    ----------
    dtypes : tuple of str
        The query/cache dtypes it runs (``float16``, ``bfloat16``, ``float32``, ``float64``).
    graph : str
        One of :data:`GRAPH_MODES`.
    head_dims : tuple of int or None
        The head dimensions it runs; None: any the spec allows.
    page_sizes : tuple of int or None
        The page sizes it runs; None: any the spec allows.
    host_arrays : bool
        run() takes NumPy arrays on the host (the NumPy executor), not tensors.
    plan_engine : bool
        Its plans carry the engine that made them (``plan.engine``) and run(q, cache, plan, out)
        is ``plan.engine.run(q, cache, plan, out)``: a wrapper (adaptive) may call that directly,
        one Python call fewer per layer.
    kv_dtypes : tuple of str
        Cache dtypes it reads besides the query's (``float8_e4m3``: an FP8 cache with scales).
    fp8_query : bool
        With an FP8 cache, the query is rounded to e4m3 (by the library or its kernel): its error is
        of the FP8-query class, which validation reports beside the dtype's tolerance instead of
        failing the run on it (never under a looser tolerance).
    """

    dtypes: tuple[str, ...]
    graph: str
    head_dims: tuple[int, ...] | None = None
    page_sizes: tuple[int, ...] | None = None
    host_arrays: bool = False
    plan_engine: bool = False
    kv_dtypes: tuple[str, ...] = ()
    fp8_query: bool = False

    def __post_init__(self):
        require(self.graph in GRAPH_MODES, f"Capabilities.graph must be one of {', '.join(GRAPH_MODES)}, "
                                           f"got {self.graph!r}")
        require(isinstance(self.dtypes, tuple) and self.dtypes, "Capabilities.dtypes: a non-empty tuple")

    @property
    def capturable(self) -> bool:
        """Whether run() may be captured in a CUDA graph (``graph`` is not ``none``)."""
        return self.graph != "none"

    def shape_reasons(self, spec: AttentionSpec, who: str) -> list[str]:
        """Why ``spec``'s dtype, head dim or page size is not among the declared ones ([] when
        they all are); ``who`` names the kernel in the reasons."""
        reasons = dtype_reasons(spec, self.dtypes, who)
        if spec.cache_dtype != spec.dtype and spec.cache_dtype not in self.kv_dtypes:
            reasons.append(f"{who} does not read a {spec.cache_dtype} KV cache")
        if self.head_dims is not None and spec.head_dim not in self.head_dims:
            reasons.append(f"{who} supports head dims {self.head_dims}, not {spec.head_dim}")
        if self.page_sizes is not None and spec.page_size not in self.page_sizes:
            reasons.append(f"{who} supports page sizes {self.page_sizes}, not {spec.page_size}")
        return reasons


@dataclass
class TablePlan:
    """A step as kernels that read a block table on the device take it (XQA, cuDNN): the
    ``block_tables`` int32 [B, W] and the rows' lengths ``seq_lens`` int32 (shaped as the library
    takes them, B values) on the device; ``max_seq_len`` = W x page size."""

    spec: AttentionSpec
    batch_size: int
    block_tables: Any
    seq_lens: Any
    max_seq_len: int

    def update_lengths(self, lengths) -> None:
        """Follow the rows' lengths (int32 [B] on the device, within the planned block table):
        ``seq_lens`` takes them (``max_seq_len`` covers the reservation). One device copy."""
        self.seq_lens.view(-1).copy_(lengths)


@runtime_checkable
class Backend(Protocol):
    """One kernel family behind the five members every harness, policy and loop uses.

    Attributes
    ----------
    name : str
        Short identifier used in results (``flashinfer-tc``, ``pkv-workqueue``).
    capabilities : Capabilities
        What it runs and how a captured step follows growing lengths (a class attribute, or a
        property when it depends on constructor options).
    """

    name: str
    capabilities: Capabilities

    def unavailable(self, spec: AttentionSpec) -> list[str]:
        """Why this backend cannot run ``spec`` here (missing package, no GPU, a dtype, head dim
        or page size outside ``capabilities``), one reason per string; ``[]`` when it can. Never
        raises."""
        ...

    def plan(self, batch: Batch) -> Any:
        """Per-step metadata for ``batch``, made once per decode step and reused by every layer
        (it may upload to the GPU, asynchronously). With ``capabilities.graph == "device"`` the
        plan has ``update_lengths(lengths)`` (module docstring)."""
        ...

    def run(self, q: Any, cache: tuple[Any, Any], plan: Any, out: Any) -> None:
        """One layer of decode attention.

        Parameters
        ----------
        q : tensor, shape [B, Hq, D]
            Queries, of the spec's dtype (a NumPy array with ``capabilities.host_arrays``).
        cache : (tensor, tensor) or (tensor, tensor, tensor, tensor)
            K and V, each [num_pages, page_size, Hkv, D] (NHD), of the spec's kv_dtype; with an
            FP8 cache, then k_scale and v_scale (float32 [1] or [Hkv], on the cache's device).
        plan : object
            What ``plan(batch)`` returned for this step.
        out : tensor, shape [B, Hq, D]
            Preallocated by the caller, written in full. No allocation and no host
            synchronisation inside, so a GPU backend's call can be captured in a CUDA graph.
        """
        ...
