"""A Dask worker preload: ``dask worker SCHEDULER --nthreads 1 --preload hotswap.fleet.preload``.

Warms the worker as a local compile worker warms (torch, inductor, the device, one tiny
compile) on a thread as it joins; a job that arrives meanwhile waits for it (it would pay the
same costs itself)."""

from __future__ import annotations

import threading
from typing import Any

from hotswap.executors.dask import warm_worker


def dask_setup(worker: Any) -> None:
    threading.Thread(target=warm_worker, daemon=True, name="hotswap-warm").start()
