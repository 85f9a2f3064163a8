"""One graph dynamo handed to hotswap: the callable it calls, and the tier serving it.

``GraphRunner.__call__`` is the hot path: one attribute read and one call. A swap replaces that
attribute (atomic under the GIL), so a call already running finishes on the old callable and
threads never see a half-made swap. A newly swapped tier serves its first call on probation:
if it raises (or, with ``verify=True``, disagrees with the tier before it), the graph goes back
to the previous callable, the reason is recorded, and the call is answered by that callable.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hotswap.errors import HotswapError
from hotswap.orchestrator.counters import bump

__all__ = ["GraphRunner", "GraphStatus", "TierFailed"]

log = logging.getLogger("hotswap")

Fn = Callable[..., Any]
# A gate decides whether a ready tier may replace the serving one: (runner, tier) -> (adopt, why).
Gate = Callable[["GraphRunner", str], tuple[bool, str]]


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
                 verify: bool = False, raise_failures: bool = False, gate: Gate | None = None):
        self.graph_id = graph_id
        self._gm = gm
        self._ranks = {name: i for i, name in enumerate(tiers)}
        self._verify = verify
        self._raise_failures = raise_failures
        self._gate = gate
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
        return self._gm(*args)

    # ------------------------------------------------------------------ state changes

    def serve_now(self, tier: str, fn: Fn) -> None:
        """Blocking modes: the tier serves from the very first call (no eager, no swap)."""
        with self._lock:
            self._fn = fn
            self._fallback = (self._eager, "eager", -1)
            self.tier = tier
            self._rank = self._ranks.get(tier, 0)
            self.pending.discard(tier)

    def swap_in(self, tier: str, fn: Fn) -> bool:
        """Adopt a ready tier if it ranks above the serving one and the gate agrees."""
        with self._lock:
            self.pending.discard(tier)
            rank = self._ranks[tier]
            if rank <= self._rank:
                self.kept.append((tier, f"tier {self.tier!r} already serves"))
                return False
            if self._gate is not None:
                adopt, why = self._gate(self, tier)
                if not adopt:
                    self.kept.append((tier, why))
                    return False
            previous = self._fn
            self._fallback = (previous, self.tier, self._rank)
            self._fn = self._probation(tier, fn, previous)
            self.tier, self._rank = tier, rank
        bump("swaps")
        log.info("graph %s: now served by tier %r", self.graph_id, tier)
        return True

    def skip(self, tier: str, reason: str) -> None:
        """A tier that will not be compiled nor loaded (a better one is already on its way)."""
        with self._lock:
            self.pending.discard(tier)
            self.kept.append((tier, reason))

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
            out = fn(*args)
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
            self._fn, self.tier, self._rank = self._fallback
            self._fallback = (self._eager, "eager", -1)

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
            )
