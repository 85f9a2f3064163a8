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

Workers in the idle group yield to every process of the machine, not only to the caller's:
beside another job (a test run on the 2-core box) the demo's worker got 0.2-0.5 of a core,
its compile took 25.6 s instead of 10.5 s, and compiled code served 57.1 s from process start
where plain torch.compile's first call, at normal priority beside the same job, returned
after 21.9 s. So a pool that yields to the caller only (``yield_to="caller"``, the local
pool's default) also raises a worker that got under ``CROWDED_SHARE`` of a core for
``STARVED_AFTER_S`` while processes other than this one and its descendants used at least
``CROWDED_BY`` of this process's cores: the compile then competes with that other work as
one in this process would (in a session of its own, one more equal beside the caller's).
The compile service's pool yields to all (``yield_to="all"``): its callers are the other
processes.

What the watch did shows in ``WorkerPool.cpu_note()`` (``hotswap.status`` puts it on the
pending graphs) and, once, in the log.
"""

from __future__ import annotations

import collections
import logging
import os
import threading

import psutil

from hotswap.system import proctree
from hotswap.system.priority import WorkerPriority

__all__ = ["CROWDED_BY", "CROWDED_SHARE", "POLL_S", "STARVED_AFTER_S", "STARVED_SHARE",
           "STOPPED_GRACE_S", "YIELD_TO", "CpuWatch", "OtherLoad"]

log = logging.getLogger("hotswap")

STARVED_SHARE = 0.25   # of one core
STARVED_AFTER_S = 2.0
# Crowded out by other processes (yield_to="caller"): under this share of a core while they
# used at least CROWDED_BY cores.
CROWDED_SHARE = 0.5
CROWDED_BY = 0.5
YIELD_TO = ("caller", "all")
POLL_S = 0.5
# A worker seen stopped (SIGSTOP, Ctrl-Z) this long is killed as if it had crashed, one poll
# at most later; a claim holder stopped this long is given up on (engine/sources/cache_access.py).
STOPPED_GRACE_S = 2.0


class CpuWatch:
    """The manager thread's view of its workers' CPU share. ``note`` may be read anywhere."""

    def __init__(self, nice: int, idle: bool, yield_to: str = "caller") -> None:
        if yield_to not in YIELD_TO:
            raise ValueError(f"yield_to must be one of {YIELD_TO}, got {yield_to!r}")
        # How workers are lowered, raised and lowered again (priority.py)
        self.priority = WorkerPriority(nice, idle)
        self.lowered = self.priority.lowered
        self.next_poll_s = 0.0
        self._samples: dict[int, tuple[float, float]] = {}  # pid -> (time, cpu seconds)
        self._starved_since: dict[int, float] = {}
        # yield_to="caller": what other processes use, and the cores they used while a
        # worker now under its share was (None: under CROWDED_BY).
        self.others = OtherLoad() if yield_to == "caller" else None
        self._crowded_by: dict[int, float | None] = {}
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
            self._crowded_by.pop(pid, None)
        if self.others is not None and needed:
            self.others.sample(now)
        found = []
        for pid in needed:
            cpu = proctree.tree_cpu_s(pid)
            before = self._samples.get(pid)
            if before is None or now - before[0] <= 0:
                self._samples[pid] = (now, cpu)
                continue
            share = (cpu - before[1]) / (now - before[0])
            others = self.others.cores_since(before[0]) if self.others is not None else 0.0
            crowded = others >= CROWDED_BY and share < CROWDED_SHARE
            if share >= STARVED_SHARE and not crowded:
                self._samples[pid] = (now, cpu)
                self._starved_since.pop(pid, None)
                self._crowded_by.pop(pid, None)
                continue
            since = self._starved_since.setdefault(pid, before[0])
            self._crowded_by[pid] = others if others >= CROWDED_BY else None
            if now - since >= STARVED_AFTER_S:
                found.append((pid, share))
        if not self._raised and not self._starved_since:
            self._set_note("")
        elif self._starved_since and not self._raised:
            waited = max(now - s for s in self._starved_since.values())
            crowded_by = [c for c in self._crowded_by.values() if c is not None]
            self._set_note(
                f"waiting on CPU: compile workers got under {CROWDED_SHARE:.0%} of a core for "
                f"{waited:.1f} s while other processes used {max(crowded_by):.1f} cores"
                if crowded_by and len(crowded_by) == len(self._crowded_by) else
                f"waiting on CPU: compile workers got under {STARVED_SHARE:.0%} of a core for "
                f"{waited:.1f} s (the cores are busy)")
        return found

    def raise_worker(self, pid: int, share: float, waited_s: float) -> bool:
        """Raise a starved worker to normal priority; False where the OS refused (the caller
        then restarts its job on a worker started at normal priority)."""
        raised = self.priority.raise_tree(pid)
        crowded_by = self._crowded_by.get(pid)
        if raised:
            self._raised.add(pid)
            action = "raised them to the caller's priority until their job ends"
            if crowded_by is not None:
                action += ", to share the cores with that work as a compile in this process would"
        else:
            self.priority.normal_start = True
            action = ("the OS refused to raise their priority (CAP_SYS_NICE or RLIMIT_NICE); "
                      "restarting the job on a worker at normal priority")
        why = (f"other processes used {crowded_by:.1f} cores" if crowded_by is not None
               else "the cores were busy")
        message = f"compile workers got {share:.0%} of a core for {waited_s:.1f} s while {why}; {action}"
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
        self._crowded_by.pop(pid, None)
        if not self._raised and not self._starved_since:
            self._set_note("")

    def starved_for(self, pid: int, now: float) -> float:
        return now - self._starved_since.get(pid, now)

    def _set_note(self, note: str) -> None:
        with self._lock:
            self._note = note


class OtherLoad:
    """The CPU that processes other than this one and its descendants (the caller, its
    workers, their compilers) use on the cores this process may run on, from the polls'
    samples: ``sample(now)`` on each poll, ``cores_since(t)`` over the polls since ``t``."""

    def __init__(self) -> None:
        # (time, busy CPU seconds of those cores, this process tree's CPU seconds), one per poll
        self._samples: collections.deque[tuple[float, float, float]] = collections.deque(
            maxlen=64)

    def sample(self, now: float) -> None:
        try:
            per_core = psutil.cpu_times(percpu=True)
            cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        except OSError:
            return
        busy = sum(_busy_s(times) for core, times in enumerate(per_core)
                   if cores is None or core in cores)
        self._samples.append((now, busy, proctree.tree_cpu_s(os.getpid())))

    def cores_since(self, start: float) -> float:
        """Cores the others used from the last sample at or before ``start`` (else the first)
        to the last one; 0 without two samples."""
        if len(self._samples) < 2:
            return 0.0
        first = next((s for s in reversed(self._samples) if s[0] <= start), self._samples[0])
        last = self._samples[-1]
        if last[0] <= first[0]:
            return 0.0
        return max(0.0, ((last[1] - first[1]) - (last[2] - first[2])) / (last[0] - first[0]))


def _busy_s(times: object) -> float:
    """A core's CPU seconds not idle (iowait is idle; steal is another machine's)."""
    return float(sum(getattr(times, name, 0.0)
                     for name in ("user", "nice", "system", "irq", "softirq")))
