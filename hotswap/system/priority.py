"""How a pool's workers are kept below the caller: in a cpu cgroup, else by lowering themselves.

    WorkerPriority.lower_new(pid)  -> (nice, idle)  a worker that just started, before its
                                    INIT: into the pool's cgroup where one can be made
                                    (cgroup.py); what it should still set on itself
                                    (lower_priority) goes out in INIT
    WorkerPriority.raise_tree(pid)  a starved worker and its subprocesses to the caller's
                                    priority: out of the group, niceness 0, SCHED_OTHER
    WorkerPriority.lower_tree(pid)  back where lower_new put it, once its job is over
    WorkerPriority.note             what ran ("cgroup v1 cpu.idle", "autogroup + SCHED_IDLE"):
                                    ``hotswap.status(...).worker_priority``

The group is used for ``idle`` (the workers only get CPU nobody else wants), which is what
``cpu.idle`` means for a group; a niceness alone keeps the niceness, as asked. Where no group
can be made (no writable cpu cgroup, macOS) or a worker cannot be moved into it, the worker
lowers itself as before: niceness, its session's autogroup niceness, ``SCHED_IDLE``.

Used by the pool's manager thread only (through starvation.CpuWatch); ``note`` may be read
from any thread.
"""

from __future__ import annotations

import contextlib
import os
import threading

from hotswap.system import cgroup, proctree

__all__ = ["SCHED_IDLE_IN_IDLE_GROUP", "WorkerPriority", "lower_priority"]

# Whether a worker in a ``cpu.idle`` group also runs under SCHED_IDLE itself: no. The kernel
# already lets a waking thread take the core from anything in an idle group, as it does from a
# SCHED_IDLE thread, and SCHED_IDLE inside was no better, if anything worse: in one run of
# scripts/priority_check.py (2 cores, 2 spinning workers, a call every 2 ms, on a machine
# that others kept busy, load 6) the caller's lateness was p99 0.88 ms, max 8.0 ms in the
# group alone and p99 5.9 ms, max 54 ms with SCHED_IDLE inside too (autogroup + SCHED_IDLE:
# p99 12 ms, max 501 ms; workers at normal priority: p99 330 ms). Beside two spinners of the
# caller's session, a third got 0.30 of a core in the group, 0.45 with SCHED_IDLE inside
# too, and 0.77 under SCHED_IDLE in a session of its own (2 s each, same machine). In a
# group of low weight (``cpu.weight``/``cpu.shares``, kernels without ``cpu.idle``) workers
# stay SCHED_IDLE: a weight alone does not let a waking thread take the core at once.
SCHED_IDLE_IN_IDLE_GROUP = False


class WorkerPriority:
    def __init__(self, nice: int, idle: bool, fs: cgroup.CgroupFs | None = None) -> None:
        self.nice, self.idle = nice, idle
        self.lowered = nice > 0 or idle
        # The OS would not raise a starved worker: new ones start at normal priority.
        self.normal_start = False
        self._fs = fs
        self._group: cgroup.WorkerGroup | None = None
        self._group_tried = False
        self._in_group: set[int] = set()
        self._notes: dict[int, str] = {}  # live worker pid -> how it was lowered
        self._last_note = ""
        self._lock = threading.Lock()

    @property
    def note(self) -> str:
        """How the workers yield the CPU: the live ones' ways (the last one's once none
        runs); "" before any started."""
        with self._lock:
            notes = list(dict.fromkeys(self._notes.values()))
            return "; ".join(notes) if notes else self._last_note

    def lower_new(self, pid: int) -> tuple[int, bool]:
        """Lower a worker that has not begun its work; the (niceness, SCHED_IDLE) it still
        sets on itself."""
        if self.normal_start or not self.lowered:
            why = " (the OS would not raise a starved worker)" if self.normal_start else ""
            self._set_note(pid, f"normal priority{why}")
            return 0, False
        group = self._worker_group() if self.idle else None
        if group is not None and group.add(pid):
            self._in_group.add(pid)
            idle = self._idle_in(group)
            self._set_note(pid, group.note + (" + SCHED_IDLE" if idle else ""))
            return self.nice, idle
        self._set_note(pid, _fallback_note(self.nice, self.idle))
        return self.nice, self.idle

    def raise_tree(self, pid: int) -> bool:
        """``pid`` and its descendants at the caller's priority; False where the OS refused
        any of it (CAP_SYS_NICE, RLIMIT_NICE, or a cgroup we may not move it out of)."""
        ok = True
        if pid in self._in_group and self._group is not None:
            ok = self._group.leave(pid)
            for proc in proctree.descendants(pid):
                self._group.leave(proc.pid)  # one that exits meanwhile is no refusal
        return proctree.set_tree_priority(pid, nice=0, idle=False) and ok

    def lower_tree(self, pid: int) -> None:
        """A raised worker, its job over, back where ``lower_new`` put it (never refused)."""
        if self.normal_start:
            proctree.set_tree_priority(pid, nice=0, idle=False)
            return
        idle = self.idle
        if pid in self._in_group and self._group is not None:
            for p in [pid, *(proc.pid for proc in proctree.descendants(pid))]:
                self._group.add(p)
            idle = self._idle_in(self._group)
        proctree.set_tree_priority(pid, nice=self.nice, idle=idle)

    def forget(self, pid: int) -> None:
        """The worker exited."""
        self._in_group.discard(pid)
        with self._lock:
            self._notes.pop(pid, None)

    def close(self) -> None:
        """Every worker has exited: the group goes (cgroup.release)."""
        group, self._group = self._group, None
        if group is not None:
            cgroup.release(group)

    def _worker_group(self) -> cgroup.WorkerGroup | None:
        if not self._group_tried:
            self._group_tried = True
            self._group = cgroup.acquire(self._fs)
        return self._group

    @staticmethod
    def _idle_in(group: cgroup.WorkerGroup) -> bool:
        return SCHED_IDLE_IN_IDLE_GROUP if group.knob == "cpu.idle" else True

    def _set_note(self, pid: int, note: str) -> None:
        with self._lock:
            self._notes[pid] = self._last_note = note


def _fallback_note(nice: int, idle: bool) -> str:
    parts = []
    group_nice = max(nice, 19 if idle else 0)  # as lower_priority sets it
    if os.path.exists("/proc/self/autogroup"):
        parts.append("autogroup" if group_nice == 19 and idle else f"autogroup nice {group_nice}")
    elif nice:
        parts.append(f"niceness {nice}")
    if idle and hasattr(os, "SCHED_IDLE"):
        parts.append("SCHED_IDLE")
    return " + ".join(parts) or "normal priority"


def lower_priority(nice: int, idle: bool) -> None:
    """Background compile work must not slow the user's process down: lower our priority
    (inherited by the compiler subprocesses we start) before any real work.

    A niceness alone is not enough on Linux. We lead a session of our own, and with autogroup
    scheduling (``/proc/sys/kernel/sched_autogroup_enabled``, on by default) the CPU is shared
    between sessions first and by niceness only within one: a niced worker still got half the
    CPU against the user's session, and the user's calls stalled while it compiled. The
    session's own niceness (``/proc/self/autogroup``, see sched(7)) is what makes it yield.

    ``idle`` goes further: the ``SCHED_IDLE`` policy, under which a thread of any other
    policy that wakes on a core takes it from us at once. Niceness only shares the CPU out
    over time, and a user's OpenMP threads that spin-wait for each other were still held up
    by a niced worker for a scheduler period (23 ms calls where 0.3 ms was usual, measured on
    2 cores); as ``SCHED_IDLE`` in a session of niceness 19, none were.

    Where the pool could put us in a cpu cgroup with ``cpu.idle=1`` (system/priority.py) it
    did so before INIT, and INIT asks for no ``idle`` here: on Linux 6.18 a ``SCHED_IDLE``
    process in a session of its own still competed with the user's session as an equal.
    """
    group_nice = max(nice, 19 if idle else 0)
    with contextlib.suppress(OSError):
        os.nice(nice)
    with contextlib.suppress(OSError), open("/proc/self/autogroup", "w") as f:
        f.write(str(group_nice))
    if idle:
        with contextlib.suppress(OSError, AttributeError):  # AttributeError: not Linux
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
