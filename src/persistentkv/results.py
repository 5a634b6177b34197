"""Load whatever subset of one hardware's results exists (docs/DATA.md), and say what is missing.

Nothing here invents a value: an absent file gives an empty frame (or None) and an entry in
:attr:`Results.missing`, which the report shows as "not measured on <hw> yet". Only finished
files are read: a name that starts with a dot is a writer's temporary file (persistentkv.io),
whatever it ends in, and is never taken for a result.

Below both the claims (persistentkv.claims, persistentkv.targets) and the renderers, which read
their rows from here and their cells from :meth:`Results.cells`.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from . import analysis
from .errors import PKVError, require
from .names import CEILING_BACKENDS, EXPERIMENTS, KV_GRID_SUFFIX, KV_GRIDS, SHAPES_EXPERIMENT, kv_grid_name

#: The FP8 cache's files beside the kernel grids (results/{hw}/<name>.parquet + .json) and the
#: folder of measure-e2e's FP8 passes (results/{hw}/e2e_fp8/pass<N>.parquet + .json).
FP8_FILES = ("validation_gpu_fp8", "fp8_logits")
FP8_E2E = "e2e_fp8"
#: The experiments measured on an FP8 cache (names.FP8_EXPERIMENTS: the FP8 policy's calibration and
#: holdout rows), kept apart from raw/ so they are never pooled with the fp16 rows, and the policy
#: fitted on them.
FP8_RAW = "raw_fp8"
FP8_POLICY = "policy_fp8.json"


@dataclass
class Results:
    """One hardware's results plus the hardware-independent counters.

    raw:            tidy timing rows of every results/{hw}/raw/*.parquet (DATA.md), concatenated
    bench:          results/{hw}/bench_kernels.parquet (kernel rows and ceiling rows)
    validation_gpu: results/{hw}/validation_gpu.parquet
    validation_cpu, ablation_buckets, ablation_splits: results/counters/*.parquet
    provenance:     run_id -> provenance fields (provenance.json, else the sidecar .json files)
    e2e:            results/{hw}/e2e/*.parquet, the full decode step's passes (measure-e2e; one run_id
                    each, concatenated), its own schema;
                    empty where absent
    """

    hw: str
    raw: pd.DataFrame
    bench: pd.DataFrame
    validation_gpu: pd.DataFrame
    validation_cpu: pd.DataFrame
    ablation_buckets: pd.DataFrame
    ablation_splits: pd.DataFrame
    provenance: dict
    policy: dict | None
    kernels: dict | None
    holdout_seeds: tuple[int, ...] = ()
    calibration_seed: int | None = None
    config: dict = field(default_factory=dict)
    found: dict = field(default_factory=dict)     # what -> path, for files that exist
    missing: list = field(default_factory=list)   # what, for files that do not
    e2e: pd.DataFrame = field(default_factory=pd.DataFrame)
    #: metric -> every timing cell, bootstrapped once (:meth:`all_cells`)
    _cells: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    #: results/{hw}/bench_shapes.parquet (the shapes experiment: kernel rows and the one-kernel
    #: floor's, plus ceiling rows); kept apart from :attr:`timing`, read by targets.floor_verdicts
    shapes: pd.DataFrame = field(default_factory=pd.DataFrame)
    #: results/{hw}/<grid>_<suffix>.parquet by file stem (names.kv_grid_name: bench_kernels_fp8,
    #: bench_shapes_fp8): the kernel grids on a cache of another dtype, where present; never in
    #: :attr:`timing` nor in :attr:`missing` (targets_fp8 reads them and says when they are absent)
    kv_grids: dict = field(default_factory=dict)
    #: The FP8 cache beyond the kernel grids, where present (never in :attr:`missing`; targets_fp8
    #: says when they are absent): validate-gpu --kv-dtype float8_e4m3
    #: (results/{hw}/validation_gpu_fp8.parquet), measure-e2e --kv-dtype float8_e4m3's passes
    #: (results/{hw}/e2e_fp8/*.parquet) and fp8-logits (results/{hw}/fp8_logits.parquet)
    validation_gpu_fp8: pd.DataFrame = field(default_factory=pd.DataFrame)
    e2e_fp8: pd.DataFrame = field(default_factory=pd.DataFrame)
    fp8_logits: pd.DataFrame = field(default_factory=pd.DataFrame)
    #: results/{hw}/raw_fp8/*.parquet (measure --kv-dtype float8_e4m3: calibration, published,
    #: long_context on FP8 caches) and the policy fitted on them (results/{hw}/policy_fp8.json), where
    #: present; never in :attr:`timing` nor in :attr:`missing` (claims' fp8 entry judges them)
    raw_fp8: pd.DataFrame = field(default_factory=pd.DataFrame)
    policy_fp8: dict | None = None

    def kv_grid(self, grid: str, kv_dtype: str) -> pd.DataFrame:
        """The rows of ``grid`` (names.KV_GRIDS) measured on a ``kv_dtype`` cache; empty when absent."""
        return self.kv_grids.get(kv_grid_name(grid, kv_dtype), pd.DataFrame())

    @property
    def timing(self) -> pd.DataFrame:
        """Every attention timing row: raw experiments plus bench_kernels (ceiling rows excluded)."""
        parts = [f for f in (self.raw, self.bench[~self.bench["backend"].isin(CEILING_BACKENDS)]
                             if not self.bench.empty and "backend" in self.bench else self.bench) if not f.empty]
        return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()

    @property
    def ceilings(self) -> pd.DataFrame:
        if self.bench.empty or "backend" not in self.bench:
            return pd.DataFrame()
        return self.bench[self.bench["backend"].isin(CEILING_BACKENDS)]

    def experiment(self, name: str) -> pd.DataFrame:
        timing = self.timing
        if timing.empty:
            return timing
        return timing[timing["experiment"] == name]

    def measured_experiments(self) -> list[str]:
        timing = self.timing
        if timing.empty:
            return []
        return sorted(timing.loc[timing["status"] == "ok", "experiment"].unique())

    def all_cells(self, metric: str = "time_us") -> list[analysis.Cell]:
        """Every timing cell, bootstrapped once per metric and kept.

        Each cell's interval depends only on its own rows and key (analysis.bootstrap_cells), so
        selecting cells afterwards gives exactly what bootstrapping the selected rows would.
        """
        if metric not in self._cells:
            timing = self.timing
            self._cells[metric] = [] if timing.empty or metric not in timing.columns else \
                analysis.bootstrap_cells(timing, metric)
        return self._cells[metric]

    def cells(self, experiment, protocol: str, metric: str = "time_us", trace: str | None = None,
              holdout: bool = True, group_size: int | None = None) -> list[analysis.Cell]:
        """The cells of ``experiment`` (a name or a list) under ``protocol``; on ``trace`` only when
        given; at holdout seeds only (``holdout``, when the config names any: trace experiments are
        judged on holdout seeds, the policy was fitted on calibration); of group size Hq / Hkv =
        ``group_size`` only when given."""
        equal = {"experiment": experiment, "protocol": protocol}
        if trace is not None:
            equal["trace"] = trace
        cells = analysis.where(self.all_cells(metric), **equal)
        if holdout and self.holdout_seeds:
            cells = [c for c in cells if c.key.get("seed") in self.holdout_seeds]
        if group_size is not None:
            cells = [c for c in cells if c.key["num_qo_heads"] // c.key["num_kv_heads"] == group_size]
        return cells

    def gpu_name(self) -> str:
        """The GPU named by the provenance, else the hardware slug."""
        names = sorted({str(p.get("gpu")) for p in self.provenance.values() if p.get("gpu")})
        return " / ".join(names) if names else self.hw


def finished(paths) -> list[Path]:
    """``paths`` without the temporary files of an unfinished or killed write (a leading dot)."""
    return [p for p in paths if not p.name.startswith(".")]


def sidecar_paths(results_dir: str | Path) -> list[Path]:
    """The provenance sidecars of results/{hw}/ as they lie (rule provenance merges them into
    provenance.json): raw/*.json, bench_kernels.json, validation_gpu.json, bench_shapes.json and
    e2e/*.json, and the FP8 runs' (raw_fp8/*.json, the FP8 grids', validate-gpu's, the logits',
    e2e_fp8/*.json)."""
    results_dir = Path(results_dir)
    paths = [p for folder in ("raw", FP8_RAW) for p in finished(sorted((results_dir / folder).glob("*.json")))]
    names = ["bench_kernels.json", "validation_gpu.json", f"{SHAPES_EXPERIMENT}.json"]
    names += [f"{kv_grid_name(grid, kv)}.json" for grid in KV_GRIDS for kv in KV_GRID_SUFFIX]
    names += [f"{name}.json" for name in FP8_FILES]
    paths += [results_dir / name for name in names if (results_dir / name).is_file()]
    return paths + [p for folder in ("e2e", FP8_E2E) for p in finished(sorted((results_dir / folder).glob("*.json")))]


def _run_ids(*tables: pd.DataFrame) -> set[str]:
    """The run ids of the rows of ``tables`` (a table without a run_id column has none)."""
    return {str(r) for t in tables if "run_id" in t for r in t["run_id"].dropna().unique()}


def _read_parquet(path: Path) -> pd.DataFrame:
    try:
        return pd.read_parquet(path)
    except Exception as exc:  # pyarrow raises several types for a corrupt or foreign file
        raise PKVError(f"cannot read {path}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")


def with_kv_dtype(frame: pd.DataFrame) -> pd.DataFrame:
    """Timing rows with a ``kv_dtype`` column (docs/DATA.md): files written before it existed lack
    it, and their caches were of the query's dtype, so it is filled with each row's ``dtype``, after
    that column. A frame that has it, or has no ``dtype``, comes back as it is."""
    if "kv_dtype" in frame.columns or "dtype" not in frame.columns:
        return frame
    frame = frame.copy()
    frame.insert(frame.columns.get_loc("dtype") + 1, "kv_dtype", frame["dtype"])
    return frame


def _read_timing(path: Path) -> pd.DataFrame:
    return with_kv_dtype(_read_parquet(path))


def _read_validation(path: Path) -> pd.DataFrame:
    """validate-gpu's rows; those before the FP8 columns: the query's dtype, no FP8 query."""
    frame = with_kv_dtype(_read_parquet(path))
    return frame.assign(fp8_query=False) if "fp8_query" not in frame.columns and "dtype" in frame.columns else frame


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PKVError(f"cannot read {path}: {exc}")


def load_results(results_dir: str | Path, counters_dir: str | Path | None = None,
                 config: dict | None = None) -> Results:
    """Read results/{hw}/ (``results_dir``; hw = its folder name) and results/counters/."""
    results_dir = Path(results_dir)
    hw = results_dir.name
    require(bool(hw) and hw not in (".", ".."), f"cannot tell the hardware from results folder {results_dir}")
    require(not results_dir.exists() or results_dir.is_dir(), f"{results_dir} is not a folder")
    found, missing = {}, []

    raw_parts = []
    raw_dir = results_dir / "raw"
    for exp in EXPERIMENTS:
        path = raw_dir / f"{exp}.parquet"
        if path.is_file():
            raw_parts.append(_read_timing(path))
            found[f"raw/{exp}"] = str(path)
        else:
            missing.append(f"raw/{exp}")
    # Any other experiment file present is read too (the grid may grow); never silently dropped.
    if raw_dir.is_dir():
        for path in finished(sorted(raw_dir.glob("*.parquet"))):
            if path.stem not in EXPERIMENTS:
                raw_parts.append(_read_timing(path))
                found[f"raw/{path.stem}"] = str(path)
    raw = pd.concat(raw_parts, ignore_index=True) if raw_parts else pd.DataFrame()

    def present(name: str, path: Path, read=_read_parquet) -> pd.DataFrame:
        """``path`` read (empty where absent, which is not reported missing)."""
        if not path.is_file():
            return pd.DataFrame()
        found[name] = str(path)
        return read(path)

    def optional_parquet(name: str, path: Path, read=_read_parquet) -> pd.DataFrame:
        if not path.is_file():
            missing.append(name)
        return present(name, path, read)

    bench = optional_parquet("bench_kernels", results_dir / "bench_kernels.parquet", _read_timing)
    shapes = optional_parquet(SHAPES_EXPERIMENT, results_dir / f"{SHAPES_EXPERIMENT}.parquet", _read_timing)
    stems = [kv_grid_name(grid, kv) for grid in KV_GRIDS for kv in KV_GRID_SUFFIX]
    kv_grids = {stem: present(stem, results_dir / f"{stem}.parquet", _read_timing) for stem in stems
                if (results_dir / f"{stem}.parquet").is_file()}
    e2e_passes = (config or {}).get("measure", {}).get("e2e_passes")
    old_e2e = results_dir / "e2e.parquet"   # the layout before measure-e2e ran as passes: never dropped silently
    require(not old_e2e.is_file(),
            f"{old_e2e} is a full decode step run in the layout before passes; move it to "
            f"{results_dir / 'e2e' / 'pass1.parquet'} (and e2e.json to e2e/pass1.json)")

    def passes(folder: str) -> pd.DataFrame:
        """measure-e2e's passes in ``folder`` concatenated (runs before kv_dtype: the query's dtype):
        pass<N> for N up to the config's measure.e2e_passes where the config names it, so a run of
        fewer passes than the folder holds (the reduced grid's one) is not judged with older ones."""
        paths = finished(sorted((results_dir / folder).glob("*.parquet")))
        if e2e_passes is not None:
            paths = [p for p in paths if not re.fullmatch(r"pass\d+", p.stem) or int(p.stem[4:]) <= e2e_passes]
        found.update({f"{folder}/{p.stem}": str(p) for p in paths})
        return with_kv_dtype(pd.concat([_read_parquet(p) for p in paths], ignore_index=True)) if paths \
            else pd.DataFrame()

    e2e = passes("e2e")
    if e2e.empty:
        missing.append("e2e")
    e2e_fp8 = passes(FP8_E2E)
    raw_fp8_paths = finished(sorted((results_dir / FP8_RAW).glob("*.parquet")))
    found.update({f"{FP8_RAW}/{p.stem}": str(p) for p in raw_fp8_paths})
    raw_fp8 = pd.concat([_read_timing(p) for p in raw_fp8_paths], ignore_index=True) if raw_fp8_paths \
        else pd.DataFrame()
    validation_gpu = optional_parquet("validation_gpu", results_dir / "validation_gpu.parquet", _read_validation)
    validation_gpu_fp8 = present("validation_gpu_fp8", results_dir / "validation_gpu_fp8.parquet", _read_validation)
    fp8_logits = present("fp8_logits", results_dir / "fp8_logits.parquet")
    counters = Path(counters_dir) if counters_dir is not None else results_dir.parent / "counters"
    validation_cpu = optional_parquet("validation_cpu", counters / "validation_cpu.parquet")
    ablation_buckets = optional_parquet("ablation_buckets", counters / "ablation_buckets.parquet")
    ablation_splits = optional_parquet("ablation_splits", counters / "ablation_splits.parquet")

    provenance: dict = {}
    prov_path = results_dir / "provenance.json"
    for path in sidecar_paths(results_dir) + ([prov_path] if prov_path.is_file() else []):
        payload = _read_json(path)
        require(isinstance(payload, dict), f"{path} must hold {{run_id: {{...}}}}")
        records = {str(k): v for k, v in payload.items() if isinstance(v, dict)}
        if path == prov_path:  # the merge may be older than the sidecars: a run nothing else holds is gone
            live = set(provenance) | _run_ids(raw, bench, shapes, e2e, validation_gpu, *kv_grids.values(), e2e_fp8,
                                              validation_gpu_fp8, fp8_logits, raw_fp8)
            stale = sorted(set(records) - live)
            if stale:
                warnings.warn(f"{prov_path} names runs whose rows and sidecars are gone ({', '.join(stale)}); "
                              f"left out; merge it again (rule provenance, docs/DATA.md)", stacklevel=2)
            records = {k: v for k, v in records.items() if k not in stale}
        provenance.update(records)
    if prov_path.is_file():
        found["provenance"] = str(prov_path)
    else:
        missing.append("provenance")

    def optional_json(name: str, path: Path):
        if path.is_file():
            found[name] = str(path)
            return _read_json(path)
        missing.append(name)
        return None

    policy = optional_json("policy", results_dir / "policy.json")
    policy_fp8 = _read_json(results_dir / FP8_POLICY) if (results_dir / FP8_POLICY).is_file() else None
    if policy_fp8 is not None:
        found["policy_fp8"] = str(results_dir / FP8_POLICY)
    kernels = optional_json("kernels", results_dir / "kernels.json")

    config = config or {}
    seeds = config.get("seeds", {}) if isinstance(config.get("seeds"), dict) else {}
    return Results(hw=hw, raw=raw, bench=bench, validation_gpu=validation_gpu, validation_cpu=validation_cpu,
                   ablation_buckets=ablation_buckets, ablation_splits=ablation_splits, provenance=provenance,
                   policy=policy, kernels=kernels,
                   holdout_seeds=tuple(int(s) for s in seeds.get("holdout", ())),
                   calibration_seed=seeds.get("calibration"), config=config, found=found, missing=missing,
                   shapes=shapes, e2e=e2e, kv_grids=kv_grids, e2e_fp8=e2e_fp8,
                   validation_gpu_fp8=validation_gpu_fp8, fp8_logits=fp8_logits, raw_fp8=raw_fp8,
                   policy_fp8=policy_fp8)
