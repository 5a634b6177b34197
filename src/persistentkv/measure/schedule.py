"""Interleaved measurement order: rounds that visit every variant once, in an order that changes.

Two orders, behind one function (:func:`round_order`), each what its callers' runs were taken with:

* seeded (the kernel harness: ``persistentkv measure``, ``bench-kernels``): round r visits each
  backend variant once, in an order drawn from a generator seeded with (seed, case index, r), so
  slow drift (clocks, temperature) spreads over all backends instead of landing on whichever ran
  last;
* rotated (measure-e2e, benchmarks/step_probe.py: whole decode steps, graph after graph): round r
  is the list rotated by r, so each variant leads once every len(names) rounds. The first graph
  of a round carries whatever the round starts with (the host's launch of it, where nothing is
  queued ahead: benchmarks/NOTES.md, "What ships", the rotated rounds row), and every variant
  takes that place equally often.

The first ``warmup`` rounds are run and discarded; rounds ``warmup .. warmup + repeats - 1`` are
recorded as repeats 0 .. repeats - 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import require


def round_order(names, r: int, seed: int | None = None, case_index: int = 0) -> list:
    """The order of ``names`` (any iterable; a dict gives its keys) in round ``r``, a new list.

    ``seed`` None: rotated by r (each name leads once every len(names) rounds). ``seed`` given: a
    permutation drawn from a generator seeded with (seed, case_index, r).
    """
    names = list(names)
    if seed is None:
        k = r % len(names) if names else 0
        return names[k:] + names[:k]
    rng = np.random.default_rng([int(seed), int(case_index), r])
    return [names[int(i)] for i in rng.permutation(len(names))]


@dataclass(frozen=True)
class Round:
    index: int            # 0 .. warmup + repeats - 1
    repeat: int           # recorded repeat number, -1 for a warm-up round
    order: tuple[int, ...]  # indices into the case's variant list

    @property
    def warmup(self) -> bool:
        return self.repeat < 0


def rounds(num_variants: int, repeats: int, warmup: int, seed: int, case_index: int = 0) -> list[Round]:
    """The rounds of one case (the seeded order): ``warmup`` discarded ones, then ``repeats``
    recorded ones."""
    require(num_variants >= 0, f"num_variants must be >= 0, got {num_variants}")
    require(repeats >= 1, f"repeats must be >= 1, got {repeats}")
    require(warmup >= 0, f"warmup must be >= 0, got {warmup}")
    return [Round(r, r - warmup if r >= warmup else -1, tuple(round_order(range(num_variants), r, seed, case_index)))
            for r in range(warmup + repeats)]
