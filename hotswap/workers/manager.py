"""The pool's manager thread: the one owner of every worker process and pipe.

    caller threads (pool.py)        Inbox (inbox.py, lock)  manager thread (this module)        workers
    ------------------------        ------------            ----------------------------        -------
    submit() pickles payload  --->  jobs deque  --wake--->  selector over: wake pipe, each
    future.cancel()           --->  cancelled   --wake--->    worker's read pipe, its write
    shutdown()/terminate()    --->  flags       --wake--->    pipe (while a frame is pending)
                                                              and its pidfd
                                                            dispatch: job -> idle READY worker  -frame->  runs
                                                            read: STAGE_EVENT -> subscribers  <-frames-
                                                                  JOB_RESULT/JOB_FAILED -> future
                                                            pidfd readable: worker died -> resolve
                                                              its job (WorkerCrashed, JobTimeout,
                                                              MemoryLimitExceeded), kill its process
                                                              group, start a replacement
                                                            timers: job deadlines, RSS polls,
                                                              ready deadlines

Caller threads touch only the Inbox, under its lock. Futures are resolved with no lock held, so
their callbacks may submit again. Invariant: every future handed out resolves.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import sys
import time
from collections.abc import Callable
from typing import Any

from hotswap.errors import (
    PoolClosed,
    SerializationFailed,
    WorkerStartFailed,
)
from hotswap.system import cores, proctree
from hotswap.system.starvation import CpuWatch
from hotswap.workers import scratch
from hotswap.workers.future import WorkerInfo
from hotswap.workers.inbox import Inbox, Job, PoolConfig, resolve
from hotswap.workers.process import WorkerProcess, remote_error, spawn
from hotswap.workers.protocol import (
    MessageKind,
    Payload,
    ProtocolError,
    StageEvent,
    decode_control,
    decode_result,
    encode_control,
    encode_job_request,
)
from hotswap.workers.watchdog import Watchdog

__all__ = ["Manager"]

log = logging.getLogger(__name__)

_MAX_START_FAILURES = 3
# How long a worker's start is taken to be before one has been timed in this pool.
DEFAULT_START_S = 5.0
# What a job sent to a worker in a warm-up step grants the step beyond its own timeout (the
# op-family step took 3.1-3.7 s on the H100); the job's deadline is set again at its end.
WARM_STEP_LIMIT_S = 60.0


def _counted_from(worker: WorkerProcess, start_s: float) -> float:
    """When a worker's running job begins to count as the pool's job time: when it was sent,
    or a start later for the worker's first job (which pays its process's one-time costs)."""
    return worker.job_started_s + (start_s if worker.jobs_done == 0 else 0.0)


class Manager:
    """Runs on the pool's manager thread (``run``); owns ``workers`` and every fd."""

    def __init__(self, inbox: Inbox, config: PoolConfig, on_exit: Callable[[], None]) -> None:
        self.inbox = inbox
        self.config = config
        self.on_exit = on_exit
        self.workers: dict[int, WorkerProcess] = {}  # by pid; callers read snapshots (info())
        self.restarts = 0
        self._running: dict[int, WorkerProcess] = {}
        self._start_failures = 0
        self._last_start_error = ""
        self._last_start_s: float | None = None  # how long the last worker's start took
        self._mean_job_s: float | None = None  # the recent jobs' time (a moving average)
        self._selector = selectors.DefaultSelector()
        self.cpu = CpuWatch(config.nice, config.idle, config.yield_to)  # starvation.py
        self.watchdog = Watchdog(config, self.cpu)       # watchdog.py

    def ready_count(self) -> int:
        """Workers ready for jobs (called under inbox.lock)."""
        return sum(w.ready for w in self.workers.values())

    def info(self) -> list[WorkerInfo]:
        """A snapshot of every worker, by slot (called under inbox.lock)."""
        return [WorkerInfo(w.slot, w.pid, w.ready, w.job is not None, w.started_s, w.ready_s,
                           w.warming, w.jobs_done, tuple(w.steps_done))
                for w in sorted(self.workers.values(), key=lambda w: w.slot)]

    def cpu_note(self) -> str:
        return self.cpu.note

    def priority_note(self) -> str:
        note = self.cpu.priority.note
        if note and self.cpu.load is not None:
            note += "; raised while other processes crowd them out"
        return note

    def reset_start_failures(self) -> None:
        """New demand gets a fresh round of start attempts (called under inbox.lock)."""
        self._start_failures = 0

    def run(self) -> None:
        scratch.sweep()  # what pools killed before they could clean up left behind
        self._selector.register(self.inbox.wake_r, selectors.EVENT_READ, ("wake", None))
        try:
            while self._manage_once():
                pass
        except BaseException:
            log.exception("hotswap pool manager failed; failing all jobs")
            raise
        finally:
            cores.set_running(self, 0)  # first: stopping the workers may raise
            with self.inbox.lock:
                self.inbox.closing = True
            self._stop_all_workers()
            self.cpu.priority.close()  # its workers are gone: so goes their cgroup
            self.inbox.fail_all(PoolClosed("the pool was shut down before the job ran"))
            self._selector.close()
            self.inbox.close_wake_pipe()
            self.on_exit()

    def _manage_once(self) -> bool:
        with self.inbox.lock:
            # A closing pool still runs what was queued before shutdown() (unless cancelled).
            wanted = not self.inbox.terminating and (not self.inbox.closing or bool(self.inbox.jobs))
        if wanted:  # dispatch first: a job an idle worker takes now is due no new one
            self._dispatch()
            self._top_up_workers()
            self._publish_running()
        for key, mask in self._selector.select(self._next_timeout()):
            what, worker = key.data
            if what == "wake":
                with contextlib.suppress(OSError):
                    while os.read(self.inbox.wake_r, 4096):
                        pass
            elif what == "exit":
                self._reap(worker)
            elif worker.pid in self.workers:
                if mask & selectors.EVENT_READ:
                    self._read(worker)
                if mask & selectors.EVENT_WRITE and worker.pid in self.workers:
                    worker.flush()
        self._apply_cancellations()
        self._check_timers()
        with self.inbox.lock:
            closing, terminating = self.inbox.closing, self.inbox.terminating
            if closing and self.inbox.cancel_on_close:
                cancelled = list(self.inbox.jobs)
                self.inbox.jobs.clear()
            else:
                cancelled = []
        for job in cancelled:
            job.future.cancel()
        self._publish_running()
        if terminating:
            return False
        with self.inbox.lock:
            idle = not self.inbox.jobs and not self._running
        return not (closing and idle)

    def _publish_running(self) -> None:
        """Workers on this machine's cores now (starting, warming up, with a job): eager
        answers leave them theirs (system/cores.py)."""
        cores.set_running(self, sum(not w.ready or w.warming or w.job is not None
                                    for w in self.workers.values()))

    def _next_timeout(self) -> float | None:
        with self.inbox.lock:
            queued = self.inbox.wanted()
        now = time.monotonic()
        timeout = self.watchdog.next_deadline(self.workers.values(), queued, now)
        # Wake to grow the pool, and when a held worker's hold ends with jobs queued for it.
        wakes = [w.held_until for w in self.workers.values()
                 if queued and w.job is None and w.held_until > now]
        grow = self._grow_deadline()
        for at in wakes if grow is None else [*wakes, grow]:
            timeout = max(0.0, at - now) if timeout is None else min(timeout, max(0.0, at - now))
        return timeout

    def _spawn(self, slot: int) -> None:
        worker = spawn(slot, self.config, self._selector)
        with self.inbox.lock:
            self.workers[worker.pid] = worker
        # Lowered before INIT, so before the worker's imports: into the pool's cgroup here,
        # the rest by the worker itself (priority.py).
        nice, idle = self.cpu.priority.lower_new(worker.pid)
        init = {"sys_path": [p for p in sys.path if p], "warm_modules": self.config.warm_modules,
                "nice": nice, "idle": idle}
        worker.send(MessageKind.INIT, 0, encode_control(init))

    def _top_up_workers(self) -> None:
        """Start workers, up to the pool's size: the first at once, and those the pool keeps
        warm (``warm``) one after another; the others where the queue would keep its last job
        waiting longer than a worker takes to start (``_due``), or for a caller in
        ``wait_ready``, who asked for all of them."""
        if len(self.workers) >= self.config.workers:
            return
        if self._start_failures >= _MAX_START_FAILURES:
            if not any(w.ready for w in self.workers.values()):  # else the ready ones run them
                self.inbox.fail_all(WorkerStartFailed(self._start_failures,
                                                      self._last_start_error))
            return
        # One worker starts at a time: starting is CPU-bound (imports, then on CPU the ISA
        # probe), and workers starting side by side on a small machine each took longer to
        # be ready than one alone. More start at once only for jobs that would otherwise wait.
        with self.inbox.lock:
            queued = len(self.inbox.jobs)
            everyone = self.inbox.ready_waiters > 0
        # An empty pool starts a worker for each job queued (up to its size, one at a time
        # otherwise): nothing is known yet of how long its jobs or its starts take.
        due = queued if everyone or not self.workers else self._due(time.monotonic())
        starting = sum(not w.ready for w in self.workers.values())
        # A worker kept warm starts after the one before is ready, and not again after a
        # failed start until a job comes (submit resets the count): no restarts in a loop.
        warm = (starting == 0 and len(self.workers) < self.config.warm
                and self._start_failures == 0)
        if warm:
            due = max(due, 1)
        used = {w.slot for w in self.workers.values()}
        for slot in range(self.config.workers):
            if slot in used:
                continue
            if not self.workers or (everyone and starting == 0) or starting < due:
                if self.workers and not everyone:
                    why = ("kept warm" if warm else
                           f"the queued jobs would wait about "
                           f"{self._queue_wait_s(time.monotonic()):.1f} s for a worker (a start "
                           f"takes {self._start_s():.1f} s here)")
                    log.info("hotswap: starting worker %d of %d: %s", len(self.workers) + 1,
                             self.config.workers, why)
                self._spawn(slot)
                starting += 1

    # A pool grows past its first worker only where the queue would keep a job waiting longer
    # than a new worker takes to start: a worker holds hundreds of MB (on a GPU, a CUDA
    # context and inductor's compile processes: about 5 GB on a 16-core H100 machine), and a
    # pool that grew to its size whatever came made four processes of one service hold 12.3
    # GB where one held 3.6-4.9 GB. The wait is estimated from the queued jobs per worker,
    # times how long a job takes here (the recent ones' average, or the longest running
    # one's time so far), after what the soonest running job has left: short jobs run one
    # after another on the workers already up.
    def _start_s(self) -> float:
        """How long a worker's start takes here: the last one's (its imports and device
        set-up); before one was timed, at least as long as the one under way has taken."""
        if self._last_start_s is not None:
            return self._last_start_s
        now = time.monotonic()
        return max([DEFAULT_START_S, *(now - w.started_s for w in self.workers.values()
                                       if not w.ready)])

    def _job_s(self, now: float) -> float:
        """How long a job takes here: the recent ones' average, or the longest running one's
        time so far (0.0 where neither is known). A worker's first job pays its process's
        one-time costs (a CUDA context, inductor's compile processes, lazy set-up: on the
        H100, four processes' MLP jobs grew the service by a worker while the first one ran):
        it counts in neither until it has run longer than a start takes."""
        start_s = self._start_s()
        running = [now - _counted_from(w, start_s) for w in self.workers.values()
                   if w.job is not None]
        return max([self._mean_job_s or 0.0, *running])

    def _queue_wait_s(self, now: float) -> float:
        """About how long the last queued job would wait with the workers there are: the
        queued jobs per worker, each a job's time, after what the soonest running job has
        left of it."""
        with self.inbox.lock:
            queued = len(self.inbox.jobs)
        if not queued or not self.workers:
            return 0.0
        job_s = self._job_s(now)
        # A worker held for a measurement (hold_s) is free once its hold ends.
        left = min([*(max(0.0, job_s - (now - w.job_started_s)) for w in self.workers.values()
                      if w.job is not None),
                    *(w.held_until - now for w in self.workers.values()
                      if w.job is None and w.held_until > now)], default=0.0)
        return left + -(-queued // len(self.workers)) * job_s

    def _due(self, now: float) -> int:
        """Workers to add now: one where the queue's last job would wait longer than a start."""
        return int(self._queue_wait_s(now) > self._start_s())

    def _grow_deadline(self) -> float | None:
        """When the queue's wait, growing with the longest running job's time so far, would
        exceed a worker's start (None: not before something else wakes the manager)."""
        if not self.workers or len(self.workers) >= self.config.workers:
            return None
        if self._last_start_s is None and not all(w.ready for w in self.workers.values()):
            return None  # the start under way sets the measure: its readiness wakes us
        with self.inbox.lock:
            queued = len(self.inbox.jobs)
        start_s = self._start_s()
        running = [_counted_from(w, start_s) for w in self.workers.values() if w.job is not None]
        if not queued or not running:
            return None
        rounds = -(-queued // len(self.workers))  # the wait grows as the running job lasts
        due = min(running) + start_s / rounds
        return due if due > time.monotonic() else None

    def _read(self, worker: WorkerProcess) -> None:
        while True:
            try:
                frames = worker.decoder.read_from(worker.read_fd)
            except BlockingIOError:
                return
            except (EOFError, OSError):  # the worker is dead or dying
                worker.stop_reading()
                if worker.pidfd < 0:
                    self._reap(worker)
                return
            except ProtocolError as e:
                log.error("worker %d sent garbage (%s); killing it", worker.pid, e)
                self._kill(worker, ("crash", None))
                return
            for frame in frames:
                try:
                    self._handle(worker, frame.kind, frame.job_id, frame.payload)
                except Exception as e:
                    log.error("worker %d sent an unreadable %s (%r); killing it",
                              worker.pid, frame.kind.name, e)
                    self._kill(worker, ("crash", None))
                    return

    def _handle(self, worker: WorkerProcess, kind: MessageKind, job_id: int, payload: Payload) -> None:
        if kind == MessageKind.READY:
            # Raised while starving at its start: lowered now unless a job waits for it, and
            # before a caller in wait_ready sees it ready (the cgroup writes outside the lock).
            with self.inbox.lock:
                queued = bool(self.inbox.jobs)
            self.watchdog.ready(worker.pid, queued=queued)
            with self.inbox.ready_cond:
                worker.ready = True
                worker.ready_s = time.monotonic()
                self._last_start_s = worker.ready_s - worker.started_s
                self._start_failures = 0
                self.inbox.ready_cond.notify_all()
            return
        if kind == MessageKind.WARMING:
            control = decode_control(payload)
            worker.warming = bool(control.get("busy"))
            if not worker.warming and isinstance(control.get("step"), str):
                worker.steps_done.append(control["step"])
            if not worker.warming and worker.job is not None:
                # A job sent while a warm-up step ran starts now: its deadline and its time
                # (what the pool's growth reads) begin here, not at the send.
                worker.job_started_s = time.monotonic()
                if worker.job.timeout_s is not None:
                    worker.deadline_s = worker.job_started_s + worker.job.timeout_s
            return
        job = worker.job
        if job is None or job.job_id != job_id:
            return  # a late frame of a job that was cancelled or timed out
        if kind == MessageKind.STAGE_EVENT:
            event = StageEvent.from_wire(job_id, payload)
            job.future.stage_events.append(event)
            with self.inbox.lock:
                subscribers = list(self.inbox.subscribers)
            for callback in subscribers:
                try:
                    callback(event)
                except Exception:
                    log.exception("StageEvent subscriber %r raised", callback)
            return
        self._finish(worker, answered=True)
        if kind == MessageKind.JOB_RESULT and job.hold_s > 0 and not job.future.cancelled():
            # its result will be measured: the worker waits for that measurement
            worker.held_until = time.monotonic() + job.hold_s
        if kind == MessageKind.JOB_RESULT:
            try:
                result = decode_result(payload)
            except Exception as e:
                resolve(job.future, error=SerializationFailed(job.name, "result", "parent",
                                                               repr(e)))
            else:
                resolve(job.future, result=result)
        elif kind == MessageKind.JOB_FAILED:
            resolve(job.future, error=remote_error(job.name, decode_control(payload)))

    def _finish(self, worker: WorkerProcess, *, answered: bool = False) -> None:
        """``answered``: the worker answered its job (a result or a failure), so its time is
        a job's time; a job killed (timeout, cancel, starved) says nothing of that."""
        if worker.job is not None:
            with self.inbox.lock:
                self._running.pop(worker.job.job_id, None)
            if answered and worker.jobs_done:  # a first job's time is its process's start too
                took = time.monotonic() - worker.job_started_s
                self._mean_job_s = (took if self._mean_job_s is None
                                    else 0.7 * self._mean_job_s + 0.3 * took)
            worker.jobs_done += 1
        self.watchdog.job_ended(worker.pid, had_job=worker.job is not None)
        worker.job = None
        worker.deadline_s = None

    def _dispatch(self) -> None:
        now = time.monotonic()
        # Workers held for a measurement first (WorkerPool.submit's hold_s): a measurement at
        # the queue's head goes to one of them, and a worker that is not held stays free for
        # the job behind it.
        # Then workers not in a warm-up step (a job sent to one waits for the step's end).
        for worker in sorted(self.workers.values(),
                             key=lambda w: (w.held_until <= now, w.warming, w.slot)):
            if not worker.ready or worker.job is not None or worker.kill_reason is not None:
                continue
            job = self._take(worker, now)
            if job is None:
                continue
            worker.held_until = 0.0
            worker.job = job
            worker.job_started_s = time.monotonic()
            job.future.worker_pid = worker.pid
            job.future.set_running()
            if job.timeout_s is not None:
                # A worker in a warm-up step starts the job at the step's end (WARMING), when
                # its deadline is set again; until then the step may take WARM_STEP_LIMIT_S.
                worker.deadline_s = time.monotonic() + job.timeout_s + (
                    WARM_STEP_LIMIT_S if worker.warming else 0.0)
            parts = encode_job_request(job.name, job.data)  # job.data: kept for a restart
            worker.send(MessageKind.JOB_REQUEST, job.job_id, *parts)

    def _take(self, worker: WorkerProcess, now: float) -> Job | None:
        """The queued job ``worker`` runs next, taken off the queue (jobs cancelled while
        queued are dropped on the way); None where the queue is empty, or where the worker is
        held for a measurement and the job at the head is none it takes."""
        with self.inbox.lock:
            while self.inbox.jobs:
                job = self.inbox.jobs[0]
                if job.future.done():  # cancelled while queued
                    self.inbox.jobs.popleft()
                    continue
                if worker.held_until > now and not job.for_held_worker(self.config.measures):
                    return None
                self.inbox.jobs.popleft()
                self._running[job.job_id] = worker
                return job
        return None

    def _apply_cancellations(self) -> None:
        with self.inbox.lock:
            cancelled, self.inbox.cancelled = self.inbox.cancelled, []
        for job_id in cancelled:
            with self.inbox.lock:
                worker = self._running.get(job_id)
            if worker is not None and worker.job is not None and worker.job.job_id == job_id:
                self._kill(worker, ("cancel", None))

    def _check_timers(self) -> None:
        with self.inbox.lock:
            queued = self.inbox.wanted()
        for worker, reason in self.watchdog.overdue(self.workers.values(), queued,
                                                    time.monotonic()):
            if reason[0] == "start":
                self._last_start_error = f"not ready after {self.config.ready_timeout_s:g} s"
            self._kill(worker, reason)

    def _kill(self, worker: WorkerProcess, reason: tuple[str, Any]) -> None:
        if worker.kill_reason is None:
            worker.kill_reason = reason
        proctree.kill_tree(worker.pid)
        if worker.pidfd < 0:
            self._reap(worker)

    def _reap(self, worker: WorkerProcess) -> None:
        """The worker exited: read what it wrote last, resolve its job, clean up after it."""
        if self.workers.get(worker.pid) is not worker:
            return
        self._read_remaining(worker)
        exitcode = worker.proc.wait()
        proctree.kill_group(worker.pid)  # inductor subprocesses it left behind
        scratch.remove(worker.tmpdir)  # and the temporary files of what was killed
        worker.close()
        self.cpu.priority.forget(worker.pid)
        self.cpu.forget(worker.pid)
        with self.inbox.lock:
            del self.workers[worker.pid]
        job = worker.job
        self._finish(worker)
        if job is not None and worker.kill_reason is not None and worker.kill_reason[0] == "starved":
            with self.inbox.lock:  # starts over on a worker at normal priority (starvation.py)
                self.inbox.jobs.appendleft(job)
            job.future.set_queued()
            job = None
        if not worker.ready and (worker.kill_reason or ("",))[0] != "starved":
            self._start_failures += 1
            if not self._last_start_error or worker.kill_reason is None:
                self._last_start_error = f"last worker exited with code {exitcode}"
        elif not self.inbox.closing:
            self.restarts += 1
        if job is not None:
            resolve(job.future, error=worker.death_error(job, exitcode, self.config.rss_limit_bytes))

    def _read_remaining(self, worker: WorkerProcess) -> None:
        worker.stop_reading()
        while True:
            try:
                frames = worker.decoder.read_from(worker.read_fd)
            except (EOFError, OSError, ProtocolError):
                return
            for frame in frames:
                self._handle(worker, frame.kind, frame.job_id, frame.payload)

    def _stop_all_workers(self) -> None:
        """Ask idle workers to exit; kill the rest. Resolves every running job."""
        for worker in list(self.workers.values()):
            if worker.job is None and not self.inbox.terminating:
                worker.send(MessageKind.SHUTDOWN, 0)
            else:
                self._kill(worker, ("shutdown", None))
        deadline = time.monotonic() + 2.0
        while self.workers and time.monotonic() < deadline:
            events = self._selector.select(max(0.0, deadline - time.monotonic()))
            if not events:
                break
            for key, _ in events:
                what, worker = key.data
                if what == "exit" or (what == "io" and worker.pidfd < 0):
                    self._reap(worker)
                elif what == "io":
                    self._read(worker)
        for worker in list(self.workers.values()):
            self._kill(worker, ("shutdown", None))
            self._reap(worker)
