"""The process-wide pools of compile workers the coordinators share, and how they are set up."""

from __future__ import annotations

import atexit
import os
import threading

from hotswap.workers import WorkerPool
from hotswap.workers.pool import default_workers

__all__ = ["prewarm_loading", "shared_pool"]

_pools: dict[int | None, WorkerPool] = {}
_pools_lock = threading.Lock()


def shared_pool(workers: int | None = None) -> WorkerPool:
    """The process-wide pool of compile workers (one per requested size), started and warming."""
    with _pools_lock:
        pool = _pools.get(workers)
        if pool is None:
            size = workers or default_workers()
            # Inductor's own parallel compile would put several processes per worker on a few
            # cores; share the cores out instead, unless the user chose.
            threads = str(max(1, (os.cpu_count() or 1) // size))
            env = {} if "TORCHINDUCTOR_COMPILE_THREADS" in os.environ else {
                "TORCHINDUCTOR_COMPILE_THREADS": threads}
            pool = WorkerPool(size, worker_env=env, nice=_worker_nice(),
                              rss_limit_bytes=_rss_limit(), warm_modules=(
                "torch", "torch._inductor.compile_fx", "hotswap.orchestrator.compile_job:warm_worker"))
            pool.start()
            _pools[workers] = pool
        return pool


def _worker_nice() -> int:
    """Compile workers yield the CPU to the user's process: niceness +10 unless
    HOTSWAP_WORKER_NICE says otherwise (0 keeps the caller's priority)."""
    raw = os.environ.get("HOTSWAP_WORKER_NICE", "10")
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= 19:
        raise ValueError(f"HOTSWAP_WORKER_NICE must be a whole number from 0 to 19, got {raw!r}")
    return value


def _rss_limit() -> int | None:
    """A worker whose memory passes HOTSWAP_WORKER_RSS_LIMIT_BYTES is killed and its job fails
    with MemoryLimitExceeded (default: no limit)."""
    raw = os.environ.get("HOTSWAP_WORKER_RSS_LIMIT_BYTES", "")
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"HOTSWAP_WORKER_RSS_LIMIT_BYTES must be a number of bytes > 0, got {raw!r}")
    return value


def prewarm_loading(devices: set[str]) -> None:
    """Pay the load path's one-time costs (imports; on CPU, inductor's vector-ISA probe, which
    runs the C++ compiler) on the loader thread while workers compile, not during the swap."""
    import torch._functorch._aot_autograd.autograd_cache
    import torch._inductor.codecache
    import torch._inductor.standalone_compile

    if "cpu" in devices:
        from torch._inductor import cpu_vec_isa

        cpu_vec_isa.pick_vec_isa()
    if any(d.startswith("cuda") for d in devices):
        import torch._inductor.runtime.triton_heuristics  # noqa: F401


@atexit.register
def _shutdown_pools() -> None:
    with _pools_lock:
        pools = list(_pools.values())
        _pools.clear()
    for pool in pools:
        pool.terminate()
