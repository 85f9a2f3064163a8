"""One tier of one graph, from the cache or a compile to a loaded callable: the lifecycle
every mode shares (the background modes continue on the load thread, the blocking ones wait
for it in the call).

    start(journey, tier, cached=None) -> Future[Arrival]
      hit ---------------------------------> load (load thread) --> Arrival(fn, "cache", entry)
       |                                          '-- will not load: compiled, as a miss
      miss here, a fleet store behind (cache_url): go on on a thread, its hit is a hit
      miss: claim key --held elsewhere--> wait for its holder (a thread), then start again
       |                                  (a hit now; or, past the limit, compile unclaimed)
       '--claimed--> compile (retried once on a crashed worker) --> load --> store -->
                     release --> Arrival(fn, "worker", entry)
    (a claim is this machine's file lock, then, with a fleet store, the fleet's claim)

This is the cached compiler of the worker modes: load-else-compile-then-store in one place
(vLLM's ``CompilerManager``). ``InProcess`` (inprocess.py) keeps the same contract for
compiles in the caller's process; a mode picks one, and whether the first call waits. The
future resolves on the load thread; a failure resolves it with the error (a pool error, or a
``TierError``), its claim released. What a failure means is the caller's to decide. The tier
walks ``pending -> compiled`` here; the caller moves it on.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any, Protocol

from hotswap.compat import Buffer
from hotswap.counting import bump
from hotswap.engine import threads
from hotswap.engine.journey import GraphJourney, TierState
from hotswap.engine.options import Tier
from hotswap.engine.recording import Recorder
from hotswap.engine.shipping.wire import CachedEntry, CompileResult
from hotswap.engine.sources.cache_access import CacheAccess, HolderWait
from hotswap.engine.sources.compilers import CompileFuture

__all__ = ["Arrival", "Dropped", "LoadFailed", "TierError", "TierLifecycle", "TierSource"]

log = logging.getLogger("hotswap")

# Runs ``fn(*args)`` on the load thread; ``args[0]`` is the graph's journey.
OnLoader = Callable[[Callable[..., None], tuple[Any, ...]], None]
# Loads a packed entry for a tier: (journey, tier, entry, stage) -> callable; stage is the
# span it is timed as ("load" for a fresh compile, "cache_load" for a hit).
Load = Callable[[GraphJourney, Tier, Any, str], Any]
# Compiles a tier: (journey, tier, measured) -> its future; ``measured``: a gate measures the
# result once it is loaded (CompileRequest.measured).
Compile = Callable[[GraphJourney, Tier, bool], CompileFuture]


@dataclass(frozen=True)
class Arrival:
    fn: Any                                  # the loaded tier
    path: str                                # "cache" or "worker"
    entry: Buffer | CachedEntry  # what a later benchmark of the tier loads


class TierError(Exception):
    """A tier did not come in; ``str(error)`` is the reason its status shows."""


class LoadFailed(TierError):
    """A compiled artifact did not load in this process."""


class Dropped(TierError):
    """Nothing will serve the tier (``GraphJourney.unwanted``: the graph was let go by
    ``torch.compiler.reset()``, or a higher tier serves): it ends without loading."""


class TierSource(Protocol):
    """Brings one tier of one graph in: the contract every mode composes."""

    def start(self, journey: GraphJourney, tier: Tier, *, cached: Buffer | None = None,
              example_inputs: Sequence[Any] = ()) -> Future[Arrival]: ...


class TierLifecycle:
    def __init__(self, cache: CacheAccess, compile: Compile, load: Load, on_loader: OnLoader,
                 recorder: Recorder, *, store_first: bool = False,
                 forced: str | None = None) -> None:
        self._cache, self._compile_fn, self._load = cache, compile, load
        self._on_loader, self._recorder = on_loader, recorder
        # A compiled tier's entry is stored before it arrives where a gate will measure it
        # (the benchmark job then reads it from the cache, its bytes do not travel); else
        # after it serves. Its compile then says that a measurement follows, but for the
        # tier ``forced`` (force_tier), which serves unmeasured.
        self._store_first = store_first
        self._forced = forced
        self.stores = PendingStores()

    def start(self, journey: GraphJourney, tier: Tier, *, cached: Buffer | None = None,
              example_inputs: Sequence[Any] = ()) -> Future[Arrival]:
        """Bring ``tier`` in: from ``cached`` (an entry the caller already read), the cache,
        or a compile (of the shipped graph: the example inputs stay with the caller). In the
        caller's thread a miss costs one stat() and a lock try."""
        out: Future[Arrival] = Future()
        self._begin(out, journey, tier, journey.keys.get(tier.name), cached)
        return out

    def _begin(self, out: Future[Arrival], journey: GraphJourney,
               tier: Tier, key: str | None, cached: Buffer | None, *,
               off_caller: bool = False) -> None:
        if cached is None and self._cache.enabled and key is not None:
            cached = self._cache.get(key)
            if cached is None and self._cache.shared:
                if not off_caller:  # the fleet store is a network away: not in the call
                    threads.io.submit(self._begin_off_caller, out, journey, tier, key)
                    return
                cached = self._cache.fetch(key)
            if cached is None:
                if not self._cache.claim(key):
                    threads.io.submit(self._await_holder, out, journey, tier, key,
                                      self._cache.holder_wait(key))
                    return
                try:
                    cached = self._cache.claimed_hit(key)
                except BaseException:
                    self._cache.release(key)  # ours: others waiting on it may go on
                    raise
        if cached is None:
            self._compile(out, journey, tier, key)
            return
        bump("cache_hits")
        self._on_loader(self._load_cached, (journey, out, tier, key, cached))

    def _begin_off_caller(self, out: Future[Arrival], journey: GraphJourney, tier: Tier,
                          key: str) -> None:
        """io lane: ``_begin`` where the fleet store is read (a network away; a store that
        fails is a miss). Anything else it raises fails the tier, as a failed compile does,
        rather than leaving it pending for good."""
        try:
            self._begin(out, journey, tier, key, None, off_caller=True)
        except Exception as e:
            log.debug("hotswap: graph %s tier %r could not start", journey.graph_id, tier.name,
                      exc_info=True)
            self._on_loader(self._not_started, (journey, out, None, e))

    def _await_holder(self, out: Future[Arrival], journey: GraphJourney, tier: Tier, key: str,
                      wait: HolderWait) -> None:
        """Look at the process compiling ``key`` (io lane) until it lets go, then start again
        (its entry is a hit now; if it failed, this process compiles)."""
        try:
            outcome = None if journey.forgotten else wait.look()
        except Exception as e:  # its holder cannot be looked at: compile here
            log.debug("hotswap: looking at the holder of %s… failed: %s: %s", key[:12],
                      type(e).__name__, e)
            outcome = False
        if journey.forgotten:
            self._compile(out, journey, tier, None)  # resolves it as dropped
        elif outcome is None:
            threads.io.later(wait.next_look_s, self._await_holder, out, journey, tier, key, wait)
        elif outcome:
            self._begin_off_caller(out, journey, tier, key)
        else:
            self._compile(out, journey, tier, None)  # too slow: compile here

    def _load_cached(self, journey: GraphJourney, out: Future[Arrival], tier: Tier,
                     key: str | None, entry: bytes) -> None:
        if journey.unwanted(tier.name):
            _resolve(out, error=Dropped("not wanted any more"))
            return
        journey.to(tier.name, TierState.COMPILED)
        try:
            fn = self._load(journey, tier, entry, "cache_load")
        except Exception as e:  # compiled again; its result replaces the entry
            log.warning("hotswap: cached artifact of graph %s tier %r failed to load (%s: %s); "
                        "compiling it again", journey.graph_id, tier.name, type(e).__name__, e)
            journey.to(tier.name, TierState.PENDING)
            self._compile(out, journey, tier, key)
            return
        _resolve(out, Arrival(fn, "cache", self._cache.ref(key) or entry))

    def _compile(self, out: Future[Arrival], journey: GraphJourney,
                 tier: Tier, key: str | None) -> None:
        if journey.unwanted(tier.name):  # while its claim or the fleet store was awaited
            _resolve(out, error=Dropped("not wanted any more"))
            self._cache.release(key)
            return
        submitted = time.monotonic()
        try:
            future = self._compile_fn(journey, tier,
                                      self._store_first and tier.name != self._forced)
        except BaseException as e:  # not taken (a pool that cannot start, ...): failed
            log.debug("hotswap: graph %s tier %r: its compile was not submitted",
                      journey.graph_id, tier.name, exc_info=True)
            self._on_loader(self._not_started, (journey, out, key, e))
            if not isinstance(e, Exception):  # Ctrl-C in the call: the user's to see
                raise
            return
        future.add_done_callback(lambda f: self._on_loader(self._compiled, (
            journey, out, tier, f, submitted, time.monotonic(), key)))

    def _not_started(self, journey: GraphJourney, out: Future[Arrival], key: str | None,
                     error: BaseException) -> None:
        """Load thread: a tier that could not start fails as a compile that failed does
        (the caller's handler runs where it runs for those); its claim, if any, released."""
        try:
            _resolve(out, error=error)
        finally:
            self._cache.release(key)

    def _compiled(self, journey: GraphJourney, out: Future[Arrival], tier: Tier,
                  future: CompileFuture, submitted: float, done: float, key: str | None) -> None:
        """Load thread: load a finished compile and store it, or pass its failure on."""
        try:
            if journey.forgotten or future.cancelled():  # a reset cancelled it: load nothing
                _resolve(out, error=Dropped("the graph was reset"))
                return
            error = future.exception()
            if error is not None:
                _resolve(out, error=error)
                return
            self._recorder.worker_job(journey, tier.name, future.stage_events, submitted, done)
            result = CompileResult.from_wire(future.result())
            bump("worker_compiles")
            if journey.unwanted(tier.name):  # kept while it compiled: a higher tier serves
                # Stored all the same, then its claim released: processes waiting on the
                # claim load it instead of finding nothing and compiling it again. Unlike
                # every other entry it was not loaded here first: a load (and its first run)
                # in the serving process for a tier it will not serve would compete with
                # the user's calls; an entry that then fails to load is compiled again.
                self._cache.store(key, tier.name, result.entry, journey.origin)
                _resolve(out, error=Dropped("a higher tier serves"))
                return
            journey.to(tier.name, TierState.COMPILED)
            try:
                fn = self._load(journey, tier, result.entry, "load")
            except Exception as e:
                log.debug("hotswap: graph %s tier %r: its artifact failed to load",
                          journey.graph_id, tier.name, exc_info=True)
                _resolve(out, error=LoadFailed(
                    f"artifact failed to load: {type(e).__name__}: {e}"))
                return
            if self._store_first:  # only ones that loaded
                stored = self._cache.store(key, tier.name, result.entry, journey.origin)
                _resolve(out, Arrival(fn, "worker", stored or result.entry))
                return
            # Served first, stored after: a cache's first entry writes the headers its
            # entries share too, and a GPT-2 swap on the 2-core box waited 0.75 s for that
            # while the caller's calls ran beside it.
            self.stores.add()
            try:
                _resolve(out, Arrival(fn, "worker", result.entry))
            finally:
                self._on_loader(self._store, (journey, tier.name, key, result.entry))
                key = None  # _store releases it
        except Exception as e:  # never leave a tier pending: wait() would hang
            _resolve(out, error=LoadFailed(f"internal error: {type(e).__name__}: {e}"))
        finally:
            self._cache.release(key)  # processes waiting on us may go on

    def _store(self, journey: GraphJourney, tier: str, key: str | None,
               entry: bytes | memoryview) -> None:
        """Scheduler, after the tier's arrival: store its entry under ``key`` and release the
        claim; a later benchmark of the graph then reads the entry from the cache instead of
        carrying its bytes."""
        start = time.monotonic()
        try:
            try:
                stored = self._cache.store(key, tier, entry, journey.origin)
                if stored is not None:
                    journey.remember(tier, stored, only_instead=True)
            finally:
                self._cache.release(key)  # processes waiting on us may go on
                self._recorder.span(journey, tier, "store", start, time.monotonic())
        finally:
            self.stores.done()  # whatever failed: wait() and exit must not wait for it


class PendingStores:
    """Entries to be stored once their tier serves (``TierLifecycle._store``): ``wait()``
    (``hotswap.wait``) waits for them, and interpreter exit waits for every one up to
    ``EXIT_WAIT_S``, so that a process that exits right after a swap leaves its entry stored."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._count = 0
        _pending.add(self)

    def add(self) -> None:
        with self._cond:
            self._count += 1

    def done(self) -> None:
        with self._cond:
            self._count -= 1
            self._cond.notify_all()

    def wait(self, timeout_s: float | None = None) -> bool:
        """False: some were still pending after ``timeout_s``."""
        with self._cond:
            return self._cond.wait_for(lambda: self._count == 0, timeout_s)


EXIT_WAIT_S = 2.0
_pending: weakref.WeakSet[PendingStores] = weakref.WeakSet()


def _wait_at_exit() -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    with threads.user_waiting():  # the stores run at full speed: no calls are left to spare
        for stores in list(_pending):
            stores.wait(max(0.0, deadline - time.monotonic()))


atexit.register(_wait_at_exit)


def _resolve(out: Future[Arrival], result: Arrival | None = None, *,
             error: BaseException | None = None) -> None:
    try:
        if error is not None:
            out.set_exception(error)
        else:
            out.set_result(result)  # type: ignore[arg-type]
    except InvalidStateError:
        pass
