"""hotswap: torch.compile that never blocks.

Importing hotswap must stay cheap and torch-free: every worker process imports it first. The
torch-facing API (compile, backend, status, wait) is therefore loaded on first use.
"""

# First: hotswap's other modules are then read as bytecode where Python would compile them.
from hotswap.system import own_bytecode as _own_bytecode  # noqa: F401  # isort: skip

from typing import TYPE_CHECKING, Any

from hotswap.counting import counters, counters_delta
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
from hotswap.workers import StageEvent, WorkerPool

if TYPE_CHECKING:
    from hotswap.engine.api import (
        backend,
        compile,
        prepare,
        runtime,
        shutdown,
        status,
        wait,
    )
    from hotswap.engine.graph import TierFailed
    from hotswap.engine.journey import GraphStatus
    from hotswap.engine.options import MODES
    from hotswap.fleet.metrics import serve_metrics

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
    "backend": "hotswap.engine.api",
    "compile": "hotswap.engine.api",
    "prepare": "hotswap.engine.api",
    "runtime": "hotswap.engine.api",
    "shutdown": "hotswap.engine.api",
    "status": "hotswap.engine.api",
    "wait": "hotswap.engine.api",
    "GraphStatus": "hotswap.engine.journey",
    "MODES": "hotswap.engine.options",
    "TierFailed": "hotswap.engine.graph",
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


# The compile workers (the compile service, else the local pool) warm while the model is
# built: started on a daemon thread (HOTSWAP_START_EARLY).
from hotswap.service import early as _early  # noqa: E402

_early.start()
