"""What hotswap runs in this process beside the user's code: the compile workers.

``hotswap.runtime()`` is the one process-wide ``Runtime``, a facade over the executors
(hotswap.executors): the local worker pools (``executors.local.pools``: one per worker count,
``workers=None`` being the default count, so it shares the pool of that many) and every
executor the registry opened (a cluster). Tools read it (worker pids, restarts) instead of
reaching into pools; ``hotswap.shutdown()`` (and interpreter exit) stops it. A compile after a
shutdown starts fresh workers.
"""

from __future__ import annotations

import atexit
import logging
import time
from collections.abc import Callable
from typing import Any

from hotswap.counting import bump
from hotswap.engine import threads
from hotswap.engine.sources.compilers import Compiler, ExecutorCompiler
from hotswap.executors import registry
from hotswap.executors.local import (
    idle_exit_s,
    key,
    pools,
    rss_limit,
    visible_devices,
    worker_priority,
)
from hotswap.workers import WorkerPool

__all__ = ["SHUTDOWN_JOIN_S", "Runtime", "idle_exit_s", "rss_limit", "runtime",
           "visible_devices", "worker_priority"]

log = logging.getLogger("hotswap")

# How long shutdown() waits for hotswap's threads: a load under way (seconds for a big graph),
# a gate measurement due on a timer (up to half a minute for a busy machine's retries).
SHUTDOWN_JOIN_S = 10.0

# Executors count remote compiles and jobs sent home in hotswap.counters().
registry.count_with(bump)


class Runtime:
    """The process's worker pools and executors. Thread-safe."""

    def compiler(self, workers: int | None = None, devices: tuple[str, ...] = (),
                 executor: Any = None) -> Compiler:
        """What compiles a tier now: the pool of ``workers`` (on ``devices``), or the
        executor of the spec ``executor`` with that pool behind it, in every installed
        middleware (``registry.wrap``)."""
        return ExecutorCompiler(registry.resolve(executor, workers=workers, devices=devices))

    def wrap_compiler(self, wrap: Callable[[Any], Any]) -> Callable[[], None]:
        """``registry.wrap``: wrap every executor resolved from now on (``wrap(executor)``
        returns the executor to use); returns the function that removes the wrapper."""
        return registry.wrap(wrap)

    def cluster(self, executor: Any) -> Any:
        """The connection behind the executor spec ``executor`` (an address or a
        distributed.Client: a ``hotswap.fleet.Cluster``), made on first use and shared by
        every coordinator of this process."""
        return getattr(registry.connect(executor), "cluster", None)

    def pool(self, workers: int | None = None, devices: tuple[str, ...] = ()) -> WorkerPool:
        """The pool of ``workers`` compile workers (None: the default count) on ``devices``
        (worker_devices), started and warming. Malformed HOTSWAP_* settings for workers, and
        devices this machine lacks, raise ValueError here."""
        return pools.pool(key(workers, devices))

    def pools(self) -> list[WorkerPool]:
        return pools.pools()

    def settled(self, workers: int | None = None, devices: tuple[str, ...] = ()) -> None:
        """Every graph of a backend that warmed that pool is final (``LocalPools.settled``)."""
        try:
            size = key(workers, devices)
        except ValueError:  # malformed settings: the pool was never started
            return
        pools.settled(size)

    def release_idle(self) -> None:
        """``torch.compiler.reset()``: the local pools' workers exit once idle for a short
        while (``LocalPools.release_idle``)."""
        pools.release_idle()

    def worker_pids(self) -> list[int]:
        """Every compile worker running now."""
        return [pid for pool in self.pools() for pid in pool.worker_pids()]

    def cpu_note(self, workers: int | None = None, devices: tuple[str, ...] = ()) -> str:
        """Why that pool's jobs wait on CPU, where they do (``WorkerPool.cpu_note``); "" when
        it is not running."""
        pool = pools.running(key(workers, devices))
        return pool.cpu_note() if pool is not None else ""

    def priority_note(self, workers: int | None = None, devices: tuple[str, ...] = ()) -> str:
        """How that pool's workers yield the CPU ("cgroup v1 cpu.idle", "autogroup +
        SCHED_IDLE": ``WorkerPool.priority_note``); "" when it is not running."""
        pool = pools.running(key(workers, devices))
        return pool.priority_note() if pool is not None else ""

    @property
    def restarts(self) -> int:
        """Workers replaced after dying (crash, kill, time or memory limit), in all pools."""
        return sum(pool.restarts for pool in self.pools())

    @property
    def worker_priority(self) -> tuple[int, bool]:
        """(niceness, SCHED_IDLE) compile workers start at (HOTSWAP_WORKER_NICE/_IDLE)."""
        return worker_priority()

    def finish_profile(self, directory: str) -> str:
        """Close this process's profile in ``directory`` (``profile_dir``); the path of its
        records file ("" if nothing was recorded)."""
        from hotswap.engine.recording import shared_timeline

        timeline = shared_timeline(directory)
        timeline.close()
        return timeline.path or ""

    def shutdown(self, wait: bool = True, timeout_s: float = SHUTDOWN_JOIN_S) -> list[str]:
        """Stop every worker now; jobs still running or queued fail with ``PoolClosed`` (their
        graphs keep the tier they serve). With ``wait``, then wait up to ``timeout_s`` for
        every thread hotswap started (threads.py) to end, once the loads and swaps queued
        by then are done; returns the names of those still running (logged). Safe to call
        twice; later compiles start again."""
        registry.shutdown(wait=wait)
        if not wait:
            return []
        running = _join_threads(timeout_s)
        if running:
            log.warning("hotswap: shutdown() left %d thread(s) running after %.0f s: %s",
                        len(running), timeout_s, ", ".join(running))
        return running


def _join_threads(timeout_s: float) -> list[str]:
    """Stop hotswap's lanes and wait up to ``timeout_s`` for its threads to end; the names of
    those still running then."""
    deadline = time.monotonic() + timeout_s
    while True:
        # Again each round: the pools' failed jobs queue their last steps on the scheduler
        # (which then starts its thread again).
        threads.stop_lanes()
        running = threads.join_all(min(0.2, max(0.0, deadline - time.monotonic())))
        if not running or time.monotonic() >= deadline:
            return running


runtime = Runtime()

# How long interpreter exit waits for hotswap's threads to finish the task in hand.
EXIT_JOIN_S = 2.0


def _at_exit() -> None:
    """Interpreter exit: the workers stop now, and hotswap's threads get up to EXIT_JOIN_S to
    finish the task in hand (and those queued, where they fit): not longer, since a load
    nobody will use is no use. A daemon thread still inside one of torch's calls that let go
    of the GIL when the interpreter finalizes is ended by Python with a forced unwind, which
    pybind11's frames turn into std::terminate (pytorch#38228): a GPU audit process aborted
    at its exit with "terminate called without an active exception" (rc 134), a compile
    still under way and its results printed. Registered as the runtime is imported, after
    the modules it imports, so it runs before their exit handlers (pending stores, temporary
    files, the profile's timeline)."""
    runtime.shutdown(wait=False)
    _join_threads(EXIT_JOIN_S)


atexit.register(_at_exit)
