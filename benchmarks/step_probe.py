"""Where the full decode step's time goes, and what PDL does inside it (development; GPU).

    python benchmarks/step_probe.py [--model llama3_8b] [--cells 1x4096,1x32768,16x32768]
                                    [--rounds 15] [--out DIR]

Three parts, one process, on the model shapes of config/config.yaml (seeded random weights,
random K/V, as ``persistentkv measure-e2e`` builds them):

  pdl        the step graph of the GPU-planned queue (at the warps pkv-workqueue picks for the
             cell) with PDL and early K/V (``pdl-kv``, what pkv-workqueue ships), PDL with only
             the item and page ids read early (``pdl-ids``), and without PDL (``nopdl``), replayed
             in interleaved rounds: the step's us per round.
  linears    each projection of the step (qkv, o, gate_up, down over the model's layers, and
             lm_head) at B=1 as F.linear runs it, one CUDA graph of one call per layer's weights
             (weights stream from HBM, as in the step), under torch's default BLAS library and
             under cuBLASLt (torch.backends.cuda.preferred_blas_library): us per call and the
             fraction of the weight bytes' read-ceiling time.
  kernels    one B=1 step (the first cell's context) under torch.profiler: GPU time per kernel
             name, summed over the step, beside the graph-replayed step.

Writes step_probe_HHMMSS.parquet to --out ($OUT) after each part: part, cell, variant, name,
repeat, us, bytes, read_gbps.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "benchmarks")]

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

CONFIG = ROOT / "config" / "config.yaml"


class Queue:
    """The GPU-planned queue on an engine with ``pdl`` and ``early_kv`` (measure_e2e's EngineWorkqueue,
    with early K/V as a switch too)."""

    graph_safe = True

    def __init__(self, name, warps, pdl, early_kv):
        self.name, self.warps, self.pdl, self.early_kv = name, warps, pdl, early_kv

    def unavailable(self, spec):
        return []

    def plan(self, batch):
        from persistentkv.engine import engine_for

        return engine_for(batch.spec, warps=self.warps, pdl=self.pdl, early_kv=self.early_kv).plan(batch, "workqueue")

    def run(self, q, cache, plan, out):
        plan.engine.run(q, cache, plan, out)


def write(rows, out, stem):
    path = Path(out) / f"{stem}.parquet"
    pd.DataFrame(rows).to_parquet(path.with_suffix(".tmp"), index=False)
    os.replace(path.with_suffix(".tmp"), path)


def build(model_name, batch_size, context, seed=0):
    import torch

    from persistentkv import configuration
    from persistentkv.env import torch_dtype
    from persistentkv.model import Model, PagedKV, model_shape, random_weights
    from persistentkv.model.shape import pages_for

    config = configuration.load_config(str(CONFIG))
    shape = model_shape(config, model_name)
    P = int(config["spec"]["page_size"])
    weights = build.cache.get(model_name)
    if weights is None:
        weights = build.cache[model_name] = random_weights(shape, torch_dtype(config["spec"]["dtype"]), "cuda", seed)
    model = Model(shape, weights, kernels="auto", max_position=context + 64)
    reserve = context + 64
    kv = PagedKV(shape, batch_size * pages_for(reserve, P), P, weights.embed.dtype, "cuda", seed=seed)
    kv.fill_random(seed)
    torch.cuda.synchronize()
    return shape, model, kv, reserve


build.cache = {}


def admit_all(loop, batch_size, context, reserve, vocab):
    tokens = np.random.default_rng(0).integers(0, vocab, batch_size)
    for rid in range(batch_size):
        loop.admit(rid, context - 1, int(tokens[rid]), reserve)


def part_pdl(model_name, cells, rounds, rows):
    import torch

    from persistentkv.commands.measure_e2e import _time_rounds
    from persistentkv.model import DecodeLoop

    for b, n in cells:
        shape, model, kv, reserve = build(model_name, b, n)
        shipped = DecodeLoop(model, kv, "pkv-workqueue")
        admit_all(shipped, b, n, reserve, shape.vocab_size)
        shipped.next_tokens()
        warps = shipped.plan.warps
        loops = {}
        for name, pdl, early in (("pdl-kv", True, True), ("pdl-ids", True, False), ("nopdl", False, False)):
            loop = DecodeLoop(model, kv, Queue(name, warps, pdl, early))
            admit_all(loop, b, n, reserve, shape.vocab_size)
            loop.next_tokens()
            loop.capture("step")
            loop.capture("attention")
            loops[name] = loop
        marks = {name: loop.mark() for name, loop in loops.items()}
        times = _time_rounds(loops, rounds, 2, marks)
        for name, pairs in times.items():
            for r, (step_us, attn_us) in enumerate(pairs):
                rows.append(dict(part="pdl", cell=f"{b}x{n}", variant=name, name="step", repeat=r, us=step_us))
                rows.append(dict(part="pdl", cell=f"{b}x{n}", variant=name, name="attention", repeat=r, us=attn_us))
        med = {k: np.median([s for s, _ in v]) for k, v in times.items()}
        print(f"pdl {model_name} {b}x{n} (warps {warps}): " +
              ", ".join(f"{k} {v:.1f} us" for k, v in med.items()) +
              f"; pdl-kv / nopdl {med['pdl-kv'] / med['nopdl']:.4f}, pdl-ids / nopdl {med['pdl-ids'] / med['nopdl']:.4f}")
        del loops, shipped, kv
        torch.cuda.empty_cache()


def part_linears(model_name, rounds, ceiling, rows):
    import torch
    import torch.nn.functional as F

    shape, model, kv, _ = build(model_name, 1, 64)
    w = model.weights
    x = torch.randn((1, shape.hidden_size), device="cuda", dtype=w.embed.dtype)
    xi = torch.randn((1, shape.intermediate_size), device="cuda", dtype=w.embed.dtype)
    xa = torch.randn((1, shape.num_heads * shape.head_dim), device="cuda", dtype=w.embed.dtype)
    mats = {"qkv": (w.qkv, x), "o": (w.o, xa), "gate_up": (w.gate_up, x), "down": (w.down, xi),
            "lm_head": (w.lm_head[None], x)}
    for lib in ("default", "cublaslt"):
        torch.backends.cuda.preferred_blas_library("cublaslt" if lib == "cublaslt" else "default")
        for name, (stack, inp) in mats.items():
            outs = [None] * stack.shape[0]
            for l in range(stack.shape[0]):
                outs[l] = F.linear(inp, stack[l])
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for l in range(stack.shape[0]):
                    outs[l] = F.linear(inp, stack[l])
            graph.replay()
            torch.cuda.synchronize()
            nbytes = stack[0].numel() * stack.element_size()
            for r in range(rounds):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                graph.replay()
                e.record()
                torch.cuda.synchronize()
                us = s.elapsed_time(e) * 1e3 / stack.shape[0]
                rows.append(dict(part="linears", cell="1", variant=lib, name=name, repeat=r, us=us, bytes=nbytes,
                                 read_gbps=ceiling))
            med = np.median([r["us"] for r in rows if r["part"] == "linears" and r["variant"] == lib
                             and r["name"] == name])
            print(f"linear {name} [{tuple(stack.shape[1:])}] {lib}: {med:.1f} us per call, "
                  f"{nbytes / (med * 1e3) / ceiling:.3f} of the read ceiling")
    torch.backends.cuda.preferred_blas_library("default")


def part_kernels(model_name, cell, rows):
    import torch
    from torch.profiler import ProfilerActivity, profile

    from persistentkv.model import DecodeLoop

    b, n = cell
    shape, model, kv, reserve = build(model_name, b, n)
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
        rows.append(dict(part="kernels", cell=f"{b}x{n}", variant="eager", name=ev.key, repeat=int(ev.count), us=us))
    loop.rewind(mark)
    loop.capture("step")
    times = []
    for _ in range(15):
        loop.rewind(mark)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        loop.replay("step")
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    rows.append(dict(part="kernels", cell=f"{b}x{n}", variant="graph", name="step", repeat=15, us=float(np.median(times))))
    top = sorted((r for r in rows if r["part"] == "kernels" and r["variant"] == "eager"), key=lambda r: -r["us"])
    print(f"kernels of one {b}x{n} step: GPU time {total:.0f} us summed over kernels, graph-replayed step "
          f"{np.median(times):.0f} us")
    for r in top[:25]:
        print(f"  {r['us']:9.1f} us  x{r['repeat']:<4d} {r['name'][:110]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3_8b")
    parser.add_argument("--cells", default="1x4096,1x32768,16x32768")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--parts", default="pdl,linears,kernels")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    cells = [tuple(int(x) for x in c.split("x")) for c in args.cells.split(",")]
    parts = args.parts.split(",")
    from persistentkv.ceiling import ceiling_gbps, measure_ceilings
    from persistentkv.measure.device import TorchDevice

    ceiling = ceiling_gbps(measure_ceilings(TorchDevice("cuda"), repeats=3, log=print)[0])
    print(f"read ceiling {ceiling:.0f} GB/s")
    stem = time.strftime("step_probe_%H%M%S")
    rows: list[dict] = []
    if "kernels" in parts:
        part_kernels(args.model, cells[0], rows)
        write(rows, args.out, stem)
    if "linears" in parts:
        part_linears(args.model, args.rounds, ceiling, rows)
        write(rows, args.out, stem)
    if "pdl" in parts:
        part_pdl(args.model, cells, args.rounds, rows)
        write(rows, args.out, stem)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
