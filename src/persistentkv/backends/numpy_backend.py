"""The ``numpy`` backend: our planner's items run by the NumPy executor (CPU, any machine).

An FP8 cache (spec.kv_dtype ``float8_e4m3``) comes as ``(K codes, V codes, k_scale, v_scale)``:
uint8 e4m3 codes and NumPy float32 scales (one value or one per KV head). Each run dequantises
it once, in float32 (``value(code) x scale`` rounded once to float32, as the GPU's float32
multiply; float64 for a float64 spec), then runs the plan's items as on any cache (float32
accumulation); queries and the output stay in the spec's dtype. The float64 reference judges it
on the exact values (reference.dequantized_cache in float64).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..cache import Batch, numpy_dtype
from ..errors import PKVError, require
from ..names import PLAN_ROUTES
from ..plan import Plan, make_plan
from ..reference import dequantized_cache, execute_plan
from ..spec import AttentionSpec
from .base import Capabilities


class NumpyPlan(NamedTuple):
    """A step of the NumPy executor: the host plan and the batch it was made for."""

    plan: Plan
    batch: Batch


class NumpyBackend:
    """CPU executor of any route; accumulates in float32 (float64 for a float64 cache)."""

    #: host arrays, planned on the host every step, never captured
    capabilities = Capabilities(dtypes=("float16", "float32", "float64"), graph="none", host_arrays=True,
                                kv_dtypes=("float8_e4m3",))

    def __init__(self, route: str = "workqueue", name: str = "numpy", **route_options):
        require(isinstance(route, str) and route in PLAN_ROUTES,
                f"route {route!r} is not one of {', '.join(PLAN_ROUTES)}")
        self.name = name
        self.route = route
        self.route_options = route_options or ({"target_items": 64} if route == "workqueue" else {})

    def unavailable(self, spec: AttentionSpec) -> list[str]:
        return self.capabilities.shape_reasons(spec, "the NumPy executor")

    def plan(self, batch: Batch) -> NumpyPlan:
        require(isinstance(batch, Batch), f"{self.name}: batch must be a Batch, got {type(batch).__name__}")
        return NumpyPlan(make_plan(batch, self.route, **self.route_options), batch)

    def run(self, q: np.ndarray, cache, plan, out: np.ndarray) -> None:
        """One layer: q [B, Hq, D], cache (K, V) each [pages, P, Hkv, D], out [B, Hq, D] (written),
        all NumPy arrays of the spec's dtype; ``plan`` is what :meth:`plan` returned. For an FP8
        spec, cache is (K codes, V codes, k_scale, v_scale): uint8 codes, scales of one value or
        one per KV head (module docstring)."""
        require(isinstance(plan, tuple) and len(plan) == 2 and isinstance(plan[0], Plan),
                f"{self.name}: plan must be what {type(self).__name__}.plan returned, got {type(plan).__name__}")
        step_plan, batch = plan
        fp8 = batch.spec.fp8_kv
        if fp8 and isinstance(cache, (tuple, list)) and len(cache) == 2:
            raise PKVError(f"{self.name}: an FP8 cache is (K codes, V codes, k_scale, v_scale), got a (K, V) pair")
        require(isinstance(cache, (tuple, list)) and len(cache) == (4 if fp8 else 2),
                f"{self.name}: cache must be a {'(K, V, k_scale, v_scale) tuple' if fp8 else '(K, V) pair'}, "
                f"got {type(cache).__name__}")
        require(out is not None, f"{self.name}: run() writes into out, a [B, Hq, D] array; got None")
        if not fp8:
            execute_plan(step_plan, q, cache[0], cache[1], batch, out=out)
            return
        want = numpy_dtype(batch.spec.dtype)
        for name, value in (("q", q), ("out", out)):
            require(isinstance(value, np.ndarray), f"{self.name}: {name} must be a NumPy array, got "
                                                   f"{type(value).__name__}")
            if value.dtype.kind in "ui" and value.dtype.itemsize == 1:
                raise PKVError(f"{self.name}: {name} is {value.dtype}; an FP8 query is not supported (queries and "
                               f"outputs stay in the spec's dtype, {batch.spec.dtype})")
            require(value.dtype == want, f"{self.name}: {name} is {value.dtype}, expected {want}")
        require(out.shape == q.shape, f"out has shape {out.shape}, expected {q.shape}")
        require(out.flags.writeable, "out is read-only")
        accum = np.float64 if want == np.float64 else np.float32
        k, v = dequantized_cache(cache[0], cache[1], cache[2], cache[3], dtype=accum)
        result = execute_plan(step_plan, q.astype(accum, copy=False), k, v, batch)
        out[...] = result  # one rounding to the spec's dtype, as the executor's own out would take
