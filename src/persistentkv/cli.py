"""``persistentkv`` / ``python -m persistentkv``: everything the workflow rules call.

Each command lives in ``persistentkv.commands.<module>`` and defines ``add_arguments(parser)``
and ``run(args) -> int``; it is imported only when invoked, so ``--help`` stays fast and a
command needing a GPU package never slows the others down. User errors (:class:`PKVError`, and
a path the command cannot read or write) print one line, ``error: ...``, and exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from . import __version__
from .errors import PKVError

#: command -> (module under persistentkv.commands, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "info": ("info", "environment, GPU and which backends can run here (with reasons)"),
    "traces": ("traces", "generate a seeded trace (or read a trace file) into canonical JSON"),
    "counters": ("counters", "plan every step of a trace with every route; write workload counters"),
    "validate-cpu": ("validate_cpu", "run the NumPy executor on sampled steps against float64"),
    "ablation": ("ablation", "bucket and split ablations (launches, padded and merge bytes)"),
    "compile-kernels": ("compile_kernels", "compile kernels/ for named architectures; report registers/spills"),
    "bench-kernels": ("bench_kernels", "GPU: our routes, every installed baseline and the read ceiling"),
    "bench-shapes": ("bench_shapes", "GPU: Hkv x G x B x bytes, every baseline, our routes, the one-kernel floor"),
    "measure": ("measure", "GPU: one experiment under the fair and the published protocol"),
    "measure-e2e": ("measure_e2e", "GPU: the full Llama decode step per backend (graph replay), attention's share"),
    "validate-gpu": ("validate_gpu", "GPU: every backend against float64 at sampled steps of every trace"),
    "fp8-logits": ("fp8_logits", "an FP8 cache's effect on a decode loop's logits (GPU, or the CPU)"),
    "calibrate": ("calibrate", "fit the policy (thresholds and cost model) on calibration timings"),
    "claims": ("claims", "judge each numbered claim of the paper from measured results"),
    "figures": ("figures", "render seaborn figures"),
    "tables": ("tables", "render jinja2 LaTeX tables and macros"),
    "report": ("report", "render the self-contained HTML report"),
    "reproduce-check": ("reproduce_check", "compare a re-measured results folder with the committed reference"),
    "reproduce-reference": ("reproduce_reference", "cut a full run's results to a reduced grid and judge them again"),
}


def _main_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="persistentkv",
        description="Page-aware decode scheduling: traces, planner, kernels, measurement, report.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n" + "\n".join(f"  {name:<16} {help_}" for name, (_, help_) in COMMANDS.items())
        + "\n\nRun 'persistentkv COMMAND --help' for a command's options.",
    )
    parser.add_argument("command", nargs="?", help="one of the commands below")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _main_parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    if argv[0] == "--version":
        print(__version__)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        parser.print_usage(sys.stderr)
        print(f"error: unknown command {name!r}; expected one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module_name, help_ = COMMANDS[name]
    module = importlib.import_module(f"persistentkv.commands.{module_name}")
    sub = argparse.ArgumentParser(prog=f"persistentkv {name}", description=help_)
    module.add_arguments(sub)
    args = sub.parse_args(rest)
    try:
        return int(module.run(args) or 0)
    except PKVError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `persistentkv info --json | head`: the reader left early
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:  # a path the command cannot read or write: say which, in one line
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"error: {where}{exc.strerror or exc} (check the path and its permissions)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
