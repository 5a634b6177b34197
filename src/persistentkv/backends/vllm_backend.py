"""``vllm-fa3``: vLLM's Hopper decode path, FlashAttention-3 through ``vllm.vllm_flash_attn``.

What vLLM's FlashAttention backend does per decode step, the same in 0.26 and 0.34 (vllm/v1/
attention/backends/flash_attn.py, ``FlashAttentionMetadataBuilder.build`` and
``FlashAttentionImpl.forward``):

* plan (the metadata builder, once per step): upload the block table ``[B, max pages]`` int32 and
  ``seqused_k`` (each row's length) int32, ``cu_seqlens_q = arange(B + 1)`` (one query token per
  row), and call ``get_scheduler_metadata(batch_size=B, max_seqlen_q=1, max_seqlen_k=N_max,
  num_heads_q=Hq, num_heads_kv=Hkv, headdim=D, cache_seqlens=seqused_k, qkv_dtype=..., cu_seqlens_q=...,
  page_size=P, causal=True, num_splits=max_num_splits)`` (FA3's ahead-of-time tile scheduler);
* run (once per layer): ``flash_attn_varlen_func(q, K, V, out=out, cu_seqlens_q, max_seqlen_q=1,
  seqused_k, max_seqlen_k, softmax_scale, causal=True, block_table, scheduler_metadata,
  fa_version=3, num_splits=max_num_splits)``.

The split cap: with full CUDA graphs vLLM sets ``max_num_splits =
attention_config.flash_attn_max_num_splits_for_cuda_graph`` (32 in vLLM 0.26 and 0.34) for every batch
that fits its graph capture sizes, "so that large enough intermediate buffers are pre-allocated
during capture"; without graphs it passes 0 (FA3's own heuristic). Our batches (B <= 512) all
fit, so the default here is 32, the path a graph-replaying vLLM server takes on Hopper.

Decode is causal in vLLM; with one query token per row FA3 treats causal and non-causal alike.
The plan does not depend on the cache pointer: ``get_scheduler_metadata`` sees lengths only.
``run()`` allocates small temporaries (softmax LSE, split accumulators) through torch's caching
allocator, which a CUDA-graph capture pools, as vLLM's own graphs do; it never synchronises.

FP8 caches (``AttentionSpec(kv_dtype="float8_e4m3")``), as vLLM 0.26 and 0.34 run them on Hopper.
FA3 needs the query in the cache's dtype (hopper/flash_api.cpp, mha_fwd: "query and key must have the
same dtype") and then writes bfloat16 only ("For FP8 input, output must have dtype BF16"), so
vLLM quantises the query in the attention layer (static per-tensor FP8 with ``layer._q_scale``,
1.0 unless a checkpoint calibrated it) and passes ``q_descale``/``k_descale``/``v_descale`` as
``scale.expand((B, Hkv))`` views (flash_attn.py: "flash-attn expect the size of {q,k,v}_descale
to be (num_sequences, num_kv_heads)"; flash_api.cpp reads them through their strides, so
per-tensor [1] and per-KV-head [Hkv] scales both work), and plans with
``get_scheduler_metadata(qkv_dtype=float8_e4m3fn)``. This adapter does the same: ``plan()`` makes
a float8_e4m3fn query buffer, a clamp buffer and ``q_descale`` (ones, [B, Hkv]); ``run()``
quantises q into the buffer (clamped to +-448, then rounded to e4m3, q_scale 1, as vLLM's
QuantFP8 with scale 1), and passes ``k_scale``/``v_scale`` as ``reshape(1, -1).expand(B, Hkv)``
views (no copy, read by the kernel at every launch, so a replayed graph follows new values).
The error is therefore of the FP8-query class (the query rounded to e4m3; FA3's FP8 kernel also
runs P.V in FP8), not the bf16 one; the validation reports it. A float16 spec with an FP8 cache
is unavailable (FA3 would write bfloat16, which vLLM's float16 models do not take either).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..cache import Batch
from ..spec import AttentionSpec
from ..env import cuda_reasons, missing_module
from ..env import torch_dtype
from ..fp8 import E4M3_MAX
from .base import Capabilities
from .torch_sdpa import check_step_tensors

#: vLLM 0.26 AttentionConfig.flash_attn_max_num_splits_for_cuda_graph.
VLLM_CUDA_GRAPH_MAX_SPLITS = 32
FA_VERSION = 3
FA3_MAJOR = 9


@dataclass
class VllmPlan:
    """Device metadata of one step (all int32 on the GPU).

    block_table:  [B, W], W = widest row's page count
    seqused_k:    [B], each row's length
    cu_seqlens_q: [B + 1], arange (one query token per row)
    scheduler_metadata: FA3's tile-scheduler buffer from get_scheduler_metadata
    """

    spec: AttentionSpec
    batch_size: int
    max_seqlen_k: int
    block_table: Any
    seqused_k: Any
    cu_seqlens_q: Any
    scheduler_metadata: Any
    num_splits: int
    q_fp8: Any = None       # FP8 caches: float8_e4m3fn [B, Hq, D], the quantised query
    q_clamped: Any = None   # FP8 caches: [B, Hq, D] of the spec's dtype, the query clamped to +-448
    q_descale: Any = None   # FP8 caches: float32 ones [B, Hkv]

    def update_lengths(self, lengths) -> None:
        """Follow the rows' lengths (int32 [B] on the device, within the planned block table):
        ``seqused_k`` takes them; block table, ``max_seqlen_k`` and the FA3 scheduler metadata
        stay the ones planned for the reservation. One device copy (capturable)."""
        self.seqused_k.copy_(lengths)


class VllmFA3Backend:
    #: a plan for the reserved pages follows the lengths through seqused_k (VllmPlan.update_lengths)
    capabilities = Capabilities(dtypes=("float16", "bfloat16"), graph="device", kv_dtypes=("float8_e4m3",),
                                fp8_query=True)

    def __init__(self, name: str = "vllm-fa3", max_num_splits: int = VLLM_CUDA_GRAPH_MAX_SPLITS,
                 device: str = "cuda"):
        self.name = name
        self.max_num_splits = int(max_num_splits)
        self.device = device

    def unavailable(self, spec: AttentionSpec) -> list[str]:
        reasons = cuda_reasons() + missing_module("vllm.vllm_flash_attn")
        if not reasons:
            # Asked directly rather than through vllm's fa_version_unsupported_reason(), which goes
            # through vLLM's platform detection: in the wheel-less FA3 slice carried to the H200 that
            # finds no package metadata, falls back to UnspecifiedPlatform and would call FA3
            # unsupported on a Hopper GPU.
            from vllm.vllm_flash_attn import flash_attn_interface as fa

            if not getattr(fa, "FA3_AVAILABLE", False):
                reasons.append(f"vLLM's FA3 extension is not loaded ({getattr(fa, 'FA3_UNAVAILABLE_REASON', '?')})")
            import torch

            major, minor = torch.cuda.get_device_capability()
            if major != FA3_MAJOR:
                reasons.append(f"FA3 runs on compute capability 9.x (Hopper), this GPU is {major}.{minor}")
        reasons += self.capabilities.shape_reasons(spec, "vLLM FA3")
        if spec.fp8_kv and spec.dtype != "bfloat16":
            reasons.append(f"vLLM FA3 with an FP8 cache takes an FP8 query and writes bfloat16 only "
                           f"(flash_api.cpp: 'For FP8 input, output must have dtype BF16'), not {spec.dtype}")
        return reasons

    def plan(self, batch: Batch) -> VllmPlan:
        import torch
        from vllm.vllm_flash_attn import get_scheduler_metadata

        spec = batch.spec
        dev = torch.device(self.device)
        B = batch.batch_size
        block_table = torch.from_numpy(batch.padded_block_table()).to(dev)
        seqused_k = torch.from_numpy(batch.seq_lens).to(dev)
        cu_seqlens_q = torch.arange(B + 1, dtype=torch.int32, device=dev)
        metadata = get_scheduler_metadata(
            batch_size=B, max_seqlen_q=1, max_seqlen_k=batch.max_len,
            num_heads_q=spec.num_qo_heads, num_heads_kv=spec.num_kv_heads, headdim=spec.head_dim,
            cache_seqlens=seqused_k, qkv_dtype=torch.float8_e4m3fn if spec.fp8_kv else torch_dtype(spec.dtype),
            cu_seqlens_q=cu_seqlens_q,
            page_size=spec.page_size, causal=True, window_size=(-1, -1),
            num_splits=self.max_num_splits,
        )
        if spec.fp8_kv:
            shape = (B, spec.num_qo_heads, spec.head_dim)
            return VllmPlan(spec, B, batch.max_len, block_table, seqused_k, cu_seqlens_q, metadata,
                            self.max_num_splits, torch.empty(shape, dtype=torch.float8_e4m3fn, device=dev),
                            torch.empty(shape, dtype=torch_dtype(spec.dtype), device=dev),
                            torch.ones((B, spec.num_kv_heads), dtype=torch.float32, device=dev))
        return VllmPlan(spec, B, batch.max_len, block_table, seqused_k, cu_seqlens_q, metadata,
                        self.max_num_splits)

    def run(self, q, cache, plan: VllmPlan, out) -> None:
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        check_step_tensors(plan.spec, plan.batch_size, q, cache, out, self.name)
        if plan.q_fp8 is not None:
            self._run_fp8(flash_attn_varlen_func, q, cache, plan, out)
            return
        flash_attn_varlen_func(
            q=q, k=cache[0], v=cache[1], out=out,
            cu_seqlens_q=plan.cu_seqlens_q, max_seqlen_q=1,
            seqused_k=plan.seqused_k, max_seqlen_k=plan.max_seqlen_k,
            softmax_scale=1.0 / math.sqrt(plan.spec.head_dim), causal=True,
            block_table=plan.block_table, scheduler_metadata=plan.scheduler_metadata,
            fa_version=FA_VERSION, num_splits=plan.num_splits,
        )

    def _run_fp8(self, flash_attn_varlen_func, q, cache, plan: VllmPlan, out) -> None:
        """An FP8 cache: the query quantised into the plan's buffer (q_scale 1), the scales as
        [B, Hkv] expand views (no copies, no host sync)."""
        import torch

        torch.clamp(q, -E4M3_MAX, E4M3_MAX, out=plan.q_clamped)
        plan.q_fp8.copy_(plan.q_clamped)
        descale = (plan.batch_size, plan.spec.num_kv_heads)
        flash_attn_varlen_func(
            q=plan.q_fp8, k=cache[0], v=cache[1], out=out,
            cu_seqlens_q=plan.cu_seqlens_q, max_seqlen_q=1,
            seqused_k=plan.seqused_k, max_seqlen_k=plan.max_seqlen_k,
            softmax_scale=1.0 / math.sqrt(plan.spec.head_dim), causal=True,
            block_table=plan.block_table, scheduler_metadata=plan.scheduler_metadata,
            fa_version=FA_VERSION, num_splits=plan.num_splits,
            q_descale=plan.q_descale, k_descale=cache[2].reshape(1, -1).expand(descale),
            v_descale=cache[3].reshape(1, -1).expand(descale),
        )
