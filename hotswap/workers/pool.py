"""The worker pool, caller side: ``WorkerPool.submit`` / ``shutdown`` and ``JobFuture``.

The manager thread that owns the worker processes lives in manager.py (its docstring draws
the data flow); the worker program lives in child.py; the wire format in protocol.py.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import pickle
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

from hotswap import settings
from hotswap.errors import PoolClosed, SerializationFailed
from hotswap.system.starvation import YIELD_TO
from hotswap.workers.child import resolve_job
from hotswap.workers.future import JobFuture, WorkerInfo
from hotswap.workers.inbox import Inbox, Job, PoolConfig, WorkerEnv
from hotswap.workers.manager import Manager
from hotswap.workers.protocol import StageEvent

__all__ = ["DEFAULT_WARM_MODULES", "JobFuture", "WorkerInfo", "WorkerPool", "default_workers"]

# Importing these takes seconds; a pre-warmed worker pays it before its first job, not during.
DEFAULT_WARM_MODULES: tuple[str, ...] = ("torch", "torch._inductor.compile_fx")
# The longest a worker may be held for a measurement (``submit``'s ``hold_s``): a hold is a
# wait of seconds for a caller that is about to submit, never a reservation.
MAX_HOLD_S = 60.0


def default_workers() -> int:
    """``HOTSWAP_WORKERS`` if set, else one worker per two cores (1 to 4).

    A compile runs its C++ and triton builds side by side on the worker's share of the cores
    (engine/runtime.py), so a worker per core left each compile one thread. On 2 cores,
    GPT-2 (one graph) served compiled code at 23.6 s from process start with two workers and
    17.7 s with one."""
    value = settings.workers()
    return value if value is not None else max(1, min(4, (os.cpu_count() or 1) // 2))


_live_pools: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


@atexit.register
def _terminate_live_pools() -> None:
    # Interpreter exit with jobs still pending must neither hang nor leave workers behind.
    for pool in list(_live_pools):
        pool.terminate()


def _forget_live_pools() -> None:
    """A forked child has none of its parent's pools: at its exit it must not stop theirs
    (nor wait on a lock a thread of the parent held at the fork)."""
    _live_pools.clear()


os.register_at_fork(after_in_child=_forget_live_pools)


class WorkerPool:
    """A pool of ``python -m hotswap.workers`` processes that run named jobs.

    ``submit(job, payload, timeout_s=...)`` returns a :class:`JobFuture` that always resolves:
    with the job's result, or with one of ``CompileFailed``, ``SerializationFailed``,
    ``WorkerCrashed``, ``JobTimeout``, ``MemoryLimitExceeded``, ``PoolClosed``,
    ``WorkerStartFailed``. Workers start on the first submit (or ``start()``), import
    ``warm_modules`` right away, and are replaced when they die.

    ``worker_env`` adds environment variables per worker: a mapping, or a function of the
    worker's slot (0..workers-1, kept by its replacements), e.g. for ``CUDA_VISIBLE_DEVICES``.
    ``nice`` lowers the workers' CPU priority (0-19) so their work yields to the caller's;
    ``idle`` gives them only the CPU nothing else wants: on Linux in a cgroup of their own with
    ``cpu.idle=1`` where the caller may make one, else under the ``SCHED_IDLE`` policy
    (elsewhere it does nothing), so a thread of the caller that wakes takes their core at
    once. ``priority_note()`` says which. ``yield_to``: whom lowered workers yield to.
    ``"caller"`` (this process): in the idle group they yield to every process, so one that
    other processes crowd out of its share while it has a job is raised until the job ends,
    as one the caller starves is (system/starvation.py). ``"all"``: only a starved one is
    (the compile service's pool: its callers are other processes).
    ``warm_modules`` are imported by each worker before it reports ready; an entry
    ``"module:function"`` is a warm-up step beyond imports, called (with ``None``) after the
    worker reports ready, in order, until a job arrives: a job never waits for more than the
    step under way.
    ``measures`` names the jobs that time code (hotswap's benchmark job): each goes ahead of
    the other queued jobs (after the measurements queued before it), since what it decides
    serves now, while a queued compile is mostly of a tier to come; a job that measurements
    passed ``MAX_OVERTAKEN`` times (inbox.py) keeps its place. It runs at the workers'
    priority, as every job does (a starved one is raised, as a compile is): at the caller's
    from its start, beside a caller whose two intra-op threads kept both cores of a 2-core box
    busy, a two-thread benchmark made the caller's calls take 150-400 ms, where its largest
    call beside a measurement at the workers' priority took 10.1 ms (two OpenMP teams on two
    cores, each waiting at every barrier for a thread the other's had preempted).
    ``submit(..., hold_s=)``: the caller will measure what the job makes. After its result
    its worker takes only a measurement, for up to ``hold_s`` seconds (or a job measurements
    may not pass any more), so that the measurement does not wait behind a job queued
    meanwhile: on the 2-core box, the pool's one worker took the next tier's compile 0.1-0.8
    s before the measurement of the tier it had just compiled was queued, and that
    measurement then waited 3 s for it (12 s beside a busy caller).
    ``warm``: how many workers it keeps started whether jobs wait or not (at most
    ``workers``), one after another; past them, it grows only for jobs that would wait longer
    than a worker takes to start (manager.py).
    """

    def __init__(
        self,
        workers: int | None = None,
        *,
        rss_limit_bytes: int | None = None,
        worker_env: WorkerEnv = None,
        warm_modules: Iterable[str] = DEFAULT_WARM_MODULES,
        rss_poll_s: float = 0.1,
        ready_timeout_s: float = 120.0,
        nice: int = 0,
        idle: bool = False,
        measures: Iterable[str] = (),
        yield_to: str = "caller",
        warm: int = 1,
    ) -> None:
        if workers is None:
            workers = default_workers()
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be an int >= 1, got {workers!r}; pass workers=None "
                             "for the default (HOTSWAP_WORKERS, or one per two cores, 1 to 4)")
        if rss_limit_bytes is not None and (
            isinstance(rss_limit_bytes, bool) or not isinstance(rss_limit_bytes, int)
            or rss_limit_bytes <= 0
        ):
            raise ValueError(f"rss_limit_bytes must be a positive int or None, got "
                             f"{rss_limit_bytes!r}")
        if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19:
            raise ValueError(f"nice must be an int from 0 to 19 (added to the workers' niceness), "
                             f"got {nice!r}")
        if not isinstance(idle, bool):
            raise ValueError(f"idle must be a bool, got {idle!r}")
        if yield_to not in YIELD_TO:
            raise ValueError(f"yield_to must be one of {', '.join(map(repr, YIELD_TO))}, got "
                             f"{yield_to!r}")
        if isinstance(measures, str):
            raise ValueError(f"measures must be a collection of job names, got the string "
                             f"{measures!r}; pass [{measures!r}]")
        measures = frozenset(measures)
        if not all(isinstance(job, str) for job in measures):
            raise ValueError(f"measures must name jobs ('package.module:function' strings), "
                             f"got {sorted(map(repr, measures))}")
        if isinstance(warm, bool) or not isinstance(warm, int) or warm < 1:
            raise ValueError(f"warm must be an int >= 1, got {warm!r}")
        _check_positive("rss_poll_s", rss_poll_s)
        _check_positive("ready_timeout_s", ready_timeout_s)
        self.num_workers = workers
        self.rss_limit_bytes = rss_limit_bytes
        self._config = PoolConfig(workers, rss_limit_bytes, worker_env, list(warm_modules),
                                  rss_poll_s, ready_timeout_s, nice, idle, measures, yield_to,
                                  min(warm, workers))
        self._inbox: Inbox | None = None
        self._manager: Manager | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards lazy start; the Inbox's lock guards the rest
        self._closed_before_start = False
        self._job_ids = itertools.count(1)
        self._owner_pid = os.getpid()

    def cpu_note(self) -> str:
        """Why jobs wait on CPU, where they do ("" otherwise): the workers were starved by
        the caller's threads and raised to its priority, or restarted (starvation.py)."""
        return self._manager.cpu_note() if self._manager is not None else ""

    def priority_note(self) -> str:
        """How the workers yield the CPU to the caller, e.g. "cgroup v1 cpu.idle" (in a cgroup
        of their own), "autogroup + SCHED_IDLE" (where no cpu cgroup is ours to make; see
        hotswap/system/priority.py), with "; raised while other processes crowd them out"
        where they yield to the caller only (``yield_to="caller"``); "" before a worker
        started."""
        return self._manager.priority_note() if self._manager is not None else ""

    @property
    def measures(self) -> frozenset[str]:
        """The jobs queued as measurements (``measures=``)."""
        return self._config.measures

    @property
    def restarts(self) -> int:
        """Workers replaced after dying with a job or while idle (not at shutdown)."""
        return self._manager.restarts if self._manager is not None else 0

    # ------------------------------------------------------------------ public API (any thread)

    def start(self) -> None:
        """Start the workers now instead of on the first submit."""
        inbox = self._started()
        inbox.wake()

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Start the pool if needed and block until every worker is ready (its imports done;
        warm-up steps run after)."""
        inbox = self._started()
        assert self._manager is not None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with inbox.lock:
            inbox.ready_waiters += 1  # a starved starting worker is raised for us (starvation.py)
        try:
            inbox.wake()  # the manager's next poll counts us
            with inbox.ready_cond:
                while self._manager.ready_count() < self.num_workers:
                    if inbox.closing:
                        return False
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return False
                    inbox.ready_cond.wait(remaining)
        finally:
            with inbox.lock:
                inbox.ready_waiters -= 1
        return True

    def submit(self, job: str, payload: Any = None, *, timeout_s: float | None = None,
               hold_s: float = 0.0) -> JobFuture:
        """Queue ``job`` (``"package.module:function"``) to run on ``payload`` in a worker.
        ``hold_s``: its worker then waits that long for a measurement (class docstring)."""
        if not isinstance(job, str):
            raise ValueError(f"job must be a 'package.module:function' string, got {job!r}")
        resolve_job(job)  # ValueError / LookupError now, at the call, not later in a worker
        if timeout_s is not None:
            _check_positive("timeout_s", timeout_s)
        if (isinstance(hold_s, bool) or not isinstance(hold_s, int | float)
                or not 0 <= hold_s <= MAX_HOLD_S):
            raise ValueError(f"hold_s must be a number of seconds from 0 to {MAX_HOLD_S:g}, "
                             f"got {hold_s!r}")
        inbox = self._started()
        future = JobFuture(job, next(self._job_ids))
        try:
            data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            future.set_exception(SerializationFailed(job, "payload", "parent", repr(e)))
            return future
        with inbox.lock:
            if inbox.closing:  # shut down while we were pickling
                future.set_exception(PoolClosed("the pool was shut down before the job ran"))
                return future
            inbox.enqueue(Job(future.job_id, job, data, timeout_s, future, hold_s=hold_s),
                          self._config.measures)
            assert self._manager is not None
            self._manager.reset_start_failures()
        future.add_done_callback(self._on_future_done)
        inbox.wake()
        return future

    def subscribe(self, callback: Callable[[StageEvent], None]) -> Callable[[], None]:
        """Call ``callback(event)`` (on the manager thread) for every StageEvent; returns an
        unsubscribe function. Keep callbacks short: they delay the pool's I/O."""
        inbox = self._started()
        with inbox.lock:
            inbox.subscribers.append(callback)

        def unsubscribe() -> None:
            with inbox.lock, contextlib.suppress(ValueError):
                inbox.subscribers.remove(callback)

        return unsubscribe

    def workers_info(self) -> list[WorkerInfo]:
        if self._inbox is None or self._manager is None:
            return []
        with self._inbox.lock:
            return self._manager.info()

    def worker_pids(self) -> list[int]:
        return [info.pid for info in self.workers_info()]

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop accepting jobs; with ``cancel_futures`` cancel queued ones. Queued and running
        jobs otherwise finish first. ``wait`` blocks until every worker has exited."""
        with self._lock:
            inbox, thread = self._inbox, self._thread
            if inbox is None:
                self._closed_before_start = True
                return
        with inbox.lock:
            inbox.closing = True
            inbox.cancel_on_close = inbox.cancel_on_close or cancel_futures
            inbox.ready_cond.notify_all()
        inbox.wake()
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join()

    def terminate(self) -> None:
        """Kill every worker now; running and queued jobs resolve with PoolClosed."""
        with self._lock:
            inbox = self._inbox
        if inbox is not None:
            with inbox.lock:
                inbox.terminating = True
        self.shutdown(wait=True)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown(wait=True)

    # ------------------------------------------------------------------ helpers

    def _started(self) -> Inbox:
        """The Inbox of a running manager thread, started on first use."""
        with self._lock:
            if self._closed_before_start or (self._inbox is not None and self._inbox.closing):
                raise PoolClosed("this pool was shut down; create a new WorkerPool")
            if os.getpid() != self._owner_pid:
                raise PoolClosed("this pool belongs to the process that created it, not to a "
                                 "forked child; create a new WorkerPool in the child")
            if self._inbox is None:
                self._inbox = Inbox()
                self._manager = Manager(self._inbox, self._config,
                                        on_exit=lambda: _live_pools.discard(self))
                self._thread = threading.Thread(target=self._manager.run, name="hotswap-pool",
                                                daemon=True)
                _live_pools.add(self)
                self._thread.start()
            return self._inbox

    def _on_future_done(self, future: Future[Any]) -> None:
        if future.cancelled() and self._inbox is not None:
            assert isinstance(future, JobFuture)
            with self._inbox.lock:
                self._inbox.cancelled.append(future.job_id)
            self._inbox.wake()


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be a number > 0 (seconds), got {value!r}; use None for "
                         "no limit")

