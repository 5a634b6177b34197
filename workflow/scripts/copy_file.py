"""Copy a file under a temporary name beside the target, then rename it (rule kernels_report).

    python workflow/scripts/copy_file.py SOURCE TARGET

A copy that is interrupted never leaves a partial TARGET that Snakemake could take as finished.
"""

from __future__ import annotations

import sys
from pathlib import Path

from persistentkv.io import atomic_write_bytes


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: python {Path(__file__).name} SOURCE TARGET", file=sys.stderr)
        return 2
    source, target = map(Path, argv)
    try:
        data = source.read_bytes()
    except OSError as exc:
        print(f"error: cannot read {source}: {exc.strerror}", file=sys.stderr)
        return 2
    atomic_write_bytes(target, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
