"""The cores this process's compile workers use now, and the intra-op threads the graphs
hotswap answers eagerly run with meanwhile.

A caller whose intra-op threads fill every core (torch's default: one per core) leaves a
worker none. Torch's OpenMP threads spin-wait between parallel regions: corpus GPT-2 called
every 2 ms on the 2-core box kept 1.36 cores busy with two intra-op threads and 0.37 with one,
its call taking 1.10 ms and 1.16 ms. The workers run below the caller (priority.py), so they
got scraps of a core, were raised (starvation.py), and then shared the cores with spinning
threads: its compiled code served at 1.338x torch.compile's first call, and at 0.712x with
the eager answers on one thread (medians of three, BENCHMARKS.md).

So while this process has workers running on this machine (a local pool's worker starting,
in a warm-up step or with a job, each counted once; a job of its own in the machine's compile
service), a graph hotswap answers eagerly runs with at most ``cores - running`` intra-op
threads (never fewer than one, never more than the caller's), the caller's count put back
when the call returns. Only the eager stand-in's calls: compiled tiers run as they were
compiled, eager calls the gate times run with the caller's own count, and nothing else of
the caller's changes. ``HOTSWAP_EAGER_THREADS=keep``: the caller's count always.

The count is set for the calling thread alone (OpenMP's ``omp_set_num_threads`` and MKL's
``MKL_Set_Num_Threads_Local``), not through ``torch.set_num_threads``: that one also sets
the count a thread of the process takes at its first parallel op, so a thread started while
an eager call ran would keep one thread for good. Where torch's OpenMP runtime cannot be
found (another parallel backend), eager answers keep the caller's count.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from hotswap import settings
from hotswap.system.proctree import usable_cores

__all__ = ["add_running", "eager_cap", "running", "set_running", "with_threads"]

log = logging.getLogger("hotswap")

_lock = threading.Lock()
_running: dict[int, int] = {}  # id(owner) -> its workers on this machine's cores now
# The most intra-op threads an eager answer takes now; None: the caller's own. Read on the
# user's calls without the lock; set under it whenever what runs changes.
_cap: int | None = None
_setters: tuple[Callable[[int], Any], Callable[[int], int] | None] | None = None
_setters_found = False


def running() -> int:
    """This process's workers running on this machine's cores now, every owner's."""
    with _lock:
        return sum(_running.values())


def set_running(owner: object, count: int) -> None:
    """``owner`` (a pool's manager, an executor) has ``count`` workers of this process
    running on this machine's cores now (0: none; forgets it)."""
    with _lock:
        _set(id(owner), count)


def add_running(owner: object, delta: int) -> None:
    """``owner``'s count of running workers changed by ``delta`` (a job sent, a job ended)."""
    with _lock:
        _set(id(owner), _running.get(id(owner), 0) + delta)


def _set(key: int, count: int) -> None:
    global _cap
    if _running.get(key, 0) == count:
        return
    if count > 0:
        _running[key] = count
    else:
        _running.pop(key, None)
    total = sum(_running.values())
    _cap = max(1, usable_cores() - total) if total and _lends() else None


def eager_cap() -> int | None:
    """The most intra-op threads an eager answer takes now; None: the caller's own."""
    return _cap


def with_threads(threads: int, own: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """``fn(*args)`` with ``threads`` intra-op threads on this thread, which uses ``own``
    (``torch.get_num_threads()``, read on it before: that starts torch's count on a new
    thread), and ``own`` again after; ``fn(*args)`` as it is where the runtime is not found."""
    found = _thread_setters()
    if found is None:
        return fn(*args)
    set_omp, set_mkl = found
    set_omp(threads)
    mkl_before = set_mkl(threads) if set_mkl is not None else 0
    try:
        return fn(*args)
    finally:
        set_omp(own)
        if set_mkl is not None:
            set_mkl(mkl_before)  # the thread's own MKL count, 0 where it had none


def _lends() -> bool:
    try:
        return settings.eager_threads() == "auto"
    except ValueError:  # malformed: hotswap.compile raised on it already (check_all)
        return False


def _thread_setters() -> tuple[Callable[[int], Any], Callable[[int], int] | None] | None:
    """OpenMP's and MKL's per-thread setters of the runtime torch uses, found once."""
    global _setters, _setters_found
    if _setters_found:
        return _setters
    found: tuple[Callable[[int], Any], Callable[[int], int] | None] | None = None
    try:
        import torch

        if "parallel backend: OpenMP" in torch.__config__.parallel_info():
            omp = ctypes.CDLL(None).omp_set_num_threads  # libgomp/libiomp, loaded globally
            omp.argtypes, omp.restype = [ctypes.c_int], None
            found = (omp, _mkl_setter())
    except (AttributeError, OSError) as e:
        log.debug("hotswap: eager answers keep the caller's threads: %s", e)
    with _lock:
        _setters, _setters_found = found, True
    return found


def _mkl_setter() -> Callable[[int], int] | None:
    """MKL's C setter for this thread (``MKL_Set_Num_Threads_Local(int)``; the lowercase
    symbols are its Fortran interface, which takes a pointer), from torch's library or a
    loaded MKL; None without MKL."""
    import torch

    if not torch.backends.mkl.is_available():  # type: ignore[no-untyped-call]
        return None
    libs = [ctypes.CDLL(None)]
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in ("libtorch_cpu.so", "libmkl_rt.so.2", "libmkl_rt.so"):
        path = os.path.join(lib_dir, name) if name == "libtorch_cpu.so" else name
        try:  # RTLD_NOLOAD: only a library this process has loaded already
            libs.append(ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY))
        except OSError:
            continue
    for lib in libs:
        setter = getattr(lib, "MKL_Set_Num_Threads_Local", None)
        if setter is not None:
            setter.argtypes, setter.restype = [ctypes.c_int], ctypes.c_int
            return setter  # type: ignore[no-any-return]
    return None
