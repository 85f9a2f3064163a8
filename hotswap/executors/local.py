"""The local executor: this machine's compile worker pools (hotswap.workers).

    LocalExecutor(pools, workers, devices).submit(job, payload, timeout_s)
        --> LocalPools: the pool of (workers, devices), started on first use, counted until the
            job is done --> WorkerPool.submit --> a worker process runs the job by name
    hotswap-idle-pools (a thread of LocalPools): stops a pool idle for idle_exit_s()

One ``LocalPools`` per process (``pools``): coordinators share its pools, one per worker count
(``workers=None`` is the default count, so it shares the pool of that many) and worker devices.
``shutdown()`` stops them; a job after it starts fresh workers.
"""

from __future__ import annotations

import getpass
import importlib
import logging
import os
import re
import sys
import tempfile
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any

from hotswap import settings
from hotswap.executors.base import (
    MEASURES,
    WARM_COMPILE_JOB,
    WARM_DEVICE_JOB,
    WARM_OPS_JOB,
    hold_for,
)
from hotswap.workers import JobFuture, WorkerPool
from hotswap.workers.pool import default_workers

__all__ = ["LocalExecutor", "LocalPools", "PoolKey", "build_env", "idle_exit_s", "inductor_cache_dir",
           "pools", "rss_limit", "trace_dirs", "visible_devices", "worker_priority"]

log = logging.getLogger("hotswap")

PoolKey = tuple[int, tuple[str, ...]]
# After torch.compiler.reset(), a pool with no job for this long stops its workers (instead of
# idle_exit_s()): long enough for the compile that often follows a reset (a test's next case,
# a reloaded model) to find them warm.
RESET_IDLE_EXIT_S = 5.0


class LocalPools:
    """The process's worker pools. Thread-safe."""

    def __init__(self, yield_to: str | None = None, warm: int = 1) -> None:
        # Whom the workers yield to (WorkerPool's ``yield_to``; None: HOTSWAP_WORKER_YIELD),
        # and how many of a pool's workers stay started with no job (WorkerPool's ``warm``).
        self._yield_to = yield_to
        self._warm = warm
        self._start_fresh()
        fresh = weakref.WeakMethod(self._start_fresh)  # registered for good: not the pools
        os.register_at_fork(after_in_child=lambda: (method := fresh()) and method())

    def _start_fresh(self) -> None:
        """No pool, no reaper. Also a forked child's state: its parent's pools (one started
        as the parent imported hotswap, say) are the parent's (``WorkerPool`` refuses work in
        another process), their reaper thread is not in the child, and a lock a thread of
        the parent held at the fork would stay held."""
        # One pool per (worker count, worker devices).
        self._pools: dict[PoolKey, WorkerPool] = {}
        self._lock = threading.Lock()
        # Jobs submitted and not yet done, and since when a pool that has run jobs has none
        # (idle_exit_s() stops such a pool; the next job starts one).
        self._inflight: dict[PoolKey, int] = {}
        self._idle_since: dict[PoolKey, float] = {}
        self._reset: set[PoolKey] = set()  # pools idle since a reset: RESET_IDLE_EXIT_S
        self._reaper: threading.Thread | None = None
        self._reaper_stop = threading.Event()  # shutdown(): the reaper ends
        # Pools started before a compile asked for them (``start_early``): when each
        # started, how long it waits for one at least, the environment it started in.
        self._early: dict[PoolKey, tuple[float, float, dict[str, str]]] = {}

    def submit(self, size: PoolKey, job: str, payload: Any, timeout_s: float | None) -> JobFuture:
        """A job for the pool of ``size``, counted until done. Counted under the lock that
        stops idle pools, so a job never lands in a pool being stopped: it gets the pool, or
        a new one. The payload is pickled outside that lock (cache reads on the user's path
        take it too)."""
        with self._lock:
            pool = self._pool_locked(size)
            self._inflight[size] = self._inflight.get(size, 0) + 1
            self._idle_since.pop(size, None)
            self._reset.discard(size)  # in use again: the usual idle limit
            self._start_reaper_locked()
        try:
            future = pool.submit(job, payload, timeout_s=timeout_s, hold_s=hold_for(job, payload))
        except BaseException:
            self._job_done(size, pool)
            raise
        future.add_done_callback(lambda _: self._job_done(size, pool))
        return future

    def start_early(self, size: PoolKey, first_job_within_s: float) -> bool:
        """Start the pool of ``size`` before any compile asks for it (as hotswap is imported:
        service/early.py), unless it runs; whether it started. It stops
        ``first_job_within_s`` from now, or ``idle_exit_s()`` if longer (none: kept), unless
        a compile asks for it first (``pool``, ``submit``). Asked for once this process has
        changed what a worker's build reads from the environment it inherits
        (``build_env``: CUDA_VISIBLE_DEVICES, a TORCHINDUCTOR_* variable...), it is replaced
        by a pool started in the new one."""
        with self._lock:
            if size in self._pools:
                return False
            self._pool_locked(size)
            self._early[size] = (time.monotonic(), first_job_within_s, build_env())
            self._start_reaper_locked()
            return True

    def _job_done(self, size: PoolKey, pool: WorkerPool) -> None:
        with self._lock:
            if self._pools.get(size) is not pool:
                return
            self._inflight[size] -= 1
            if self._inflight[size] == 0:
                self._idle_since[size] = time.monotonic()

    def release_idle(self) -> None:
        """``torch.compiler.reset()``: every pool, those that never ran a job included, stops
        its workers once it has had no job for ``RESET_IDLE_EXIT_S`` from now (unless
        HOTSWAP_WORKER_IDLE_EXIT_S=0 keeps workers for good); a job, or ``pool()`` asked
        for it (``prepare()``, a new backend), before then keeps it."""
        now = time.monotonic()
        with self._lock:
            for size in self._pools:
                self._reset.add(size)
                if self._inflight.get(size, 0) == 0:
                    self._idle_since[size] = now
            if self._pools:
                self._start_reaper_locked()

    def settled(self, size: PoolKey) -> None:
        """Every graph of a backend that warmed the pool of ``size`` (as it was made, before
        its first graph) is final. A pool that never ran a job starts its idle clock now, as
        one whose last job is done does: a warm restart whose tiers all came from the cache
        held its warmed workers for good (2.9 GB of workers and their compile processes,
        GPT-2 on the H100). A pool that has run jobs keeps its clock."""
        with self._lock:
            if size in self._pools and self._inflight.get(size, 0) == 0 \
                    and size not in self._idle_since:
                self._idle_since[size] = time.monotonic()
                self._start_reaper_locked()

    def _start_reaper_locked(self) -> None:
        if self._reaper is None:
            self._reaper = threading.Thread(target=self._stop_idle_pools,
                                            args=(self._reaper_stop,), daemon=True,
                                            name="hotswap-idle-pools")
            self._reaper.start()

    def _stop_idle_pools(self, stop: threading.Event) -> None:
        """Stop a pool whose jobs are all done and that has had none for idle_exit_s(): its
        workers hold torch and inductor (hundreds of MiB each) for nothing once every ladder
        is final. A pool that never ran a job (prepare(), a warm pool) is kept, unless the
        graphs it was warmed for all settled without one (``settled``), or it was started
        early and no compile asked for it in its window (``start_early``). Ends when
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
                # started early, and no compile asked for it in time
                idle = [size for size, (started, window, _) in self._early.items()
                        if limit is not None and now - started >= max(window, limit)
                        and size in self._pools]
                if limit is not None:
                    # (a job given to a pool directly, not through submit(), keeps it too)
                    idle += [size for size, since in self._idle_since.items()
                             if now - since >= (min(limit, RESET_IDLE_EXIT_S)
                                                if size in self._reset else limit)
                             and self._inflight.get(size, 0) == 0
                             and size in self._pools and size not in idle
                             and not any(w.busy for w in self._pools[size].workers_info())]
                stopped = [self._forget_locked(size) for size in idle]
            for pool in stopped:
                pool.terminate()

    def pool(self, size: PoolKey) -> WorkerPool:
        with self._lock:
            if size in self._reset or size not in self._inflight:
                # wanted again since a reset, or never ran a job: kept warm for whoever asks
                self._reset.discard(size)
                self._idle_since.pop(size, None)
            return self._pool_locked(size)

    def _forget_locked(self, size: PoolKey) -> WorkerPool:
        """Take the pool of ``size`` out (the caller terminates it, outside the lock)."""
        self._idle_since.pop(size, None)
        self._inflight.pop(size, None)
        self._early.pop(size, None)
        self._reset.discard(size)
        return self._pools.pop(size)

    def _pool_locked(self, size: PoolKey) -> WorkerPool:
        pool = self._pools.get(size)
        early = self._early.pop(size, None)  # asked for: no first-job window any more
        if pool is not None and early is not None and (changed := _changed(early[2])):
            log.info("hotswap: the compile workers started as hotswap was imported are "
                     "replaced: this process has changed %s since", ", ".join(changed))
            threading.Thread(target=self._forget_locked(size).terminate, daemon=True,
                             name="hotswap-pool-replaced").start()
            pool = None
        if pool is None:
            pool = self._pools[size] = _start_pool(
                *size, yield_to=self._yield_to or settings.worker_yield(), warm=self._warm)
        return pool

    def running(self, size: PoolKey) -> WorkerPool | None:
        """The pool of ``size`` if it runs now (None: not started, or stopped). Takes no
        lock (one dict read): a status asked while a pool starts (torch imported under the
        lock) answers at once."""
        return self._pools.get(size)

    def pools(self) -> list[WorkerPool]:
        with self._lock:
            return list(self._pools.values())

    def shutdown(self, wait: bool = True) -> None:
        """Stop every worker now; jobs still running or queued fail with ``PoolClosed``. With
        ``wait``, the idle-pool reaper has ended on return too. Later jobs start again."""
        with self._lock:
            pools = list(self._pools.values())
            reaper = self._reaper
            self._pools.clear()
            self._inflight.clear()
            self._idle_since.clear()
            self._reset.clear()
            self._early.clear()
            self._reaper_stop.set()
            self._reaper_stop, self._reaper = threading.Event(), None
        for pool in pools:
            pool.terminate()
        if wait and reaper is not None and reaper is not threading.current_thread():
            reaper.join()


pools = LocalPools()


class LocalExecutor:
    """The ``Executor`` of one pool of ``pools``: ``workers`` compile workers (None: the
    default count) on ``devices`` (worker_devices). Shutting it down leaves the pool running:
    it is shared (``LocalPools.shutdown`` stops it)."""

    def __init__(self, workers: int | None = None, devices: tuple[str, ...] = (), *,
                 shared: LocalPools | None = None) -> None:
        self.size: PoolKey = key(workers, devices)
        self._pools = shared or pools

    def submit(self, job: str, payload: Any, timeout_s: float | None) -> Future[Any]:
        return self._pools.submit(self.size, job, payload, timeout_s)

    def shutdown(self, wait: bool = True) -> None:
        pass


def key(workers: int | None, devices: tuple[str, ...]) -> PoolKey:
    return (workers or default_workers(), tuple(devices))


def idle_exit_s() -> float | None:
    """HOTSWAP_WORKER_IDLE_EXIT_S: stop a pool's workers once its jobs are done and none came
    for this long (default 300; 0: never). The next compile starts workers again."""
    return settings.worker_idle_exit_s()


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


# What a compile worker's build reads from the environment it inherits as it starts (its
# compiler and its flags, its devices, inductor's, triton's and hotswap's settings and caches),
# but for the variables of those prefixes that only this process reads (hotswap's own) or that
# inductor sets here as it runs (TRITON_CACHE_DIR: a worker derives the same one).
_BUILD_PREFIXES = ("TORCH", "PYTORCH", "TRITON", "CUDA", "NVIDIA", "ATEN_", "HOTSWAP_", "PYTHON",
                   "OMP_", "MKL", "KMP_", "LD_", "CC", "CXX", "CFLAGS", "CPATH", "C_INCLUDE_PATH",
                   "CPLUS_INCLUDE_PATH", "LIBRARY_PATH", "PATH", "CONDA_PREFIX", "TMPDIR",
                   "TEMP", "TMP", "HOME", "XDG_")
_NOT_BUILD = frozenset((
    "TRITON_CACHE_DIR", "PYTHONWARNINGS", "HOTSWAP_MODE", "HOTSWAP_TIERS", "HOTSWAP_REGIONS",
    "HOTSWAP_PARTS", "HOTSWAP_TIMEOUT_S", "HOTSWAP_GATE_THRESHOLD", "HOTSWAP_PROFILE_DIR",
    "HOTSWAP_LOG", "HOTSWAP_START_EARLY", "HOTSWAP_SWITCH_INTERVAL_S", "HOTSWAP_GC_FREEZE",
    "HOTSWAP_EAGER_THREADS",
    "HOTSWAP_CACHE_URL", "HOTSWAP_CACHE_KEY_FILE", "HOTSWAP_CLAIM_TTL_S",
    "HOTSWAP_CACHE_MAX_BYTES", "HOTSWAP_EXECUTOR", "HOTSWAP_SERVICE", "HOTSWAP_SERVICE_DIR",
    "HOTSWAP_SERVICE_IDLE_EXIT_S"))


def build_env() -> dict[str, str]:
    """The variables of this process's environment that a worker's build reads
    (``_BUILD_PREFIXES``), inductor's cache folder as resolved (inductor sets
    TORCHINDUCTOR_CACHE_DIR in its process as it first looks for it)."""
    env = {k: v for k, v in os.environ.items()
           if k.startswith(_BUILD_PREFIXES) and k not in _NOT_BUILD}
    env["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache_dir(import_torch=False)
    return env


def _changed(earlier: dict[str, str]) -> list[str]:
    """The variables ``build_env()`` holds that differ from ``earlier`` (set, unset or
    changed since)."""
    now = build_env()
    return sorted(k for k in earlier.keys() | now.keys() if earlier.get(k) != now.get(k))


def inductor_cache_dir(*, import_torch: bool = True) -> str:
    """Where inductor keeps compiled kernels in this process (honours TORCHINDUCTOR_CACHE_DIR).
    ``import_torch=False``: inductor's own answer only if its module is imported already,
    else by its rule (TORCHINDUCTOR_CACHE_DIR, else ``torchinductor_<user>`` in the temporary
    folder: cache_dir_utils.default_cache_dir), for a pool started as hotswap is imported:
    importing torch on a thread beside the user's own import of it can hand either one a
    module half made."""
    names = ("torch._inductor.runtime.cache_dir_utils", "torch._inductor.runtime.runtime_utils")
    if not import_torch and not any(hasattr(sys.modules.get(n), "cache_dir") for n in names):
        configured = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        if configured is not None:
            return os.path.abspath(configured)
        try:
            user = getpass.getuser()
        except (KeyError, ModuleNotFoundError, OSError):
            user = f"uid_{os.getuid()}"
        user = re.sub(r'[\\/:*?"<>|]', "_", user)
        return os.path.abspath(os.path.join(tempfile.gettempdir(), "torchinductor_" + user))
    for name in names:
        try:
            return str(importlib.import_module(name).cache_dir())
        except (ImportError, AttributeError):
            continue
    raise RuntimeError("cannot find inductor's cache directory in this torch version")


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


def trace_dirs(slot: int) -> dict[str, str]:
    """``TORCH_TRACE`` (and ``TORCH_DTRACE``) for the worker of ``slot``: with the caller's
    set to DIR, ``DIR/worker-<slot>``. Torch names every process's trace file alike
    (``dedicated_log_torch_trace_<random>.log``); a folder per worker keeps the caller's file
    alone in DIR, where ``tlparse`` and ``--all-ranks-html`` look, and names each worker's.
    A replacement worker writes beside the one it replaced (each line carries its pid)."""
    return {var: os.path.join(os.environ[var], f"worker-{slot}")
            for var in ("TORCH_TRACE", "TORCH_DTRACE") if os.environ.get(var)}


def _start_pool(size: int, devices: tuple[str, ...] = (), *, yield_to: str = "caller",
                warm: int = 1) -> WorkerPool:
    # Inductor's own parallel compile would put several processes per worker on a few cores;
    # share the cores out instead, unless the user chose.
    threads = str(max(1, (os.cpu_count() or 1) // size))
    env = {} if "TORCHINDUCTOR_COMPILE_THREADS" in os.environ else {
        "TORCHINDUCTOR_COMPILE_THREADS": threads}
    # Workers give their child processes a TMPDIR of their own (workers/scratch.py); pin
    # inductor's cache, which would otherwise follow it, to the caller's: one cache for all.
    env["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache_dir(import_torch=False)
    nice, idle = worker_priority()
    visible: list[str] = []
    if devices:
        import torch

        count = torch.cuda.device_count()
        visible = [visible_devices(d, os.environ.get("CUDA_VISIBLE_DEVICES"), count)
                   for d in devices]

    def worker_env(slot: int) -> dict[str, str]:
        own = {**env, **trace_dirs(slot)}
        if visible:
            own["CUDA_VISIBLE_DEVICES"] = visible[slot % len(visible)]
        return own

    pool = WorkerPool(size, worker_env=worker_env, nice=nice, idle=idle, rss_limit_bytes=rss_limit(),
                      warm_modules=("torch", "torch._inductor.compile_fx",
                                    WARM_DEVICE_JOB, WARM_COMPILE_JOB, WARM_OPS_JOB),
                      measures=MEASURES, yield_to=yield_to, warm=warm)
    pool.start()
    return pool
