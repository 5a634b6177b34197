"""Merge the provenance sidecars of one hardware's GPU runs into results/<hw>/provenance.json.

    python workflow/scripts/merge_provenance.py --out results/<hw>/provenance.json SIDECAR.json...
        [--annotations results/<hw>/run_commits.json]

Each sidecar is ``{run_id: {...}}`` (docs/DATA.md); the merge is their union, keys sorted. A run id
that appears twice must carry the same record (a conflict means two runs claim one id: an error,
never a silent overwrite). ``--annotations`` supplies git_commit/git_dirty for runs whose sidecar
has none (a tree copied to the GPU host without .git); such a record says so in
``git_source: "annotation"`` and carries the annotation's note. A sidecar's own commit wins,
except where the annotation names it as wrong: ``"corrects": {"git_commit": ..., "git_dirty": ...}``
must equal the sidecar's values exactly (a copy that carried a stale .git), and the merged record
then keeps them as ``git_recorded``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from persistentkv.errors import PKVError, require
from persistentkv.io import atomic_write_json


def merge(paths: list[Path]) -> dict:
    merged: dict = {}
    origin: dict[str, Path] = {}
    for path in paths:
        require(path.is_file(), f"provenance sidecar {path} does not exist")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise PKVError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        require(isinstance(data, dict) and all(isinstance(v, dict) for v in data.values()),
                f"{path}: expected {{run_id: {{...}}}}")
        for run_id, record in data.items():
            require(run_id not in merged or merged[run_id] == record,
                    f"run id {run_id!r} has different records in {origin.get(run_id)} and {path}")
            merged[run_id] = record
            origin[run_id] = path
    return merged


def annotate(merged: dict, path: Path) -> dict:
    """Fill git_commit/git_dirty from ``path`` ({run_id: {git_commit, git_dirty, note}}) where null."""
    require(path.is_file(), f"annotations {path} do not exist")
    notes = json.loads(path.read_text())
    unknown = sorted(set(notes) - set(merged))
    require(not unknown, f"{path}: annotations for unknown run ids {', '.join(unknown)}")
    for run_id, note in notes.items():
        record = merged[run_id]
        wrong = note.get("corrects")
        recorded = {"git_commit": record.get("git_commit"), "git_dirty": record.get("git_dirty")}
        if wrong is not None:
            require(wrong == recorded, f"{path}: {run_id} corrects {wrong}, but its sidecar records {recorded}")
            record["git_recorded"] = recorded
        elif record.get("git_commit") is not None:
            continue
        record.update(git_commit=note["git_commit"], git_dirty=note.get("git_dirty"),
                      git_source="annotation", git_note=note.get("note", ""))
    return merged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="merged provenance JSON")
    parser.add_argument("--annotations", type=Path, help="git commits for runs whose sidecars have none")
    parser.add_argument("sidecars", type=Path, nargs="+", help="sidecar JSON files")
    args = parser.parse_args(argv)
    try:
        merged = merge(args.sidecars)
        if args.annotations:
            merged = annotate(merged, args.annotations)
    except PKVError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    atomic_write_json(args.out, merged)
    print(f"{args.out}: {len(merged)} runs from {len(args.sidecars)} sidecars")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
