"""persistentkv claims: judge every numbered claim of the paper from one hardware's results."""

from __future__ import annotations

from pathlib import Path

from ..io import atomic_write_json, round_floats
from ..render.cli_args import add_results_arguments, load


def add_arguments(parser) -> None:
    add_results_arguments(parser)
    parser.add_argument("--out", required=True, type=Path, help="claims.json to write")


def run(args) -> int:
    from .. import claims  # pandas and the bootstrap: loaded when the claims are judged
    from ..targets import floor_verdicts
    from ..targets_fp8 import fp8_verdicts

    results = load(args)
    payload = claims.judge(results)
    payload["floor"] = floor_verdicts(results)  # the one-kernel floor and the shapes grid (targets.py)
    payload["fp8"] = fp8_verdicts(results)      # the FP8 cache's grids (targets_fp8.py)
    atomic_write_json(args.out, round_floats(payload, "claims"))
    c = payload["counts"]
    print(f"{results.hw}: {len(payload['claims'])} claims: " + ", ".join(f"{v} {n}" for v, n in c.items())
          + f" -> {args.out}")
    return 0
