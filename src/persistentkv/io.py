"""Atomic file output: write to a temporary name beside the target, then rename.

An interrupted run therefore never leaves a half-written file under the final name, which
Snakemake (or a later run) could take as done, and the file it replaces stays whole until the
rename. The temporary name is ``.<name>.<random>.tmp``: hidden, and ending in no data suffix, so
what a killed writer leaves behind (SIGKILL runs no cleanup) is never taken for a result by a
loader or a glob for ``*.parquet`` (persistentkv.results skips names that start with a dot).
Every file the library writes goes through :func:`atomic_path`.
"""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


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
