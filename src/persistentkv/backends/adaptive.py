"""The ``adaptive`` backend: a frozen policy picks a delegate backend for each decode step.

plan(batch) decides (persistentkv.policy) and returns the delegate's plan wrapped with the
decision, so the harness can record what ran (``plan.route``, also ``last_decision``); run() hands
the inner plan untouched to the delegate's run (for a delegate whose capabilities say
``plan_engine``, our routes, to the engine that made the plan), so it stays graph-capturable
whenever the delegate's run() is. Its ``capabilities.graph`` is ``replan`` (each step may go to
another delegate, so a captured step is re-captured when the lengths change), ``none`` while the
last planned delegate's is.

With the memoised cost model (the default) a step is decided where that costs least. A step the
memo answers by its one-row fast path (one row, in the length bin of the last one-row step:
DecisionMemo.fast_decision, two comparisons) is decided in plan(). Any other step runs on the
previous step's choice and is decided right after its first run() has launched (``defer``), so a
signature lookup or a model evaluation overlaps the GPU instead of delaying the first launch. A
one-row decode takes the fast path on every step but the first of each bin (a bin is ~2.2 % of the
length wide: ~180 steps at 8200 tokens), and such a step's host work is the two comparisons, the
delegate's plan and one AdaptivePlan, with nothing left for run() to settle. Its path does not
enter the memo at all: what it needs (the bin, the delegate's bound plan method, the prebuilt
tuples it stores) is read once per decision (``_fast``), because a host-bound step pays its extra
Python cold, between the other work of a serving loop, where each line costs several times its
warm time (benchmarks/NOTES.md, "Host: the adaptive's fast step").
"""

from __future__ import annotations

import json
from operator import attrgetter
from pathlib import Path
from typing import Any

from ..cache import Batch
from ..errors import PKVError, require
from ..policy import POLICIES, Decision, DecisionMemo, Policy, load_policy
from ..spec import AttentionSpec
from . import registry
from .base import Capabilities


#: Memo decisions whose delegate AdaptiveBackend remembers by identity; the cache is emptied when
#: it reaches this size (the memo holds at most policy.MEMO_MAX_ENTRIES decisions at a time).
MAX_DECISIONS_HELD = 4096
#: What the adaptive backend declares: the serving dtypes of the routes and baselines its policies
#: choose among (each delegate's own unavailable() decides a spec); a step re-captured when the
#: lengths change, or never captured while the last planned delegate cannot be.
CAPABILITIES = Capabilities(dtypes=("float16", "bfloat16"), graph="replan")
EAGER_CAPABILITIES = Capabilities(dtypes=("float16", "bfloat16"), graph="none")


def _refuse(name: str):
    """The setter of AdaptivePlan's field ``name``: it refuses."""
    def refuse(self, value):
        raise AttributeError(f"AdaptivePlan is read-only (tried to set {name})")

    return refuse


def _field(name: str) -> property:
    """A read-only public view of AdaptivePlan's slot ``_<name>``."""
    return property(attrgetter("_" + name), _refuse(name), doc=f"this step's {name} (read-only)")


class _Runs:
    """An object whose ``run`` is a given callable: the runner of an AdaptivePlan constructed with
    an explicit ``run`` (AdaptiveBackend.plan stores the delegate or the engine itself)."""

    __slots__ = ("run",)

    def __init__(self, run):
        self.run = run


class AdaptivePlan:
    """One step's decision and the chosen delegate's own plan (read-only).

    route:    the delegate's backend name (what the timing rows record as ``route``)
    decision: the policy's Decision (backend, options, one-line reason)
    delegate: the backend object that plans and runs this step
    inner:    ``delegate.plan(batch)``, passed back to ``delegate.run`` unchanged
    run:      what runs it: ``delegate.run``, or for a delegate whose plans carry the engine that
              made them (``delegate.capabilities.plan_engine``, our pkv backends) that engine's
              run, one Python call fewer per layer

    One is made on every step's host path and its run is called once per layer, so it is plain
    slots (``_route`` ...), each exposed as a property that refuses assignment, and it holds the
    object whose run() runs the step (``_runner``: the delegate or the engine) rather than the
    bound method: AdaptiveBackend.run calls ``plan._runner.run(...)``, which Python does without
    making or unpacking a bound method. On the development CPU: ~0.2 us to build (a
    ``__setattr__`` override, which every store would go through, made it ~0.5 us) and ~12 ns less
    per run() than calling a stored bound method.
    """

    __slots__ = ("_route", "_decision", "_delegate", "_inner", "_runner")

    def __init__(self, route: str, decision: Decision, delegate: Any, inner: Any, run: Any = None):
        self._route = route
        self._decision = decision
        self._delegate = delegate
        self._inner = inner
        self._runner = delegate if run is None else _Runs(run)

    route = _field("route")
    decision = _field("decision")
    delegate = _field("delegate")
    inner = _field("inner")
    run = property(lambda self: getattr(self._runner, "run", None), _refuse("run"),
                   doc="what runs inner: delegate.run or its engine's run (read-only)")

    def __repr__(self) -> str:
        return f"AdaptivePlan(route={self._route!r}, decision={self._decision!r})"

    def counters(self):
        """The delegate plan's workload counters when it has them (our routes), else None."""
        counters = getattr(self._inner, "counters", None)
        return counters() if callable(counters) else None


_new_plan = object.__new__


def _route(delegate: Any) -> tuple:
    """(delegate, whether its plans run on their engine): what a step needs of a delegate, read
    once per decision of the memo rather than on every step."""
    return delegate, delegate.capabilities.plan_engine


class AdaptiveBackend:
    """Routes each step by ``policy`` (one of paper, thresholds, cost_model) read from ``policy_path``.

    ``registry`` needs ``create(name, **options) -> Backend``; it defaults to
    ``persistentkv.backends.registry``. Delegates are created once per (name, options).

    ``memo`` (cost_model only, default on): reuse a decision for steps of the same
    :func:`persistentkv.policy.step_signature` (persistentkv.policy.DecisionMemo), so a step pays
    the model once every few hundred steps instead of every step; ``memo_stats()`` counts hits and
    misses. The rule policies are exact functions of the step (the paper's rules count distinct
    lengths) and are always evaluated.

    ``defer`` (memoised cost model only, default on): a step that the memo cannot answer by its
    one-row fast path (:meth:`persistentkv.policy.DecisionMemo.fast_decision`) runs on the
    delegate chosen for the previous step of its spec, and its own decision is made right after
    its first run() has launched, so the decision's host time overlaps the GPU instead of delaying
    the step's first launch. A fast-path step is decided in plan(), on its own decision: two
    comparisons cost less than the deferral's bookkeeping, and run() then has nothing to settle.
    The result is the same either way (every delegate computes the same attention); only the
    route of a deferred step can lag by one step, and consecutive decode steps share a memo
    signature for hundreds of steps. A plan made while the previous one is still undecided
    settles that decision first (so the fast path reads the memo as it would be had every step
    run); the first step of a spec decides before it plans. ``plan.decision``, ``plan.route`` and
    ``last_decision`` name the delegate the step actually runs on.
    """

    def __init__(self, policy_path: str | Path, registry: Any = None, name: str = "adaptive",
                 policy: str = "cost_model", memo: bool = True, defer: bool = True):
        require(policy in POLICIES, f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")
        self.name = name
        self.policy_path = Path(policy_path)
        self.kind = policy
        self.memo = bool(memo) and policy == "cost_model"
        self.defer = bool(defer) and self.memo
        #: (spec, decision, *_route(delegate)) of the last decided step: the next step of that spec
        #: runs on it when its own decision is deferred (defer)
        self._chosen: tuple | None = None
        #: the batch planned on the previous choice, whose own decision is still to be made (defer)
        self._undecided: Batch | None = None
        #: (decision, delegate) of the last planned step: last_decision and capabilities read it
        self._last: tuple = (None, None)
        #: what a fast step needs (_refresh_fast), and how many steps took it (memo hits)
        self._fast: tuple | None = None
        self._fast_hits = 0
        self._registry = registry
        self._policy: Policy | None = None
        self._delegates: dict[tuple, Any] = {}
        self._usable: dict[AttentionSpec, tuple[str, ...]] = {}
        self._memos: dict[tuple[str, ...], DecisionMemo] = {}
        #: spec -> (usable candidates, their memo or None): one lookup per step
        self._per_spec: dict[AttentionSpec, tuple] = {}
        #: the spec of the last step and its _for_spec entry (a serving loop's batches share one spec
        #: object, so most steps skip hashing it)
        self._last_spec: Any = None
        self._last_entry: tuple = ()
        #: id(decision) -> (decision, _route(delegate)): a memo hit returns the same Decision object,
        #: so its delegate is found without rebuilding the options key (the entry holds the
        #: decision, so its id cannot be reused while the entry lives)
        self._by_decision: dict[int, tuple] = {}

    # -- helpers
    def _load(self) -> Policy:
        if self._policy is None:
            self._policy = load_policy(self.policy_path)
        return self._policy

    def _get_registry(self):
        if self._registry is None:
            self._registry = registry
        return self._registry

    def _delegate(self, backend: str, options: dict) -> Any:
        try:
            key = (backend, tuple(sorted(options.items())))
            hash(key)
        except TypeError:  # an option value that is a list or a dict
            key = (backend, json.dumps(options, sort_keys=True))
        delegate = self._delegates.get(key)
        if delegate is None:
            delegate = self._delegates[key] = self._get_registry().create(backend, **options)
        return delegate

    # -- the Backend interface
    def unavailable(self, spec: AttentionSpec) -> list[str]:
        """[] when the policy loads and at least one backend it can choose runs ``spec`` here."""
        try:
            policy = self._load()
            self._get_registry()
        except PKVError as exc:
            return [str(exc)]
        usable, reasons = [], []
        for backend in policy.choosable(self.kind):
            try:
                why = list(self._delegate(backend, {}).unavailable(spec))
            except Exception as exc:  # a backend that cannot even be constructed is unusable, not fatal
                why = [f"cannot be created ({type(exc).__name__}: {exc})"]
            if why:
                reasons.append(f"{backend}: {'; '.join(why)}")
            else:
                usable.append(backend)
        self._usable[spec] = tuple(usable)
        if usable:
            return []
        if not policy.choosable(self.kind):
            return [f"policy {self.policy_path} ({self.kind}) has no backend it can choose "
                    f"(no fitted cost model for any of {', '.join(policy.candidates)})"]
        return [f"no candidate of policy {self.policy_path} can run here: " + " | ".join(reasons)]

    def _for_spec(self, spec: AttentionSpec) -> tuple:
        """(usable candidates, their DecisionMemo or None) for ``spec``, checked once."""
        entry = self._per_spec.get(spec)
        if entry is None:
            if spec not in self._usable:
                reasons = self.unavailable(spec)
                require(not reasons, f"{self.name} cannot run this spec: {'; '.join(reasons)}")
            usable = self._usable[spec]
            require(usable, f"{self.name}: no candidate backend can run this spec")
            memo = None
            if self.memo:
                memo = self._memos.get(usable)
                if memo is None:
                    memo = self._memos[usable] = DecisionMemo(self._load(), usable)
            entry = self._per_spec[spec] = (usable, memo)
        return entry

    def _route_for(self, decision: Decision) -> tuple:
        """(delegate, whether its plans run on their engine) for ``decision``; a memo's
        decision is found by identity (a memo hit returns the same Decision object), so its options
        key is built once per decision, not once per step."""
        hit = self._by_decision.get(id(decision))
        if hit is not None and hit[0] is decision:
            return hit[1]
        route = _route(self._delegate(decision.backend, decision.options))
        if len(self._by_decision) >= MAX_DECISIONS_HELD:
            self._by_decision.clear()
        self._by_decision[id(decision)] = (decision, route)
        return route

    def plan(self, batch: Batch) -> AdaptivePlan:
        # The fast step: one row of the spec and in the length bin of the last one-row step the
        # memo decided, so the memo would answer it by its two comparisons (a hit). Everything
        # it needs was read when that decision was made (``_fast``), so its host path is this
        # block: a step of a host-bound decode (B = 1, plan + 32 layers) pays it cold, between
        # other work, where every line of Python it runs costs several times its warm time.
        fast = self._fast
        if fast is not None and batch.spec is fast[0]:
            lens = batch.seq_lens.tolist()
            if len(lens) == 1 and fast[1] <= lens[0] < fast[2]:
                self._fast_hits += 1
                self._chosen = fast[4]
                self._last = fast[5]
                plan = _new_plan(AdaptivePlan)
                plan._route, plan._decision, plan._delegate = fast[6]
                inner = plan._inner = fast[3](batch)
                plan._runner = inner.engine if fast[7] else fast[5][1]
                return plan
        return self._plan_slow(batch)

    def _plan_slow(self, batch: Batch) -> AdaptivePlan:
        """plan() of any step but a fast one; it refreshes ``_fast`` for the next."""
        spec = batch.spec
        if spec is not self._last_spec:
            self._last_entry = self._for_spec(spec)
            self._last_spec = spec
        usable, memo = self._last_entry
        if memo is None:  # the rule policies decide every step anew
            decision = self._load().decide(batch, self.kind, usable)
            delegate, on_engine = _route(self._delegate(decision.backend, decision.options))
        elif not self.defer:
            decision = memo.decide(batch)
            delegate, on_engine = self._route_for(decision)
        else:
            if self._undecided is not None:  # planned again before a run: settle that decision first
                self._settle()
            chosen = self._chosen
            decision = memo.fast_decision(batch)  # a cheap decision is made here, not deferred
            if decision is None:
                if chosen is not None and chosen[0] is spec:
                    self._undecided = batch  # runs on the previous step's choice; decided in run()
                else:
                    decision = memo.decide(batch)  # no choice of this spec to run on: decide now
            if decision is not None:
                chosen = self._choose(spec, decision)
            _, decision, delegate, on_engine = chosen
        self._refresh_fast(memo)
        inner = delegate.plan(batch)
        self._last = (decision, delegate)
        # The AdaptivePlan, built without a call to its constructor. A step of a few hundred
        # microseconds can be host-bound (each run() call's host time near the kernel's), so the
        # adaptive's own calls per layer count: our plans (capabilities.plan_engine) run on their engine.
        plan = _new_plan(AdaptivePlan)
        plan._route = decision.backend
        plan._decision = decision
        plan._delegate = delegate
        plan._inner = inner
        plan._runner = inner.engine if on_engine else delegate
        return plan

    def _refresh_fast(self, memo: DecisionMemo | None) -> None:
        """``_fast`` from ``memo``'s last one-row decision: (spec, lo, hi, delegate.plan, the
        _chosen entry, (decision, delegate), (route, decision, delegate), on_engine); None while a
        decision is pending (the next plan must settle it first) or without a memo."""
        row = None if memo is None or self._undecided is not None else memo.last_row()
        if row is None:
            self._fast = None
            return
        spec, lo, hi, decision = row
        fast = self._fast
        if fast is not None and fast[0] is spec and fast[4][1] is decision and fast[1] == lo:
            return  # unchanged
        delegate, on_engine = self._route_for(decision)
        self._fast = (spec, lo, hi, delegate.plan, (spec, decision, delegate, on_engine), (decision, delegate),
                      (decision.backend, decision, delegate), on_engine)

    def _settle(self) -> None:
        """Decide the undecided batch; the next step of its spec runs on that choice. (Inside a
        step's first run().)"""
        batch, self._undecided = self._undecided, None
        if batch is None:  # nothing pending (the step was decided in plan())
            return
        spec = batch.spec
        memo = self._last_entry[1] if spec is self._last_spec else self._for_spec(spec)[1]
        self._choose(spec, memo.decide(batch))
        self._refresh_fast(memo)

    def _choose(self, spec: AttentionSpec, decision: Decision) -> tuple:
        """``_chosen`` = (spec, decision, delegate, on_engine) for ``decision``, rebuilt only when
        the spec or the decision changed (a memo hit returns the same Decision object)."""
        chosen = self._chosen
        if chosen is None or chosen[1] is not decision or chosen[0] is not spec:
            chosen = self._chosen = (spec, decision, *self._route_for(decision))
        return chosen

    def memo_stats(self) -> dict:
        """{"hits": n, "misses": n} of the decision memo over every spec planned so far (a fast
        step, answered in plan() without asking the memo, counts as the hit it is)."""
        return {"hits": self._fast_hits + sum(m.hits for m in self._memos.values()),
                "misses": sum(m.misses for m in self._memos.values())}

    @property
    def last_decision(self) -> Decision | None:
        """The Decision the last planned step runs on (None before the first plan)."""
        return self._last[0]

    @property
    def capabilities(self) -> Capabilities:
        """:data:`CAPABILITIES`; graph ``none`` while the last planned delegate's run() cannot be
        captured (before the first plan: ``replan``)."""
        delegate = self._last[1]
        if delegate is not None and delegate.capabilities.graph == "none":
            return EAGER_CAPABILITIES
        return CAPABILITIES

    def run(self, q, cache, plan: AdaptivePlan, out) -> None:
        plan._runner.run(q, cache, plan._inner, out)
        if self._undecided is not None:  # defer: decide while the GPU runs this launch
            self._settle()
