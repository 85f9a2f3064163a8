"""One worker process, seen from the parent: its pipes, its pidfd, what it runs.

    spawn(slot, config, selector) -> WorkerProcess    python -m hotswap.workers, in its own
                                                      session, its scratch directory in
                                                      HOTSWAP_SCRATCH, hotswap's bytecode
                                                      cache where it needs one (system/
                                                      bytecode.py), stdout sent to stderr
    WorkerProcess.send(kind, job_id, parts)           frames out; a half-sent frame waits for
                                                      the write pipe (watched only then)
    WorkerProcess.close()                             every fd unregistered and closed
    WorkerProcess.death_error(job, exitcode, limit)   what its job's future fails with

Touched by the pool's manager thread only (manager.py), which owns the selector.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import selectors
import signal
import subprocess
import sys
import time
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
    WorkerStopped,
)
from hotswap.system import bytecode
from hotswap.workers import scratch
from hotswap.workers.inbox import Job, PoolConfig
from hotswap.workers.protocol import FrameDecoder, MessageKind, encode_frame

__all__ = ["WorkerProcess", "remote_error", "spawn"]

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


class WorkerProcess:
    """Parent-side state of one worker process. Touched by the manager thread only."""

    def __init__(self, slot: int, proc: subprocess.Popen[bytes], read_fd: int, write_fd: int,
                 selector: selectors.BaseSelector) -> None:
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
        self.job_started_s = 0.0  # when its job was sent (monotonic)
        self.jobs_done = 0  # jobs it finished (its first pays the process's one-time costs)
        self.deadline_s: float | None = None
        # Until when it takes only a measurement (its last job's ``hold_s``; monotonic)
        self.held_until = 0.0
        # In a warm-up step (it said so: WARMING): a job sent now waits for the step's end
        self.warming = False
        self.steps_done: list[str] = []  # the warm-up steps it has run (WARMING), in order
        self.kill_reason: tuple[str, Any] | None = None
        self.watching_write = False
        self.tmpdir: str | None = None  # its scratch directory (scratch.py), removed with it
        self._selector = selector

    def send(self, kind: MessageKind, job_id: int, *parts: bytes) -> None:
        self.outbuf.extend(memoryview(b) for b in encode_frame(kind, job_id, *parts) if b)
        self.flush()

    def flush(self) -> None:
        try:
            while self.outbuf:
                view = self.outbuf[0]
                n = os.write(self.write_fd, view)
                if n < len(view):
                    self.outbuf[0] = view[n:]
                    break
                self.outbuf.popleft()
        except BlockingIOError:
            pass
        except OSError as e:  # EPIPE: the worker is gone; its exit event follows
            if e.errno not in (errno.EPIPE, errno.EBADF):
                raise
            self.outbuf.clear()
        # The write fd is watched only while a frame is half-sent (the worker reads slowly).
        if self.outbuf and not self.watching_write:
            self._selector.register(self.write_fd, selectors.EVENT_WRITE, ("io", self))
            self.watching_write = True
        elif not self.outbuf and self.watching_write:
            self._selector.unregister(self.write_fd)
            self.watching_write = False

    def stop_reading(self) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(self.read_fd)

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd, self.pidfd):
            if fd >= 0:
                with contextlib.suppress(KeyError, ValueError):
                    self._selector.unregister(fd)
                with contextlib.suppress(OSError):
                    os.close(fd)

    def death_error(self, job: Job, exitcode: int, rss_limit: int | None) -> BaseException:
        """What ``job`` fails with now that this worker has exited (why it was killed, if it
        was)."""
        what, value = self.kill_reason or ("crash", 0)
        if what == "timeout":
            return JobTimeout(float(value), self.pid, job=job.name)
        if what == "memory":
            return MemoryLimitExceeded(self.pid, int(value), rss_limit or 0, job=job.name)
        if what == "shutdown":
            return PoolClosed(f"the pool was terminated while {job.name} ran")
        if what == "stopped":
            return WorkerStopped(self.pid, int(value), job=job.name)
        signal_name = signal.Signals(-exitcode).name if exitcode < 0 else None
        return WorkerCrashed(self.pid, exitcode, signal_name, job=job.name)


def spawn(slot: int, config: PoolConfig, selector: selectors.BaseSelector) -> WorkerProcess:
    """Start the worker of ``slot``, its pipes and pidfd registered with ``selector``."""
    parent_r, child_w = os.pipe()
    child_r, parent_w = os.pipe()
    env = dict(os.environ)
    extra = config.worker_env(slot) if callable(config.worker_env) else config.worker_env
    env.update(extra or {})
    # The worker must import hotswap even when the parent found it through sys.path tweaks.
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p
    )
    # A worker that would compile torch's sources at every start reads bytecode compiled once.
    env = bytecode.child_env(env)
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
    worker = WorkerProcess(slot, proc, parent_r, parent_w, selector)
    worker.tmpdir = tmpdir
    os.set_blocking(parent_r, False)
    os.set_blocking(parent_w, False)
    try:
        worker.pidfd = os.pidfd_open(proc.pid)
        selector.register(worker.pidfd, selectors.EVENT_READ, ("exit", worker))
    except (OSError, AttributeError):
        worker.pidfd = -1  # no pidfd: pipe EOF is the death signal
    selector.register(parent_r, selectors.EVENT_READ, ("io", worker))
    return worker


def remote_error(job: str, failure: dict[str, Any]) -> JobError:
    """The error a job that failed inside its worker resolves with."""
    if failure.get("kind") == "serialization":
        return SerializationFailed(job, failure.get("what") or "payload", "worker",
                                   f"{failure['type']}: {failure['message']}")
    return CompileFailed(job, failure["type"], failure["message"], failure["traceback"])
