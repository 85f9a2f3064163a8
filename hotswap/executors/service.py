"""The compile-service executor: jobs run in this user's machine-wide compile service.

    ServiceExecutor.submit(job, payload) --pickle--> ServiceLink.when_ready(target)
        hotswap-service-link thread: control.ensure(): find, or start, this build's service
        hotswap-service-send threads (4): connect (SO_PEERCRED, challenge), send JobRequest
        hotswap-service-replies thread: wait() on every job's connection at once:
            JobResult / JobFailed       --> the future (a pool error as the pool gives it)
            the connection ends         --> ExecutorUnavailable: the service died; the local
                                            pool takes the job, a new service is started
            no reply by timeout_s + REPLY_GRACE_S, or the service stopped (SIGSTOP) for
            STOPPED_AFTER_S             --> ExecutorUnavailable: the local pool takes the job;
                                            the service is left alone for RETRY_AFTER_S
            the future cancelled        --> its connection closed: the service cancels the job

The registry opens one per process for ``"service://"`` (``executor="service://"``, or
HOTSWAP_SERVICE=on) and puts the local pool behind it (``FallbackExecutor``): a service that
cannot be used (a folder or socket another user could have made, a service of another
build, one that does not answer) never fails a job and never hangs its caller; ``refused``
and ``note`` say why, and the reason is logged once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, wait
from typing import Any

from hotswap.errors import PoolClosed, SerializationFailed
from hotswap.executors import registry
from hotswap.executors.base import COMPILE_JOB, ExecutorUnavailable
from hotswap.service import control
from hotswap.service.place import Place, UntrustedPath, authkey, find_place
from hotswap.service.wire import (
    PeerRefused,
    connect,
    decode_reply,
    encode,
    error_from_wire,
)
from hotswap.system import bytecode, cores
from hotswap.system.proctree import is_stopped
from hotswap.workers import JobFuture, StageEvent
from hotswap.workers.inbox import resolve
from hotswap.workers.protocol import decode_result

__all__ = ["REPLY_GRACE_S", "RETRY_AFTER_S", "STOPPED_AFTER_S", "ServiceExecutor",
           "ServiceLink"]

log = logging.getLogger("hotswap")

# A job's reply may come this long after its timeout_s (the service's pool enforces that).
REPLY_GRACE_S = 5.0
# A service that did not answer is tried again after this long (jobs go to the local pool).
RETRY_AFTER_S = 30.0
# A service stopped (SIGSTOP) for this long with jobs of ours is given up on, as the local
# pool gives up on a stopped worker.
STOPPED_AFTER_S = 2.0


@dataclass(frozen=True)
class _Target:
    place: Place
    key: bytes
    pid: int


class ServiceLink:
    """Whether this process may use the service, and where it is: ``client(timeout_s)``
    waits for it (None: not used now; ``refused``/``note`` say why)."""

    def __init__(self, name: str = "service://") -> None:
        self.name = name
        self.closed = False
        self._lock = threading.Lock()
        self._refused = ""  # for good: another user's files, another build
        self._why = ""  # for now: not answering, gone, failed to start
        self._retry_at = 0.0
        self._attempt: Future[_Target | None] = Future()
        self._start_attempt(self._attempt)

    @property
    def refused(self) -> str:
        """Why the service is not used, for good ("" while it is or may be)."""
        return self._refused

    @property
    def note(self) -> str:
        """Why jobs go to the local pool now ("" when they go to the service)."""
        return self._refused or self._why

    def client(self, timeout_s: float | None = None) -> _Target | None:
        try:
            return self._current().result(timeout_s)
        except TimeoutError:
            return None

    def when_ready(self, fn: Any) -> None:
        """``fn(target or None)`` once the current attempt is settled."""
        self._current().add_done_callback(lambda f: fn(f.result()))

    def _current(self) -> Future[_Target | None]:
        with self._lock:
            attempt = self._attempt
            if (attempt.done() and attempt.result() is None and not self._refused
                    and not self.closed and time.monotonic() >= self._retry_at):
                attempt = self._attempt = Future()
                self._start_attempt(attempt)
            return attempt

    def _start_attempt(self, attempt: Future[_Target | None]) -> None:
        threading.Thread(target=self._connect, args=(attempt,), daemon=True,
                         name="hotswap-service-link").start()

    def _connect(self, attempt: Future[_Target | None]) -> None:
        try:
            place = find_place(create=True)
            status = control.ensure(place)
            target = _Target(place, authkey(place, create=False), int(status["pid"]))
            if isinstance(status.get("pycache"), str):
                bytecode.offer(status["pycache"])
            if isinstance(status.get("templates"), str):
                bytecode.offer_templates(status["templates"])
        except (UntrustedPath, PeerRefused, control.OtherBuild) as e:
            self.refuse(str(e))
            attempt.set_result(None)
            return
        except Exception as e:  # not answering, failed to start: again later
            self.unavailable(f"{type(e).__name__}: {e}")
            attempt.set_result(None)
            return
        with self._lock:
            self._why = ""
        attempt.set_result(target)

    def refuse(self, why: str) -> None:
        """Stop using the service for good (said once)."""
        with self._lock:
            if self._refused:
                return
            self._refused = why
        log.warning("hotswap: compile service not used (%s); compiling in the local worker "
                    "pool", why)

    def unavailable(self, why: str) -> None:
        """The service cannot take jobs now: the local pool takes them for RETRY_AFTER_S."""
        with self._lock:
            said = self._why == why
            self._why, self._retry_at = why, time.monotonic() + RETRY_AFTER_S
            self._expire_locked()
        if not said:
            log.warning("hotswap: compile service unavailable (%s); compiling in the local "
                        "worker pool", why)

    def lost(self, target: _Target, why: str) -> None:
        """The service ``target`` is gone: the next job finds or starts another at once."""
        with self._lock:
            if self._attempt.done() and self._attempt.result() is target:
                self._why, self._retry_at = why, 0.0
                self._expire_locked()

    def _expire_locked(self) -> None:
        if self._attempt.done() and self._attempt.result() is not None:
            self._attempt = Future()
            self._attempt.set_result(None)


@dataclass
class _Pending:
    outer: JobFuture
    job: str
    target: _Target
    deadline: float | None
    stopped_since: float | None = None


class _Replies:
    """The thread that reads every job's reply (the only one that reads or closes a job's
    connection once it is sent)."""

    def __init__(self, link: ServiceLink) -> None:
        self._link = link
        self._lock = threading.Lock()
        self._pending: dict[Connection[bytes, bytes], _Pending] = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="hotswap-service-replies")
        self._thread.start()

    def add(self, conn: Connection[bytes, bytes], pending: _Pending) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._pending[conn] = pending
        self.wake()
        return True

    def wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")

    def close(self) -> None:
        """Fail every pending job with PoolClosed; closing their connections cancels them
        in the service."""
        with self._lock:
            self._closed = True
        self.wake()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    break
                pending = dict(self._pending)
            now = time.monotonic()
            deadlines = [p.deadline for p in pending.values() if p.deadline is not None]
            timeout = min([max(0.0, d - now) for d in deadlines], default=None)
            if pending:  # look for a stopped service at least once a second
                timeout = min(timeout if timeout is not None else 1.0, 1.0)
            ready = wait([self._wake_r, *pending], timeout)
            if self._wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
            for conn, p in pending.items():
                if conn in ready:
                    self._finish(conn, p, self._receive(conn, p))
                elif p.outer.cancelled():
                    self._finish(conn, p, None)
                else:
                    self._check_alive(conn, p)
        with self._lock:
            pending, self._pending = self._pending, {}
        for conn, p in pending.items():
            conn.close()
            resolve(p.outer, error=PoolClosed("hotswap was shut down"))
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _finish(self, conn: Connection[bytes, bytes], p: _Pending,
                outcome: tuple[Any, BaseException | None] | None) -> None:
        with self._lock:
            self._pending.pop(conn, None)
        conn.close()
        if outcome is not None:
            result, error = outcome
            resolve(p.outer, result=result, error=error)

    def _check_alive(self, conn: Connection[bytes, bytes], p: _Pending) -> None:
        now = time.monotonic()
        if is_stopped(p.target.pid):
            p.stopped_since = p.stopped_since or now
        else:
            p.stopped_since = None
        if p.deadline is not None and now >= p.deadline:
            why = f"the compile service (pid {p.target.pid}) did not answer {p.job} in time"
        elif p.stopped_since is not None and now - p.stopped_since >= STOPPED_AFTER_S:
            why = f"the compile service (pid {p.target.pid}) is stopped (SIGSTOP?)"
        else:
            return
        self._link.unavailable(why)
        self._finish(conn, p, (None, ExecutorUnavailable(why)))

    def _receive(self, conn: Connection[bytes, bytes],
                 p: _Pending) -> tuple[Any, BaseException | None]:
        try:
            reply, framed = decode_reply(conn.recv_bytes())
        except (EOFError, OSError, ValueError) as e:
            why = (f"the compile service (pid {p.target.pid}) went away while running "
                   f"{p.job} ({type(e).__name__})")
            self._link.lost(p.target, why)
            return None, ExecutorUnavailable(why)
        kind = reply["kind"]
        if kind == "result":
            with contextlib.suppress(TypeError, ValueError):
                p.outer.stage_events = [StageEvent(**e) for e in reply.get("events", [])]
            try:
                if framed is None:
                    raise ValueError("a job result with no result framed after its header")
                result = decode_result(framed)  # the artifact: a view into the reply read
            except Exception as e:
                return None, SerializationFailed(p.job, "result", "parent", repr(e))
            if p.job == COMPILE_JOB:
                registry.count("remote_compiles")
            return result, None
        if kind == "failed":
            error = error_from_wire(reply["error"])
            if isinstance(error, PoolClosed):  # the service is stopping: run it elsewhere
                self._link.lost(p.target, f"the compile service (pid {p.target.pid}) stopped")
                return None, ExecutorUnavailable(str(error))
            return None, error
        why = str(reply.get("reason", f"the compile service answered {kind!r}"))
        self._link.refuse(why)
        return None, ExecutorUnavailable(why)


class ServiceExecutor:
    """The ``Executor`` of this user's compile service (``spec``: "service://"). A job it
    cannot send fails with ``ExecutorUnavailable``: the registry puts the local pool behind
    it. ``shutdown()`` fails its pending jobs with ``PoolClosed`` (the service cancels them)
    and leaves the service running for other processes."""

    def __init__(self, spec: str = "service://") -> None:
        self.cluster = ServiceLink(spec)
        self._replies = _Replies(self.cluster)
        self._send = ThreadPoolExecutor(max_workers=4, thread_name_prefix="hotswap-service-send")
        self._closed = False

    @property
    def note(self) -> str:
        return self.cluster.note

    def submit(self, job: str, payload: Any, timeout_s: float | None) -> JobFuture:
        outer = JobFuture(job, -1)
        if self._closed:
            resolve(outer, error=PoolClosed("hotswap was shut down"))
            return outer
        try:
            data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            resolve(outer, error=SerializationFailed(job, "payload", "parent", repr(e)))
            return outer
        outer.add_done_callback(lambda f: self._replies.wake() if f.cancelled() else None)
        # The service's workers run on this machine's cores while ours is among their jobs
        cores.add_running(self, 1)
        outer.add_done_callback(lambda _: cores.add_running(self, -1))
        # A compile that asks to be split across the service's warm workers (service/parts.py)
        parts = payload.get("parts", 1) if job == COMPILE_JOB and isinstance(payload, dict) else 1

        def ready(target: _Target | None) -> None:
            try:
                self._send.submit(self._dispatch_or_fail, target, outer, job, data, timeout_s,
                                  parts)
            except RuntimeError:  # shut down meanwhile
                resolve(outer, error=PoolClosed("hotswap was shut down"))

        self.cluster.when_ready(ready)
        return outer

    def shutdown(self, wait: bool = True) -> None:
        self._closed = True
        self.cluster.closed = True
        self._send.shutdown(wait=wait, cancel_futures=True)
        self._replies.close()
        cores.set_running(self, 0)  # also jobs whose send was cancelled, never answered

    def _dispatch_or_fail(self, target: _Target | None, outer: JobFuture, job: str,
                          data: bytes, timeout_s: float | None, parts: int) -> None:
        """``_dispatch``, the job failed with what it raised: an executor's thread would
        swallow it, and the caller would wait for the job (and count it running) for good."""
        try:
            self._dispatch(target, outer, job, data, timeout_s, parts)
        except Exception as e:
            if not outer.done():
                resolve(outer, error=ExecutorUnavailable(
                    f"sending the job to the compile service failed: {type(e).__name__}: {e}"))

    def _dispatch(self, target: _Target | None, outer: JobFuture, job: str, data: bytes,
                  timeout_s: float | None, parts: int = 1) -> None:
        """On a send thread: connect, send the job, hand the connection to the reader."""
        if outer.done():
            return
        if target is None:
            resolve(outer, error=ExecutorUnavailable(self.cluster.note or "no compile service"))
            return
        try:
            conn = connect(target.place.socket, target.key)
        except (ConnectionRefusedError, FileNotFoundError) as e:
            why = f"the compile service (pid {target.pid}) is gone ({type(e).__name__})"
            self.cluster.lost(target, why)
            resolve(outer, error=ExecutorUnavailable(why))
            return
        except PeerRefused as e:
            self.cluster.refuse(str(e))
            resolve(outer, error=ExecutorUnavailable(str(e)))
            return
        except (OSError, EOFError, AuthenticationError) as e:
            why = f"the compile service (pid {target.pid}) did not answer ({type(e).__name__})"
            self.cluster.unavailable(why)
            resolve(outer, error=ExecutorUnavailable(why))
            return
        try:
            conn.send_bytes(encode({"kind": "job", "stamp": target.place.stamp, "job": job,
                                    "payload": data, "timeout_s": timeout_s,
                                    "parts": parts}))
        except OSError as e:
            conn.close()
            why = f"the compile service (pid {target.pid}) went away ({type(e).__name__})"
            self.cluster.lost(target, why)
            resolve(outer, error=ExecutorUnavailable(why))
            return
        outer.set_running()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s + REPLY_GRACE_S
        if not self._replies.add(conn, _Pending(outer, job, target, deadline)):
            conn.close()
            resolve(outer, error=PoolClosed("hotswap was shut down"))
