"""persistentkv report: the self-contained HTML report for one hardware."""

from __future__ import annotations

from pathlib import Path

from ..render.cli_args import add_results_arguments, load, read_claims


def add_arguments(parser) -> None:
    add_results_arguments(parser)
    parser.add_argument("--claims", required=True, type=Path, help="claims.json written by 'persistentkv claims'")
    parser.add_argument("--figures-dir", required=True, type=Path, help="folder with the SVG figures")
    parser.add_argument("--out", required=True, type=Path, help="report.html to write")


def run(args) -> int:
    from ..render.report import read_reproduction, render  # jinja2, matplotlib: loaded when the report is rendered

    results = load(args)
    out = render(read_claims(args.claims), results, args.figures_dir, args.out,
                 reproduction=read_reproduction(args.results))
    print(f"{results.hw}: report -> {out} ({out.stat().st_size // 1024} KiB)")
    return 0
