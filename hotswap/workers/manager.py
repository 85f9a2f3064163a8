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

import collections
import contextlib
import errno
import logging
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hotswap.errors import (
    CompileFailed,
    JobError,
    JobTimeout,
    MemoryLimitExceeded,
    PoolClosed,
    SerializationFailed,
    WorkerCrashed,
    WorkerStartFailed,
    WorkerStopped,
)
from hotswap.workers import proctree, scratch
from hotswap.workers.future import WorkerInfo
from hotswap.workers.inbox import Inbox, Job, PoolConfig, resolve
from hotswap.workers.protocol import (
    FrameDecoder,
    MessageKind,
    Payload,
    ProtocolError,
    StageEvent,
    decode_control,
    decode_result,
    encode_control,
    encode_frame,
    encode_job_request,
)
from hotswap.workers.starvation import POLL_S, STOPPED_GRACE_S, CpuWatch

__all__ = ["Manager"]

log = logging.getLogger(__name__)

_MAX_START_FAILURES = 3
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])

class _Worker:
    """Parent-side state of one worker process. Touched by the manager thread only."""

    def __init__(self, slot: int, proc: subprocess.Popen[bytes], read_fd: int, write_fd: int):
        self.slot = slot
        self.proc = proc
        self.pid = proc.pid
        self.read_fd = read_fd
        self.write_fd = write_fd
        self.pidfd = -1
        self.decoder = FrameDecoder()
        self.outbuf: collections.deque[memoryview] = collections.deque()
        self.ready = False
        self.started_s = time.monotonic()
        self.ready_s: float | None = None
        self.job: Job | None = None
        self.deadline_s: float | None = None
        self.kill_reason: tuple[str, Any] | None = None
        self.watching_write = False
        self.tmpdir: str | None = None  # its scratch directory (scratch.py), removed with it


class Manager:
    """Runs on the pool's manager thread (``run``); owns ``workers`` and every fd."""

    def __init__(self, inbox: Inbox, config: PoolConfig, on_exit: Callable[[], None]) -> None:
        self.inbox = inbox
        self.config = config
        self.on_exit = on_exit
        self.workers: dict[int, _Worker] = {}  # by pid; callers read snapshots (info())
        self.restarts = 0
        self._running: dict[int, _Worker] = {}
        self._start_failures = 0
        self._last_start_error = ""
        self._next_rss_poll_s = 0.0
        self._selector = selectors.DefaultSelector()
        self.cpu = CpuWatch(config.nice, config.idle)  # starvation.py
        self._stopped_since: dict[int, float] = {}  # worker pid -> first seen stopped

    def ready_count(self) -> int:
        """Workers ready for jobs (called under inbox.lock)."""
        return sum(w.ready for w in self.workers.values())

    def info(self) -> list[WorkerInfo]:
        """A snapshot of every worker, by slot (called under inbox.lock)."""
        return [WorkerInfo(w.slot, w.pid, w.ready, w.job is not None, w.started_s, w.ready_s)
                for w in sorted(self.workers.values(), key=lambda w: w.slot)]

    def cpu_note(self) -> str:
        return self.cpu.note

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
            with self.inbox.lock:
                self.inbox.closing = True
            self._stop_all_workers()
            self.inbox.fail_all(PoolClosed("the pool was shut down before the job ran"))
            self._selector.close()
            self.inbox.close_wake_pipe()
            self.on_exit()

    def _manage_once(self) -> bool:
        with self.inbox.lock:
            # A closing pool still runs what was queued before shutdown() (unless cancelled).
            wanted = not self.inbox.terminating and (not self.inbox.closing or bool(self.inbox.jobs))
        if wanted:
            self._top_up_workers()
            self._dispatch()
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
                    self._flush(worker)
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
        if terminating:
            return False
        with self.inbox.lock:
            idle = not self.inbox.jobs and not self._running
        return not (closing and idle)

    def _next_timeout(self) -> float | None:
        now = time.monotonic()
        deadlines = [w.deadline_s for w in self.workers.values() if w.deadline_s is not None]
        deadlines += [w.started_s + self.config.ready_timeout_s for w in self.workers.values()
                      if not w.ready]
        if self.config.rss_limit_bytes is not None and self._running:
            deadlines.append(self._next_rss_poll_s)
        if self._cpu_needed():
            deadlines.append(self.cpu.next_poll_s)
        return max(0.0, min(deadlines) - now) if deadlines else None

    def _spawn(self, slot: int) -> None:
        parent_r, child_w = os.pipe()
        child_r, parent_w = os.pipe()
        env = dict(os.environ)
        extra = self.config.worker_env(slot) if callable(self.config.worker_env) else self.config.worker_env
        env.update(extra or {})
        # The worker must import hotswap even when the parent found it through sys.path tweaks.
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p
        )
        tmpdir = scratch.make(slot)
        env[scratch.ENV] = tmpdir
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "hotswap.workers", "--read-fd", str(child_r),
                 "--write-fd", str(child_w), "--parent-pid", str(os.getpid())],
                pass_fds=(child_r, child_w),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=2,  # job output must never land in the user's stdout
                start_new_session=True,
            )
        except BaseException:
            scratch.remove(tmpdir)
            raise
        finally:
            os.close(child_r)
            os.close(child_w)
        worker = _Worker(slot, proc, parent_r, parent_w)
        worker.tmpdir = tmpdir
        os.set_blocking(parent_r, False)
        os.set_blocking(parent_w, False)
        try:
            worker.pidfd = os.pidfd_open(proc.pid)
            self._selector.register(worker.pidfd, selectors.EVENT_READ, ("exit", worker))
        except (OSError, AttributeError):
            worker.pidfd = -1  # no pidfd: pipe EOF is the death signal
        self._selector.register(parent_r, selectors.EVENT_READ, ("io", worker))
        with self.inbox.lock:
            self.workers[worker.pid] = worker
        nice, idle = self.cpu.start_priority()
        init = {"sys_path": [p for p in sys.path if p], "warm_modules": self.config.warm_modules,
                "nice": nice, "idle": idle}
        self._send(worker, MessageKind.INIT, 0, encode_control(init))

    def _top_up_workers(self) -> None:
        if len(self.workers) >= self.config.workers:
            return
        if self._start_failures >= _MAX_START_FAILURES:
            self.inbox.fail_all(WorkerStartFailed(self._start_failures, self._last_start_error))
            return
        # One worker starts at a time: starting is CPU-bound (imports, then on CPU the ISA
        # probe), and workers starting side by side on a small machine each took longer to
        # be ready than one alone. More start at once only for jobs that would otherwise wait.
        with self.inbox.lock:
            queued = len(self.inbox.jobs)
        starting = sum(not w.ready for w in self.workers.values())
        used = {w.slot for w in self.workers.values()}
        for slot in range(self.config.workers):
            if slot not in used and (starting == 0 or starting < queued):
                self._spawn(slot)
                starting += 1

    def _send(self, worker: _Worker, kind: MessageKind, job_id: int, *parts: bytes) -> None:
        worker.outbuf.extend(memoryview(b) for b in encode_frame(kind, job_id, *parts) if b)
        self._flush(worker)

    def _flush(self, worker: _Worker) -> None:
        try:
            while worker.outbuf:
                view = worker.outbuf[0]
                n = os.write(worker.write_fd, view)
                if n < len(view):
                    worker.outbuf[0] = view[n:]
                    break
                worker.outbuf.popleft()
        except BlockingIOError:
            pass
        except OSError as e:  # EPIPE: the worker is gone; its exit event follows
            if e.errno not in (errno.EPIPE, errno.EBADF):
                raise
            worker.outbuf.clear()
        # The write fd is watched only while a frame is half-sent (the worker reads slowly).
        if worker.outbuf and not worker.watching_write:
            self._selector.register(worker.write_fd, selectors.EVENT_WRITE, ("io", worker))
            worker.watching_write = True
        elif not worker.outbuf and worker.watching_write:
            self._selector.unregister(worker.write_fd)
            worker.watching_write = False

    def _read(self, worker: _Worker) -> None:
        while True:
            try:
                frames = worker.decoder.read_from(worker.read_fd)
            except BlockingIOError:
                return
            except (EOFError, OSError):  # the worker is dead or dying
                with contextlib.suppress(KeyError, ValueError):
                    self._selector.unregister(worker.read_fd)
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

    def _handle(self, worker: _Worker, kind: MessageKind, job_id: int, payload: Payload) -> None:
        if kind == MessageKind.READY:
            with self.inbox.ready_cond:
                worker.ready = True
                worker.ready_s = time.monotonic()
                self._start_failures = 0
                self.inbox.ready_cond.notify_all()
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
        self._finish(worker)
        if kind == MessageKind.JOB_RESULT:
            try:
                result = decode_result(payload)
            except Exception as e:
                resolve(job.future, error=SerializationFailed(job.name, "result", "parent",
                                                               repr(e)))
            else:
                resolve(job.future, result=result)
        elif kind == MessageKind.JOB_FAILED:
            resolve(job.future, error=_remote_error(job.name, decode_control(payload)))

    def _finish(self, worker: _Worker) -> None:
        if worker.job is not None:
            with self.inbox.lock:
                self._running.pop(worker.job.job_id, None)
            self.cpu.job_ended(worker.pid)
        self._stopped_since.pop(worker.pid, None)
        worker.job = None
        worker.deadline_s = None

    def _dispatch(self) -> None:
        for worker in sorted(self.workers.values(), key=lambda w: w.slot):
            if not worker.ready or worker.job is not None or worker.kill_reason is not None:
                continue
            with self.inbox.lock:
                job = self.inbox.jobs.popleft() if self.inbox.jobs else None
                if job is None:
                    return
                self._running[job.job_id] = worker
            if job.future.done():  # cancelled while queued
                with self.inbox.lock:
                    self._running.pop(job.job_id, None)
                continue
            worker.job = job
            job.future.worker_pid = worker.pid
            job.future._is_running = True
            if job.timeout_s is not None:
                worker.deadline_s = time.monotonic() + job.timeout_s
            parts = encode_job_request(job.name, job.data)  # job.data: kept for a restart
            self._send(worker, MessageKind.JOB_REQUEST, job.job_id, *parts)

    def _apply_cancellations(self) -> None:
        with self.inbox.lock:
            cancelled, self.inbox.cancelled = self.inbox.cancelled, []
        for job_id in cancelled:
            with self.inbox.lock:
                worker = self._running.get(job_id)
            if worker is not None and worker.job is not None and worker.job.job_id == job_id:
                self._kill(worker, ("cancel", None))

    def _check_timers(self) -> None:
        now = time.monotonic()
        poll_rss = now >= self._next_rss_poll_s
        if poll_rss:
            self._next_rss_poll_s = now + self.config.rss_poll_s
        for worker in list(self.workers.values()):
            if worker.kill_reason is not None:
                continue
            if not worker.ready and now - worker.started_s > self.config.ready_timeout_s:
                self._last_start_error = f"not ready after {self.config.ready_timeout_s:g} s"
                self._kill(worker, ("start", None))
            elif worker.deadline_s is not None and now >= worker.deadline_s:
                assert worker.job is not None
                self._kill(worker, ("timeout", worker.job.timeout_s))
            elif self.config.rss_limit_bytes is not None and worker.job is not None and poll_rss:
                rss = proctree.tree_rss_bytes(worker.pid)
                if rss > self.config.rss_limit_bytes:
                    self._kill(worker, ("memory", rss))
        if now >= self.cpu.next_poll_s:
            self._watch_cpu(now)

    def _cpu_needed(self) -> set[int]:
        """Workers whose CPU share matters: running a job, or starting while jobs wait."""
        with self.inbox.lock:
            queued = bool(self.inbox.jobs)
        return {w.pid for w in self.workers.values() if w.kill_reason is None
                and (w.job is not None or (not w.ready and queued))}

    def _watch_cpu(self, now: float) -> None:
        """Compiles never starve (starvation.py): raise a starved worker, or where the OS
        will not, restart its job on a worker started at normal priority."""
        needed = self._cpu_needed()
        if not needed:
            self.cpu.next_poll_s = now + POLL_S
            return
        for pid, share in self.cpu.starved(now, needed):
            worker = self.workers.get(pid)
            if worker is None:
                continue
            stopped = proctree.stopped(pid)
            if stopped is not None:
                # SIGSTOP, a suspended terminal job: it would hold its job until the time
                # limit. A crash instead, once it stays stopped: the job is retried once.
                since = self._stopped_since.setdefault(pid, now)
                if now - since >= STOPPED_GRACE_S:
                    log.warning("hotswap: worker %d is stopped (process %d, for %.1f s); "
                                "killing it and replacing it", pid, stopped, now - since)
                    self._kill(worker, ("stopped", stopped))
                continue
            self._stopped_since.pop(pid, None)
            if not self.cpu.lowered or self.cpu.is_raised(pid):
                continue  # already at the caller's priority: the note says why it waits
            if not self.cpu.raise_worker(pid, share, self.cpu.starved_for(pid, now)):
                self._kill(worker, ("starved", share))

    def _kill(self, worker: _Worker, reason: tuple[str, Any]) -> None:
        if worker.kill_reason is None:
            worker.kill_reason = reason
        proctree.kill_tree(worker.pid)
        if worker.pidfd < 0:
            self._reap(worker)

    def _reap(self, worker: _Worker) -> None:
        """The worker exited: read what it wrote last, resolve its job, clean up after it."""
        if self.workers.get(worker.pid) is not worker:
            return
        self._read_remaining(worker)
        exitcode = worker.proc.wait()
        proctree.kill_group(worker.pid)  # inductor subprocesses it left behind
        scratch.remove(worker.tmpdir)  # and the temporary files of what was killed
        for fd in (worker.read_fd, worker.write_fd, worker.pidfd):
            if fd >= 0:
                with contextlib.suppress(KeyError, ValueError):
                    self._selector.unregister(fd)
                with contextlib.suppress(OSError):
                    os.close(fd)
        with self.inbox.lock:
            del self.workers[worker.pid]
        job = worker.job
        self._finish(worker)
        if job is not None and worker.kill_reason is not None and worker.kill_reason[0] == "starved":
            with self.inbox.lock:  # starts over on a worker at normal priority (starvation.py)
                self.inbox.jobs.appendleft(job)
            job.future._is_running = False
            job = None
        if not worker.ready and (worker.kill_reason or ("",))[0] != "starved":
            self._start_failures += 1
            if not self._last_start_error or worker.kill_reason is None:
                self._last_start_error = f"last worker exited with code {exitcode}"
        elif not self.inbox.closing:
            self.restarts += 1
        if job is not None:
            resolve(job.future, error=_death_error(worker, job, exitcode, self.config.rss_limit_bytes))

    def _read_remaining(self, worker: _Worker) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(worker.read_fd)
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
                self._send(worker, MessageKind.SHUTDOWN, 0)
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


def _remote_error(job: str, failure: dict[str, Any]) -> JobError:
    if failure.get("kind") == "serialization":
        return SerializationFailed(job, failure.get("what") or "payload", "worker",
                                   f"{failure['type']}: {failure['message']}")
    return CompileFailed(job, failure["type"], failure["message"], failure["traceback"])


def _death_error(worker: _Worker, job: Job, exitcode: int, rss_limit: int | None) -> BaseException:
    what, value = worker.kill_reason or ("crash", 0)
    if what == "timeout":
        return JobTimeout(float(value), worker.pid, job=job.name)
    if what == "memory":
        return MemoryLimitExceeded(worker.pid, int(value), rss_limit or 0, job=job.name)
    if what == "shutdown":
        return PoolClosed(f"the pool was terminated while {job.name} ran")
    if what == "stopped":
        return WorkerStopped(worker.pid, int(value), job=job.name)
    signal_name = signal.Signals(-exitcode).name if exitcode < 0 else None
    return WorkerCrashed(worker.pid, exitcode, signal_name, job=job.name)
