"""Peak resident memory of process trees, sampled on a daemon thread (the tools' one sampler;
the pool's memory limit reads the same ``proctree.tree_rss_bytes``)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from hotswap.system.proctree import tree_rss_bytes

__all__ = ["PeakRss"]


class PeakRss:
    """Samples the trees rooted at ``roots()`` every ``interval_s`` until ``stop()``, which
    returns the peak in bytes: of their sum, or with ``each=True`` of the largest one."""

    def __init__(self, roots: Callable[[], Iterable[int]], *, interval_s: float = 0.05,
                 each: bool = False, name: str = "hotswap-rss") -> None:
        self.peak = 0
        self._stop = threading.Event()

        def sample() -> None:
            while not self._stop.wait(interval_s):
                sizes = [tree_rss_bytes(pid) for pid in roots()]
                self.peak = max(self.peak, (max(sizes, default=0) if each else sum(sizes)))

        self._thread = threading.Thread(target=sample, daemon=True, name=name)
        self._thread.start()

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(timeout=2)
        return self.peak
