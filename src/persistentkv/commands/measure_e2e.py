"""``persistentkv measure-e2e``: the full Llama decode step with each backend, side by side (GPU).

    persistentkv measure-e2e --config config/config.yaml --out results/nvidia-h200/e2e/pass1.parquet \
        [--models llama3_8b,llama3_70b_tp8] [--cases 1x4096,64x4096] [--traces bimodal_b8,zipf_b8] \
        [--backends pkv-workqueue,flashinfer-tc,...] [--kernels auto|torch|flashinfer|pkv[,...]] \
        [--kv-dtype float8_e4m3] [--quick]

For every model of ``--models`` (config ``models:``; seeded random weights, the spec's dtype and
page size), every (B, context) cell of its ``cases`` and every trace of ``--traces``, each backend
runs the same step in its own DecodeLoop over one shared cache (the prompts' K/V are seeded random
values, not a prefill) and one shared set of weights. Each loop captures two CUDA graphs:

* the step: embedding, 32 (80) layers of norm, QKV, rotary, append, attention, O projection, norm,
  SwiGLU, then the final norm, LM head and greedy sampling; the plan's refresh inside it for the
  backends that follow lengths on the device (DecodeLoop's ``device`` mode: pkv-workqueue
  re-plans on the GPU inside the graph);
* the rest: the same step without attention (each layer's append kept, the plan's device refresh
  left out: it is the backend's), the step's non-attention time measured directly (``rest_us``);
* the attention alone: the same refresh, then per layer that layer's append (of fixed k, v) and
  one ``run()`` over its cache on a fixed q, so every call follows the kernel it follows in the
  step (a launch with programmatic dependent launch may start under the append's tail, as in the
  step, never under the previous attention call's); and the appends alone, replayed right before
  it and subtracted (``append_us``): ``attention_us`` is what the step spends in attention,
  measured in the same run (the layers' calls back to back would hide part of attention's cost
  in a step: benchmarks/NOTES.md, "Attention alone, timed after its append").

Rounds interleave the backends (A B C, B C A, ...: the order rotates each round, and each round
starts behind a ~1 ms spin so that its first graph is not timed with the host's launch of it;
benchmarks/NOTES.md, "What ships", the rotated rounds row; persistentkv.measure.steps, which also
holds the attention-alone graphs, and measure.schedule.round_order): in each round every loop is rewound
to the cell's state (its positions and tokens restored on the device, outside the timed window)
before each of its graphs, which replay between two CUDA events each: the step (``step_us``), the
rest, the appends, the attention; ``non_attention_us`` is step_us - attention_us within the round,
and step_us - rest_us what attention costs inside the step. The floor of a step
is its bytes, weights read once (every layer, the LM head, B embedding rows) plus the K/V of every
row and layer, at the run's read ceiling (persistentkv.ceiling, measured before and after the
cases; the higher counts). Beside it, the measured yardstick of the step's weight reads
(``weight_kernel_floor_us``): each weight matrix's one-kernel floor (a plain read of its bytes in
one kernel, cold L2, graph-replayed), measured before the cases, times the step's reads of it.

Traces: the loop follows the trace's rows (arrivals and departures), every ``measure.step_stride``
th step is timed; a change of rows re-plans and re-captures, and ``recaptures`` counts them.
``--kv-dtype float8_e4m3``: every loop's cache holds e4m3 codes (persistentkv.model.PagedKV, scales
1 per tensor), the append quantises, and each backend that reads no FP8 cache gets an
``unavailable`` row with its reason; the rows' ``kv_dtype`` and ``kv_bytes`` (and so the floors)
are the cache's.

A configuration that does not fit in free device memory is refused with one line before anything
is allocated for it, and its rows say so (status ``refused``).

Nothing measured is lost to a run stopped part-way (a time limit, a lost session): after every
configuration (a model's cell or trace under one ``--kernels`` variant) the rows gathered so far
are written to ``--out`` (atomically), their floors at the read ceiling measured before the cases,
with those ceiling rows, and the sidecar beside it says ``complete: false`` and how many
configurations the file holds. The last write replaces both: every row's floors at the run's
ceiling (before and after), both ceilings' rows, and ``complete: true``.
"""

from __future__ import annotations

import argparse
import functools
import math
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..errors import PKVError, require

#: Column -> dtype of the rows this command writes (one per repeat of a backend in a cell or step).
E2E_COLUMNS: dict[str, str] = {
    "run_id": "string", "experiment": "string", "model": "string", "tensor_parallel": "int64",
    "trace": "string", "seed": "int64", "step": "int64", "batch_size": "int64", "context": "int64",
    "total_tokens": "int64", "dtype": "string", "kv_dtype": "string", "page_size": "int64", "backend": "string",
    "kernels": "string", "follow": "string", "repeat": "int64", "step_us": "float64", "attention_us": "float64",
    "non_attention_us": "float64", "rest_us": "float64", "append_us": "float64", "tokens_per_s": "float64",
    "weight_bytes": "int64", "kv_bytes": "int64",
    "floor_us": "float64", "weight_floor_us": "float64", "kv_floor_us": "float64", "read_ceiling_gbps": "float64",
    "weight_kernel_floor_us": "float64",
    "mem_estimate_bytes": "int64", "mem_peak_bytes": "int64", "recaptures": "int64", "status": "string",
    "reason": "string",
}
#: Tokens each row may grow past its context inside a cell (one step per replay, rewound each round).
ROOM = 64
EXPERIMENT = "e2e"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="config/config.yaml", help="config/config.yaml")
    parser.add_argument("--out", required=True, help="FILE.parquet for the rows (provenance beside it, .json)")
    parser.add_argument("--models", default=None, help="comma-separated models (default: those with cases)")
    parser.add_argument("--cases", default=None,
                        help="comma-separated BxCONTEXT cells, e.g. 1x4096,64x4096 (default: each model's cases)")
    parser.add_argument("--traces", default=None,
                        help="comma-separated trace names, or 'none' (default: each model's models.<name>.traces, else "
                             "every generated trace of the config)")
    parser.add_argument("--backends", default=None,
                        help="comma-separated subset (default: config measure.backends that are graph-safe on the GPU)")
    parser.add_argument("--kernels", default="auto",
                        help="the non-attention kernels (persistentkv.model.Kernels): auto (pkv on CUDA where FlashInfer "
                             "and CuPy import), torch, flashinfer, pkv, or a comma list (one run each)")
    from .measure import add_kv_dtype

    add_kv_dtype(parser, "results/{hw}/e2e_fp8/pass<N>.parquet")
    parser.add_argument("--quick", action="store_true",
                        help="one cell per model, one trace of two timed steps, 3 rounds: a smoke run, not a result")


def parse_cases(text: str | None) -> list[tuple[int, int]] | None:
    """'1x4096,64x32768' -> [(1, 4096), (64, 32768)]; None for None."""
    if text is None:
        return None
    cases = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        b, sep, n = part.lower().partition("x")
        require(sep and b.isdigit() and n.isdigit() and int(b) > 0 and int(n) > 0,
                f"--cases: {part!r} is not BxCONTEXT with positive integers (e.g. 4x32768)")
        cases.append((int(b), int(n)))
    require(cases, f"--cases {text!r} names no cell")
    return cases


def default_backends(config: dict) -> list[str]:
    """measure.backends that run inside a captured step on the GPU (the adaptive backend needs a
    policy file and the NumPy executor runs on the host)."""
    from ..names import ADAPTIVE, CPU_ONLY

    return [b for b in config["measure"]["backends"] if b != ADAPTIVE and b not in CPU_ONLY]


# -- one configuration ------------------------------------------------------------------------
class Setting:
    """What the rows of one (model, cell or trace) share."""

    def __init__(self, run_id, shape, dtype, page_size, trace, seed, kernels, mem_estimate,
                 weight_kernel_floor_us: float = math.nan, kv_dtype: str | None = None):
        self.kv_dtype = kv_dtype or dtype
        self.fields = dict(run_id=run_id, experiment=EXPERIMENT, model=shape.name,
                           tensor_parallel=shape.tensor_parallel, trace=trace, seed=int(seed), dtype=dtype,
                           kv_dtype=self.kv_dtype,
                           page_size=int(page_size), kernels=kernels, mem_estimate_bytes=int(mem_estimate),
                           weight_kernel_floor_us=float(weight_kernel_floor_us))
        self.shape, self.dtype = shape, dtype

    def row(self, backend: str, batch_size: int, lengths, step: int, **fields) -> dict:
        lengths = np.asarray(lengths, np.int64)
        row = {name: None for name in E2E_COLUMNS}
        row.update(self.fields, backend=backend, step=int(step), batch_size=int(batch_size),
                   context=int(lengths.max()) if lengths.size else 0, total_tokens=int(lengths.sum()),
                   weight_bytes=self.shape.step_weight_bytes(self.dtype, batch_size),
                   kv_bytes=int(lengths.sum()) * self.shape.kv_bytes_per_token(self.kv_dtype), follow="",
                   repeat=-1, mem_peak_bytes=0, recaptures=0, reason="", status="ok")
        for name in ("step_us", "attention_us", "non_attention_us", "rest_us", "append_us", "tokens_per_s", "floor_us",
                     "weight_floor_us", "kv_floor_us", "read_ceiling_gbps"):
            row[name] = math.nan
        row.update(fields)
        return row


def _loops(model, kv, names, rows_of, log):
    """{name: DecodeLoop} for every backend that can run here, with its attention-alone graphs
    (persistentkv.measure.steps); {name: reason} for the others."""
    from ..measure.steps import add_alone_graphs
    from ..model import DecodeLoop

    loops, refused = {}, {}
    for name in names:
        try:
            loop = DecodeLoop(model, kv, name, log=log)
            require(loop.backend.capabilities.graph != "none", f"backend {name} is not graph-safe")
            add_alone_graphs(loop)
            rows_of(loop)
            loop.next_tokens()  # plans the step (and fails here, not mid-round, if it cannot)
            loops[name] = loop
        except Exception as exc:
            refused[name] = _one_line(exc)
    return loops, refused


def _one_line(exc: BaseException) -> str:
    from ..measure.rows import one_line

    return one_line(exc)


def _timed_rows(setting, loops, times, batch_size, lengths, step, peak) -> list[dict]:
    rows = []
    for name, loop in loops.items():
        for repeat, us in enumerate(times[name]):
            attn_us = us["attention"] - us["appends"]
            rows.append(setting.row(name, batch_size, lengths, step, repeat=repeat, step_us=us["step"],
                                    attention_us=attn_us, non_attention_us=us["step"] - attn_us,
                                    rest_us=us["rest"], append_us=us["appends"],
                                    tokens_per_s=batch_size / (us["step"] * 1e-6),
                                    follow=loop.mode, mem_peak_bytes=int(peak),
                                    recaptures=int(loop.recaptures)))
    return rows


def _refused_rows(setting, names, batch_size, lengths, step, reasons, status) -> list[dict]:
    return [setting.row(name, batch_size, lengths, step, status=status, reason=reasons[name]) for name in names]


def _run_cell(ctx, model, shape, batch_size: int, context: int, names) -> list[dict]:
    import torch

    from ..model import PagedKV, check_fits, footprint
    from ..model.shape import pages_for

    dtype, P = ctx.dtype, ctx.page_size
    reserve = context + ROOM
    pages = batch_size * pages_for(reserve, P)
    need = footprint(shape, dtype, pages, P, batch_size, backends=len(names), kv_dtype=ctx.kv_dtype)
    need = replace(need, weights=0)  # the weights are already on the device
    label = f"{shape.name} at B={batch_size} x {context}"
    setting = Setting(ctx.run_id, shape, dtype, P, "cases", ctx.seed, model.kernels.name,
                      need.total + shape.weight_bytes(dtype), ctx.kernel_floors.get(shape.name, math.nan),
                      ctx.kv_dtype)
    lengths = [context] * batch_size
    try:
        check_fits(need, ctx.device.free_bytes(), label)
    except PKVError as exc:
        ctx.log(f"refused: {exc}")
        return _refused_rows(setting, names, batch_size, lengths, 0, {n: str(exc) for n in names}, "refused")
    torch.cuda.reset_peak_memory_stats()
    kv = PagedKV(shape, pages, P, model.dtype, "cuda", seed=ctx.seed, kv_dtype=ctx.kv_dtype)
    kv.fill_random(ctx.seed)
    tokens = np.random.default_rng(ctx.seed).integers(0, shape.vocab_size, batch_size)

    def admit(loop):
        for rid in range(batch_size):
            loop.admit(rid, context - 1, int(tokens[rid]), reserve)

    loops, refused = _loops(model, kv, names, admit, ctx.log)
    rows = _refused_rows(setting, refused, batch_size, lengths, 0, refused, "unavailable")
    return rows + _time_step(ctx, setting, loops, batch_size, lengths, 0)


def _time_step(ctx, setting, loops, batch_size: int, lengths, step: int) -> list[dict]:
    """Capture what is not captured, then the interleaved rounds of every loop at this state
    (persistentkv.measure.steps)."""
    import torch

    from ..measure.steps import capture_missing, time_loop_rounds

    failed = capture_missing(loops)
    rows = _refused_rows(setting, failed, batch_size, lengths, step, failed, "failed")
    marks = {name: loop.mark() for name, loop in loops.items()}
    times = time_loop_rounds(ctx.device, loops, marks, ctx.rounds, ctx.warmup)
    return rows + _timed_rows(setting, loops, times, batch_size, lengths, step, torch.cuda.max_memory_allocated())


def _run_trace(ctx, model, shape, trace, names) -> list[dict]:
    """Follow ``trace``'s rows in every backend's loop; time every step_stride-th step."""
    import torch

    from ..model import PagedKV, check_fits, footprint

    dtype, P = ctx.dtype, ctx.page_size
    timed, reserve, live = trace_layout(trace, ctx.stride, ctx.quick, P)
    widest = max(step.batch_size for step in timed)
    need = footprint(shape, dtype, live, P, widest, backends=len(names), kv_dtype=ctx.kv_dtype)
    need = replace(need, weights=0)
    setting = Setting(ctx.run_id, shape, dtype, P, trace.name, trace.seed, model.kernels.name,
                      need.total + shape.weight_bytes(dtype), ctx.kernel_floors.get(shape.name, math.nan),
                      ctx.kv_dtype)
    try:
        check_fits(need, ctx.device.free_bytes(), f"{shape.name} on trace {trace.name}")
    except PKVError as exc:
        ctx.log(f"refused: {exc}")
        ctx.progress.update(len(timed))
        return [row for step in timed for row in _refused_rows(
            setting, names, step.batch_size, step.lengths, step.index, {n: str(exc) for n in names}, "refused")]
    torch.cuda.reset_peak_memory_stats()
    kv = PagedKV(shape, live, P, model.dtype, "cuda", seed=trace.seed, kv_dtype=ctx.kv_dtype)
    kv.fill_random(trace.seed)
    first = timed[0]
    first_token = functools.partial(trace_first_token, vocab=shape.vocab_size)

    def join(loop):
        loop.follow(first.request_ids, first.lengths, reserve, first_token)

    loops, refused = _loops(model, kv, names, join, ctx.log)
    rows = []
    for step in timed:
        rows += _refused_rows(setting, refused, step.batch_size, step.lengths, step.index, refused, "unavailable")
        for loop in loops.values():
            loop.follow(step.request_ids, step.lengths, reserve, first_token)
        rows += _time_step(ctx, setting, loops, step.batch_size, step.lengths, step.index)
        ctx.progress.update(1)
    return rows


def trace_layout(trace, stride: int, quick: bool, page_size: int) -> tuple:
    """(the timed steps, request id -> tokens reserved, pages the cache needs) of ``trace``: the
    loops share the rows' pages and follow a step one after another, so between two timed steps
    the old rows and the new ones are held at once."""
    from ..model.shape import pages_for

    reserve = {r.id: r.prompt_len + r.decode_steps for r in trace.requests}
    timed = timed_steps(trace, stride, quick)
    held = [set(timed[0].request_ids)] + [set(a.request_ids) | set(b.request_ids) for a, b in zip(timed, timed[1:])]
    return timed, reserve, max(sum(pages_for(reserve[r], page_size) for r in rows) for rows in held)


def trace_first_token(rid: int, vocab: int) -> int:
    """A trace row's first input token (seeded by its request id)."""
    return int(rid * 7919 % vocab)


def _release() -> None:
    """Give a finished configuration's cache, plans and graph pools back to the device."""
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()


def timed_steps(trace, stride: int, quick: bool) -> tuple:
    """The trace steps timed: every ``stride``-th, the first two of them in a quick run."""
    return trace.steps[::stride][: 2 if quick else None]


class _Context:
    def __init__(self, **fields):
        self.__dict__.update(fields)


def run(args: argparse.Namespace) -> int:
    from ..measure.device import require_cuda
    from .measure import parse_kv_dtype

    parse_kv_dtype(args.kv_dtype)  # a bad value is one line before any GPU is looked for
    require_cuda()
    return measure(args)


def measure(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .. import configuration, traces
    from ..backends import registry
    from ..ceiling import measure_ceilings
    from ..measure.device import TorchDevice
    from ..model import KERNEL_CHOICES, model_cases, model_shape, model_traces
    from ..provenance import collect, new_run_id, utc_now

    from .measure import parse_kv_dtype, parse_names

    kv_dtype = parse_kv_dtype(args.kv_dtype)
    config = configuration.load_config(args.config)
    models_known = list(config.get("models") or {})
    models = parse_names(args.models, models_known, "models") or [m for m in models_known if model_cases(config, m)]
    require(models, "the config has no models with cases; add models.<name>.cases or pass --models")
    cases_arg = parse_cases(args.cases)
    generated = [e["name"] for e in config["traces"] if e["kind"] != "file"]
    trace_names = [] if args.traces == "none" else parse_names(args.traces, configuration.trace_names(config), "traces")
    names = parse_names(args.backends, registry.names(), "backends") or default_backends(config)
    kernels = parse_names(args.kernels, KERNEL_CHOICES, "kernels")
    quick = bool(args.quick)
    P, dtype = int(config["spec"]["page_size"]), str(config["spec"]["dtype"])
    seed = configuration.calibration_seed(config)
    require(args.out.endswith(".parquet"), f"--out {args.out!r} must be a .parquet file")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # fail before the GPU work, not after

    started = utc_now()
    run_id = new_run_id(EXPERIMENT, started)
    device = TorchDevice("cuda")
    ctx = _Context(run_id=run_id, device=device, dtype=dtype, kv_dtype=kv_dtype, page_size=P, seed=seed,
                   quick=quick,
                   rounds=3 if quick else int(config["measure"].get("step_repeats", config["measure"]["repeats"])),
                   warmup=1 if quick else int(config["measure"]["warmup"]),
                   stride=int(config["measure"]["step_stride"]), log=tqdm.write)
    print(f"device: {device.name}; models {', '.join(models)}; backends {', '.join(names)}; kernels "
          f"{', '.join(kernels)}; cache {kv_dtype or dtype}; {ctx.rounds} rounds after {ctx.warmup} warm-up")
    before, failed_before = measure_ceilings(device, repeats=3 if quick else 5, log=print)
    plans = []
    for name in models:
        shape = model_shape(config, name)
        cells = cases_arg or model_cases(config, name)
        cells = cells[:1] if quick else cells
        names_of = trace_names if trace_names is not None else model_traces(config, name, generated)
        names_of = names_of[:1] if quick else names_of
        built = [traces.build(configuration.trace_entry(config, t), seed) for t in names_of]
        plans.append((shape, cells, built))
    units = {shape.name: len(cells) + sum(len(timed_steps(t, ctx.stride, quick)) for t in built)
             for shape, cells, built in plans}
    ctx.kernel_floors = weight_kernel_floors(device, [shape for shape, _, _ in plans], dtype, quick, print)
    saver = PartialWriter(args.out, run_id, collect(config, [seed], started, device),
                          configurations=len(kernels) * sum(len(cells) + len(built) for _, cells, built in plans),
                          before=before, failed_before=failed_before)
    rows: list[dict] = []
    try:
        _measure_all(ctx, plans, units, kernels, names, saver, rows)
    except BaseException as exc:  # a device fault, an interrupt: keep the rows, say what stopped it
        saver.stopped(rows, exc)
        raise
    after, failed_after = measure_ceilings(device, repeats=3 if quick else 5, log=print)
    frame, sidecar = saver.finish(rows, after, failed_after)
    print(f"wrote {args.out} ({len(frame)} rows) and {sidecar}")
    print(summary_table(frame))
    return 0


def weight_kernel_floors(device, shapes, dtype: str, quick: bool, log) -> dict[str, float]:
    """{model: us}: the one-kernel floor of each weight matrix a step reads (ModelShape.step_matrices;
    persistentkv.ceiling.measure_floor: a plain read of its bytes in one kernel, cold L2,
    graph-replayed, best grid), times how many the step reads, summed: the step's weight reads
    at the measured yardstick rather than at the asymptotic read ceiling (weight_floor_us).
    Measured before any weights are on the device; a matrix size shared by two models is timed
    once."""
    from ..ceiling import measure_floor

    timed: dict[int, float] = {}
    out = {}
    for shape in shapes:
        total = 0.0
        for name, (nbytes, count) in shape.step_matrices(dtype).items():
            if nbytes not in timed:
                timed[nbytes] = measure_floor(device, nbytes, repeats=3 if quick else 5).median_us
            total += count * timed[nbytes]
        out[shape.name] = total
        log(f"{shape.name}: its weight matrices' one-kernel floors sum to {total:.0f} us per step")
    return out


def _measure_all(ctx, plans, units, kernels, names, saver, rows) -> None:
    """Every model's cells and traces, appending to ``rows`` and saving after each configuration."""
    import torch
    from tqdm import tqdm

    from ..env import torch_dtype
    from ..model import Model, check_fits, footprint, random_weights

    device, dtype, P, run_id, seed = ctx.device, ctx.dtype, ctx.page_size, ctx.run_id, ctx.seed
    with tqdm(total=len(kernels) * sum(units.values()), desc="e2e", unit="cell") as progress:
        ctx.progress = progress
        for shape, cells, built in plans:
            if shape.note:
                progress.write(f"{shape.name}: {shape.note}")
            weights_need = footprint(shape, dtype, 0, P, 1, backends=0)
            try:
                check_fits(weights_need, device.free_bytes(), f"{shape.name}'s weights")
            except PKVError as exc:
                progress.write(f"refused: {exc}")
                for variant in kernels:
                    setting = Setting(run_id, shape, dtype, P, "cases", seed, variant, weights_need.total,
                                      ctx.kernel_floors.get(shape.name, math.nan))
                    for b, n in cells:
                        rows += _refused_rows(setting, names, b, [n] * b, 0, {x: str(exc) for x in names}, "refused")
                saver.save(rows, done=len(kernels) * (len(cells) + len(built)))
                progress.update(len(kernels) * units[shape.name])
                continue
            weights = random_weights(shape, torch_dtype(dtype), "cuda", seed)
            most = max([n for _, n in cells] + [s.max_len for t in built for s in t.steps] + [1]) + ROOM
            model = None
            for variant in kernels:
                try:
                    model = Model(shape, weights, variant, max_position=most)
                except PKVError as exc:  # e.g. kernels=flashinfer where flashinfer does not import
                    progress.write(f"kernels {variant}: {exc}")
                    saver.save(rows, done=len(cells) + len(built))
                    progress.update(units[shape.name])
                    continue
                with torch.no_grad():
                    for b, n in cells:
                        rows += _run_cell(ctx, model, shape, b, n, names)
                        _release()
                        saver.save(rows)
                        progress.update(1)
                    for trace in built:
                        rows += _run_trace(ctx, model, shape, trace, names)
                        _release()
                        saver.save(rows)
            del weights, model
            _release()


def with_floors(rows: list[dict], read: float) -> list[dict]:
    """Copies of ``rows`` with read_ceiling_gbps = ``read`` and the step's floors at it: its weight
    bytes, its K/V bytes and their sum, read once at ``read`` GB/s (NaN floors without a ceiling)."""
    out = []
    for row in rows:
        row = {**row, "read_ceiling_gbps": read}
        if read > 0:
            row["weight_floor_us"] = row["weight_bytes"] / (read * 1e3)
            row["kv_floor_us"] = row["kv_bytes"] / (read * 1e3)
            row["floor_us"] = row["weight_floor_us"] + row["kv_floor_us"]
        out.append(row)
    return out


class PartialWriter:
    """Writes ``--out`` and its sidecar after every configuration, so a stopped run keeps its rows.

    ``save(rows)`` writes the rows so far (floors at the ceiling measured before the cases, with
    its rows) and a sidecar whose record says ``complete: false`` and ``configurations: {done,
    total}``; ``finish(rows, after, failed_after)`` writes the whole run (floors at the higher of
    the two ceilings, both ceilings' rows) and ``complete: true``. Each file is replaced atomically
    (persistentkv.io): the sidecar first says this run is under way (before any row is written), and
    each parquet is written before the sidecar that describes it, so a run stopped between the two
    leaves a sidecar that still says partial, never one that calls a partial file complete.
    """

    def __init__(self, out, run_id: str, record: dict, configurations: int, before, failed_before: dict):
        self.out, self.run_id, self.record = out, run_id, dict(record)
        self.total, self.done = int(configurations), 0
        self.before, self.failed_before = list(before), dict(failed_before)
        self._sidecar(complete=False)  # a file left by an earlier run is not this run's, complete or not

    def _sidecar(self, complete: bool):
        from ..provenance import write_sidecar

        record = {**self.record, "complete": complete, "configurations": {"done": self.done, "total": self.total}}
        return write_sidecar(self.out, self.run_id, record)

    def _write(self, rows: list[dict], samples, failures: dict, read: float, complete: bool):
        import pandas as pd

        from ..io import atomic_write_parquet

        rows = with_floors(rows, read) + _ceiling_rows(self.run_id, samples, failures, read)
        frame = pd.DataFrame(rows, columns=list(E2E_COLUMNS)).astype(E2E_COLUMNS)
        atomic_write_parquet(self.out, frame)
        return frame, self._sidecar(complete)

    def save(self, rows: list[dict], done: int = 1):
        """After ``done`` more configurations: the rows so far, marked partial."""
        from ..ceiling import run_read_gbps

        self.done += int(done)
        return self._write(rows, self.before, self.failed_before, run_read_gbps([self.before]), complete=False)

    def stopped(self, rows: list[dict], exc: BaseException):
        """The run stopped on ``exc``: the rows so far, and a partial sidecar that names why (after a
        device fault the rows still come from host memory; the write itself may fail then too, and
        is reported without hiding ``exc``)."""
        from ..ceiling import run_read_gbps

        self.record["stopped_by"] = _one_line(exc) or type(exc).__name__
        try:
            return self._write(rows, self.before, self.failed_before, run_read_gbps([self.before]), complete=False)
        except Exception as write_exc:
            print(f"measure-e2e: could not write the rows after the stop: {_one_line(write_exc)}")
            return None

    def finish(self, rows: list[dict], after, failed_after: dict):
        """The whole run: both ceilings, complete."""
        from ..ceiling import ceiling_gbps, renumbered, run_read_gbps

        after = renumbered(after, 1 + max((s.repeat for s in self.before), default=-1))
        read = run_read_gbps([self.before, after])
        print(f"read ceiling: {ceiling_gbps(self.before):.0f} GB/s before the cases, {ceiling_gbps(after):.0f} "
              f"after; the run's: {read:.0f}")
        self.done = self.total
        return self._write(rows, self.before + after, {**failed_after, **self.failed_before}, read, complete=True)


def _ceiling_rows(run_id: str, samples, failures: dict, read: float) -> list[dict]:
    """The ceilings' samples as rows (backend read-ceiling / copy-ceiling; kv_bytes = bytes moved,
    step_us = the sample's time), or one ``failed`` row for a ceiling that was never measured."""
    measured = {s.backend for s in samples}
    base = {name: None for name in E2E_COLUMNS}
    base.update(run_id=run_id, experiment=EXPERIMENT, model="", tensor_parallel=1, seed=0, step=0, batch_size=0,
                context=0, total_tokens=0, dtype="", page_size=0, kernels="", follow="", weight_bytes=0,
                mem_estimate_bytes=0, mem_peak_bytes=0, recaptures=0, read_ceiling_gbps=read, reason="",
                status="ok")
    for name in ("attention_us", "non_attention_us", "rest_us", "append_us", "tokens_per_s", "floor_us",
                 "weight_floor_us", "kv_floor_us"):
        base[name] = math.nan
    rows = [{**base, "trace": s.backend, "backend": s.backend, "repeat": s.repeat, "kv_bytes": s.bytes_moved,
             "step_us": s.time_us} for s in samples]
    rows += [{**base, "trace": b, "backend": b, "repeat": -1, "kv_bytes": 0, "step_us": math.nan,
              "status": "failed", "reason": why} for b, why in failures.items() if b not in measured]
    return rows


def summary_table(frame) -> str:
    """Per configuration and backend: median and p99 step, tokens/s, attention's share, the step
    against the best baseline's, the Amdahl prediction from the attention times, and the
    non-attention part against its weight-read floor."""
    from ..names import BASELINES

    ok = frame[(frame["status"] == "ok") & frame["model"].ne("")]
    if ok.empty:
        return "no timed rows"
    keys = ["model", "kernels", "trace", "step", "batch_size", "context"]
    lines = [f"{'model':<16}{'kernels':<11}{'case':<22}{'backend':<22}{'step us':>10}{'p99':>10}{'tok/s':>10}"
             f"{'attn %':>8}{'vs best':>9}{'Amdahl':>8}{'rest/floor':>11}"]
    for key, cell in ok.groupby(keys, sort=False):
        med = cell.groupby("backend", sort=False).agg(step=("step_us", "median"), attn=("attention_us", "median"),
                                                       p99=("step_us", lambda s: s.quantile(0.99)),
                                                       tok=("tokens_per_s", "median"),
                                                       rest=("non_attention_us", "median"),
                                                       floor=("weight_floor_us", "first"))
        base = med[med.index.isin(BASELINES)]
        best = base["step"].idxmin() if not base.empty else None
        case = f"{key[4]}x{key[5]}" if key[2] == "cases" else f"{key[2]}@{key[3]}"
        for backend, m in med.iterrows():
            vs = amdahl = math.nan
            if best is not None:
                b = med.loc[best]
                vs = b["step"] / m["step"]
                amdahl = b["step"] / (b["step"] - b["attn"] + m["attn"])
            lines.append(f"{key[0]:<16}{key[1]:<11}{case:<22}{backend:<22}{m['step']:>10.1f}{m['p99']:>10.1f}"
                         f"{m['tok']:>10.0f}{100 * m['attn'] / m['step']:>8.1f}{vs:>9.3f}{amdahl:>8.3f}"
                         f"{m['floor'] / m['rest'] if m['rest'] > 0 else math.nan:>11.2f}")
    return "\n".join(lines)
