"""Our shipped routes and warps beside the installed baselines, under CUDA-graph replay, cold L2.

    python benchmarks/bench_engine.py [--cases 1x4096,4x8192,B8-bimodal] [--repeats 15] [--out DIR]
                                      [--waves 2,0.5] [--baselines vllm-fa3] [--routes workqueue]
                                      [--against DIR[,DIR...]] [--heads 32:8] [--kv-dtype float8_e4m3]
                                      [--ctas 3,4]

The kernel development loop's bench; the artifact's own measurements come from `persistentkv
bench-kernels` and `persistentkv measure`. Shape: Hq=32, Hkv=8, D=128, fp16, page 16, scattered
pages (--heads HQ:HKV sets the heads, e.g. 4:1 for a TP=8 shard of Llama-3-8B). Each case's variants are checked against float64, then timed as bench_common.py does it:
graphs of --calls calls over rotated cache copies (cold L2), --repeats rounds with every variant
of the case interleaved. Variants:
  wq, wq8                  the GPU-planned work queue (route workqueue), 4 and 8 warps per CTA
  buckets, buckets8        exact-length buckets, one decode + merge pair each (route buckets)
  split, split8            the rectangular split grid with its merge (route split)
  wq@xW, wq8@xW            (--waves W,...) the queues over W times their default target_items:
                           W waves of shorter items (W > 1), or fewer and longer ones (W < 1)
  wqcK                     (--ctas K,..., FP8 cache) the 4-warp module built for K resident CTAs
                           per SM (3 or 4; the default module holds 2), its queue K x SMs items
  auto                     (with the workqueue route) pkv-workqueue's per-step choice of module,
                           as the backend makes it (choose.choose_warps, choose_ctas_per_sm); each
                           case prints the module it chose
  X-TAG                    (--against DIR[,DIR...]) every shipped variant X (auto too) built by another
                           version of the engine: each DIR holds that version's kernels/ and
                           src/PACKAGE (the package renamed, e.g. persistentkv_0390ebd, so all
                           import in one process; TAG is its suffix, one per DIR). Made by
                             git archive REV src/persistentkv kernels | tar -x -C DIR
                             mv DIR/src/persistentkv DIR/src/persistentkv_REV
  flashinfer-cc, flashinfer-tc, vllm-fa3, trtllm-xqa   the baselines installed here (--baselines)
  read                     not attention: the read-ceiling kernel over a contiguous buffer of the
                           case's KV bytes, the time a kernel that only streams them takes
With --kv-dtype float8_e4m3 the cache is FP8 e4m3 codes with one scale per tensor (every variant,
ours and the baselines' FP8 paths, reads the same codes; the floor and `read` are of the FP8
bytes), and two more variants run on an fp16 cache of the same (dequantised) values, twice the
bytes, beside them:
  wq-fp16, wq8-fp16        our fp16 engine, so the paired ratios give FP8 against our own fp16
Prints, per case, the floor (the case's bytes at this run's read ceiling, measured over 16 GiB),
every variant's median, the best baseline, our best and its speedup; then every X-TAG variant's
per-round ratio to X. Writes bench_engine_HHMMSS.parquet to --out ($OUT) after every case.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from bench_common import (FP16_TWIN, WARPS, add_baselines, add_engine_plan, add_plain_read, bench_args,  # noqa: E402
                          comparison_row, first_line, load_baselines, planning_adder, print_comparison,
                          print_paired, read_ceiling_gbps, timed_cases, variant_name, write_rows)
from persistentkv.names import BASELINES, ENGINE_ROUTES  # noqa: E402
from persistentkv.spec import AttentionSpec  # noqa: E402

SPEC = AttentionSpec(32, 8, 128, 16, "float16")


class Variant(NamedTuple):
    """One of our variants of every case: ``engine.plan(batch, **plan)``, run by ``engine``."""
    name: str
    engine: object
    plan: dict


def variants(spec, *, warps=WARPS, waves=(), make_engine=None, routes=ENGINE_ROUTES, ctas=(),
             make_auto=None) -> list[Variant]:
    """Our variants (module docstring), in the order the tables print them: each of ``routes`` at
    each of ``warps``, then the queue over each of ``waves`` times its default target_items, then
    the 4-warp queue of each of ``ctas`` resident CTAs per SM, then ``auto`` (with the workqueue
    route). ``make_engine(spec, **options)`` builds the engines (default
    persistentkv.engine.engine_for) and ``make_auto()`` the auto variant's engine-like object
    (default _Auto over persistentkv's PKVWorkqueue; False: no auto variant), so the same variants
    can come from another build of the kernels. Modules that cannot be built here print why and are
    left out."""
    if make_engine is None:
        from persistentkv.engine import engine_for as make_engine
    if make_auto is None:
        from persistentkv.backends.pkv import PKVWorkqueue

        def make_auto():
            return _Auto(PKVWorkqueue())
    out = []
    for w in warps:
        try:
            engine = make_engine(spec, warps=w)
        except Exception as exc:  # e.g. a GPU whose opt-in shared memory is below the 8-warp CTA's
            print(f"{w} warps: no engine ({first_line(exc)})")
            continue
        queue = variant_name("workqueue", w)
        out += [Variant(variant_name(route, w), engine, {"route": route}) for route in routes]
        out += [Variant(f"{queue}@x{x:g}", engine, {"route": "workqueue",
                                                    "target_items": max(1, round(x * engine.target_items))})
                for x in waves]
    for k in ctas:
        try:
            out.append(Variant(f"wqc{k}", make_engine(spec, ctas_per_sm=k), {"route": "workqueue"}))
        except Exception as exc:
            print(f"{k} CTAs per SM: no engine ({first_line(exc)})")
    if "workqueue" in routes and make_auto is not False:
        out.append(Variant("auto", make_auto(), {}))
    return out


class _Auto:
    """pkv-workqueue's per-step module choice (warps="auto") as an engine: plan() is the backend's
    (on the batch ``rebuild`` makes, for another version's package), run() the planning engine's;
    ``chosen`` names the module of the last plan."""

    def __init__(self, backend, rebuild=None):
        self._backend, self._rebuild, self.chosen = backend, rebuild, ""

    def plan(self, batch, **_):
        plan = self._backend.plan(self._rebuild(batch) if self._rebuild else batch)
        engine = plan.engine
        self.chosen = f"{engine.warps} warps, {getattr(engine, 'ctas_per_sm', None) or engine.module.occupancy} " \
                      f"CTAs per SM, {engine.target_items} items"
        return plan

    def run(self, q, kv, plan, out) -> None:
        plan.engine.run(q, kv, plan, out)


class _Against:
    """Another version's engine behind this version's batches: its plan() gets the batch rebuilt
    with that version's Batch and AttentionSpec (the same lengths, page table and pages); the
    tensors it runs on are the same."""

    def __init__(self, engine, package):
        self._engine, self._cache, self._spec = engine, package.cache, package.spec

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def plan(self, batch, route="workqueue", **options):
        return self._engine.plan(their_batch(batch, self._spec, self._cache), route, **options)


def their_batch(batch, spec_module, cache_module):
    """``batch`` rebuilt with another version's AttentionSpec and Batch (``spec_module``,
    ``cache_module``): the same lengths, page table and pages."""
    spec = spec_module.AttentionSpec(**{k: getattr(batch.spec, k) for k in
                                        ("num_qo_heads", "num_kv_heads", "head_dim", "page_size", "dtype")},
                                     **({"kv_dtype": batch.spec.kv_dtype} if batch.spec.kv_dtype else {}))
    return cache_module.Batch(spec, batch.seq_lens, batch.kv_indptr, batch.kv_indices, batch.num_pages)


class FP16Twin:
    """Our fp16 ``engine`` on an fp16 cache holding the values of each FP8 copy (codes x scale,
    rounded to fp16), made before the first run (time_case calls ``prepare``; never inside a
    capture); called as run(kv, plan, out) with the FP8 copy, it runs on that copy's twin."""

    def __init__(self, engine, q):
        self.engine, self.q, self.twins = engine, q, {}

    def prepare(self, copies) -> None:
        import torch

        for kv in copies:
            k, v, k_scale, v_scale = kv
            self.twins[k.data_ptr()] = ((k.float() * k_scale).to(torch.float16),
                                        (v.float() * v_scale).to(torch.float16))

    def __call__(self, kv, plan, out) -> None:
        self.engine.run(self.q, self.twins[kv[0].data_ptr()], plan, out)


def add_fp16_twins(add, batch, spec16) -> None:
    """Register wq-fp16 and wq8-fp16: our workqueue route at 4 and 8 warps on the fp16 twin cache."""
    from persistentkv.cache import Batch
    from persistentkv.engine import engine_for

    twin_batch = Batch(spec16, batch.seq_lens, batch.kv_indptr, batch.kv_indices, batch.num_pages)
    for w in WARPS:
        engine = engine_for(spec16, warps=w)
        add(variant_name("workqueue", w) + FP16_TWIN, lambda e=engine: e.plan(twin_batch),
            lambda q, e=engine: FP16Twin(e, q))


def against_variants(path: str, spec, *, warps=WARPS, routes=ENGINE_ROUTES) -> list[Variant]:
    """The shipped variants of each of ``routes`` and warps, built by the engine under ``path``
    (--against; module docstring), named X-TAG with TAG the package's suffix."""
    import importlib

    root = Path(path).resolve()
    packages = sorted(p.name for p in (root / "src").glob("persistentkv_*") if (p / "engine.py").is_file())
    if len(packages) != 1 or not (root / "kernels" / "pkv_decode.cu").is_file():
        raise SystemExit(f"--against: {root} must hold kernels/pkv_decode.cu and one src/persistentkv_TAG package "
                         f"(found {packages or 'none'})")
    sys.path.insert(0, str(root / "src"))
    name = packages[0]
    package = SimpleNamespace(**{m: importlib.import_module(f"{name}.{m}") for m in ("cache", "spec", "engine")})
    tag = name.removeprefix("persistentkv_")
    try:
        backend = importlib.import_module(f"{name}.backends.pkv").PKVWorkqueue
    except (ImportError, AttributeError) as exc:
        print(f"auto-{tag}: left out ({first_line(exc)})")
        backend = None

    def make_engine(spec, **options):
        theirs = package.spec.AttentionSpec(spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.page_size,
                                            spec.dtype, **({"kv_dtype": spec.kv_dtype} if spec.kv_dtype else {}))
        return _Against(package.engine.engine_for(theirs, **options), package)

    def make_auto():
        return _Auto(backend(), lambda batch: their_batch(batch, package.spec, package.cache))

    return [v._replace(name=f"{v.name}-{tag}") for v in variants(spec, warps=warps, make_engine=make_engine,
                                                                 routes=routes, make_auto=make_auto if backend else False)]


def parse_waves(text: str) -> tuple[float, ...]:
    """``2,0.5`` -> (2.0, 0.5): multiples of the queues' default target_items, each > 0 and not 1."""
    try:
        waves = tuple(float(w) for w in text.split(",") if w.strip())
    except ValueError:
        raise SystemExit(f"--waves: {text!r} is not comma-separated numbers") from None
    if any(not w > 0 or w == 1 for w in waves):
        raise SystemExit("--waves: each multiple must be > 0 and not 1 (1 is the default queue, wq / wq8)")
    return waves


def parse_ctas(text: str, spec) -> tuple[int, ...]:
    """``3,4`` -> (3, 4): resident CTAs per SM of the FP8 4-warp modules (--ctas)."""
    from persistentkv.launch import ENGINE_CTAS_PER_SM

    allowed = ENGINE_CTAS_PER_SM[4][1:]
    try:
        ctas = tuple(int(k) for k in text.split(",") if k.strip())
    except ValueError:
        raise SystemExit(f"--ctas: {text!r} is not comma-separated integers") from None
    if any(k not in allowed for k in ctas):
        raise SystemExit(f"--ctas: each must be one of {', '.join(map(str, allowed))}, got {text!r}")
    if ctas and not spec.fp8_kv:
        raise SystemExit("--ctas needs --kv-dtype float8_e4m3 (the modules are built for an FP8 cache)")
    return ctas


def parse_heads(text: str) -> AttentionSpec:
    """``4:1`` -> the bench's spec with 4 query heads and 1 kv head (D=128, page 16, fp16)."""
    try:
        hq, hkv = (int(x) for x in text.split(":"))
        return AttentionSpec(hq, hkv, SPEC.head_dim, SPEC.page_size, SPEC.dtype)
    except ValueError as exc:
        raise SystemExit(f"--heads: {text!r} is not HQ:HKV with HKV dividing HQ ({exc})") from None


def parse_names(text: str, known, option: str) -> tuple[str, ...]:
    """Comma-separated names, each one of ``known`` (a bad one exits, naming ``option``)."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in known]
    if bad:
        raise SystemExit(f"{option}: {', '.join(bad)} not among {', '.join(known)}")
    return names


def main() -> int:
    import pandas as pd
    import torch

    def extra(parser):
        parser.add_argument("--waves", default="", help="comma-separated multiples W of the queues' default "
                            "target_items: adds wq@xW and wq8@xW")
        parser.add_argument("--baselines", default=",".join(BASELINES),
                            help="comma-separated baselines to time where installed (default all; '' for none)")
        parser.add_argument("--against", default="", help="comma-separated folders, each with another version's "
                            "kernels/ and src/persistentkv_TAG: adds its shipped variants as X-TAG (see above)")
        parser.add_argument("--routes", default=",".join(ENGINE_ROUTES),
                            help="comma-separated routes of ours (and --against's) to time (default all)")
        parser.add_argument("--heads", default="32:8", help="query heads and kv heads, HQ:HKV (default 32:8)")
        parser.add_argument("--kv-dtype", default="", choices=["", "float8_e4m3"],
                            help="the cache's dtype: the query's (default) or float8_e4m3 (see above)")
        parser.add_argument("--ctas", default="", help="comma-separated resident CTAs per SM (3, 4) of the "
                            "FP8 4-warp modules: adds wqcK (see above)")

    args = bench_args(extra, description=__doc__)
    waves = parse_waves(args.waves)
    baseline_names = parse_names(args.baselines, BASELINES, "--baselines")
    routes = parse_names(args.routes, ENGINE_ROUTES, "--routes")
    spec16 = parse_heads(args.heads)
    spec = replace(spec16, kv_dtype=args.kv_dtype or None)
    t_start = time.time()
    ctas = parse_ctas(args.ctas, spec)
    ours = variants(spec, waves=waves, routes=routes, ctas=ctas)
    for path in (p for p in args.against.split(",") if p.strip()):
        ours += against_variants(path.strip(), spec, routes=routes)
    if not ours:
        raise SystemExit("no engine could be built on this GPU")
    ceiling = read_ceiling_gbps()
    print(f"{torch.cuda.get_device_name(0)}: read ceiling {ceiling:.0f} GB/s (16 GiB)")
    for v in ours:
        if v.plan == {"route": "workqueue"}:
            print(f"  {v.name}: target_items {v.engine.target_items}, min chunk {v.engine.min_chunk_tiles} tiles")
    baselines = load_baselines(spec, baseline_names)

    def for_batch(batch) -> dict:
        runs = {}
        add = planning_adder(runs)
        for v in ours:
            add_engine_plan(add, batch, v.name, v.engine, v.plan)
            if isinstance(v.engine, _Auto) and v.name in runs:  # planned just now: chosen is this case's
                print(f"  {v.name}: {v.engine.chosen}")
        add_baselines(add, batch, baselines)
        add_plain_read(add, batch)
        if spec.fp8_kv:
            add_fp16_twins(add, batch, spec16)
        return runs

    rows = []
    table = [comparison_row(label, floor, med, ok, errors)
             for label, med, ok, floor, errors in timed_cases(spec, args, for_batch, ceiling, rows, "bench_engine", t_start)]
    print_comparison(table)
    if rows:
        print_paired(pd.DataFrame(rows))
        write_rows(rows, args.out, "bench_engine", t_start)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
