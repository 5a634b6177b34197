"""Where the full decode step's time goes (development; GPU).

    python benchmarks/step_probe.py [--model llama3_8b] [--cell 1x4096] [--rounds 15]
        [--parts linears,kernels,steps,evict,maps,ctas,paired] [--kernels flashinfer,pkv] [--steps 8b:1x4096,...]
        [--backends pkv-workqueue,pkv-workqueue:warps=8,...] [--traced] [--out DIR]

Its parts run in one process, on the model shapes of config/config.yaml (seeded random weights,
random K/V, as ``persistentkv measure-e2e`` builds them); --kernels names the loop's kernel
choices compared (persistentkv.model.Kernels):

  linears    each projection of the step (qkv, o, gate_up, down over the model's layers, and
             lm_head; gate_up+silu: the MLP's first half with its activation) at B=1 as each
             kernel choice runs it (Kernels.linear, Kernels.gate_up_silu), one CUDA graph of one
             call per layer's weights (weights stream from HBM, as in the step), the choices'
             graphs replayed in interleaved rounds: us per call and the fraction of the weight
             bytes' read-ceiling time.
  kernels    one step of --cell under torch.profiler per kernel choice: GPU time per kernel
             name, summed over the step, beside the graph-replayed step.
  steps      the whole graph-replayed step (pkv-workqueue attention) of each --steps cell
             (model:BxN, model a config model key or 8b / 70b) under each kernel choice, one
             cache and one set of rows shared by the choices' graphs, replayed in interleaved
             rounds: step us, the step without attention (rest-<choice>), and its
             attention alone after each layer's append (attention; appends: those alone).
  evict      per --steps cell and --backends backend: attention alone as measure-e2e times it,
             the same with a 256 MB read between each layer's append and its call (each minus
             its graph without the calls), and the step minus the step without attention: does
             the step's weight stream, evicting the attention's other reads from L2, explain
             what attention costs in a step beyond its time alone?
  ctas       per --steps cell, pkv-workqueue's attention in the CTA-traced module
             (benchmarks/trace_cta.py's stamps) inside the graph-replayed step and alone (each
             layer's append, then the call), --rounds // 3 replays of each: per layer call, when
             its first CTA entered after the previous call's last exit, its release, loop and
             tail, and the SM that finished last. Where does attention's in-step cost leave its
             time alone? (Writes its own step_probe_ctas_HHMMSS.parquet, one row per CTA.)
  maps       per --steps cell and --backends backend: attention alone as measure-e2e times it,
             with a no-op kernel of k CTAs between each layer's append and its call (k in
             MAP_SHIFTS; 0: none), each minus its graph without the calls. The hardware places a
             kernel's CTAs on SMs in an order that depends on the kernels before it; the no-op
             moves that order and nothing else. With --backends' pkv-workqueue, the traced
             module's placement of each k (the SM of item 0, and the most loaded 16-SM block of
             SM ids over the mean). Does attention's time depend on where its CTAs land?

  paired     per --steps cell, every --backends backend's loop on one cache, all their graphs
             replayed in the same rotated rounds: each backend's step, and its attention alone
             after each layer's append (``alone``: that graph minus the appends alone), so two
             variants of one backend compare per round inside the step.

Files of benchmarks/runs/ written by this script may hold parts and arms it does not run (part
``pdl``; cuBLASLt in ``linears``; pkv-unfused and pkv-pdl in ``steps``; ``name~nosignal`` in
``paired``): benchmarks/NOTES.md says what each measured and which of its rows read them.

Writes step_probe_HHMMSS.parquet to --out ($OUT) after each part: part, cell, variant, name,
repeat, us, bytes, read_gbps.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "benchmarks")]

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from persistentkv.measure.schedule import round_order  # noqa: E402
from persistentkv.measure.steps import AttentionAlone, add_alone_graphs, time_rounds  # noqa: E402

CONFIG = ROOT / "config" / "config.yaml"


def write(rows, out, stem):
    path = Path(out) / f"{stem}.parquet"
    pd.DataFrame(rows).to_parquet(path.with_suffix(".tmp"), index=False)
    os.replace(path.with_suffix(".tmp"), path)


def build(model_name, batch_size, context, seed=0):
    import torch

    from persistentkv import configuration
    from persistentkv.model import Model, PagedKV, model_shape
    from persistentkv.model.shape import pages_for

    config = configuration.load_config(str(CONFIG))
    shape = model_shape(config, model_name)
    P = int(config["spec"]["page_size"])
    weights = cached_weights(config, shape, seed)
    model = Model(shape, weights, kernels="auto", max_position=context + 64)
    reserve = context + 64
    kv = PagedKV(shape, batch_size * pages_for(reserve, P), P, weights.embed.dtype, "cuda", seed=seed)
    kv.fill_random(seed)
    torch.cuda.synchronize()
    return shape, model, kv, reserve


build.cache = {}


def cached_weights(config, shape, seed=0):
    """The seeded random weights of ``shape`` (config's dtype, on the GPU), made once per model
    and kept in build.cache (part_steps and part_evict drop the other models' first)."""
    from persistentkv.env import torch_dtype
    from persistentkv.model import random_weights

    weights = build.cache.get(shape.name)
    if weights is None:
        weights = build.cache[shape.name] = random_weights(shape, torch_dtype(config["spec"]["dtype"]), "cuda", seed)
    return weights


def admit_all(loop, batch_size, context, reserve, vocab):
    tokens = np.random.default_rng(0).integers(0, vocab, batch_size)
    for rid in range(batch_size):
        loop.admit(rid, context - 1, int(tokens[rid]), reserve)


def cuda():
    """The GPU as the measurement harness drives it (persistentkv.measure.device.TorchDevice)."""
    from persistentkv.measure.device import TorchDevice

    if cuda.device is None:
        cuda.device = TorchDevice("cuda")
    return cuda.device


cuda.device = None


def timed(order_of, replays, rounds, before=None):
    """[{key: us}] per round: ``replays[key]()`` for each key of ``order_of(r)``, each between two
    CUDA events and synchronised after (persistentkv.measure.steps.time_rounds), ``before(key)``
    ahead of its window."""
    return time_rounds(cuda(), order_of, replays, rounds, before=before, sync_each=True)


def captured(fn):
    """fn() once eagerly, then a CUDA graph of it (persistentkv.measure.device.capture_graph),
    replayed once; returns the graph's replay."""
    import torch

    from persistentkv.measure.device import capture_graph

    replay = capture_graph(fn, warmup=fn)
    replay()
    torch.cuda.synchronize()
    return replay


def loop_graph(loop, mark, what):
    """The loop's graph of ``what`` (DecodeLoop.capture) from ``mark``, taken out of the loop so a
    later capture of the same name does not replace it; returns its replay."""
    loop.rewind(mark)
    loop.capture(what)
    return loop._graphs.pop(what)


def part_linears(model_name, rounds, ceiling, kernels, rows):
    import torch

    from persistentkv.model import Kernels

    shape, model, kv, _ = build(model_name, 1, 64)
    w = model.weights
    x = torch.randn((1, shape.hidden_size), device="cuda", dtype=w.embed.dtype)
    xi = torch.randn((1, shape.intermediate_size), device="cuda", dtype=w.embed.dtype)
    xa = torch.randn((1, shape.num_heads * shape.head_dim), device="cuda", dtype=w.embed.dtype)
    # name: (weights stacked over layers, the call on one layer's weights)
    mats = {"qkv": (w.qkv, lambda K, m: K.linear(x, m)),
            "o": (w.o, lambda K, m: K.linear(xa, m)),
            "gate_up": (w.gate_up, lambda K, m: K.linear(x, m)),
            "gate_up+silu": (w.gate_up, lambda K, m: K.gate_up_silu(x, m)),
            "down": (w.down, lambda K, m: K.linear(xi, m)),
            "lm_head": (w.lm_head[None], lambda K, m: K.linear(x, m))}
    for name, (stack, op) in mats.items():
        replays = {}
        for variant in kernels:
            K = Kernels(variant, shape, "cuda", 64)
            outs = [None] * stack.shape[0]

            def calls(K=K, op=op, outs=outs):
                for l in range(stack.shape[0]):
                    outs[l] = op(K, stack[l])

            replays[variant] = captured(calls)
        nbytes = stack[0].numel() * stack.element_size()
        for r, times in enumerate(timed(lambda r: round_order(kernels, r), replays, rounds)):
            for variant, us in times.items():
                rows.append(dict(part="linears", cell="1", variant=variant, name=name, repeat=r,
                                 us=us / stack.shape[0], bytes=nbytes, read_gbps=ceiling))
        for variant in kernels:
            med = np.median([r["us"] for r in rows if r["part"] == "linears" and r["variant"] == variant
                             and r["name"] == name])
            print(f"linear {name} [{tuple(stack.shape[1:])}] {variant}: {med:.1f} us per call, "
                  f"{nbytes / (med * 1e3) / ceiling:.3f} of the read ceiling")
        del replays
        torch.cuda.synchronize()


MODEL_KEYS = {"8b": "llama3_8b", "70b": "llama3_70b_tp8"}


def part_steps(cells, rounds, kernels, rows):
    """Each cell's graph-replayed step under each kernel choice, and the same step without its
    attention (``rest-<choice>``), then the attention alone after each layer's append
    (``attention``) and those appends alone (``appends``), as measure-e2e times them."""
    import torch

    from persistentkv.model import DecodeLoop, Kernels

    for model_key, (b, n) in cells:
        model_name = MODEL_KEYS.get(model_key, model_key)
        for other in [m for m in build.cache if m != model_name]:   # one model's weights at a time
            del build.cache[other]
        torch.cuda.empty_cache()
        shape, model, kv, reserve = build(model_name, b, n)
        loop = DecodeLoop(model, kv, "pkv-workqueue")
        add_alone_graphs(loop)
        admit_all(loop, b, n, reserve, shape.vocab_size)
        loop.next_tokens()
        mark = loop.mark()
        graphs = {}
        for variant in kernels:   # one loop and cache; each choice's graphs captured into their own
            model.kernels = Kernels(variant, shape, "cuda", reserve + 64)
            for what, label in (("step", variant), ("rest", f"rest-{variant}")):
                graphs[label] = loop_graph(loop, mark, what)
        for what in ("attention", "appends"):
            graphs[what] = loop_graph(loop, mark, what)
        order = list(graphs)
        label = f"{model_key}:{b}x{n}"
        for r, times in enumerate(timed(lambda r: round_order(order, r), graphs, rounds,
                                        before=lambda _: loop.rewind(mark))):
            for variant, us in times.items():
                rows.append(dict(part="steps", cell=label, variant=variant, name="step", repeat=r, us=us))
        meds = {v: np.median([x["us"] for x in rows if x["part"] == "steps" and x["cell"] == label
                              and x["variant"] == v]) for v in order}
        print(f"step {label}: " + ", ".join(f"{v} {us:.0f} us" for v, us in meds.items()))
        del graphs, loop, kv, model
        torch.cuda.empty_cache()


def part_evict(cells, rounds, backends, rows, evict_mb=256):
    """Is attention slower in a step because the step's weights evict what it reads besides K/V
    from L2 (plan, page ids, counters)? Per cell and backend, the attention-alone graph as
    measure-e2e times it (per layer: append, attention) and the same with a read of ``evict_mb``
    MB of other memory between the append and the call (``+evict``), each minus its own graph
    without the calls; and the step minus the step without attention (``in-step``). A cell is
    ``model:BxN`` (equal rows) or ``model:trace@step`` (a timed step of a config trace, reached as
    measure-e2e reaches it: every backend's loop on one cache, following the timed steps before it)."""
    import torch

    from persistentkv.model import DecodeLoop

    flush = torch.empty(evict_mb << 20 >> 1, dtype=torch.float16, device="cuda").normal_()
    sink = torch.empty(1024, dtype=torch.float32, device="cuda")
    for model_key, where in cells:
        model_name = MODEL_KEYS.get(model_key, model_key)
        for other in [m for m in build.cache if m != model_name]:
            del build.cache[other]
        torch.cuda.empty_cache()
        if isinstance(where, str):   # trace@step
            label = f"{model_key}:{where}"
            with torch.no_grad():
                shape, model, kv, loops = trace_loops(model_name, where, backends)
                for backend, loop in loops.items():
                    _evict_times(loop, label, backend, shape, rounds, rows, flush, sink)
            del loops
        else:
            b, n = where
            shape, model, kv, reserve = build(model_name, b, n)
            label = f"{model_key}:{b}x{n}"
            for backend in backends:
                loop = DecodeLoop(model, kv, backend_of(backend))
                admit_all(loop, b, n, reserve, shape.vocab_size)
                loop.next_tokens()
                _evict_times(loop, label, backend, shape, rounds, rows, flush, sink)
                del loop
                torch.cuda.empty_cache()
        del kv, model
        torch.cuda.empty_cache()


def trace_loops(model_name, where, backends):
    """(shape, model, kv, {backend: loop}) at trace step ``name@index`` of config/config.yaml, as
    measure-e2e reaches it (its cache size and seed, and each timed step before it followed)."""
    from persistentkv import configuration, traces
    from persistentkv.commands.measure_e2e import _loops, trace_first_token, trace_layout
    from persistentkv.model import Model, PagedKV, model_shape

    config = configuration.load_config(str(CONFIG))
    name, at = where.split("@")
    trace = traces.build(configuration.trace_entry(config, name), configuration.calibration_seed(config))
    shape, P = model_shape(config, model_name), int(config["spec"]["page_size"])
    timed, reserve, live = trace_layout(trace, int(config["measure"]["step_stride"]), False, P)
    upto = [s for s in timed if s.index <= int(at)]
    assert upto and upto[-1].index == int(at), f"{name}@{at} is not a timed step ({[s.index for s in timed]})"
    weights = cached_weights(config, shape)
    model = Model(shape, weights, kernels="auto", max_position=max(reserve.values()) + 64)
    kv = PagedKV(shape, live, P, weights.embed.dtype, "cuda", seed=trace.seed)
    kv.fill_random(trace.seed)
    first_token = functools.partial(trace_first_token, vocab=shape.vocab_size)
    made = [backend_of(b) for b in backends]
    loops, refused = _loops(model, kv, made,
                            lambda loop: loop.follow(upto[0].request_ids, upto[0].lengths, reserve, first_token), print)
    assert not refused, refused
    loops = {label: loops[m] for label, m in zip(backends, made)}
    for step in upto[1:]:
        for loop in loops.values():
            loop.follow(step.request_ids, step.lengths, reserve, first_token)
    print(f"{where}: B={upto[-1].batch_size}, lengths {list(upto[-1].lengths)}", flush=True)
    return shape, model, kv, loops


def each_cell_loops(cells, backends, body):
    """``body(label, shape, {backend: loop})`` for each (model key, where) of ``cells``, every
    backend's loop on one cache (loops_of), with autograd off. The other models' cached weights go
    first, and no reference to a cell's loops or cache outlives it, so the next cell's cache is
    allocated after this one's is freed."""
    import torch

    for model_key, where in cells:
        model_name = MODEL_KEYS.get(model_key, model_key)
        for other in [m for m in build.cache if m != model_name]:
            del build.cache[other]
        torch.cuda.empty_cache()
        label = f"{model_key}:{where}" if isinstance(where, str) else f"{model_key}:{where[0]}x{where[1]}"
        with torch.no_grad():
            shape, model, kv, loops = loops_of(model_name, where, backends)
            body(label, shape, loops)
        del loops, kv, model
        torch.cuda.empty_cache()


def each_cell_loop(cells, backends, body):
    """``body(label, backend, shape, loop)`` for each cell and each backend (parts maps and ctas),
    as each_cell_loops gives them."""
    def each_backend(label, shape, loops):
        for backend in list(loops):
            body(label, backend, shape, loops[backend])

    each_cell_loops(cells, backends, each_backend)


def loops_of(model_name, where, backends):
    """(shape, model, kv, {backend: loop}) at a trace step (``name@index``, trace_loops) or at
    (B, N) equal rows, every backend's loop on one cache."""
    from persistentkv.model import DecodeLoop

    if isinstance(where, str):
        return trace_loops(model_name, where, backends)
    shape, model, kv, reserve = build(model_name, *where)
    loops = {}
    for backend in backends:
        loops[backend] = DecodeLoop(model, kv, backend_of(backend))
        admit_all(loops[backend], where[0], where[1], reserve, shape.vocab_size)
        loops[backend].next_tokens()
    return shape, model, kv, loops


def backend_of(spec: str):
    """A backend from ``name`` or ``name:key=value[+key=value...]`` (int values), e.g.
    ``pkv-workqueue:warps=8`` or ``pkv-workqueue:warps=4+target_items=528``."""
    from persistentkv.backends import registry

    name, _, options = spec.partition(":")
    pairs = [option.split("=") for option in options.split("+") if option]
    return registry.create(name, **{key: int(value) for key, value in pairs})


def _between_times(loop, part, label, backend, shape, rounds, rows, betweens):
    """Attention alone as measure-e2e times it (per layer: append, then the call) with
    ``betweens[name]()`` (None: nothing) queued between each append and its call, each minus the
    same graph without the calls (rows ``name``), and the step minus the step without attention
    (``in-step``; ``step``, ``rest``): every graph of one loop replayed in rotated rounds.
    Returns the medians by name, and the graphs' replays by (attention, name)."""
    mark = loop.mark()
    alone = AttentionAlone(loop)
    graphs = {}
    for what in ("step", "rest"):
        graphs[what] = loop_graph(loop, mark, what)
    for name, between in betweens.items():
        for attention in (True, False):
            loop.rewind(mark)
            graphs[(attention, name)] = captured(lambda a=attention, b=between: alone(a, b))
    order = list(graphs)
    for r, us in enumerate(timed(lambda r: round_order(order, r), graphs, rounds, before=lambda _: loop.rewind(mark))):
        named = [(name, us[(True, name)] - us[(False, name)]) for name in betweens]
        named += [("in-step", us["step"] - us["rest"]), ("step", us["step"]), ("rest", us["rest"])]
        for name, value in named:
            rows.append(dict(part=part, cell=label, variant=backend, name=name, repeat=r, us=value))
    loop.rewind(mark)
    return {nm: np.median([x["us"] for x in rows if x["part"] == part and x["cell"] == label
                           and x["variant"] == backend and x["name"] == nm])
            for nm in list(betweens) + ["in-step", "step"]}, graphs


def _evict_times(loop, label, backend, shape, rounds, rows, flush, sink):
    """part_evict's graphs of one loop (rows: alone, alone+evict, in-step, step, rest)."""
    import torch

    def evict():
        torch.sum(flush.view(-1, 1024), dim=0, dtype=torch.float32, out=sink)

    meds, _ = _between_times(loop, "evict", label, backend, shape, rounds, rows,
                             {"alone": None, "alone+evict": evict})
    print(f"evict {label} {backend}: " + ", ".join(f"{k} {v:.0f} us" for k, v in meds.items()), flush=True)


def part_paired(cells, rounds, backends, rows, written=lambda: None):
    """part paired (module docstring): rows ``step`` and ``alone`` per backend; printed: medians,
    and each backend's step over the first one's, the median of the per-round ratios.
    ``written()`` after each cell (the rows so far to disk)."""
    def body(label, shape, loops):
        marks = {b: loop.mark() for b, loop in loops.items()}
        alone = {b: AttentionAlone(loop) for b, loop in loops.items()}
        graphs = {}
        for backend, loop in loops.items():
            graphs[(backend, "step")] = loop_graph(loop, marks[backend], "step")
            loop.rewind(marks[backend])
            graphs[(backend, "alone")] = captured(alone[backend])
        first = next(iter(loops))
        loops[first].rewind(marks[first])
        graphs[(first, "appends")] = captured(lambda: alone[first](attention=False))
        order = list(graphs)
        for r, us in enumerate(timed(lambda r: round_order(order, r), graphs, rounds,
                                     before=lambda key: loops[key[0]].rewind(marks[key[0]]))):
            for backend in loops:
                rows.append(dict(part="paired", cell=label, variant=backend, name="step", repeat=r,
                                 us=us[(backend, "step")]))
                rows.append(dict(part="paired", cell=label, variant=backend, name="alone", repeat=r,
                                 us=us[(backend, "alone")] - us[(first, "appends")]))
        for backend in loops:
            loops[backend].rewind(marks[backend])
        frame = pd.DataFrame([x for x in rows if x["part"] == "paired" and x["cell"] == label])
        step = frame[frame.name == "step"].pivot(index="repeat", columns="variant", values="us")
        alone = frame[frame.name == "alone"].groupby("variant").us.median()
        print(f"paired {label}: " + "; ".join(
            f"{b} step {step[b].median():.0f} us ({(step[b] / step[first]).median():.4f}), alone {alone[b]:.0f}"
            for b in loops), flush=True)
        written()

    each_cell_loops(cells, backends, body)


#: part maps' no-op kernels: CTAs launched between each layer's append and its attention call
MAP_SHIFTS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 33, 66)


def part_maps(cells, rounds, backends, rows):
    """part maps (module docstring): rows name ``map<k>`` (attention alone after a k-CTA no-op),
    ``in-step`` and ``step``; printed: each k's median, its SM placement where traced."""
    import cupy
    import torch

    nop = cupy.RawKernel(r'''extern "C" __global__ void pkv_nop(int* p) {
        if (p[0] == 12345 && threadIdx.x == 0) p[1] = blockIdx.x; }''', "pkv_nop")
    flag = torch.zeros(2, dtype=torch.int32, device="cuda")
    flag_cp = cupy.asarray(flag)

    def no_op(k):
        if k:
            with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                nop((k,), (32,), (flag_cp,))

    for k in MAP_SHIFTS:
        no_op(k)
    torch.cuda.synchronize()
    each_cell_loop(cells, backends, lambda label, backend, shape, loop:
                   _map_times(loop, label, backend, shape, rounds, rows, no_op))


def _map_times(loop, label, backend, shape, rounds, rows, no_op):
    mark = loop.mark()
    betweens = {f"map{k}": (functools.partial(no_op, k) if k else None) for k in MAP_SHIFTS}
    meds, replays = _between_times(loop, "maps", label, backend, shape, rounds, rows, betweens)
    graphs = {(True, k): replays[(True, f"map{k}")] for k in MAP_SHIFTS}
    placed = _map_placements(graphs, shape, loop, mark) if backend.split(":")[0] == "pkv-workqueue" else {}
    print(f"maps {label} {backend}: " + ", ".join(
        f"{k} {v:.0f} us" + (f" (item 0 on SM {placed[k][0]}, 16-SM block {placed[k][1]:.3f})" if k in placed else "")
        for k, v in meds.items() if k != "step"), flush=True)


def _map_placements(graphs, shape, loop, mark):
    """{map<k>: (SM of item 0, most loaded 16-SM block of SM ids over the mean)} from one replay
    of each k's graph, where the module is the traced one (--traced); else {}."""
    import torch

    from trace_cta import read_trace, records_frame, reset_trace

    placed = {}
    for shift in MAP_SHIFTS if TRACED else ():
        loop.rewind(mark)
        for engine in TRACED.values():
            reset_trace(engine)
        graphs[(True, shift)]()
        torch.cuda.synchronize()
        rec = max((read_trace(e) for e in TRACED.values()), key=len)
        if not len(rec) or len(rec) % shape.num_layers:
            continue
        df = records_frame(rec, len(rec) // shape.num_layers, "", 0)
        df = df[df.call == 1]
        blocks = df.groupby(df.sm // 16).tokens.sum()
        placed[f"map{shift}"] = (int(df[df.slot == 0].sm.iloc[0]), float(blocks.max() / blocks.mean()))
    loop.rewind(mark)
    return placed


#: the traced DecodeEngines by (spec, options), once use_traced_module() has run
TRACED: dict = {}


def use_traced_module() -> dict:
    """Every pkv engine made from here on is the CTA-traced module (benchmarks/trace_cta.py's
    stamps); returns the engines made so, by (spec, options)."""
    from persistentkv.backends import pkv as pkv_backend
    from persistentkv.engine import DecodeEngine

    def traced_engine_for(spec, **options):
        key = (spec, tuple(sorted(options.items())))
        if key not in TRACED:
            TRACED[key] = DecodeEngine(spec, trace=True, **options)
        return TRACED[key]

    pkv_backend.engine_for = traced_engine_for
    return TRACED


def part_ctas(cells, rounds, backends, out, stem):
    """part ctas (module docstring), for the pkv-workqueue variants in ``backends``. Every pkv
    engine made from here on is the traced module."""
    traced = use_traced_module()
    backends = [b for b in backends if b.split(":")[0] == "pkv-workqueue"]
    frames, summary = [], []

    def body(cell, backend, shape, loop):
        label = f"{cell} {backend}"
        frames.extend(_cta_frames(loop, shape, label, rounds, traced, summary))
        table = pd.concat(summary)
        med = table[table.case == label].groupby("where").median(numeric_only=True)
        print(f"ctas {label}: medians over layer calls (us)\n{med.round(2).to_string()}", flush=True)
        pd.concat(frames).to_parquet(Path(out) / f"{stem.replace('step_probe', 'step_probe_ctas')}.parquet",
                                     index=False)

    each_cell_loop(cells, backends, body)


def _cta_frames(loop, shape, label, rounds, traced, summary):
    """One loop's traced step and attention-alone graphs, replayed in alternating order: the CTA
    records of each replay (rows appended to ``summary`` per layer call)."""
    import torch

    from trace_cta import read_trace, records_frame, reset_trace

    mark = loop.mark()
    graphs = {"in-step": loop_graph(loop, mark, "step")}
    loop.rewind(mark)
    graphs["alone"] = captured(AttentionAlone(loop))
    L, frames = shape.num_layers, []
    for r in range(max(1, rounds // 3)):
        for what in round_order(graphs, r):  # two graphs: each leads every other round
            loop.rewind(mark)
            for engine in traced.values():
                reset_trace(engine)
            graphs[what]()
            torch.cuda.synchronize()
            rec = max((read_trace(e) for e in traced.values()), key=len)
            if not len(rec) or len(rec) % L:
                print(f"ctas {label} {what}: {len(rec)} records, not a multiple of {L} layers; skipped")
                continue
            df = records_frame(rec, len(rec) // L, label, 0)
            t0 = df.ns_entry.min()
            for c in [c for c in df.columns if c.startswith("ns_")]:
                df[c] = (df[c] - t0).where(df[c] > 0, -1).astype(np.int32)
            df = df[["case", "call", "sm", "slot", "tokens", "merged"] + [c for c in df.columns if c.startswith("ns_")]]
            df["where"], df["repeat"] = what, r
            frames.append(df)
            summary.append(_cta_calls(df, label, what, r))
    loop.rewind(mark)
    return frames


def _cta_calls(df, label, where, repeat):
    """One row per layer call: its CTAs' phases in us (module docstring's part ctas)."""
    rows = []
    calls = sorted(df.call.unique())
    for k in calls:
        cur = df[df.call == k]
        entry, rel, done, end = cur.ns_entry.min(), cur.ns_released.min(), cur.ns_loop.max(), cur.ns_exit.max()
        last_sm = int(cur.loc[cur.ns_exit.idxmax(), "sm"])
        per_sm = cur.groupby("sm").tokens.sum()
        rate = cur.tokens / ((cur.ns_loop - cur.ns_first).clip(lower=1) / 1e3)
        prev_exit = df[df.call == k - 1].ns_exit.max() if k > 0 else np.nan
        rows.append(dict(case=label, where=where, repeat=repeat, call=k, items=len(cur),
                         before=(entry - prev_exit) / 1e3, span=(end - entry) / 1e3,
                         release=(rel - entry) / 1e3, first=float(np.median(cur.ns_first - rel)) / 1e3,
                         loop=(done - rel) / 1e3, spread=(done - cur.ns_loop.min()) / 1e3,
                         tail=(end - done) / 1e3, skew=(cur.ns_released.max() - rel) / 1e3,
                         last_sm_tokens=float(per_sm.get(last_sm, 0)), max_sm_tokens=float(per_sm.max()),
                         mean_sm_tokens=float(per_sm.mean()), sms=len(per_sm),
                         cta_tokens_per_us=float(np.median(rate))))
    return pd.DataFrame(rows)


def part_kernels(model_name, cell, variant, rows):
    import torch
    from torch.profiler import ProfilerActivity, profile

    from persistentkv.model import DecodeLoop, Kernels

    b, n = cell
    shape, model, kv, reserve = build(model_name, b, n)
    model.kernels = Kernels(variant, shape, "cuda", reserve + 64)
    loop = DecodeLoop(model, kv, "pkv-workqueue")
    admit_all(loop, b, n, reserve, shape.vocab_size)
    loop.next_tokens()
    mark = loop.mark()
    for _ in range(3):
        loop.rewind(mark)
        loop.step()
    torch.cuda.synchronize()
    loop.rewind(mark)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        loop.step()
        torch.cuda.synchronize()
    total = 0.0
    for ev in prof.key_averages():
        us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        if us <= 0:
            continue
        total += us
        rows.append(dict(part="kernels", cell=f"{b}x{n}", variant=f"eager-{variant}", name=ev.key,
                         repeat=int(ev.count), us=us))
    loop.rewind(mark)
    loop.capture("step")
    times = [us["step"] for us in timed(lambda r: ["step"], {"step": lambda: loop.replay("step")}, 15,
                                        before=lambda _: loop.rewind(mark))]
    rows.append(dict(part="kernels", cell=f"{b}x{n}", variant=f"graph-{variant}", name="step", repeat=15,
                     us=float(np.median(times))))
    top = sorted((r for r in rows if r["part"] == "kernels" and r["variant"] == f"eager-{variant}"),
                 key=lambda r: -r["us"])
    print(f"kernels of one {b}x{n} step ({variant}): GPU time {total:.0f} us summed over kernels, graph-replayed step "
          f"{np.median(times):.0f} us")
    for r in top[:25]:
        print(f"  {r['us']:9.1f} us  x{r['repeat']:<4d} {r['name'][:110]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3_8b")
    parser.add_argument("--cell", default="1x4096")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--parts", default="linears,kernels")
    parser.add_argument("--kernels", default="flashinfer,pkv", help="kernel choices compared (comma list)")
    parser.add_argument("--steps", default="8b:1x4096,8b:1x32768,8b:16x32768,70b:1x32768,70b:8x32768",
                        help="the cells of parts steps (model:BxN), evict, maps, ctas and paired (also model:trace@step)")
    parser.add_argument("--backends", default="pkv-workqueue,flashinfer-tc,vllm-fa3",
                        help="the attention backends of parts evict, maps and paired (comma list; ctas takes its "
                             "pkv-workqueue ones)")
    parser.add_argument("--traced", action="store_true",
                        help="every part's pkv engines are the CTA-traced module (part maps then prints placements)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    if args.traced:
        use_traced_module()
    cell = tuple(int(x) for x in args.cell.split("x"))
    parts = args.parts.split(",")
    kernels = args.kernels.split(",")
    steps = [(c.split(":")[0], c.split(":")[1] if "@" in c else tuple(int(x) for x in c.split(":")[1].split("x")))
             for c in args.steps.split(",")]
    from persistentkv.ceiling import ceiling_gbps, measure_ceilings
    from persistentkv.measure.device import TorchDevice

    ceiling = ceiling_gbps(measure_ceilings(TorchDevice("cuda"), repeats=3, log=print)[0])
    print(f"read ceiling {ceiling:.0f} GB/s")
    stem = time.strftime("step_probe_%H%M%S")
    rows: list[dict] = []
    if "linears" in parts:
        part_linears(args.model, args.rounds, ceiling, kernels, rows)
        write(rows, args.out, stem)
    if "kernels" in parts:
        for variant in kernels:
            part_kernels(args.model, cell, variant, rows)
            write(rows, args.out, stem)
    if "steps" in parts:
        if any(isinstance(where, str) for _, where in steps):
            parser.error("--parts steps takes model:BxN cells only (model:trace@step is for --parts evict)")
        part_steps(steps, args.rounds, kernels, rows)
        write(rows, args.out, stem)
    if "evict" in parts:
        part_evict(steps, args.rounds, args.backends.split(","), rows)
        write(rows, args.out, stem)
    if "maps" in parts:
        part_maps(steps, args.rounds, args.backends.split(","), rows)
        write(rows, args.out, stem)
    if "paired" in parts:
        part_paired(steps, args.rounds, args.backends.split(","), rows, lambda: write(rows, args.out, stem))
    if "ctas" in parts:  # last: it makes every pkv engine the traced module
        part_ctas(steps, args.rounds, args.backends.split(","), args.out, stem)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
