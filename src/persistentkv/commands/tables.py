"""persistentkv tables: LaTeX tables and macros.tex for the paper, from claims.json and the results."""

from __future__ import annotations

from pathlib import Path

from ..render.cli_args import add_results_arguments, load, read_claims


def add_arguments(parser) -> None:
    add_results_arguments(parser)
    parser.add_argument("--claims", required=True, type=Path, help="claims.json written by 'persistentkv claims'")
    parser.add_argument("--out-dir", required=True, type=Path,
                        help="folder for macros.tex and tables/*.tex (paper/generated)")


def run(args) -> int:
    from ..render.tables import render  # jinja2: loaded when the tables are rendered

    results = load(args)
    written = render(read_claims(args.claims), results, args.out_dir)
    print(f"{results.hw}: {len(written)} file(s) -> {args.out_dir}")
    return 0
