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
  events are read on hotswap's I/O lane once they have all completed (it polls). Calls from
  several threads at once on one stream overlap there, and each one's span holds the others'.

``GraphStatus.served_ms`` holds each window's median (and the first window's slowest call)
beside the gate's measurement; a steady median ``GAP`` (10 %) or more slower than the gate
measured is said in ``GraphStatus.served_gap`` and counted (``served_gaps``).

Where no gate weighs a tier before it serves (``async``), the tier serves on probation: eager's
calls are timed too, one window from its second call to the swap at the latest, and a tier
whose steady window's median runs ``GAP`` or more slower than eager's gives way to eager
(journey.py); at once, after its first window, where even the window's fastest call took
``FAR_SLOWER`` times eager's median. Calls made while the current stream captures a CUDA
graph are not timed (an event recorded there would join the capture).
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["FAR_SLOWER", "GAP", "MIN_CALLS", "STEADY_AFTER_S", "WINDOW", "CallClock",
           "CudaClock", "Window", "clock_for", "timed"]

log = logging.getLogger("hotswap")

WINDOW = 100          # calls timed in each window
MIN_CALLS = 20        # eager's window, cut short by a swap, is reported from this many calls
FAR_SLOWER = 2.0      # on probation, a first window whose every call took this many times
                      # eager's median sends its tier back at once
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
    """Times calls on the CPU: ``start``/``stop`` around each, ``read`` at the window's end
    (None: not yet readable)."""

    lane = "scheduler"  # where ``read`` runs: it waits for nothing

    def start(self) -> Any:
        return time.perf_counter()

    def stop(self, started: Any) -> Any:
        return (started, time.perf_counter())

    def read(self, marks: list[Any]) -> tuple[float, ...] | None:
        return tuple((end - start) * 1e3 for start, end in marks)


class CudaClock(CallClock):
    """Times calls on CUDA device ``index`` with events on its current stream (the user's);
    ``read`` on the I/O lane, once every event has completed (it polls: no wait that holds
    the lane behind a deep queue of the user's work)."""

    lane = "io"

    def __init__(self, index: int) -> None:
        import torch

        self._torch = torch
        self._index = index

    def _record(self) -> Any:
        torch = self._torch
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self._index))
        return event

    def start(self) -> Any:
        if self._torch.cuda.is_current_stream_capturing():
            return None  # the call is being captured, not run: not timed
        return self._record()

    def stop(self, started: Any) -> Any:
        return None if started is None else (started, self._record())

    def read(self, marks: list[Any]) -> tuple[float, ...] | None:
        marks = [m for m in marks if m is not None]
        if not all(end.query() for _, end in marks):
            return None
        return tuple(float(start.elapsed_time(end)) for start, end in marks)


def clock_for(devices: Iterable[str]) -> CallClock | None:
    """The clock for a graph whose tensor inputs are on ``devices`` ("cpu", "cuda", "cuda:1"):
    the first CUDA device's (a CPU scalar beside CUDA tensors is not the graph's device), else
    the CPU's; None for a graph with no tensor input or one on another kind of device."""
    devices = list(devices)
    cuda = next((d for d in devices if d.startswith("cuda")), None)
    if cuda is not None:
        import torch

        index = int(cuda.partition(":")[2] or torch.cuda.current_device())
        return CudaClock(index)
    if devices and all(d == "cpu" for d in devices):
        return CallClock()
    return None


def timed(fn: Callable[..., Any], clock: CallClock, window: int,
          done: Callable[[Callable[..., Any], list[Any]], None]) -> Callable[..., Any]:
    """``fn`` timed for its next ``window`` calls; then ``done(the wrapper, marks)``, once (a
    call that raises is not timed)."""
    marks: list[Any] = []
    tickets = itertools.count()  # atomic under the GIL: calls from several threads
    closed: list[bool] = []      # the window is full: a wrapper still held anywhere only calls

    def timed_call(*args: Any) -> Any:
        if closed:
            return fn(*args)
        started = clock.start()
        out = fn(*args)
        mark = clock.stop(started)  # first: nothing of ours between the call and its end
        ticket = next(tickets)
        if ticket < window:
            marks.append(mark)
            if ticket == window - 1:
                closed.append(True)
                try:
                    done(timed_call, marks)
                except Exception as e:  # never the user's call's: it was answered
                    log.debug("hotswap: a timed window not reported: %s: %s",
                              type(e).__name__, e)
        return out

    return timed_call
