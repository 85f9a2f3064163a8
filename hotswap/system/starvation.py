"""Compiles never starve: a worker that gets no CPU for its job is raised to normal priority.

Workers run below the caller (by default in a cgroup with ``cpu.idle=1`` where one can be
made, else ``SCHED_IDLE`` at niceness 19: priority.py) so that the user's calls keep their
cores while a compile runs. On a machine without a spare core that becomes "never compiles":
a caller whose threads kept both cores of our 2-core box busy left the default tier pending
for as long as it served (121,050 eager calls in 60 s).

So the pool's manager samples the CPU time of every worker that has a job (or is starting
while a job or a caller in ``wait_ready``, i.e. ``prepare(wait=True)``, waits for it): one
that got under ``STARVED_SHARE`` of a core for ``STARVED_AFTER_S`` is
starved, and is raised to the caller's priority (out of the workers' cgroup, niceness 0,
``SCHED_OTHER``) until its job ends; then it is lowered again. From then on the compile
shares the cores with the caller's threads as equals: the caller's calls slow down while it
runs (measured in BENCHMARKS.md), and the compile ends.

Raising a priority needs CAP_SYS_NICE (root has it) or an RLIMIT_NICE that allows it (and to
move a worker out of the workers' cgroup, write access to the caller's own cgroup). Where
the OS refuses, the starved worker is killed, its job goes back to the front of the queue,
and workers start at normal priority from then on: the job starts over, having lost the
little it had done.

A worker that is stopped (SIGSTOP, a suspended terminal job) would hold its job until the
time limit: each of these polls also looks for a stopped process in a worker's tree, and one
seen stopped for ``STOPPED_GRACE_S`` is killed and its job fails as after a crash
(``WorkerStopped``; callers retry once), whether or not the worker looks starved: a stopped
worker's children (the C++ compiler) keep running and using CPU (watchdog.py).

What the watch did shows in ``WorkerPool.cpu_note()`` (``hotswap.status`` puts it on the
pending graphs) and, once, in the log.
"""

from __future__ import annotations

import logging
import threading

from hotswap.system import proctree
from hotswap.system.priority import WorkerPriority

__all__ = ["POLL_S", "STARVED_AFTER_S", "STARVED_SHARE", "STOPPED_GRACE_S", "CpuWatch"]

log = logging.getLogger("hotswap")

STARVED_SHARE = 0.25   # of one core
STARVED_AFTER_S = 2.0
POLL_S = 0.5
# A worker seen stopped (SIGSTOP, Ctrl-Z) this long is killed as if it had crashed, one poll
# at most later; a claim holder stopped this long is given up on (engine/sources/cache_access.py).
STOPPED_GRACE_S = 2.0


class CpuWatch:
    """The manager thread's view of its workers' CPU share. ``note`` may be read anywhere."""

    def __init__(self, nice: int, idle: bool) -> None:
        # How workers are lowered, raised and lowered again (priority.py)
        self.priority = WorkerPriority(nice, idle)
        self.lowered = self.priority.lowered
        self.next_poll_s = 0.0
        self._samples: dict[int, tuple[float, float]] = {}  # pid -> (time, cpu seconds)
        self._starved_since: dict[int, float] = {}
        self._raised: set[int] = set()
        self._lock = threading.Lock()
        self._note = ""
        self._warned = False

    @property
    def note(self) -> str:
        with self._lock:
            return self._note

    def starved(self, now: float, needed: set[int]) -> list[tuple[int, float]]:
        """Poll: the needed workers starved for ``STARVED_AFTER_S`` (raised ones too), with
        their share of a core over that time. Workers no longer needed are forgotten."""
        self.next_poll_s = now + POLL_S
        for pid in set(self._samples) - needed:
            self._samples.pop(pid, None)
            self._starved_since.pop(pid, None)
        found = []
        for pid in needed:
            cpu = proctree.tree_cpu_s(pid)
            before = self._samples.get(pid)
            if before is None or now - before[0] <= 0:
                self._samples[pid] = (now, cpu)
                continue
            share = (cpu - before[1]) / (now - before[0])
            if share >= STARVED_SHARE:
                self._samples[pid] = (now, cpu)
                self._starved_since.pop(pid, None)
                continue
            since = self._starved_since.setdefault(pid, before[0])
            if now - since >= STARVED_AFTER_S:
                found.append((pid, share))
        if not self._raised and not self._starved_since:
            self._set_note("")
        elif self._starved_since and not self._raised:
            waited = max(now - s for s in self._starved_since.values())
            self._set_note(f"waiting on CPU: compile workers got under {STARVED_SHARE:.0%} of a "
                           f"core for {waited:.1f} s (the caller's threads keep the cores busy)")
        return found

    def raise_worker(self, pid: int, share: float, waited_s: float) -> bool:
        """Raise a starved worker to normal priority; False where the OS refused (the caller
        then restarts its job on a worker started at normal priority)."""
        raised = self.priority.raise_tree(pid)
        if raised:
            self._raised.add(pid)
            action = "raised them to the caller's priority until their job ends"
        else:
            self.priority.normal_start = True
            action = ("the OS refused to raise their priority (CAP_SYS_NICE or RLIMIT_NICE); "
                      "restarting the job on a worker at normal priority")
        message = (f"compile workers got {share:.0%} of a core for {waited_s:.1f} s while the "
                   f"caller's threads kept every core busy; {action}")
        self._set_note(f"waiting on CPU: {message}")
        if not self._warned:
            self._warned = True
            log.warning("hotswap: %s (HOTSWAP_WORKER_NICE / HOTSWAP_WORKER_IDLE set the "
                        "workers' priority)", message)
        return raised

    def is_raised(self, pid: int) -> bool:
        return pid in self._raised

    def job_ended(self, pid: int) -> None:
        """Lower a raised worker again once its job is over (never refused)."""
        if pid in self._raised:
            self.priority.lower_tree(pid)
        self.forget(pid)

    def forget(self, pid: int) -> None:
        """The worker exited (a raised one too, before its job or readiness ended): a pid
        the OS reuses for a new worker starts afresh."""
        self._raised.discard(pid)
        self._samples.pop(pid, None)
        self._starved_since.pop(pid, None)
        if not self._raised and not self._starved_since:
            self._set_note("")

    def starved_for(self, pid: int, now: float) -> float:
        return now - self._starved_since.get(pid, now)

    def _set_note(self, note: str) -> None:
        with self._lock:
            self._note = note
