"""persistentkv figures: render every figure for one hardware (SVG for the report, PDF for the paper)."""

from __future__ import annotations

from pathlib import Path

from ..render import FIGURE_FORMATS, FIGURE_NAMES
from ..render.cli_args import add_results_arguments, load


def add_arguments(parser) -> None:
    add_results_arguments(parser)
    parser.add_argument("--out-dir", required=True, type=Path, help="folder for <figure>.<format>")
    parser.add_argument("--format", default="svg", choices=FIGURE_FORMATS, help="output format (default svg)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="figures to render: " + ", ".join(FIGURE_NAMES))


def run(args) -> int:
    from ..render.figures import render_all  # matplotlib and seaborn: loaded when figures are drawn

    results = load(args)
    written = render_all(results, args.out_dir, args.format, args.only)
    print(f"{results.hw}: {len(written)} figure(s) -> {args.out_dir}")
    return 0
