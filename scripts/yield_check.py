"""How much a thread that yields the GIL (the load path's warm-up, ``threads.yielding_gil``)
slows another thread's Python beside it, with each way of looking at the clock.

    python scripts/yield_check.py

A thread calls a small function in a loop for 1.5 s: alone, then beside a thread inside
``yielding_gil`` that does the same, once through ``sys.monitoring`` (Python 3.12+) and once
through ``sys.settrace``. On 3.12 a trace function on one thread makes the interpreter
instrument every line of every thread; the loop's rate beside each says what that costs a
caller. (H100 machine, Python 3.12.3: 0.92-0.95x alone through sys.monitoring, 0.29x
through sys.settrace.) On Python 3.11 both rows use sys.settrace.
"""

from __future__ import annotations

import sys
import threading
import time

from hotswap.engine import threads


def _f(i: int) -> int:
    return i + 1


def _rate(seconds: float = 1.5) -> float:
    """Loops of 500 calls per second on this thread."""
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for i in range(500):
            _f(i)
        n += 1
    return n / seconds


def _beside(monitoring: bool) -> float:
    threads._monitoring._available = monitoring and sys.version_info >= (3, 12)
    stop = threading.Event()

    def yielding() -> None:
        with threads.yielding_gil():
            while not stop.is_set():
                for i in range(200):
                    _f(i)

    worker = threading.Thread(target=yielding)
    worker.start()
    time.sleep(0.2)
    try:
        return _rate()
    finally:
        stop.set()
        worker.join()


def main() -> int:
    alone = _rate()
    monitored, traced = _beside(True), _beside(False)
    print(f"Python {sys.version.split()[0]}: the caller's loops per second alone {alone:.0f}; "
          f"beside a yielding thread: sys.monitoring {monitored:.0f} ({monitored / alone:.2f}x), "
          f"sys.settrace {traced:.0f} ({traced / alone:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
