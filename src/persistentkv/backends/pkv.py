"""Our routes behind the backend interface: pkv-workqueue, pkv-buckets, pkv-split.

    pkv-workqueue   balanced compact queue planned on the GPU (no host round trip), merge fused;
                    route="cluster" runs the cluster route instead, route="auto" picks per step
                    with plan.choose_route (cluster only for a balanced one-wave step of at most
                    256 tokens per CTA, on sm_90+); warps=8 runs every route on the 8-warp module
                    (128-token stages, head_dim <= 128)
    pkv-buckets     exact-length buckets, one decode + merge launch pair each (the published B=1 route)
    pkv-split       the rectangular B x Hkv x S grid with empty splits (the published kernel's grid)
"""

from __future__ import annotations

from ..cache import Batch
from ..spec import AttentionSpec


class _PKVBackend:
    route = "workqueue"
    graph_safe = True
    #: DecodeEngine options (the module's shape), as opposed to the per-step plan options
    engine_options: dict = {}

    def __init__(self, name: str, **options):
        self.name = name
        self.options = {k: v for k, v in options.items() if v is not None}
        self._engine = None

    def unavailable(self, spec: AttentionSpec) -> list[str]:
        from ..engine import engine_unsupported, gpu_reasons

        return engine_unsupported(spec, **self.engine_options) + gpu_reasons()

    def engine(self, spec: AttentionSpec):
        from ..engine import engine_for

        if self._engine is None or self._engine.spec != spec:
            self._engine = engine_for(spec, **self.engine_options)
        return self._engine

    def plan(self, batch: Batch):
        return self.engine(batch.spec).plan(batch, self.route, **self.options)

    def run(self, q, cache, plan, out) -> None:
        self._engine.run(q, cache, plan, out)


class PKVWorkqueue(_PKVBackend):
    route = "workqueue"
    ROUTE_CHOICES = ("workqueue", "cluster", "auto")

    def __init__(self, name: str = "pkv-workqueue", target_items: int | None = None,
                 min_chunk_tiles: int | None = None, route: str = "workqueue", cluster_size: int | None = None,
                 cluster_smem_bytes: int | None = None, warps: int | None = None):
        from ..errors import require

        require(route in self.ROUTE_CHOICES,
                f"pkv-workqueue route must be one of {', '.join(self.ROUTE_CHOICES)}, got {route!r}")
        super().__init__(name, target_items=target_items, min_chunk_tiles=min_chunk_tiles)
        # unset: the default module, through the same engine_for cache entry as the other backends
        self.engine_options = {} if warps is None else {"warps": warps}
        self.route = route
        self.cluster_options = {k: v for k, v in (("cluster_size", cluster_size),
                                                  ("cluster_smem_bytes", cluster_smem_bytes)) if v is not None}

    def plan(self, batch: Batch):
        engine = self.engine(batch.spec)
        route = self.route
        if route == "auto":
            from ..plan import CLUSTER_MIN_MAJOR, choose_route

            route, size = ("workqueue", None) if engine.capability[0] < CLUSTER_MIN_MAJOR else \
                choose_route(batch.seq_lens, batch.spec.num_kv_heads, engine.num_sms)
            if route == "cluster":
                return engine.plan(batch, "cluster", **{"cluster_size": size, **self.cluster_options})
        if route == "cluster":
            return engine.plan(batch, "cluster", **self.cluster_options)
        return engine.plan(batch, "workqueue", **self.options)


class PKVWorkqueueHost(_PKVBackend):
    route = "workqueue_host"

    def __init__(self, name: str = "pkv-workqueue-host", target_items: int | None = None,
                 min_chunk_tiles: int | None = None):
        super().__init__(name, target_items=target_items, min_chunk_tiles=min_chunk_tiles)


class PKVBuckets(_PKVBackend):
    route = "buckets"

    def __init__(self, name: str = "pkv-buckets", num_splits: int = 32):
        super().__init__(name, num_splits=num_splits)


class PKVSplit(_PKVBackend):
    route = "split"

    def __init__(self, name: str = "pkv-split", num_splits: int = 32):
        super().__init__(name, num_splits=num_splits)
