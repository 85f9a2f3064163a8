"""Process-wide counters: ``hotswap.counters()`` and ``hotswap.counters_delta()`` for tests."""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator

__all__ = ["COUNTER_NAMES", "bump", "counters", "counters_delta"]

COUNTER_NAMES = (
    "eager_calls",      # calls served by the eager graph (before any tier is ready, or after a fallback)
    "eager_fewer_threads",  # ... of them, run with fewer intra-op threads than the caller's while
                            # its compile workers ran (hotswap.system.cores)
    "swaps",            # a better tier replaced the one serving a graph
    "worker_compiles",  # compile jobs that finished in a worker with an artifact
    "inprocess_compiles",
    "cache_hits",       # artifacts taken from the artifact cache instead of compiling
    "remote_cache_hits",  # ... of them, found in the fleet store (cache_url), not on this machine
    "remote_compiles",  # compile jobs that finished on the cluster (executor), with an artifact
    "fallbacks",        # a tier failed (compile error, crash, timeout, unserializable graph, bad artifact)
    "graphs",           # graphs dynamo handed to hotswap
    "regional_loads",   # artifacts loaded that serve a graph as its regions' pieces (regions=)
    "regional_pieces",  # ... the pieces they call per call, and of those, the distinct ones
    "regional_compiled",  # compiled (GPT-2's embeddings, 6 blocks, head: 8 pieces, 3 distinct)
    "gate_benchmarks",  # a gate measurement of a ready tier against the compiled tier serving
    "gate_kept",        # a tier the gate kept out: not faster by its threshold than what served
                        # (a compiled tier, or eager)
    "gate_undecided",   # a gate measurement that decided nothing (noise, contention): again later
    "eager_checks",     # a gate measurement of a ready tier against eager, before it serves
    "gate_remeasured",  # a low-confidence verdict of an earlier run, measured again
    "served_gaps",      # a tier's steady calls ran 10 % or more slower than the gate measured it
    "probation_reverts",  # an ungated tier (async) served 10 % or more slower than eager's
                          # calls had run, and eager serves again
    # What went wrong with compile jobs and cache reads (retried or not):
    "worker_crashes",          # WorkerCrashed: the worker died mid-job (segfault, SIGKILL, exit)
    "job_timeouts",            # JobTimeout: over timeout_s; the worker was killed
    "memory_limit_kills",      # MemoryLimitExceeded: over HOTSWAP_WORKER_RSS_LIMIT_BYTES
    "serialization_failures",  # SerializationFailed: a payload or result would not (un)pickle
    "cache_rejects",           # cache entries refused (checksum, signature, stamp) and removed
    "fleet_store_errors",      # fleet store (cache_url) operations that failed: Redis unreachable
    "cluster_fallbacks",       # cluster jobs sent to the local pool instead (refused, unreachable)
    # Processes this process started to load artifacts or warm their load path (a compiler,
    # an ISA probe), a compiler's version query aside: 0 when every kernel arrived built.
    "load_compiler_runs",
    # A tier's state changed in a way its state machine does not allow (journey.py): a bug in
    # hotswap; the tier fails and the ERROR log says which move it was.
    "internal_errors",
    # Dynamo hit a recompile limit in a call with a hotswap backend: that frame runs plain
    # eager, outside hotswap (hotswap.status notes it).
    "recompile_limits",
)

_lock = threading.Lock()
_counts: collections.Counter[str] = collections.Counter({name: 0 for name in COUNTER_NAMES})


def bump(name: str, n: int = 1) -> None:
    with _lock:
        _counts[name] += n


def counters() -> dict[str, int]:
    """A snapshot of every counter."""
    with _lock:
        return dict(_counts)


class CounterDelta(dict[str, int]):
    """Filled when its ``with`` block exits: counter changes inside the block (0 if unchanged)."""


@contextlib.contextmanager
def counters_delta() -> Iterator[CounterDelta]:
    """``with hotswap.counters_delta() as d: ...`` then ``assert d["swaps"] == 1``."""
    before = counters()
    delta = CounterDelta()
    try:
        yield delta
    finally:
        after = counters()
        delta.update({k: after.get(k, 0) - before.get(k, 0) for k in after})
