"""How late a thread that asks to wake every millisecond wakes: the serving process's stalls
as its caller would feel them, whoever caused them.

A Python thread waking from ``time.sleep`` must take the GIL before it runs again. Where
another thread holds the GIL (a module compiled from source, a long C call that does not
release it) or the process gets no CPU, the wake is late by that long. The probe records
every wake's lateness on the user's clock (seconds since the process started), so that its
worst wakes can be matched against the stage timeline. One Python thread at work beside it
costs it up to the interpreter's switch interval (``sys.getswitchinterval()``, 5 ms): the
floor a ``torch:eager-backend`` row shows.

It also times the cycle collector's collections in the process (``gc.callbacks``): a full
collection holds the GIL over every tracked object, and in a serving process that has imported
inductor a warm-up's imports set one off (129 ms with torch alone on the 2-core box, the late
wake beside it as long; 220-290 ms in a GPT-2 row). And it lists the Python sources the
process compiles (the ``compile`` audit event: a module imported without bytecode), each one
GIL held for its whole compile: 56-146 ms for one of inductor's 300-400 KB modules on the
2-core box.

Where a wake is late by ``SNAPSHOT_LATE_S`` or more, the probe notes every other thread's
innermost frames as it wakes (``sys._current_frames``): the thread that held the GIL gave it
up a moment before, at the first point it could, so its frames are where it held it (a thread
blocked in a call that releases the GIL shows its frames too: the caller's own ``synchronize``,
a worker thread's wait). Given a view of the caller's calls (``watch_calls``), it notes them
too once a call has run past a limit: what the caller's thread waits in, and what ran
beside it."""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
import types
import weakref
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["SNAPSHOTS", "SNAPSHOT_LATE_S", "Lateness", "LatenessProbe"]

SNAPSHOT_LATE_S = 0.005  # a wake this late notes the other threads' frames
SNAPSHOTS = 2000  # notes kept per probe, the longest (a summary reports its ``top_snapshots``)
_FRAMES = 4  # innermost frames noted per thread
# (s since process start, "late wake" or "slow call", ms, ((thread, "inner < outer"), ...))
Snapshot = tuple[float, str, float, tuple[tuple[str, str], ...]]


@dataclass(frozen=True)
class Lateness:
    """What a probe saw: its wakes, their p50/p99/max lateness (ms) and the ``worst`` ones
    as ``(s since process start, ms late)``, largest first, at least a second apart (one
    stall, one entry)."""

    wakes: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    worst: tuple[tuple[float, float], ...]
    # the collector's collections in the same window, and the longest as (s, ms, generation)
    gc_collections: int = 0
    gc_worst: tuple[tuple[float, float, int], ...] = ()
    # Sources compiled in the window: how many, their KB, and the largest as (s, KB, file)
    compiles: int = 0
    compiled_kb: float = 0.0
    compiles_largest: tuple[tuple[float, float, str], ...] = ()
    # The threads' innermost frames at late wakes and slow calls (the probe's notes)
    snapshots: tuple[Snapshot, ...] = ()

    def as_dict(self) -> dict[str, object]:
        return {"probe_wakes": self.wakes, "probe_p50_ms": self.p50_ms,
                "probe_p99_ms": self.p99_ms, "probe_max_ms": self.max_ms,
                "probe_worst": [list(w) for w in self.worst],
                "gc_collections": self.gc_collections,
                "gc_worst": [list(w) for w in self.gc_worst],
                "source_compiles": self.compiles, "source_compiled_kb": self.compiled_kb,
                "source_compiles_largest": [list(c) for c in self.compiles_largest],
                "stall_stacks": [[at, what, ms, [list(t) for t in threads]]
                                 for at, what, ms, threads in self.snapshots]}


# Probes told of each source compiled (``compile`` audit events): one audit hook for the
# process, since hooks cannot be removed, and a probe leaves the set as it stops.
_listening: weakref.WeakSet[LatenessProbe] = weakref.WeakSet()
_hooked = False
_hook_lock = threading.Lock()


def _listen(probe: LatenessProbe) -> None:
    global _hooked
    with _hook_lock:
        if not _hooked:
            sys.addaudithook(_audit)
            _hooked = True
    _listening.add(probe)


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "compile" and _listening and len(args) >= 2:
        source = args[0]
        if isinstance(source, (str, bytes)) and len(source) >= 1024:
            for probe in list(_listening):
                probe._compiled_source(len(source) / 1024, str(args[1]))


class LatenessProbe:
    """A daemon thread that waits ``interval_s`` at a time until ``stop()``; ``summary()``
    is the :class:`Lateness` of its wakes. ``clock_origin``: the perf_counter reading that is
    second 0 of the reported times (the process's start, as the bench rows time)."""

    def __init__(self, *, interval_s: float = 0.001, clock_origin: float | None = None,
                 name: str = "hotswap-lateness") -> None:
        self._interval_s = interval_s
        self._origin = time.perf_counter() if clock_origin is None else clock_origin
        self._at = array("d")  # perf_counter of each wake
        self._late = array("d")  # its lateness, s
        self._stop = threading.Event()
        self._gc_started: float | None = None
        self._gc = array("d")  # start (perf_counter), seconds, generation of each collection
        gc.callbacks.append(self._collected)
        self._compiles: list[tuple[float, float, str]] = []  # (perf_counter, KB, file)
        self._snapshots: list[Snapshot] = []  # at: perf_counter until summary()
        self._call_started: Callable[[], float | None] = lambda: None
        self._call_limit_s = float("inf")
        self._noted_call: float | None = None
        _listen(self)
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._thread.start()

    def _compiled_source(self, kb: float, name: str) -> None:
        if not self._stop.is_set():
            self._compiles.append((time.perf_counter(), kb, name))

    def _collected(self, phase: str, info: dict[str, Any]) -> None:
        """``gc.callbacks``: runs on the thread whose allocation set the collection off."""
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            started, self._gc_started = self._gc_started, None
            self._gc.extend((started, time.perf_counter() - started,
                             float(info.get("generation", -1))))

    def watch_calls(self, started: Callable[[], float | None], limit_s: float) -> None:
        """Note the threads' frames once per call that has run longer than ``limit_s``:
        ``started()`` is the perf_counter reading at which the caller's call in progress
        began, None between calls."""
        self._call_started, self._call_limit_s = started, limit_s

    def _run(self) -> None:
        interval, at, late, stopped = self._interval_s, self._at, self._late, self._stop.wait
        while True:
            before = time.perf_counter()
            if stopped(interval):  # a timed wait, as a sleep: woken, it takes the GIL back
                return
            now = time.perf_counter()
            at.append(now)
            late_s = now - before - interval
            late.append(max(0.0, late_s))
            if late_s >= SNAPSHOT_LATE_S:
                self._note(before + interval, "late wake", late_s)
            call = self._call_started()
            if call is not None and now - call > self._call_limit_s and call != self._noted_call:
                self._noted_call = call
                self._note(call, "slow call", now - call)

    def _note(self, at: float, what: str, took_s: float) -> None:
        if len(self._snapshots) >= SNAPSHOTS:  # full: it takes the shortest one's place
            shortest = min(range(len(self._snapshots)), key=lambda i: self._snapshots[i][2])
            if self._snapshots[shortest][2] >= round(took_s * 1e3, 2):
                return
            del self._snapshots[shortest]
        names = {t.ident: t.name for t in threading.enumerate()}
        me = threading.get_ident()
        threads = []
        for ident, top in sys._current_frames().items():
            if ident == me:
                continue
            where: list[str] = []
            frame: types.FrameType | None = top
            while frame is not None and len(where) < _FRAMES:
                code = frame.f_code
                where.append(f"{code.co_name} ({os.path.basename(code.co_filename)}:"
                             f"{frame.f_lineno})")
                frame = frame.f_back
            threads.append((names.get(ident, str(ident)), " < ".join(where)))
        self._snapshots.append((at, what, round(took_s * 1e3, 2), tuple(threads)))

    def stop(self) -> None:
        _listening.discard(self)
        self._stop.set()
        self._thread.join(timeout=2)
        if self._collected in gc.callbacks:
            gc.callbacks.remove(self._collected)

    def summary(self, *, since_s: float = float("-inf"), until_s: float = float("inf"),
                top: int = 5, top_snapshots: int = 50) -> Lateness:
        """The wakes between ``since_s`` and ``until_s`` (on the probe's clock)."""
        origin = self._origin
        collections = [(round(self._gc[i] - origin, 3), round(self._gc[i + 1] * 1e3, 2),
                        int(self._gc[i + 2])) for i in range(0, len(self._gc) - 2, 3)
                       if since_s <= self._gc[i] - origin <= until_s]
        gc_worst = tuple(sorted(collections, key=lambda c: -c[1])[:top])
        compiled = [(round(at - origin, 3), round(kb, 1), name)
                    for at, kb, name in list(self._compiles) if since_s <= at - origin <= until_s]
        largest = tuple(sorted(compiled, key=lambda c: -c[1])[:top])
        sources = (len(compiled), round(sum(c[1] for c in compiled), 1), largest)
        notes = tuple(sorted(((round(at - origin, 3), what, ms, threads)
                              for at, what, ms, threads in list(self._snapshots)
                              if since_s <= at - origin <= until_s),
                             key=lambda n: -n[2])[:top_snapshots])
        picked = [i for i, at in enumerate(self._at) if since_s <= at - origin <= until_s]
        if not picked:
            return Lateness(0, 0.0, 0.0, 0.0, (), len(collections), gc_worst, *sources,
                            snapshots=notes)
        ordered = sorted(self._late[i] for i in picked)
        n = len(ordered)
        worst: list[tuple[float, float]] = []
        for i in sorted(picked, key=self._late.__getitem__, reverse=True):
            t = self._at[i] - origin
            if all(abs(t - w) >= 1.0 for w, _ in worst):
                worst.append((round(t, 3), round(self._late[i] * 1e3, 2)))
            if len(worst) == top:
                break
        return Lateness(n, ordered[n // 2] * 1e3, ordered[int(0.99 * (n - 1))] * 1e3,
                        ordered[-1] * 1e3, tuple(worst), len(collections), gc_worst, *sources,
                        snapshots=notes)
