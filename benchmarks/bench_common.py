"""The development benches' one timing helper: cases, baselines, the read ceiling and a plain read
of a case's bytes, cold cache copies, CUDA-graph capture and interleaved replays, one case's
check-then-time loop, the tables and paired ratios, and the rows' atomic incremental writes.

How a case is timed (time_case), the same for every variant, ours and the baselines':
  1. R views of one KV tensor, R x the case's bytes >= 3 x L2 (rotated_copies): consecutive calls
     read different copies, so each call's K/V comes from HBM (cold L2); --warm keeps one copy;
  2. every variant's output checked against float64 per (row, head) (tests/gpu_support);
  3. one CUDA graph per variant of --calls calls cycling over the copies (capture);
  4. --repeats rounds, each replaying every graph once in a shuffled order (time_replays): the
     variants of a round run interleaved, side by side, so paired_ratios can compare them round
     by round.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from pathlib import Path

import numpy as np

from persistentkv.names import BASELINES, ENGINE_ROUTES

#: B x N cases of the default --cases: B=1 from 1K to 128K tokens and the 134-537 MB steps of B > 1.
CASES = [(1, 1024), (1, 4096), (1, 8192), (1, 16384), (1, 32768), (1, 65536), (1, 131072),
         (2, 16384), (4, 8192), (8, 4096), (4, 32768)]
#: variants that time something other than attention (no float64 check, never "fastest")
NOT_ATTENTION = ("read",)
#: our variants' names: the route's stem, with the CTA's warps appended when not 4 (wq, wq8, buckets8)
ROUTE_STEMS = {"workqueue": "wq", "buckets": "buckets", "split": "split"}
WARPS = (4, 8)
#: the suffix of an FP8 bench's twins: our variant on an fp16 cache of the same values (FP16Twin)
FP16_TWIN = "-fp16"


def variant_name(route: str, warps: int) -> str:
    """The name of ``route`` at ``warps`` warps per CTA: ``wq``, ``wq8``, ``buckets``, ``split8``..."""
    stem = ROUTE_STEMS[route]
    return stem if warps == 4 else f"{stem}{warps}"


#: the shipped engine configurations' names, the bases of paired_ratios
SHIPPED = (*(variant_name(route, warps) for route in ENGINE_ROUTES for warps in WARPS), "auto")


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def parse_cases(text: str) -> list[tuple[str, list[int]]]:
    """``1x4096,B=4x8192,B8-bimodal,13184:19392`` -> [(label, row lengths), ...]; empty -> CASES.

    A case is BxN (B rows of N tokens), the name of one of bench-kernels' ragged row sets
    (persistentkv.names.BENCH_EXTRA, e.g. B8-bimodal), so the development benches can
    time the cases where bench-kernels found a route behind, or the row lengths themselves joined
    by ``:`` (a step of a trace, e.g. one where a measured route fell behind)."""
    from persistentkv.names import BENCH_EXTRA

    if not text:
        return [(f"B={B} N={N}", [N] * B) for B, N in CASES]
    cases = []
    for item in (c.strip() for c in text.split(",")):
        if item in BENCH_EXTRA:
            cases.append((item, list(BENCH_EXTRA[item])))
            continue
        if ":" in item:
            rows = item.split(":")
            if not all(r.strip().isdigit() and int(r) > 0 for r in rows):
                raise SystemExit(f"--cases: {item!r} is not row lengths joined by ':' (positive integers)")
            lengths = [int(r) for r in rows]
            cases.append((f"B={len(lengths)} N={min(lengths)}-{max(lengths)}", lengths))
            continue
        parts = item.lower().replace("b=", "").split("x")
        if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
            raise SystemExit(f"--cases: {item!r} is not BxN with positive integers (e.g. 4x8192) nor one of "
                             f"{', '.join(BENCH_EXTRA)}")
        B, N = int(parts[0]), int(parts[1])
        cases.append((f"B={B} N={N}", [N] * B))
    return cases


def read_ceiling_gbps() -> float:
    """The read ceiling as the pipeline measures it: the read kernel's median over 16 GiB
    (persistentkv.ceiling.STREAM_BYTES, where its ~12 us fixed part is 0.3 %); nan when it fails."""
    from persistentkv.ceiling import STREAM_BYTES, measure_read, median_gbps
    from persistentkv.measure.device import TorchDevice

    try:
        return median_gbps(measure_read(TorchDevice("cuda"), nbytes=STREAM_BYTES, repeats=5, warmup=2))
    except Exception as exc:  # the bench still runs; the floor column says nan
        print(f"read ceiling: not measured ({first_line(exc)})")
        return math.nan


class PlainRead:
    """The read-ceiling kernel (kernels/ceiling.cu) over a contiguous buffer of ``nbytes``: what a
    step of the same bytes costs a kernel that only streams them, launch and ramp included, with no
    pages, no math and no merge. As many buffers as rotated_copies makes cache copies (allocated
    here, never inside a graph capture), the n-th cache copy it is called with mapped to buffer n,
    so it is as cold in L2 as the attention variants. Called as run(kv, plan, out); plan and out
    are unused."""

    def __init__(self, nbytes: int, factor: float = 3.0, max_copies: int = 64):
        import cupy
        import torch

        from persistentkv import ceiling
        from persistentkv.measure.rotation import cold_copies

        self.kernel = ceiling._read_kernel()
        self.nbytes = (nbytes + 15) // 16 * 16
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        self.grid = props.multi_processor_count * ceiling.BLOCKS_PER_SM
        self.block = ceiling.THREADS
        count = min(max_copies, cold_copies(nbytes, props.L2_cache_size, factor))
        self.buffers = []
        for _ in range(count):
            buf = torch.full((self.nbytes,), 0x5A, dtype=torch.uint8, device="cuda")
            sink = torch.zeros(1, dtype=torch.int32, device="cuda")
            self.buffers.append((buf, sink, cupy.from_dlpack(buf), cupy.from_dlpack(sink)))
        self.slot: dict = {}

    def __call__(self, kv, plan, out) -> None:
        import torch

        from persistentkv import ceiling

        index = self.slot.setdefault(kv[0].data_ptr(), len(self.slot) % len(self.buffers))
        _, _, src, sink = self.buffers[index]
        with ceiling.cupy_stream(torch.cuda.current_stream()):
            self.kernel((self.grid,), (self.block,), (src, np.uint64(self.nbytes // 16), sink))


def rotated_copies(spec, batch, l2_bytes: int, factor: float = 3.0, max_copies: int = 64, seed: int = 5):
    """(copies, q): R views of one KV tensor, R x case bytes >= factor x L2 (at most ``max_copies``),
    and the queries; standard normals of the spec's dtype. An FP8 spec's copies are
    (K, V, k_scale, v_scale) (the backend interface's FP8 cache): the normals quantised to e4m3
    with one scale per tensor (amax / 448), which every FP8 baseline takes."""
    import torch

    from persistentkv.fp8 import E4M3_MAX
    from persistentkv.measure.rotation import cold_copies

    R = min(max_copies, cold_copies(batch.kv_bytes, l2_bytes, factor))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = batch.num_pages
    shape = (R * pages, spec.page_size, spec.num_kv_heads, spec.head_dim)
    dtype = torch.bfloat16 if spec.dtype == "bfloat16" else torch.float16
    k_all = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
    v_all = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
    scales = ()
    if spec.fp8_kv:
        scales = tuple((t.abs().amax().float() / E4M3_MAX).reshape(1) for t in (k_all, v_all))
        k_all, v_all = ((t.float() / s).to(torch.float8_e4m3fn) for t, s in zip((k_all, v_all), scales))
    copies = [(k_all[r * pages:(r + 1) * pages], v_all[r * pages:(r + 1) * pages], *scales) for r in range(R)]
    q = torch.randn((batch.batch_size, spec.num_qo_heads, spec.head_dim), generator=gen, device="cuda",
                    dtype=dtype)
    return copies, q


def dequantized(kv):
    """(K, V) of a cache copy as the float64 reference reads it: an FP8 copy's codes x scales."""
    if len(kv) == 2:
        return kv
    k, v, k_scale, v_scale = kv
    return k.float() * k_scale, v.float() * v_scale


def capture(run, copies, calls: int, warmup: int = 3):
    """The replay of a CUDA graph of ``calls`` calls run(copy) cycling over ``copies``, warmed up
    on the capture stream (persistentkv.measure.device.capture_graph)."""
    from persistentkv.measure.device import capture_graph

    def warm():
        for r in range(min(len(copies), warmup)):
            run(copies[r])

    def calls_of():
        for c in range(calls):
            run(copies[c % len(copies)])

    return capture_graph(calls_of, warmup=warm)


def time_replays(graphs: dict, repeats: int, calls: int, seed: int = 0) -> dict[str, list[float]]:
    """Microseconds per call of each graph ({name: its replay, as capture returns it}): one warm-up
    replay each, then ``repeats`` rounds, each replaying every graph once in a shuffled order (CUDA
    events around each replay)."""
    import torch

    order = list(graphs)
    for name in order:
        graphs[name]()
    torch.cuda.synchronize()
    times = {name: [] for name in order}
    rng = np.random.default_rng(seed)
    for _ in range(repeats):
        rng.shuffle(order)
        for name in order:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphs[name]()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3 / calls)
    return times


def planning_adder(runs: dict):
    """add(name, make_plan, make_run): plans now and registers runs[name] = (plan, make_run), or
    prints why the variant could not be planned and leaves it out. make_run(q) returns the
    variant's run(kv, plan, out)."""

    def add(name, make_plan, make_run):
        try:
            runs[name] = (make_plan(), make_run)
        except Exception as exc:
            print(f"  {name}: not planned ({first_line(exc)})")

    return add


def add_engine_plan(add, batch, name: str, engine, plan_options: dict) -> None:
    """Register ``engine.plan(batch, **plan_options)`` and ``engine.run`` as the variant ``name``."""
    add(name, lambda: engine.plan(batch, **plan_options), lambda q: (lambda kv, p, o: engine.run(q, kv, p, o)))


def add_plain_read(add, batch) -> None:
    """Register PlainRead over the case's KV bytes as the variant ``read`` (NOT_ATTENTION)."""
    add(NOT_ATTENTION[0], lambda: None, lambda q: PlainRead(batch.kv_bytes))


def load_baselines(spec, names=BASELINES) -> dict:
    """name -> backend for the backends ``names`` (default every baseline) that can run ``spec``
    here; the others print why not."""
    from persistentkv.backends import registry

    baselines = {}
    for name in names:
        try:
            backend = registry.create(name)
            reasons = backend.unavailable(spec)
        except Exception as exc:
            reasons = [first_line(exc)]
        if reasons:
            print(f"{name}: skipped ({'; '.join(reasons)})")
        else:
            baselines[name] = backend
    return baselines


def add_baselines(add, batch, baselines: dict) -> None:
    """Register every baseline as a variant through ``add(name, make_plan, make_run)``."""
    for name, backend in baselines.items():
        add(name, lambda b=backend: b.plan(batch), lambda q, b=backend: (lambda kv, p, o: b.run(q, kv, p, o)))


def time_case(spec, batch, variants: dict, ceiling: float, args, case: str | None = None):
    """Check every variant (name -> (plan, make_run)) against float64, then time them interleaved
    (module docstring). A variant that fails prints its reason and is left out.

    Returns (parquet rows, median us per variant, worst (row, head) rel err per variant, floor us).
    """
    import torch

    from gpu_support import TOLERANCE, reference_torch64, row_head_errors_torch

    B, N = batch.batch_size, int(batch.seq_lens.max())
    case = case or f"B={B} N={N}"
    copies, q = rotated_copies(spec, batch, torch.cuda.get_device_properties(0).L2_cache_size,
                               max_copies=1 if args.warm else 64)
    ref = reference_torch64(batch, q, *dequantized(copies[0]))
    floor = batch.kv_bytes / (ceiling * 1e3) if ceiling > 0 else math.nan
    print(f"{case}: {batch.kv_bytes / 1e6:.1f} MB, floor {floor:.2f} us, {len(copies)} copies", flush=True)
    graphs, errors, keep = {}, {}, []
    for name, (plan, make_run) in variants.items():
        try:
            run = make_run(q)
            if hasattr(run, "prepare"):  # a variant that reads its own copies of the same values
                run.prepare(copies)
            out = torch.full_like(q, float("nan"))
            run(copies[0], plan, out)
            torch.cuda.synchronize()
            errors[name] = math.nan if name in NOT_ATTENTION else float(row_head_errors_torch(out, ref).max())
            graphs[name] = capture(lambda kv, r=run, p=plan, o=out: r(kv, p, o), copies, args.calls)
            keep.append((plan, out))  # the graph reads the plan and writes into out: both outlive it
            wrong = "" if name in NOT_ATTENTION or errors[name] <= TOLERANCE[spec.dtype] else "  WRONG"
            print(f"  {name}: " + ("not attention, not checked" if name in NOT_ATTENTION else
                                   f"worst (row, head) rel err {errors[name]:.1e}{wrong}"))
        except Exception as exc:
            print(f"  {name}: failed ({first_line(exc)})")
            torch.cuda.synchronize()
    times = time_replays(graphs, args.repeats, args.calls) if graphs else {}
    med = {name: statistics.median(ts) for name, ts in times.items()}
    rows = [{"case": case, "batch_size": B, "seq_len": N, "variant": name, "repeat": i, "time_us": t,
             "max_row_head_err": errors[name], "kv_bytes": batch.kv_bytes, "floor_us": floor,
             "read_ceiling_gbps": ceiling, "copies": len(copies)}
            for name, ts in times.items() for i, t in enumerate(ts)]
    del graphs, copies, keep
    torch.cuda.empty_cache()
    return rows, med, errors, floor


def within_tolerance(med: dict, errors: dict, dtype: str) -> dict:
    """The medians of the attention variants whose output passed the float64 check."""
    from gpu_support import TOLERANCE

    return {n: t for n, t in med.items() if n not in NOT_ATTENTION and errors[n] <= TOLERANCE[dtype]}


def add_out_option(parser: argparse.ArgumentParser) -> None:
    """--out: the directory of a bench's rows, $OUT where the device machine sets it, else '.'."""
    parser.add_argument("--out", default=os.environ.get("OUT", "."),
                        help="directory of the rows (default $OUT, else .)")


def bench_args(extra=None, description: str | None = None) -> argparse.Namespace:
    """The development benches' command line: --out (default $OUT, else .), --calls per graph,
    --repeats of every graph, --warm, --cases (see parse_cases); ``extra(parser)`` adds a bench's own."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    if extra is not None:
        extra(parser)
    add_out_option(parser)
    parser.add_argument("--calls", type=int, default=10, help="calls per CUDA graph (default 10)")
    parser.add_argument("--repeats", type=int, default=15, help="interleaved rounds, each replaying every graph once "
                        "(default 15)")
    parser.add_argument("--warm", action="store_true",
                        help="every call of a graph on one cache copy (L2 warm where the case's bytes fit in it), "
                             "instead of rotating over copies of 3x L2 (cold)")
    parser.add_argument("--cases", default="",
                        help="comma-separated BxN (e.g. 1x4096,4x8192), bench-kernels' ragged cases (B8-bimodal) or "
                             "row lengths joined by ':'; default " + ",".join(f"{B}x{N}" for B, N in CASES))
    args = parser.parse_args()
    try:  # before any GPU work: a --out that cannot be made fails now, not after the first case
        Path(args.out).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"--out {args.out}: {exc.strerror or exc}")
    parse_cases(args.cases)  # a bad case fails now, too
    return args


def timed_cases(spec, args, variants_for_batch, ceiling: float, rows: list, stem: str, t_start: float):
    """Each case of --cases, timed by time_case over ``variants_for_batch(batch)``; its rows are
    added to ``rows`` and written at once (write_rows), so a crash keeps the cases done. Yields
    (label, medians, medians of the attention variants that passed the float64 check, floor us,
    worst (row, head) rel err per variant)."""
    from persistentkv.cache import make_batch

    for label, lengths in parse_cases(args.cases):
        batch = make_batch(spec, lengths, seed=1)
        case_rows, med, errors, floor = time_case(spec, batch, variants_for_batch(batch), ceiling, args, label)
        rows += case_rows
        write_rows(rows, args.out, stem, t_start, final=False)
        yield label, med, within_tolerance(med, errors, spec.dtype), floor, errors


def fastest(times: dict, keep=lambda name: True) -> tuple:
    """(name, us) of the fastest variant in ``times`` that ``keep`` accepts, else (None, nan)."""
    picks = {n: t for n, t in times.items() if keep(n)}
    return min(picks.items(), key=lambda kv: kv[1]) if picks else (None, math.nan)


def comparison_row(label: str, floor: float, med: dict, ok: dict, errors: dict | None = None) -> tuple:
    """One case of print_comparison: (label, floor, medians, best baseline, best of ours, outside),
    each best as fastest's (name, us) over the attention variants that passed the check, and
    ``outside`` the baselines that ran but missed it, (name, us, worst (row, head) rel err) each:
    an FP8 path that rounds the query to e4m3 is timed and shown with its error, never the best."""
    errors = errors or {}
    outside = [(n, t, errors.get(n, math.nan)) for n, t in med.items() if n in BASELINES and n not in ok]
    ok = {n: t for n, t in ok.items() if n not in NOT_ATTENTION}
    return label, floor, med, fastest(ok, lambda n: n in BASELINES), fastest(
        ok, lambda n: n not in BASELINES and not n.endswith(FP16_TWIN)), outside


def print_comparison(table: list) -> None:
    """Our variants beside the best baseline, one line per comparison_row: the floor at this run's
    read ceiling, our variants' medians, the best baseline, our best, its speedup over the best
    baseline and its fraction of the floor; then the baselines outside the tolerance, with their
    times and errors."""
    print(f"\n{'case':<14} {'floor':>6}  variants (us)   best baseline   best of ours   speedup   %ceiling")
    for case, floor, med, (bn, bus), (on, ous), outside in table:
        cells = " ".join(f"{n}={t:.1f}" for n, t in med.items() if n not in BASELINES)
        missed = "".join(f"   [outside the tolerance: {n}={t:.1f} (err {e:.1e}), {t / ous:.2f}x]"
                         for n, t, e in outside)
        print(f"{case:<14} {floor:6.1f}  {cells}   {bn}={bus:.1f}   {on}={ous:.1f}   {bus / ous:.2f}x   "
              f"{100 * floor / ous:.0f}%{missed}")


def paired_ratios(df):
    """Each variant ``X-TAG`` whose base X is a shipped configuration (SHIPPED) run in the same
    file, per case: the ratio of their times in each round (the variants of a round run
    interleaved, side by side), as its median, min and max over the rounds, and the rounds in which
    X-TAG was faster. Rounds missing either variant are left out. Columns: case, variant, base,
    median, min, max, faster, rounds (below 1 is faster)."""
    import pandas as pd

    per_round = df.pivot_table(index=["case", "repeat"], columns="variant", values="time_us", sort=False)
    rows = []
    for variant in per_round.columns:
        base, sep, tag = variant.partition("-")
        if not sep or not tag or base not in SHIPPED or base not in per_round.columns:
            continue
        for case, both in per_round[[base, variant]].dropna().groupby(level="case", sort=False):
            ratio = both[variant] / both[base]
            rows.append({"case": case, "variant": variant, "base": base, "median": ratio.median(),
                         "min": ratio.min(), "max": ratio.max(), "faster": int((ratio < 1).sum()),
                         "rounds": len(ratio)})
    return pd.DataFrame(rows, columns=["case", "variant", "base", "median", "min", "max", "faster", "rounds"])


def print_paired(df) -> None:
    """paired_ratios as one line per case and variant."""
    table = paired_ratios(df)
    if table.empty:
        return
    print("\npaired per-round ratios, variant / its shipped configuration (median [min, max], rounds faster):")
    for r in table.itertuples():
        print(f"  {r.case:<14} {r.variant:<18} {r.median:.3f} [{r.min:.3f}, {r.max:.3f}]  {r.faster}/{r.rounds}")


def write_rows(rows: list[dict], out: str, stem: str, t_start: float, final: bool = True) -> Path:
    """Write the rows so far to <out>/<stem>_<HHMMSS of t_start>.parquet, atomically (a temporary
    file renamed over it: a run killed mid-write leaves the last complete file). The same file on
    every call: the benches call it after each case, so a crash or a time limit keeps the cases done."""
    import pandas as pd

    from persistentkv.io import atomic_write_parquet

    path = Path(out) / f"{stem}_{time.strftime('%H%M%S', time.localtime(t_start))}.parquet"
    atomic_write_parquet(path, pd.DataFrame(rows))  # makes a missing --out directory: the rows are kept
    if final:
        print(f"wrote {path} ({time.time() - t_start:.0f} s)")
    return path
