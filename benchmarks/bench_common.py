"""Shared by bench_cluster.py and bench_warps.py: the cases, the baselines, the read ceiling, and
one case's check-then-time loop (float64 check, CUDA graphs over rotated cold-L2 copies, every
variant of the case interleaved), so the two benches measure the same way."""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from pathlib import Path

from graph_timing import capture, rotated_copies, time_replays

CASES = [(1, 1024), (1, 4096), (1, 8192), (1, 16384), (1, 32768), (1, 65536), (1, 131072),
         (2, 16384), (4, 8192), (8, 4096), (4, 32768)]
BASELINES = ("flashinfer-tc", "vllm-fa3", "trtllm-xqa")
#: variants that time something other than attention (no float64 check, never "fastest")
NOT_ATTENTION = ("read",)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def parse_cases(text: str) -> list[tuple[str, list[int]]]:
    """``1x4096,B=4x8192,B8-bimodal,13184:19392`` -> [(label, row lengths), ...]; empty -> CASES.

    A case is BxN (B rows of N tokens), the name of one of bench-kernels' ragged row sets
    (persistentkv.measure.workload.BENCH_EXTRA, e.g. B8-bimodal), so the development benches can
    time the cases where bench-kernels found a route behind, or the row lengths themselves joined
    by ``:`` (a step of a trace, e.g. one where a measured route fell behind)."""
    from persistentkv.measure.workload import BENCH_EXTRA

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
    from persistentkv.ceiling import measure_read, median_gbps
    from persistentkv.measure.device import TorchDevice

    try:
        return median_gbps(measure_read(TorchDevice("cuda"), nbytes=2**30, repeats=5, warmup=2))
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
        import numpy as np
        import torch

        from persistentkv import ceiling

        index = self.slot.setdefault(kv[0].data_ptr(), len(self.slot) % len(self.buffers))
        _, _, src, sink = self.buffers[index]
        with ceiling.cupy_stream(torch.cuda.current_stream()):
            self.kernel((self.grid,), (self.block,), (src, np.uint64(self.nbytes // 16), sink))


def planning_adder(runs: dict):
    """add(name, make_plan, make_run) for the benches' variants_for: plans now and registers
    runs[name] = (plan, make_run), or prints why the variant could not be planned and leaves it out."""

    def add(name, make_plan, run):
        try:
            runs[name] = (make_plan(), run)
        except Exception as exc:
            print(f"  {name}: not planned ({first_line(exc)})")

    return add


def engine_run(engine):
    """make_run of one of our engines: q -> run(kv, plan, out)."""
    return lambda q: (lambda kv, p, o: engine.run(q, kv, p, o))


def queue_name(warps: int, stem: str = "wq") -> str:
    """A queue variant's name: ``stem`` at 4 warps, ``stem`` + warps otherwise (wq, wq8; wqh, wqh8)."""
    return stem if warps == 4 else f"{stem}{warps}"


def add_queue(add, batch, name: str, engine, **options) -> None:
    """Register ``engine``'s work-queue plan of ``batch`` (plan ``options``) as the variant ``name``."""
    add(name, lambda: engine.plan(batch, "workqueue", **options), engine_run(engine))


def add_plain_read(add, batch) -> None:
    """Register PlainRead over the case's KV bytes as the variant ``read`` (NOT_ATTENTION)."""
    add(NOT_ATTENTION[0], lambda: None, lambda q: PlainRead(batch.kv_bytes))


def load_baselines(spec, names=BASELINES) -> dict:
    """name -> backend for the backends ``names`` (default BASELINES) that can run ``spec`` here;
    the others print why not."""
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


def time_case(engine, spec, batch, variants: dict, ceiling: float, args,
              case: str | None = None) -> tuple[list[dict], dict, dict, float]:
    """Check every variant (name -> (plan, make_run)) against float64, then time them interleaved.

    Returns (parquet rows, median us per variant, name -> (rel err, CTAs per SM or -1), floor us).
    A variant that fails prints its reason and is left out. ``engine`` only answers occupancy
    queries (any DecodeEngine answers them for any of our launches).
    """
    import torch

    from gpu_support import TOLERANCE, reference_torch64, rel_err
    from persistentkv.engine import DevicePlan

    B, N = batch.batch_size, int(batch.seq_lens.max())
    case = case or f"B={B} N={N}"
    copies, q = rotated_copies(spec, batch, torch.cuda.get_device_properties(0).L2_cache_size,
                               max_copies=1 if getattr(args, "warm", False) else 64)
    ref = reference_torch64(batch, q, *copies[0])
    floor = batch.kv_bytes / (ceiling * 1e3) if ceiling > 0 else math.nan
    print(f"{case}: {batch.kv_bytes / 1e6:.1f} MB, floor {floor:.2f} us, {len(copies)} copies", flush=True)
    graphs, info = {}, {}
    for name, (plan, make_run) in variants.items():
        try:
            run = make_run(q)
            out = torch.full_like(q, float("nan"))
            run(copies[0], plan, out)
            torch.cuda.synchronize()
            err = math.nan if name in NOT_ATTENTION else rel_err(out, ref)
            occ = engine.occupancy(plan.launches[-1]) if isinstance(plan, DevicePlan) else -1
            graphs[name] = capture(lambda kv, r=run, p=plan, o=out: r(kv, p, o), copies, args.calls)
            info[name] = (err, occ)
            if name in NOT_ATTENTION:
                print(f"  {name}: not attention, not checked")
                continue
            print(f"  {name}: rel err {err:.1e}{'' if err <= TOLERANCE[spec.dtype] else '  WRONG'}"
                  + (f", {occ} CTA/SM" if occ >= 0 else ""))
        except Exception as exc:
            print(f"  {name}: failed ({first_line(exc)})")
            torch.cuda.synchronize()
    times = time_replays(graphs, args.repeats, args.calls) if graphs else {}
    med = {name: statistics.median(ts) for name, ts in times.items()}
    rows = []
    for name, ts in times.items():
        err, occ = info[name]
        rows += [{"case": case, "batch_size": B, "seq_len": N, "variant": name, "repeat": i, "time_us": t,
                  "rel_err": err, "ctas_per_sm": occ, "kv_bytes": batch.kv_bytes, "floor_us": floor,
                  "read_ceiling_gbps": ceiling, "copies": len(copies)} for i, t in enumerate(ts)]
    del graphs, copies
    torch.cuda.empty_cache()
    return rows, med, info, floor


def bench_args(extra=None) -> argparse.Namespace:
    """The development benches' command line: --out (default $OUT, else .), --calls per graph,
    --repeats of every graph, --cases (see parse_cases); ``extra(parser)`` adds a bench's own."""
    parser = argparse.ArgumentParser()
    if extra is not None:
        extra(parser)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warm", action="store_true",
                        help="every call of a graph on one cache copy (L2 warm where the case's bytes fit in it), "
                             "instead of rotating over copies of 3x L2 (cold)")
    parser.add_argument("--cases", default="",
                        help="comma-separated BxN (e.g. 1x4096,4x8192) or bench-kernels' ragged cases (B8-bimodal); "
                             "default all")
    args = parser.parse_args()
    try:  # before any GPU work: a --out that cannot be made fails now, not after the first case
        Path(args.out).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"--out {args.out}: {exc.strerror or exc}")
    return args


def timed_cases(engine, spec, args, variants_for_batch, ceiling: float, rows: list, stem: str, t_start: float):
    """Each case of --cases, timed by time_case over ``variants_for_batch(batch)``; its rows are
    added to ``rows`` and written at once (write_rows), so a crash keeps the cases done. Yields
    (label, batch, medians, medians of the variants that passed the float64 check, floor us)."""
    from persistentkv.cache import make_batch

    for label, lengths in parse_cases(args.cases):
        batch = make_batch(spec, lengths, seed=1)
        case_rows, med, info, floor = time_case(engine, spec, batch, variants_for_batch(batch), ceiling, args, label)
        rows += case_rows
        write_rows(rows, args.out, stem, t_start, final=False)
        yield label, batch, med, within_tolerance(med, info, spec.dtype), floor


def fastest(times: dict, keep=lambda name: True) -> tuple:
    """(name, us) of the fastest variant in ``times`` that ``keep`` accepts, else (None, nan)."""
    picks = {n: t for n, t in times.items() if keep(n)}
    return min(picks.items(), key=lambda kv: kv[1]) if picks else (None, math.nan)


SHIPPED = ("wq", "wq8")


def comparison_row(label: str, floor: float, med: dict, ok: dict, is_candidate) -> tuple:
    """One case of print_comparison: (label, floor, medians, best baseline, best shipped queue,
    best candidate), each best as fastest's (name, us) over the variants that passed the check."""
    ok = {n: t for n, t in ok.items() if n not in NOT_ATTENTION}
    return (label, floor, med, fastest(ok, lambda n: n in BASELINES), fastest(ok, lambda n: n in SHIPPED),
            fastest(ok, is_candidate))


def print_comparison(table: list, tag: str) -> None:
    """The candidate ``tag`` against the shipped queue and the baselines, one line per comparison_row."""
    print(f"\n{'case':<14} {'floor':>6}  variants (us)   best baseline   best shipped   best {tag}   {tag} gain   "
          f"{tag} vs baseline   %ceiling({tag})")
    for case, floor, med, (bn, bus), (cn, cus), (tn, tus) in table:
        cells = " ".join(f"{n}={t:.1f}" for n, t in med.items() if n not in BASELINES)
        print(f"{case:<14} {floor:6.1f}  {cells}   {bn}={bus:.1f}   {cn}={cus:.1f}   {tn}={tus:.1f}   "
              f"{cus / tus:.2f}x   {bus / tus:.2f}x   {100 * floor / tus:.0f}%")


def paired_ratios(df):
    """Each development variant ``X-TAG`` (X a shipped queue, wq or wq8) against X, per case: the
    ratio of their times in each round (the variants of a round run interleaved, side by side),
    as its median, min and max over the rounds, and the rounds in which X-TAG was faster. Rounds
    missing either variant are left out. Columns: case, variant, base, median, min, max, faster,
    rounds (below 1 is faster)."""
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
    print("\npaired per-round ratios, variant / its shipped queue (median [min, max], rounds faster):")
    for r in table.itertuples():
        print(f"  {r.case:<14} {r.variant:<18} {r.median:.3f} [{r.min:.3f}, {r.max:.3f}]  {r.faster}/{r.rounds}")


def within_tolerance(med: dict, info: dict, dtype: str) -> dict:
    """The medians of the variants whose output passed the float64 check."""
    from gpu_support import TOLERANCE

    return {n: t for n, t in med.items() if info[n][0] <= TOLERANCE[dtype]}


def write_rows(rows: list[dict], out: str, stem: str, t_start: float, final: bool = True) -> Path:
    """Write the rows so far to <out>/<stem>_<HHMMSS of t_start>.parquet (the same file on every
    call: the benches call it after each case, so a crash or a time limit keeps the cases done)."""
    import pandas as pd

    path = Path(out) / f"{stem}_{time.strftime('%H%M%S', time.localtime(t_start))}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)  # a missing --out directory must not lose the rows
    pd.DataFrame(rows).to_parquet(path, index=False)
    if final:
        print(f"wrote {path} ({time.time() - t_start:.0f} s)")
    return path
