"""The compile service: warm workers that every hotswap process of this user and build shares.

    main thread       accept() on <dir>/<stamp>.sock (1 s ticks: idle exit, stop request)
        --> one hotswap-service-conn thread per connection: SO_PEERCRED, the challenge,
            one request (wire.py):
              JobRequest   --> LocalExecutor.submit(runner_for(job), (job, payload bytes))
                               --> a warm worker unpickles and runs the job
                               wait for: the job's end (a pipe its future's callback writes)
                                     or the connection's end (the client died or cancelled:
                                     the job is cancelled, its worker killed and replaced)
                           <-- JobResult | JobFailed | Refused (another build)
              StatusRequest <-- Status;  StopRequest <-- Status, then the service exits
    the pool's manager thread (hotswap.workers) owns the workers; nothing here blocks it

The service exits after ``idle_exit_s`` with no job, on a StopRequest, or on SIGTERM; it
removes its socket and pid file only if they are still its own (a client may have replaced a
socket it found stale). Its workers watch it and exit with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import signal
import socket
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, wait
from typing import Any

from hotswap.executors.base import BENCH_JOB, COMPILE_JOB, MEASURE_PICKLED, WARM_COMPILE_JOB
from hotswap.executors.local import LocalExecutor, LocalPools
from hotswap.service.parts import PartsFuture, submit_parts
from hotswap.service.place import Place, authkey
from hotswap.service.wire import (
    HANDSHAKE_TIMEOUT_S,
    PeerRefused,
    accept,
    decode,
    encode,
    encode_result,
    error_to_wire,
)
from hotswap.system import bytecode
from hotswap.system.proctree import tree_rss_bytes
from hotswap.workers import WorkerInfo

__all__ = ["RUN_PICKLED", "Service", "install_signals", "parts_for", "runner_for"]

log = logging.getLogger("hotswap.service")

# What the service's workers run: the client's job on the client's pickled payload.
RUN_PICKLED = "hotswap.service.jobs:run_pickled"


def runner_for(job: str) -> str:
    """The pool job that runs a client's ``job``: a benchmark as MEASURE_PICKLED, which the
    pool queues ahead of compiles (WorkerPool's ``measures``), anything else as RUN_PICKLED."""
    return MEASURE_PICKLED if job == BENCH_JOB else RUN_PICKLED


class _Signal:
    """A pipe a future's callback writes once, so that a thread can wait for it and for a
    connection together (``multiprocessing.connection.wait``)."""

    def __init__(self) -> None:
        self.r, self._w = os.pipe()
        self._lock = threading.Lock()

    def set(self, *_: object) -> None:
        with self._lock:
            if self._w >= 0:
                with contextlib.suppress(OSError):
                    os.write(self._w, b"\0")

    def close(self) -> None:
        with self._lock:
            os.close(self.r)
            os.close(self._w)
            self._w = -1


# Workers the service keeps started with no job waiting (at most its pool's size): a graph's
# pieces and its whole graph (regions="auto" in async, docs/regions.md) compile side by side,
# where one warm worker took them one after another and the whole graph waited 3.2 s for the
# pieces (GPT-2, H100). A GPU worker holds a CUDA context and inductor's compile processes.
WARM_WORKERS = 2


class Service:
    """Serves jobs of clients of this uid on ``place.socket`` until idle for ``idle_exit_s``
    or stopped. ``serve_forever()`` returns once it has stopped its workers."""

    def __init__(self, place: Place, *, idle_exit_s: float, workers: int | None = None,
                 first_job_within_s: float | None = None) -> None:
        self.place = place
        self.idle_exit_s = idle_exit_s
        # Until a first job comes, the idle exit is this (a service started early, as hotswap
        # was imported, for a process that then never sent it a job: service/early.py).
        self.first_job_within_s = first_job_within_s
        self._had_job = False
        self._key = authkey(place, create=True)
        # Its workers yield to every process: its callers are the other processes.
        self._pools = LocalPools(yield_to="all", warm=WARM_WORKERS)
        self._executor = LocalExecutor(workers, (), shared=self._pools)
        self._lock = threading.Lock()
        self._split_lock = threading.Lock()
        self._sent: set[Any] = set()  # pool jobs not done (a job's parts, or the job)
        self._connections = 0  # being served (a job's among them)
        self._jobs_running = 0
        self._last_job = time.monotonic()
        self._started = time.monotonic()
        self.jobs_served = self.jobs_failed = self.jobs_cancelled = 0
        self._stop = threading.Event()
        self._inode = -1

    def stop(self) -> None:
        self._stop.set()

    def serve_forever(self) -> None:
        listener = self._bind()
        # Workers warm before the first job, while the socket already answers: a pool's start
        # can take seconds (its first workers write their bytecode), longer than a client
        # waits for the status it asks for on connecting.
        threading.Thread(target=self._pools.pool, args=(self._executor.size,), daemon=True,
                         name="hotswap-service-warm").start()
        log.info("hotswap service %s (pid %d) serving %s", self.place.stamp, os.getpid(),
                 self.place.socket)
        listener.settimeout(min(1.0, max(0.05, self.idle_exit_s / 4)))
        try:
            while not self._stop.is_set():
                try:
                    sock, _ = listener.accept()
                except TimeoutError:
                    why = self._idle()
                    if why:
                        log.info("hotswap service: %s; exiting", why)
                        break
                    continue
                except OSError as e:
                    log.warning("hotswap service: accept failed: %s", e)
                    continue
                threading.Thread(target=self._serve, args=(sock,), daemon=True,
                                 name="hotswap-service-conn").start()
        finally:
            self._unbind(listener)
            self._pools.shutdown(wait=True)
            log.info("hotswap service %s (pid %d) stopped", self.place.stamp, os.getpid())

    def _parts(self, request: dict[str, Any], job: str) -> int:
        """How many parts a compile job is split into: as many as it asks for
        (``CompileRequest.parts``: the client reads it from the request it pickled), at most
        as many workers as are warm and free now (``_warm``), else 1, the whole graph in one
        worker. A part that waits for a worker, or that pays a fresh worker's first compile,
        makes the whole graph wait: on the H200, the first process ever's graph (the service
        just started, its second worker still in its warm-up) served 0.9-4.7 s later in
        parts than whole."""
        parts = request.get("parts", 1)
        if job != COMPILE_JOB or not isinstance(parts, int) or isinstance(parts, bool) \
                or parts < 2:
            return 1
        pool = self._pools.running(self._executor.size)
        queued = sum(not f.running() and not f.done() for f in list(self._sent))
        return parts_for(parts, pool.workers_info() if pool is not None else [], queued)

    def status(self) -> dict[str, Any]:
        pool = self._pools.running(self._executor.size)
        workers = pool.workers_info() if pool is not None else []
        with self._lock:
            counts = {"jobs_served": self.jobs_served, "jobs_failed": self.jobs_failed,
                      "jobs_cancelled": self.jobs_cancelled, "jobs_running": self._jobs_running,
                      # while no job came yet: it exits this long after its start without one
                      "first_job_within_s": None if self._had_job else self.first_job_within_s}
        return {"kind": "status", "stamp": self.place.stamp, "pid": os.getpid(),
                "uid": os.geteuid(), "dir": str(self.place.dir),
                "uptime_s": round(time.monotonic() - self._started, 3),
                "idle_exit_s": self.idle_exit_s,
                "workers": [{"pid": w.pid, "ready": w.ready, "busy": w.busy, "warm": _warm(w)}
                            for w in workers],
                "rss_bytes": tree_rss_bytes(os.getpid()),
                # the bytecode folder it and its workers read (bytecode.child_env), which a
                # client's load path may read too (bytecode.offer)
                "pycache": os.environ.get(bytecode.PREFIX_ENV),
                # the folder its workers keep inductor's compiled templates in, which a
                # client's load path reads what its own lacks from (bytecode.offer_templates)
                "templates": os.path.realpath(where) if (where := bytecode.templates_folder())
                else None,
                **counts}

    # ------------------------------------------------------------------ the socket

    def _bind(self) -> socket.socket:
        """Listen on a new name, then rename it over the socket's: a client finds the old
        socket or this one, never none. Mode 0600 (the folder is 0700 too)."""
        fresh = self.place.dir / f".{self.place.stamp}.{os.getpid()}.sock"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(fresh)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        umask = os.umask(0o177)
        try:
            listener.bind(str(fresh))
        finally:
            os.umask(umask)
        listener.listen(128)
        os.rename(fresh, self.place.socket)
        self._inode = os.lstat(self.place.socket).st_ino
        fd = os.open(self.place.pid_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                     0o600)
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return listener

    def _unbind(self, listener: socket.socket) -> None:
        """Remove the socket and pid file if they are still this service's."""
        with contextlib.suppress(OSError):
            if os.lstat(self.place.socket).st_ino == self._inode:
                os.unlink(self.place.socket)
        with contextlib.suppress(OSError, ValueError):
            if int(self.place.pid_file.read_text()) == os.getpid():
                os.unlink(self.place.pid_file)
        listener.close()

    def _idle(self) -> str:
        """Why the service exits now ("" while it stays)."""
        with self._lock:
            if self._connections:
                return ""
            now = time.monotonic()
            if (not self._had_job and self.first_job_within_s is not None
                    and now - self._started >= self.first_job_within_s):
                return f"no first job within {self.first_job_within_s:g} s of its start"
            if now - self._last_job >= self.idle_exit_s:
                return f"no job for {self.idle_exit_s:g} s"
            return ""

    # ------------------------------------------------------------------ one connection

    def _serve(self, sock: socket.socket) -> None:
        with self._lock:  # a connection is activity: its job may follow its status request
            self._connections += 1
        try:
            self._serve_one(sock)
        finally:
            with self._lock:
                self._connections -= 1
                self._last_job = time.monotonic()

    def _serve_one(self, sock: socket.socket) -> None:
        try:
            conn = accept(sock, self._key)
        except (PeerRefused, AuthenticationError) as e:
            log.warning("hotswap service: connection refused: %s", e)
            return
        except (OSError, EOFError) as e:
            log.info("hotswap service: a client left during the challenge (%s)", e)
            return
        with conn:
            try:
                if not conn.poll(HANDSHAKE_TIMEOUT_S):  # a client stopped or hung: let go
                    log.info("hotswap service: no request within %g s", HANDSHAKE_TIMEOUT_S)
                    return
                request = decode(conn.recv_bytes())
            except (OSError, EOFError, ValueError) as e:
                log.info("hotswap service: no request read (%s)", e)
                return
            kind = request["kind"]
            if kind == "job":
                self._run(conn, request)
            elif kind in ("status", "stop", "keep"):
                if kind == "keep":  # started by name: it stays until its idle exit
                    with self._lock:
                        self.first_job_within_s = None
                    log.info("hotswap service: kept: no first-job limit")
                with contextlib.suppress(OSError):
                    conn.send_bytes(encode(self.status()))
                if kind == "stop":
                    log.info("hotswap service: asked to stop")
                    self._stop.set()
            else:
                log.warning("hotswap service: unknown request %r", kind)

    def _run(self, conn: Connection[bytes, bytes], request: dict[str, Any]) -> None:
        job = str(request.get("job", ""))
        if request.get("stamp") != self.place.stamp:
            with contextlib.suppress(OSError):
                conn.send_bytes(encode({"kind": "refused", "reason": (
                    f"the compile service serves build {self.place.stamp}, not "
                    f"{request.get('stamp')}")}))
            return
        with self._lock:
            self._jobs_running += 1
            self._had_job = True
        done = _Signal()
        try:
            try:
                # Decided and sent under one lock, so that a job coming at the same moment
                # counts these parts as taking their workers.
                with self._split_lock:
                    parts = self._parts(request, job)
                    future = (submit_parts(self._executor, job, request["payload"],
                                           request.get("timeout_s"), parts) if parts > 1 else
                              self._executor.submit(runner_for(job), (job, request["payload"]),
                                                    request.get("timeout_s")))
                    for sent in future.parts if isinstance(future, PartsFuture) else [future]:
                        self._sent.add(sent)
                        sent.add_done_callback(self._sent.discard)
            except Exception as e:  # the pool is closing, or the limit is malformed
                with contextlib.suppress(OSError):
                    conn.send_bytes(encode({"kind": "failed", "error": error_to_wire(e, job)}))
                return
            future.add_done_callback(done.set)
            ready = wait([conn, done.r])
            if done.r not in ready:  # the client closed its end: it died or cancelled
                future.cancel()
                with self._lock:
                    self.jobs_cancelled += 1
                return
            reply = self._reply(future, job)
            with contextlib.suppress(OSError):
                conn.send_bytes(reply)
        finally:
            done.close()
            with self._lock:
                self._jobs_running -= 1

    def _reply(self, future: Any, job: str) -> bytes:
        events = [dataclasses.asdict(e) for e in getattr(future, "stage_events", [])]
        error = future.exception()
        if error is None:
            try:
                result = _out_of_band(future.merged() if isinstance(future, PartsFuture)
                                      else future.result())
                try:
                    reply = encode_result({"kind": "result", "events": events}, result)
                except (TypeError, ValueError):  # an event's attrs msgpack cannot carry
                    reply = encode_result({"kind": "result", "events": []}, result)
            except Exception as e:
                error = e
            else:
                with self._lock:
                    self.jobs_served += 1
                return reply
        with self._lock:
            self.jobs_failed += 1
        fields = error_to_wire(error, job)
        if "job" in fields:  # the worker ran runner_for(job); the client asked for ``job``
            fields["job"] = job
        return encode({"kind": "failed", "error": fields})


def parts_for(asked: int, workers: list[WorkerInfo], queued: int = 0) -> int:
    """``asked`` parts, at most one per warm free worker, less the jobs ``queued`` for one
    (sent, on no worker yet); 1 (whole) where fewer than two."""
    free = sum(_warm(w) and not w.busy for w in workers) - queued
    return min(asked, free) if free >= 2 else 1


def _warm(worker: WorkerInfo) -> bool:
    """Ready, in no warm-up step, and past its first compile's one-time costs: it ran a job
    or the warm-up compile (a first compile in a process pays seconds of lazy set-up)."""
    return worker.ready and not worker.warming and (
        worker.jobs_done > 0 or WARM_COMPILE_JOB in worker.steps_done)


def _out_of_band(result: Any) -> Any:
    """A compile result from the pool holds its artifact as a view into the frame it came in
    (a merged one, as bytes): sent on out of band, it reaches the client as a view into the
    reply it reads, never copied there (wire.encode_result)."""
    if isinstance(result, dict) and isinstance(result.get("entry"), bytes | memoryview):
        return {**result, "entry": pickle.PickleBuffer(result["entry"])}
    return result


def install_signals(service: Service) -> None:
    """SIGTERM and SIGINT stop the service as a StopRequest does."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: service.stop())
