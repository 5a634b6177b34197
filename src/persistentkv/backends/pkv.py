"""Our routes behind the backend interface: pkv-workqueue, pkv-buckets, pkv-split.

    pkv-workqueue   the balanced compact queue planned on the GPU (no host round trip), merge
                    fused; ``warps="auto"`` (default) picks the module per step with
                    choose.choose_warps (8 warps, 128-token stages, unless the 8-warp queue's items
                    balance worse than the 4-warp queue's or it would run several waves of short
                    rows; 4 at head_dim > 128), then on an FP8 cache choose.choose_ctas_per_sm
                    (3 or 4 resident 4-warp CTAs per SM where the queue's items stay long, or
                    where they balance a ragged 8-warp step at least twice as well); an
                    8-warp step of >= 64 groups and rows <= 512 tokens gets one item a group
                    (choose.unsplit_min_chunk);
                    ``warps=4`` or ``8`` fixes it. Explicit target_items and min_chunk_tiles
                    apply to the default 4-warp module (the config's planner values); the 8-warp
                    module and the FP8 modules for 3 or 4 CTAs per SM keep their own defaults
                    (one wave of their resident CTAs; one stage, 128 or 64 tokens).
    pkv-buckets     exact-length buckets, one decode + merge launch pair each (the published B=1 route)
    pkv-split       the rectangular B x Hkv x S grid with empty splits (the published kernel's grid)
"""

from __future__ import annotations

from ..cache import Batch
from ..choose import choose_ctas_per_sm, choose_warps, unsplit_min_chunk
from ..engine import ENGINE_DTYPES, engine_for, engine_unsupported, gpu_reasons
from ..launch import ENGINE_KV_DTYPES
from ..errors import PKVError, require
from ..spec import AttentionSpec
from .base import Capabilities

#: pkv-workqueue's warps choices: "auto" (per step, choose.choose_warps) or a fixed module.
WARPS_CHOICES = ("auto", 4, 8)


class _PKVBackend:
    route = "workqueue"
    #: host-planned routes (buckets, split): a captured step is re-captured when the lengths change;
    #: run() is plan.engine.run(plan), so a wrapper (adaptive) may call the engine directly. The
    #: shapes the engine takes are its own check (engine.engine_unsupported, which unavailable asks).
    capabilities = Capabilities(dtypes=ENGINE_DTYPES, graph="replan", plan_engine=True, kv_dtypes=ENGINE_KV_DTYPES)
    #: DecodeEngine options (the module's shape), as opposed to the per-step plan options
    engine_options: dict = {}

    def __init__(self, name: str, **options):
        self.name = name
        self.options = {k: v for k, v in options.items() if v is not None}
        self._engine = None

    def unavailable(self, spec: AttentionSpec) -> list[str]:
        return engine_unsupported(spec, **self.engine_options) + gpu_reasons()

    def engine(self, spec: AttentionSpec):
        if self._engine is None or self._engine.spec != spec:
            self._engine = engine_for(spec, **self.engine_options)
        return self._engine

    def plan(self, batch: Batch):
        return self.engine(batch.spec).plan(batch, self.route, **self.options)

    def run(self, q, cache, plan, out) -> None:
        plan.engine.run(q, cache, plan, out)  # the engine (module) that planned it; (K, V[, scales])


class PKVWorkqueue(_PKVBackend):
    route = "workqueue"
    #: planned on the GPU: DevicePlan.update_lengths re-plans inside a captured step
    capabilities = Capabilities(dtypes=ENGINE_DTYPES, graph="device", plan_engine=True, kv_dtypes=ENGINE_KV_DTYPES)

    def __init__(self, name: str = "pkv-workqueue", target_items: int | None = None,
                 min_chunk_tiles: int | None = None, warps: int | str = "auto"):
        require(warps in WARPS_CHOICES and not isinstance(warps, bool),
                f"pkv-workqueue warps must be one of {', '.join(map(str, WARPS_CHOICES))}, got {warps!r}")
        super().__init__(name, target_items=target_items, min_chunk_tiles=min_chunk_tiles)
        # "auto" and 4: the default module, through the same engine_for cache entry as the other backends
        self.warps = warps
        self.engine_options = {"warps": 8} if warps == 8 else {}
        self._engines = {}        # spec -> the 8-warp DecodeEngine (auto)
        self._ctas_engines = {}   # (spec, CTAs per SM) -> the FP8 4-warp DecodeEngine built for them (auto)
        self._warps8_error = None  # why the 8-warp module is unavailable here (auto falls back to 4)

    def _engine_for_step(self, batch: Batch):
        """(engine, plan options) for this step: the fixed module, or choose_warps's, or on an FP8
        cache the 4-warp module built for choose_ctas_per_sm's CTAs per SM (where it builds)."""
        engine = self.engine(batch.spec)
        if self.warps != "auto" or self._warps8_error is not None or batch.spec.head_dim > 128:
            return engine, self.options
        w8 = self._engines.get(batch.spec)
        if w8 is None:
            try:
                w8 = self._engines[batch.spec] = engine_for(batch.spec, warps=8)
            except PKVError as exc:  # e.g. a device whose opt-in shared memory is below 192 KB
                self._warps8_error = str(exc)
                return engine, self.options
        options = self.options
        queue4 = (options.get("target_items") or engine.target_items,
                  options.get("min_chunk_tiles") or engine.min_chunk_tiles)
        queue8 = (w8.target_items, w8.min_chunk_tiles)
        warps = choose_warps(batch.seq_lens, batch.spec.head_dim, num_kv_heads=batch.spec.num_kv_heads,
                             queue4=queue4, queue8=queue8)
        chosen = (engine, options) if warps == 4 else (w8, {})
        if warps == 8:  # many short groups: one item each, no split and no merge (choose.unsplit_min_chunk)
            unsplit = unsplit_min_chunk(batch.seq_lens, batch.spec.num_kv_heads)
            if unsplit is not None and unsplit > w8.min_chunk_tiles:
                chosen = (w8, {"min_chunk_tiles": unsplit})
        if not batch.spec.fp8_kv:
            return chosen
        ctas = choose_ctas_per_sm(batch.seq_lens, batch.spec.num_kv_heads, engine.num_sms,
                                  queue4 if warps == 4 else queue8, min_chunk_tiles=engine.min_chunk_tiles,
                                  picked_warps=warps)
        if ctas is None:
            return chosen
        key = (batch.spec, ctas)
        more = self._ctas_engines.get(key)
        if more is None:
            try:
                more = self._ctas_engines[key] = engine_for(batch.spec, ctas_per_sm=ctas)
            except PKVError:  # a device that holds fewer such CTAs per SM: the module choose_warps picked
                more = self._ctas_engines[key] = chosen[0]
        return more, {}

    def plan(self, batch: Batch):
        engine, options = self._engine_for_step(batch)
        return engine.plan(batch, "workqueue", **options)


class PKVBuckets(_PKVBackend):
    route = "buckets"

    def __init__(self, name: str = "pkv-buckets", num_splits: int = 32):
        super().__init__(name, num_splits=num_splits)


class PKVSplit(_PKVBackend):
    route = "split"

    def __init__(self, name: str = "pkv-split", num_splits: int = 32):
        super().__init__(name, num_splits=num_splits)
