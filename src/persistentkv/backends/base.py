"""The backend interface: four members, one file per backend.

    name                      short identifier used in results ("flashinfer-tc", "pkv-workqueue")
    unavailable(spec)         reasons (strings) this backend cannot run ``spec`` here; [] when usable
    plan(batch)               per-step metadata, made once per decode step (may upload to the GPU)
    run(q, cache, plan, out)  one layer: q [B, Hq, D], cache = (K, V) each [pages, P, Hkv, D],
                              out [B, Hq, D] preallocated by the caller; no allocation and no host
                              synchronisation inside, so GPU backends can be captured in a CUDA graph

A backend never copies the KV cache; every backend reads the same cache bytes.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from ..cache import Batch
from ..spec import AttentionSpec


@runtime_checkable
class Backend(Protocol):
    name: str

    def unavailable(self, spec: AttentionSpec) -> list[str]: ...

    def plan(self, batch: Batch) -> Any: ...

    def run(self, q: Any, cache: tuple[Any, Any], plan: Any, out: Any) -> None: ...
