"""``trtllm-xqa`` (TensorRT-LLM's XQA decode kernel through FlashInfer) and ``trtllm-native``.

trtllm-xqa. ``flashinfer.decode.trtllm_batch_decode_with_kv_cache(query, (K, V), workspace,
block_tables, seq_lens, max_seq_len, bmm1_scale, bmm2_scale, out=out, kv_layout="NHD",
backend="xqa")`` (FlashInfer 0.6.x). Layouts: with ``backend="xqa"`` it forwards to
``xqa_batch_decode_with_kv_cache``, whose kernel reads K/V as ``[pages, P, Hkv, D]`` (NHD) in
place, or HND through a transposed view; our NHD cache is read as it is (the function's default
``kv_layout`` is "HND", so the adapter passes "NHD" explicitly). Constraints from
flashinfer/jit/xqa.py: fp16/bf16 input, page size in {16, 32, 64, 128}, head_dim a multiple of
16 in [16, 256]; flashinfer/xqa.py: compute capability 9.x, 10.x or 12.x.

Scales: XQA computes with q_scale = bmm1_scale / (bmm2_scale * o_scale) * sqrt(D), so
bmm1_scale = 1/sqrt(D) and bmm2_scale = 1 give plain softmax(q.k / sqrt(D)) v.

FP8 caches (``AttentionSpec(kv_dtype="float8_e4m3")``; FlashInfer 0.6.14 flashinfer/xqa.py,
csrc/xqa/mha_sm90.cu). K and V are passed as torch.float8_e4m3fn tensors and the query stays
fp16/bf16 (xqa(): "Data type should match query tensor or be torch.float8_e4m3fn, in which case
xqa will run fp8 calculation"; vLLM 0.26: "On SM90, XQA decode requires BF16/FP16-Q even with FP8
KV cache"). The kernel chooses its own math: on compute capability 9.x an FP8 cache runs
``mha_sm90.cu`` with MathElem = e4m3, which converts the query to e4m3 inside the kernel (no
scale: q_scale is applied to q.k afterwards) and the softmax weights too (x 448), so this
baseline's error is of the FP8-query class, not the fp16 one; we pass the query as a server does
and let the validation report that error. Scales: XQA has one ``kv_scale`` for K and V; through
``trtllm_batch_decode_with_kv_cache`` the adapter passes bmm1_scale = k_scale / sqrt(D) (q_scale
1) and bmm2_scale = v_scale, so kv_scale = v_scale and q_scale = k_scale / v_scale * sqrt(D), and
the kernel's q.k scale q_scale * kv_scale / sqrt(D) = k_scale / sqrt(D). FlashInfer 0.6.14 takes
these as floats or float32 device tensors, of which its kernel reads element 0 only; the adapter
passes Python floats as vLLM's FlashInfer backend does (``layer._k_scale_float``), read on the host
once per scale memory and version outside CUDA-graph capture (flashinfer_backend.HostScales; a
graph replays the values it was captured with). Per-KV-head scales of distinct values are refused
at run() with one line.

There is no host planning step in this API: a TensorRT-LLM server keeps block tables and
sequence lengths on the device. ``plan()`` uploads them (int32 ``[B, W]`` and ``[B]``) once per
step; ``run()`` launches the kernel only (no allocation, no sync: graph-capturable). The workspace
(semaphores + scratch) must start zeroed; the kernel leaves its semaphores reset.
The plan does not depend on the cache pointer.

trtllm-native. Only where ``tensorrt_llm`` imports. TensorRT-LLM's own attention op needs its
engine-side metadata (KV-cache manager, attention metadata objects); an adapter to it is not
written (it could not be tested on the hosts we have), so even where the package imports this
backend reports that, rather than pretending. XQA through FlashInfer is TensorRT-LLM's decode
kernel and is measured as ``trtllm-xqa``.
"""

from __future__ import annotations

import math

from ..cache import Batch
from ..errors import PKVError
from ..spec import AttentionSpec
from ..env import cuda_reasons, dtype_reasons, missing_module
from .base import Capabilities, TablePlan
from .flashinfer_backend import HostScales
from .torch_sdpa import check_step_tensors

#: FlashInfer's XQA reserves the first 8 MiB of the workspace for semaphores; the rest is scratch
#: for multi-block (split) partial results.
WORKSPACE_BYTES = 256 * 1024 * 1024
XQA_PAGE_SIZES = (16, 32, 64, 128)
XQA_MAJOR_CAPABILITIES = (9, 10, 12)
#: head_dim a multiple of 16 in [16, 256] (flashinfer/jit/xqa.py)
XQA_HEAD_DIMS = tuple(range(16, 257, 16))


class TrtllmXqaBackend:
    #: a plan for the reserved pages follows the lengths through seq_lens (TablePlan.update_lengths)
    capabilities = Capabilities(dtypes=("float16", "bfloat16"), graph="device", head_dims=XQA_HEAD_DIMS,
                                page_sizes=XQA_PAGE_SIZES, kv_dtypes=("float8_e4m3",), fp8_query=True)

    def __init__(self, name: str = "trtllm-xqa", workspace_bytes: int = WORKSPACE_BYTES, device: str = "cuda"):
        self.name = name
        self.workspace_bytes = int(workspace_bytes)
        self.device = device
        self._workspace = None
        self._scales = HostScales(self.name, "XQA takes one K and one V scale per tensor (its kernel reads one "
                                             "kv_scale)")

    def unavailable(self, spec: AttentionSpec) -> list[str]:
        reasons = cuda_reasons()
        if not reasons:
            import torch

            major = torch.cuda.get_device_capability()[0]
            if major not in XQA_MAJOR_CAPABILITIES:
                reasons.append(f"XQA runs on compute capability {XQA_MAJOR_CAPABILITIES}.x, this GPU is {major}.x")
        reasons += missing_module("flashinfer")
        caps = self.capabilities
        reasons += dtype_reasons(spec, caps.dtypes, "XQA")
        if spec.cache_dtype != spec.dtype and spec.cache_dtype not in caps.kv_dtypes:
            reasons.append(f"XQA does not read a {spec.cache_dtype} KV cache")
        if spec.page_size not in caps.page_sizes:
            reasons.append(f"XQA supports page sizes {caps.page_sizes}, not {spec.page_size}")
        if spec.head_dim not in caps.head_dims:
            reasons.append(f"XQA needs head_dim a multiple of 16 in [16, 256], not {spec.head_dim}")
        return reasons

    def _workspace_buffer(self):
        import torch

        if self._workspace is None:
            self._workspace = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=self.device)
        return self._workspace

    def plan(self, batch: Batch) -> TablePlan:
        import torch

        dev = torch.device(self.device)
        table = batch.padded_block_table()
        self._workspace_buffer()  # allocated here, never inside run()
        return TablePlan(batch.spec, batch.batch_size, torch.from_numpy(table).to(dev),
                       torch.from_numpy(batch.seq_lens).to(dev), int(table.shape[1]) * batch.spec.page_size)

    def run(self, q, cache, plan: TablePlan, out) -> None:
        from flashinfer.decode import trtllm_batch_decode_with_kv_cache

        check_step_tensors(plan.spec, plan.batch_size, q, cache, out, self.name)
        if plan.spec.fp8_kv:
            k_scale, v_scale = self._scales.pair(cache[2], cache[3])
            trtllm_batch_decode_with_kv_cache(
                q, (cache[0], cache[1]), self._workspace, plan.block_tables, plan.seq_lens, plan.max_seq_len,
                bmm1_scale=k_scale / math.sqrt(plan.spec.head_dim), bmm2_scale=v_scale, out=out,
                kv_layout="NHD", backend="xqa",
            )
            return
        trtllm_batch_decode_with_kv_cache(
            q, (cache[0], cache[1]), self._workspace, plan.block_tables, plan.seq_lens, plan.max_seq_len,
            bmm1_scale=1.0 / math.sqrt(plan.spec.head_dim), bmm2_scale=1.0, out=out,
            kv_layout="NHD", backend="xqa",
        )


class TrtllmNativeBackend:
    """TensorRT-LLM's own attention op: reported, not run (see the module docstring)."""

    capabilities = Capabilities(dtypes=("float16", "bfloat16"), graph="none")

    def __init__(self, name: str = "trtllm-native"):
        self.name = name

    def unavailable(self, spec: AttentionSpec) -> list[str]:
        reasons = missing_module("tensorrt_llm")
        if reasons:
            return reasons + ["TensorRT-LLM is not on the public package index (only a stub); "
                              "its XQA kernel is measured as trtllm-xqa"]
        return ["tensorrt_llm imports, but no adapter to its native attention op is implemented; "
                "its XQA decode kernel is measured as trtllm-xqa"]

    def plan(self, batch: Batch):
        raise PKVError(f"{self.name} is unavailable: {'; '.join(self.unavailable(batch.spec))}")

    def run(self, q, cache, plan, out) -> None:
        raise PKVError(f"{self.name} is unavailable")
