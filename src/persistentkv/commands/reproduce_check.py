"""persistentkv reproduce-check: a re-measured results folder against the committed reference.

    persistentkv reproduce-check --config config/config.yaml \
        [--reference results/nvidia-h200] [--measured results/<gpu>] [--out results/<gpu>/reproduction.json]

Prints one table (item, committed, re-measured, agrees), writes reproduction.json (docs/DATA.md)
and exits 0 when every judged item agrees, 1 when one does not (persistentkv.reproduce).
"""

from __future__ import annotations

from pathlib import Path

from .. import configuration
from ..io import atomic_write_json, round_floats


def add_arguments(parser) -> None:
    configuration.add_config_argument(parser)
    parser.add_argument("--reference", type=Path, default=None,
                        help="the committed results folder (default: results/<hardware.reference>)")
    parser.add_argument("--measured", type=Path, default=None,
                        help="the re-measured results folder (default: config reproduce.measured; auto: "
                             "results/<hardware.target's GPU>)")
    parser.add_argument("--reference-counters", type=Path, default=None,
                        help="the reference's counters folder (default: counters/ beside --reference)")
    parser.add_argument("--measured-counters", type=Path, default=None,
                        help="the re-measured counters folder (default: counters/ beside --measured)")
    parser.add_argument("--out", type=Path, default=None,
                        help="reproduction.json to write (default: reproduction.json in --measured)")
    parser.add_argument("--exit-zero", action="store_true",
                        help="exit 0 when items disagree too (the workflow keeps reproduction.json; "
                             "Snakemake deletes the outputs of a job that fails)")


def run(args) -> int:
    from .. import reproduce  # pandas: loaded when the folders are compared

    config = configuration.load_config(args.config)
    tolerances = reproduce.Tolerances.from_config(config)   # fixed before any result is read
    reference = args.reference or Path("results") / config["hardware"]["reference"]
    measured = args.measured
    if measured is None:
        from ..hardware import target

        auto = config["reproduce"]["measured"] == reproduce.MEASURED_AUTO   # only then ask nvidia-smi
        measured = reproduce.measured_folder(config, target(config) if auto else None)
    payload = reproduce.compare(reproduce.read_side(reference, args.reference_counters),
                                reproduce.read_side(measured, args.measured_counters), tolerances)
    out = args.out or measured / "reproduction.json"
    atomic_write_json(out, round_floats(payload, "claims"))
    print("\n".join(reproduce.summary_lines(payload)))
    print(f"-> {out}")
    return 0 if payload["agrees"] or args.exit_zero else 1
