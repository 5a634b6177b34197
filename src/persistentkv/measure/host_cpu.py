"""Which CPU the harness's timing thread runs on.

The H200 host is a virtual machine whose 16 vCPUs do not run at one speed. Pinned to each in
turn, one pkv-workqueue run() call took about 6.7 us of host time on some and 10.5 us on others,
and which ones were slow changed within seconds to minutes (benchmarks/host_overhead.py
``--per-cpu``; benchmarks/NOTES.md, "Host: the vCPUs run at two speeds"). Rows timed on the host
(eager, step, the published wall clock) then follow where the OS happens to put the thread, not
the backend.

``measure.host_cpu`` in the config says what the harness does about it:

- ``fastest``: at the start of every round of a case, time a fixed pure-Python workload
  (:func:`probe_us`) on each CPU the process may use, and pin the timing thread to the quickest
  for that round. Every backend of the round then runs on that CPU, so the choice favours none.
- ``none``: leave the OS to place the thread (the rows say -1).
- an integer: pin to that CPU for the whole run.

Each timing row records the CPU (``host_cpu``, -1 when not pinned) and the probe's time there
(``host_probe_us``, NaN when not probed), so the host's state is part of the result
(persistentkv.analysis.pinning sums it up for a set of rows). Only the
calling thread is pinned (Linux affinity is per thread); the CUDA driver's threads stay free.
On a platform without ``os.sched_setaffinity`` ``fastest`` logs once and pins nothing.
"""

from __future__ import annotations

import math
import os
import time
from typing import Callable

from ..errors import PKVError, require

HOST_CPU_CHOICES = ("fastest", "none")


def check_host_cpu(value) -> str | int:
    """``fastest``, ``none`` or a CPU number >= 0; anything else is a PKVError naming the choices."""
    if isinstance(value, bool):
        raise PKVError(f"measure.host_cpu must be one of {', '.join(HOST_CPU_CHOICES)} or a CPU number, got {value!r}")
    if isinstance(value, int):
        require(value >= 0, f"measure.host_cpu must be a CPU number >= 0, got {value}")
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    require(value in HOST_CPU_CHOICES,
            f"measure.host_cpu must be one of {', '.join(HOST_CPU_CHOICES)} or a CPU number, got {value!r}")
    return value


def _probe_work(n: int) -> int:
    """Tuples, a dict and integer arithmetic: the kind of work run()'s host path does."""
    acc, seen = 0, {}
    for i in range(n):
        key = (i, i + 1, i & 3)
        seen[key] = i
        acc += (len(key) + (i ^ acc)) & 7
    return acc + len(seen)


def probe_us(n: int = 1000, repeats: int = 3, clock: Callable[[], float] = time.perf_counter) -> float:
    """The quickest of ``repeats`` timings of the probe workload, in us (about 100 us on a fast core)."""
    best = math.inf
    for _ in range(repeats):
        t0 = clock()
        _probe_work(n)
        best = min(best, (clock() - t0) * 1e6)
    return best


class HostPinner:
    """Pins the calling thread per ``mode`` (module docstring); :meth:`pin` at each round's start
    returns (cpu, probe us there), (-1, nan) when nothing is pinned; :meth:`restore` undoes it."""

    def __init__(self, mode="none", log: Callable[[str], None] = print, probe: Callable[[], float] = probe_us,
                 get_affinity=None, set_affinity=None):
        self.mode = check_host_cpu(mode)
        self.log = log
        self.probe = probe
        self._get = get_affinity or getattr(os, "sched_getaffinity", None)
        self._set = set_affinity or getattr(os, "sched_setaffinity", None)
        self._saved = None
        self.active = self.mode != "none"
        if self.active and (self._get is None or self._set is None):
            log(f"  measure.host_cpu={self.mode}: this platform cannot pin a thread to a CPU; the OS places it")
            self.active = False
        if self.active:
            self._saved = set(self._get(0))
            if isinstance(self.mode, int):
                require(self.mode in self._saved,
                        f"measure.host_cpu={self.mode}: this process may run on CPUs {sorted(self._saved)} only")

    def pin(self) -> tuple[int, float]:
        if not self.active:
            return -1, math.nan
        try:
            if isinstance(self.mode, int):
                self._set(0, {self.mode})
                return self.mode, self.probe()
            times = {}
            for cpu in sorted(self._saved):
                self._set(0, {cpu})
                times[cpu] = self.probe()
            cpu = min(times, key=times.get)
            self._set(0, {cpu})
            return cpu, times[cpu]
        except OSError as exc:  # a CPU taken offline mid-run: carry on unpinned rather than lose the run
            self.log(f"  measure.host_cpu={self.mode}: pinning failed ({exc}); the rest of the run is not pinned")
            self.restore()
            self.active = False
            return -1, math.nan

    def restore(self) -> None:
        if self.active and self._saved is not None:
            self._set(0, self._saved)
