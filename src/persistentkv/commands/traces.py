"""``persistentkv traces``: one trace -> canonical JSON (build/traces/{trace}_s{seed}.json).

Either a config entry (``--trace NAME --seed SEED``) or a user's CSV file (``--file``, columns
request_id, arrival_step, prompt_len, decode_steps). Same seed and parameters, same bytes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import configuration, traces
from ..errors import require


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", metavar="NAME", help="a trace entry of the config (traces[].name)")
    source.add_argument("--file", metavar="CSV", type=Path,
                        help="a trace file: request_id, arrival_step, prompt_len, decode_steps")
    configuration.add_config_argument(parser)
    parser.add_argument("--seed", type=int, default=None,
                        help="generator seed (default: the config's calibration seed; recorded only for --file)")
    parser.add_argument("--max-active", type=int, default=None, help="--file: rows per step (required)")
    parser.add_argument("--num-steps", type=int, default=None, help="--file: keep the first N non-empty steps")
    parser.add_argument("--name", default=None, help="--file: trace name (default: the file's stem)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output JSON (default: build/traces/{name}_s{seed}.json)")


def run(args: argparse.Namespace) -> int:
    if args.trace is not None:
        for flag, value in (("--max-active", args.max_active), ("--num-steps", args.num_steps), ("--name", args.name)):
            require(value is None, f"{flag} applies to --file only; {args.trace!r} takes it from the config")
        config = configuration.load_config(args.config)
        entry = configuration.trace_entry(config, args.trace)
        seed = configuration.calibration_seed(config) if args.seed is None else args.seed
        trace = traces.build(entry, seed)
    else:
        require(args.max_active is not None, "--file needs --max-active (rows per decode step)")
        trace = traces.from_file(args.file, args.max_active, args.num_steps,
                                 seed=0 if args.seed is None else args.seed, name=args.name)
    require(len(trace.steps) > 0, f"trace {trace.name!r} has no active step")
    out = args.out if args.out is not None else Path("build/traces") / f"{trace.name}_s{trace.seed}.json"
    traces.write_trace(trace, out)
    print(f"{out}: {trace.name} seed {trace.seed}, {len(trace.requests)} requests, {len(trace.steps)} steps, "
          f"max {max(s.max_len for s in trace.steps)} tokens")
    return 0
