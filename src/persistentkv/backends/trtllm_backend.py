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
from dataclasses import dataclass
from typing import Any

from ..cache import Batch
from ..errors import PKVError
from ..spec import AttentionSpec
from ..env import cuda_reasons, dtype_reasons, missing_module
from .base import Capabilities
from .torch_sdpa import check_step_tensors

#: FlashInfer's XQA reserves the first 8 MiB of the workspace for semaphores; the rest is scratch
#: for multi-block (split) partial results.
WORKSPACE_BYTES = 256 * 1024 * 1024
XQA_PAGE_SIZES = (16, 32, 64, 128)
XQA_MAJOR_CAPABILITIES = (9, 10, 12)
#: head_dim a multiple of 16 in [16, 256] (flashinfer/jit/xqa.py)
XQA_HEAD_DIMS = tuple(range(16, 257, 16))


@dataclass
class XqaPlan:
    """block_tables int32 [B, W] and seq_lens int32 [B] on the device; max_seq_len = W * P."""

    spec: AttentionSpec
    batch_size: int
    block_tables: Any
    seq_lens: Any
    max_seq_len: int

    def update_lengths(self, lengths) -> None:
        """Follow the rows' lengths (int32 [B] on the device, within the planned block table):
        ``seq_lens`` takes them (``max_seq_len`` covers the reservation). One device copy."""
        self.seq_lens.copy_(lengths)


class TrtllmXqaBackend:
    #: a plan for the reserved pages follows the lengths through seq_lens (XqaPlan.update_lengths)
    capabilities = Capabilities(dtypes=("float16", "bfloat16"), graph="device", head_dims=XQA_HEAD_DIMS,
                                page_sizes=XQA_PAGE_SIZES)

    def __init__(self, name: str = "trtllm-xqa", workspace_bytes: int = WORKSPACE_BYTES, device: str = "cuda"):
        self.name = name
        self.workspace_bytes = int(workspace_bytes)
        self.device = device
        self._workspace = None

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

    def plan(self, batch: Batch) -> XqaPlan:
        import torch

        dev = torch.device(self.device)
        table = batch.padded_block_table()
        self._workspace_buffer()  # allocated here, never inside run()
        return XqaPlan(batch.spec, batch.batch_size, torch.from_numpy(table).to(dev),
                       torch.from_numpy(batch.seq_lens).to(dev), int(table.shape[1]) * batch.spec.page_size)

    def run(self, q, cache, plan: XqaPlan, out) -> None:
        from flashinfer.decode import trtllm_batch_decode_with_kv_cache

        check_step_tensors(plan.spec, plan.batch_size, q, cache, out, self.name)
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
