"""The threads hotswap starts beside the user's code, so that ``hotswap.shutdown()`` can wait
for each of them.

Every one is a daemon: none holds up the interpreter's exit. Each is started here, which keeps
the set of those still running: loaders (loader.py, the warm-up's among them), the cache
stamp's lookups, fleet lookups, gate measurements due later (timers), the runtime's idle-pool
reaper. Those that loop end when idle or when told to (``Loader.stop_all``, the reaper's
event); ``join_all`` waits for the rest, up to a deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["join_all", "live", "start", "start_timer"]

_lock = threading.Lock()
_live: set[threading.Thread] = set()


def start(target: Callable[..., Any], *, name: str, args: tuple[Any, ...] = (),
          kwargs: dict[str, Any] | None = None) -> threading.Thread:
    """Run ``target(*args, **kwargs)`` on a daemon thread named ``name``, counted until it ends."""
    thread: threading.Thread

    def run() -> None:
        try:
            target(*args, **(kwargs or {}))
        finally:
            _forget(thread)

    thread = threading.Thread(target=run, name=name, daemon=True)
    _begin(thread)
    return thread


class _Timer(threading.Timer):
    def run(self) -> None:
        try:
            super().run()
        finally:
            _forget(self)


def start_timer(delay_s: float, fn: Callable[..., Any], args: tuple[Any, ...], *,
                name: str) -> threading.Timer:
    """Run ``fn(*args)`` after ``delay_s`` on a daemon thread, counted until it ends."""
    timer = _Timer(delay_s, fn, args)
    timer.name, timer.daemon = name, True
    _begin(timer)
    return timer


def _begin(thread: threading.Thread) -> None:
    with _lock:
        _live.add(thread)
    try:
        thread.start()
    except BaseException:  # no thread to start (RuntimeError: can't start new thread)
        _forget(thread)
        raise


def _forget(thread: threading.Thread) -> None:
    with _lock:
        _live.discard(thread)


def live() -> list[threading.Thread]:
    """hotswap's threads running now."""
    with _lock:
        return list(_live)


def join_all(timeout_s: float, *, name: str | None = None) -> list[str]:
    """Wait up to ``timeout_s`` for every hotswap thread (``name``: of that name) to end, the
    caller's own aside; the names of those still running then."""
    deadline = time.monotonic() + timeout_s
    me = threading.current_thread()
    while True:
        running = [t for t in live() if t is not me and t.is_alive()
                   and (name is None or t.name == name)]
        if not running:
            return []
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return sorted(t.name for t in running)
        running[0].join(min(remaining, 0.1))
