"""persistentkv claims: judge every numbered claim of the paper from one hardware's results."""

from __future__ import annotations

from pathlib import Path

from ..io import atomic_write_json, round_floats
from ..render.cli_args import add_results_arguments, load


def add_arguments(parser) -> None:
    add_results_arguments(parser)
    parser.add_argument("--out", required=True, type=Path, help="claims.json to write")


def judged(results) -> dict:
    """claims.json's payload for ``results``: the claims, the engine's targets, the floor and the
    FP8 cache's (before the published rounding)."""
    from .. import claims  # pandas and the bootstrap: loaded when the claims are judged
    from ..targets import floor_verdicts
    from ..targets_fp8 import fp8_verdicts

    payload = claims.judge(results)
    payload["floor"] = floor_verdicts(results)  # the one-kernel floor and the shapes grid (targets.py)
    payload["fp8"] = fp8_verdicts(results, claims.fp8_adaptive(results))  # the FP8 cache's (targets_fp8.py)
    return payload


def write(payload: dict, out: Path) -> None:
    atomic_write_json(out, round_floats(payload, "claims"))


def run(args) -> int:
    results = load(args)
    payload = judged(results)
    write(payload, args.out)
    c = payload["counts"]
    print(f"{results.hw}: {len(payload['claims'])} claims: " + ", ".join(f"{v} {n}" for v, n in c.items())
          + f" -> {args.out}")
    return 0
