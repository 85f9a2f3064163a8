"""The backend's two threads, and the registry that lets ``hotswap.shutdown()`` wait for them.

    scheduler  ("hotswap-load":       every change of a graph's state: loads and swaps, the
               the load thread)       gate's steps and its retries when due, the process's
                                      load-path warm-up. In order, one at a time, with the
                                      quick GIL handoff on while it works (below)
    io         ("hotswap-io")         what waits on the disk, the network or another process:
                                      the cache stamp's lookups, index touches, fleet store
                                      reads, looks at another process's compile claim;
                                      the same handoff and deferral as the scheduler's

Each is a ``Lane``: one daemon thread at a time that runs the lane's tasks in order and its
timers (``later``) when due, and ends once it has had nothing to do for ``idle_exit_s`` with no
timer pending; the next task starts another. A process with many backends keeps no thread for
each. The warm-up (loading/warmup.py) starts one more, short-lived, for triton's part of it
beside the imports, where there is a GPU. Every thread is a daemon: none holds up the
interpreter's exit; ``join_all`` waits for them, up to a deadline, and ``stop_lanes`` ends them
once their queued tasks are done (their timers are dropped: nothing measures after a shutdown).

The quick GIL handoff: a first load in a process is about a second of interpreter time on a
thread of the user's process. Python hands its interpreter lock to a waiting thread only after
the switch interval (5 ms by default), and every torch op a user call runs releases the GIL and
takes it back: so while a load ran, each op could wait 5 ms, and an eager 9-op MLP call on CPU
went from 1 ms to 60-250 ms. While the scheduler has work, hotswap lowers the process's switch
interval (``HOTSWAP_SWITCH_INTERVAL_S``, default 0.2 ms) so a waiting caller gets the GIL back
within that, and puts the user's value back once the scheduler is idle.

Deferring to the user's calls: the handoff still costs a call of hundreds of ops up to the
interval per op (ViT on the H200: 17-47 ms calls of a 2 ms eager graph while an artifact
loaded beside them). So the scheduler's tasks, and the warm-up's steps, stay off the GIL
while a user call runs on eager (``user_calls``: ``GraphRunner`` marks each eager call,
``dynamo_compiling`` each frame dynamo compiles, the user's call waiting on it):
as each of their Python functions starts they check, and sleep until the call has ended,
for at most ``YIELD_DEFER_S`` at a time (``YIELD_DEFER_COMPILE_S`` while dynamo compiles and
no eager call runs), then run ``YIELD_RUN_S`` before they defer again (a caller with no gap
between calls still lets a load through). Where a thread of the user's
waits for the work (``user_waiting``, the warm-up's ``full_speed``), it does not defer. A
single long C call is not split, and a lock the deferring thread holds waits with it: a
user call that needs it waits up to the deferral's pace (2 ms in 12), but for a module's
import lock: a thread that another waits on to finish an import neither defers nor rests
(``prepare()`` first thing: the warm-up imports inductor while the program imports what it
needs of it). The lanes defer on Python 3.12+ only (``DEFERS``).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from hotswap import settings

__all__ = ["DEFERS", "Lane", "Timer", "deferring", "dynamo_compiling", "gil_handoff_s", "io",
           "join_all", "live",
           "quick_gil_handoff", "run_lowered", "scheduler", "start", "stop_lanes", "user_calls",
           "user_waiting", "user_waits", "yielding", "yielding_gil"]

log = logging.getLogger("hotswap")
T = TypeVar("T")

# A lane with no work and no timer for this long lets its thread end.
IDLE_EXIT_S = 5.0

_lock = threading.Lock()
_live: set[threading.Thread] = set()


def start(target: Callable[..., Any], *, name: str, args: tuple[Any, ...] = (),
          kwargs: dict[str, Any] | None = None) -> threading.Thread:
    """Run ``target(*args, **kwargs)`` on a daemon thread named ``name``, counted until it ends."""
    thread: threading.Thread

    def run() -> None:
        try:
            target(*args, **(kwargs or {}))
        finally:
            _forget(thread)

    thread = threading.Thread(target=run, name=name, daemon=True)
    _begin(thread)
    return thread


# The niceness of the serving process's background CPU work (run_lowered): low enough that
# the caller's threads take the cores back at once, and a tenth of a core still where they
# keep every core busy (niceness 19: 1.5 %, and the lane that waits for it waits that long).
LOWERED_NICENESS = 10


def run_lowered(fn: Callable[[], T], *, name: str) -> T:
    """``fn()`` on a thread of its own at ``LOWERED_NICENESS``, joined, its exception raised
    here: the serving process's CPU-heavy background work, which should take no core the
    caller's threads want (a cache write hashes and copies its entry: 148 MiB where it ships
    inductor's precompiled header, scripts/write_pacing.py). It defers to the user's calls
    as the calling thread does. Linux lowers a thread alone; elsewhere, where no thread can
    be started (the interpreter exiting), ``fn()`` runs here, as it would have."""
    if not sys.platform.startswith("linux") or sys.is_finalizing():
        return fn()
    outcome: list[Any] = []  # [True, result] or [False, exception]
    defer = DEFERS and yielding()

    def lowered() -> None:
        try:
            with contextlib.suppress(OSError):  # a thread's own niceness (Linux, not POSIX)
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWERED_NICENESS)
            with deferring() if defer else contextlib.nullcontext():
                outcome.extend((True, fn()))
        except BaseException as e:
            outcome.extend((False, e))

    try:
        thread = start(lowered, name=name)
    except RuntimeError:  # can't start a thread (the interpreter exiting, say)
        return fn()
    thread.join()
    ok, value = outcome
    outcome.clear()  # no cycle through the exception's traceback keeps the payload alive
    if not ok:
        try:
            raise value
        finally:
            del value
    return value  # type: ignore[no-any-return]


def _begin(thread: threading.Thread) -> None:
    with _lock:
        _live.add(thread)
    try:
        thread.start()
    except BaseException:  # no thread to start (RuntimeError: can't start new thread)
        _forget(thread)
        raise


def _forget(thread: threading.Thread) -> None:
    with _lock:
        _live.discard(thread)


def live() -> list[threading.Thread]:
    """hotswap's threads running now."""
    with _lock:
        return list(_live)


def join_all(timeout_s: float, *, name: str | None = None) -> list[str]:
    """Wait up to ``timeout_s`` for every hotswap thread (``name``: of that name) to end, the
    caller's own aside; the names of those still running then."""
    deadline = time.monotonic() + timeout_s
    me = threading.current_thread()
    while True:
        running = [t for t in live() if t is not me and t.is_alive()
                   and (name is None or t.name == name)]
        if not running:
            return []
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return sorted(t.name for t in running)
        running[0].join(min(remaining, 0.1))


def gil_handoff_s() -> float:
    """The switch interval hotswap sets while the scheduler works (``HOTSWAP_SWITCH_INTERVAL_S``)."""
    return settings.switch_interval_s()


class _QuickHandoff:
    """``with quick_gil_handoff:`` from any number of threads: the first one in lowers the
    switch interval, the last one out puts the earlier value back, unless someone changed it
    in between (their value stays)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._saved = self._ours = 0.0

    def __enter__(self) -> None:
        with self._lock:
            if self._depth == 0:
                self._saved = sys.getswitchinterval()
                sys.setswitchinterval(min(self._saved, gil_handoff_s()))
                self._ours = sys.getswitchinterval()
            self._depth += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0 and sys.getswitchinterval() == self._ours:
                sys.setswitchinterval(self._saved)

    @property
    def active(self) -> bool:
        return self._depth > 0


quick_gil_handoff = _QuickHandoff()

# A thread inside ``yielding_gil`` runs at most this long, then sleeps this long (below);
# once someone waits for its work, this long.
YIELD_RUN_S = 0.002
YIELD_REST_S = 0.004
YIELD_WANTED_REST_S = 0.001
# A deferring thread waits for the user's running calls at most this long at a time, looking
# this often (then it runs YIELD_RUN_S before it defers again).
YIELD_DEFER_S = 0.010
YIELD_DEFER_POLL_S = 0.0005
# While dynamo compiles for a call (seconds for a transformer), and no eager call runs, it
# defers this long at a time: it then ran 2 ms in 12, a sixth of the trace's interpreter.
YIELD_DEFER_COMPILE_S = 0.050
# Whether the lanes defer to the user's calls here. On Python 3.12+ the check is a
# ``sys.monitoring`` callback (``_Monitoring``). 3.11's trace function puts every instruction
# of the thread through the tracing path: an interpreter-heavy task took 2.3x as long, and the
# load path's imports 1.44-1.50 s against 0.86-0.94 s (torch 2.13, CPU). There the lanes keep
# the quick handoff alone (the warm-up, whose imports are most of that, still defers).
DEFERS = sys.version_info >= (3, 12)


class _UserCalls:
    """The user's calls running now on a graph's eager code (``GraphRunner`` marks them): the
    threads in one, with how many deep. hotswap's deferring threads stay off the GIL while
    one runs. A dict's item set and delete are atomic under the GIL, and a thread only
    touches its own entry."""

    __slots__ = ("_running",)

    def __init__(self) -> None:
        self._running: dict[int, int] = {}

    def enter(self) -> int:
        ident = threading.get_ident()
        self._running[ident] = self._running.get(ident, 0) + 1
        return ident

    def exit(self, ident: int) -> None:
        depth = self._running.get(ident, 1) - 1
        if depth > 0:
            self._running[ident] = depth
        else:
            self._running.pop(ident, None)

    def compiling_only(self) -> bool:
        """Whether dynamo's compile is the only mark (no eager call runs)."""
        running = self._running
        return len(running) == 1 and _COMPILING in running

    def running(self) -> bool:
        if self.compiling_only():
            # dynamo compiles for a call of the user's; unless a thread of the user's waits
            # for hotswap's work inside that compile (a waiting mode's first call)
            return not user_waits._running
        return bool(self._running)


# ``user_calls``' key while dynamo compiles a frame, on whichever thread (its callbacks are
# process-wide: ``dynamo_compiling``).
_COMPILING = -1
_compile_ended = threading.Event()  # clear while dynamo compiles
_compile_ended.set()
user_calls = _UserCalls()
# The user's threads waiting for hotswap's work (``user_waiting``): the lanes then run at
# full speed (deferring to another thread's calls would make the waiting one wait longer).
user_waits = _UserCalls()


def dynamo_compiling(started: bool) -> None:
    """Dynamo began (``started``) or ended compiling a frame (``compat.on_dynamo_compiles``):
    the call that set it off waits for its trace, its backend call and its guards (seconds,
    for a transformer's first call). Until it ends, hotswap's deferring threads stay off the
    GIL as they do during an eager call of the user's: the load path's warm-up, which a load
    arriving then (a warm restart's cached tier) would otherwise run beside the trace,
    taking a third of the GIL from it."""
    if started:
        _compile_ended.clear()
        user_calls._running[_COMPILING] = 1
    else:
        user_calls._running.pop(_COMPILING, None)
        _compile_ended.set()


@contextlib.contextmanager
def user_waiting() -> Iterator[None]:
    """Mark the calling thread (the user's) as waiting for hotswap's work meanwhile."""
    ident = user_waits.enter()
    try:
        yield
    finally:
        user_waits.exit(ident)


class _Yield:
    """One thread's state inside ``yielding_gil``."""

    __slots__ = ("defer", "full_speed", "owed_until", "rest_s", "run_s", "skip", "started",
                 "unless", "wanted_rest_s")

    def __init__(self, run_s: float, rest_s: float, unless: Callable[[], bool],
                 wanted_rest_s: float, full_speed: Callable[[], bool], defer: bool) -> None:
        self.run_s, self.rest_s, self.unless = run_s, rest_s, unless
        self.wanted_rest_s, self.full_speed, self.defer = wanted_rest_s, full_speed, defer
        self.started = time.perf_counter()
        self.owed_until = 0.0  # after a full deferral: it runs until then before deferring
        self.skip = 0  # function starts left before the next tick (``_Monitoring``)

    def tick(self) -> bool:
        """As a Python frame starts: stay off the GIL while a user call runs (``defer``), and
        rest once the thread has run ``run_s``, unless a thread of the user's waits for an
        import this one is making. False: full speed from here (no more ticks wanted)."""
        now = time.perf_counter()
        if self.defer and now >= self.owed_until and user_calls.running():
            if self.unless() and self.full_speed():
                return False
            until = now + (YIELD_DEFER_COMPILE_S if user_calls.compiling_only()
                           else YIELD_DEFER_S)
            while now < until and user_calls.running():
                if _import_waits_on_me():  # a thread waits for what this one imports:
                    self.owed_until = now + YIELD_DEFER_S  # a run, then it looks again
                    break
                if user_calls.compiling_only():
                    # woken as the compile ends (or to look at the imports again), not
                    # polling: the trace is pure Python, each poll takes the GIL from it
                    _compile_ended.wait(min(until - now, YIELD_DEFER_S))
                else:
                    time.sleep(YIELD_DEFER_POLL_S)
                now = time.perf_counter()
            else:
                if now >= until:  # calls back to back: a run of ours before deferring again
                    self.owed_until = now + YIELD_RUN_S
            self.started = now  # that was a rest
            return True
        if now - self.started <= self.run_s:
            return True
        wanted = self.unless()
        rest = self.wanted_rest_s if wanted else self.rest_s
        if wanted and self.full_speed():
            return False
        if _import_waits_on_me():  # a rest would hold up the thread waiting for the import
            self.started = now
            return True
        if rest <= 0:
            if not self.defer:
                return False
            self.started = now  # no rest: it defers, and looks again after another run
            return True
        time.sleep(rest)
        self.started = time.perf_counter()
        return True


def _import_waits_on_me() -> bool:
    """Whether a thread not of hotswap's waits for a module this thread is importing (its
    import lock): a user's call (or dynamo's trace) that needs the module would wait out
    every deferral and rest, so the importing thread neither defers nor rests then. Another
    thread of hotswap's waiting (triton's warm-up beside the imports) changes nothing: the
    user's calls still come first. (importlib's record of who waits on which lock:
    ``_blocking_on``, thread -> its lock on 3.11, -> a weak reference to a list of locks on
    3.12+. Nothing is found where it is neither.)"""
    waiting = getattr(_bootstrap, "_blocking_on", None)
    waiting = getattr(waiting, "data", waiting)
    if not waiting:
        return False
    me = threading.get_ident()
    try:
        # not live(): its lock is not reentrant, and this runs as any Python function of the
        # thread starts, a finalizer called while the thread holds that lock too (copying
        # the set is one C call, under the GIL)
        ours = {t.ident for t in list(_live)}
        for waiter, value in list(waiting.items()):
            if waiter in ours:
                continue
            if isinstance(value, weakref.ref):
                value = value()
            for lock in value if isinstance(value, list) else (value,):
                if getattr(lock, "owner", None) == me:
                    return True
    except Exception:  # another Python's import internals: no deferral is shortened
        return False
    return False


_bootstrap = sys.modules.get("_frozen_importlib")


class _Monitoring:
    """``sys.monitoring`` (Python 3.12+) for ``yielding_gil``: a callback as each Python
    function starts, for the threads inside a block. On 3.12 a trace function on one thread
    (``sys.settrace``) instruments every line of every function for every thread: the user's
    calls ran their Python with that instrumentation for as long as a warm-up yielded beside
    them. A ``PY_START`` callback is the one event it asks for; a thread outside the blocks
    gets ``DISABLE`` for the function it starts, so the user's code runs uninstrumented after
    its first call. (Disabled is per function, not per thread: the blocks' threads then see
    fewer starts, in code the user's thread ran first; imports run code nobody ran before.
    The first block in re-enables what was disabled before it.)"""

    TOOL_IDS = (3, 4)  # free by convention (0: debuggers, 1: coverage, 2: profilers, 5: optimizers)
    TICK_EVERY = 16

    def __init__(self) -> None:
        # Reentrant: the callback may run inside enter/exit on the same thread (a finalizer
        # or a collector callback starting a Python function while the lock is held).
        self._lock = threading.RLock()
        self._tool: int | None = None
        self._active: dict[int, _Yield] = {}  # thread -> its innermost block's state
        self._outer: dict[int, list[_Yield | None]] = {}  # thread -> the states around it
        self._available = sys.version_info >= (3, 12)

    def enter(self, state: _Yield) -> bool:
        """Tick ``state`` as this thread's functions start (until ``exit``: then the state of
        the block around this one, if any, again); False: sys.monitoring is not available
        here (older Python, or every tool id taken)."""
        monitoring: Any = getattr(sys, "monitoring", None)
        with self._lock:
            if not self._available or monitoring is None:
                return False
            if self._tool is None:
                for tool in self.TOOL_IDS:
                    try:
                        monitoring.use_tool_id(tool, "hotswap")
                    except ValueError:  # in use
                        continue
                    monitoring.register_callback(tool, monitoring.events.PY_START,
                                                 self._on_start)
                    self._tool = tool
                    break
                else:
                    self._available = False
                    return False
            ident = threading.get_ident()
            self._outer.setdefault(ident, []).append(self._active.get(ident))
            self._active[ident] = state
            if len(self._active) == 1:
                # What earlier blocks' outsiders disabled is code this block may run too.
                # (This re-enables other tools' disabled events as well: they see those
                # again once, which costs them time, not correctness.)
                monitoring.restart_events()
                monitoring.set_events(self._tool, monitoring.events.PY_START)
        return True

    def exit(self) -> None:
        monitoring: Any = sys.monitoring  # type: ignore[attr-defined,unused-ignore]
        with self._lock:
            ident = threading.get_ident()
            outer = self._outer[ident].pop()
            if not self._outer[ident]:
                del self._outer[ident]
            if outer is None:
                self._active.pop(ident, None)
            else:
                self._active[ident] = outer
            if self._tool is not None:  # on while any block is active, whoever turned it off
                monitoring.set_events(self._tool,
                                      monitoring.events.PY_START if self._active else 0)

    def threads(self) -> set[int]:
        """The threads whose starts it ticks now."""
        with self._lock:
            return set(self._active)

    def _on_start(self, code: Any, offset: int) -> Any:
        ident = threading.get_ident()
        state = self._active.get(ident)
        if state is None:
            return sys.monitoring.DISABLE  # type: ignore[attr-defined,unused-ignore]
        # A full tick (the clock, rests) at every TICK_EVERY-th start: a tick at each made a
        # call-heavy function 12x as long (0.45 us a start on 3.12). Whether a user call runs
        # is looked at every start: code with C work between its starts (an unpickler) would
        # otherwise run up to TICK_EVERY of those into a call
        state.skip -= 1
        if state.skip > 0 and not (state.defer and user_calls._running and user_calls.running()):
            return None
        state.skip = self.TICK_EVERY
        if not state.tick():
            with self._lock:  # full speed from here
                self._active.pop(ident, None)
        return None


_monitoring = _Monitoring()


@contextlib.contextmanager
def yielding_gil(run_s: float = YIELD_RUN_S, rest_s: float = YIELD_REST_S, *,
                 unless: Callable[[], bool] = lambda: False,
                 wanted_rest_s: float = YIELD_WANTED_REST_S,
                 full_speed: Callable[[], bool] = lambda: False,
                 defer: bool = True) -> Iterator[None]:
    """Inside the block this thread runs Python for at most about ``run_s`` at a time, then
    sleeps ``rest_s``, holding no GIL; once ``unless()`` (someone waits for the work now) it
    sleeps ``wanted_rest_s`` instead, and once ``full_speed()`` too (0 rest: the user's own
    thread waits), it removes itself and runs on at full speed: the hook costs the work about
    as much again (a warm-up's imports took 4.99 s with 1 ms rests, 2.23 s at full speed). For
    interpreter-heavy work (the load path's warm-up). The quick handoff alone is not enough
    for a GPU caller: each of the hundreds of ops in one call gives the GIL up and waits up to
    the switch interval to take it back, so a 3 ms GPT-2 call took 90-190 ms while the warm-up
    imported inductor's modules (H100); at full speed once an artifact waited for the rest of
    the warm-up, a call beside it took 171 ms.

    The clock is looked at as each Python function starts: through ``sys.monitoring`` on
    Python 3.12+ (``_Monitoring``: at every 16th start, and whether a user call runs at each),
    else a trace function on this thread alone
    (``sys.settrace``; it asks for no line events), which removes itself at full speed and
    puts the thread's earlier one back after the block. A single C call is not split. (A
    profile function would also see every C call: the imports then ran 6x slower.)

    With ``defer`` (the default) it also stays off the GIL while a user call runs on eager
    (``user_calls``; the module's docstring). ``run_s=math.inf`` defers and never rests; so
    does a rest of 0 once due (without ``defer``, that is full speed)."""
    state = _Yield(run_s, rest_s, unless, wanted_rest_s, full_speed, defer)
    if _monitoring.enter(state):
        try:
            yield
        finally:
            _monitoring.exit()
        return

    def trace(frame: Any, event: str, arg: Any) -> None:
        if not state.tick():
            sys.settrace(None)  # full speed from here: no more calls into this function

    earlier = sys.gettrace()
    sys.settrace(trace)
    _tracing.hook = trace
    try:
        yield
    finally:
        sys.settrace(earlier)
        _tracing.hook = None


_tracing = threading.local()  # .hook: this thread's yielding trace function (settrace's way)


def yielding() -> bool:
    """Whether this thread's Python yields now: inside ``yielding_gil``, not yet at full
    speed."""
    if threading.get_ident() in _monitoring.threads():
        return True
    hook = getattr(_tracing, "hook", None)
    return hook is not None and sys.gettrace() is hook

_Task = tuple[Callable[..., Any], tuple[Any, ...]]


class Timer:
    """A task a lane runs when it is due, unless cancelled first."""

    def __init__(self, due: float, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.due, self.fn, self.args = due, fn, args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Lane:
    """Runs tasks in order on one daemon thread at a time, and timers when due. ``busy()``
    makes the context entered while the lane has work and left once its queue is empty.

    Not a ThreadPoolExecutor: those threads are joined at interpreter exit, so exiting would
    wait for a load nobody will use. A daemon thread is simply dropped.
    """

    def __init__(self, name: str, *, idle_exit_s: float = IDLE_EXIT_S,
                 busy: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
                 ) -> None:
        self.name, self._idle_exit_s = name, idle_exit_s
        self._busy = busy or contextlib.nullcontext
        self._order = itertools.count()
        self._start_fresh()

    def _start_fresh(self) -> None:
        """No thread, no task, no timer: a new lane, and in a forked child the lane it
        inherited (its thread is not there, and its lock may have been held at the fork)."""
        self._cond = threading.Condition()
        self._tasks: deque[_Task] = deque()
        self._timers: list[tuple[float, int, Timer]] = []
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._running = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the lane's thread, after the tasks queued before it."""
        with self._cond:
            self._tasks.append((fn, args))
            self._wake_locked()

    def later(self, delay_s: float, fn: Callable[..., Any], *args: Any) -> Timer:
        """Run ``fn(*args)`` on the lane's thread once ``delay_s`` has passed."""
        timer = Timer(time.monotonic() + max(0.0, delay_s), fn, args)
        with self._cond:
            heapq.heappush(self._timers, (timer.due, next(self._order), timer))
            self._wake_locked()
        return timer

    def waiting(self, *, besides: Callable[..., Any] | None = None) -> bool:
        """Whether a task waits in the queue for the running one (one of ``besides`` aside)."""
        return any(fn != besides for fn, _ in list(self._tasks))

    def here(self) -> bool:
        """Whether the caller runs on this lane's thread (a task of it)."""
        return self._thread is threading.current_thread()

    def stop(self) -> None:
        """End the thread once the tasks queued now are done; its timers are dropped (a later
        task starts a new thread)."""
        with self._cond:
            self._timers.clear()
            if self._thread is not None:
                self._stopping = True
                self._cond.notify_all()

    def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the tasks queued now (not the timers) to be done."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while (self._tasks or self._running) and not self.here():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 0.05))
        return True

    def _wake_locked(self) -> None:
        if self._thread is None:
            self._stopping = False
            self._thread = start(self._run, name=self.name)
        else:
            self._cond.notify_all()

    def _next(self) -> _Task | None:
        """The next task, once there is one; None: the thread ends."""
        with self._cond:
            idle_since = time.monotonic()
            while True:
                now = time.monotonic()
                while self._timers and self._timers[0][0] <= now:
                    timer = heapq.heappop(self._timers)[2]
                    if not timer.cancelled:
                        self._tasks.append((timer.fn, timer.args))
                if self._tasks:
                    self._running = True
                    return self._tasks.popleft()
                self._running = False
                self._cond.notify_all()  # drain()
                if self._stopping or (not self._timers
                                      and now - idle_since >= self._idle_exit_s):
                    self._thread, self._stopping = None, False
                    return None
                wait_s = self._idle_exit_s - (now - idle_since)
                if self._timers:
                    wait_s = self._timers[0][0] - now
                self._cond.wait(max(wait_s, 0.0))

    def _has_task(self) -> bool:
        with self._cond:
            return bool(self._tasks)

    def _run(self) -> None:
        while (task := self._next()) is not None:
            with self._busy():
                while task is not None:
                    fn, args = task
                    try:
                        fn(*args)
                    except Exception:  # tasks record their own failures; a last resort
                        log.exception("hotswap %s task %r failed", self.name, fn)
                    # Idle, this thread must not keep the last task's graph and artifact.
                    task = fn = args = None  # type: ignore[assignment]
                    if self._has_task():
                        task = self._next()


def deferring() -> contextlib.AbstractContextManager[None]:
    """A block that never rests but defers to the user's running calls, and runs at full
    speed once a thread of the user's waits for hotswap's work (``user_waiting``)."""
    return yielding_gil(YIELD_RUN_S, 0.0, unless=lambda: True, wanted_rest_s=0.0,
                        full_speed=user_waits.running)


@contextlib.contextmanager
def _lane_busy() -> Iterator[None]:
    """A lane's state while it has work: the quick GIL handoff, and where ``DEFERS`` its
    thread defers to the user's running calls until a thread of the user's waits for
    hotswap's work (``deferring``)."""
    with quick_gil_handoff, deferring() if DEFERS else contextlib.nullcontext():
        yield


scheduler = Lane("hotswap-load", busy=_lane_busy)
io = Lane("hotswap-io", busy=_lane_busy)


def stop_lanes() -> None:
    """End both lanes' threads once their queued tasks are done (``hotswap.shutdown()``)."""
    for lane in (scheduler, io):
        lane.stop()


def _after_fork_in_child() -> None:
    """A forked child has none of hotswap's threads, and a lock one of them held at the fork
    would stay held for good: its exit (which stops the lanes) would hang on it."""
    global _lock
    _lock = threading.Lock()
    _live.clear()
    for lane in (scheduler, io):
        lane._start_fresh()
    for marks in (user_calls, user_waits):  # of threads the child does not have
        marks._running.clear()
    _compile_ended.set()


os.register_at_fork(after_in_child=_after_fork_in_child)
