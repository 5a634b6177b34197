"""``flashinfer-cudnn``: cuDNN's paged decode (its SDPA graph) through FlashInfer.

``flashinfer.decode.cudnn_batch_decode_with_kv_cache(q, K, V, scale, workspace, *,
max_sequence_kv, actual_seq_lens_kv, block_tables, is_cuda_graph_compatible, out)`` (FlashInfer
0.7.x, ``flashinfer/cudnn/decode.py``; the cuDNN graph path needs the ``cudnn`` module of
nvidia-cudnn-frontend). FlashInfer's own benchmark put it at 20 us against its FA2 decode's 35 at
B=1 x 8K, 64/8 heads, bf16, page 32, on an H200; here it is validated and timed like every other
backend.

Layout. cuDNN takes K and V as ``[pages, Hkv, P, D]`` tensors with any strides (its graph binds
them by shape and strides); our NHD cache ``[pages, P, Hkv, D]`` is passed as the permuted view
``K.permute(0, 2, 1, 3)``: the same bytes, no copy. The query ``[B, Hq, D]`` and the output (the
query's dtype) are used as they are. The block table is int32 ``[B, W]`` and the lengths int32
``[B, 1, 1, 1]`` on the device, ``max_sequence_kv = W * P``.

Graphs. The lengths are read on the device (cuDNN's ``seq_len_kv`` is not passed by value), so a
plan made for the rows' reserved pages follows growing lengths by one device copy
(``update_lengths``): ``capabilities.graph`` is ``device``, as for XQA. FlashInfer builds and
caches one cuDNN graph per signature (shapes, strides, dtypes, the scale, ``max_sequence_kv``);
the first run() of a signature builds it on the host, so a step is run once eagerly before it is
captured (the harness's warm-up does).

Not supported by this path (``unavailable`` says so, before any launch): an FP8 cache (the
function accepts fp16 and bf16 query and cache only) and a float32 query.
"""

from __future__ import annotations

import math

from ..cache import Batch
from ..env import cuda_reasons, missing_module
from ..spec import AttentionSpec
from .base import Capabilities, TablePlan
from .torch_sdpa import check_step_tensors

#: cuDNN's decode workspace ("128 MB is sufficient for typical decode workloads").
WORKSPACE_BYTES = 128 * 1024 * 1024


class CudnnDecodeBackend:
    #: a plan for the reserved pages follows the lengths through seq_lens (TablePlan.update_lengths: lengths [B, 1, 1, 1])
    capabilities = Capabilities(dtypes=("float16", "bfloat16"), graph="device")

    def __init__(self, name: str = "flashinfer-cudnn", workspace_bytes: int = WORKSPACE_BYTES,
                 device: str = "cuda"):
        self.name = name
        self.workspace_bytes = int(workspace_bytes)
        self.device = device
        self._workspace = None

    def unavailable(self, spec: AttentionSpec) -> list[str]:
        reasons = cuda_reasons() + missing_module("flashinfer")
        if not reasons:
            reasons += missing_module("flashinfer.cudnn.decode")
        # the cudnn-frontend module: without it FlashInfer falls back to bf16-only cubins
        reasons += missing_module("cudnn")
        reasons += self.capabilities.shape_reasons(spec, "cuDNN's paged decode")
        return reasons

    def plan(self, batch: Batch) -> TablePlan:
        import torch

        dev = torch.device(self.device)
        if self._workspace is None:  # allocated here, never inside run()
            self._workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=dev)
        table = batch.padded_block_table()
        lengths = torch.from_numpy(batch.seq_lens).to(device=dev, dtype=torch.int32)
        return TablePlan(batch.spec, batch.batch_size, torch.from_numpy(table).to(dev),
                         lengths.reshape(batch.batch_size, 1, 1, 1).contiguous(),
                         int(table.shape[1]) * batch.spec.page_size)

    def run(self, q, cache, plan: TablePlan, out) -> None:
        from flashinfer.decode import cudnn_batch_decode_with_kv_cache

        check_step_tensors(plan.spec, plan.batch_size, q, cache, out, self.name)
        k, v = cache
        cudnn_batch_decode_with_kv_cache(
            q, k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3), 1.0 / math.sqrt(plan.spec.head_dim), self._workspace,
            max_sequence_kv=plan.max_seq_len, actual_seq_lens_kv=plan.seq_lens, block_tables=plan.block_tables,
            is_cuda_graph_compatible=True, out=out,
        )
