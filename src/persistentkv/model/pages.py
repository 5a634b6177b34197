"""The paged cache of a decode loop: one tensor for every layer's K and V, and its page pool.

    kv = PagedKV(shape, num_pages, page_size=16, dtype=torch.float16, device="cuda")
    k, v = kv.layer(l)      # layer l's [pages, P, Hkv, D] views
    kv.cache_of(l)          # what every backend reads: (K, V), or (K, V, k_scale, v_scale) when FP8
    pages = kv.pool.reserve(request_id, tokens)   # a row's physical pages, in logical order

Loops that share a cache share its rows' pages (PagePool): every backend reads the same bytes.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from ..errors import require
from ..traces import PAGE_SEED_OFFSET, TorchCompatibleRNG
from .llama import resolve_device
from ..fp8 import quantize_e4m3
from .shape import Footprint, ModelShape, check_fits


class PagePool:
    """Physical page ids of one cache, reserved per row and given back when it leaves.

    The free list starts as a seeded permutation (``seed + 99``, as persistentkv.cache
    allocates), so a row's pages are scattered; released pages go to its end. Loops that share a
    cache share its rows: a second reservation of a row takes the pages it already holds (the
    same bytes for every backend), and they return when the last holder releases them.
    """

    def __init__(self, num_pages: int, page_size: int, seed: int = 0):
        require(num_pages >= 1, f"a page pool needs at least one page, got {num_pages}")
        self.num_pages, self.page_size = int(num_pages), int(page_size)
        perm = TorchCompatibleRNG(int(seed) + PAGE_SEED_OFFSET).randperm(self.num_pages)
        self._free = deque(int(p) for p in perm)
        self._owned: dict[int, np.ndarray] = {}
        self._holders: dict[int, int] = {}

    def reserve(self, rid: int, tokens: int) -> np.ndarray:
        """int32 [ceil(tokens / P)] pages for row ``rid``, in logical order."""
        count = math.ceil(int(tokens) / self.page_size)
        if rid in self._owned:
            held = self._owned[rid]
            require(held.size == count, f"row {rid} holds {held.size} pages; another reservation asks for {count}")
            self._holders[rid] += 1
            return held
        require(count <= len(self._free), f"row {rid} needs {count} pages for {tokens} tokens; "
                                          f"{len(self._free)} of {self.num_pages} are free")
        pages = np.array([self._free.popleft() for _ in range(count)], dtype=np.int32)
        self._owned[rid], self._holders[rid] = pages, 1
        return pages

    def release(self, rid: int) -> None:
        require(rid in self._owned, f"row {rid} holds no pages")
        self._holders[rid] -= 1
        if not self._holders[rid]:
            del self._holders[rid]
            self._free.extend(int(p) for p in self._owned.pop(rid))

    def pages(self, rid: int) -> np.ndarray:
        return self._owned[rid]

    @property
    def free(self) -> int:
        return len(self._free)


class PagedKV:
    """One paged cache per layer: ``cache`` [L, 2, pages, P, Hkv, D] of ``dtype`` on ``device``.

    ``layer(l)`` is layer l's (K, V), each [pages, P, Hkv, D] (strides [P*Hkv*D, Hkv*D, D, 1]:
    what every backend reads; the engine's page stride stays far below 4 GiB);
    ``flat(l)`` the same as [pages * P, Hkv, D], the rows the append writes.

    ``kv_dtype="float8_e4m3"``: the cache holds e4m3 codes (torch.float8_e4m3fn) and ``scales``
    float32 [L, 2, S] (S = 1: per tensor, or Hkv: per KV head) on the device, layer l's K and V
    scales at ``scales[l, 0]`` and ``scales[l, 1]``; ``dtype`` stays the model's (queries,
    appended rows). Default scales are 1 (what a server without calibrated scales uses); a
    caller sets calibrated ones before the first append (``scales.copy_(...)``: a captured step
    reads them in place).
    """

    def __init__(self, shape: ModelShape, num_pages: int, page_size: int, dtype, device, seed: int = 0,
                 kv_dtype: str | None = None, scales=None):
        import torch

        from ..spec import FP8_KV

        require(kv_dtype in (None, FP8_KV), f"kv_dtype must be None (the model's dtype) or {FP8_KV}, got {kv_dtype!r}")
        self.shape, self.page_size, self.dtype = shape, int(page_size), dtype
        self.kv_dtype = kv_dtype
        self.cache_dtype = torch.float8_e4m3fn if kv_dtype else dtype
        self.device = resolve_device(device)
        if self.device.type == "cuda":
            from ..measure.device import TorchDevice

            item = torch.empty((), dtype=self.cache_dtype).element_size()
            size = 2 * shape.num_layers * int(num_pages) * self.page_size * shape.num_kv_heads * shape.head_dim * item
            check_fits(Footprint(0, size, 0), TorchDevice(str(self.device)).free_bytes(),
                       f"a paged cache of {num_pages} pages x {shape.num_layers} layers")
        # zeros, not empty: torch-sdpa gathers whole pages and its masked-out slots still multiply
        # their V (0 x NaN of stale memory is NaN)
        self.cache = torch.zeros((shape.num_layers, 2, int(num_pages), self.page_size, shape.num_kv_heads,
                                  shape.head_dim), dtype=self.cache_dtype, device=self.device)
        self.scales = None
        if kv_dtype:
            self.scales = torch.ones((shape.num_layers, 2, 1), dtype=torch.float32, device=self.device)
            if scales is not None:
                scales = torch.as_tensor(scales, dtype=torch.float32, device=self.device)
                require(scales.dim() == 3 and tuple(scales.shape[:2]) == (shape.num_layers, 2)
                        and scales.shape[2] in (1, shape.num_kv_heads),
                        f"scales must be [layers, 2, 1 or num_kv_heads] = [{shape.num_layers}, 2, 1 or "
                        f"{shape.num_kv_heads}], got {list(scales.shape)}")
                require(bool(torch.isfinite(scales).all()) and bool((scales > 0).all()),
                        "scales must be finite and > 0")
                self.scales = scales.contiguous()
        else:
            require(scales is None, "scales are for an FP8 cache (kv_dtype='float8_e4m3')")
        self.pool = PagePool(num_pages, page_size, seed)

    @property
    def num_pages(self) -> int:
        return int(self.cache.shape[2])

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def layer(self, l: int):
        return self.cache[l, 0], self.cache[l, 1]

    def layer_scales(self, l: int):
        """Layer l's (k_scale, v_scale) of an FP8 cache, float32 [S] views; (None, None) otherwise."""
        return (None, None) if self.scales is None else (self.scales[l, 0], self.scales[l, 1])

    def cache_of(self, l: int) -> tuple:
        """Layer l's cache as a backend's run() takes it: (K, V), or (K, V, k_scale, v_scale)."""
        if self.scales is None:
            return self.cache[l, 0], self.cache[l, 1]
        return self.cache[l, 0], self.cache[l, 1], self.scales[l, 0], self.scales[l, 1]

    def flat(self, l: int):
        s = self.shape
        return (self.cache[l, 0].view(-1, s.num_kv_heads, s.head_dim),
                self.cache[l, 1].view(-1, s.num_kv_heads, s.head_dim))

    def fill_random(self, seed: int) -> None:
        """Standard normals in every page (speed runs: the prompt's K/V instead of a prefill)."""
        import torch

        gen = torch.Generator(device=self.device)
        gen.manual_seed(int(seed))
        for l in range(self.shape.num_layers):
            if self.scales is None:
                self.cache[l].normal_(generator=gen)
                continue
            values = torch.empty(self.cache[l].shape, dtype=self.dtype, device=self.device).normal_(generator=gen)
            # cache[l] is [2, pages, P, Hkv, D]; scales[l] is [2, 1 or Hkv]
            self.cache[l].copy_(quantize_e4m3(values, self.scales[l].view(2, 1, 1, -1, 1)))
