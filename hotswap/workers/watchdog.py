"""Which workers to kill, and why: the manager thread's timers, as decisions.

    Watchdog.next_deadline(workers, queued)  -> how long the manager's select may sleep
    Watchdog.overdue(workers, queued, now)   -> [(worker, reason)] for the manager to kill:
        ("start", None)      not ready after ``ready_timeout_s``
        ("timeout", limit)   its job ran past its time limit
        ("memory", rss)      its process tree passed ``rss_limit_bytes`` (polled)
        ("stopped", pid)     a process of its tree stopped (SIGSTOP, a suspended job) for
                             ``STOPPED_GRACE_S``, looked for on every CPU poll
        ("starved", share)   starved at a lowered priority the OS will not raise; its job
                             starts over at normal priority (starvation.py)

A starved worker the OS lets us raise is raised here, not killed. Runs on the manager thread
only; the manager owns the workers and does the killing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from hotswap.system import proctree
from hotswap.system.starvation import POLL_S, STOPPED_GRACE_S, CpuWatch
from hotswap.workers.inbox import PoolConfig
from hotswap.workers.process import WorkerProcess

__all__ = ["Watchdog"]

log = logging.getLogger("hotswap.workers.manager")

Kill = tuple[WorkerProcess, tuple[str, Any]]


class Watchdog:
    def __init__(self, config: PoolConfig, cpu: CpuWatch) -> None:
        self.config = config
        self.cpu = cpu
        self._next_rss_poll_s = 0.0
        self._stopped_since: dict[int, float] = {}  # worker pid -> first seen stopped

    def job_ended(self, pid: int, *, had_job: bool) -> None:
        if had_job:
            self.cpu.job_ended(pid)
        self._stopped_since.pop(pid, None)

    def ready(self, pid: int, *, queued: bool) -> None:
        """A worker finished starting. One raised while it starved at its start (someone
        waited on it) is lowered again unless a job is queued for it to take raised."""
        if not queued:
            self.cpu.job_ended(pid)

    def next_deadline(self, workers: Iterable[WorkerProcess], queued: bool,
                      now: float) -> float | None:
        workers = list(workers)
        deadlines = [w.deadline_s for w in workers if w.deadline_s is not None]
        deadlines += [w.started_s + self.config.ready_timeout_s for w in workers if not w.ready]
        if self.config.rss_limit_bytes is not None and any(w.job is not None for w in workers):
            deadlines.append(self._next_rss_poll_s)
        if _cpu_needed(workers, queued):
            deadlines.append(self.cpu.next_poll_s)
        return max(0.0, min(deadlines) - now) if deadlines else None

    def overdue(self, workers: Iterable[WorkerProcess], queued: bool, now: float) -> list[Kill]:
        workers = [w for w in workers if w.kill_reason is None]
        kills: list[Kill] = []
        poll_rss = now >= self._next_rss_poll_s
        if poll_rss:
            self._next_rss_poll_s = now + self.config.rss_poll_s
        for worker in workers:
            if not worker.ready and now - worker.started_s > self.config.ready_timeout_s:
                kills.append((worker, ("start", None)))
            elif worker.deadline_s is not None and now >= worker.deadline_s:
                assert worker.job is not None
                kills.append((worker, ("timeout", worker.job.timeout_s)))
            elif self.config.rss_limit_bytes is not None and worker.job is not None and poll_rss:
                rss = proctree.tree_rss_bytes(worker.pid)
                if rss > self.config.rss_limit_bytes:
                    kills.append((worker, ("memory", rss)))
        if now >= self.cpu.next_poll_s:
            killed = {w.pid for w, _ in kills}
            kills += self._watch_cpu([w for w in workers if w.pid not in killed], queued, now)
        return kills

    def _watch_cpu(self, workers: list[WorkerProcess], queued: bool, now: float) -> list[Kill]:
        """Stopped workers are killed; compiles never starve (starvation.py): raise a starved
        worker, or where the OS will not, restart its job on a worker at normal priority."""
        needed = _cpu_needed(workers, queued)
        if not needed:
            self.cpu.next_poll_s = now + POLL_S
            return []
        by_pid = {w.pid: w for w in workers}
        kills = self._watch_stopped([by_pid[pid] for pid in needed], now)
        for found in self.cpu.starved(now, needed, set(by_pid)):
            pid = found.pid
            worker = by_pid.get(pid)
            if worker is None or pid in self._stopped_since:
                continue  # a stopped worker is not starved: raising it would not help
            if not self.cpu.lowered:
                continue  # at the caller's priority: the note says why it waits
            if self.cpu.is_raised(pid):
                # Raised before it read its INIT, a starting worker lowers itself after: raise
                # it again (idempotent; a raised worker that merely shares busy cores stays so).
                self.cpu.priority.raise_tree(pid)
                continue
            if not self.cpu.raise_worker(found):
                kills.append((worker, ("starved", found.share)))
        return kills

    def _watch_stopped(self, workers: list[WorkerProcess], now: float) -> list[Kill]:
        """SIGSTOP, a suspended terminal job: a stopped worker would hold its job until the
        time limit. Killed like a crash once seen stopped for ``STOPPED_GRACE_S`` (its job is
        retried once), so ``STOPPED_GRACE_S`` to one poll more after the stop. Looked for on
        every poll, not only once the worker looks starved: its children (the C++ compiler,
        inductor's compile workers) keep running while it is stopped, and their CPU time keeps
        its tree from looking starved for as long as they run."""
        kills: list[Kill] = []
        # Pids no longer watched (killed, done) are forgotten: a reused pid starts afresh.
        watched = {w.pid for w in workers}
        for pid in [p for p in self._stopped_since if p not in watched]:
            del self._stopped_since[pid]
        for worker in workers:
            stopped = proctree.stopped(worker.pid)
            if stopped is None:
                self._stopped_since.pop(worker.pid, None)
                continue
            since = self._stopped_since.setdefault(worker.pid, now)
            if now - since >= STOPPED_GRACE_S:
                log.warning("hotswap: worker %d is stopped (process %d, for %.1f s); "
                            "killing it and replacing it", worker.pid, stopped, now - since)
                kills.append((worker, ("stopped", stopped)))
        return kills


def _cpu_needed(workers: Iterable[WorkerProcess], queued: bool) -> set[int]:
    """Workers whose CPU share matters: running a job, or starting while someone waits (a
    queued job, or a caller in ``wait_ready``)."""
    return {w.pid for w in workers if w.kill_reason is None
            and (w.job is not None or (not w.ready and queued))}
