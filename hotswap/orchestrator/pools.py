"""The process-wide pools of compile workers the coordinators share, and how they are set up."""

from __future__ import annotations

import atexit
import os
import threading

from hotswap._env import env_number
from hotswap.orchestrator.compat import inductor_cache_dir
from hotswap.workers import WorkerPool
from hotswap.workers.pool import default_workers

__all__ = ["shared_pool"]

_pools: dict[int | None, WorkerPool] = {}
_pools_lock = threading.Lock()


def shared_pool(workers: int | None = None) -> WorkerPool:
    """The process-wide pool of compile workers (one per requested size), started and warming."""
    with _pools_lock:
        pool = _pools.get(workers)
        if pool is None:
            size = workers or default_workers()
            # Inductor's own parallel compile would put several processes per worker on a few
            # cores; share the cores out instead, unless the user chose.
            threads = str(max(1, (os.cpu_count() or 1) // size))
            env = {} if "TORCHINDUCTOR_COMPILE_THREADS" in os.environ else {
                "TORCHINDUCTOR_COMPILE_THREADS": threads}
            # Workers get a TMPDIR of their own (workers/scratch.py); inductor's default cache
            # lives under the temporary directory, so pin it to the caller's: one cache for all.
            env["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache_dir()
            nice, idle = worker_priority()
            pool = WorkerPool(size, worker_env=env, nice=nice, idle=idle,
                              rss_limit_bytes=_rss_limit(), warm_modules=(
                "torch", "torch._inductor.compile_fx",
                "hotswap.orchestrator.compile_job:warm_device",
                "hotswap.orchestrator.compile_job:warm_compile"))
            pool.start()
            _pools[workers] = pool
        return pool


def worker_priority() -> tuple[int, bool]:
    """The compile workers' (niceness, SCHED_IDLE), from the environment or the defaults."""
    return _worker_nice(), _worker_idle()


def _worker_nice() -> int:
    """Compile workers yield the CPU to the user's process: niceness 19 (the lowest priority:
    a worker gets what the user's threads leave) unless HOTSWAP_WORKER_NICE says otherwise
    (0 keeps the caller's priority)."""
    nice = env_number("HOTSWAP_WORKER_NICE", int, lambda v: 0 <= v <= 19,
                      "a whole number from 0 to 19", default=19)
    assert nice is not None
    return nice


def _worker_idle() -> bool:
    """Compile workers run under ``SCHED_IDLE`` (Linux): a core they use is the user's again
    the moment one of the user's threads wakes on it. HOTSWAP_WORKER_IDLE=0 turns it off."""
    return env_number("HOTSWAP_WORKER_IDLE", int, lambda v: v in (0, 1), "0 or 1",
                      default=1) == 1


def _rss_limit() -> int | None:
    """A worker whose memory passes HOTSWAP_WORKER_RSS_LIMIT_BYTES is killed and its job fails
    with MemoryLimitExceeded (default: no limit)."""
    return env_number("HOTSWAP_WORKER_RSS_LIMIT_BYTES", int, lambda v: v > 0,
                      "a number of bytes > 0")


@atexit.register
def _shutdown_pools() -> None:
    with _pools_lock:
        pools = list(_pools.values())
        _pools.clear()
    for pool in pools:
        pool.terminate()
