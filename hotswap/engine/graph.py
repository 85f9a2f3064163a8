"""The callable dynamo calls for one graph, and the tier serving it: the hot path, nothing else.

``GraphRunner.__call__`` is one attribute read and one call. A swap replaces that attribute
(atomic under the GIL), so a call already running finishes on the old callable and threads
never see a half-made swap. A newly swapped tier serves its first call on probation: if it
disagrees with the tier before it (``verify=True``), the graph goes back to the previous
callable and the call is answered by that callable.

A tier that raises is not blamed at once: the input may be one eager rejects too (a wrong
dtype that passed dynamo's guards, an index out of range). Eager runs on the same arguments
and decides. If it raises as well, the error is the user's: eager's exception propagates as
eager raised it (not chained to the tier's, so its traceback is eager's and a few frames),
and the tier keeps serving, counted as nothing but the eager call it took. If eager answers,
the tier is faulty: it is dropped for the one before it, and eager's answer is returned.

Tiers climb by rank (their place in the ladder); the benchmark gate decides before
``swap_in`` is called and may adopt a lower-ranked tier that measured faster
(``measured=True``). While the gate cannot decide (a busy machine), the faster-looking of two
tiers serves, and ``give_way`` hands the graph back to the one it replaced. What the runner
does is told to its ``listener`` (the graph's journey, journey.py, which keeps the graph's
status). ``ProfiledGraphRunner`` also records every call
and the tier that served it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

from hotswap.counting import bump
from hotswap.engine import served, threads
from hotswap.engine.loading.per_thread import PerThread
from hotswap.engine.served import CallClock, Window
from hotswap.errors import HotswapError
from hotswap.profiles.timeline import Timeline
from hotswap.profiles.trace import call_mark
from hotswap.system import cores

__all__ = ["GraphRunner", "Listener", "ProfiledGraphRunner", "TierFailed"]

Fn = Callable[..., Any]
log = logging.getLogger("hotswap")
# A timed window's CUDA events are read once all have completed: looked at this often, this
# many times (a minute), then let go.
_READ_EVERY_S = 0.05
_READ_TRIES = 1200


class TierFailed(HotswapError):
    """A tier could not serve a graph (raised into the user's call only with on_failure="raise")."""

    def __init__(self, graph_id: str, tier: str, reason: str) -> None:
        super().__init__(f"graph {graph_id}: tier {tier!r} failed: {reason}")
        self.graph_id = graph_id
        self.tier = tier
        self.reason = reason


class Listener(Protocol):
    """Told of what the runner does, on the thread that does it (a swap: the load thread; a
    first call or a drop: the user's)."""

    def swapped(self, tier: str, previous: str) -> None: ...

    def first_call(self, tier: str, start_s: float, end_s: float) -> None: ...

    def dropped(self, tier: str, back_to: str, reason: str) -> None: ...

    def served(self, window: Window) -> None: ...


def _lane(clock: CallClock) -> Any:
    """The hotswap thread a clock's window is read on (served.py: ``CallClock.lane``)."""
    return threads.io if clock.lane == "io" else threads.scheduler


def _close(new: Any, ref: Any) -> bool:
    """Outputs agree within a dtype-aware tolerance (pytrees of tensors and plain values)."""
    if isinstance(new, torch.Tensor) and isinstance(ref, torch.Tensor):
        if new.shape != ref.shape or new.dtype != ref.dtype:
            return False
        if not new.dtype.is_floating_point:
            return bool(torch.equal(new, ref))
        tol = 2e-2 if new.dtype in (torch.float16, torch.bfloat16) else 1e-3
        return bool(torch.allclose(new.detach(), ref.detach(), rtol=tol, atol=tol, equal_nan=True))
    if isinstance(new, list | tuple) and isinstance(ref, list | tuple):
        return len(new) == len(ref) and all(_close(a, b) for a, b in zip(new, ref, strict=True))
    return bool(new == ref)


class GraphRunner:
    """The callable returned to dynamo for one graph. Thread-safe; swaps never block calls."""

    def __init__(self, graph_id: str, gm: torch.fx.GraphModule, tiers: list[str], *,
                 verify: bool = False,
                 after_first_call: Callable[[], object] | None = None) -> None:
        self.graph_id = graph_id
        self._gm = gm
        self._ranks = {name: i for i, name in enumerate(tiers)}
        self._verify = verify
        self.listener: Listener | None = None
        # Run once, after the first call served eagerly returns (the coordinator starts this
        # process's load-path warm-up there).
        self.after_first_call = after_first_call
        self._lock = threading.Lock()
        # Bound once: ``self._run_eager`` makes a new bound method at each read, and the
        # callable serving is told from eager by identity.
        self._eager: Fn = self._run_eager
        self._fn: Fn = self._eager
        # The callables of the tier serving now, the one serving first (a probation wrapper,
        # then what it graduates to): an error in another one drops nothing.
        self._tier_fns: tuple[Fn, ...] = (self._eager,)
        # What serves if the current tier fails: (its callables, tier name, rank).
        self._fallback: tuple[tuple[Fn, ...], str, int] = ((self._eager,), "eager", -1)
        self.tier = "eager"
        self._rank = -1
        self.eager_calls = 0
        # Times a window of each tier's calls once it serves (served.py); None: not timed.
        self.clock: CallClock | None = None
        # Eager's own calls, timed for one window from the call after ``time_eager`` asks
        # (a tier on probation is weighed against them, journey.py); None: not timed.
        self._eager_clock: CallClock | None = None
        self._eager_from = 0
        self._eager_marks: list[Any] = []
        # Wrappers serving in a tier's place for a while (a tier making its per-thread plans,
        # a failure to raise once) -> what answers for them: a tier swapped in meanwhile
        # weighs itself against, and stands in with, that one.
        self._stand_ins: weakref.WeakKeyDictionary[Fn, Fn] = weakref.WeakKeyDictionary()

    @property
    def serving(self) -> Fn:
        """The callable serving calls now (what ``__call__`` dispatches to)."""
        return self._fn

    @property
    def rank(self) -> int:
        return self._rank

    # ------------------------------------------------------------------ hot path

    def __call__(self, *args: Any) -> Any:
        fn = self._fn
        try:
            return fn(*args)
        except Exception as e:
            if fn is self._eager or isinstance(e, TierFailed):
                raise
            reason = f"{type(e).__name__}: {e}"
        # Outside the except block: an exception eager raises here is not chained to the
        # tier's, and the tier's traceback (with its frames' tensors) is let go.
        return self._ask_eager(fn, reason, args)

    def _run_eager(self, *args: Any) -> Any:
        self.eager_calls += 1
        bump("eager_calls")
        # ``forward``, as dynamo's own eager backend calls it: GraphModule.__call__ would
        # print the graph's code to stderr on every error the user's inputs cause. Marked as
        # a user call running: hotswap's loads and warm-up stay off the GIL meanwhile.
        clock = self._eager_clock
        running = threads.user_calls.enter()
        try:
            if clock is None or self.eager_calls < self._eager_from:
                cap = cores.eager_cap()  # None unless workers of ours share the cores
                # Read first: on a thread new to torch, the read starts its count
                own = torch.get_num_threads() if cap is not None else 0
                if cap is not None and own > cap and cores.can_set_threads():
                    bump("eager_fewer_threads")
                    out = cores.with_threads(cap, own, self._gm.forward, args)
                else:
                    out = self._gm.forward(*args)
            else:  # weighed against a tier: as the caller would run it, on its threads
                started = clock.start()
                out = self._gm.forward(*args)
                self._eager_marks.append(clock.stop(started))
        finally:
            threads.user_calls.exit(running)
        if clock is not None and len(self._eager_marks) >= served.WINDOW:
            self._end_eager_window()
        if self.after_first_call is not None:
            hook, self.after_first_call = self.after_first_call, None
            hook()
        return out

    def time_eager(self) -> None:
        """Time a window of eager's calls (served.WINDOW), from the second one on (the first
        pays one-time costs), to the first swap at the latest; reported to the listener as
        tier "eager"'s "first" window where it holds served.MIN_CALLS calls or more."""
        if self.clock is not None:
            self._eager_from = max(self.eager_calls + 1, 2)
            self._eager_clock = self.clock

    def _end_eager_window(self) -> None:
        with self._lock:
            clock, self._eager_clock = self._eager_clock, None
            marks, self._eager_marks = self._eager_marks, []
        if clock is not None and len(marks) >= served.MIN_CALLS:
            window = marks[:served.WINDOW]  # a call in flight at the window's end adds one
            _lane(clock).submit(self._report, "eager", "first", clock, window, 0)

    # ------------------------------------------------------------------ swaps

    def serve_now(self, tier: str, fn: Fn) -> None:
        """The tier serves from the very first call (no eager, no swap): a first call that
        waited for it."""
        if isinstance(fn, PerThread):  # its first call waited: its plans are made there
            fn = fn.fn
        with self._lock:
            self._tier_fns = (fn,)
            self._fn = self._timing_locked(tier, fn, "first")
            self._fallback = ((self._eager,), "eager", -1)
            self.tier = tier
            self._rank = self._ranks.get(tier, 0)

    def swap_in(self, tier: str, fn: Fn, *, measured: bool = False) -> bool:
        """Adopt a ready tier if it ranks above the serving one (or, ``measured``, if the gate
        benchmarked it faster than the serving one, whatever its rank). False: not adopted."""
        with self._lock:
            rank = self._ranks[tier]
            if rank <= self._rank and not measured:
                return False
            previous, previous_tier = self._fn, self.tier
            self._fallback = ((previous, *self._tier_fns), self.tier, self._rank)
            work = fn if isinstance(fn, PerThread) else None
            if work is not None:
                fn = work.fn  # served as it is, once the thread made its plans
            meanwhile = previous  # what answered the calls: not a stand-in's wrapper
            while meanwhile in self._stand_ins:
                meanwhile = self._stand_ins[meanwhile]
            first_call = self._probation(tier, fn, meanwhile)
            self._tier_fns = (first_call, fn)
            self._fn = first_call if work is None else self._planning(work, first_call,
                                                                      meanwhile)
            self.tier, self._rank = tier, rank
        if previous_tier == "eager":
            self._end_eager_window()
        bump("swaps")
        if self.listener is not None:
            self.listener.swapped(tier, previous_tier)
        return True

    def give_way(self, tier: str) -> str | None:
        """``tier`` served before the gate decided on it, and the tier it replaced measured
        faster: that one serves again, as it did (its callables, eager's included). Returns
        the tier now serving; None (nothing changes) if ``tier`` no longer serves."""
        with self._lock:
            if self.tier != tier:
                return None
            self._tier_fns, self.tier, self._rank = self._fallback
            self._fn = self._tier_fns[0]
            self._fallback = ((self._eager,), "eager", -1)
            return self.tier

    def raise_next(self, error: TierFailed) -> None:
        """``on_failure="raise"``: the next call raises ``error``, later calls are served."""
        with self._lock:
            self._fn = self._raiser(error, self._fn)

    def _raiser(self, error: BaseException, then: Fn) -> Fn:
        def raise_once(*args: Any) -> Any:
            with self._lock:
                if self._fn is raise_once:  # a swap since the failure stays in place
                    self._fn = then
            raise error

        self._stand_ins[raise_once] = then
        return raise_once

    def _planning(self, work: PerThread, first_call: Fn, previous: Fn) -> Fn:
        """Until the calling thread made the tier's per-thread plans (per_thread.py), one per
        call, ``previous`` answers its calls; then the tier serves. Not one of the tier's own
        callables: an error ``previous`` raises here drops nothing of the tier."""
        def planning(*args: Any) -> Any:
            if work.step():
                return previous(*args)
            with self._lock:
                if self._fn is planning:
                    self._fn = first_call
            return GraphRunner.__call__(self, *args)  # whatever serves now, as it would

        self._stand_ins[planning] = previous
        return planning

    def _probation(self, tier: str, fn: Fn, previous: Fn) -> Fn:
        def first_call(*args: Any) -> Any:
            start = time.monotonic()
            out = fn(*args)
            if self.listener is not None:
                self.listener.first_call(tier, start, time.monotonic())
            if self._verify:
                ref = previous(*args)
                if not _close(out, ref):
                    self._drop(first_call,
                               "verify: its output disagrees with the previous tier's")
                    return ref
            with self._lock:
                if self._fn is first_call:  # a tier swapped in meanwhile stays in place
                    # graduated: later calls go straight to the artifact, timed for a window
                    self._fn = self._timing_locked(tier, fn, "first")
            return out

        return first_call

    # ------------------------------------------------------------------ timing as it serves

    def _timing_locked(self, tier: str, fn: Fn, window: str) -> Fn:
        """``fn``, timed for ``served.WINDOW`` calls where the runner has a clock; the timed
        callable counts as the tier's own (a call that raises in it drops the tier)."""
        clock = self.clock
        if clock is None or self.listener is None:
            return fn

        def done(wrapper: Fn, marks: list[Any]) -> None:
            with self._lock:  # the window is full: the artifact alone again, wherever it is
                if self._fn is wrapper:
                    self._fn = fn
                fns, name, rank = self._fallback  # a swap during the window's last call
                self._fallback = (tuple(fn if f is wrapper else f for f in fns), name, rank)
            _lane(clock).submit(self._report, tier, window, clock, marks, 0)
            if window == "first":
                threads.scheduler.later(served.STEADY_AFTER_S, self._time_again, tier, fn)

        wrapper = served.timed(fn, clock, served.WINDOW, done)
        self._tier_fns = (*self._tier_fns, wrapper)
        return wrapper

    def _time_again(self, tier: str, fn: Fn) -> None:
        """The steady window: ``fn`` timed again if it still serves."""
        with self._lock:
            if self._fn is fn:
                self._fn = self._timing_locked(tier, fn, "steady")

    def _report(self, tier: str, window: str, clock: CallClock, marks: list[Any],
                tries: int) -> None:
        try:
            times = clock.read(marks)
        except Exception as e:  # a device error is the user's next call's to see, not ours
            log.debug("graph %s: tier %r's calls not timed: %s: %s", self.graph_id, tier,
                      type(e).__name__, e)
            return
        if times is None:  # the device has not run them all yet: look again a little later
            if tries < _READ_TRIES:
                threads.io.later(_READ_EVERY_S, self._report, tier, window, clock, marks,
                                 tries + 1)
            return
        if self.listener is not None and times:  # empty: every call was captured, not run
            self.listener.served(Window(tier, window, times))

    def _ask_eager(self, fn: Fn, reason: str, args: tuple[Any, ...]) -> Any:
        """``fn`` raised ``reason``: eager answers the call, or raises the user's error."""
        out = self._eager(*args)
        self._drop(fn, f"raised in a call and was dropped: {reason}")
        return out

    def _drop(self, fn: Fn, reason: str) -> None:
        """The tier ``fn`` serves goes back to the one before it; nothing changes if ``fn``
        no longer serves (another call dropped it first, or a swap replaced it)."""
        with self._lock:
            if not any(fn is f for f in self._tier_fns):
                return
            dropped = self.tier
            self._tier_fns, self.tier, self._rank = self._fallback
            self._fn = self._tier_fns[0]
            self._fallback = ((self._eager,), "eager", -1)
            back = self.tier
        if self.listener is not None:
            self.listener.dropped(dropped, back, reason)


class ProfiledGraphRunner(GraphRunner):
    """A GraphRunner that records each call (start, end, serving tier, thread) on a timeline,
    and marks it for torch.profiler when one is recording, so traces can be merged."""

    def __init__(self, *args: Any, timeline: Timeline, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timeline = timeline
        self._seq = itertools.count(1)

    def __call__(self, *args: Any) -> Any:
        seq = next(self._seq)
        tier = self.tier
        start = time.monotonic()
        try:
            if torch._C._autograd._profiler_enabled():
                with torch.profiler.record_function(call_mark(self.graph_id, seq)):
                    return super().__call__(*args)
            return super().__call__(*args)
        finally:
            self._timeline.add_call(self.graph_id, tier, start, time.monotonic(),
                                    threading.current_thread().name, seq)
