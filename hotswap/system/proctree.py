"""Process-tree helpers for the pool: kill a worker with everything it started, measure its RSS
and CPU time, change its priority.

Each worker leads its own session and process group (``start_new_session=True``), so inductor's
compile subprocesses share its group. A descendant can still leave the group (``setsid``), so
kills take both routes: every descendant psutil can see, then the whole group.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable

import psutil

__all__ = ["descendants", "is_stopped", "kill_tree", "set_tree_priority", "stopped",
           "tree_cpu_s", "tree_rss_bytes", "trees_cpu_s", "usable_cores"]


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return list(psutil.Process(pid).children(recursive=True))
    except psutil.Error:
        return []


def kill_tree(pid: int, extra: list[psutil.Process] | None = None) -> None:
    """SIGKILL ``pid``, its descendants (listed before the kill: once the worker is gone, its
    children are re-parented and can no longer be found from it) and its process group."""
    procs = descendants(pid) + (extra or [])
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    kill_group(pid)


def kill_group(pgid: int) -> None:
    """Kill what is left of a worker's process group (no-op when it is empty)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def tree_rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` plus all its descendants; 0 when it is gone."""
    try:
        root = psutil.Process(pid)
        total: int = root.memory_info().rss
        for child in root.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                total += child.memory_info().rss
        return total
    except psutil.Error:
        return 0


def tree_cpu_s(pid: int) -> float:
    """CPU seconds used by ``pid`` and its descendants (living ones, and those it waited
    for); 0 when it is gone."""
    return trees_cpu_s((pid,))[pid]


def trees_cpu_s(pids: Iterable[int]) -> dict[int, float]:
    """CPU seconds used by each of ``pids`` and its descendants (living ones, and those it
    waited for; 0 for one that is gone), from one pass over the machine's processes (a tree
    walk reads every process's parent anyway)."""
    pids = set(pids)
    if not pids:
        return {}
    try:
        parent, cpu = _proc_stats()
    except OSError:  # no /proc (macOS): psutil's way, slower
        parent, cpu = {}, {}
        for proc in psutil.process_iter(["ppid", "cpu_times"]):
            times = proc.info["cpu_times"]
            if times is None or proc.info["ppid"] is None:
                continue
            parent[proc.pid] = proc.info["ppid"]
            cpu[proc.pid] = (times.user + times.system + times.children_user
                             + times.children_system)
    children: dict[int, list[int]] = {}
    for child, ppid in parent.items():
        children.setdefault(ppid, []).append(child)
    totals = {}
    for pid in pids:
        total, stack = 0.0, [pid] if pid in cpu else []
        while stack:
            node = stack.pop()
            total += cpu.get(node, 0.0)
            stack.extend(children.get(node, ()))
        totals[pid] = total
    return totals


def _proc_stats() -> tuple[dict[int, int], dict[int, float]]:
    """Every process's parent and CPU seconds (its own and its waited children's), read from
    /proc/<pid>/stat: a third of psutil.process_iter's time (3.1 ms for 67 processes)."""
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        # The name (field 2) may hold spaces and parentheses: the fields after it follow
        # the last ")". Then: state ppid ... utime stime cutime cstime (fields 3, 4, 14-17).
        fields = stat[stat.rfind(b")") + 2:].split()
        parent[int(name)] = int(fields[1])
        cpu[int(name)] = sum(int(v) for v in fields[11:15]) / tick
    return parent, cpu


def is_stopped(proc: psutil.Process | int) -> bool:
    """The process is stopped (SIGSTOP, SIGTSTP, a debugger's stop); False when it is gone."""
    try:
        proc = proc if isinstance(proc, psutil.Process) else psutil.Process(proc)
        return proc.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False


def stopped(pid: int) -> int | None:
    """A process of ``pid``'s tree that is stopped, or None: a stopped process holds up its
    whole job."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    return next((int(proc.pid) for proc in procs if is_stopped(proc)), None)


def set_tree_priority(pid: int, *, nice: int, idle: bool) -> bool:
    """Give every thread of ``pid`` and its descendants this niceness and policy (SCHED_IDLE
    or SCHED_OTHER), and their session's autogroup the niceness (see priority.lower_priority).
    Linux sets both per thread. False when the OS refused any of it: raising a priority needs
    CAP_SYS_NICE (root) or an RLIMIT_NICE that allows it; lowering one never does."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return True  # gone: nothing to do
    policy = getattr(os, "SCHED_IDLE" if idle else "SCHED_OTHER", None)
    ok = True
    for proc in procs:
        try:
            tids = [t.id for t in proc.threads()]
        except psutil.Error:
            continue
        for tid in tids:
            try:
                if policy is not None:
                    os.sched_setscheduler(tid, policy, os.sched_param(0))
                os.setpriority(os.PRIO_PROCESS, tid, nice)
            except (ProcessLookupError, FileNotFoundError):
                continue
            except PermissionError:
                ok = False
    try:
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(str(max(nice, 19 if idle else 0)))
    except PermissionError:
        ok = False
    except OSError:
        pass  # no autogroup scheduling here
    return ok
