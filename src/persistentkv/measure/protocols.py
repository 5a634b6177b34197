"""The four timing protocols, each measuring ONE repetition of one backend on one case.

``run_on(copy)`` below stands for ``backend.run(q, copies.pair(copy), plan, out)``: the plan is
made before, as a server makes it once per step. Every call reads the copy the shared cursor
hands out (persistentkv.measure.rotation), so no call finds its K/V warm in L2.

kernel     device time of run() alone: CUDA-graph replays of ``calls_per_graph`` captured calls
           cycling over the copies; time_us = event time of one replay / calls. The replay is
           queued behind a spin of ``kernel_queue_cycles`` GPU cycles (device.queue_ahead) so the
           first event is stamped when the GPU starts the graph, not while the host is still
           submitting it (benchmarks/NOTES.md, "the kernel window"; 0 turns the spin off).
           With ``kernel_separator`` on (the config's default) each captured call follows one
           small copy kernel, the bytes of the step's K/V append, as attention follows the append
           in a decode step: a call launched with programmatic dependent launch (FlashInfer's,
           XQA's) may then start under that kernel's tail, as in a step, but not under the
           previous attention call's, which a step never runs. A graph of ``calls_per_graph``
           separators alone is replayed right before, the same way; time_us is the difference
           per call and separator_us the separators' own time per call.
eager      CUDA events around one Python run() call (plan reused): time_us is the event time,
           host_us the host (CPU) time of the call itself, before any synchronisation. Then
           ``loop_calls`` more calls back to back, as a serving loop makes them (no
           synchronisation between them, each on the next copy): host_loop_us is the host time
           per call of that loop, what a layer's attention costs the CPU in a decode step, and
           host_loop_max_us its longest call (one stall, or every call slower).
step       synchronized wall clock of plan + ``layers`` x run (layers cycling over the copies):
           what one decode step of an L-layer model spends in attention. time_us is the whole
           step; per_layer_us = time_us / layers.
published  the paper's timed region, one layer, CUDA events AND synchronized wall clock of the
           SAME execution: for a baseline (FlashInfer in the paper) wrapper.plan() and the Q gather
           (index_select + contiguous) run inside the window; for our routes the metadata is
           precomputed outside it, as the paper's artifact did.
"""

from __future__ import annotations

import time
from typing import Callable

from ..ceiling import timed_replay_ms
from .rotation import CopyCursor
from .statistics import per_call_us


def kernel_once(device, replays: list[Callable[[], None]], cursor: CopyCursor, calls: int,
                queue_cycles: int = 0, separators: Callable[[], None] | None = None) -> dict:
    """Replay the next graph (``replays[cursor.next_graph()]``) once, timed by
    :func:`timed_replay_ms`. ``separators``: the replay of ``calls`` separator kernels alone
    (module docstring), timed the same way right before; their time per call is subtracted."""
    if separators is None:
        return {"time_us": per_call_us(timed_replay_ms(device, replays[cursor.next_graph()], queue_cycles), calls),
                "layers": 1}
    separator_us = per_call_us(timed_replay_ms(device, separators, queue_cycles), calls)
    both_us = per_call_us(timed_replay_ms(device, replays[cursor.next_graph()], queue_cycles), calls)
    return {"time_us": both_us - separator_us, "separator_us": separator_us, "layers": 1}


def eager_once(device, run_on: Callable[[int], None], cursor: CopyCursor, loop_calls: int = 0) -> dict:
    copy = cursor.next_copy()
    device.synchronize()
    start, end = device.event(), device.event()
    start.record()
    t0 = time.perf_counter()
    run_on(copy)
    host_us = (time.perf_counter() - t0) * 1e6
    end.record()
    device.synchronize()
    fields = {"time_us": start.elapsed_ms(end) * 1e3, "host_us": host_us, "layers": 1}
    if loop_calls > 0:
        calls = timed_calls(run_on, [cursor.next_copy() for _ in range(loop_calls)])
        fields["host_loop_us"] = sum(calls) / loop_calls
        fields["host_loop_max_us"] = max(calls)
        device.synchronize()
    return fields


def timed_calls(fn: Callable[[object], None], args) -> list[float]:
    """Host us of each call ``fn(a)`` for ``a`` in ``args`` (a sequence), made back to back with one
    clock stamp after each: the eager loop's timing, shared with benchmarks/host_overhead.py."""
    clock = time.perf_counter
    stamps = [0.0] * (len(args) + 1)
    stamps[0] = clock()
    for i, a in enumerate(args):
        fn(a)
        stamps[i + 1] = clock()
    return [(b - a) * 1e6 for a, b in zip(stamps, stamps[1:])]


def step_once(device, plan: Callable[[], object], run_on: Callable[[object, int], None], layers: int,
              cursor: CopyCursor) -> dict:
    """plan() once, then ``layers`` calls of run_on(plan, copy); the returned plan is discarded."""
    device.synchronize()
    t0 = time.perf_counter()
    step_plan = plan()
    for _ in range(layers):
        run_on(step_plan, cursor.next_copy())
    device.synchronize()
    wall_us = (time.perf_counter() - t0) * 1e6
    return {"time_us": wall_us, "layers": layers}


def published_once(device, body: Callable[[int], None], cursor: CopyCursor) -> dict:
    """One execution of ``body(copy)`` (plan + Q gather + run, or run alone) inside both windows."""
    copy = cursor.next_copy()
    device.synchronize()
    start, end = device.event(), device.event()
    t0 = time.perf_counter()
    start.record()
    body(copy)
    end.record()
    device.synchronize()
    wall_us = (time.perf_counter() - t0) * 1e6
    return {"time_us": start.elapsed_ms(end) * 1e3, "wall_us": wall_us, "layers": 1}
