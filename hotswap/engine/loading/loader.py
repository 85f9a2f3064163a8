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
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from hotswap import settings
from hotswap.engine import threads

__all__ = ["Loader", "at_lowest_priority", "gil_handoff_s", "quick_gil_handoff"]

log = logging.getLogger("hotswap")

# A loader with no work for this long lets its thread end (the next task starts another).
_IDLE_EXIT_S = 5.0
_Task = tuple[Callable[..., Any], tuple[Any, ...]]
T = TypeVar("T")

_loaders: weakref.WeakSet[Loader] = weakref.WeakSet()
_loaders_lock = threading.Lock()


def gil_handoff_s() -> float:
    """The switch interval hotswap sets while it loads (``HOTSWAP_SWITCH_INTERVAL_S``)."""
    return settings.switch_interval_s()


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

    threads.start(run, name="hotswap-low-priority").join()
    if errors:
        raise errors[0]
    return results[0]


class Loader:
    """One daemon thread at a time that runs loads and swaps in order, with the quick GIL
    handoff on while it has work. The thread ends once it has had no work for
    ``idle_exit_s`` (or when ``stop_all`` finds it idle); the next ``submit`` starts another,
    so a process with many coordinators keeps no thread for each (threads.py counts them for
    ``hotswap.shutdown()``).

    Not a ThreadPoolExecutor: those threads are joined at interpreter exit, so exiting would
    wait for a load nobody will use. A daemon thread is simply dropped.
    """

    def __init__(self, name: str = "hotswap-load", idle_exit_s: float = _IDLE_EXIT_S) -> None:
        self._name, self._idle_exit_s = name, idle_exit_s
        # None in the queue: "stop once idle" (stop_all)
        self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        with _loaders_lock:
            _loaders.add(self)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        # Under the lock that an idle thread takes to end: a task is either seen by the
        # thread running now or starts a new one.
        with self._lock:
            self._tasks.put((fn, args))
            if self._thread is None:
                self._thread = threads.start(self._run, name=self._name)

    def stop(self) -> None:
        """End the thread once the tasks queued now are done (a later submit starts one)."""
        with self._lock:
            if self._thread is not None:
                self._tasks.put(None)

    @staticmethod
    def stop_all() -> None:
        """``stop()`` every loader of this process (``hotswap.shutdown()``)."""
        with _loaders_lock:
            loaders = list(_loaders)
        for loader in loaders:
            loader.stop()

    def _run(self) -> None:
        while True:
            try:  # idle: the user's switch interval is on
                task = self._tasks.get(timeout=self._idle_exit_s)
            except queue.Empty:
                task = None
            stopped = task is None  # idle for idle_exit_s, or told to stop
            if task is not None:
                with quick_gil_handoff:
                    while task is not None:
                        fn, args = task
                        try:
                            fn(*args)
                        except Exception:  # tasks record their own failures; a last resort
                            log.exception("hotswap loader task %r failed", fn)
                        # Idle, this thread must not keep the last task's graph and artifact.
                        task = fn = args = None  # type: ignore[assignment]
                        try:
                            task = self._tasks.get_nowait()
                        except queue.Empty:
                            break
                        stopped = task is None
            if stopped:
                with self._lock:
                    if self._tasks.empty():
                        self._thread = None
                        return
