"""``persistentkv reproduce-reference``: a full run's results cut to a reduced grid, judged again.

    persistentkv reproduce-reference --config config/reproduce.yaml \
        --reference build/reproduce/committed/results/nvidia-h200 --out build/reproduce/reference

writes ``--out``/<hw>/ (the rows a run of ``--config``'s grid would have measured, taken from the
reference's: persistentkv.reproduce_grid) with its claims.json, and ``--out``/counters/ (the
reference's, copied). ``snakemake reproduce`` compares a reduced re-measurement with it, like for
like (config ``reproduce.reference: cut``).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="the reduced grid's config (config/reproduce.yaml)")
    parser.add_argument("--reference", required=True, type=Path, help="a full run's results/<hw> folder")
    parser.add_argument("--out", required=True, type=Path, help="folder to write <hw>/ and counters/ into")


def run(args: argparse.Namespace) -> int:
    import warnings

    from .. import configuration
    from ..reproduce_grid import cut_reference
    from ..results import load_results
    from .claims import judged, write

    config = configuration.load_config(args.config)
    folder = cut_reference(args.reference, args.out, config)
    with warnings.catch_warnings():   # provenance.json names the passes the cut leaves out
        warnings.filterwarnings("ignore", message=".*names runs whose rows and sidecars are gone")
        results = load_results(folder, args.out / "counters", config)
    payload = judged(results)
    write(payload, folder / "claims.json")
    print(f"{folder}: the reference cut to {args.config}'s grid; {len(payload['claims'])} claims judged again")
    return 0
