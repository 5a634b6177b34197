"""The ``numpy`` backend: our planner's items run by the NumPy executor (CPU, any machine)."""

from __future__ import annotations

import numpy as np

from ..cache import Batch
from ..plan import Plan, make_plan
from ..reference import execute_plan
from ..spec import AttentionSpec
from ..env import dtype_reasons


class NumpyBackend:
    """CPU executor of any route; accumulates in float32 (float64 for a float64 cache)."""

    def __init__(self, route: str = "workqueue", name: str = "numpy", **route_options):
        self.name = name
        self.route = route
        self.route_options = route_options or ({"target_items": 64} if route == "workqueue" else {})

    def unavailable(self, spec: AttentionSpec) -> list[str]:
        return dtype_reasons(spec, ("float16", "float32", "float64"), "the NumPy executor")

    def plan(self, batch: Batch) -> tuple[Plan, Batch]:
        return make_plan(batch, self.route, **self.route_options), batch

    def run(self, q: np.ndarray, cache, plan, out: np.ndarray) -> None:
        step_plan, batch = plan
        execute_plan(step_plan, q, cache[0], cache[1], batch, out=out)
