"""The loader thread: where artifacts load and swap in, beside the user's calls.

A first load in a process is Python-heavy (inductor's runtime modules import, the artifact
unpickles, kernels load): about a second of interpreter time on a thread of the user's process.
Python hands its interpreter lock (GIL) to a waiting thread only after the switch interval
(5 ms by default), and every torch op a user call runs releases the GIL and takes it back: so
while the loader ran, each op could wait 5 ms, and an eager 9-op MLP call on CPU went from
1 ms to 60-250 ms. While the loader has work, hotswap lowers the process's switch interval
(``HOTSWAP_SWITCH_INTERVAL_S``, default 0.2 ms) so a waiting caller gets the GIL back within
that, and puts the user's value back once the loader is idle.

Work that mostly waits on the OS (hashing torch's or triton's sources, the driver's start)
runs ``at_lowest_priority`` (niceness 19 and, on Linux, ``SCHED_IDLE``):
its processes then yield the CPU to the user's threads. Not loads themselves: a low-priority
thread that holds the GIL leaves the user's threads waiting for it to be scheduled again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from hotswap._env import env_number

__all__ = ["Loader", "at_lowest_priority", "gil_handoff_s", "quick_gil_handoff"]

log = logging.getLogger("hotswap")

_DEFAULT_SWITCH_INTERVAL_S = 2e-4
_Task = tuple[Callable[..., Any], tuple[Any, ...]]
T = TypeVar("T")


def gil_handoff_s() -> float:
    """The switch interval hotswap sets while it loads (``HOTSWAP_SWITCH_INTERVAL_S``)."""
    value = env_number("HOTSWAP_SWITCH_INTERVAL_S", float, lambda v: 0 < v <= 1,
                       "a number of seconds in (0, 1]", default=_DEFAULT_SWITCH_INTERVAL_S)
    assert value is not None
    return value


class _QuickHandoff:
    """``with quick_gil_handoff:`` from any number of threads: the first one in lowers the
    switch interval, the last one out puts the earlier value back, unless someone changed it
    in between (their value stays)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._saved = self._ours = 0.0

    def __enter__(self) -> None:
        with self._lock:
            if self._depth == 0:
                self._saved = sys.getswitchinterval()
                sys.setswitchinterval(min(self._saved, gil_handoff_s()))
                self._ours = sys.getswitchinterval()
            self._depth += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0 and sys.getswitchinterval() == self._ours:
                sys.setswitchinterval(self._saved)

    @property
    def active(self) -> bool:
        return self._depth > 0


quick_gil_handoff = _QuickHandoff()


def at_lowest_priority(fn: Callable[[], T]) -> T:
    """Run ``fn`` on a thread of its own at niceness 19 and under ``SCHED_IDLE``, which the
    processes it starts inherit (Linux: both are per thread; elsewhere ``fn`` just runs). Only
    for work that mostly waits on subprocesses: a low-priority thread that holds the GIL would
    hold up the user's threads."""
    results: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        with contextlib.suppress(OSError, AttributeError):
            os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
        try:
            results.append(fn())
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=run, name="hotswap-low-priority", daemon=True)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return results[0]


class Loader:
    """One daemon thread that runs loads and swaps in order, with the quick GIL handoff on
    while it has work.

    Not a ThreadPoolExecutor: those threads are joined at interpreter exit, so exiting would
    wait for a load nobody will use. A daemon thread is simply dropped.
    """

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue[_Task] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hotswap-load",
                                                daemon=True)
                self._thread.start()
        self._tasks.put((fn, args))

    def _run(self) -> None:
        while True:
            task: _Task | None = self._tasks.get()  # idle: the user's switch interval is on
            with quick_gil_handoff:
                while task is not None:
                    fn, args = task
                    try:
                        fn(*args)
                    except Exception:  # tasks record their own failures; this is a last resort
                        log.exception("hotswap loader task %r failed", fn)
                    # Idle, this thread must not keep the last task's graph and artifact alive.
                    task = fn = args = None  # type: ignore[assignment]
                    try:
                        task = self._tasks.get_nowait()
                    except queue.Empty:
                        task = None
