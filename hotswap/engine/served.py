"""A tier's calls as it serves them, against what the gate measured of it.

The gate measures a tier in a worker, on inputs made from the graph's metadata, in blocks of
back-to-back calls. What serves is the artifact in the user's process, called as the user
calls it. So once a tier serves (its first call passed), the runner times a window of its
calls (``WINDOW``: the first calls after the swap), and ``STEADY_AFTER_S`` later one more
(its steady state); the hot path carries no timing outside the two windows.

- On the CPU a call's time is its wall time (``time.perf_counter``).
- On a CUDA device it is the device's time from a CUDA event recorded before the call to one
  recorded after, on the user's stream: what the call cost the device, launch gaps
  included, as the gate's blocks count it. Nothing synchronizes the user's thread: the
  events are read on hotswap's I/O lane once the window's last one has completed.

``GraphStatus.served_ms`` holds each window's median (and the first window's slowest call)
beside the gate's measurement; a steady median ``GAP`` (10 %) or more slower than the gate
measured is said in ``GraphStatus.served_gap`` and counted (``served_gaps``).
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["GAP", "STEADY_AFTER_S", "WINDOW", "CallClock", "Window", "clock_for"]

WINDOW = 100          # calls timed in each window
STEADY_AFTER_S = 10.0  # from the first window's end to the second's start
GAP = 0.10            # a steady median this much slower than measured is reported


@dataclass(frozen=True)
class Window:
    """One window's calls: which one ("first" after the swap, or "steady"), their times."""

    tier: str
    name: str
    times_ms: tuple[float, ...]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)

    @property
    def max_ms(self) -> float:
        return max(self.times_ms)


class CallClock:
    """Times calls on the CPU: ``start``/``stop`` around each, ``read`` at the window's end."""

    lane = "scheduler"  # where ``read`` runs: it waits for nothing

    def start(self) -> Any:
        return time.perf_counter()

    def stop(self, started: Any) -> Any:
        return (started, time.perf_counter())

    def read(self, marks: list[Any]) -> tuple[float, ...]:
        return tuple((end - start) * 1e3 for start, end in marks)


class CudaClock(CallClock):
    """Times calls on a CUDA device with events on the current stream; ``read`` waits for the
    window's last event (on the I/O lane: the wait releases the GIL)."""

    lane = "io"

    def start(self) -> Any:
        import torch

        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
        return event

    def stop(self, started: Any) -> Any:
        import torch

        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
        return (started, event)

    def read(self, marks: list[Any]) -> tuple[float, ...]:
        marks[-1][1].synchronize()
        return tuple(float(start.elapsed_time(end)) for start, end in marks)


def clock_for(device: str) -> CallClock | None:
    """The clock for a graph on ``device`` ("cpu", "cuda", "cuda:1"); None for others."""
    if device == "cpu":
        return CallClock()
    if device.startswith("cuda"):
        return CudaClock()
    return None


def timed(fn: Callable[..., Any], clock: CallClock, window: int,
          done: Callable[[Callable[..., Any], list[Any]], None]) -> Callable[..., Any]:
    """``fn`` timed for its next ``window`` calls; then ``done(the wrapper, marks)``, once (a
    call that raises is not timed)."""
    marks: list[Any] = []
    tickets = itertools.count()  # atomic under the GIL: calls from several threads

    def timed_call(*args: Any) -> Any:
        started = clock.start()
        out = fn(*args)
        ticket = next(tickets)
        if ticket < window:
            marks.append(clock.stop(started))
            if ticket == window - 1:
                done(timed_call, marks)
        return out

    return timed_call
