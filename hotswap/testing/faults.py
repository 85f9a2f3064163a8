"""Jobs that misbehave on purpose: the documented hook for testing and stress-testing the pool.

Each is a named job (``"hotswap.testing.faults:NAME"``) that runs inside a worker, so faults are
injected where real compiles fail, without patching user code. Payloads are plain values.

    echo(x)               returns x                         (the no-op job)
    sleep(seconds)        sleeps, returns seconds
    raise_error(message)  raises RuntimeError(message)      -> CompileFailed
    exit(code)            os._exit(code)                    -> WorkerCrashed(exitcode=code)
    sigkill(_)            kills itself with SIGKILL         -> WorkerCrashed(signal_name="SIGKILL")
    segfault(_)           dereferences NULL through ctypes  -> WorkerCrashed(signal_name="SIGSEGV")
    hang(_)               sleeps forever                    -> JobTimeout (with timeout_s)
    allocate(nbytes)      touches nbytes of memory, hangs   -> MemoryLimitExceeded (with a limit)
    unpicklable_result(_) returns a lambda                  -> SerializationFailed(result, worker)
    spawn_sleeper(path)   starts `sleep 600`, writes its pid to path, hangs   (grandchild kill)
    staged(names)         emits one StageEvent per name, returns the names

``FailsToUnpickle()`` pickles in the parent and raises while being unpickled in the worker.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from typing import Any, NoReturn

from hotswap.workers.child import stage

__all__ = [
    "FailsToUnpickle", "allocate", "echo", "exit", "hang", "raise_error", "segfault", "sigkill",
    "sleep", "spawn_sleeper", "staged", "unpicklable_result",
]


def echo(x: Any) -> Any:
    return x


def sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def raise_error(message: str) -> NoReturn:
    raise RuntimeError(message)


def exit(code: int) -> NoReturn:
    os._exit(code)


def sigkill(_: Any = None) -> NoReturn:
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
    raise AssertionError("unreachable")


def segfault(_: Any = None) -> NoReturn:
    ctypes.string_at(0)
    raise AssertionError("unreachable")


def hang(_: Any = None) -> NoReturn:
    while True:
        time.sleep(3600)


def allocate(nbytes: int) -> NoReturn:
    block = bytearray(nbytes)  # zero-filled by calloc: touch every page so it is resident
    block[::4096] = b"\1" * len(range(0, nbytes, 4096))
    hang()


def unpicklable_result(_: Any = None) -> Any:
    return lambda: None


def spawn_sleeper(pid_path: str) -> NoReturn:
    child = subprocess.Popen(["sleep", "600"])
    with open(pid_path, "w") as f:
        f.write(str(child.pid))
    hang()


def staged(names: list[str]) -> list[str]:
    for name in names:
        with stage(name, job="staged"):
            time.sleep(0.001)
    return names


def _raise_on_unpickle() -> NoReturn:
    raise RuntimeError("FailsToUnpickle refuses to be unpickled")


class FailsToUnpickle:
    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_raise_on_unpickle, ())
