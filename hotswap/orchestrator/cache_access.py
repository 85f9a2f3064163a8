"""The coordinator's use of the artifact cache: keys, reads, writes and compile claims.

    Coordinator ---keys()----> one key per (graph, tier), from the graph, inputs and tier config
                ---get()-----> a verified entry or None (a refused entry counts in cache_rejects)
                ---claim()---> this process compiles key; others wait_for_holder(), then re-read
                ---store()---> entries of artifacts that loaded here; gate verdicts beside them

Opened lazily on the first graph (the stamp needs the graph's devices); a cache that cannot be
opened (unwritable directory, say) is logged once and hotswap runs without one. Locks held by
this process live in ``_claims``: taken in the user's call, released on the loader thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any

import filelock
import torch

from hotswap.cache import VERDICT_TIER, ArtifactCache
from hotswap.orchestrator.counters import bump
from hotswap.orchestrator.keys import environment_stamp, tier_key, verdict_key
from hotswap.orchestrator.options import Tier
from hotswap.orchestrator.runtime import runtime
from hotswap.orchestrator.wire import CachedEntry
from hotswap.workers import proctree
from hotswap.workers.starvation import STOPPED_GRACE_S

__all__ = ["STOPPED_GRACE_S", "CacheAccess"]

_POLL_S = 0.5

log = logging.getLogger("hotswap")


class CacheAccess:
    def __init__(self, cache_dir: str | None, timeout_s: float | None) -> None:
        self._cache_dir = cache_dir
        self._timeout_s = timeout_s
        self._cache: ArtifactCache | None = None
        self._failed = False
        self._lock = threading.Lock()
        self._claims: dict[str, filelock.FileLock] = {}
        self._notes: dict[str, str] = {}  # what failed -> its first message (status, log)

    @property
    def note(self) -> str:
        """What went wrong with the cache in this process ("" when nothing did)."""
        with self._lock:
            return "; ".join(self._notes.values())

    @property
    def enabled(self) -> bool:
        return self._cache is not None

    def keys(self, gm: torch.fx.GraphModule, inputs: tuple[Any, ...], grad_enabled: bool,
             wanted: list[Tier], num_threads: int | None = None) -> dict[str, str]:
        """Cache key per tier; opens the cache on first use. No cache, no keys."""
        with self._lock:
            if self._cache is None and not self._failed:
                devices = {m.device for m in inputs}
                try:
                    self._cache = ArtifactCache(self._cache_dir,
                                                stamp=environment_stamp(devices))
                except (OSError, ValueError) as e:
                    self._failed = True
                    self._notes["open"] = f"artifact cache disabled: {e}"
                    log.warning("hotswap: %s", self._notes["open"])
        if self._cache is None or self._cache.stamp is None:
            return {}
        stamp = self._cache.stamp
        return {t.name: tier_key(gm, inputs, grad_enabled, t.load_config, stamp, num_threads)
                for t in wanted}

    def get(self, key: str | None) -> bytes | None:
        """An entry, if the cache has a valid one; a refused entry counts in cache_rejects."""
        if self._cache is None or key is None:
            return None
        rejected = self._cache.rejected
        try:
            runtime.before_cache_read(self._cache, key)  # hotswap.testing's faults land here
            entry = self._cache.get(key, touch=False)
        except OSError as e:  # unreadable, a directory, ...: a miss, never the user's error
            self._warn_once("read", e)
            return None
        if self._cache.rejected != rejected:
            bump("cache_rejects")
        if entry is not None:  # the index notes the use off the user's path (best effort)
            threading.Thread(target=self._cache.touch, args=(key,), daemon=True,
                             name="hotswap-cache-touch").start()
        return entry

    def _warn_once(self, what: str, error: OSError) -> None:
        root = self._cache.root if self._cache is not None else self._cache_dir
        note = (f"could not {what} the artifact cache at {root} ({type(error).__name__}: "
                f"{error}); serving without it where it fails (check its permissions and free "
                "space, or set HOTSWAP_CACHE_DIR)")
        with self._lock:
            first = what not in self._notes
            self._notes.setdefault(what, note)
        if first:
            log.warning("hotswap: %s", note)

    def verdict(self, key: str) -> bytes | None:
        """The gate's verdict on ``key``'s tier in an earlier run, if any."""
        if self._cache is None:
            return None
        try:
            return self._cache.get(verdict_key(key), touch=False)
        except OSError as e:
            self._warn_once("read", e)
            return None

    def store(self, key: str | None, tier: str, entry: bytes | memoryview,
              origin: str = "") -> CachedEntry | None:
        """Store a tier's packed artifact (``artifacts.pack_entry``) under ``key``; where a
        worker finds it, if it was stored. ``origin`` labels it in ``hotswap cache ls``."""
        if key is not None and self._put(key, entry, tier, origin):
            return self.ref(key)
        return None

    def ref(self, key: str | None) -> CachedEntry | None:
        """Where a worker reads the entry stored under ``key`` (None without a cache)."""
        if self._cache is None or key is None:
            return None
        return CachedEntry(str(self._cache.root), key)

    def store_verdict(self, key: str, verdict: bytes, label: str = "") -> None:
        """The gate's verdict on ``key``'s tier; ``label`` shows in ``hotswap cache ls``."""
        self._put(verdict_key(key), verdict, VERDICT_TIER, label)

    def _put(self, key: str, payload: bytes | memoryview, tier: str, origin: str = "") -> bool:
        if self._cache is None:
            return False
        try:
            self._cache.put(key, payload, tier=tier, origin=origin)
        except OSError as e:  # a full disk must not cost the user the tier they already have
            self._warn_once("write", e)
            return False
        return True

    # ------------------------------------------------------------------ compile claims

    def claim(self, key: str) -> bool:
        """Take the cross-process compile lock for ``key`` without waiting; False if taken.

        Callers re-check the cache after a successful claim: another process may have stored
        the entry and released the lock between our miss and our claim.
        """
        assert self._cache is not None
        try:
            lock = self._cache.compile_lock(key)
            lock.acquire(timeout=0)
        except filelock.Timeout:
            return False
        except OSError as e:  # the locks folder cannot be written: compile, unclaimed
            self._warn_once("lock", e)
            return True
        with self._lock:
            self._claims[key] = lock
        try:
            self._cache.claim_owner_path(key).write_text(str(os.getpid()))
        except OSError:
            pass  # waiters then cannot tell if we stop; the time limit still bounds them
        return True

    def claimed_hit(self, key: str) -> bytes | None:
        """After a claim: the entry if it appeared meanwhile (the claim is then released)."""
        cached = self.get(key)
        if cached is not None:
            self.release(key)
        return cached

    def release(self, key: str | None) -> None:
        with self._lock:
            lock = self._claims.pop(key, None) if key is not None else None
        if lock is not None:
            if self._cache is not None and key is not None:
                with contextlib.suppress(OSError):
                    self._cache.claim_owner_path(key).unlink()
            lock.release()

    def wait_for_holder(self, key: str) -> bool:
        """Block until the process holding ``key``'s compile lock lets go. False (compile
        here instead) after the time limit, or once the holder has been stopped (SIGSTOP,
        Ctrl-Z) for ``STOPPED_GRACE_S``: a suspended process must not stall every other
        process on the cache."""
        assert self._cache is not None
        try:
            lock = self._cache.compile_lock(key)
        except OSError as e:
            self._warn_once("lock", e)
            return False
        deadline = None if self._timeout_s is None else time.monotonic() + self._timeout_s
        stopped_since: float | None = None
        while True:
            try:
                lock.acquire(timeout=_POLL_S)
            except filelock.Timeout:  # before OSError: filelock.Timeout is a TimeoutError
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return False
                holder = self._holder(key)
                # A holder that is gone released its lock: the next acquire gets it.
                if holder is None or not proctree.is_stopped(holder):
                    stopped_since = None
                    continue
                stopped_since = stopped_since if stopped_since is not None else now
                if now - stopped_since >= STOPPED_GRACE_S:
                    log.warning("hotswap: process %d holds the compile claim on %s… but is "
                                "stopped; compiling it here instead", holder, key[:16])
                    return False
                continue
            except OSError as e:
                self._warn_once("lock", e)
                return False
            lock.release()
            return True

    def _holder(self, key: str) -> int | None:
        assert self._cache is not None
        try:
            return int(self._cache.claim_owner_path(key).read_text())
        except (OSError, ValueError):
            return None
