"""The adaptive backend's host overhead per step when its code runs cold, on any CPU (no GPU).

    python benchmarks/adaptive_cold.py [--trials 4] [--rounds 300]

A host-bound decode step (B = 1: plan + 32 layers, the step protocol) runs its Python between
other work, so the adaptive's extra lines are paid with cold caches, several times their warm
cost. This times one step (plan, then 32 run() calls) of: the delegate alone, a one-line wrapper
around it (the least any routing layer can cost), and the adaptive backend, each with a
64 MB array read and 20,000 random dict reads before it (to evict the caches), in a shuffled
order per round. The delegate is a stand-in whose plan does what pkv-workqueue's host side does
to a batch's lengths (plan.choose_warps, one numpy concatenate into a buffer) and whose plans
carry an engine with an empty run, so the times are the Python around the GPU, not the GPU.
Prints, per trial, the median paired difference to the delegate alone (us per step). See
benchmarks/NOTES.md, "Host: the adaptive's fast step".
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src")]

import numpy as np  # noqa: E402

from persistentkv.backends.adaptive import AdaptiveBackend  # noqa: E402
from persistentkv.cache import make_batch  # noqa: E402
from persistentkv.plan import choose_warps  # noqa: E402
from persistentkv.spec import AttentionSpec  # noqa: E402

LAYERS = 32


class _Engine:
    def run(self, q, cache, plan, out):
        pass


class _Plan:
    def __init__(self, engine):
        self.engine = engine


class StandIn:
    """A delegate with pkv-workqueue's host-side shape and no GPU."""
    plan_runs_on_engine = True
    graph_safe = True

    def __init__(self, **options):
        self._engine = _Engine()
        self._buffer = np.zeros(64, dtype=np.int32)

    def unavailable(self, spec):
        return []

    def plan(self, batch):
        choose_warps(batch.seq_lens, batch.spec.head_dim)
        np.concatenate((batch.seq_lens, batch.kv_indptr), out=self._buffer[:1 + batch.kv_indptr.size])
        return _Plan(self._engine)

    def run(self, q, cache, plan, out):
        plan.engine.run(q, cache, plan, out)


class Wrapper:
    def __init__(self, inner):
        self.inner = inner

    def plan(self, batch):
        return self.inner.plan(batch)

    def run(self, q, cache, plan, out):
        self.inner.run(q, cache, plan, out)


class _Registry:
    def create(self, name, **options):
        return StandIn(**options)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default=str(ROOT / "results" / "nvidia-h200" / "policy.json"))
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--length", type=int, default=8200, help="the one row's length (default 8200: bucketed_b1)")
    args = ap.parse_args(argv)

    spec = AttentionSpec(32, 8, 128, 16, "float16")
    batch = make_batch(spec, [args.length], seed=1)
    adaptive = AdaptiveBackend(args.policy, registry=_Registry())
    reasons = adaptive.unavailable(spec)
    if reasons:
        print("adaptive unusable:", "; ".join(reasons), file=sys.stderr)
        return 2
    backends = {"delegate": StandIn(), "wrapper": Wrapper(StandIn()), "adaptive": adaptive}
    for b in backends.values():  # warm-up: the adaptive decides this row once here
        for _ in range(3):
            b.run(None, None, b.plan(batch), None)

    junk = np.random.default_rng(0).random(8 * 2**20)
    objects = [{"a": i, "b": str(i)} for i in range(200_000)]
    rng = random.Random(0)

    def evict():
        junk.sum()
        total = 0
        for d in rng.sample(objects, 20_000):
            total += d["a"]

    def step(b):
        plan = b.plan(batch)
        for _ in range(LAYERS):
            b.run(None, None, plan, None)

    print(f"B=1 x {args.length}: median us per step over {args.rounds} rounds, minus the delegate alone's")
    for trial in range(args.trials):
        times = {name: [] for name in backends}
        for _ in range(args.rounds):
            names = list(backends)
            rng.shuffle(names)
            for name in names:
                evict()
                t0 = time.perf_counter()
                step(backends[name])
                times[name].append((time.perf_counter() - t0) * 1e6)
        t = {k: np.asarray(v) for k, v in times.items()}
        print(f"trial {trial}: delegate {np.median(t['delegate']):.1f} us; "
              + ", ".join(f"{k} +{np.median(t[k] - t['delegate']):.1f}" for k in ("wrapper", "adaptive")), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
