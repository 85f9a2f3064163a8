"""Testing hooks: inject faults into hotswap's own machinery, never into user code.

    with hotswap.testing.inject(FaultPlan({"crash": 0.2, "corrupt-cache": 0.5}, seed=1)) as plan:
        ...                      # compile jobs and cache reads draw faults from the plan
    plan.injected                # Counter: how many of each were actually injected

Where each fault lands, and what hotswap must make of it:

    crash          the compile job kills its worker (SIGKILL)      -> WorkerCrashed, one retry
    hang           the compile job sleeps forever                  -> JobTimeout (needs timeout_s)
    oom            the compile job allocates until the pool's      -> MemoryLimitExceeded (needs
                   RSS limit kills it                                 HOTSWAP_WORKER_RSS_LIMIT_BYTES)
    unpicklable    the compile job returns a lambda                -> SerializationFailed
    slow           the compile job sleeps ``slow_s`` first         -> nothing fails, later swap
    corrupt-cache  a byte of the entry about to be read flips      -> entry refused, recompiled

``inject`` installs two wrappers, and production code knows nothing of them: a faulty
executor (``hotswap.executors.registry.wrap``: a compile drawn a fault is sent as
``jobs.faulty_compile``, which carries the fault out in the worker with the jobs of
``hotswap.testing.faults``) and a corrupting store (``hotswap.cache.stores.wrap_local``, on
the local caches opened inside the block: an artifact read drawn a fault finds its file
corrupted on disk first). Each fault is counted the moment it is injected, so a stress run can hold
what it injected against what hotswap observed (``hotswap.counters()``: worker_crashes,
job_timeouts, memory_limit_kills, serialization_failures, cache_rejects).
"""

from __future__ import annotations

import collections
import contextlib
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

__all__ = ["CACHE_FAULTS", "FAULT_KINDS", "JOB_FAULTS", "CorruptingStore", "FaultPlan",
           "FaultyCompiler", "FaultyExecutor", "corrupt_entry", "inject"]

JOB_FAULTS = ("crash", "hang", "oom", "unpicklable", "slow")
CACHE_FAULTS = ("corrupt-cache",)
FAULT_KINDS = JOB_FAULTS + CACHE_FAULTS


@dataclass
class FaultPlan:
    """Per-kind probabilities, drawn once per compile job (job faults, at most one per job) or
    per cache read of an existing entry (cache faults)."""

    rates: dict[str, float]
    seed: int = 0
    slow_s: float = 0.2
    injected: collections.Counter[str] = field(default_factory=collections.Counter)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.rates) - set(FAULT_KINDS))
        if unknown:
            raise ValueError(f"unknown fault kind(s) {unknown}; kinds are {list(FAULT_KINDS)}")
        bad = {k: v for k, v in self.rates.items() if not 0.0 <= v <= 1.0}
        if bad:
            raise ValueError(f"fault rates are probabilities from 0 to 1, got {bad}")
        if sum(self.rates.get(k, 0.0) for k in JOB_FAULTS) > 1.0:
            raise ValueError("job fault rates add up to more than 1 (one fault per job at most)")
        self._random = random.Random(self.seed)
        self._lock = threading.Lock()

    def draw_job_fault(self) -> str | None:
        with self._lock:
            roll = self._random.random()
            for kind in JOB_FAULTS:
                roll -= self.rates.get(kind, 0.0)
                if roll < 0:
                    self.injected[kind] += 1
                    return kind
        return None

    def draw_cache_fault(self) -> bool:
        with self._lock:
            return self._random.random() < self.rates.get("corrupt-cache", 0.0)

    def count(self, kind: str) -> None:
        with self._lock:
            self.injected[kind] += 1


class FaultyCompiler:
    """Sends a compile drawn a job fault as ``jobs.faulty_compile``; the rest as they were."""

    def __init__(self, inner: Any, plan: FaultPlan) -> None:
        self._inner, self._plan = inner, plan

    def submit(self, request: Any, timeout_s: float | None) -> Any:
        fault = self._plan.draw_job_fault()
        if fault is None:
            return self._inner.submit(request, timeout_s)
        from hotswap.testing.jobs import FAULTY_COMPILE_JOB

        return self._inner.submit_job(FAULTY_COMPILE_JOB, {
            "fault": fault, "slow_s": self._plan.slow_s, "request": request.to_wire()},
            timeout_s)

    def submit_job(self, job: str, payload: Any, timeout_s: float | None) -> Any:
        return self._inner.submit_job(job, payload, timeout_s)

    def load(self, entry: Any, config: Any) -> Any:
        return self._inner.load(entry, config)

    def warm(self, devices: Any, wait_s: float | None = 0.0) -> bool:
        return bool(self._inner.warm(devices, wait_s))


class FaultyExecutor:
    """Executor middleware: sends a compile job drawn a job fault as ``jobs.faulty_compile``
    (the compile's payload inside); every other job as it was."""

    def __init__(self, inner: Any, plan: FaultPlan) -> None:
        self._inner, self._plan = inner, plan

    def submit(self, job: str, payload: Any, timeout_s: float | None) -> Any:
        from hotswap.executors.base import COMPILE_JOB

        fault = self._plan.draw_job_fault() if job == COMPILE_JOB else None
        if fault is None:
            return self._inner.submit(job, payload, timeout_s)
        from hotswap.testing.jobs import FAULTY_COMPILE_JOB

        return self._inner.submit(FAULTY_COMPILE_JOB, {
            "fault": fault, "slow_s": self._plan.slow_s, "request": payload}, timeout_s)

    def shutdown(self, wait: bool = True) -> None:
        self._inner.shutdown(wait)


@contextlib.contextmanager
def inject(plan: FaultPlan) -> Iterator[FaultPlan]:
    """Install ``plan`` process-wide for the ``with`` block: compiles submitted and cache
    entries read inside it draw their faults from it."""
    from hotswap.cache import stores
    from hotswap.executors import registry

    active = threading.Event()
    active.set()
    removals = [registry.wrap(lambda inner: FaultyExecutor(inner, plan)),
                stores.wrap_local(lambda inner: cast(Any, CorruptingStore(inner, plan, active)))]
    try:
        yield plan
    finally:
        active.clear()  # stores opened inside the block read plainly from now on
        for remove in removals:
            remove()


class CorruptingStore:
    """A local store whose artifact reads first draw a cache fault from ``plan`` (while
    ``active``): a drawn fault flips a byte of the entry on disk, which the store then refuses
    as it would any corrupted file. The gate's verdicts beside the artifacts are read as they
    are. Everything else is the inner store's."""

    def __init__(self, inner: Any, plan: FaultPlan, active: threading.Event) -> None:
        self._inner, self._plan, self._active = inner, plan, active

    def get(self, key: str, *, touch: bool = True, have: Any = None) -> bytes | None:
        if self._active.is_set() and not _is_verdict(self._inner, key) \
                and self._plan.draw_cache_fault() and corrupt_entry(self._inner, key):
            self._plan.count("corrupt-cache")
        result: bytes | None = self._inner.get(key, touch=touch, have=have)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _is_verdict(cache: Any, key: str) -> bool:
    """Whether ``key``'s entry holds a gate verdict (its header's tier; the header is not
    secret, only signed)."""
    import msgpack

    from hotswap.cache.store import MAGIC, VERDICT_TIER

    try:
        with open(cache.entry_path(key), "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    start = len(MAGIC) + 4
    try:
        header = msgpack.Unpacker(raw=False)
        header.feed(head[start:])
        return bool(next(header).get("tier") == VERDICT_TIER)
    except Exception:
        return False


def corrupt_entry(cache: Any, key: str) -> bool:
    """Flip one byte in the middle of ``key``'s entry file; False if there is no entry."""
    path = Path(cache.entry_path(key))
    try:
        data = bytearray(path.read_bytes())
    except FileNotFoundError:
        return False
    if not data:
        return False
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return True
