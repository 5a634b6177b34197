"""Arguments shared by the rendering commands (claims, figures, tables, report)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import PKVError, require


def add_results_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results", required=True, type=Path,
                        help="results/<hw> folder to render (may be absent or partial: missing parts read 'not measured')")
    parser.add_argument("--counters", type=Path, default=None,
                        help="hardware-independent counters folder (default: results/counters beside --results)")
    from ..configuration import add_config_argument  # yaml: loaded when a command is built, not at import

    add_config_argument(parser)


def load(args: argparse.Namespace):
    from ..configuration import load_config  # yaml and pandas load only when a command runs
    from ..results import load_results

    if not args.results.exists():
        print(f"note: {args.results} does not exist: everything of {args.results.name} renders as "
              "'not measured yet'", file=sys.stderr)
    return load_results(args.results, args.counters, load_config(args.config))


def read_claims(path: Path) -> dict:
    require(path.is_file(), f"claims file {path} does not exist; run 'persistentkv claims' first")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise PKVError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
