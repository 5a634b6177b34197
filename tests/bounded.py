"""``within(seconds)``: a block that must return in time (a hang fails the test, it never stalls
the suite). SIGALRM, so the main thread of a POSIX process only, which is where pytest runs."""

from __future__ import annotations

import signal
from contextlib import contextmanager


@contextmanager
def within(seconds: int):
    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
