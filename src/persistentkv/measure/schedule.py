"""Interleaved measurement order: rounds of every backend once, shuffled per round (seeded).

Round r visits each backend variant once, in an order drawn from a generator seeded with
(seed, case index, r), so slow drift (clocks, temperature) spreads over all backends instead of
landing on whichever ran last. The first ``warmup`` rounds are run and discarded; rounds
``warmup .. warmup + repeats - 1`` are recorded as repeats 0 .. repeats - 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import require


@dataclass(frozen=True)
class Round:
    index: int            # 0 .. warmup + repeats - 1
    repeat: int           # recorded repeat number, -1 for a warm-up round
    order: tuple[int, ...]  # indices into the case's variant list

    @property
    def warmup(self) -> bool:
        return self.repeat < 0


def rounds(num_variants: int, repeats: int, warmup: int, seed: int, case_index: int = 0) -> list[Round]:
    """The rounds of one case: ``warmup`` discarded ones, then ``repeats`` recorded ones."""
    require(num_variants >= 0, f"num_variants must be >= 0, got {num_variants}")
    require(repeats >= 1, f"repeats must be >= 1, got {repeats}")
    require(warmup >= 0, f"warmup must be >= 0, got {warmup}")
    out = []
    for r in range(warmup + repeats):
        rng = np.random.default_rng([int(seed), int(case_index), r])
        order = tuple(int(i) for i in rng.permutation(num_variants))
        out.append(Round(r, r - warmup if r >= warmup else -1, order))
    return out
