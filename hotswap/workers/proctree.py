"""Process-tree helpers for the pool: kill a worker with everything it started, measure its RSS.

Each worker leads its own session and process group (``start_new_session=True``), so inductor's
compile subprocesses share its group. A descendant can still leave the group (``setsid``), so
kills take both routes: every descendant psutil can see, then the whole group.
"""

from __future__ import annotations

import contextlib
import os
import signal

import psutil

__all__ = ["descendants", "kill_tree", "tree_rss_bytes"]


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
