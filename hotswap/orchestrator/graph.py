"""One graph dynamo handed to hotswap: the callable it calls, and the tier serving it.

``GraphRunner.__call__`` is the hot path: one attribute read and one call. A swap replaces that
attribute (atomic under the GIL), so a call already running finishes on the old callable and
threads never see a half-made swap. A newly swapped tier serves its first call on probation:
if it raises (or, with ``verify=True``, disagrees with the tier before it), the graph goes back
to the previous callable, the reason is recorded, and the call is answered by that callable.

Tiers climb by rank (their place in the ladder). The benchmark gate lives in the coordinator:
it decides before ``swap_in`` is called, and may adopt a lower-ranked tier that measured faster
(``measured=True``). ``ProfiledGraphRunner`` also records every call and the tier that served it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from hotswap.errors import HotswapError
from hotswap.orchestrator.counters import bump
from hotswap.profiles.timeline import Timeline
from hotswap.profiles.trace import call_mark

__all__ = ["GraphRunner", "GraphStatus", "ProfiledGraphRunner", "TierFailed"]

log = logging.getLogger("hotswap")

Fn = Callable[..., Any]
# Told of each change of serving tier and each first call on a new tier:
# (what, tier, previous tier, start_s, end_s); what is "swap", "first_call" or "dropped".
Observer = Callable[[str, str, str, float, float], None]


class TierFailed(HotswapError):
    """A tier could not serve a graph (raised into the user's call only with on_failure="raise")."""

    def __init__(self, graph_id: str, tier: str, reason: str) -> None:
        super().__init__(f"graph {graph_id}: tier {tier!r} failed: {reason}")
        self.graph_id = graph_id
        self.tier = tier
        self.reason = reason


@dataclass(frozen=True)
class GraphStatus:
    graph_id: str
    tier: str                                  # serving now; "eager" until a tier swaps in
    final: bool                                # nothing pending, whether the ladder succeeded or not
    pending: tuple[str, ...]
    failures: tuple[tuple[str, str], ...]      # (tier, reason)
    kept: tuple[tuple[str, str], ...]          # ready tiers not served, and why
    timings_s: dict[str, float] = field(default_factory=dict)  # "tier/stage" -> seconds
    eager_calls: int = 0
    # How the serving tier got here: "eager" (none did), "worker", "cache", or
    # "inprocess: <why the graph could not go to a worker>".
    path: str = "eager"
    # Why the pending tiers wait, where hotswap knows ("" otherwise), e.g. "waiting on CPU:
    # ..." when the caller's threads starve the compile workers (workers/starvation.py).
    waiting: str = ""
    # What went wrong with the artifact cache in this process ("" when nothing did): it could
    # not be opened, read, written or locked; the graph is served and compiled without it.
    cache: str = ""


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
                 verify: bool = False, raise_failures: bool = False):
        self.graph_id = graph_id
        self._gm = gm
        self._ranks = {name: i for i, name in enumerate(tiers)}
        self._verify = verify
        self._raise_failures = raise_failures
        self.observer: Observer | None = None
        # Run once, after the first call served eagerly returns (the coordinator starts this
        # process's load-path warm-up there).
        self.after_first_call: Callable[[], None] | None = None
        self._lock = threading.Lock()
        self._fn: Fn = self._eager
        # What serves if the current tier fails: (callable, tier name, rank).
        self._fallback: tuple[Fn, str, int] = (self._eager, "eager", -1)
        self.tier = "eager"
        self._rank = -1
        self.pending: set[str] = set()
        self.failures: list[tuple[str, str]] = []
        self.kept: list[tuple[str, str]] = []
        self.timings_s: dict[str, float] = {}
        self.eager_calls = 0
        self._paths: dict[str, str] = {}

    @property
    def serving(self) -> Fn:
        """The callable serving calls now (what ``__call__`` dispatches to)."""
        return self._fn

    # ------------------------------------------------------------------ hot path

    def __call__(self, *args: Any) -> Any:
        fn = self._fn
        try:
            return fn(*args)
        except Exception as e:
            if fn is self._eager or isinstance(e, TierFailed):
                raise
            return self._demote(fn, e, args)

    def _eager(self, *args: Any) -> Any:
        self.eager_calls += 1
        bump("eager_calls")
        out = self._gm(*args)
        if self.after_first_call is not None:
            hook, self.after_first_call = self.after_first_call, None
            hook()
        return out

    # ------------------------------------------------------------------ state changes

    def serve_now(self, tier: str, fn: Fn) -> None:
        """Blocking modes: the tier serves from the very first call (no eager, no swap)."""
        with self._lock:
            self._fn = fn
            self._fallback = (self._eager, "eager", -1)
            self.tier = tier
            self._rank = self._ranks.get(tier, 0)
            self.pending.discard(tier)

    def swap_in(self, tier: str, fn: Fn, *, measured: bool = False) -> bool:
        """Adopt a ready tier if it ranks above the serving one (or, ``measured``, if the gate
        benchmarked it faster than the serving one, whatever its rank)."""
        with self._lock:
            self.pending.discard(tier)
            rank = self._ranks[tier]
            if rank <= self._rank and not measured:
                self.kept.append((tier, f"tier {self.tier!r} already serves"))
                return False
            previous, previous_tier = self._fn, self.tier
            self._fallback = (previous, self.tier, self._rank)
            self._fn = self._probation(tier, fn, previous)
            self.tier, self._rank = tier, rank
        bump("swaps")
        log.info("graph %s: now served by tier %r", self.graph_id, tier)
        self._observe("swap", tier, previous_tier)
        return True

    def expect(self, tiers: Iterable[str]) -> None:
        """These tiers are on their way (``status().pending`` until each ends)."""
        with self._lock:
            self.pending.update(tiers)

    def add_timing(self, key: str, seconds: float, *, accumulate: bool = True) -> None:
        """``status().timings_s[key]``: add ``seconds`` to it (or set it)."""
        with self._lock:
            self.timings_s[key] = (self.timings_s.get(key, 0.0) if accumulate else 0.0) + seconds

    def arrived(self, tier: str, path: str) -> None:
        """Note how ``tier``'s artifact came (``status().path`` while it serves)."""
        with self._lock:
            self._paths[tier] = path

    def keep(self, tier: str, reason: str) -> None:
        """A tier that will not serve: not needed (a better one is on its way or came from the
        cache) or kept out by the gate. It is still on file; ``status().kept`` says why."""
        with self._lock:
            self.pending.discard(tier)
            self.kept.append((tier, reason))

    @property
    def rank(self) -> int:
        return self._rank

    def _observe(self, what: str, tier: str, previous: str, start_s: float | None = None,
                 end_s: float | None = None) -> None:
        if self.observer is not None:
            now = time.monotonic()
            self.observer(what, tier, previous, start_s or now, end_s or now)

    def fail(self, tier: str, reason: str, *, level: int = logging.WARNING) -> None:
        """Record a failed tier; the graph stays where it is. Logged once (WARNING by default)."""
        with self._lock:
            self.pending.discard(tier)
            self.failures.append((tier, reason))
            if self._raise_failures:
                error = TierFailed(self.graph_id, tier, reason)
                serving = self._fn
                self._fn = self._raiser(error, serving)
        bump("fallbacks")
        log.log(level, "hotswap graph %s: tier %r failed, staying on %r: %s",
                self.graph_id, tier, self.tier, reason)

    def _raiser(self, error: BaseException, then: Fn) -> Fn:
        def raise_once(*args: Any) -> Any:
            with self._lock:
                if self._fn is raise_once:  # a swap since the failure stays in place
                    self._fn = then
            raise error

        return raise_once

    def _probation(self, tier: str, fn: Fn, previous: Fn) -> Fn:
        def first_call(*args: Any) -> Any:
            start = time.monotonic()
            out = fn(*args)
            self._observe("first_call", tier, tier, start, time.monotonic())
            if self._verify:
                ref = previous(*args)
                if not _close(out, ref):
                    self._restore_fallback()
                    self.fail(tier, "verify: its output disagrees with the previous tier's")
                    return ref
            self._fn = fn  # graduated: later calls go straight to the artifact
            return out

        return first_call

    def _demote(self, fn: Fn, error: Exception, args: tuple[Any, ...]) -> Any:
        failed_tier = self.tier
        self._restore_fallback()
        self.fail(failed_tier, f"raised in a call and was dropped: {type(error).__name__}: {error}")
        return self(*args)

    def _restore_fallback(self) -> None:
        with self._lock:
            dropped = self.tier
            self._fn, self.tier, self._rank = self._fallback
            self._fallback = (self._eager, "eager", -1)
            back = self.tier
        self._observe("dropped", back, dropped)

    def status(self) -> GraphStatus:
        with self._lock:
            return GraphStatus(
                graph_id=self.graph_id,
                tier=self.tier,
                final=not self.pending,
                pending=tuple(sorted(self.pending, key=lambda t: self._ranks.get(t, 0))),
                failures=tuple(self.failures),
                kept=tuple(self.kept),
                timings_s=dict(self.timings_s),
                eager_calls=self.eager_calls,
                path=self._paths.get(self.tier, "eager"),
            )


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
