"""Arguments shared by the rendering commands (claims, figures, tables, report)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import PKVError, require


def add_results_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results", required=True, type=Path,
                        help="results/<hw> folder to render (must exist; may be partial: missing parts read 'not measured')")
    parser.add_argument("--counters", type=Path, default=None,
                        help="hardware-independent counters folder (default: results/counters beside --results)")
    from ..configuration import add_config_argument  # yaml: loaded when a command is built, not at import

    add_config_argument(parser)


def load(args: argparse.Namespace):
    from ..configuration import load_config  # yaml and pandas load only when a command runs
    from ..results import load_results

    # A mistyped folder would render every claim as "not measured" and exit 0.
    require(args.results.is_dir(), f"results folder {args.results} does not exist (or is not a folder); "
                                   "give the results/<hw> folder a run wrote")
    require(args.counters is None or args.counters.is_dir(),
            f"counters folder {args.counters} does not exist (or is not a folder)")
    return load_results(args.results, args.counters, load_config(args.config))


def read_claims(path: Path) -> dict:
    require(path.is_file(), f"claims file {path} does not exist; run 'persistentkv claims' first")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise PKVError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
