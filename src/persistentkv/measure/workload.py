"""Workload cases and the experiment grids, all read from the config (the only source of grids).

A :class:`Case` is one decode step on a compact cache (persistentkv.cache.compact_batch)
plus the backend variants to run on it. Trace cases come from build/traces/{name}_s{seed}.json
(pages from persistentkv.cache.allocate with the trace's seed, every ``measure.step_stride``-th
step); synthetic cases are B rows of given lengths (persistentkv.cache.make_batch, seed 0).

Experiments (``persistentkv measure --experiment NAME``):

    calibration        calibration seed; every config trace + the batch_sweep grid; the policy's candidates
    published          holdout seeds; bucketed_b1, bimodal_b8, uniform_b8, zipf_b8, bimodal_b4
    long_context       B = measure.long_context.batch_size at each of measure.long_context.lengths
    fragmented         holdout seeds; measure.fragmented.traces with hole_fraction from the config
    batch_sweep        measure.batch_sweep.batch_sizes x lengths (synthetic, equal lengths)
    gqa_sweep          holdout seeds; measure.gqa_sweep.trace with Hq = G x Hkv for each group size
    split_sensitivity  holdout seeds; pkv-buckets and pkv-split at each S of ablations.splits.values,
                       on the B1 and B8 bimodal-family traces of ablations.splits.traces

``--quick`` keeps the first holdout seed, four times the step stride and the smallest grids'
ends, for a smoke run; the rows say so through their seeds and steps, never by pretending.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable

from .. import configuration
from ..cache import Batch, allocate, batch_for_step, compact_batch, make_batch
from ..errors import require
from ..names import (BASELINES, BENCH_BATCHES, BENCH_EXTRA, BENCH_LENGTHS, EXPERIMENTS, PKV_BACKENDS, PUBLISHED_TRACES,
                     SHAPES_EXPERIMENT, synthetic_name)
from ..spec import AttentionSpec, shapes_cells
from ..traces import Trace, read_trace

#: Traces of the split-sensitivity sweep: the B1 and B8 bimodal-family rows of the paper.
SPLIT_SENSITIVITY_TRACES = ("bucketed_b1", "bimodal_b8")
SPLIT_BACKENDS = ("pkv-buckets", "pkv-split")


@dataclass(frozen=True)
class Variant:
    """A backend name and its constructor options (hashable, so instances can be shared)."""

    name: str
    options: tuple = ()

    @property
    def kwargs(self) -> dict:
        return dict(self.options)

    @property
    def num_splits(self) -> int:
        return int(self.kwargs.get("num_splits", -1))

    @property
    def label(self) -> str:
        return self.name if not self.options else f"{self.name}[{','.join(f'{k}={v}' for k, v in self.options)}]"


@dataclass(frozen=True)
class Case:
    experiment: str
    trace: str
    seed: int
    step: int
    batch: Batch
    hole_fraction: float
    variants: tuple[Variant, ...] = field(default_factory=tuple)

    @property
    def spec(self) -> AttentionSpec:
        return self.batch.spec

    @property
    def label(self) -> str:
        return f"{self.trace} s{self.seed} step {self.step}"


def on_cache(spec: AttentionSpec, kv_dtype: str | None) -> AttentionSpec:
    """``spec`` with K and V of ``kv_dtype`` (None: as it is, the cache of its own dtype); a dtype
    the spec does not take is refused in one line (AttentionSpec)."""
    return spec if kv_dtype is None else replace(spec, kv_dtype=kv_dtype)


# -- variants -----------------------------------------------------------------------------------
def variant_for(name: str, config: dict, splits: int | None = None, policy_path: str | None = None) -> Variant:
    """A backend with the constructor options the config gives it.

    pkv-workqueue: planner.target_items and min_chunk_tiles; pkv-buckets / pkv-split: num_splits = ``splits`` (the
    trace's published S, or the sweep value); adaptive: policy_path.
    """
    if name == "pkv-workqueue":
        return Variant(name, (("target_items", int(config["planner"]["target_items"])),
                              ("min_chunk_tiles", int(config["planner"]["min_chunk_tiles"]))))
    if name in SPLIT_BACKENDS:
        require(splits is not None and splits >= 1, f"{name} needs a split count, got {splits!r}")
        return Variant(name, (("num_splits", int(splits)),))
    if name == "adaptive":
        return Variant(name, (("policy_path", str(policy_path)),) if policy_path else ())
    return Variant(name)


def variants(names: Iterable[str], config: dict, splits: int | None, policy_path: str | None) -> tuple[Variant, ...]:
    return tuple(variant_for(n, config, splits, policy_path) for n in names)


def default_splits(config: dict) -> int:
    """S for synthetic cases: the per-bucket S of the bucket ablation (the published B1 setting)."""
    return int(config["ablations"]["buckets"]["splits"])


# -- cases --------------------------------------------------------------------------------------
def trace_path(traces_dir: str | Path, name: str, seed: int) -> Path:
    return Path(traces_dir) / f"{name}_s{seed}.json"


def load_trace(traces_dir: str | Path, name: str, seed: int) -> Trace:
    path = trace_path(traces_dir, name, seed)
    require(path.is_file(), f"trace file {path} does not exist (run the traces rule, "
                            f"or 'persistentkv traces', for {name} seed {seed})")
    trace = read_trace(path)
    require(trace.seed == seed, f"{path} holds seed {trace.seed}, expected {seed}")
    return trace


def strided_steps(trace: Trace, stride: int) -> list[int]:
    """Indices into ``trace.steps``: every ``stride``-th step, starting with the first."""
    require(stride >= 1, f"step_stride must be >= 1, got {stride}")
    return list(range(0, len(trace.steps), stride))


def trace_cases(experiment: str, trace: Trace, spec: AttentionSpec, hole_fraction: float, steps: list[int],
                variants_: tuple[Variant, ...], trace_name: str | None = None) -> list[Case]:
    """Cases for the given step indices of a trace, each on its own compact cache."""
    allocation = allocate(trace.requests, spec.page_size, hole_fraction, trace.seed)
    cases = []
    for index in steps:
        step = trace.steps[index]
        full = batch_for_step(spec, allocation, step)
        batch, _ = compact_batch(full, hole_fraction, trace.seed + step.index)
        cases.append(Case(experiment, trace_name or trace.name, trace.seed, step.index, batch, hole_fraction, variants_))
    return cases


def synthetic_case(experiment: str, name: str, lengths: list[int], spec: AttentionSpec,
                   variants_: tuple[Variant, ...], hole_fraction: float = 0.0) -> Case:
    batch, _ = compact_batch(make_batch(spec, lengths, hole_fraction, seed=0), hole_fraction, 0)
    return Case(experiment, name, 0, 0, batch, hole_fraction, variants_)


def bench_grid() -> list[tuple[str, list[int]]]:
    """bench-kernels' synthetic cases: (name, lengths), the grid then the extra rows, no duplicates."""
    cases = [(synthetic_name([n] * b), [n] * b) for b in BENCH_BATCHES for n in BENCH_LENGTHS]
    seen = {name for name, _ in cases}
    for name, lengths in BENCH_EXTRA.items():
        plain = synthetic_name(lengths)
        if plain in seen:
            continue
        cases.append((name, list(lengths)))
        seen.add(name)
    return cases


def _backend_names(config: dict, requested: list[str] | None, drop_adaptive: bool = False) -> list[str]:
    names = list(requested) if requested else list(config["measure"]["backends"])
    if drop_adaptive:
        names = [n for n in names if n != "adaptive"]
    return names


def experiment_cases(experiment: str, config: dict, traces_dir: str | Path | None,
                     policy_path: str | None = None, backends: list[str] | None = None,
                     quick: bool = False, kv_dtype: str | None = None) -> list[Case]:
    """Every case of one experiment, with its backend variants, from the config; on caches of
    ``kv_dtype`` (None: the spec's own dtype)."""
    require(experiment in EXPERIMENTS, f"unknown experiment {experiment!r}; expected one of {', '.join(EXPERIMENTS)}")
    measure = config["measure"]
    seeds = config["seeds"]
    holdout = list(seeds["holdout"])[:1] if quick else list(seeds["holdout"])
    stride = int(measure["step_stride"]) * (4 if quick else 1)
    spec = on_cache(configuration.spec(config), kv_dtype)
    names = _backend_names(config, backends, drop_adaptive=experiment == "calibration")
    if experiment == "calibration" and not backends:
        # calibration fits the policy, which chooses among policy.candidates: it times those
        names = [n for n in config["policy"]["candidates"] if n != "adaptive"]
    splits0 = default_splits(config)

    def for_traces(trace_names, seed_list, rho=0.0, spec_=spec, names_=names, splits=None):
        out = []
        for name in trace_names:
            entry = configuration.trace_entry(config, name)
            s = int(entry["splits"]) if splits is None else splits
            for seed in seed_list:
                trace = load_trace(traces_dir, name, seed)
                out += trace_cases(experiment, trace, spec_, rho, strided_steps(trace, stride),
                                   variants(names_, config, s, policy_path), name)
        return out

    def synthetic(grid):
        vs = variants(names, config, splits0, policy_path)
        return [synthetic_case(experiment, synthetic_name(lens), lens, spec, vs) for lens in grid]

    sweep = measure["batch_sweep"]
    sweep_grid = [[n] * b for b in sweep["batch_sizes"] for n in sweep["lengths"]]
    if quick:
        sweep_grid = [[n] * b for b in (min(sweep["batch_sizes"]), max(sweep["batch_sizes"]))
                      for n in (min(sweep["lengths"]),)]

    if experiment == "calibration":
        require(traces_dir is not None, "the calibration experiment needs --traces-dir")
        return (for_traces([t["name"] for t in config["traces"]], [int(seeds["calibration"])])
                + synthetic(sweep_grid))
    if experiment == "published":
        return for_traces(PUBLISHED_TRACES, holdout)
    if experiment == "long_context":
        lc = measure["long_context"]
        lengths = list(lc["lengths"])[:2] if quick else list(lc["lengths"])
        return synthetic([[n] * int(lc["batch_size"]) for n in lengths])
    if experiment == "fragmented":
        fr = measure["fragmented"]
        return for_traces(fr["traces"], holdout, rho=float(fr["hole_fraction"]))
    if experiment == "batch_sweep":
        return synthetic(sweep_grid)
    if experiment == "gqa_sweep":
        gq = measure["gqa_sweep"]
        out = []
        for g in gq["group_sizes"]:
            spec_g = replace(spec, num_qo_heads=int(g) * spec.num_kv_heads)
            out += for_traces([gq["trace"]], holdout, spec_=spec_g)
        return out
    # split_sensitivity
    wanted = [t for t in SPLIT_SENSITIVITY_TRACES if t in config["ablations"]["splits"]["traces"]]
    require(wanted, f"split_sensitivity needs one of {SPLIT_SENSITIVITY_TRACES} in ablations.splits.traces")
    split_names = [n for n in names if n in SPLIT_BACKENDS] or list(SPLIT_BACKENDS)
    values = list(config["ablations"]["splits"]["values"])
    if quick:
        values = values[::max(1, len(values) // 3)]
    out = []
    for s in values:
        out += for_traces(wanted, holdout, names_=split_names, splits=int(s))
    return _merge_split_cases(out)


def _merge_split_cases(cases: list[Case]) -> list[Case]:
    """One case per step with every S as a variant, so the sweep shares caches and interleaves."""
    merged: dict[tuple, Case] = {}
    for case in cases:
        key = (case.trace, case.seed, case.step)
        if key in merged:
            held = merged[key]
            merged[key] = replace(held, variants=held.variants + tuple(v for v in case.variants if v not in held.variants))
        else:
            merged[key] = case
    return list(merged.values())


def seeds_of(cases: list[Case]) -> list[int]:
    return sorted({int(c.seed) for c in cases})



# -- the shapes experiment (persistentkv bench-shapes) --------------------------------------------
def shapes_grid(config: dict, quick: bool = False) -> tuple[list[tuple[AttentionSpec, str, list[int]]], list[str]]:
    """(cases, skipped) of config ``measure.bench_shapes``: per Hkv x G x B x size, the spec (Hq = G x
    Hkv, the rest from ``spec``), the case name (B{b}xN{n}) and its row lengths; ``skipped`` says
    which cells do not fit (persistentkv.spec.shapes_cells). ``quick``: the ends of Hkv, B and the sizes and
    the first G (a smoke run)."""
    grid = config["measure"].get("bench_shapes")
    require(grid is not None, "config measure.bench_shapes is missing (the shapes experiment's grid)")
    base = configuration.spec(config)
    ends = (lambda xs: sorted({min(xs), max(xs)})) if quick else (lambda xs: list(xs))
    picked = {**grid, "kv_heads": ends(grid["kv_heads"]), "batch_sizes": ends(grid["batch_sizes"]),
              "kv_mib": ends(grid["kv_mib"]),
              "group_sizes": list(grid["group_sizes"])[:1] if quick else grid["group_sizes"]}
    cases, skipped = [], []
    for hkv, g, b, mib, spec, n in shapes_cells(base, picked):
        if n is None:
            skipped.append(f"Hkv={hkv} G={g} B={b} at {mib:g} MiB (the tokens per row would be under one page or "
                           f"over {grid['max_tokens_per_row']})")
            continue
        cases.append((spec, synthetic_name([n] * b), [n] * b))
    return cases, skipped


def shapes_backends(config: dict, requested: list[str] | None = None) -> list[str]:
    """bench-shapes' backends: ``requested``, else config measure.backends' routes of ours and baselines
    (the policy-driven adaptive backend and the non-baseline torch-sdpa are left out of its default)."""
    names = _backend_names(config, requested)
    return names if requested else [n for n in names if n in PKV_BACKENDS or n in BASELINES]


def shapes_cases(config: dict, backends: list[str] | None = None, quick: bool = False,
                 kv_dtype: str | None = None) -> tuple[list[Case], list[str]]:
    """(cases, skipped) of the shapes experiment, each with every backend of :func:`shapes_backends`.
    ``kv_dtype``: the cells of the spec's own grid (its rows and tokens, sized by its dtype) on caches
    of that dtype (:func:`on_cache`), so each case pairs with its twin of the same shape and tokens."""
    vs = variants(shapes_backends(config, backends), config, default_splits(config), None)
    grid, skipped = shapes_grid(config, quick)
    return [synthetic_case(SHAPES_EXPERIMENT, name, lengths, on_cache(spec, kv_dtype), vs)
            for spec, name, lengths in grid], skipped
