"""Whole decode steps under the clock: the attention-alone graphs and rounds of captured graphs.

``persistentkv measure-e2e`` and benchmarks/step_probe.py time CUDA graphs of decode loops
(persistentkv.model.DecodeLoop, a layer above this one: nothing here imports it; a loop is taken
by its public pieces):

    AttentionAlone(loop)     the step's attention alone, each layer's call after that layer's
                             append (on fixed, seeded q, k, v), the plan's refresh first; called
                             with ``attention=False``: those appends alone, what is subtracted
    add_alone_graphs(loop)   the loop's ``attention`` and ``appends`` graphs from it
    capture_missing(loops)   capture each loop's ROUND graphs that are not ready
    time_rounds(...)         replays in rounds of a given order, each between two device events
    time_loop_rounds(...)    measure-e2e's rounds: the loops rotated (schedule.round_order), each
                             replaying its ROUND graphs, each round queued behind a GPU spin

What a loop gives: for a body, ``rows``, ``model.shape``, ``model.dtype``, ``kv.device``,
``refresh(plan)``, ``slots()``, ``append(layer, slots, k, v)``, ``attend(layer, q)`` and its
``out``; for its graphs, ``add_graph(name, body)``, ``capture(what)``, ``graph_ready(what)``,
``replay(what)``, ``mark()`` and ``rewind(marked)``.
"""

from __future__ import annotations

import functools
from typing import Callable

from .rows import one_line
from .schedule import round_order

#: The graphs of a round, in the order each loop replays them: the appends right before the
#: attention they are subtracted from.
ROUND = ("step", "rest", "appends", "attention")

#: GPU cycles of the spin queued before each round (~1 ms at the H200's 1.98 GHz): the round's
#: first graph then starts behind it, not after the host's launch of it. Without it the first
#: loop of a round has the host's launch of its step graph inside its window: ~150 us of its
#: step_us (benchmarks/NOTES.md, "What ships", the rotated rounds row).
ROUND_QUEUE_CYCLES = 2_000_000


class AttentionAlone:
    """The step's attention alone over ``loop``'s rows, as measure-e2e times it.

    A call, at the loop's prepared state (after its ``next_tokens()``, a step or a replay), runs,
    per layer, the append of fixed k, v [B, Hkv, D] into every row's next slot
    (which the next step's append overwrites before anything reads it), then, with
    ``attention``, that layer's call on a fixed q [B, Hq, D] (positions do not advance): every
    call follows the kernel it follows in the step. With ``attention`` the plan's refresh comes
    first; without it (the appends alone) the lengths are not refreshed into the plan either, as
    the step without attention leaves them. ``between()``, if given, runs between each append
    and its call (benchmarks/step_probe.py's parts evict and maps).
    """

    def __init__(self, loop):
        self.loop = loop
        self.probe = None

    def inputs(self):
        """(q, k, v), standard normals seeded 0 on the loop's device, made again when the batch's
        size changes (the same values for the same size)."""
        import torch

        loop = self.loop
        B = len(loop.rows)
        if self.probe is None or self.probe[0].shape[0] != B:
            s = loop.model.shape
            gen = torch.Generator(device=loop.kv.device)
            gen.manual_seed(0)
            self.probe = tuple(torch.randn((B, h, s.head_dim), generator=gen, device=loop.kv.device,
                                           dtype=loop.model.dtype)
                               for h in (s.num_heads, s.num_kv_heads, s.num_kv_heads))
        return self.probe

    def __call__(self, attention: bool = True, between: Callable[[], None] | None = None) -> None:
        loop = self.loop
        q, k, v = self.inputs()
        if attention:
            loop.refresh()
        slots = loop.slots()
        for l in range(loop.model.shape.num_layers):
            loop.append(l, slots, k, v)
            if between is not None:
                between()
            if attention:
                loop.attend(l, q)


def add_alone_graphs(loop) -> AttentionAlone:
    """Give ``loop`` its ``attention`` and ``appends`` graphs (ROUND); returns their body."""
    alone = AttentionAlone(loop)
    loop.add_graph("attention", alone)
    loop.add_graph("appends", functools.partial(alone, attention=False))
    return alone


def capture_missing(loops: dict, graphs=ROUND) -> dict[str, str]:
    """Capture each loop's ``graphs`` where they are not ready; a loop whose capture fails leaves
    ``loops`` and is returned with the reason ({name: one line})."""
    failed = {}
    for name, loop in list(loops.items()):
        try:
            for what in graphs:
                if not loop.graph_ready(what):
                    loop.capture(what)
        except Exception as exc:
            failed[name] = one_line(exc)
            del loops[name]
    return failed


def time_rounds(device, order_of: Callable[[int], list], replays: dict, rounds: int, warmup: int = 0,
                before: Callable[[object], None] | None = None, queue_cycles: int = 0,
                sync_each: bool = False) -> list[dict]:
    """{key: us} of each recorded round: ``warmup`` rounds run and dropped, then ``rounds``.

    Round r replays ``replays[key]()`` for each key of ``order_of(r)`` in turn, each between two
    ``device.event()`` records, ``before(key)`` ahead of its window (a rewind); the round starts
    behind ``device.queue_ahead(queue_cycles)`` (0: none) and ends in one synchronisation
    (``sync_each``: one after every replay as well, so nothing queues ahead of the next).
    """
    recorded = []
    for r in range(warmup + rounds):
        if queue_cycles:
            device.queue_ahead(queue_cycles)
        events = {}
        for key in order_of(r):
            if before is not None:
                before(key)
            start, end = device.event(), device.event()
            start.record()
            replays[key]()
            end.record()
            if sync_each:
                device.synchronize()
            events[key] = (start, end)
        device.synchronize()
        if r >= warmup:
            recorded.append({key: start.elapsed_ms(end) * 1e3 for key, (start, end) in events.items()})
    return recorded


def time_loop_rounds(device, loops: dict, marks: dict, rounds: int, warmup: int) -> dict[str, list[dict[str, float]]]:
    """{name: [{graph: us} per recorded round]} of every ROUND graph of each loop: rounds
    interleave the loops, rotated (schedule.round_order), each loop rewound to ``marks[name]``
    before each of its graphs, each round queued behind a spin of ROUND_QUEUE_CYCLES."""
    replays = {(name, what): functools.partial(loop.replay, what) for name, loop in loops.items() for what in ROUND}
    timed = time_rounds(device, lambda r: [(name, what) for name in round_order(loops, r) for what in ROUND],
                        replays, rounds, warmup, before=lambda key: loops[key[0]].rewind(marks[key[0]]),
                        queue_cycles=ROUND_QUEUE_CYCLES)
    return {name: [{what: us[(name, what)] for what in ROUND} for us in timed] for name in loops}
