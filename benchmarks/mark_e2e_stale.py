"""Mark the e2e rows a DecodeLoop defect (fixed in 35ec66d) made wrong, in place.

Before 35ec66d a ``replan``-mode loop (pkv-buckets, pkv-split: host-planned items) that re-planned
for grown lengths re-captured its step graph but kept its attention graph, which replayed the
previous plan's freed buffers. In a measure-e2e trace that happens at every timed step whose rows
are the previous timed step's (a change of rows rebuilt the loop and captured both graphs fresh).
Those rows' attention_us, and so non_attention_us, are not measurements of the step they name:
they get status ``failed`` and a reason saying so (step_us was measured by a fresh step graph but
goes with them: a row is judged whole). Run once on a file written before 35ec66d:

    python benchmarks/mark_e2e_stale.py results/nvidia-h200/e2e.parquet
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from persistentkv import configuration, traces  # noqa: E402
from persistentkv.io import atomic_write_parquet  # noqa: E402

REPLAN_BACKENDS = ("pkv-buckets", "pkv-split")
REASON = ("attention graph captured before the step's re-plan: it replayed the previous plan's freed buffers "
          "(DecodeLoop, fixed in 35ec66d); attention_us and non_attention_us are not this step's")


def stale_steps(config: dict, trace: str, seed: int, stride: int) -> set[int]:
    """Timed steps (every ``stride``-th) whose rows equal the previous timed step's."""
    steps = traces.build(configuration.trace_entry(config, trace), seed).steps[::stride]
    return {b.index for a, b in zip(steps, steps[1:]) if list(a.request_ids) == list(b.request_ids)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", help="an e2e.parquet written before 35ec66d")
    parser.add_argument("--config", default="config/config.yaml")
    args = parser.parse_args()
    config = configuration.load_config(args.config)
    frame = pd.read_parquet(args.table)
    marked = pd.Series(False, index=frame.index)
    for trace, part in frame[frame["backend"].isin(REPLAN_BACKENDS) & frame["model"].ne("")].groupby("trace"):
        if trace == "cases":
            continue
        seed = int(part["seed"].iloc[0])
        stale = stale_steps(config, trace, seed, int(config["measure"]["step_stride"]))
        marked |= frame.index.isin(part.index[part["step"].isin(stale) & part["status"].eq("ok")])
    frame.loc[marked, "status"] = "failed"
    frame.loc[marked, "reason"] = REASON
    atomic_write_parquet(args.table, frame)
    print(f"{args.table}: {int(marked.sum())} rows marked failed "
          f"({', '.join(sorted(set(frame.loc[marked, 'trace'] + '@' + frame.loc[marked, 'step'].astype(str))))})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
