"""The GPU engine: our decode kernels on torch tensors, in plan/run shape.

    engine = engine_for(spec)                       # compiles (once, cached by CuPy) and loads; per device
    plan = engine.plan(batch, sm_scale=None)        # once per decode step
    engine.run(q, (k_cache, v_cache), plan, out, lse=None)   # once per layer; graph-capturable
    engine.run(q, (k_fp8, v_fp8), plan, out, k_scale=ks, v_scale=vs)   # an FP8 cache (AttentionSpec(kv_dtype="float8_e4m3"))

``run`` takes torch tensors and passes their device pointers straight to the kernels: no copies,
no allocation, no host synchronisation, launched on torch's current stream, so a step can be
captured in a CUDA graph. Routes (names.ENGINE_ROUTES):

* ``workqueue`` (default): the balanced compact queue, planned ON THE GPU by ``pkv_plan`` from the
  device sequence lengths (no host round trip), one fused launch (the last CTA of each
  (row, kv head) merges; in two levels when it split more than 16 ways).
  ``plan.update_lengths(lengths)`` re-plans it from lengths changed on the device, so a whole step
  (plan + layers) can be one CUDA graph; ``plan(..., workspace=)`` puts it in a caller-owned
  buffer, so plans of one shape share every address and a captured graph serves each of them.
* ``buckets``: one decode + merge launch pair per exact-length bucket, as published.
* ``split``: the rectangular B x Hkv x S grid with its empty splits, decode + merge.

Supported: fp16 and bf16 queries and outputs over a cache of the same dtype or of FP8 e4m3 codes
(``AttentionSpec(kv_dtype="float8_e4m3")``, torch.float8_e4m3fn tensors, dequantised in registers
as code x scale, the scales float32 device tensors of one value or one per KV head, read by the
kernels at every launch, so a captured graph follows new scales); head_dim 64/128/256; G = Hq/Hkv from 1 to 16; page sizes 1-256
(powers of two; 8-128 are the tested range); batch up to the GPU planner's rows
(``module.plan_max_rows``, 4096) on ``workqueue`` (65535 on the host-planned routes). Anything
else is refused in ``DecodeEngine`` or ``plan`` with one line.

``warps`` (default 4) picks the module's CTA shape: 8 warps stream 128-token pipeline stages
(192 KB of shared memory at head_dim 128, one CTA per SM) instead of 64-token ones (two CTAs per
SM); head_dim <= 128 only. ``ctas_per_sm`` (FP8 cache, 4 warps: 2 by default, 3 or 4) builds the
module for more resident CTAs, so the queue's wave (occupancy x SMs) has more, shorter items.
``choose.choose_warps`` and ``choose.choose_ctas_per_sm`` pick both per step for pkv-workqueue.

Every kernel launches plainly, after the kernel before it on the stream has completed (launches
with programmatic dependent launch were measured and rejected: benchmarks/NOTES.md, "Tried and
rejected").

``trace`` (development): builds the module with the CTA trace stamps (kernels/pkv_trace.cuh) that
benchmarks/trace_cta.py reads; never for serving.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import plan as planner
from .cache import Batch
from .env import cuda_reasons, missing_module
from .errors import PKVError, require
from .launch import (DEFAULT_WARPS, ENGINE_DTYPES, ENGINE_KV_DTYPES, MAX_GROUP_SIZE, DecodeArgs, KernelLaunch,
                     MergeArgs, PlanArgs, PTRS, STRIDES, arg_block, kernel_launcher, kernel_occupancy, load_module, min_chunk_tiles_for,
                     ctas_unsupported, raw_stream_reader, warps_unsupported)
from .names import ENGINE_ROUTES
from .spec import AttentionSpec

LOG2E = 1.4426950408889634


def engine_unsupported(spec: AttentionSpec, warps: int = DEFAULT_WARPS, ctas_per_sm: int | None = None) -> list[str]:
    """Reasons our kernels cannot run ``spec`` with ``warps``-warp CTAs, ``ctas_per_sm`` of them
    resident per SM (None: the default), empty when they can; checked before any compile or launch."""
    reasons = warps_unsupported(spec, warps) or ctas_unsupported(spec, warps, ctas_per_sm)
    if spec.dtype not in ENGINE_DTYPES:
        reasons.append(f"the PersistentKV kernels take {'/'.join(ENGINE_DTYPES)}, not {spec.dtype}")
    if spec.cache_dtype != spec.dtype and spec.cache_dtype not in ENGINE_KV_DTYPES:
        reasons.append(f"the PersistentKV kernels read a cache of the query's dtype or "
                       f"{'/'.join(ENGINE_KV_DTYPES)}, not {spec.cache_dtype}")
    if spec.group_size > MAX_GROUP_SIZE:
        reasons.append(f"group size G={spec.group_size} exceeds {MAX_GROUP_SIZE} query heads per kv head")
    if spec.layout != "NHD":
        reasons.append(f"layout {spec.layout} is not NHD")
    return reasons


def gpu_reasons() -> list[str]:
    """Why the engine cannot run on this machine ([] when torch + CUDA + CuPy are usable)."""
    return cuda_reasons() or missing_module("cupy")


@dataclass
class DevicePlan:
    """Device-side metadata of one step; holds every buffer its launches touch.

    Attributes
    ----------
    route : str
        ``workqueue``, ``buckets`` or ``split``.
    batch_size : int
        Rows of the step (B).
    launches : list of launch.KernelLaunch
        In order; a ``workqueue`` plan's first is the GPU planner's (plan() and replan_device()
        launch it; ``run_launches`` are the ones run() makes).
    buffers : dict of torch.Tensor
        What the launches read and write, ``view(name)`` for any of them:
        ``items`` int32 [max_items, 8] (row | head << 16, lo, hi, split | nsplit << 16, page_base,
        0, 0, flags); ``num_items`` int32 [1] (GPU-planned); ``part_o`` float32 [slots, G, D] and
        ``part_lse`` float32 [slots, G] (partial states); ``counters`` int32 [slots] (the fused
        merge's arrivals, zero between launches); ``packed`` int32 [2B + 1 + pages]
        (seq_lens | kv_indptr | kv_indices; GPU-planned). A GPU-planned plan keeps them in one
        device tensor, ``buffers['workspace']``, beside ``upload`` (what one pinned copy
        uploaded); the views are made when asked for (each costs microseconds of host time).
    host_plan : plan.Plan or None
        The host plan of a host-planned route.
    """

    route: str
    spec: AttentionSpec
    batch_size: int
    launches: list
    buffers: dict = field(default_factory=dict)
    host_plan: planner.Plan | None = None
    #: recomputes the host plan this device plan is equal to (for counters; never on the hot path)
    _host_equivalent: Any = None
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
    #: the softmax scale its launches apply to q.k (plan()'s sm_scale, 1/sqrt(head_dim) by default)
    sm_scale: float = 0.0
    #: the raw CUDA stream its last launch went to (plan()'s, then each run()'s)
    stream: int = field(default=0, repr=False, compare=False)

    def __post_init__(self):
        #: what run() launches, in order (the GPU planner's launch is plan()'s and replan_device()'s)
        self.run_launches = tuple(l for l in self.launches if l.kind != "plan")
        #: held while run() writes this call's pointers into the launches' parameter blocks and
        #: launches them, so two host threads never interleave their stores
        self.lock = threading.Lock()

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

    def update_lengths(self, lengths) -> None:
        """Follow the rows' lengths changed on the device: a ``workqueue`` plan copies them into its
        device block table and re-plans on the GPU, on the current stream (no host work, graph-
        capturable). Other routes are planned on the host and refuse (plan again).

        Parameters
        ----------
        lengths : torch.Tensor
            int32 [B] on the plan's device: each row's new length, within the pages its block
            table holds (the batch the plan was made for).
        """
        require(self.route == "workqueue",
                f"a {self.route} plan is planned on the host and cannot follow lengths on the device; "
                f"plan the step again")
        self.view("packed")[: self.batch_size].copy_(lengths)
        self.engine.replan_device(self)

    def counters(self) -> dict:
        """Workload counters (plan.StepCounters) of this step; computed on demand on the host."""
        host = self.host_plan if self.host_plan is not None else self._host_equivalent()
        counters = host.counters().to_dict()
        if "upload" in self.buffers:  # GPU-planned: what one copy uploaded
            counters["h2d_bytes"] = int(self.buffers["upload"].numel() * 4)
        return counters


class DecodeEngine:
    """Our decode kernels for one AttentionSpec on one CUDA device.

    Parameters
    ----------
    spec : AttentionSpec
        Hq, Hkv, head_dim, page_size and dtype of every tensor the engine will see.
    device : int, optional
        CUDA device index (default: torch's current device).
    target_items : int, optional
        Items per wave of the balanced queue (default: resident CTAs per SM x SMs).
    min_chunk_tiles : int, optional
        Smallest work item in 32-token planner tiles (default: one pipeline stage).
    warps : {4, 8}
        Warps per decode CTA (8: head_dim <= 128).
    ctas_per_sm : {2, 3, 4}, optional
        Resident CTAs per SM the 4-warp module is built for (default 2; 3 and 4: FP8 cache only).
    trace : bool
        Build with the CTA trace stamps (development; benchmarks/trace_cta.py).
    """

    def __init__(self, spec: AttentionSpec, device: int | None = None, *, target_items: int | None = None,
                 min_chunk_tiles: int | None = None, warps: int = DEFAULT_WARPS, trace: bool = False,
                 ctas_per_sm: int | None = None):
        require(isinstance(trace, bool), f"trace must be True or False, got {trace!r}")
        reasons = engine_unsupported(spec, warps, ctas_per_sm) + gpu_reasons()
        if reasons:
            raise PKVError("; ".join(reasons))
        import torch  # the engine's tensors are torch's; imported only where a GPU is used

        self.spec = spec
        self.warps = warps
        self.ctas_per_sm = ctas_per_sm
        self.trace = trace
        self.torch = torch
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None else device)
        self.module = load_module(spec, warps, self.device.index, trace, ctas_per_sm)
        props = torch.cuda.get_device_properties(self.device)
        self.num_sms = props.multi_processor_count
        self.capability = (props.major, props.minor)
        # Balanced queue: one wave of resident CTAs (occupancy read from the compiled kernel, or the
        # CTAs per SM the module was built for: load_module checked that they fit).
        self.target_items = int(target_items or (ctas_per_sm or self.module.occupancy) * self.num_sms)
        self.min_chunk_tiles = int(min_chunk_tiles or min_chunk_tiles_for(warps))
        self.torch_dtype = torch.float16 if spec.dtype == "float16" else torch.bfloat16
        #: the cache's torch dtype: the query's, or float8_e4m3fn
        self.cache_dtype = torch.float8_e4m3fn if spec.fp8_kv else self.torch_dtype
        #: the driver's launch call and torch's current-stream reader, bound once: each launch is one
        #: call through them (launch.kernel_launcher, launch.raw_stream_reader)
        self._launch_kernel = kernel_launcher()
        self._raw_stream = raw_stream_reader()
        #: the default softmax scale (plan()'s sm_scale overrides it per plan)
        self.sm_scale = 1.0 / math.sqrt(spec.head_dim)
        self.scale_log2 = float(np.float32(LOG2E * self.sm_scale))
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

    def plan(self, batch: Batch, route: str = "workqueue", *, num_splits: int = 32, target_items: int | None = None,
             min_chunk_tiles: int | None = None, sm_scale: float | None = None, workspace=None) -> DevicePlan:
        """Plan one decode step; once per step, reused by every layer.

        Parameters
        ----------
        batch : Batch
            The step's rows: seq_lens int32 [B], kv_indptr int32 [B + 1], kv_indices int32 [pages].
        route : {"workqueue", "buckets", "split"}
            See the module docstring.
        num_splits : int
            S of the ``buckets`` and ``split`` routes.
        target_items, min_chunk_tiles : int, optional
            The balanced queue's wave and smallest item (default: the engine's).
        sm_scale : float, optional
            The softmax scale applied to q.k (default ``1 / sqrt(head_dim)``); finite and > 0.
        workspace : torch.Tensor, optional
            ``workqueue`` only: a caller-owned contiguous CUDA buffer on the engine's device, of
            any dtype, 16-byte aligned, at least ``workspace_bytes(B, len(kv_indices))`` bytes. The
            plan lives in it instead of a fresh allocation: plans of the same batch size and
            block-table length made into one workspace share every address, so a CUDA graph
            captured over one plan's run() stays valid for the next (FlashInfer's fixed buffers).
            A workspace serves one plan at a time: planning into it overwrites the last plan.

        Returns
        -------
        DevicePlan
            Its buffers live on the device; a ``workqueue`` plan's planner is already launched on
            the current stream.
        """
        # A serving loop pays this method's host time before every step's first launch: the
        # checks build their messages only when they fail.
        if route not in ENGINE_ROUTES:
            raise PKVError(f"unknown route {route!r}; expected one of {', '.join(ENGINE_ROUTES)}")
        if batch.spec != self.spec:
            raise PKVError(f"batch spec {batch.spec} != engine spec {self.spec}")
        if sm_scale is None:
            scale, scale_log2 = self.sm_scale, self.scale_log2
        else:
            scale = float(sm_scale)
            require(math.isfinite(scale) and scale > 0, f"sm_scale must be finite and > 0, got {sm_scale!r}")
            scale_log2 = float(np.float32(LOG2E * scale))
        if route == "workqueue":
            return self._plan_device(batch, int(target_items or self.target_items),
                                     int(min_chunk_tiles or self.min_chunk_tiles), scale, scale_log2, workspace)
        require(workspace is None, f"workspace= is for the workqueue route; a {route} plan allocates its own buffers")
        if route == "buckets":
            host = planner.plan_buckets(batch, num_splits=int(num_splits))
        else:
            host = planner.plan_split(batch, num_splits=int(num_splits))
        return self._upload(batch, host, scale, scale_log2)

    def _decode_launch(self, kind: str, grid: int, kv_indices: int, items: int, num_items: int, part_o: int,
                       part_lse: int, counters: int, slot_offset: int, scale_log2: float) -> KernelLaunch:
        """A decode launch over the given device addresses (its q/k/v/out/lse and strides are run()'s)."""
        spec, mod = self.spec, self.module
        args = arg_block(DecodeArgs, 0, 0, 0, 0, 0, 0, 0, kv_indices, items, num_items, part_o, part_lse, counters,
                         slot_offset, spec.num_kv_heads, spec.group_size, self._log2_page, 0, 0, 0, 0, 0, 0, 0,
                         scale_log2)
        function = mod.functions["pkv_decode_fused" if kind == "fused" else "pkv_decode"].ptr
        return KernelLaunch(kind, grid, args, function, mod.threads, mod.smem_bytes)

    def _upload(self, batch: Batch, host: planner.Plan, scale: float, scale_log2: float) -> DevicePlan:
        """A host plan's items (as the kernels read them), page table and merge groups on the
        device, and its launches."""
        torch, spec = self.torch, self.spec
        n = host.num_items
        items8 = np.zeros((max(n, 1), 8), dtype=np.int32)
        items8[:n, :4] = host.items
        items8[:n, 4] = batch.kv_indptr[host.items[:, 0] & 0xFFFF]
        G, D = spec.group_size, spec.head_dim
        buffers = {
            "part_o": torch.empty((max(n, 1), G, D), dtype=torch.float32, device=self.device),
            "part_lse": torch.empty((max(n, 1), G), dtype=torch.float32, device=self.device),
            "counters": torch.zeros((max(n, 1),), dtype=torch.int32, device=self.device),
            "items": self._i32(items8),
            "kv_indices": self._i32(batch.kv_indices if batch.kv_indices.size else [0]),
            "merge_groups": self._i32(host.merge_groups if host.merge_groups.size else np.zeros((1, 4))),
        }
        ptr = {name: t.data_ptr() for name, t in buffers.items()}
        launches = []
        for launch in host.launches:
            if launch.kind == "merge":
                args = arg_block(MergeArgs, ptr["merge_groups"] + 16 * launch.start, ptr["part_o"], ptr["part_lse"],
                                 0, 0, spec.group_size, spec.num_kv_heads, 0, 0)
                launches.append(KernelLaunch("merge", launch.size, args, self.module.functions["pkv_merge"].ptr,
                                             self.module.threads, 0))
            elif launch.size:
                launches.append(self._decode_launch(launch.kind, launch.size, ptr["kv_indices"], ptr["items"], 0,
                                                    ptr["part_o"], ptr["part_lse"], ptr["counters"], launch.start,
                                                    scale_log2))
        return DevicePlan(host.route, spec, batch.batch_size, launches, buffers, host, warps=self.warps, engine=self,
                          num_pages=batch.num_pages, sm_scale=scale, stream=self._stream())

    def _workspace_layout(self, batch_size: int, num_indices: int, target_items: int) -> dict[str, int]:
        """Offsets (int32 elements) of a GPU-planned plan's workspace, each part 16-byte aligned
        (items are read as int4, states as float4):
            seq_lens | indptr | indices (one 0 when empty) | counters (zeros) || num_items | items | states
        everything before || uploaded in one copy; the planner writes num_items and items, the
        decode kernel the float32 states (part_o [max_items, G, D], then part_lse [max_items, G])."""
        B, spec = batch_size, self.spec
        max_items = planner.max_workqueue_items(B, spec.num_kv_heads, target_items)
        n_packed = 2 * B + 1 + num_indices
        counters = (n_packed + 4) & ~3  # at least one index slot, rounded up to 4 ints
        num = (counters + max_items + 3) & ~3  # per slot: the fused merge's arrivals
        items = num + 4
        states = items + 8 * max_items
        n_part_o = max_items * spec.group_size * spec.head_dim
        return {"max_items": max_items, "packed": n_packed, "counters": counters, "num_items": num, "items": items,
                "states": states, "part_o": n_part_o, "total": states + n_part_o + max_items * spec.group_size}

    def workspace_bytes(self, batch_size: int, num_indices: int, target_items: int | None = None) -> int:
        """Bytes of the caller-owned ``workspace`` a ``workqueue`` plan of ``batch_size`` rows and
        ``num_indices`` block-table entries needs (plan(..., workspace=)).

        Parameters
        ----------
        batch_size : int
            Rows of the step (B), at most the GPU planner's rows (``module.plan_max_rows``).
        num_indices : int
            Entries of its block table (``len(kv_indices)``: pages over all rows).
        target_items : int, optional
            The queue's wave (default: the engine's), as passed to plan().

        Returns
        -------
        int
            Bytes; a larger buffer serves as well.
        """
        require(batch_size >= 1 and num_indices >= 0, f"workspace_bytes needs batch_size >= 1 and num_indices >= 0, "
                                                       f"got {batch_size}, {num_indices}")
        return 4 * self._workspace_layout(int(batch_size), int(num_indices), int(target_items or self.target_items))[
            "total"]

    def _caller_workspace(self, workspace, elements: int):
        """The first ``elements`` int32 of a caller's workspace, or a one-line PKVError."""
        torch = self.torch
        require(isinstance(workspace, torch.Tensor) and workspace.device == self.device and workspace.is_contiguous(),
                f"workspace must be a contiguous torch tensor on {self.device}")
        require(workspace.data_ptr() % 16 == 0, "workspace must be 16-byte aligned")
        nbytes = workspace.numel() * workspace.element_size()
        require(nbytes >= 4 * elements, f"workspace holds {nbytes} bytes; this plan needs {4 * elements} "
                                        f"(engine.workspace_bytes)")
        return workspace.view(torch.uint8)[:4 * elements].view(torch.int32)

    def _plan_device(self, batch: Batch, target_items: int, min_chunk: int, scale: float, scale_log2: float,
                     workspace=None) -> DevicePlan:
        """The GPU-planned queue. Its host work is what a serving loop pays before each step's
        first launch, so it makes one device allocation (none with a caller's workspace), one
        asynchronous copy from pinned memory (torch's caching host allocator keeps the staging
        block until the copy is done), no fill kernel and no tensor views, then launches the
        planner (layout: _workspace_layout)."""
        B, nnz, spec, torch = batch.batch_size, int(batch.kv_indices.size), self.spec, self.torch
        if B > self.module.plan_max_rows:
            raise PKVError(f"batch size {B} exceeds the GPU planner's {self.module.plan_max_rows} rows; "
                           f"use route buckets or split")
        at = self._workspace_layout(B, nnz, target_items)
        max_items, n_packed, o_num = at["max_items"], at["packed"], at["num_items"]
        G, D = spec.group_size, spec.head_dim
        staging = torch.empty((o_num,), dtype=torch.int32, pin_memory=True)
        host = staging.numpy()
        np.concatenate((batch.seq_lens, batch.kv_indptr, batch.kv_indices), out=host[:n_packed])
        host[n_packed:] = 0
        if workspace is None:
            workspace = torch.empty((at["total"],), dtype=torch.int32, device=self.device)
        else:
            workspace = self._caller_workspace(workspace, at["total"])
        upload = workspace[:o_num]
        upload.copy_(staging, non_blocking=True)
        base = workspace.data_ptr()
        items, num_items, states = base + 4 * at["items"], base + 4 * o_num, base + 4 * at["states"]
        plan_args = arg_block(PlanArgs, base, base + 4 * B, B, spec.num_kv_heads, target_items, min_chunk, max_items,
                              items, num_items)
        launches = [KernelLaunch("plan", 1, plan_args, self._plan_function, self.module.plan_threads, 0),
                    self._decode_launch("fused", max_items, base + 4 * (2 * B + 1), items, num_items, states,
                                        states + 4 * at["part_o"], base + 4 * at["counters"], 0, scale_log2)]
        f32 = torch.float32

        def regions() -> dict:
            return {"packed": (0, n_packed, (n_packed,), None),
                    "kv_indices": (2 * B + 1, max(nnz, 1), (max(nnz, 1),), None),
                    "counters": (at["counters"], max_items, (max_items,), None),
                    "num_items": (o_num, 1, (1,), None), "items": (at["items"], 8 * max_items, (max_items, 8), None),
                    "part_o": (at["states"], at["part_o"], (max_items, G, D), f32),
                    "part_lse": (at["states"] + at["part_o"], max_items * G, (max_items, G), f32)}

        stream = self._stream()
        plan = DevicePlan("workqueue", spec, B, launches, {"workspace": workspace, "upload": upload}, None,
                          warps=self.warps, _make_regions=regions, engine=self, num_pages=batch.num_pages,
                          _host_equivalent=lambda: planner.plan_workqueue(
                              batch, target_items=target_items, min_chunk_tiles=min_chunk),
                          sm_scale=scale, stream=stream)
        self._launch(launches[0], stream)
        return plan

    def replan_device(self, plan: DevicePlan) -> None:
        """Re-run the GPU planner of a ``workqueue`` plan on the current stream: no host work,
        graph-capturable. ``plan.update_lengths(lengths)`` writes new lengths and calls it.

        Parameters
        ----------
        plan : DevicePlan
            A ``workqueue`` plan whose lengths changed on the device, within the pages its block
            table holds.
        """
        require(plan.route == "workqueue", "only GPU-planned (workqueue) plans follow lengths changed on the device")
        self._launch(plan.launches[0], self._stream())

    def occupancy(self, launch: KernelLaunch) -> int:
        """CTAs of ``launch``'s kernel resident per SM at its shared memory."""
        return kernel_occupancy(launch.function, launch.threads, launch.smem)

    def _launch(self, launch: KernelLaunch, stream: int) -> None:
        self._launch_kernel(launch.function, launch.grid, 1, 1, launch.threads, 1, 1, launch.smem, stream,
                            launch.args.address, 0)

    # ------------------------------------------------------------------ running
    def _stream(self) -> int:
        """The raw pointer of torch's current stream on this device (the capture stream inside
        torch.cuda.graph)."""
        return self._raw_stream(self._device_index)

    def _follow_stream(self, plan: DevicePlan, stream: int) -> None:
        """``plan`` last launched on another stream: order this stream after everything queued
        there so far (its planner, its last run), since the plan's partial states and arrival
        counters serve one run at a time. Inside a CUDA-graph capture no wait is recorded (an
        event from outside a capture cannot be waited on in it; torch.cuda.graph synchronises the
        device before it captures)."""
        torch = self.torch
        if plan.stream and not torch.cuda.is_current_stream_capturing():
            event = torch.cuda.Event()
            event.record(torch.cuda.ExternalStream(plan.stream, device=self.device))
            torch.cuda.current_stream(self.device).wait_event(event)
        plan.stream = stream

    def _check(self, q, k, v, out, lse, plan: DevicePlan, k_scale=None, v_scale=None) -> None:
        """Refuse what the kernels cannot run right (run() calls it when its key changes)."""
        spec, torch = self.spec, self.torch
        expect_q = (plan.batch_size, spec.num_qo_heads, spec.head_dim)
        require(tuple(q.shape) == expect_q, f"q has shape {tuple(q.shape)}, expected {expect_q}")
        require(tuple(out.shape) == expect_q, f"out has shape {tuple(out.shape)}, expected {expect_q}")
        for name, t, want in (("q", q, self.torch_dtype), ("k_cache", k, self.cache_dtype),
                              ("v_cache", v, self.cache_dtype), ("out", out, self.torch_dtype)):
            if t.dtype != want:
                fp8 = "float8" in str(t.dtype)
                hint = (f"; an FP8 {'query is' if name in ('q', 'out') else 'cache needs'} "
                        + ("not supported (the engine keeps queries and outputs in fp16/bf16)" if name in ("q", "out")
                           else "float8_e4m3fn codes and AttentionSpec(kv_dtype='float8_e4m3')"
                           + (" (e5m2 is not supported)" if "e5m2" in str(t.dtype) else ""))) if fp8 else ""
                raise PKVError(f"{name} has dtype {t.dtype}, expected {want}{hint}")
            require(t.device == self.device, f"{name} is on {t.device}, expected {self.device}")
        if spec.fp8_kv:
            self._check_scales(k_scale, v_scale)
        else:
            require(k_scale is None and v_scale is None,
                    f"k_scale/v_scale are for an FP8 cache; this engine's cache is {spec.cache_dtype}")
        if lse is not None:
            expect_lse = (plan.batch_size, spec.num_qo_heads)
            require(tuple(lse.shape) == expect_lse and lse.dtype == self.torch.float32 and lse.is_contiguous()
                    and lse.device == self.device,
                    f"lse must be a contiguous float32 tensor {list(expect_lse)} on {self.device}, got "
                    f"{lse.dtype} {list(lse.shape)} on {lse.device}")
        kv_shape = (spec.page_size, spec.num_kv_heads, spec.head_dim)
        require(tuple(k.shape[1:]) == kv_shape and k.dim() == 4,
                f"k_cache has shape {tuple(k.shape)}, expected [num_pages, {', '.join(map(str, kv_shape))}]")
        require(tuple(v.shape) == tuple(k.shape) and v.stride() == k.stride(),
                "v_cache must have k_cache's shape and strides")
        require(k.shape[0] >= plan.num_pages,
                f"k_cache has {k.shape[0]} pages; the plan's block table addresses page ids up to "
                f"{plan.num_pages - 1} (the batch's num_pages is {plan.num_pages})")
        per16 = 16 // k.element_size()  # elements per 16-byte chunk: token rows start on one
        require(k.stride(3) == 1 and k.stride(2) == spec.head_dim and k.stride(1) % per16 == 0
                and k.stride(0) % per16 == 0,
                f"k_cache strides {k.stride()} unsupported: need [*, {per16}k, head_dim, 1] (16-byte token rows)")
        for name, t in (("q", q), ("out", out)):
            require(t.stride(2) == 1 and t.stride(1) % 2 == 0 and t.stride(0) % 2 == 0,
                    f"{name} strides {t.stride()} unsupported: need an even-strided [B, H, D] with contiguous D")
        require(q.data_ptr() % 4 == 0 and out.data_ptr() % 4 == 0 and k.data_ptr() % 16 == 0
                and v.data_ptr() % 16 == 0, "q and out must be 4-byte and k/v 16-byte aligned")
        esize, ks = k.element_size(), k.stride()
        require(ks[0] * esize < 2**32 and ((spec.page_size - 1) * ks[1] + spec.head_dim) * esize < 2**32,
                f"k_cache strides {ks} unsupported: the kernels address a page and a token row in it with "
                f"32-bit byte offsets (page stride x {esize} B must stay below 4 GiB)")

    def _check_scales(self, k_scale, v_scale) -> None:
        """An FP8 cache's scales: float32 tensors on the device, one value or one per KV head (both
        alike), finite and > 0 (their values are read once here, a host sync; not inside a graph
        capture, where the kernels read whatever the tensors then hold)."""
        torch, hkv = self.torch, self.spec.num_kv_heads
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            require(t is not None, f"an FP8 cache needs {name}: a float32 tensor of 1 or {hkv} (num_kv_heads) values "
                                   f"on {self.device}")
            require(isinstance(t, torch.Tensor), f"{name} must be a float32 tensor on {self.device} (a Python "
                                                 f"number would be baked into a captured graph), got {type(t).__name__}")
            require(t.dtype == torch.float32 and t.device == self.device and t.numel() in (1, hkv)
                    and t.dim() <= 1 and (t.dim() == 0 or t.stride(0) == 1),
                    f"{name} must be a contiguous float32 tensor of 1 or {hkv} (num_kv_heads) values on "
                    f"{self.device}, got {t.dtype} {list(t.shape)} on {t.device}")
        require(k_scale.numel() == v_scale.numel(), f"k_scale and v_scale must both be per tensor or both per KV head, "
                                                    f"got {k_scale.numel()} and {v_scale.numel()} values")
        if not (k_scale.is_cuda and torch.cuda.is_current_stream_capturing()):
            for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
                bad = ~(torch.isfinite(t) & (t > 0))
                if bool(bad.any()):
                    raise PKVError(f"{name} must be finite and > 0, got {float(t.reshape(-1)[bad.reshape(-1)][0])}")

    def run(self, q, cache, plan: DevicePlan, out, lse=None, check: bool = True, *, k_scale=None,
            v_scale=None) -> None:
        """One layer of decode attention, launched on torch's current stream.

        Parameters
        ----------
        q : torch.Tensor
            [B, Hq, D] of the engine's dtype, on its device; D contiguous, even strides.
        cache : tuple of torch.Tensor
            (K, V), or (K, V, k_scale, v_scale) as the backend interface passes an FP8 cache;
            K and V each [num_pages, page_size, Hkv, D] (NHD), strides [8a, 8b, D, 1] elements,
            16-byte aligned, page stride below 4 GiB; at least ``plan.num_pages`` pages. K and V
            may be views into one buffer (e.g. ``kv[:, 0]`` and ``kv[:, 1]`` of a
            [pages, 2, P, Hkv, D] cache); they must share strides.
        plan : DevicePlan
            This step's plan, from this engine.
        out : torch.Tensor
            [B, Hq, D] of the engine's dtype, written in full.
        lse : torch.Tensor, optional
            float32 [B, Hq], contiguous: written with each (row, query head)'s log-sum-exp of the
            scaled scores, natural log (``logsumexp(sm_scale * q.k)`` over the row's tokens).
        check : bool
            Check the tensors again when anything about them differs from the last call's
            (1.5-3 us of host time); ``False`` skips it for callers that guarantee them (a wrong
            tensor is then a wrong answer, not an error).
        k_scale, v_scale : torch.Tensor, optional
            An FP8 cache's (spec.kv_dtype ``float8_e4m3``) scales, required there and refused
            otherwise: float32 on the device, one value (per tensor) or [Hkv] (per KV head), both
            alike, finite and > 0; a stored code c of KV head h stands for value(c) x scale[h].
            The kernels read them at every launch: a replayed graph uses their current values.

        Notes
        -----
        A plan's partial states and arrival counters serve one run at a time. run() on a stream
        other than the plan's last one first orders that stream after the plan's last launch
        (one event, only when the stream changes), so two streams may share a plan and their runs
        of it serialise; for runs that overlap, plan once per stream. Host threads may share a
        plan: its parameter blocks are written and launched under the plan's lock.
        """
        k, v = cache[0], cache[1]
        if len(cache) != 2:  # the backend interface's FP8 cache: (K, V, k_scale, v_scale)
            require(len(cache) == 4 and k_scale is None and v_scale is None,
                    "cache is (K, V) or (K, V, k_scale, v_scale), the scales given once")
            k_scale, v_scale = cache[2], cache[3]
        q_ptr, k_ptr, v_ptr, o_ptr = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
        lse_ptr = 0 if lse is None else lse.data_ptr()
        # -1: not a tensor, so the checks below run and refuse it
        ks_ptr = 0 if k_scale is None else k_scale.data_ptr() if hasattr(k_scale, "data_ptr") else -1
        vs_ptr = 0 if v_scale is None else v_scale.data_ptr() if hasattr(v_scale, "data_ptr") else -1
        qs, os_, ks = q.stride(), out.stride(), k.stride()
        if check:  # full checks only when anything they look at differs from the last call's
            key = (q.shape, qs, q.dtype, q.device, k.shape, ks, k.dtype, k.device, v.shape, v.stride(), v.dtype,
                   v.device, out.shape, os_, out.dtype, out.device, plan.batch_size, plan.num_pages,
                   (q_ptr | o_ptr) & 3, (k_ptr | v_ptr) & 15,
                   None if lse is None else (lse.shape, lse.stride(), lse.dtype, lse.device),
                   ks_ptr, vs_ptr)
            if key != self._last_check:
                self._check(q, k, v, out, lse, plan, k_scale, v_scale)
                self._last_check = key
        s_sh = 1 if ks_ptr and k_scale.numel() > 1 else 0
        stream = self._raw_stream(self._device_index)
        with plan.lock:
            if stream != plan.stream:
                self._follow_stream(plan, stream)
            for launch in plan.run_launches:
                args = launch.args
                if launch.kind == "merge":
                    args.out, args.lse = o_ptr, lse_ptr
                    args.o_sb, args.o_sh = os_[0], os_[1]
                    self._launch(launch, stream)
                    continue
                PTRS.pack_into(args, 0, q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, ks_ptr, vs_ptr)
                STRIDES.pack_into(args, args.strides_offset, ks[0], ks[1], qs[0], qs[1], os_[0], os_[1], s_sh)
                self._launch(launch, stream)

    def device_items(self, plan: DevicePlan) -> np.ndarray:
        """The plan's items as the kernels see them: a host copy, int32 [n, 4] (plan.Plan.items'
        words); synchronises."""
        items = plan.view("items").cpu().numpy()
        n = plan.host_plan.num_items if plan.host_plan is not None else int(plan.view("num_items").item())
        return items[:n, :4]


_ENGINES: dict = {}


def engine_for(spec: AttentionSpec, device: int | None = None, **options) -> DecodeEngine:
    """A cached DecodeEngine per (spec, CUDA device, options).

    Parameters
    ----------
    spec : AttentionSpec
        The shapes and dtype.
    device : int, optional
        CUDA device index (default: torch's current device, read at each call).
    **options
        DecodeEngine keyword options (``warps``, ``target_items``, ...).
    """
    if device is None:
        import torch

        device = torch.cuda.current_device()
    key = (spec, int(device), tuple(sorted(options.items())))
    engine = _ENGINES.get(key)
    if engine is None:
        engine = _ENGINES[key] = DecodeEngine(spec, int(device), **options)
    return engine
