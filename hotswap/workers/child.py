"""The worker process: ``python -m hotswap.workers --read-fd R --write-fd W --parent-pid P``.

It is started as its own program, never through multiprocessing's spawn, so it never imports
the user's ``__main__`` (scripts without a guard, ``python -c``, stdin and notebooks all work).

Threads in the child::

    main thread      reads frames from R; runs one job at a time; writes results to W
    parent watcher   blocks on a pidfd of the parent; when the parent dies, kills this
                     process group (inductor's own compile subprocesses included) and exits
    job threads      (the job's own) may call stage(); writes to W are serialized by a lock

See protocol.py for the messages.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import pickle
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any, cast

from hotswap.system.priority import lower_priority
from hotswap.workers import scratch
from hotswap.workers.protocol import (
    Frame,
    FrameDecoder,
    MessageKind,
    StageEvent,
    decode_control,
    decode_job_request,
    encode_control,
    encode_frame,
    encode_result,
)

__all__ = ["beside_jobs", "current_job_id", "emit_stage", "in_worker", "is_beside_jobs",
           "lower_priority", "main", "resolve_job", "stage"]


class _Channel:
    """Blocking framed I/O over the two inherited pipe fds."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self._read_fd = read_fd
        self._write_fd = write_fd
        self._write_lock = threading.Lock()
        self._decoder = FrameDecoder()

    def recv(self) -> Frame | None:
        """The next frame (None at end of file), read straight into its payload's buffer."""
        while True:
            try:
                frames = self._decoder.read_from(self._read_fd)
            except EOFError:
                return None
            if frames:
                return frames[0]

    def pending(self, wait_s: float = 0.0) -> bool:
        """Whether a frame is waiting to be read, within ``wait_s`` (recv() leaves the
        decoder between frames)."""
        return bool(select.select([self._read_fd], [], [], wait_s)[0])

    def send(self, kind: MessageKind, job_id: int, *parts: bytes | memoryview) -> None:
        with self._write_lock:
            for chunk in encode_frame(kind, job_id, *parts):
                view = memoryview(chunk).cast("B")
                while view:
                    view = view[os.write(self._write_fd, view):]


_channel: _Channel | None = None
_job_id = 0


def in_worker() -> bool:
    """True inside a hotswap worker process."""
    return _channel is not None


_beside = threading.local()


def beside_jobs() -> None:
    """Mark this thread's work as no job's: a thread a job started for work that outlives it
    (the precompiled header, jobs/compile.py). Its inductor events are no job's stages, and
    the sources it writes ship in no job's entry (``is_beside_jobs``)."""
    _beside.on = True


def is_beside_jobs() -> bool:
    return getattr(_beside, "on", False)


def current_job_id() -> int:
    return _job_id


def emit_stage(name: str, start_s: float, end_s: float, **attrs: Any) -> None:
    """Report a stage measured elsewhere (e.g. from inductor's own timers). No-op outside a worker."""
    if _channel is None:
        return
    event = StageEvent(name, start_s, end_s, os.getpid(), _job_id, attrs)
    _channel.send(MessageKind.STAGE_EVENT, _job_id, event.to_wire())


@contextlib.contextmanager
def stage(name: str, **attrs: Any) -> Iterator[None]:
    """Time a block of a job and stream it to the parent as a StageEvent, even if it raises."""
    start = time.monotonic()
    try:
        yield
    finally:
        emit_stage(name, start, time.monotonic(), **attrs)


_job_cache: dict[str, Callable[[Any], Any]] = {}


def resolve_job(name: str) -> Callable[[Any], Any]:
    """Import ``"package.module:function"``. Raises ValueError / LookupError naming the fix."""
    fn = _job_cache.get(name)
    if fn is not None:
        return fn
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr or ":" in attr:
        raise ValueError(
            f"job {name!r} is not of the form 'package.module:function'; jobs are named "
            "functions importable in the worker, not closures"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise LookupError(
            f"job {name!r}: module {module_name!r} cannot be imported ({e}); put it on sys.path "
            "or in an installed package"
        ) from e
    found = getattr(module, attr, None)
    if not callable(found):
        raise LookupError(f"job {name!r}: {module_name!r} has no callable named {attr!r}")
    fn = cast(Callable[[Any], Any], found)
    _job_cache[name] = fn
    return fn


def _failure(kind: str, exc: BaseException, what: str = "") -> bytes:
    return encode_control(
        {
            "kind": kind,
            "what": what,
            "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
            "message": str(exc),
            "traceback": "".join(traceback.format_exception(exc)),
        }
    )


def _run_job(channel: _Channel, frame: Frame) -> None:
    """Run one job. Never raises: a job that ends without a reply would leave a future pending."""
    global _job_id
    _job_id = frame.job_id
    try:
        job, request = decode_job_request(frame.payload)
        fn = resolve_job(job)
        try:
            with stage("worker_deserialize"):
                payload = pickle.loads(request)
        except BaseException as e:
            channel.send(MessageKind.JOB_FAILED, frame.job_id, _failure("serialization", e, "payload"))
            return
        try:
            result = fn(payload)
        except BaseException as e:
            channel.send(MessageKind.JOB_FAILED, frame.job_id, _failure("exception", e))
            return
        try:
            parts = encode_result(result)
        except BaseException as e:
            channel.send(MessageKind.JOB_FAILED, frame.job_id, _failure("serialization", e, "result"))
            return
        channel.send(MessageKind.JOB_RESULT, frame.job_id, *parts)
    except BaseException as e:  # the job machinery itself (decode, resolve): still reply
        channel.send(MessageKind.JOB_FAILED, frame.job_id, _failure("exception", e))
    finally:
        _job_id = 0


_READY_ROUND_TRIP_S = 0.1
_IDLE_BEFORE_WARM_S = 1.0


def _warm(entry: str, run: Callable[[str], Any]) -> bool:
    """Whether ``entry`` ran (else the worker goes on without it, and says why)."""
    try:
        run(entry)
    except Exception as e:  # a missing optional module must not stop the worker
        print(f"hotswap worker {os.getpid()}: could not pre-warm {entry}: {e}", file=sys.stderr)
        return False
    return True


def _install_templates(name: str) -> None:
    importlib.import_module(name).install()


def _kill_own_group_and_exit() -> None:
    # Children that left our process group would survive killpg; kill them by name first.
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
    except Exception:
        pass
    with contextlib.suppress(OSError):
        os.killpg(os.getpgid(0), signal.SIGKILL)
    os._exit(0)


def _watch_parent(parent_pid: int) -> None:
    try:
        pidfd = os.pidfd_open(parent_pid)
    except (OSError, AttributeError):
        pidfd = -1
    if pidfd >= 0:
        # A pidfd becomes readable when the process exits: an event, not a sleep loop.
        select.select([pidfd], [], [])
    else:
        while os.getppid() == parent_pid:
            time.sleep(0.2)
    _kill_own_group_and_exit()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hotswap.workers")
    parser.add_argument("--read-fd", type=int, required=True)
    parser.add_argument("--write-fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    if os.getppid() != args.parent_pid:
        return 0  # the parent died before we started
    scratch.enter()  # what the processes we start leave behind goes with us
    # The parent owns interrupts; a ^C in its terminal must not kill a compile mid-write.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(
        target=_watch_parent, args=(args.parent_pid,), name="hotswap-parent-watch", daemon=True
    ).start()
    # Our pipe ends must not leak into processes the job starts.
    os.set_inheritable(args.read_fd, False)
    os.set_inheritable(args.write_fd, False)

    global _channel
    channel = _Channel(args.read_fd, args.write_fd)
    init_frame = channel.recv()
    if init_frame is None or init_frame.kind != MessageKind.INIT:
        return 0
    init = decode_control(init_frame.payload)
    # What a compile writes into inductor's folders travels in signed cache entries only where
    # no one else may write it (engine/loading/kernel_files.py): never group-writable here,
    # whatever the caller's umask (002 under user-private groups).
    os.umask(os.umask(0o022) | 0o022)
    if init.get("nice") or init.get("idle"):
        lower_priority(int(init.get("nice", 0)), bool(init.get("idle")))
    for entry in reversed(init.get("sys_path", [])):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    start = time.monotonic()
    entries = init.get("warm_modules", [])
    for entry in entries:
        if ":" not in entry:
            if entry.startswith("torch._inductor"):  # its kernel templates, compiled once
                _warm("hotswap.engine.loading.templates", _install_templates)
            _warm(entry, importlib.import_module)
    channel.send(
        MessageKind.READY, 0, encode_control({"pid": os.getpid(), "warm_s": time.monotonic() - start})
    )
    _channel = channel
    # "module:function" entries: warm-up steps, while no job waits (a job pays for itself).
    # A job queued before we were ready comes within the pool's round trip to READY. Steps a
    # job came before run once no job came for _IDLE_BEFORE_WARM_S after the last one: a
    # worker that serves for hours (the compile service's) is not left cold for good by a job
    # that came early, and a process's graphs, which come in a burst, do not wait for a step.
    # A step whose function has an ``idle_s`` waits for the worker to idle that long (a step a
    # job need not have done first, which a job coming meanwhile would wait for).
    steps = [entry for entry in entries if ":" in entry]
    _warm_while_idle(channel, steps, _READY_ROUND_TRIP_S)
    while True:
        frame = channel.recv()
        if frame is None or frame.kind == MessageKind.SHUTDOWN:
            return 0
        if frame.kind == MessageKind.JOB_REQUEST:
            _run_job(channel, frame)
            _warm_while_idle(channel, steps, _IDLE_BEFORE_WARM_S)


def _warm_while_idle(channel: _Channel, steps: list[str], idle_s: float) -> None:
    """Run warm-up ``steps`` in order (taking each from the list), each once the worker has
    idled ``idle_s`` or the step's own ``idle_s`` (run neither a job nor a step), until a
    frame waits."""
    idle_since = time.monotonic()
    while steps:
        try:
            step = resolve_job(steps[0])
        except Exception:
            step = None  # _warm says why
        wait_s = max(idle_s, getattr(step, "idle_s", 0.0)) - (time.monotonic() - idle_since)
        if channel.pending(max(wait_s, 0.0)):
            return
        # The pool sends jobs elsewhere while it may, and starts a job's clock at the end
        channel.send(MessageKind.WARMING, 0, encode_control({"busy": True}))
        name, ran = steps.pop(0), False
        try:
            ran = _warm(name, lambda name: resolve_job(name)(None))
        finally:  # the step, where it ran: the pool tells a warm worker by it (WorkerInfo)
            channel.send(MessageKind.WARMING, 0,
                         encode_control({"busy": False, **({"step": name} if ran else {})}))
        idle_since = time.monotonic()
