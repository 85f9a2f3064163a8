"""What hotswap runs in this process beside the user's code: the compile workers.

``hotswap.runtime()`` is the one process-wide ``Runtime``. Coordinators share its pools, one
per worker count (``workers=None`` is the default count, so it shares the pool of that many);
tools read it (worker pids, restarts) instead of reaching into pools; ``hotswap.shutdown()``
(and interpreter exit) stops it. A compile after a shutdown starts fresh workers.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from hotswap import settings
from hotswap.cache import ArtifactCache
from hotswap.fleet.cluster import Cluster, ClusterCompiler
from hotswap.orchestrator import threads
from hotswap.orchestrator.compilers import Compiler, PoolCompiler
from hotswap.orchestrator.kernel_files import inductor_cache_dir
from hotswap.orchestrator.loader import Loader
from hotswap.workers import JobFuture, WorkerPool
from hotswap.workers.pool import default_workers

__all__ = ["SHUTDOWN_JOIN_S", "Runtime", "idle_exit_s", "rss_limit", "runtime",
           "worker_priority"]

log = logging.getLogger("hotswap")

# How long shutdown() waits for hotswap's threads: a load under way (seconds for a big graph),
# a gate measurement due on a timer (up to half a minute for a busy machine's retries).
SHUTDOWN_JOIN_S = 10.0


class Runtime:
    """The process's worker pools. Thread-safe."""

    def __init__(self) -> None:
        # One pool per (worker count, worker devices).
        self._pools: dict[PoolKey, WorkerPool] = {}
        self._clusters: dict[Any, Cluster] = {}
        self._lock = threading.Lock()
        # Jobs submitted through compiler() and not yet done, and since when a pool that has
        # run jobs has none (idle_exit_s() stops such a pool; the next job starts one).
        self._inflight: dict[PoolKey, int] = {}
        self._idle_since: dict[PoolKey, float] = {}
        self._reaper: threading.Thread | None = None
        self._reaper_stop = threading.Event()  # shutdown(): the reaper ends
        self._compiler_wrappers: list[Callable[[Compiler], Compiler]] = []
        self._read_hooks: list[Callable[[ArtifactCache, str], None]] = []

    def compiler(self, workers: int | None = None, devices: tuple[str, ...] = (),
                 executor: Any = None) -> Compiler:
        """What compiles a tier now: the pool of ``workers`` (on ``devices``), or the cluster
        ``executor`` with that pool behind it, in every installed wrapper."""
        size = _key(workers, devices)
        compiler: Compiler = PoolCompiler(
            lambda job, payload, timeout_s: self._submit(size, job, payload, timeout_s))
        if executor is not None:
            compiler = ClusterCompiler(self.cluster(executor), compiler)
        with self._lock:
            wrappers = list(self._compiler_wrappers)
        for wrap in wrappers:
            compiler = wrap(compiler)
        return compiler

    def wrap_compiler(self, wrap: Callable[[Compiler], Compiler]) -> Callable[[], None]:
        """Wrap every compile submitted from now on (``wrap(compiler)`` returns the compiler
        to use); returns the function that removes the wrapper."""
        return _add(self._lock, self._compiler_wrappers, wrap)

    def on_cache_read(self, hook: Callable[[ArtifactCache, str], None]) -> Callable[[], None]:
        """Call ``hook(cache, key)`` before each artifact-cache read on the user's path;
        returns the function that removes it."""
        return _add(self._lock, self._read_hooks, hook)

    def before_cache_read(self, cache: ArtifactCache, key: str) -> None:
        with self._lock:
            hooks = list(self._read_hooks)
        for hook in hooks:
            hook(cache, key)

    def cluster(self, executor: Any) -> Cluster:
        """The connection to the cluster ``executor`` (an address or a distributed.Client),
        made on first use and shared by every coordinator of this process."""
        with self._lock:
            key = executor if isinstance(executor, str) else id(executor)
            cluster = self._clusters.get(key)
            if cluster is None:
                cluster = self._clusters[key] = Cluster(executor)
            return cluster

    def _submit(self, size: PoolKey, job: str, payload: Any, timeout_s: float | None) -> JobFuture:
        """A job for the pool of ``size``, counted until done. Counted under the lock that
        stops idle pools, so a job never lands in a pool being stopped: it gets the pool, or
        a new one. The payload is pickled outside that lock (cache reads on the user's path
        take it too)."""
        with self._lock:
            pool = self._pool_locked(size)
            self._inflight[size] = self._inflight.get(size, 0) + 1
            self._idle_since.pop(size, None)
            if self._reaper is None:
                self._reaper = threads.start(self._stop_idle_pools, name="hotswap-idle-pools",
                                             args=(self._reaper_stop,))
        try:
            future = pool.submit(job, payload, timeout_s=timeout_s)
        except BaseException:
            self._job_done(size, pool)
            raise
        future.add_done_callback(lambda _: self._job_done(size, pool))
        return future

    def _job_done(self, size: PoolKey, pool: WorkerPool) -> None:
        with self._lock:
            if self._pools.get(size) is not pool:
                return
            self._inflight[size] -= 1
            if self._inflight[size] == 0:
                self._idle_since[size] = time.monotonic()

    def _stop_idle_pools(self, stop: threading.Event) -> None:
        """Stop a pool whose jobs are all done and that has had none for idle_exit_s(): its
        workers hold torch and inductor (hundreds of MiB each) for nothing once every ladder
        is final. A pool that never ran a job (prepare(), a warm pool) is kept. Ends when
        no pool is left to watch (the next job starts it again) or at shutdown()."""
        while True:
            try:
                limit = idle_exit_s()
            except ValueError:  # malformed: compile() reports it; keep every pool
                limit = None
            if stop.wait(1.0 if limit is None else min(1.0, max(0.1, limit / 4))):
                return
            now = time.monotonic()
            with self._lock:
                if not self._pools:
                    self._reaper = None
                    return
                if limit is None:
                    continue
                # (a job given to a pool directly, not through compiler(), keeps it too)
                idle = [size for size, since in self._idle_since.items()
                        if now - since >= limit and self._inflight.get(size, 0) == 0
                        and size in self._pools
                        and not any(w.busy for w in self._pools[size].workers_info())]
                stopped = [self._pools.pop(size) for size in idle if size in self._pools]
                for size in idle:
                    self._idle_since.pop(size, None)
                    self._inflight.pop(size, None)
            for pool in stopped:
                pool.terminate()

    def pool(self, workers: int | None = None, devices: tuple[str, ...] = ()) -> WorkerPool:
        """The pool of ``workers`` compile workers (None: the default count) on ``devices``
        (worker_devices), started and warming. Malformed HOTSWAP_* settings for workers, and
        devices this machine lacks, raise ValueError here."""
        size = _key(workers, devices)
        with self._lock:
            return self._pool_locked(size)

    def _pool_locked(self, size: PoolKey) -> WorkerPool:
        pool = self._pools.get(size)
        if pool is None:
            pool = self._pools[size] = _start_pool(*size)
        return pool

    def pools(self) -> list[WorkerPool]:
        with self._lock:
            return list(self._pools.values())

    def worker_pids(self) -> list[int]:
        """Every compile worker running now."""
        return [pid for pool in self.pools() for pid in pool.worker_pids()]

    def cpu_note(self, workers: int | None = None, devices: tuple[str, ...] = ()) -> str:
        """Why that pool's jobs wait on CPU, where they do (``WorkerPool.cpu_note``); "" when
        it is not running."""
        with self._lock:
            pool = self._pools.get(_key(workers, devices))
        return pool.cpu_note() if pool is not None else ""

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
        from hotswap.orchestrator.recording import shared_timeline

        timeline = shared_timeline(directory)
        timeline.close()
        return timeline.path or ""

    def shutdown(self, wait: bool = True, timeout_s: float = SHUTDOWN_JOIN_S) -> list[str]:
        """Stop every worker now; jobs still running or queued fail with ``PoolClosed`` (their
        graphs keep the tier they serve). With ``wait``, then wait up to ``timeout_s`` for
        every thread hotswap started (threads.py) to end, once the loads and swaps queued
        by then are done; returns the names of those still running (logged). Safe to call
        twice; later compiles start again."""
        with self._lock:
            pools = list(self._pools.values())
            clusters = list(self._clusters.values())
            self._pools.clear()
            self._clusters.clear()
            self._inflight.clear()
            self._idle_since.clear()
            self._reaper_stop.set()
            self._reaper_stop, self._reaper = threading.Event(), None
        for pool in pools:
            pool.terminate()
        for cluster in clusters:
            cluster.close()
        if not wait:
            return []
        deadline = time.monotonic() + timeout_s
        while True:
            # Again each round: the pools' failed jobs queue their last steps on loaders
            # (which then start a thread of their own again).
            Loader.stop_all()
            running = threads.join_all(min(0.2, max(0.0, deadline - time.monotonic())))
            if not running or time.monotonic() >= deadline:
                break
        if running:
            log.warning("hotswap: shutdown() left %d thread(s) running after %.0f s: %s",
                        len(running), timeout_s, ", ".join(running))
        return running


def idle_exit_s() -> float | None:
    """HOTSWAP_WORKER_IDLE_EXIT_S: stop a pool's workers once its jobs are done and none came
    for this long (default 300; 0: never). The next compile starts workers again."""
    return settings.worker_idle_exit_s()


def _add(lock: threading.Lock, hooks: list[Any], hook: Any) -> Callable[[], None]:
    with lock:
        hooks.append(hook)

    def remove() -> None:
        with lock:
            if hook in hooks:
                hooks.remove(hook)

    return remove


PoolKey = tuple[int, tuple[str, ...]]


def _key(workers: int | None, devices: tuple[str, ...]) -> PoolKey:
    return (workers or default_workers(), tuple(devices))


def visible_devices(device: str, current: str | None, count: int) -> str:
    """CUDA_VISIBLE_DEVICES for a worker that compiles on ``device`` ("cuda:N" as this
    process numbers its GPUs): this process's GPUs with 0 and N swapped. A graph on the
    caller's default GPU then compiles, autotunes and is benchmarked on GPU N, and its
    artifact, made for "cuda:0", loads here on the caller's cuda:0."""
    ids = [d.strip() for d in current.split(",")] if current else [str(i) for i in range(count)]
    index = int(device.partition(":")[2])
    if index >= len(ids):
        raise ValueError(f"worker_devices names {device!r}, but this process sees "
                         f"{len(ids)} GPU(s)")
    ids[0], ids[index] = ids[index], ids[0]
    return ",".join(ids)


def _start_pool(size: int, devices: tuple[str, ...] = ()) -> WorkerPool:
    # Inductor's own parallel compile would put several processes per worker on a few cores;
    # share the cores out instead, unless the user chose.
    threads = str(max(1, (os.cpu_count() or 1) // size))
    env = {} if "TORCHINDUCTOR_COMPILE_THREADS" in os.environ else {
        "TORCHINDUCTOR_COMPILE_THREADS": threads}
    # Workers give their child processes a TMPDIR of their own (workers/scratch.py); pin
    # inductor's cache, which would otherwise follow it, to the caller's: one cache for all.
    env["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache_dir()
    nice, idle = worker_priority()
    worker_env: Any = env
    if devices:
        import torch

        count = torch.cuda.device_count()
        visible = [visible_devices(d, os.environ.get("CUDA_VISIBLE_DEVICES"), count)
                   for d in devices]

        def worker_env(slot: int) -> dict[str, str]:
            return {**env, "CUDA_VISIBLE_DEVICES": visible[slot % len(visible)]}

    pool = WorkerPool(size, worker_env=worker_env, nice=nice, idle=idle, rss_limit_bytes=rss_limit(),
                      warm_modules=("torch", "torch._inductor.compile_fx",
                                    "hotswap.orchestrator.compile_job:warm_device",
                                    "hotswap.orchestrator.compile_job:warm_compile"))
    pool.start()
    return pool


runtime = Runtime()
# At exit, daemon threads are simply dropped: waiting for a load nobody will use is no use.
atexit.register(runtime.shutdown, wait=False)


def worker_priority() -> tuple[int, bool]:
    """The compile workers' (niceness, SCHED_IDLE), from the environment or the defaults.

    Compile workers yield the CPU to the user's process: niceness 19 (the lowest priority: a
    worker gets what the user's threads leave) unless HOTSWAP_WORKER_NICE says otherwise (0
    keeps the caller's priority). They run under ``SCHED_IDLE`` (Linux): a core they use is
    the user's again the moment one of the user's threads wakes on it. HOTSWAP_WORKER_IDLE=0
    turns it off."""
    return settings.worker_nice(), settings.worker_idle()


def rss_limit() -> int | None:
    """A worker whose memory passes HOTSWAP_WORKER_RSS_LIMIT_BYTES is killed and its job fails
    with MemoryLimitExceeded (default: no limit)."""
    return settings.worker_rss_limit_bytes()
