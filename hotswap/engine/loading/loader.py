"""Work that mostly waits on the OS, at the lowest priority.

Hashing torch's or triton's sources and the driver's start run ``at_lowest_priority``
(niceness 19 and, on Linux, ``SCHED_IDLE``): the processes they start then yield the CPU to
the user's threads. Not loads themselves: a low-priority thread that holds the GIL leaves the
user's threads waiting for it to be scheduled again. Loads run on the scheduler's thread
(threads.py), with the quick GIL handoff on.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import TypeVar

from hotswap.engine import threads

__all__ = ["at_lowest_priority"]

T = TypeVar("T")


def at_lowest_priority(fn: Callable[[], T], *,
                       wanted: Callable[[], bool] = lambda: False) -> T:
    """Run ``fn`` on a thread of its own at niceness 19 and under ``SCHED_IDLE``, which the
    processes it starts inherit (Linux: both are per thread; elsewhere ``fn`` just runs). Only
    for work that mostly waits on subprocesses: a low-priority thread that holds the GIL would
    hold up the user's threads, so it also yields the GIL (``threads.yielding_gil``) until
    ``wanted()``."""
    results: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        with contextlib.suppress(OSError, AttributeError):
            os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
        try:
            with threads.yielding_gil(unless=wanted):
                results.append(fn())
        except BaseException as e:
            errors.append(e)

    threads.start(run, name="hotswap-low-priority").join()
    if errors:
        raise errors[0]
    return results[0]
