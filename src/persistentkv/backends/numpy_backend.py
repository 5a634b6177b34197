"""The ``numpy`` backend: our planner's items run by the NumPy executor (CPU, any machine)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..cache import Batch
from ..errors import require
from ..names import PLAN_ROUTES
from ..plan import Plan, make_plan
from ..reference import execute_plan
from ..spec import AttentionSpec
from .base import Capabilities


class NumpyPlan(NamedTuple):
    """A step of the NumPy executor: the host plan and the batch it was made for."""

    plan: Plan
    batch: Batch


class NumpyBackend:
    """CPU executor of any route; accumulates in float32 (float64 for a float64 cache)."""

    #: host arrays, planned on the host every step, never captured
    capabilities = Capabilities(dtypes=("float16", "float32", "float64"), graph="none", host_arrays=True)

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
        all NumPy arrays of the spec's dtype; ``plan`` is what :meth:`plan` returned."""
        require(isinstance(plan, tuple) and len(plan) == 2 and isinstance(plan[0], Plan),
                f"{self.name}: plan must be what {type(self).__name__}.plan returned, got {type(plan).__name__}")
        require(isinstance(cache, (tuple, list)) and len(cache) == 2,
                f"{self.name}: cache must be a (K, V) pair, got {type(cache).__name__}")
        require(out is not None, f"{self.name}: run() writes into out, a [B, Hq, D] array; got None")
        step_plan, batch = plan
        execute_plan(step_plan, q, cache[0], cache[1], batch, out=out)
