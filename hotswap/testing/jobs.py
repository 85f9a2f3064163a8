"""Worker side of hotswap.testing's job faults: carry the fault out, then compile as usual.

``faulty_compile`` is a worker job (``FAULTY_COMPILE_JOB``) that the faulty compiler sends in
place of the compile job when the plan draws a fault for it.
"""

from __future__ import annotations

from typing import Any

from hotswap import settings

__all__ = ["FAULTY_COMPILE_JOB", "faulty_compile"]

FAULTY_COMPILE_JOB = "hotswap.testing.jobs:faulty_compile"


def faulty_compile(payload: dict[str, Any]) -> Any:
    """``{"fault": kind, "slow_s": s, "request": wire CompileRequest}``: the fault first (most
    never return), then the compile (``slow``), or a result the pool cannot send back."""
    from hotswap.jobs.compile import compile_graph
    from hotswap.testing import faults

    fault = payload["fault"]
    if fault == "crash":
        faults.sigkill()
    elif fault == "hang":
        faults.hang()
    elif fault == "oom":
        _grow_past_the_limit()
    elif fault == "unpicklable":
        return faults.unpicklable_result()
    elif fault == "slow":
        faults.sleep(payload["slow_s"])
    else:
        raise ValueError(f"unknown job fault {fault!r}")
    return compile_graph(payload["request"])


def _grow_past_the_limit() -> None:
    """Grow past the pool's memory limit a block at a time (one huge request would only raise
    MemoryError); the pool's RSS watch kills the worker on the way. Without a limit this would
    take the machine's memory, so refuse."""
    from hotswap.testing import faults

    limit = settings.worker_rss_limit_bytes()
    if limit is None:
        raise RuntimeError("the oom fault needs HOTSWAP_WORKER_RSS_LIMIT_BYTES set when the "
                           "pool starts")
    blocks: list[bytearray] = []
    while len(blocks) * (64 << 20) < 2 * limit:
        block = bytearray(64 << 20)
        block[::4096] = b"\1" * len(range(0, len(block), 4096))
        blocks.append(block)
    faults.hang()
