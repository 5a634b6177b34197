"""Host cost of one eager run() call with a reused plan (the issue's budget: < 15 us), taken apart.

    python benchmarks/host_overhead.py [--repeats 20] [--per-cpu P] [--cpu-only] [--out DIR]

For each case (a short kernel, B=1 x 4K, and a long one, B=1 x 128K) and each way of calling it,
times loops of N back-to-back calls that start right after a synchronisation (N = 8: what
bench_kernels' eager rows time; 32: one decode step's layers; 200: a warm steady state) and
reports the host time per call, median over ``--repeats`` loops with its quartiles, and the median
of each loop's longest call (one stall, or every call slower):

- ``run``: engine.run(q, (k, v), plan, out) with the checks' key, the cache alternating between
  two copies as the harness's cold copies do;
- ``run_nocheck``: the same with check=False (what the key costs is the difference);
- ``launch``: the decode launch alone (cuLaunchKernelEx through ctypes, or CuPy's launchKernel),
  its arguments already set: the driver's share;
- each of the three also ``cold``: the host's caches flushed before every loop (a 256 MiB buffer
  written) and the cache rotating over 8 copies, as when bench_kernels' eager loop follows the
  other backends' work;
- ``python_key``: the checks' key built and compared on the host, nothing launched: the host's
  Python speed, comparable across machines (the same work on the development CPU is printed by
  ``--cpu-only``).

``--per-cpu P`` instead pins the timing thread to each CPU in turn (P passes, each in a seeded
shuffled order, plus one unpinned entry per pass) and times ``run`` (B=1 x 4K, loops of 8) and
the harness's CPU probe there: whether the host's slow spells follow the CPU the thread runs on
(a CPU shared with interrupts or with a busy sibling thread) or the time (the host's other
tenants). Each row carries the CPU's core and sibling ids, whether it is local to the GPU, and the
interrupts it served during its loops.

Writes host_overhead_HHMMSS.parquet (host_percpu_HHMMSS.parquet with --per-cpu) to --out ($OUT).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from bench_common import add_out_option, write_rows  # noqa: E402

LOOPS = (8, 32, 200)


def key_of(q, k, v, out, plan, lse=None, k_scale=None, v_scale=None):
    """The key engine.run builds inline (a timing stand-in; tests/test_engine.py checks it is the
    key run() stores)."""
    qs, ks, os_ = q.stride(), k.stride(), out.stride()
    q_ptr, k_ptr, v_ptr, o_ptr = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
    ks_ptr = 0 if k_scale is None else k_scale.data_ptr()
    vs_ptr = 0 if v_scale is None else v_scale.data_ptr()
    return (q.shape, qs, q.dtype, q.device, k.shape, ks, k.dtype, k.device, v.shape, v.stride(), v.dtype,
            v.device, out.shape, os_, out.dtype, out.device, plan[0], plan[1], (q_ptr | o_ptr) & 3,
            (k_ptr | v_ptr) & 15, None if lse is None else (lse.shape, lse.stride(), lse.dtype, lse.device),
            ks_ptr, vs_ptr)


def time_loops(call, sync, repeats: int, loops=LOOPS, before=None) -> dict:
    """{N: [(mean us per call, longest call's us) of each of ``repeats`` loops of N calls, each loop
    started after sync() (and after ``before()``, untimed, when given)]}."""
    from persistentkv.measure.protocols import timed_calls

    samples = {n: [] for n in loops}
    for _ in range(repeats):
        for n in loops:
            if before is not None:
                before()
            sync()
            calls = timed_calls(call, range(n))
            samples[n].append((sum(calls) / n, max(calls)))
    sync()
    return samples


def summarise(samples: dict, **labels) -> list:
    rows = []
    for n, pairs in samples.items():
        xs = sorted(mean for mean, _ in pairs)
        q1, med, q3 = statistics.quantiles(xs, n=4) if len(xs) > 1 else (xs[0],) * 3
        rows.append({**labels, "loop_calls": n, "median_us": med, "q1_us": q1, "q3_us": q3, "min_us": xs[0],
                     "max_call_us": statistics.median(longest for _, longest in pairs), "repeats": len(xs)})
    return rows


def python_key_rows(repeats: int) -> list:
    """The key's cost on CPU tensors (no GPU needed): the host's Python speed."""
    import torch

    q = torch.zeros((1, 32, 128), dtype=torch.float16)
    k = torch.zeros((8, 16, 8, 128), dtype=torch.float16)
    v, out = torch.zeros_like(k), torch.zeros_like(q)
    plan = (1, 8)
    last = key_of(q, k, v, out, plan)
    return summarise(time_loops(lambda i: key_of(q, k, v, out, plan) == last, lambda: None, repeats),
                     case="cpu tensors", mode="python_key")


def cpu_topology() -> dict:
    """{cpu: (core_id, thread_siblings_list)} from sysfs ({} where sysfs does not say)."""
    topo = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        base = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            topo[cpu] = (int((base / "core_id").read_text()), (base / "thread_siblings_list").read_text().strip())
        except OSError:
            topo[cpu] = (-1, "")
    return topo


def parse_cpulist(text: str) -> set:
    """"0-3,8,10-11" -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def gpu_local_cpus(bus_id: str) -> set:
    """CPUs sysfs names local to the GPU at PCI ``bus_id`` (dddd:bb:dd.f; empty where it does not say)."""
    try:
        return parse_cpulist(Path(f"/sys/bus/pci/devices/{bus_id.lower()}/local_cpulist").read_text())
    except OSError:
        return set()


def irq_counts() -> list:
    """Interrupts served so far by each CPU (summed over /proc/interrupts' lines; [] where unreadable)."""
    try:
        lines = Path("/proc/interrupts").read_text().splitlines()
    except OSError:
        return []
    ncpu = len(lines[0].split())
    totals = [0] * ncpu
    for line in lines[1:]:
        fields = line.split()[1:1 + ncpu]
        for i, f in enumerate(fields):
            if f.isdigit():
                totals[i] += int(f)
    return totals


def per_cpu_rows(call, sync, passes: int, repeats: int, local: set, seed: int = 0, probe=None) -> list:
    """``call`` timed in loops of 8 with the thread pinned to each CPU in turn (module docstring),
    each row with ``probe_us``: the harness's CPU probe (persistentkv.measure.host_cpu) there."""
    import random

    if probe is None:
        from persistentkv.measure.host_cpu import probe_us as probe

    cpus = sorted(os.sched_getaffinity(0))
    topo = cpu_topology()
    rng = random.Random(seed)
    rows = []
    try:
        for p in range(passes):
            order = cpus[:]
            rng.shuffle(order)
            for cpu in order + [None]:
                os.sched_setaffinity(0, cpus if cpu is None else {cpu})
                for _ in range(32):  # warm on this CPU
                    call(0)
                sync()
                probed = probe()
                before = irq_counts()
                samples = time_loops(call, sync, repeats, loops=(8,))
                after = irq_counts()
                core, siblings = topo.get(cpu, (-1, "")) if cpu is not None else (-1, "")
                irqs = after[cpu] - before[cpu] if cpu is not None and cpu < len(after) and before else -1
                rows += summarise(samples, case="B=1 x 4K", mode="run_pinned" if cpu is not None else "run_unpinned",
                                  cpu=-1 if cpu is None else cpu, core_id=core, siblings=siblings,
                                  gpu_local=cpu in local if cpu is not None else None, irqs=irqs, pass_=p,
                                  probe_us=probed)
    finally:
        os.sched_setaffinity(0, cpus)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out_option(parser)
    parser.add_argument("--repeats", type=int, default=20, help="loops of each length per case and mode (default 20)")
    parser.add_argument("--cpu-only", action="store_true", help="only the python_key rows (no GPU needed)")
    parser.add_argument("--per-cpu", type=int, default=0, metavar="P",
                        help="P passes of run() pinned to each CPU in turn (see the module docstring)")
    args = parser.parse_args(argv)
    t_start = time.time()
    rows = python_key_rows(args.repeats)
    if args.per_cpu:
        import torch

        from gpu_support import device_case
        from persistentkv.engine import engine_for
        from persistentkv.spec import AttentionSpec

        spec = AttentionSpec(32, 8, 128, 16, "float16")
        batch, q, k, v = device_case(spec, [4096], hole_fraction=0.0)
        pairs = [(k, v), (k.clone(), v.clone())]
        out = torch.empty_like(q)
        engine = engine_for(spec)
        plan = engine.plan(batch, "workqueue")
        props = torch.cuda.get_device_properties(0)
        bus = getattr(props, "pci_bus_id", None)
        bus_id = (f"{getattr(props, 'pci_domain_id', 0):04x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"
                  if isinstance(bus, int) else "")
        local = gpu_local_cpus(bus_id) if bus_id else set()
        print(f"GPU at {bus_id or '?'}; CPUs local to it: {sorted(local) or 'not said'}; topology {cpu_topology()}")
        rows += per_cpu_rows(lambda i: engine.run(q, pairs[i & 1], plan, out), torch.cuda.synchronize,
                             args.per_cpu, args.repeats, local)
    elif not args.cpu_only:
        import torch

        from gpu_support import device_case
        from persistentkv.engine import engine_for
        from persistentkv.spec import AttentionSpec

        spec = AttentionSpec(32, 8, 128, 16, "float16")
        scratch = np.zeros(256 << 20, dtype=np.uint8)

        def flush():
            scratch[::64] += 1  # one write per cache line of 256 MiB: the host's caches hold none of run()'s

        sync = torch.cuda.synchronize
        for case, length in (("B=1 x 4K", 4096), ("B=1 x 128K", 131072)):
            batch, q, k, v = device_case(spec, [length], hole_fraction=0.0)
            pairs = [(k, v)] + [(k.clone(), v.clone()) for _ in range(7)]
            out = torch.empty_like(q)
            engine = engine_for(spec)
            plan = engine.plan(batch, "workqueue")
            engine.run(q, pairs[0], plan, out)
            decode = plan.launches[-1]
            stream = engine._stream()
            launch = lambda i: engine._launch(decode, stream)  # noqa: E731
            modes = {
                "run": lambda i: engine.run(q, pairs[i & 1], plan, out),
                "run_nocheck": lambda i: engine.run(q, pairs[i & 1], plan, out, check=False),
                "launch": launch,
                "run_cold": lambda i: engine.run(q, pairs[i & 7], plan, out),
                "run_nocheck_cold": lambda i: engine.run(q, pairs[i & 7], plan, out, check=False),
                "launch_cold": launch,
            }
            for mode, call in modes.items():
                rows += summarise(time_loops(call, sync, args.repeats, before=flush if "cold" in mode else None),
                                  case=case, mode=mode)
            del pairs, q, k, v, out
            torch.cuda.empty_cache()
    for r in rows:
        where = f" cpu={r['cpu']:3d} pass={r['pass_']}" if "cpu" in r else ""
        print(f"{r['case']:12s} {r['mode']:16s}{where} N={r['loop_calls']:3d}  "
              f"{r['median_us']:7.2f} us per call [{r['q1_us']:.2f}, {r['q3_us']:.2f}]  min {r['min_us']:.2f}  "
              f"longest call {r['max_call_us']:.1f}")
    write_rows(rows, args.out, "host_percpu" if args.per_cpu else "host_overhead", t_start)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
