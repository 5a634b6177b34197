"""Every backend by name, imported only when asked for.

    names()                     -> the registered names, in a stable order
    create(name, **options)     -> a backend instance (PKVError for an unknown name or a module
                                   that cannot be imported)
    available(spec, names=None) -> {name: reasons}; [] means usable here

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

from ..errors import PKVError
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
    "torch-sdpa": Entry("torch_sdpa", "TorchSdpaBackend"),
    "numpy": Entry("numpy_backend", "NumpyBackend"),
}


def names() -> list[str]:
    return list(_ENTRIES)


def _import(name: str):
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
    if name not in _ENTRIES:
        raise PKVError(f"unknown backend {name!r}; expected one of {', '.join(_ENTRIES)}")
    factory = _import(name)
    kwargs = dict(_ENTRIES[name].fixed)
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
