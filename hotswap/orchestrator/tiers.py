"""One tier of one graph, from the cache or a compile to a loaded callable: the lifecycle
every mode shares (the background modes continue on the load thread, the blocking ones wait
for it in the call).

    start(runner, request, tier, key) -> Future[Arrival]
      hit ---------------------------------> load (load thread) --> Arrival(fn, "cache", entry)
       |                                          '-- will not load: compiled, as a miss
      miss: claim key --held elsewhere--> wait for its holder (a thread), then start again
       |                                  (a hit now; or, past the limit, compile unclaimed)
       '--claimed--> compile (retried once on a crashed worker) --> load --> store -->
                     release --> Arrival(fn, "worker", entry)

The future resolves on the load thread; a failure resolves it with the error (a pool error,
or ``LoadFailed``), its claim released. What a failure means is the caller's to decide.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any

from hotswap.orchestrator.cache_access import CacheAccess
from hotswap.orchestrator.compilers import CompileFuture
from hotswap.orchestrator.counters import bump
from hotswap.orchestrator.graph import GraphRunner
from hotswap.orchestrator.options import Tier
from hotswap.orchestrator.recording import Recorder
from hotswap.orchestrator.request import GraphRequest
from hotswap.orchestrator.wire import CachedEntry, CompileResult

__all__ = ["Arrival", "LoadFailed", "TierLifecycle"]

log = logging.getLogger("hotswap")

# Runs ``fn(*args)`` on the load thread; ``args[0]`` is the graph's runner.
OnLoader = Callable[[Callable[..., None], tuple[Any, ...]], None]
# Loads a packed entry for a tier: (runner, tier, entry, stage) -> callable; stage is the
# span it is timed as ("load" for a fresh compile, "cache_load" for a hit).
Load = Callable[[GraphRunner, Tier, Any, str], Any]
Compile = Callable[[GraphRunner, GraphRequest, Tier], CompileFuture]


@dataclass(frozen=True)
class Arrival:
    fn: Any                                  # the loaded tier
    path: str                                # "cache" or "worker"
    entry: bytes | memoryview | CachedEntry  # what a later benchmark of the tier loads


class LoadFailed(Exception):
    """A compiled artifact did not load in this process."""


class TierLifecycle:
    def __init__(self, cache: CacheAccess, compile: Compile, load: Load, on_loader: OnLoader,
                 recorder: Recorder) -> None:
        self._cache, self._compile_fn, self._load = cache, compile, load
        self._on_loader, self._recorder = on_loader, recorder

    def start(self, runner: GraphRunner, request: GraphRequest, tier: Tier, key: str | None,
              *, cached: bytes | None = None) -> Future[Arrival]:
        """Bring ``tier`` in: from ``cached`` (an entry the caller already read), the cache,
        or a compile. In the caller's thread a miss costs one stat() and a lock try."""
        out: Future[Arrival] = Future()
        self._begin(out, runner, request, tier, key, cached)
        return out

    def _begin(self, out: Future[Arrival], runner: GraphRunner, request: GraphRequest,
               tier: Tier, key: str | None, cached: bytes | None) -> None:
        if cached is None and self._cache.enabled and key is not None:
            cached = self._cache.get(key)
            if cached is None:
                if not self._cache.claim(key):
                    threading.Thread(target=self._await_holder, daemon=True,
                                     name="hotswap-wait",
                                     args=(out, runner, request, tier, key)).start()
                    return
                cached = self._cache.claimed_hit(key)
        if cached is None:
            self._compile(out, runner, request, tier, key)
            return
        bump("cache_hits")
        self._on_loader(self._load_cached, (runner, out, request, tier, key, cached))

    def _await_holder(self, out: Future[Arrival], runner: GraphRunner, request: GraphRequest,
                      tier: Tier, key: str) -> None:
        """Wait until the process compiling ``key`` lets go, then start again (its entry is a
        hit now; if it failed, this process compiles)."""
        if self._cache.wait_for_holder(key):
            self._begin(out, runner, request, tier, key, None)
        else:
            self._compile(out, runner, request, tier, None)  # too slow: compile here

    def _load_cached(self, runner: GraphRunner, out: Future[Arrival], request: GraphRequest,
                     tier: Tier, key: str | None, entry: bytes) -> None:
        try:
            fn = self._load(runner, tier, entry, "cache_load")
        except Exception as e:  # compiled again; its result replaces the entry
            log.warning("hotswap: cached artifact of graph %s tier %r failed to load (%s: %s); "
                        "compiling it again", runner.graph_id, tier.name, type(e).__name__, e)
            self._compile(out, runner, request, tier, key)
            return
        _resolve(out, Arrival(fn, "cache", self._cache.ref(key) or entry))

    def _compile(self, out: Future[Arrival], runner: GraphRunner, request: GraphRequest,
                 tier: Tier, key: str | None) -> None:
        submitted = time.monotonic()
        future = self._compile_fn(runner, request, tier)
        future.add_done_callback(lambda f: self._on_loader(self._compiled, (
            runner, out, tier, f, submitted, time.monotonic(), key)))

    def _compiled(self, runner: GraphRunner, out: Future[Arrival], tier: Tier,
                  future: CompileFuture, submitted: float, done: float, key: str | None) -> None:
        """Load thread: load a finished compile and store it, or pass its failure on."""
        try:
            error = future.exception()
            if error is not None:
                _resolve(out, error=error)
                return
            self._recorder.worker_job(runner, tier.name, future.stage_events, submitted, done)
            result = CompileResult.from_wire(future.result())
            bump("worker_compiles")
            try:
                fn = self._load(runner, tier, result.entry, "load")
            except Exception as e:
                _resolve(out, error=LoadFailed(
                    f"artifact failed to load: {type(e).__name__}: {e}"))
                return
            stored = self._cache.store(key, tier.name, result.entry)  # only ones that loaded
            _resolve(out, Arrival(fn, "worker", stored or result.entry))
        except Exception as e:  # never leave a tier pending: wait() would hang
            _resolve(out, error=LoadFailed(f"internal error: {type(e).__name__}: {e}"))
        finally:
            self._cache.release(key)  # processes waiting on us may go on


def _resolve(out: Future[Arrival], result: Arrival | None = None, *,
             error: BaseException | None = None) -> None:
    try:
        if error is not None:
            out.set_exception(error)
        else:
            out.set_result(result)  # type: ignore[arg-type]
    except InvalidStateError:
        pass
