"""Does a kernel row's window hold host time? (development bench, GPU)

The kernel protocol (persistentkv.measure.protocols.kernel_once) records a CUDA event, launches one
graph of ``calls_per_graph`` calls, records a second event. On an idle stream the first event is
stamped as soon as it is queued, so the window also holds the time the host takes to submit the
graph (cudaGraphLaunch), during which the GPU has nothing to run: a fixed cost per replay that the
kernels did not spend, 1/calls of it charged to each call.

This bench times every backend the way bench-kernels does (its devices, copies, one graph per copy
offset, the shared cursor) in two modes, interleaved in every round:

    as-is    kernel_once's window
    queued   the same, after a spin kernel (torch.cuda._sleep) that keeps the stream busy until
             the graph is queued behind it, so the window starts when the GPU starts the graph

and records the host time of each replay() call. If the window holds host time, ``as-is - queued``
per call is about (host launch time - time the GPU needs to start a queued graph) / calls, the same
for every backend and independent of the case's size.

    python benchmarks/replay_latency.py [--cases 1x1024,1x4096,...] [--repeats 15] [--out DIR]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import bench_args, first_line, load_baselines, parse_cases, write_rows  # noqa: E402

BACKENDS = ("pkv-workqueue", "flashinfer-tc", "flashinfer-cc", "trtllm-xqa", "vllm-fa3")
DEFAULT_CASES = "1x1024,1x4096,1x16384,1x32768,1x131072,4x8192"
#: spin before a queued window: ~100 us at 2 GHz, longer than any graph launch on the host
SPIN_CYCLES = 200_000


def stomped(snapshots: dict, plans: dict, when: str) -> None:
    """--check-plans: exit if any of our plans' metadata (block table, item count, items) differs
    from its copy taken after capture (something wrote into a live plan's memory)."""
    for name, regions in snapshots.items():
        for region, saved in regions.items():
            now = plans[name].view(region)
            if not now.equal(saved):
                differ = int((now != saved).sum())
                print(f"  STOMPED {when}: {name}'s {region} differs in {differ} of {saved.numel()} elements; "
                      f"data_ptr {now.data_ptr():#x}", flush=True)
                raise SystemExit(3)


def engine_options(text: str) -> dict:
    """``early_kv=0,pdl=0`` -> {"early_kv": False, "pdl": False}: DecodeEngine's boolean switches."""
    options = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name not in ("early_kv", "pdl") or value not in ("0", "1"):
            raise SystemExit(f"--engine-options: {item!r} is not early_kv=0|1 or pdl=0|1")
        options[name] = value == "1"
    return options


def engine_with(options: dict) -> None:
    """Every engine our backends make from here on gets ``options`` (persistentkv.engine.engine_for
    is looked up at each call, and its cache keys on the options)."""
    import functools

    from persistentkv import engine

    engine.engine_for = functools.partial(engine.engine_for, **options)


def main() -> None:
    import numpy as np
    import torch

    from persistentkv.cache import make_batch
    from persistentkv.measure.device import TorchDevice
    from persistentkv.measure.rotation import CopyCursor, cold_copies, graph_copies, graph_offsets
    from persistentkv.spec import AttentionSpec

    def options(parser):
        parser.add_argument("--backends", default=",".join(BACKENDS))
        parser.add_argument("--modes", default="as-is,queued", help="which windows to time (as-is, queued)")
        parser.add_argument("--engine-options", default="",
                            help="DecodeEngine options for our backends, e.g. early_kv=0,pdl=0 (booleans as 0/1)")
        parser.add_argument("--check-plans", action="store_true",
                            help="after every replay, check that our plans' metadata is unchanged")

    args = bench_args(options)
    if args.engine_options:
        engine_with(engine_options(args.engine_options))
    calls = args.calls
    spec = AttentionSpec(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype="float16")
    device = TorchDevice("cuda")
    backends = load_baselines(spec, args.backends.split(","))
    t_start, rows = time.time(), []
    rng = np.random.default_rng(0)
    for label, lengths in parse_cases(args.cases or DEFAULT_CASES):
        batch = make_batch(spec, lengths, seed=1)
        n_copies = min(64, cold_copies(batch.kv_bytes, device.l2_bytes, 3.0))
        copies = device.make_copies(batch, n_copies, seed=0)
        q = device.queries(spec, batch.batch_size, seed=0)
        replays, snapshots, plans = {}, {}, {}
        for name, backend in backends.items():
            try:
                out = device.empty_out(spec, batch.batch_size)
                plan = plans[name] = backend.plan(batch)
                backend.run(q, copies.pair(0), plan, out)
                device.synchronize()
                graphs = []
                for offset in graph_offsets(n_copies):
                    chosen = graph_copies(offset, n_copies, calls)

                    def captured(chosen=chosen, b=backend, p=plan, o=out):
                        for c in chosen:
                            b.run(q, copies.pair(c), p, o)

                    graphs.append(device.capture(captured))
                replays[name] = graphs
                if args.check_plans and hasattr(plan, "view"):
                    device.synchronize()
                    snapshots[name] = {r: plan.view(r).clone() for r in ("packed", "num_items", "items")}
            except Exception as exc:
                print(f"  {name}: failed ({first_line(exc)})")
                device.synchronize()
            stomped(snapshots, plans, f"after planning and capturing {name}")
        cursor = CopyCursor(n_copies, calls)
        modes = [m for m in ("as-is", "queued") if m in args.modes.split(",")]
        variants = [(name, mode) for name in replays for mode in modes]
        for rnd in range(args.repeats + 2):
            order = rng.permutation(len(variants))
            for i in order:
                name, mode = variants[i]
                replay = replays[name][cursor.next_graph()]
                start, end = device.event(), device.event()
                if mode == "queued":
                    device.queue_ahead(SPIN_CYCLES)  # the kernel protocol's own spin
                start.record()
                t0 = time.perf_counter()
                replay()
                host_us = (time.perf_counter() - t0) * 1e6
                end.record()
                try:
                    device.synchronize()
                except Exception:
                    print(f"  failed in round {rnd}: {name} {mode} (graph {cursor.position})", flush=True)
                    raise
                stomped(snapshots, plans, f"after round {rnd}'s replay of {name} {mode}")
                if rnd < 2:
                    continue  # warm-up rounds
                rows.append({"case": label, "batch_size": batch.batch_size, "seq_len": int(max(lengths)),
                             "kv_bytes": batch.kv_bytes, "copies": n_copies, "backend": name, "mode": mode,
                             "repeat": rnd - 2, "time_us": start.elapsed_ms(end) * 1e3 / calls,
                             "replay_host_us": host_us})
        write_rows(rows, args.out, "replay_latency", t_start, final=False)
        here = [r for r in rows if r["case"] == label]
        print(f"{label}: {batch.kv_bytes / 1e6:.1f} MB, {n_copies} copies (us per call; host us per replay)")
        for name in replays:
            med = {m: statistics.median(r["time_us"] for r in here if r["backend"] == name and r["mode"] == m)
                   for m in modes}
            host = statistics.median(r["replay_host_us"] for r in here if r["backend"] == name)
            diff = f"  diff {med['as-is'] - med['queued']:6.2f}" if len(med) == 2 else ""
            print(f"  {name:<14} " + "  ".join(f"{m} {t:8.2f}" for m, t in med.items()) + diff
                  + f"  replay host {host:6.1f}")
        replays = copies = None  # free this case's graphs and caches before the next
        torch.cuda.empty_cache()
    write_rows(rows, args.out, "replay_latency", t_start)


if __name__ == "__main__":
    main()
