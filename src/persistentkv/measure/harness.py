"""One case at a time: availability, device caches, plans, warm-up, graphs, interleaved rounds.

For each case:

1. Availability. A variant whose backend cannot be created, or whose ``unavailable(spec)`` gives
   reasons, contributes ONE ``unavailable`` row per (experiment, backend, spec, reasons) and is
   skipped; the others are unaffected.
2. Device data. R rotated copies of the case's compact cache (R from the device's L2 and
   ``cold_l2_factor``, capped by ``max_copies``; fewer if memory is short, which the run log
   says), one Q, one output buffer per variant.
3. Per variant, outside any timing: plan once (the plan does not depend on the cache pointer for
   any adapter here, so it serves every copy), one eager warm-up call (JIT compilation, lazy
   buffers), the kernel protocol's CUDA graphs (one per starting copy, rotation.graph_offsets),
   and a warm-up of the instances the step and published protocols use. Those are separate
   instances of the same backend (so a re-plan there never rewrites the state that the main plan
   and its graphs hold); for FlashInfer the published instance is the plain (non-graph) wrapper
   the paper timed.
4. Rounds (persistentkv.measure.schedule): every variant once per round in a seeded shuffled
   order, all protocols per visit; warm-up rounds are discarded. Where the run times the one-kernel
   floor (``RunContext.floor``: bench-kernels, bench-shapes), it is one more slot of every round's
   order: each of its grids replayed once per visit (persistentkv.ceiling.OneKernelFloor), its rows
   backend ``one-kernel-floor``, protocol ``kernel``, one per recorded round (rows.floor_rows).
   Before each round the timing thread is pinned per ``measure.host_cpu``
   (persistentkv.measure.host_cpu: the quickest CPU of a probe, by default), and the round's rows
   record the CPU and its probe time.

Anything a backend raises (import, compile, capture, run, out of memory) becomes a ``failed`` row
with the reason, for that protocol (or all of them when planning fails); after an OOM the
allocator cache is emptied; the other backends carry on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..backends import registry
from ..ceiling import OneKernelFloor
from ..errors import PKVError, require
from ..names import FLOOR_BACKEND, PKV_BACKENDS, PROTOCOLS
from .host_cpu import HostPinner, check_host_cpu
from .protocols import eager_once, kernel_once, published_once, step_once
from .rotation import CopyCursor, cache_bytes, cold_copies, graph_copies, graph_offsets
from .rows import availability, case_fields, floor_rows, one_line, raw_row
from .schedule import rounds
from .statistics import frac_of_ceiling
from .workload import Case, Variant

#: Options that turn a variant into the instance the published protocol times (FlashInfer: the
#: plain wrapper, as in the paper).
PUBLISHED_OPTIONS = {"flashinfer-cc": (("cuda_graph", False),), "flashinfer-tc": (("cuda_graph", False),)}


@dataclass(frozen=True)
class Settings:
    layers: int = 32
    repeats: int = 5
    warmup: int = 3
    calls_per_graph: int = 10
    #: kernel rows: GPU cycles of the spin each replay is queued behind (0: none)
    kernel_queue_cycles: int = 0
    #: kernel rows (and the floor): each call follows one copy kernel of the step's appended K/V
    #: bytes, whose own time is subtracted (persistentkv.measure.protocols); False: back to back
    kernel_separator: bool = False
    cold_l2_factor: float = 3.0
    protocols: tuple[str, ...] = PROTOCOLS
    seed: int = 0
    max_copies: int = 64   # graphs per backend = copies; only sub-3 MB cases want more
    #: eager rows: run() calls of the back-to-back host loop after the single timed call (0: none)
    eager_loop_calls: int = 8
    #: recorded rounds of the step protocol (None: ``repeats``). Step rows are eager host loops, the
    #: noisiest rows, and cheap (one plan + the layers); the extra rounds time step rows only.
    step_repeats: int | None = None
    #: where the timing thread runs: "fastest" (re-chosen each round), "none" or a CPU number
    host_cpu: str | int = "none"

    def __post_init__(self):
        check_host_cpu(self.host_cpu)
        require(self.repeats >= 1, f"repeats must be >= 1, got {self.repeats}")
        require(self.kernel_queue_cycles >= 0, f"kernel_queue_cycles must be >= 0, got {self.kernel_queue_cycles}")
        require(self.eager_loop_calls >= 0, f"eager_loop_calls must be >= 0, got {self.eager_loop_calls}")
        require(self.step_repeats is None or self.step_repeats >= 1,
                f"step_repeats must be >= 1, got {self.step_repeats}")

    def repeats_of(self, protocol: str) -> int:
        """Recorded repeats of ``protocol``."""
        return self.step_repeats if protocol == "step" and self.step_repeats is not None else self.repeats

    @property
    def rounds(self) -> int:
        """Recorded rounds of a case: the most any of its protocols records."""
        return max(self.repeats_of(p) for p in self.protocols) if self.protocols else self.repeats

    @classmethod
    def from_config(cls, config: dict, protocols=PROTOCOLS, quick: bool = False, seed: int = 0,
                    bench: bool = False) -> "Settings":
        """``bench``: bench_kernels's settings, whose rows all take ``measure.bench_repeats`` rounds
        (else ``repeats``)."""
        m = config["measure"]
        step = m.get("step_repeats")
        repeats = int(m.get("bench_repeats", m["repeats"]) if bench else m["repeats"])
        return cls(layers=int(m["layers"]), repeats=2 if quick else repeats,
                   warmup=min(1, int(m["warmup"])) if quick else int(m["warmup"]),
                   calls_per_graph=int(m["calls_per_graph"]), cold_l2_factor=float(m["cold_l2_factor"]),
                   kernel_queue_cycles=int(m.get("kernel_queue_cycles", 0)),
                   kernel_separator=_flag(m.get("kernel_separator", False), "measure.kernel_separator"),
                   eager_loop_calls=int(m.get("eager_loop_calls", cls.eager_loop_calls)),
                   protocols=tuple(protocols), seed=seed,
                   step_repeats=None if quick or step is None else int(step),
                   host_cpu=check_host_cpu(m.get("host_cpu", cls.host_cpu)))


def _flag(value, name: str) -> bool:
    require(isinstance(value, bool), f"{name} must be true or false, got {value!r}")
    return value


def separator_bytes(batch) -> int:
    """The bytes a decode step of ``batch`` appends to its cache (each row's new K and V):
    what the kernel protocol's separator copies. Worked number: B=64, Hkv=8, D=128, fp16 is
    64 x 2 x 8 x 128 x 2 = 256 KiB."""
    return int(batch.batch_size) * int(batch.spec.kv_bytes_per_token)


@dataclass
class CaseSeparator:
    """A case's separator (Settings.kernel_separator): ``launch`` queues one copy kernel of
    :func:`separator_bytes`, ``replay`` replays a graph of ``calls_per_graph`` of them alone."""

    launch: Callable[[], None]
    replay: Callable[[], None]


def case_separator(case: Case, device, settings: Settings) -> CaseSeparator | None:
    """The case's separator, or None when kernel rows are not timed or run back to back."""
    if not settings.kernel_separator or "kernel" not in settings.protocols:
        return None
    launch = device.separator(separator_bytes(case.batch))
    launch()  # first launch outside any capture
    device.synchronize()

    def separators():
        for _ in range(settings.calls_per_graph):
            launch()

    return CaseSeparator(launch, device.capture(separators))


def experiment_protocols(config: dict, experiment: str) -> tuple[str, ...]:
    """The protocols ``experiment`` times: config ``measure.protocols.<experiment>``, else all four
    (in PROTOCOLS order, whatever order the config lists them in)."""
    wanted = config["measure"].get("protocols", {}).get(experiment)
    if not wanted:
        return PROTOCOLS
    unknown = sorted(set(wanted) - set(PROTOCOLS))
    require(not unknown, f"measure.protocols.{experiment}: unknown protocol(s) {', '.join(unknown)}; "
                         f"expected some of {', '.join(PROTOCOLS)}")
    return tuple(p for p in PROTOCOLS if p in wanted)


class BackendFactory:
    """Backend instances per (variant, role), created once and reused across cases.

    role: "main" (plan once per case, kernel + eager), "step", "published".
    """

    def __init__(self, create: Callable[..., Any] | None = None):
        if create is None:
            create = registry.create
        self._create = create
        self._instances: dict[tuple, Any] = {}

    def get(self, variant: Variant, role: str = "main"):
        options = variant.options
        if role == "published":
            options = tuple(sorted(dict(options + PUBLISHED_OPTIONS.get(variant.name, ())).items()))
        key = (variant.name, options, role)
        if key not in self._instances:
            self._instances[key] = self._create(variant.name, **dict(options))
        return self._instances[key]


@dataclass
class RunContext:
    run_id: str
    read_ceiling_gbps: float = float("nan")
    log: Callable[[str], None] = print
    reported_unavailable: set = field(default_factory=set)
    #: pins the timing thread before each round (run_cases makes one from Settings.host_cpu)
    pinner: HostPinner | None = None
    #: the one-kernel floor of each case, timed in its rounds: ``floor(case, device, settings)`` ->
    #: a prepared ceiling.OneKernelFloor (:func:`one_kernel_floor`); None: not timed
    floor: Callable[..., Any] | None = None


# -- what a plan tells the rows ------------------------------------------------------------------
_CHILDREN = ("plan", "host_plan", "inner", "delegate_plan")


def _children(plan) -> list:
    return [getattr(plan, a, None) for a in _CHILDREN]


def _find_counters(plan, depth: int = 0) -> dict | None:
    """Counters (launches, decode_ctas, merge_state_bytes, ...) of a plan, as a dict: from
    ``plan.counters()`` (a persistentkv.plan.StepCounters or a dict), or one or two levels down
    (plan.plan, plan.host_plan, plan.inner, plan.delegate_plan, the elements of a tuple)."""
    if plan is None or depth > 2:
        return None
    method = getattr(plan, "counters", None)
    if callable(method):
        try:
            found = method()
        except Exception:
            found = None
        if isinstance(found, dict):
            return found
        if found is not None and hasattr(found, "to_dict"):
            return found.to_dict()
    for child in _children(plan):
        found = _find_counters(child, depth + 1)
        if found is not None:
            return found
    return None


def _find_num_splits(plan, depth: int = 0) -> int | None:
    """S from a persistentkv.plan.Plan's params (or one found under the plan), else None."""
    if plan is None or depth > 2:
        return None
    params = getattr(plan, "params", None)
    if isinstance(params, dict) and params.get("num_splits") is not None:
        return int(params["num_splits"])
    for child in _children(plan):
        found = _find_num_splits(child, depth + 1)
        if found is not None:
            return found
    return None


def route_of(name: str, plan) -> str:
    """The route that ran: the registered backend a delegating backend's plan names as its
    ``route`` (the adaptive backend's chosen delegate; persistentkv.backends.base), else the
    backend itself (an engine plan's ``route``, ``workqueue`` ..., names no backend)."""
    chosen = getattr(plan, "route", None)
    if isinstance(chosen, str) and chosen in registry.names():
        return chosen
    return name


def plan_fields(variant: Variant, plan) -> dict:
    route = route_of(variant.name, plan)
    fields: dict[str, Any] = {"route": route}
    if route in PKV_BACKENDS:
        counters = _find_counters(plan) or {}
        for key in ("launches", "decode_ctas", "merge_state_bytes"):
            if counters.get(key) is not None:
                fields[key] = float(counters[key])
        splits = _find_num_splits(plan)
        fields["num_splits"] = splits if splits is not None else variant.num_splits
    return fields


def plan_inside_published(route: str) -> bool:
    """The paper timed its baseline's plan() inside the window and its own metadata outside."""
    return route not in PKV_BACKENDS


# -- one case ----------------------------------------------------------------------------------
@dataclass
class Bound:
    """A variant ready to measure on the current case."""

    variant: Variant
    backend: Any
    plan: Any
    fields: dict
    out: Any
    step_backend: Any = None
    published_backend: Any = None
    published_inside: bool = True
    replays: list = field(default_factory=list)
    skip: dict = field(default_factory=dict)   # protocol -> (status, reason)


def copies_for(case: Case, device, settings: Settings, log) -> int:
    """R for this case: the cold-L2 count, capped by ``max_copies`` and by free memory."""
    wanted = cold_copies(case.batch.kv_bytes, device.l2_bytes, settings.cold_l2_factor)
    copies = min(wanted, settings.max_copies)
    if copies < wanted:
        log(f"  {case.label}: {copies} cache copies (cap), a cold L2 wants {wanted}")
    one = cache_bytes(case.batch)
    free = device.free_bytes()
    if one > 0.8 * free:
        raise PKVError(f"the case needs {one / 2**30:.1f} GiB for one copy of its cache, {free / 2**30:.1f} GiB is free")
    fit = max(1, int(0.6 * free // max(one, 1)))
    if fit < copies:
        log(f"  {case.label}: memory holds {fit} of the {copies} cache copies a cold L2 wants")
        copies = fit
    return copies


def run_case(case: Case, device, factory: BackendFactory, settings: Settings, ctx: RunContext,
             case_index: int = 0) -> list[dict]:
    """Measure every variant of ``case`` under ``settings.protocols``; return raw rows."""
    base = dict(case_fields(case), run_id=ctx.run_id, read_ceiling_gbps=ctx.read_ceiling_gbps)
    spec, batch = case.spec, case.batch
    rows: list[dict] = []

    def status_row(variant: Variant, status: str, reason: str, protocol: str = "", repeat: int = -1, **extra):
        return raw_row(**base, backend=variant.name, route=extra.pop("route", variant.name),
                       num_splits=variant.num_splits, protocol=protocol, repeat=repeat,
                       status=status, reason=reason, **extra)

    # 1. availability
    live: list[tuple[Variant, Any]] = []
    for variant in case.variants:
        backend, reasons = availability(factory, variant, spec,
                                        f"{variant.name} runs on NumPy arrays on the host; the harness times torch tensors")
        if reasons:
            key = (case.experiment, variant.name, spec, tuple(reasons))
            if key not in ctx.reported_unavailable:
                ctx.reported_unavailable.add(key)
                rows.append(status_row(variant, "unavailable", "; ".join(reasons)))
            continue
        live.append((variant, backend))
    if not live:
        return rows

    # 2. device data
    try:
        n_copies = copies_for(case, device, settings, ctx.log)
        copies = device.make_copies(batch, n_copies, case.seed)
        q = device.queries(spec, batch.batch_size, case.seed)
        gather_index = device.index(list(range(batch.batch_size)))
        separator = case_separator(case, device, settings)
    except Exception as exc:
        if device.is_oom(exc):
            device.empty_cache()
        for variant, _ in live:
            rows += [status_row(variant, "failed", f"building the case's cache: {one_line(exc)}", p)
                     for p in settings.protocols]
        return rows
    cursor = CopyCursor(n_copies, settings.calls_per_graph)

    # 3. plans, warm-up, graphs
    bound: list[Bound] = []
    for variant, backend in live:
        try:
            plan = backend.plan(batch)
            out = device.empty_out(spec, batch.batch_size)
            backend.run(q, copies.pair(0), plan, out)
            device.synchronize()
            b = Bound(variant, backend, plan, plan_fields(variant, plan), out)
        except Exception as exc:
            if device.is_oom(exc):
                device.empty_cache()
            rows += [status_row(variant, "failed", f"plan/first run: {one_line(exc)}", p) for p in settings.protocols]
            continue
        _prepare_protocols(b, case, device, factory, settings, copies, q, gather_index, separator)
        bound.append(b)

    floor = _prepare_floor(case, device, settings, ctx) if bound else None

    # 4. interleaved rounds, each on the CPU the pinner picks for it (the floor, if timed, is slot len(bound))
    for rnd in rounds(len(bound) + (floor is not None), settings.rounds, settings.warmup, settings.seed, case_index):
        host_cpu, probe = ctx.pinner.pin() if ctx.pinner is not None else (-1, float("nan"))
        where = {"host_cpu": host_cpu, "host_probe_us": probe}
        for i in rnd.order:
            if i == len(bound):
                floor.visit(rnd, settings.repeats_of("kernel"), device)
                continue
            b = bound[i]
            for protocol in settings.protocols:
                if protocol in b.skip or rnd.repeat >= settings.repeats_of(protocol):
                    continue
                try:
                    fields = _measure(protocol, b, case, device, settings, cursor, copies, q, gather_index,
                                      separator)
                except Exception as exc:
                    if device.is_oom(exc):
                        device.empty_cache()
                    b.skip[protocol] = ("failed", f"{protocol} repeat {rnd.repeat}: {one_line(exc)}")
                    continue
                if rnd.warmup:
                    continue
                rows.append(_timing_row({**base, **where}, b, protocol, rnd.repeat, fields, ctx.read_ceiling_gbps,
                                        case))
    for b in bound:
        for protocol, (status, reason) in b.skip.items():
            rows.append(status_row(b.variant, status, reason, protocol, **{k: v for k, v in b.fields.items()
                                                                           if k in ("route",)}))
        b.replays.clear()
    if floor is not None:
        rows += floor.rows(base, ctx.read_ceiling_gbps)
    del copies, bound, floor, separator
    return rows


def one_kernel_floor(case: Case, device, settings: Settings, **options) -> OneKernelFloor:
    """The one-kernel floor of ``case``'s K/V bytes, rotated and replayed as its kernel rows are
    (Settings.cold_l2_factor, calls_per_graph, kernel_queue_cycles, max_copies), each launch after
    the case's separator kernel when Settings.kernel_separator is on; ``options`` go to
    ceiling.OneKernelFloor (the tests pass a fake ``reader``)."""
    if settings.kernel_separator and "separator" not in options:
        options["separator"] = device.separator(separator_bytes(case.batch))
    return OneKernelFloor(device, case.batch.kv_bytes, cold_l2_factor=settings.cold_l2_factor,
                          calls_per_graph=settings.calls_per_graph, queue_cycles=settings.kernel_queue_cycles,
                          max_copies=settings.max_copies, **options)


@dataclass
class _FloorSlot:
    """The floor's place in a case's rounds: the prepared floor, or why it is not timed."""

    floor: Any = None
    failure: str = ""

    def visit(self, rnd, repeats: int, device) -> None:
        if self.floor is None or rnd.repeat >= repeats:
            return
        try:
            self.floor.round(record=not rnd.warmup)
        except Exception as exc:
            if device.is_oom(exc):
                device.empty_cache()
            self.failure = f"kernel repeat {rnd.repeat}: {one_line(exc)}"
            self.floor.close()
            self.floor = None

    def rows(self, base: dict, ceiling: float) -> list[dict]:
        if self.floor is not None:
            result = self.floor.result()
            self.floor.close()
            self.floor = None
            if any(result.samples.values()):
                return floor_rows(result, base, ceiling)
            self.failure = self.failure or "no recorded round"
        return [raw_row(**base, backend=FLOOR_BACKEND, route=FLOOR_BACKEND, protocol="kernel", status="failed",
                        reason=self.failure)]


def _prepare_floor(case: Case, device, settings: Settings, ctx: RunContext) -> _FloorSlot | None:
    """The case's floor slot (None when the run does not time the floor); a floor that cannot be
    prepared (memory, compilation, capture) gives a slot that only reports why."""
    if ctx.floor is None or "kernel" not in settings.protocols:
        return None
    try:
        return _FloorSlot(ctx.floor(case, device, settings))
    except Exception as exc:
        if device.is_oom(exc):
            device.empty_cache()
        ctx.log(f"  {case.label}: one-kernel floor not measured ({one_line(exc)})")
        return _FloorSlot(failure=f"preparing the floor: {one_line(exc)}")


def _prepare_protocols(b: Bound, case: Case, device, factory: BackendFactory, settings: Settings, copies, q,
                       gather_index, separator: CaseSeparator | None = None) -> None:
    """Graphs for the kernel protocol (each call after ``separator.launch()`` when there is one);
    warmed-up step/published instances. Failures go to b.skip."""
    batch = case.batch
    if "kernel" in settings.protocols:
        if b.backend.capabilities.graph == "none":
            b.skip["kernel"] = ("unavailable", f"{b.variant.name}.run() is not CUDA-graph capturable "
                                               "(capabilities.graph = 'none'); kernel rows need graph replay")
        else:
            try:
                for offset in graph_offsets(len(copies)):
                    chosen = graph_copies(offset, len(copies), settings.calls_per_graph)

                    def captured(chosen=chosen):
                        for c in chosen:
                            if separator is not None:
                                separator.launch()
                            b.backend.run(q, copies.pair(c), b.plan, b.out)

                    b.replays.append(device.capture(captured))
            except Exception as exc:
                if device.is_oom(exc):
                    device.empty_cache()
                b.replays.clear()
                b.skip["kernel"] = ("failed", f"CUDA graph capture: {one_line(exc)}")
    if "step" in settings.protocols:
        try:
            b.step_backend = factory.get(b.variant, "step")
            step_plan = b.step_backend.plan(batch)
            b.step_backend.run(q, copies.pair(0), step_plan, b.out)
            device.synchronize()
        except Exception as exc:
            b.skip["step"] = ("failed", f"step instance: {one_line(exc)}")
    if "published" in settings.protocols:
        b.published_inside = plan_inside_published(b.fields["route"])
        try:
            if b.published_inside:
                b.published_backend = factory.get(b.variant, "published")
                pub_plan = b.published_backend.plan(batch)
                b.published_backend.run(q.index_select(0, gather_index).contiguous(), copies.pair(0), pub_plan, b.out)
            else:
                b.published_backend = b.backend
            device.synchronize()
        except Exception as exc:
            b.skip["published"] = ("failed", f"published instance: {one_line(exc)}")


def _measure(protocol: str, b: Bound, case: Case, device, settings: Settings, cursor: CopyCursor, copies, q,
             gather_index, separator: CaseSeparator | None = None) -> dict:
    batch = case.batch
    if protocol == "kernel":
        return kernel_once(device, b.replays, cursor, settings.calls_per_graph, settings.kernel_queue_cycles,
                           separators=None if separator is None else separator.replay)
    if protocol == "eager":
        return eager_once(device, lambda c: b.backend.run(q, copies.pair(c), b.plan, b.out), cursor,
                          settings.eager_loop_calls)
    if protocol == "step":
        sb = b.step_backend
        return step_once(device, lambda: sb.plan(batch), lambda p, c: sb.run(q, copies.pair(c), p, b.out),
                         settings.layers, cursor)
    if protocol == "published":
        pb = b.published_backend
        if b.published_inside:
            def body(c):
                p = pb.plan(batch)
                pb.run(q.index_select(0, gather_index).contiguous(), copies.pair(c), p, b.out)
        else:
            def body(c):
                pb.run(q, copies.pair(c), b.plan, b.out)
        return published_once(device, body, cursor)
    raise PKVError(f"unknown protocol {protocol!r}; expected one of {', '.join(PROTOCOLS)}")


def _timing_row(base: dict, b: Bound, protocol: str, repeat: int, fields: dict, ceiling: float, case: Case) -> dict:
    layers = int(fields.get("layers", 1))
    per_layer = fields["time_us"] / layers
    return raw_row(**base, backend=b.variant.name, protocol=protocol, repeat=repeat,
                   **{**{"num_splits": b.variant.num_splits}, **b.fields},
                   time_us=fields["time_us"], wall_us=fields.get("wall_us", float("nan")),
                   host_us=fields.get("host_us", float("nan")),
                   host_loop_us=fields.get("host_loop_us", float("nan")),
                   host_loop_max_us=fields.get("host_loop_max_us", float("nan")),
                   separator_us=fields.get("separator_us", float("nan")), layers=layers, per_layer_us=per_layer,
                   frac_of_ceiling=frac_of_ceiling(case.batch.kv_bytes, per_layer, ceiling), status="ok")


def run_cases(cases: list[Case], device, factory: BackendFactory, settings: Settings, ctx: RunContext,
              progress: bool = True, on_case=None) -> list[dict]:
    """Every case in turn (tqdm progress bar); returns all raw rows. The timing thread is pinned
    per ``settings.host_cpu`` while the cases run (unless ``ctx.pinner`` is set already) and its
    affinity restored after them. ``on_case(rows, done)``: called after each case with the rows
    so far and how many cases are done (runner.PartialRows.save)."""
    from tqdm import tqdm

    own = ctx.pinner is None
    if own:
        ctx.pinner = HostPinner(settings.host_cpu, log=ctx.log)
    rows: list[dict] = []
    try:
        for index, case in enumerate(tqdm(cases, desc="cases", unit="case", disable=not progress)):
            rows += run_case(case, device, factory, settings, ctx, case_index=index)
            if on_case is not None:
                on_case(rows, index + 1)
    finally:
        if own:
            ctx.pinner.restore()
            ctx.pinner = None
    return rows

