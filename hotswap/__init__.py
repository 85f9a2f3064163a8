"""hotswap: torch.compile that never blocks.

Importing hotswap must stay cheap and torch-free: every worker process imports it first. The
torch-facing API (compile, backend, status, wait) is therefore loaded on first use.
"""

from typing import TYPE_CHECKING, Any

from hotswap.errors import (
    CompileFailed,
    HotswapError,
    JobTimeout,
    MemoryLimitExceeded,
    PoolClosed,
    SerializationFailed,
    WaitTimeout,
    WorkerCrashed,
    WorkerStartFailed,
    WorkerStopped,
)
from hotswap.orchestrator.counters import counters, counters_delta
from hotswap.workers import StageEvent, WorkerPool

if TYPE_CHECKING:
    from hotswap.fleet.metrics import serve_metrics
    from hotswap.orchestrator.api import (
        backend,
        compile,
        prepare,
        runtime,
        shutdown,
        status,
        wait,
    )
    from hotswap.orchestrator.graph import TierFailed
    from hotswap.orchestrator.journey import GraphStatus
    from hotswap.orchestrator.options import MODES

__version__ = "0.1.0"

__all__ = [
    "MODES",
    "CompileFailed",
    "GraphStatus",
    "HotswapError",
    "JobTimeout",
    "MemoryLimitExceeded",
    "PoolClosed",
    "SerializationFailed",
    "StageEvent",
    "TierFailed",
    "WaitTimeout",
    "WorkerCrashed",
    "WorkerPool",
    "WorkerStartFailed",
    "WorkerStopped",
    "__version__",
    "backend",
    "compile",
    "counters",
    "counters_delta",
    "prepare",
    "runtime",
    "serve_metrics",
    "shutdown",
    "status",
    "wait",
]

_LAZY = {
    "backend": "hotswap.orchestrator.api",
    "compile": "hotswap.orchestrator.api",
    "prepare": "hotswap.orchestrator.api",
    "runtime": "hotswap.orchestrator.api",
    "shutdown": "hotswap.orchestrator.api",
    "status": "hotswap.orchestrator.api",
    "wait": "hotswap.orchestrator.api",
    "GraphStatus": "hotswap.orchestrator.journey",
    "MODES": "hotswap.orchestrator.options",
    "TierFailed": "hotswap.orchestrator.graph",
    "serve_metrics": "hotswap.fleet.metrics",
}


def __dir__() -> list[str]:
    """The public names, the lazily imported ones too (tab completion)."""
    return sorted(set(__all__) | {n for n in globals() if n.startswith("__")})


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hotswap' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
