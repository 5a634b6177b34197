"""The ``torch-sdpa`` backend: the naive baseline, and the torch helpers the GPU adapters share.

What a framework without a paged-attention kernel does: gather each row's pages into contiguous
K and V (the gather is part of ``run()``, and is timed as such), then call
``torch.nn.functional.scaled_dot_product_attention``. GQA is done exactly and without repeating
K/V: the G query heads that share a KV head are folded into the query-length axis
(q ``[B, Hkv, G, D]`` against k ``[B, Hkv, L, D]``), which is the same computation because a
decode query attends to every key of its row and no key mask depends on the query.

Rows of unequal length are padded to the widest row's page count; a boolean key mask
``[B, 1, 1, L]`` hides the padding (and the unused tail of each row's last page).

FP8 caches (``AttentionSpec(kv_dtype="float8_e4m3")``, cache ``(K, V, k_scale, v_scale)``): the
gather copies the e4m3 codes (as uint8), then dequantises them into buffers of the query's dtype,
value = code x scale with the scale per tensor or per KV head (converted and multiplied in float32,
rounded once to the query dtype), and SDPA runs on those as on any cache. Two copies and two
multiplies more per run, all device work (no scale value is read on the host).

Works on any torch device (the CPU included, which is how the tests check it against float64).
The plan does not depend on the cache pointer: it holds the block table and the gather buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..cache import Batch
from ..errors import PKVError, require
from ..spec import AttentionSpec
from ..env import missing_module, torch_dtype
from .base import Capabilities

def check_step_tensors(spec: AttentionSpec, batch_size: int, q, cache, out, who: str) -> None:
    """One-line errors for q/out/cache shapes and dtypes that do not match the planned step.

    q, out: [B, Hq, D] of ``spec.dtype``; cache: (K, V), each [pages, P, Hkv, D] of ``spec.dtype``,
    or for an FP8 spec (``spec.fp8_kv``) (K, V, k_scale, v_scale): K and V torch.float8_e4m3fn, the
    scales contiguous float32 tensors of 1 or Hkv values on K's device. Host-side checks only
    (shapes, dtypes, devices; never a scale's value), so they are safe inside a CUDA-graph capture.
    """
    import torch

    if spec.fp8_kv:
        _check_fp8_step_tensors(spec, batch_size, q, cache, out, who)
        return
    if not (isinstance(cache, (tuple, list)) and len(cache) == 2):
        extra = ("; (K, V, k_scale, v_scale) is for an FP8 cache (AttentionSpec(kv_dtype='float8_e4m3'))"
                 if isinstance(cache, (tuple, list)) and len(cache) == 4 else "")
        raise PKVError(f"{who}: cache must be a (K, V) pair, got {_describe_cache(cache)}{extra}")
    for label, t in (("q", q), ("K", cache[0]), ("V", cache[1]), ("out", out)):
        if not isinstance(t, torch.Tensor):
            raise PKVError(f"{who}: {label} must be a torch tensor, got {type(t).__name__}")
    want_q = (batch_size, spec.num_qo_heads, spec.head_dim)
    require(tuple(q.shape) == want_q, f"{who}: q has shape {tuple(q.shape)}, expected {want_q}")
    require(tuple(out.shape) == want_q, f"{who}: out has shape {tuple(out.shape)}, expected {want_q}")
    k, v = cache
    tail = (spec.page_size, spec.num_kv_heads, spec.head_dim)
    require(k.dim() == 4 and tuple(k.shape[1:]) == tail,
            f"{who}: K has shape {tuple(k.shape)}, expected [pages, {', '.join(map(str, tail))}]")
    require(tuple(v.shape) == tuple(k.shape), f"{who}: V shape {tuple(v.shape)} != K shape {tuple(k.shape)}")
    want = torch_dtype(spec.dtype)
    for label, t in (("q", q), ("K", k), ("V", v), ("out", out)):
        require(t.dtype == want, f"{who}: {label} has dtype {t.dtype}, expected {want}")


def _describe_cache(cache) -> str:
    if isinstance(cache, (tuple, list)):
        return f"a {type(cache).__name__} of {len(cache)}"
    return type(cache).__name__


def _check_fp8_step_tensors(spec: AttentionSpec, batch_size: int, q, cache, out, who: str) -> None:
    """check_step_tensors for an FP8 spec: (K, V, k_scale, v_scale)."""
    import torch

    if not (isinstance(cache, (tuple, list)) and len(cache) == 4):
        raise PKVError(f"{who}: an FP8 cache (kv_dtype float8_e4m3) is (K, V, k_scale, v_scale), got "
                       f"{_describe_cache(cache)}")
    for label, t in (("q", q), ("K", cache[0]), ("V", cache[1]), ("out", out)):
        if not isinstance(t, torch.Tensor):
            raise PKVError(f"{who}: {label} must be a torch tensor, got {type(t).__name__}")
    want_q = (batch_size, spec.num_qo_heads, spec.head_dim)
    if tuple(q.shape) != want_q:
        raise PKVError(f"{who}: q has shape {tuple(q.shape)}, expected {want_q}")
    if tuple(out.shape) != want_q:
        raise PKVError(f"{who}: out has shape {tuple(out.shape)}, expected {want_q}")
    k, v, k_scale, v_scale = cache
    tail = (spec.page_size, spec.num_kv_heads, spec.head_dim)
    if k.dim() != 4 or tuple(k.shape[1:]) != tail:
        raise PKVError(f"{who}: K has shape {tuple(k.shape)}, expected [pages, {', '.join(map(str, tail))}]")
    if tuple(v.shape) != tuple(k.shape):
        raise PKVError(f"{who}: V shape {tuple(v.shape)} != K shape {tuple(k.shape)}")
    want = torch_dtype(spec.dtype)
    for label, t in (("q", q), ("out", out)):
        if t.dtype != want:
            raise PKVError(f"{who}: {label} has dtype {t.dtype}, expected {want} (queries and outputs stay in "
                           f"the spec's dtype with an FP8 cache)")
    for label, t in (("K", k), ("V", v)):
        if t.dtype != torch.float8_e4m3fn:
            hint = (" (e5m2 caches are not supported)" if t.dtype == torch.float8_e5m2
                    else " (the spec's kv_dtype is float8_e4m3)")
            raise PKVError(f"{who}: {label} has dtype {t.dtype}, expected torch.float8_e4m3fn{hint}")
    hkv = spec.num_kv_heads
    for label, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() <= 1
                and t.numel() in (1, hkv) and t.is_contiguous() and t.device == k.device):
            got = (f"{t.dtype} {list(t.shape)} on {t.device}" if isinstance(t, torch.Tensor)
                   else type(t).__name__)
            raise PKVError(f"{who}: {label} must be a contiguous float32 tensor of 1 or {hkv} (num_kv_heads) "
                           f"values on {k.device}, got {got}")


@dataclass
class SdpaPlan:
    """Per-step state of the naive baseline.

    table:    int64 [B * W] padded block table, flattened (W = widest row's page count)
    mask:     bool [B, 1, 1, W * P] (True = attend) or None when every row fills W * P tokens
              (update_lengths makes one the first time it is called)
    k_buf:    [B * W, P, Hkv, D] gather buffer for K (reused by every layer); v_buf the same for V
              (uint8 codes for an FP8 cache)
    num_pages: the batch's page-id universe: K and V must have at least this many pages
    k_deq, v_deq: FP8 caches only: [B * W, P, Hkv, D] of the query dtype, the dequantised gather
    """

    spec: AttentionSpec
    batch_size: int
    num_pages: int
    width: int
    table: Any
    mask: Any
    k_buf: Any
    v_buf: Any
    kv_len: int
    k_deq: Any = None
    v_deq: Any = None

    def update_lengths(self, lengths) -> None:
        """Follow the rows' lengths (int32 [B] on the plan's device, each within the W pages the
        plan gathers): the key mask becomes ``position < length``, on the device. A plan made
        without a mask (every row filled its pages) gets one on the first call, so call it once
        before a CUDA-graph capture (the decode loop's warm-up does)."""
        import torch

        if self.mask is None:
            self.mask = torch.empty((self.batch_size, 1, 1, self.kv_len), dtype=torch.bool, device=lengths.device)
        keys = torch.arange(self.kv_len, device=lengths.device)
        torch.lt(keys[None, :], lengths[:, None], out=self.mask.view(self.batch_size, self.kv_len))


class TorchSdpaBackend:
    """Gather + ``scaled_dot_product_attention``; the gather's bytes and time count."""

    #: index_select(out=...) and SDPA: no host sync; SDPA's own temporaries come from torch's
    #: caching allocator, which a CUDA-graph capture pools. A plan for the reserved pages follows
    #: the lengths through its key mask (SdpaPlan.update_lengths).
    capabilities = Capabilities(dtypes=("float16", "bfloat16", "float32", "float64"), graph="device",
                                kv_dtypes=("float8_e4m3",))

    def __init__(self, name: str = "torch-sdpa", device: str | None = None):
        self.name = name
        self.device = device  # None: the device of the cache tensors given to run()/plan()

    def unavailable(self, spec: AttentionSpec) -> list[str]:
        reasons = missing_module("torch")
        if reasons:
            return reasons
        reasons += self.capabilities.shape_reasons(spec, "torch SDPA")
        try:
            self._torch_device()
        except PKVError as exc:  # not a device name, or CUDA asked for where torch sees none
            reasons.append(str(exc))
        return reasons

    def _torch_device(self):
        """The device plans live on: ``device``, else CUDA when torch sees a GPU, else the CPU."""
        import torch

        if self.device is None:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError):
            raise PKVError(f"{self.name}: device {self.device!r} is not a torch device name "
                           "('cpu', 'cuda', 'cuda:N', ...)") from None
        require(dev.type != "cuda" or torch.cuda.is_available(),
                f"{self.name}: device {self.device!r}, but no CUDA device is visible to torch {torch.__version__}")
        return dev

    def plan(self, batch: Batch) -> SdpaPlan:
        import torch

        require(isinstance(batch, Batch), f"{self.name}: batch must be a Batch, got {type(batch).__name__}")
        spec = batch.spec
        dev = self._torch_device()
        counts = np.diff(batch.kv_indptr)
        width = int(counts.max())
        table = torch.from_numpy(batch.padded_block_table(width, fill=0).reshape(-1).astype(np.int64)).to(dev)
        kv_len = width * spec.page_size
        lens = batch.seq_lens.astype(np.int64)
        mask = None
        if not np.all(lens == kv_len):
            positions = np.arange(kv_len, dtype=np.int64)[None, :]
            mask = torch.from_numpy((positions < lens[:, None]).reshape(batch.batch_size, 1, 1, kv_len)).to(dev)
        shape = (batch.batch_size * width, spec.page_size, spec.num_kv_heads, spec.head_dim)
        dtype = torch_dtype(spec.dtype)
        if spec.fp8_kv:  # codes gathered as uint8, dequantised into the query dtype
            return SdpaPlan(spec, batch.batch_size, batch.num_pages, width, table, mask,
                            torch.empty(shape, dtype=torch.uint8, device=dev),
                            torch.empty(shape, dtype=torch.uint8, device=dev), kv_len,
                            torch.empty(shape, dtype=dtype, device=dev), torch.empty(shape, dtype=dtype, device=dev))
        return SdpaPlan(spec, batch.batch_size, batch.num_pages, width, table, mask,
                        torch.empty(shape, dtype=dtype, device=dev), torch.empty(shape, dtype=dtype, device=dev),
                        kv_len)

    def run(self, q, cache, plan: SdpaPlan, out) -> None:
        import torch
        import torch.nn.functional as F

        if not isinstance(plan, SdpaPlan):
            raise PKVError(f"{self.name}: plan must be what plan() returned, got {type(plan).__name__}")
        spec = plan.spec
        check_step_tensors(spec, plan.batch_size, q, cache, out, self.name)
        k_cache, v_cache = cache[0], cache[1]
        # index_select past the last page is an IndexError on the CPU and a device-side assert
        # on a GPU; the tensors on another device than the plan, a raw RuntimeError. (if/raise:
        # run() is timed, and require() would format its message on every call.)
        if k_cache.shape[0] < plan.num_pages:
            raise PKVError(f"{self.name}: K has {k_cache.shape[0]} pages, the plan's batch addresses "
                           f"{plan.num_pages}")
        for label, t in (("q", q), ("K", k_cache), ("V", v_cache), ("out", out)):
            if t.device != plan.table.device:
                raise PKVError(f"{self.name}: {label} is on {t.device}, the plan on {plan.table.device}")
        B, Hkv, D = plan.batch_size, spec.num_kv_heads, spec.head_dim
        if plan.k_deq is None:
            torch.index_select(k_cache, 0, plan.table, out=plan.k_buf)
            torch.index_select(v_cache, 0, plan.table, out=plan.v_buf)
            k_gathered, v_gathered = plan.k_buf, plan.v_buf
        else:  # FP8: gather the codes, then value = code x scale (per tensor or per KV head)
            # (check_step_tensors: the scales are on K's device, checked against the plan's above)
            for codes, scale, buf, deq in ((k_cache, cache[2], plan.k_buf, plan.k_deq),
                                           (v_cache, cache[3], plan.v_buf, plan.v_deq)):
                torch.index_select(codes.view(torch.uint8), 0, plan.table, out=buf)
                deq.copy_(buf.view(torch.float8_e4m3fn))
                deq.mul_(scale.view(1, 1, -1, 1))
            k_gathered, v_gathered = plan.k_deq, plan.v_deq
        # [B*W, P, Hkv, D] -> [B, L, Hkv, D] -> [B, Hkv, L, D] (a strided view, no copy)
        k = k_gathered.view(B, plan.kv_len, Hkv, D).transpose(1, 2)
        v = v_gathered.view(B, plan.kv_len, Hkv, D).transpose(1, 2)
        qg = q.view(B, Hkv, spec.group_size, D)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=plan.mask, scale=1.0 / math.sqrt(D))
        out.copy_(o.reshape(B, spec.num_qo_heads, D))
