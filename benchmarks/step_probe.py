"""Where the full decode step's time goes (development; GPU).

    python benchmarks/step_probe.py [--model llama3_8b] [--cell 1x4096] [--rounds 15] [--out DIR]

Two parts, one process, on the model shapes of config/config.yaml (seeded random weights,
random K/V, as ``persistentkv measure-e2e`` builds them):

  linears    each projection of the step (qkv, o, gate_up, down over the model's layers, and
             lm_head) at B=1 as F.linear runs it, one CUDA graph of one call per layer's weights
             (weights stream from HBM, as in the step), under torch's default BLAS library and
             under cuBLASLt (torch.backends.cuda.preferred_blas_library): us per call and the
             fraction of the weight bytes' read-ceiling time.
  kernels    one step of --cell under torch.profiler: GPU time per kernel name, summed over
             the step, beside the graph-replayed step.

Up to 3153ad5 a third part timed the step with the engine's programmatic-dependent-launch
variants (runs/step_probe_b3dd932.parquet, part ``pdl``): they lost to the plain launch there,
and PDL left the engine (benchmarks/NOTES.md, "Tried and rejected").

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
    parser.add_argument("--cell", default="1x4096")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--parts", default="linears,kernels")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    cell = tuple(int(x) for x in args.cell.split("x"))
    parts = args.parts.split(",")
    from persistentkv.ceiling import ceiling_gbps, measure_ceilings
    from persistentkv.measure.device import TorchDevice

    ceiling = ceiling_gbps(measure_ceilings(TorchDevice("cuda"), repeats=3, log=print)[0])
    print(f"read ceiling {ceiling:.0f} GB/s")
    stem = time.strftime("step_probe_%H%M%S")
    rows: list[dict] = []
    if "kernels" in parts:
        part_kernels(args.model, cell, rows)
        write(rows, args.out, stem)
    if "linears" in parts:
        part_linears(args.model, args.rounds, ceiling, rows)
        write(rows, args.out, stem)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
