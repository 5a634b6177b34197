"""Host cost of the adaptive backend's decision, per policy kind (no GPU needed).

    python benchmarks/decision_cost.py [--policy results/nvidia-h200/policy.json]

The adaptive backend decides inside every step's plan, so under the step protocol this cost is
part of its time (benchmarks/NOTES.md). Prints the median of 7 rounds of timeit, in microseconds
per decision, for B = 1, 8 (ragged) and 64 rows: each policy kind evaluated in full, and the
cost model through the adaptive backend's memo (policy.DecisionMemo) when the step's signature
is already known, which is the steady state of a serving loop.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from persistentkv.cache import make_batch  # noqa: E402
from persistentkv.policy import POLICIES, DecisionMemo, load_policy  # noqa: E402
from persistentkv.spec import AttentionSpec  # noqa: E402

CASES = {"B=1 x 9000": [9000], "B=8 ragged": [4096, 9000, 300, 20000, 5000, 7000, 100, 64000],
         "B=64 x 3000": [3000] * 64}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--policy", default=str(ROOT / "results" / "nvidia-h200" / "policy.json"))
    args = parser.parse_args()
    policy = load_policy(args.policy)
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    candidates = tuple(policy.candidates)
    print(f"{'case':14s}" + "".join(f"{kind:>14s}" for kind in POLICIES) + f"{'memo hit':>14s}")
    for name, lengths in CASES.items():
        batch = make_batch(spec, lengths, seed=0)
        row = []
        for kind in POLICIES:
            rounds = timeit.repeat(lambda: policy.decide(batch, kind, candidates), number=500, repeat=7)
            row.append(statistics.median(rounds) / 500 * 1e6)
        memo = DecisionMemo(policy, candidates)
        memo.decide(batch)
        rounds = timeit.repeat(lambda: memo.decide(batch), number=500, repeat=7)
        row.append(statistics.median(rounds) / 500 * 1e6)
        print(f"{name:14s}" + "".join(f"{us:14.1f}" for us in row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
