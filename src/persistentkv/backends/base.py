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


def missing_module(module: str) -> list[str]:
    """[] if ``module`` imports, else one reason naming the import error."""
    import importlib

    try:
        importlib.import_module(module)
    except Exception as exc:  # ImportError, or a broken install raising anything else
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return [f"{module} cannot be imported ({type(exc).__name__}: {first})"]
    return []


def cuda_reasons() -> list[str]:
    """[] when torch with a CUDA device is usable, else why not."""
    reasons = missing_module("torch")
    if reasons:
        return reasons
    import torch

    if not torch.cuda.is_available():
        return [f"no CUDA device visible to torch {torch.__version__}"]
    return []


def dtype_reasons(spec: AttentionSpec, allowed: tuple[str, ...], who: str) -> list[str]:
    if spec.dtype not in allowed:
        return [f"{who} supports dtype {', '.join(allowed)}, not {spec.dtype}"]
    return []
