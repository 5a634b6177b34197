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
    """One kernel family behind the four members every harness, policy and loop uses.

    Attributes
    ----------
    name : str
        Short identifier used in results (``flashinfer-tc``, ``pkv-workqueue``).
    """

    name: str

    def unavailable(self, spec: AttentionSpec) -> list[str]:
        """Why this backend cannot run ``spec`` here (missing package, no GPU, unsupported
        shape), one reason per string; ``[]`` when it can. Never raises."""
        ...

    def plan(self, batch: Batch) -> Any:
        """Per-step metadata for ``batch``, made once per decode step and reused by every layer
        (it may upload to the GPU, asynchronously)."""
        ...

    def run(self, q: Any, cache: tuple[Any, Any], plan: Any, out: Any) -> None:
        """One layer of decode attention.

        Parameters
        ----------
        q : tensor, shape [B, Hq, D]
            Queries, of the spec's dtype.
        cache : (tensor, tensor)
            K and V, each [num_pages, page_size, Hkv, D] (NHD), of the spec's dtype.
        plan : object
            What ``plan(batch)`` returned for this step.
        out : tensor, shape [B, Hq, D]
            Preallocated by the caller, written in full. No allocation and no host
            synchronisation inside, so a GPU backend's call can be captured in a CUDA graph.
        """
        ...
