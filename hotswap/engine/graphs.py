"""A backend's graphs: their journeys in arrival order, what ``status`` and ``wait`` read, and
the recompile limits dynamo hit in their calls. One lock; waits wake when any graph moves."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from hotswap import compat
from hotswap.counting import bump
from hotswap.engine.graph import GraphRunner
from hotswap.engine.journey import GraphJourney

__all__ = ["Graphs"]


class Graphs:
    def __init__(self, on_settled: Callable[[], None] | None = None) -> None:
        # Told, outside the lock, each time a move leaves every graph final.
        self._on_settled = on_settled
        self._cond = threading.Condition()
        self._journeys: list[GraphJourney] = []
        # Dynamo's recompile limits hit in calls of this backend's models: (limit, function)
        # -> how often, the last hit.
        self._limit_hits: dict[tuple[str, str], tuple[int, compat.RecompileLimitHit]] = {}

    def add(self, journey: GraphJourney) -> None:
        with self._cond:
            self._journeys.append(journey)

    def remove(self, journey: GraphJourney) -> None:
        """Let go of one graph (dynamo will not call it)."""
        with self._cond:
            if journey in self._journeys:
                self._journeys.remove(journey)
            self._cond.notify_all()

    def journeys(self) -> list[GraphJourney]:
        with self._cond:
            return list(self._journeys)

    def runners(self) -> list[GraphRunner]:
        with self._cond:
            return [j.runner for j in self._journeys]

    def moved(self) -> None:
        """A graph moved (a tier arrived, swapped, failed): wake the waits; and where every
        graph is final now, say so (``on_settled``)."""
        with self._cond:
            self._cond.notify_all()
            settled = bool(self._journeys) and all(j.final for j in self._journeys)
        if settled and self._on_settled is not None:
            self._on_settled()

    def drop(self) -> list[GraphJourney]:
        """Let go of every graph (and the limits noted); the caller forgets them."""
        with self._cond:
            dropped, self._journeys = self._journeys, []
            self._limit_hits.clear()
            self._cond.notify_all()
        return dropped

    def wait(self, timeout_s: float | None, idle: Callable[[], bool]) -> None:
        """Until every graph is final and ``idle()`` (nothing measuring), or ``timeout_s``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while not all(j.final for j in self._journeys) or not idle():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._cond.wait(remaining)

    def limit_hit(self, hit: compat.RecompileLimitHit) -> None:
        bump("recompile_limits")
        with self._cond:
            key = (hit.limit_name, hit.function)
            self._limit_hits[key] = (self._limit_hits.get(key, (0, hit))[0] + 1, hit)

    def notes(self) -> list[str]:
        with self._cond:
            hits = list(self._limit_hits.values())
        return [hit.note(times) for times, hit in hits]
