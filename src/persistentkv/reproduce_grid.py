"""A results folder cut to a reduced grid: what a run of that grid would have measured, taken from
a full run's rows (``persistentkv reproduce-reference``).

A reduced re-measurement (config/reproduce.yaml: fewer seeds, steps, rounds, cells and passes) is
judged like for like when its reference is the committed full run cut to the same grid and judged
again: the same seeds, the steps every ``step_stride``-th, each row's first rounds, the sweep's
cells, the shapes grid's cases, the models' cells and trace steps, the first ``e2e_passes`` passes.
The cut keeps what it keeps bit for bit; the policy, provenance, kernel report and GPU validation
are copied as they are.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd

from .errors import require
from .measure.workload import shapes_grid
from .names import EXPERIMENTS, SHAPES_EXPERIMENT, synthetic_name

#: Copied whole (where the reference has them): nothing in them depends on the grid's rounds.
COPIED = ("policy.json", "provenance.json", "kernels.json", "validation_gpu.parquet", "validation_gpu.json")


def first_rounds(frame: pd.DataFrame, config: dict, bench: bool = False) -> pd.DataFrame:
    """The first rounds the reduced grid times: ``bench_repeats`` for the kernel grids, ``step_repeats``
    for step rows, ``repeats`` for the rest (the ceiling's rows are kept)."""
    m = config["measure"]
    rounds = pd.Series(m["bench_repeats"] if bench else m["repeats"], index=frame.index)
    if not bench:
        rounds[frame["protocol"] == "step"] = m["step_repeats"]
    return frame[(frame["protocol"] == "ceiling") | (frame["repeat"] < rounds)]


def _steps_and_seeds(frame: pd.DataFrame, config: dict) -> pd.DataFrame:
    """Rows at the grid's seeds (0: synthetic cases and the ceiling) and every step_stride-th step."""
    keep = {0, config["seeds"]["calibration"], *config["seeds"]["holdout"]}
    frame = frame[frame["seed"].isin(keep)]
    return frame[frame["step"] % config["measure"]["step_stride"] == 0]


def cut_raw(experiment: str, frame: pd.DataFrame, config: dict) -> pd.DataFrame:
    """One experiment's rows cut to what ``config`` measures."""
    m = config["measure"]
    frame = first_rounds(_steps_and_seeds(frame, config), config)
    if experiment in ("batch_sweep", "calibration"):   # calibration also times the sweep's grid
        sweep = m["batch_sweep"]
        names = {synthetic_name([n] * b) for b in sweep["batch_sizes"] for n in sweep["lengths"]}
        frame = frame[(frame["seed"] != 0) | frame["trace"].isin(names) | (frame["protocol"] == "ceiling")]
    if experiment == "fragmented":
        frame = frame[frame["trace"].isin(m["fragmented"]["traces"]) | (frame["protocol"] == "ceiling")]
    return frame


def cut_shapes(frame: pd.DataFrame, config: dict) -> pd.DataFrame:
    """bench_shapes' rows of the grid's cases (and the ceiling's), their first bench_repeats rounds."""
    cases = {(spec.num_kv_heads, spec.num_qo_heads, name) for spec, name, _ in shapes_grid(config)[0]}
    named = pd.Series([k in cases for k in zip(frame["num_kv_heads"], frame["num_qo_heads"], frame["trace"])],
                      index=frame.index, dtype=bool)
    return first_rounds(frame[named | (frame["protocol"] == "ceiling")], config, bench=True)


def cut_e2e(frame: pd.DataFrame, config: dict) -> pd.DataFrame:
    """The full step's rows of the grid's models: their B x context cells and trace steps, their first
    step_repeats rounds; the ceiling rows (no model) as they are."""
    no_model = frame["model"].fillna("") == ""
    keep = no_model.copy()
    for name, entry in (config.get("models") or {}).items():
        if "cases" not in entry:
            continue
        mine = frame["model"] == name
        cases = entry["cases"]
        keep |= mine & (frame["trace"] == "cases") & frame["batch_size"].isin(cases["batch_sizes"]) \
            & frame["context"].isin(cases["contexts"])
        keep |= mine & frame["trace"].isin(entry.get("traces", [])) \
            & (frame["step"] % config["measure"]["step_stride"] == 0)
    frame = frame[keep]
    return frame[(frame["model"].fillna("") == "") | (frame["repeat"] < config["measure"]["step_repeats"])]


def cut_reference(reference: Path, dest: Path, config: dict) -> Path:
    """``reference`` (a full run's results/<hw>/) cut to ``config``'s grid, written to ``dest``/<hw>/,
    its counters folder copied beside it (``dest``/counters); returns the new results folder."""
    reference, dest = Path(reference), Path(dest)
    require(reference.is_dir(), f"reference folder {reference} does not exist")
    out = dest / reference.name
    require(not out.exists(), f"{out} exists already; remove it first")
    (out / "raw").mkdir(parents=True)
    for experiment in EXPERIMENTS:
        path = reference / "raw" / f"{experiment}.parquet"
        if path.is_file():
            cut_raw(experiment, pd.read_parquet(path), config).to_parquet(out / "raw" / path.name, index=False)
    for name, cut in (("bench_kernels", lambda f: first_rounds(f, config, bench=True)),
                      (SHAPES_EXPERIMENT, lambda f: cut_shapes(f, config))):
        path = reference / f"{name}.parquet"
        if path.is_file():
            cut(pd.read_parquet(path)).to_parquet(out / path.name, index=False)
    passes = int(config["measure"].get("e2e_passes", 1))
    for n in range(1, passes + 1):
        path = reference / "e2e" / f"pass{n}.parquet"
        if path.is_file():
            (out / "e2e").mkdir(exist_ok=True)
            cut_e2e(pd.read_parquet(path), config).to_parquet(out / "e2e" / path.name, index=False)
    for name in COPIED:
        if (reference / name).is_file():
            shutil.copy2(reference / name, out / name)
    counters = reference.parent / "counters"
    if counters.is_dir():
        shutil.copytree(counters, dest / "counters")
    return out
