"""Every backend by name, imported only when asked for.

    names()                     -> the registered names, in a stable order
    create(name, **options)     -> a backend instance (PKVError for an unknown name or a module
                                   that cannot be imported)
    available(spec, names=None) -> {name: reasons}; [] means usable here
    register(name, factory)     -> a backend from outside the package (persistentkv.backends.base):
                                   ``factory(**options)`` makes it; ``unregister(name)`` drops it

A missing package (flashinfer, vllm, tensorrt_llm, cupy) never breaks another backend: each
adapter imports its library inside its methods, and ``available`` turns any failure to create a
backend into a reason instead of an exception.

Constructor options come from the config (see persistentkv.measure.workload.variant_for):
``pkv-workqueue(target_items)``, ``pkv-buckets(num_splits)``,
``pkv-split(num_splits)``, ``adaptive(policy_path)``; baselines take none by default.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import PKVError, require
from ..spec import AttentionSpec


@dataclass(frozen=True)
class Entry:
    module: str        # under persistentkv.backends
    attribute: str     # class or factory in that module
    fixed: dict = field(default_factory=dict)  # keyword arguments every instance gets


_ENTRIES: dict[str, Entry] = {
    "pkv-workqueue": Entry("pkv", "PKVWorkqueue"),
    "pkv-buckets": Entry("pkv", "PKVBuckets"),
    "pkv-split": Entry("pkv", "PKVSplit"),
    "adaptive": Entry("adaptive", "AdaptiveBackend"),
    "flashinfer-cc": Entry("flashinfer_backend", "make_cuda_core"),
    "flashinfer-tc": Entry("flashinfer_backend", "make_tensor_core"),
    "vllm-fa3": Entry("vllm_backend", "VllmFA3Backend"),
    "trtllm-xqa": Entry("trtllm_backend", "TrtllmXqaBackend"),
    "trtllm-native": Entry("trtllm_backend", "TrtllmNativeBackend"),
    "flashinfer-cudnn": Entry("cudnn_backend", "CudnnDecodeBackend"),
    "torch-sdpa": Entry("torch_sdpa", "TorchSdpaBackend"),
    "numpy": Entry("numpy_backend", "NumpyBackend"),
}


#: Backends added at run time by register(): name -> factory(**options).
_REGISTERED: dict[str, Callable[..., Any]] = {}


def names() -> list[str]:
    return [*_ENTRIES, *_REGISTERED]


def register(name: str, factory: Callable[..., Any], replace: bool = False) -> None:
    """Make ``create(name, **options)`` return ``factory(**options)``: a backend written outside
    the package (a class with the members persistentkv.backends.base documents) needs no edit in
    it. A name already taken (one of the package's, or registered before) is refused unless
    ``replace`` (only a registered one can be replaced)."""
    require(isinstance(name, str) and name.strip() == name and name, f"a backend name must be a non-empty "
                                                                      f"string without surrounding spaces, got {name!r}")
    require(callable(factory), f"backend {name}: the factory must be callable, got {type(factory).__name__}")
    require(name not in _ENTRIES, f"backend {name} is one of the package's own; register another name")
    require(replace or name not in _REGISTERED, f"backend {name} is registered already (replace=True replaces it)")
    _REGISTERED[name] = factory


def unregister(name: str) -> None:
    """Drop a backend :func:`register` added."""
    require(name in _REGISTERED, f"backend {name!r} was not added by register()")
    del _REGISTERED[name]


def _import(name: str):
    if name in _REGISTERED:
        return _REGISTERED[name]
    entry = _ENTRIES[name]
    module_name = f"persistentkv.backends.{entry.module}"
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if exc.name == module_name:
            raise PKVError(f"backend {name}: module {module_name} does not exist") from None
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PKVError(f"backend {name}: importing {module_name} failed ({first})") from None
    factory = getattr(module, entry.attribute, None)
    if factory is None:
        raise PKVError(f"backend {name}: {module_name} has no {entry.attribute}")
    return factory


def create(name: str, **options):
    """A new ``name`` backend; ``options`` are passed to its constructor.

    ``adaptive`` also receives this registry (so it can create its delegates) unless given one.
    """
    if name not in _ENTRIES and name not in _REGISTERED:
        raise PKVError(f"unknown backend {name!r}; expected one of {', '.join(names())}")
    factory = _import(name)
    kwargs = dict(_ENTRIES[name].fixed) if name in _ENTRIES else {}
    kwargs.update(options)
    if name == "adaptive":
        kwargs.setdefault("registry", sys.modules[__name__])
        if "policy_path" not in kwargs:
            raise PKVError("backend adaptive needs a policy file (policy_path); pass --policy")
    try:
        return factory(**kwargs)
    except PKVError:
        raise
    except TypeError as exc:
        raise PKVError(f"backend {name}: bad options {sorted(options)} ({exc})") from None


def available(spec: AttentionSpec, names_: list[str] | None = None, **options_by_name) -> dict[str, list[str]]:
    """{name: reasons it cannot run ``spec`` here}, [] when usable. Never raises for a backend.

    ``options_by_name`` maps a backend name (with ``-`` written as ``_``) to its constructor options.
    """
    result: dict[str, list[str]] = {}
    for name in names_ or names():
        options = options_by_name.get(name.replace("-", "_"), {})
        try:
            backend = create(name, **options)
            result[name] = list(backend.unavailable(spec))
        except Exception as exc:  # a broken install may raise anything; report it as a reason
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            result[name] = [text]
    return result
