"""hotswap: torch.compile that never blocks.

Importing hotswap must stay cheap and torch-free: every worker process imports it first.
"""

from hotswap.errors import (
    CompileFailed,
    HotswapError,
    JobTimeout,
    MemoryLimitExceeded,
    PoolClosed,
    SerializationFailed,
    WorkerCrashed,
    WorkerStartFailed,
)
from hotswap.workers import StageEvent, WorkerPool

__version__ = "0.1.0"

__all__ = [
    "CompileFailed",
    "HotswapError",
    "JobTimeout",
    "MemoryLimitExceeded",
    "PoolClosed",
    "SerializationFailed",
    "StageEvent",
    "WorkerCrashed",
    "WorkerPool",
    "WorkerStartFailed",
    "__version__",
]
