"""What this machine's Python environment can run: missing modules, CUDA, dtype names.

Below both the engine and the backends: each asks here why it cannot run, and turns the answer
into reasons (never an exception from deep inside an import).
"""

from __future__ import annotations

import importlib

from .errors import require
from .spec import AttentionSpec

#: spec.dtype -> torch dtype name, for everything that takes torch tensors.
TORCH_DTYPES = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32", "float64": "float64"}


def missing_module(module: str) -> list[str]:
    """[] if ``module`` imports, else one reason naming the import error."""
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
    """[] when ``spec.dtype`` is one of ``allowed``, else one reason naming ``who``."""
    if spec.dtype not in allowed:
        return [f"{who} supports dtype {', '.join(allowed)}, not {spec.dtype}"]
    return []


def torch_dtype(dtype: str):
    """The torch dtype for a spec dtype name (``float16`` -> ``torch.float16``)."""
    import torch

    require(dtype in TORCH_DTYPES, f"dtype {dtype!r} has no torch equivalent")
    return getattr(torch, TORCH_DTYPES[dtype])
