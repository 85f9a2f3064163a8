"""The cores this process's compile workers use now, and the intra-op threads the graphs
hotswap answers eagerly run with meanwhile.

A caller whose intra-op threads fill every core (torch's default: one per core) leaves a
worker none. Torch's OpenMP and MKL threads spin-wait between parallel regions: corpus GPT-2
called every 2 ms on the 2-core box kept 1.38 cores busy with two intra-op threads and 0.40
with one, its call taking 1.20-1.29 ms and 1.30-1.32 ms (scripts/eager_spin.py). The
workers run below the caller (priority.py), so they got scraps of a core, were raised
(starvation.py), and then shared the cores with spinning threads: its compiled code served
at 1.338x torch.compile's first call, and at 0.705x with the eager answers on one thread
(medians of four and six runs, BENCHMARKS.md).

So while this process has workers running on this machine (a local pool's worker starting,
in a warm-up step or with a job, each counted once; a job of its own in the machine's compile
service), a graph hotswap answers eagerly runs with at most ``cores - running`` intra-op
threads (never fewer than one, never more than the caller's), the caller's count put back
when the call returns. Only the eager stand-in's calls: compiled tiers run as they were
compiled, eager calls the gate times run with the caller's own count, a graph compiled
meanwhile is compiled for it (``own_threads``), and nothing else of the caller's changes.
``HOTSWAP_EAGER_THREADS=keep``: the caller's count always (read when what runs changes).

The count is set for the calling thread alone (OpenMP's ``omp_set_num_threads`` and MKL's
``MKL_Set_Num_Threads_Local``), not through ``torch.set_num_threads``: that one also sets
the count a thread of the process takes at its first parallel op, so a thread started while
an eager call ran would keep one thread for good. Where torch's OpenMP runtime cannot be
found (another parallel backend), eager answers keep the caller's count.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

from hotswap import settings
from hotswap.system.proctree import usable_cores

__all__ = ["add_running", "at_own_threads", "can_set_threads", "eager_cap", "own_threads",
           "running", "set_running", "with_threads"]

log = logging.getLogger("hotswap")

_lock = threading.Lock()
_running: dict[int, int] = {}  # id(owner) -> its workers on this machine's cores now
# The most intra-op threads an eager answer takes now; None: the caller's own. Read on the
# user's calls without the lock; set under it whenever what runs changes (so is the setting).
_cap: int | None = None
_Setters = tuple[Callable[[int], Any], Callable[[int], int] | None]
_setters: _Setters | None = None
_setters_found = False
_lent = threading.local()  # .own: the caller's count, on a thread inside with_threads


def running() -> int:
    """This process's workers running on this machine's cores now, every owner's."""
    with _lock:
        return sum(_running.values())


def set_running(owner: object, count: int) -> None:
    """``owner`` (a pool's manager, an executor) has ``count`` workers of this process
    running on this machine's cores now (0: none; forgets it). An owner sets 0 before it
    goes: its key is its ``id``."""
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


def can_set_threads() -> bool:
    """Whether a thread's own intra-op count can be set here (``with_threads``); found on
    the first call, which must be on a thread that has read ``torch.get_num_threads()``."""
    return _thread_setters() is not None


def own_threads(threads: int) -> int:
    """The caller's own intra-op count where ``threads`` was read inside ``with_threads`` on
    this thread (what a graph compiled meanwhile is compiled for), else ``threads``."""
    own: int | None = getattr(_lent, "own", None)
    return threads if own is None else own


@contextlib.contextmanager
def at_own_threads() -> Iterator[None]:
    """Inside ``with_threads`` on this thread (dynamo compiling inside an eager answer): the
    caller's own count meanwhile, as inductor's C++ code reads it when it compiles here; the
    lent one again after. Elsewhere, nothing."""
    own: int | None = getattr(_lent, "own", None)
    found = _setters if _setters_found else None
    if own is None or found is None:
        yield
        return
    import torch

    lent = torch.get_num_threads()
    set_omp, set_mkl = found
    try:
        set_omp(own)
        if set_mkl is not None:
            set_mkl(own)
        yield
    finally:
        set_omp(lent)
        if set_mkl is not None:
            set_mkl(lent)


def with_threads(threads: int, own: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """``fn(*args)`` with ``threads`` intra-op threads on this thread, whose own count is
    ``own`` (``torch.get_num_threads()``, read on it first: that read starts torch's count on
    a thread new to it, which would otherwise undo this one), and ``own`` again after;
    ``fn(*args)`` as it is where ``can_set_threads()`` is False."""
    found = _thread_setters()
    if found is None:
        return fn(*args)
    set_omp, set_mkl = found
    omp_set = mkl_set = False
    mkl_before = 0  # the thread's own MKL count, 0 where it had none (MKL's global one)
    outer = getattr(_lent, "own", None)
    try:
        _lent.own = own if outer is None else outer
        omp_set = True  # before each call: an interrupt between the two still puts it back
        set_omp(threads)
        if set_mkl is not None:
            mkl_set = True
            mkl_before = set_mkl(threads)
        return fn(*args)
    finally:
        if omp_set:
            set_omp(own)
        if mkl_set and set_mkl is not None:
            set_mkl(mkl_before)
        _lent.own = outer


def _lends() -> bool:
    try:
        return settings.eager_threads() == "auto"
    except ValueError:  # malformed: hotswap.compile raised on it already (check_all)
        return False


def _thread_setters() -> _Setters | None:
    """OpenMP's and MKL's per-thread setters of the runtime torch uses, found once and
    checked on this thread: each must change what torch and MKL then read here."""
    global _setters, _setters_found
    if _setters_found:
        return _setters
    found: _Setters | None = None
    try:
        found = _find_setters()
    except Exception as e:  # no setter: eager answers keep the caller's count
        log.debug("hotswap: eager answers keep the caller's threads: %s: %s",
                  type(e).__name__, e)
    # (an interrupt leaves it to the next call to find)
    with _lock:
        _setters, _setters_found = found, True
    return found


def _find_setters() -> _Setters | None:
    import torch

    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    # torch's own library first: a lookup through its handle searches it and what it links
    # (its OpenMP runtime, MKL linked in), not another package's copy loaded globally.
    libs = []
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    with contextlib.suppress(OSError):  # RTLD_NOLOAD: only a library loaded already
        libs.append(ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY))
    libs.append(ctypes.CDLL(None))
    omp = _symbol(libs, "omp_set_num_threads", None)
    if omp is None:
        return None
    own = torch.get_num_threads()
    try:
        omp(own + 1)
        took = torch.get_num_threads() == own + 1
    finally:
        omp(own)
    if not took:
        return None
    # MKL's C setter (the lowercase symbols are its Fortran interface, taking a pointer)
    mkl = _symbol(libs, "MKL_Set_Num_Threads_Local", ctypes.c_int)
    get_mkl = _symbol(libs, "MKL_Get_Max_Threads", ctypes.c_int, args=())
    if mkl is not None and get_mkl is not None:
        before = 0
        try:
            before = mkl(own + 1)
            took = get_mkl() == own + 1
        finally:
            mkl(before)
        if not took:
            mkl = None
    else:
        mkl = None
    return omp, mkl


def _symbol(libs: list[ctypes.CDLL], name: str, restype: Any,
            args: tuple[Any, ...] = (ctypes.c_int,)) -> Any:
    for lib in libs:
        found = getattr(lib, name, None)
        if found is not None:
            found.argtypes, found.restype = list(args), restype
            return found
    return None


def _forget_in_child() -> None:
    """A forked child runs none of its parent's workers, and a lock held at the fork is
    never released there."""
    global _lock, _cap
    _lock = threading.Lock()
    _running.clear()
    _cap = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
