"""Atomic file output: write to a temporary name beside the target, then rename.

An interrupted run therefore never leaves a half-written file under the final name, which
Snakemake (or a later run) could take as done, and the file it replaces stays whole until the
rename. The temporary name is ``.<name>.<random>.tmp``: hidden, and ending in no data suffix, so
what a killed writer leaves behind (SIGKILL runs no cleanup) is never taken for a result by a
loader or a glob for ``*.parquet`` (persistentkv.results skips names that start with a dot).
Every file the library writes goes through :func:`atomic_path`.

Published precision: a float's last digits follow the order of its sums, which NumPy's SIMD paths
and the BLAS choose per machine, so a rerun elsewhere differs in the 16th significant digit.
Writers round what they publish as :data:`PRECISION` says (:func:`significant`,
:func:`round_floats`, :func:`round_columns`), and the same inputs give the same bytes anywhere.
"""

from __future__ import annotations

import decimal
import json
import math
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

#: How a published float is rounded, per quantity: (significant digits, decimal rounding mode).
#: error: the errors of a validation row against float64 (validation_*.parquet: rel_err,
#:   max_row_head_err, max_abs_err), to nearest. The NumPy executor accumulates in float32 in the
#:   order the BLAS picks for the CPU, so two x86 machines gave errors that differ by up to 2e-4 of
#:   their value: at 3 digits about one rerun in seven elsewhere would still change a digit, at 2
#:   about one in sixty. Two digits are what the gate needs: the worst CPU error, 2.6e-4, is 7x
#:   under its rtol. The renderers print them at these 2 digits.
#: claims: every float of claims.json and reproduction.json (speedups and their bootstrap bounds,
#:   fractions of a floor or ceiling, timing medians in us). Their sentences were written from the
#:   unrounded values and the renderers print up to 6 digits from the file (20659 us, 15.227x), so
#:   the rounding must not move any of those: 7 digits rounded 05UP (toward zero, unless that leaves
#:   a last digit of 0 or 5) never leave a tie for a later rounding to 6 or fewer digits, which then
#:   gives what rounding the unrounded value gives (15.2265009 prints 15.227, as 15.226501 did; to
#:   nearest, 15.22650 would print 15.226).
PRECISION = {"error": (2, decimal.ROUND_HALF_EVEN), "claims": (7, decimal.ROUND_05UP)}


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path in the target's folder (``.<name>.<random>.tmp``); rename it onto
    ``path`` on success, remove it on an exception. A writer that needs a format names it
    explicitly: the temporary name carries none."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        # mkstemp creates 0600; give the result the mode a plain open() would (0666 & ~umask).
        os.chmod(tmp_path, 0o666 & ~_umask())
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_json(path: str | Path, payload) -> None:
    atomic_write_text(path, json.dumps(payload, indent=2, sort_keys=True, default=_jsonable) + "\n")


def atomic_write_parquet(path: str | Path, frame) -> None:
    with atomic_path(path) as tmp:
        frame.to_parquet(tmp, index=False)


def _jsonable(value):
    import numpy as np  # only for NumPy values: io stays import-light for the workflow's rules

    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def significant(value, quantity: str):
    """``value`` rounded as :data:`PRECISION` says for ``quantity``, from its shortest decimal form
    (``repr``: a value already rounded stays as it is); NaN, infinities, zeros and non-floats as given."""
    if isinstance(value, bool) or not isinstance(value, float) or value == 0 or not math.isfinite(value):
        return value
    digits, rounding = PRECISION[quantity]
    with decimal.localcontext() as context:
        context.prec, context.rounding = digits, rounding
        return float(+decimal.Decimal(repr(float(value))))


def round_floats(payload, quantity: str):
    """A copy of a JSON-like ``payload`` (dicts, lists, tuples) with every float (NumPy's too)
    rounded by :func:`significant`; every other value as given."""
    if isinstance(payload, dict):
        return {k: round_floats(v, quantity) for k, v in payload.items()}
    if isinstance(payload, (list, tuple)):
        return [round_floats(v, quantity) for v in payload]
    if type(payload).__module__ == "numpy" and hasattr(payload, "dtype") and payload.dtype.kind == "f":
        return significant(float(payload), quantity)
    return significant(payload, quantity)


def round_columns(frame, columns, quantity: str):
    """A copy of ``frame`` with the float ``columns`` it has rounded by :func:`significant`."""
    out = frame.copy()
    for name in columns:
        if name in out.columns and out[name].dtype.kind == "f":
            out[name] = [significant(float(v), quantity) for v in out[name]]
            out[name] = out[name].astype(frame[name].dtype)
    return out
