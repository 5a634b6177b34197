"""``flashinfer-cc`` / ``flashinfer-tc``: FlashInfer's paged decode, CUDA-core or tensor-core kernels.

What a FlashInfer-based server does per decode step (FlashInfer 0.6.x,
``flashinfer.decode.BatchDecodeWithPagedKVCacheWrapper``): ``wrapper.plan(indptr, indices,
last_page_len, Hq, Hkv, D, P, ...)`` from host index arrays once per step (it copies them into the
wrapper's device buffers and runs the host-side split-KV scheduler), then ``wrapper.run(q, (K, V),
out=out)`` once per layer. K and V are read in place in the NHD layout; nothing is copied.

CUDA graphs. FlashInfer supports graphs through ``use_cuda_graph=True`` wrappers: fixed batch size,
caller-owned index buffers that ``plan()`` overwrites in place, and a grid padded to the device's
maximum so that a captured ``run()`` stays valid when a later ``plan()`` changes the lengths. With
``cuda_graph=True`` (the default) this backend keeps one such wrapper per batch size, which is what
a serving stack that replays decode graphs runs, and ``capabilities.graph`` is ``host`` (a host
``plan()`` rewrites the captured buffers in place). ``cuda_graph=False`` gives the plain wrapper
(what the paper timed; the harness uses it for the published protocol), whose ``run()`` is not
promised to be capturable, so ``capabilities.graph`` is ``none`` there.

The plan does not depend on the cache pointer (``plan()`` never sees K/V), so one plan serves
every rotated copy of the cache.

A ``plan()`` rewrites the wrapper's state: a plan object is valid until the next ``plan()`` of the
same wrapper, and ``run()`` with an older one raises rather than computing with the new state.

FP8 caches (``AttentionSpec(kv_dtype="float8_e4m3")``; what FlashInfer 0.6.14's decode.py does):
``plan(..., q_data_type=<fp16/bf16>, kv_data_type=torch.float8_e4m3fn)``, so the query and the
output stay in the spec's dtype (o_data_type defaults to q_data_type) and the kernels convert the
e4m3 codes in registers. The CUDA-core path JITs a decode kernel for that (q, kv) pair; the
tensor-core path's ``backend="auto"`` asks ``determine_attention_backend``, whose
``is_fa3_backend_supported`` says no for an FP8 cache with a non-FP8 query ("FA3 FP8 KV cache
currently requires FP8 query"), so it runs the FA2 prefill kernels with an fp16/bf16 query.
``run(q, (K, V), k_scale=, v_scale=, out=)`` takes the scales as Python floats
(``Optional[float]``): ``sm_scale *= k_scale`` on the host (sm_scale is 1/sqrt(D) from plan; the
result is passed to the kernel as a double), and after the kernel ``out *= v_scale`` (one more
elementwise launch, skipped when v_scale is the float 1.0). So FlashInfer takes one K and one V
scale per tensor: a per-KV-head scale ([Hkv] of distinct values) is refused at run() with one line.
vLLM's FlashInfer backend passes ``layer._k_scale_float`` / ``layer._v_scale_float`` the same way.
Our scales are float32 device tensors, so the adapter reads each one on the host
(:class:`HostScales`) once per memory and version (``tensor._version``, which in-place torch writes
through any view bump), outside CUDA-graph capture; a capture that meets a scale not read before raises
(run the step once eagerly first). A captured graph replays the scale values it was captured
with, as a graph of vLLM's does; device writes that bypass torch (no version bump) are not seen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..cache import Batch
from ..errors import PKVError, require
from ..spec import AttentionSpec
from ..env import cuda_reasons, missing_module
from ..env import torch_dtype
from .base import Capabilities
from .torch_sdpa import check_step_tensors

#: FlashInfer's recommended float workspace ("the recommended size is 128MB"); 256 MiB leaves
#: room for the split-KV partial states of a graph-mode plan (padded to the whole grid).
WORKSPACE_BYTES = 256 * 1024 * 1024
#: GQA group sizes the CUDA-core decode kernel is instantiated for (DISPATCH_GQA_GROUP_SIZE in
#: include/flashinfer/utils.cuh); the tensor-core path (prefill kernels) takes any group size.
CUDA_CORE_GROUP_SIZES = (1, 2, 3, 4, 8)
FLASHINFER_DTYPES = ("float16", "bfloat16")


class HostScales:
    """Python floats of an FP8 cache's k_scale/v_scale tensors, for libraries that take the scales as
    host floats (FlashInfer's decode wrapper, XQA through FlashInfer as vLLM calls it).

    Each scale is read once (a host synchronisation) per memory and version and remembered: the
    key is the tensor's address, device, dtype, shape and strides, so fresh views of the same memory
    (a decode loop's ``scales[layer, 0]``, made anew at every call) find the value read before;
    views share their base's version counter, so an in-place torch write through any of them is
    read again. The memo holds the tensors it read, so their memory cannot be reused by another
    tensor under the same key. A read needed during a CUDA-graph capture raises instead. A tensor of
    several values (per KV head) is accepted only when they are all equal (then it is one scale);
    else a one-line refusal naming ``who`` and ``why``."""

    #: remembered tensors at most (a decode loop has one pair per layer)
    LIMIT = 1024

    def __init__(self, who: str, why: str):
        self.who, self.why = who, why
        self._memo: dict[tuple, tuple[Any, int, float]] = {}

    def pair(self, k_scale, v_scale) -> tuple[float, float]:
        return self.value("k_scale", k_scale), self.value("v_scale", v_scale)

    def value(self, label: str, t) -> float:
        key = (t.data_ptr(), str(t.device), t.dtype, tuple(t.shape), tuple(t.stride()))
        held = self._memo.get(key)
        if held is not None and held[1] == t._version:
            return held[2]
        import torch

        if t.is_cuda and torch.cuda.is_current_stream_capturing():
            raise PKVError(f"{self.who}: {label} was not read before this CUDA-graph capture ({self.why}, so the "
                           f"adapter reads them on the host); run the step once eagerly before capturing it")
        values = [float(x) for x in t.detach().reshape(-1).tolist()]  # one host sync per tensor version
        if any(x != values[0] for x in values):
            raise PKVError(f"{self.who}: per-KV-head {label} ({len(values)} distinct values) is not supported: "
                           f"{self.why}")
        if not (math.isfinite(values[0]) and values[0] > 0):
            raise PKVError(f"{self.who}: {label} must be finite and > 0, got {values[0]!r}")
        if len(self._memo) >= self.LIMIT:
            self._memo.clear()
        self._memo[key] = (t, t._version, values[0])
        return values[0]


@dataclass
class FlashInferPlan:
    """A planned step: which wrapper holds it, and the generation that stays valid."""

    wrapper: Any
    generation: int
    batch_size: int
    spec: AttentionSpec


class FlashInferBackend:
    """FlashInfer batch decode over the shared NHD paged cache."""

    def __init__(self, use_tensor_cores: bool, name: str | None = None, cuda_graph: bool = True,
                 workspace_bytes: int = WORKSPACE_BYTES, device: str = "cuda"):
        self.use_tensor_cores = bool(use_tensor_cores)
        self.name = name or ("flashinfer-tc" if self.use_tensor_cores else "flashinfer-cc")
        self.cuda_graph = bool(cuda_graph)
        self.capabilities = Capabilities(dtypes=FLASHINFER_DTYPES, graph="host" if self.cuda_graph else "none",
                                         kv_dtypes=("float8_e4m3",))
        self.workspace_bytes = int(workspace_bytes)
        self.device = device
        self._workspace = None
        self._plain = None
        self._graph_wrappers: dict[int, tuple[Any, int]] = {}  # batch size -> (wrapper, index capacity)
        self._generation: dict[int, int] = {}  # id(wrapper) -> generation of its current plan
        self._scales = HostScales(self.name, "FlashInfer takes one K and one V scale per tensor, as Python floats")

    def unavailable(self, spec: AttentionSpec) -> list[str]:
        reasons = cuda_reasons() + missing_module("flashinfer")
        reasons += self.capabilities.shape_reasons(spec, "FlashInfer decode")
        if not self.use_tensor_cores and spec.group_size not in CUDA_CORE_GROUP_SIZES:
            reasons.append(f"FlashInfer's CUDA-core decode supports GQA group sizes "
                           f"{CUDA_CORE_GROUP_SIZES}, not {spec.group_size}")
        return reasons

    # -- wrappers ---------------------------------------------------------------------------
    def _float_workspace(self):
        import torch

        if self._workspace is None:
            # "Must be initialized to 0 for its first use."
            self._workspace = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=self.device)
        return self._workspace

    def _wrapper_for(self, batch_size: int, num_indices: int):
        import torch
        from flashinfer.decode import BatchDecodeWithPagedKVCacheWrapper

        if not self.cuda_graph:
            if self._plain is None:
                self._plain = BatchDecodeWithPagedKVCacheWrapper(
                    self._float_workspace(), "NHD", use_tensor_cores=self.use_tensor_cores)
            return self._plain
        held = self._graph_wrappers.get(batch_size)
        if held is not None and held[1] >= num_indices:
            return held[0]
        # Graph-mode buffers are fixed for the wrapper's life; grow by doubling so a trace whose
        # rows lengthen step by step re-creates the wrapper only a few times (never mid-case).
        capacity = max(num_indices, 2 * held[1] if held else num_indices, 1)
        dev = self.device
        wrapper = BatchDecodeWithPagedKVCacheWrapper(
            self._float_workspace(), "NHD", use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
            paged_kv_indptr_buffer=torch.zeros(batch_size + 1, dtype=torch.int32, device=dev),
            paged_kv_indices_buffer=torch.zeros(capacity, dtype=torch.int32, device=dev),
            paged_kv_last_page_len_buffer=torch.zeros(batch_size, dtype=torch.int32, device=dev),
        )
        self._graph_wrappers[batch_size] = (wrapper, capacity)
        return wrapper

    # -- the interface ----------------------------------------------------------------------
    def plan(self, batch: Batch) -> FlashInferPlan:
        import torch

        spec = batch.spec
        wrapper = self._wrapper_for(batch.batch_size, int(batch.kv_indices.size))
        dtype = torch_dtype(spec.dtype)
        kv_dtype = torch.float8_e4m3fn if spec.fp8_kv else dtype
        # Host tensors, as a server passes them: plan() copies them into the device buffers.
        wrapper.plan(
            torch.from_numpy(batch.kv_indptr), torch.from_numpy(batch.kv_indices),
            torch.from_numpy(batch.last_page_len),
            spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.page_size,
            pos_encoding_mode="NONE", q_data_type=dtype, kv_data_type=kv_dtype,
        )
        generation = self._generation.get(id(wrapper), 0) + 1
        self._generation[id(wrapper)] = generation
        return FlashInferPlan(wrapper, generation, batch.batch_size, spec)

    def run(self, q, cache, plan: FlashInferPlan, out) -> None:
        if self._generation.get(id(plan.wrapper)) != plan.generation:
            raise PKVError(f"{self.name}: stale plan (the wrapper was planned again since); plan the step again")
        check_step_tensors(plan.spec, plan.batch_size, q, cache, out, self.name)
        if plan.spec.fp8_kv:
            k_scale, v_scale = self._scales.pair(cache[2], cache[3])
            plan.wrapper.run(q, (cache[0], cache[1]), k_scale=k_scale, v_scale=v_scale, out=out)
            return
        plan.wrapper.run(q, (cache[0], cache[1]), out=out)


def make_cuda_core(**options) -> FlashInferBackend:
    require("use_tensor_cores" not in options, "flashinfer-cc fixes use_tensor_cores=False")
    return FlashInferBackend(False, **options)


def make_tensor_core(**options) -> FlashInferBackend:
    require("use_tensor_cores" not in options, "flashinfer-tc fixes use_tensor_cores=True")
    return FlashInferBackend(True, **options)
