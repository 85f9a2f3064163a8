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
pool's default) also raises a worker that got under ``CROWDED_SHARE`` of a core over the
last ``STARVED_AFTER_S``, while this process's cores had less idle time than it could have
taken and processes other than this one's own threads and its workers (its other children
count as other processes) used at least ``CROWDED_BY`` of them (``MachineLoad``): the compile
then competes with that other work as one in this process would (in a session of its own, one
more equal beside the caller's). Where the OS will not raise it, it keeps its job, lowered.
The compile service's pool yields to all (``yield_to="all"``): its callers are the other
processes.

What the watch did shows in ``WorkerPool.cpu_note()`` (``hotswap.status`` puts it on the
pending graphs) and, once, in the log.
"""

from __future__ import annotations

import collections
import logging
import os
import resource
import threading
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import NamedTuple

from hotswap.system import proctree
from hotswap.system.priority import WorkerPriority

__all__ = ["CROWDED_BY", "CROWDED_SHARE", "POLL_S", "STARVED_AFTER_S", "STARVED_SHARE",
           "STOPPED_GRACE_S", "YIELD_TO", "CpuWatch", "Found", "MachineLoad"]

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


class Found(NamedTuple):
    """A worker to raise: its share of a core over ``over_s`` seconds, and, where other
    processes crowded it out (rather than it starving), (their cores, this process's)."""
    pid: int
    share: float
    over_s: float
    crowded_by: tuple[float, float] | None


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
        # yield_to="caller" on lowered workers: the machine's load over the polls.
        self.load = MachineLoad.here() if yield_to == "caller" and self.lowered else None
        self._raised: set[int] = set()
        self._lock = threading.Lock()
        self._note = ""
        self._warned: set[str] = set()

    @property
    def note(self) -> str:
        with self._lock:
            return self._note

    def starved(self, now: float, needed: AbstractSet[int],
                watched: AbstractSet[int] = frozenset()) -> list[Found]:
        """Poll: the needed workers starved for ``STARVED_AFTER_S`` (raised ones too), or
        else crowded out by other processes over the last ``STARVED_AFTER_S`` (``yield_to=
        "caller"``; not raised ones). ``watched``: every live worker, whose CPU is the pool's
        own work, not other processes'. Workers no longer needed are forgotten."""
        self.next_poll_s = now + POLL_S
        for pid in set(self._samples) - needed:
            self._samples.pop(pid, None)
            self._starved_since.pop(pid, None)
        found = []
        used = proctree.trees_cpu_s(set(needed) | set(watched) if self.load is not None
                                    else needed)
        if self.load is not None and needed:
            self.load.sample(now, used)
        for pid in needed:
            cpu = used.get(pid, 0.0)
            before = self._samples.get(pid)
            if before is None or now - before[0] <= 0:
                self._samples[pid] = (now, cpu)
                continue
            share = (cpu - before[1]) / (now - before[0])
            if share < STARVED_SHARE:
                since = self._starved_since.setdefault(pid, before[0])
                if now - since >= STARVED_AFTER_S:
                    found.append(Found(pid, share, now - since, None))
                continue
            self._samples[pid] = (now, cpu)
            self._starved_since.pop(pid, None)
            crowded = (self.load.crowded(pid) if self.load is not None and pid not in self._raised
                       else None)
            if crowded is not None:
                crowded_share, others, own = crowded
                found.append(Found(pid, crowded_share, STARVED_AFTER_S, (others, own)))
        if not self._raised and not self._starved_since:
            self._set_note("")
        elif self._starved_since and not self._raised:
            waited = max(now - s for s in self._starved_since.values())
            self._set_note(f"waiting on CPU: compile workers got under {STARVED_SHARE:.0%} of a "
                           f"core for {waited:.1f} s (the cores are busy)")
        return found

    def raise_worker(self, found: Found) -> bool:
        """Raise a starved or crowded-out worker to normal priority; False where the OS refused
        a starved one (the caller then restarts its job on a worker started at normal
        priority). A crowded-out one the OS will not raise keeps its job, put back where it
        was (a refused raise may have done part of its work): it still gets a share, and
        restarting would lose its work."""
        pid, crowded_by = found.pid, found.crowded_by
        raised = self.priority.raise_tree(pid)
        if raised:
            self._raised.add(pid)
            kind = "raised"
            action = "raised them to the caller's priority until their job ends"
            if crowded_by is not None:
                action += ", to share the cores with that work as a compile in this process would"
        elif crowded_by is not None:
            self.priority.lower_tree(pid)
            self.load = None  # not again: the OS refuses
            kind = "kept"
            action = ("the OS refused to raise their priority (CAP_SYS_NICE or RLIMIT_NICE); "
                      "they stay lowered")
        else:
            self.priority.normal_start = True
            self.load = None  # new workers start at normal priority: nothing to raise
            kind = "restarted"
            action = ("the OS refused to raise their priority (CAP_SYS_NICE or RLIMIT_NICE); "
                      "restarting the job on a worker at normal priority")
        why = (f"other processes kept the cores busy ({crowded_by[0]:.1f} cores; this process "
               f"{crowded_by[1]:.1f})" if crowded_by is not None else "the cores were busy")
        message = (f"compile workers got {found.share:.0%} of a core for {found.over_s:.1f} s "
                   f"while {why}; {action}")
        self._set_note(f"waiting on CPU: {message}")
        if kind not in self._warned:  # once per pool for each thing done
            self._warned.add(kind)
            log.warning("hotswap: %s (HOTSWAP_WORKER_NICE, HOTSWAP_WORKER_IDLE and "
                        "HOTSWAP_WORKER_YIELD set the workers' priority)", message)
        return raised or crowded_by is not None

    def is_raised(self, pid: int) -> bool:
        return pid in self._raised

    def job_ended(self, pid: int) -> None:
        """Lower a raised worker again once its job is over (never refused)."""
        if pid in self._raised:
            self.priority.lower_tree(pid)
        self.forget(pid, exited=False)

    def forget(self, pid: int, *, exited: bool = True) -> None:
        """The worker exited (a raised one too, before its job or readiness ended): a pid
        the OS reuses for a new worker starts afresh. (``exited=False``: its job ended; the
        load's window keeps what it used, the caller's work.)"""
        self._raised.discard(pid)
        self._samples.pop(pid, None)
        self._starved_since.pop(pid, None)
        if self.load is not None and exited:
            self.load.forget(pid)
        if not self._raised and not self._starved_since:
            self._set_note("")

    def _set_note(self, note: str) -> None:
        with self._lock:
            self._note = note


@dataclass(frozen=True, slots=True)
class _Sample:
    time: float
    busy_s: float    # this process's cores, not idle (user, nice, system)
    idle_s: float    # this process's cores, idle (idle, iowait)
    own_s: float     # this process's threads (not its children)
    # live worker pid (or a forgotten one's ("gone", pid, n)) -> its tree's CPU seconds
    workers: dict[object, float]


class MachineLoad:
    """The load of the cores this process may run on, one sample per poll, and who made it:
    this process's own threads (the caller), its watched workers' trees, everyone else.

    ``crowded(pid)``: over the last ``STARVED_AFTER_S`` (the same window for every worker),
    worker ``pid`` got under ``CROWDED_SHARE`` of a core, the cores had no idle time it could
    have used, and processes other than this one and its watched workers used ``CROWDED_BY``
    cores or more. Children of this process that are not its workers count as other
    processes. Linux only (``/proc/stat``): ``here()`` is None elsewhere."""

    def __init__(self, read_cores: Callable[[], tuple[float, float]],
                 read_own: Callable[[], float] | None = None) -> None:
        self._read_cores = read_cores
        self._read_own = read_own or _own_cpu_s
        self._samples: collections.deque[_Sample] = collections.deque()
        self._gone = 0

    @classmethod
    def here(cls) -> MachineLoad | None:
        try:
            cores = frozenset(os.sched_getaffinity(0))
            _proc_stat(cores)
        except (AttributeError, OSError, ValueError):
            return None
        return cls(lambda: _proc_stat(cores))

    def sample(self, now: float, workers: Mapping[int, float]) -> None:
        try:
            busy, idle = self._read_cores()
        except (OSError, ValueError):
            return
        if self._samples and now - self._samples[-1].time > 3 * POLL_S:
            self._samples.clear()  # polls stopped meanwhile (no job): a new window
        cpu: dict[object, float] = {pid: seconds for pid, seconds in workers.items()}
        self._samples.append(_Sample(now, busy, idle, self._read_own(), cpu))
        # Keep the newest sample at least a window old, and none older.
        while len(self._samples) > 2 and self._samples[1].time <= now - STARVED_AFTER_S:
            self._samples.popleft()

    def crowded(self, pid: int) -> tuple[float, float, float] | None:
        """(its share of a core, others' cores, this process's cores) over the window where
        other processes crowded worker ``pid`` out (see the class), else None."""
        window = self.window(pid)
        if window is None:
            return None
        share, idle, others, own = window
        if share >= CROWDED_SHARE or idle >= CROWDED_SHARE - share or others < CROWDED_BY:
            return None
        return share, others, own

    def window(self, pid: int) -> tuple[float, float, float, float] | None:
        """Over the last ``STARVED_AFTER_S``, in cores: (worker ``pid``'s share, the idle
        time, other processes', this process's own); None unless it was watched (had a job,
        or started while one waited) the whole window."""
        if len(self._samples) < 2:
            return None
        first, last = self._samples[0], self._samples[-1]
        elapsed = last.time - first.time
        if elapsed < STARVED_AFTER_S or any(pid not in s.workers for s in self._samples):
            return None  # not a whole window, or not watched all along (between two jobs)
        # Every worker's CPU in the window, to its last sample in it: one that ended its
        # job or exited meanwhile is the pool's work, not others'; so is all of one that
        # started meanwhile (every live worker is sampled on each poll, so a worker missing
        # from the first sample had not started).
        last_seen: dict[object, float] = {}
        for sample in self._samples:
            last_seen.update(sample.workers)
        workers = sum(cpu - first.workers.get(key, 0.0) for key, cpu in last_seen.items())
        own = (last.own_s - first.own_s) / elapsed
        return ((last.workers[pid] - first.workers[pid]) / elapsed,
                (last.idle_s - first.idle_s) / elapsed,
                (last.busy_s - first.busy_s - workers) / elapsed - own, own)

    def forget(self, pid: int) -> None:
        """A worker that exited or was killed: its CPU in the window stays the pool's, under
        a name of its own, so that a new worker the OS gives its pid is not paired with it."""
        self._gone += 1
        for sample in self._samples:
            if pid in sample.workers:
                sample.workers[("gone", pid, self._gone)] = sample.workers.pop(pid)


def _own_cpu_s() -> float:
    """This process's CPU seconds, all its threads (not its children)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _proc_stat(cores: frozenset[int]) -> tuple[float, float]:
    """(busy, idle) CPU seconds of ``cores`` since boot, from /proc/stat's ``cpuN`` lines
    (interrupt and steal time in neither)."""
    tick = os.sysconf("SC_CLK_TCK")
    busy = idle = 0.0
    found = False
    with open("/proc/stat", "rb") as f:
        for line in f:
            if not line.startswith(b"cpu") or line.startswith(b"cpu "):
                continue
            name, *fields = line.split()
            if int(name[3:]) not in cores:
                continue
            values = [int(v) for v in fields[:5]]  # user nice system idle iowait
            busy += values[0] + values[1] + values[2]
            idle += values[3] + values[4]
            found = True
    if not found:
        raise ValueError("/proc/stat names none of this process's cores")
    return busy / tick, idle / tick
