"""Crash-proof pool of subprocess workers that run named jobs (see pool.py and child.py)."""

from hotswap.workers.child import emit_stage, in_worker, stage
from hotswap.workers.pool import DEFAULT_WARM_MODULES, JobFuture, WorkerInfo, WorkerPool
from hotswap.workers.protocol import StageEvent

__all__ = [
    "DEFAULT_WARM_MODULES",
    "JobFuture",
    "StageEvent",
    "WorkerInfo",
    "WorkerPool",
    "emit_stage",
    "in_worker",
    "stage",
]
