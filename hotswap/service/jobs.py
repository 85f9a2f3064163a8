"""What the compile service's workers run: a client's named job on its pickled payload.

The service passes the payload on as the client pickled it, so the service process itself
never unpickles what a client sent; the worker does, as a local pool's worker does.
"""

from __future__ import annotations

import pickle
from typing import Any

from hotswap.workers.child import resolve_job

__all__ = ["measure_pickled", "run_pickled"]


def run_pickled(request: tuple[str, bytes]) -> Any:
    job, payload = request
    return resolve_job(job)(pickle.loads(payload))


def measure_pickled(request: tuple[str, bytes]) -> Any:
    """``run_pickled`` for a benchmark job: the pool runs it ahead of queued compiles."""
    return run_pickled(request)
