"""The coordinator's use of the artifact cache: keys, reads, writes and compile claims.

    Coordinator ---keys()----> one key per (graph, tier), from the graph, inputs and tier config
                ---get()-----> a verified entry or None (a refused entry counts in cache_rejects)
                ---fetch()---> the fleet store's entry (off the user's thread), written here too
                ---claim()---> this process compiles key; others look at its holder
                               (HolderWait.look(), every POLL_S on the io lane), then re-read
                ---store()---> entries of artifacts that loaded here; gate verdicts beside them

Opened lazily on the first graph (the stamp needs the graph's devices); a cache that cannot be
opened (unwritable directory, say) is logged once and hotswap runs without one. Locks held by
this process live in ``_claims``: taken in the user's call, released on the scheduler's thread.

With a fleet store (``cache_url``, fleet/store.py) the local directory is a read-through tier
in front of it, and a claim is two: this machine's file lock, then the fleet's expiring Redis
claim. A store that fails (Redis down) is warned of once and left alone for
``_REMOTE_RETRY_S``: the process serves on from its local cache; entries stored meanwhile are
sent once it answers again.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
from typing import Any

import filelock
import torch

from hotswap.cache import VERDICT_TIER, ArtifactCache
from hotswap.cache.stores import RemoteStore, open_local, open_remote
from hotswap.counting import bump
from hotswap.engine import threads
from hotswap.engine.loading import artifacts
from hotswap.engine.options import Tier
from hotswap.engine.shipping.keys import environment_stamp, tier_key, verdict_key
from hotswap.engine.shipping.wire import CachedEntry
from hotswap.system import proctree
from hotswap.system.starvation import STOPPED_GRACE_S

__all__ = ["STOPPED_GRACE_S", "CacheAccess", "HolderWait"]

# How often a process waiting for another's compile claim looks at it: this machine's lock (a
# lock try), then the fleet's claim (a request to the store).
POLL_S = 0.1
FLEET_POLL_S = 0.5
_REMOTE_RETRY_S = 30.0
# A cache write's rest after each MiB hashed or written (store.WRITE_PIECE): a 148 MiB entry
# takes ~0.45 s more. No rest while a thread of the user's waits for hotswap's work (wait(),
# the exit's wait for pending stores): _write_rest_s.
WRITE_REST_S = 0.001
# Entries a fleet store missed while it was down, per store URL, in this process (every
# coordinator's): key -> (tier, origin, local cache root). Sent with the next entry it takes.
_unsent: dict[str, dict[str, tuple[str, str, str]]] = {}
_unsent_lock = threading.Lock()

log = logging.getLogger("hotswap")


def _write_rest_s() -> float:
    return 0.0 if threads.user_waits.running() else WRITE_REST_S

# Notes of use under way (on the io lane) are waited for at exit, briefly: the interpreter
# stops a daemon thread wherever it is, and one stopped between its temporary file and the
# rename left a .tmp- file in the cache.
_TOUCH_EXIT_WAIT_S = 2.0
atexit.register(threads.io.drain, _TOUCH_EXIT_WAIT_S)


class CacheAccess:
    def __init__(self, cache_dir: str | None, timeout_s: float | None,
                 cache_url: str | None = None) -> None:
        self._cache_dir = cache_dir
        self._timeout_s = timeout_s
        self._cache: ArtifactCache | None = None
        self._url = cache_url
        self._remote: RemoteStore | None = None
        self._remote_down_until = 0.0
        self._failed = False
        self._lock = threading.Lock()
        self._claims: dict[str, filelock.FileLock] = {}
        self._notes: dict[str, str] = {}  # what failed -> its first message (status, log)
        # Refusals of each store already counted in cache_rejects (its ``rejected`` then).
        self._rejects_seen: dict[int, int] = {}

    @property
    def note(self) -> str:
        """What went wrong with the cache in this process ("" when nothing did)."""
        with self._lock:
            return "; ".join(self._notes.values())

    @property
    def enabled(self) -> bool:
        return self._cache is not None

    @property
    def shared(self) -> bool:
        """Whether a fleet store stands behind the local cache."""
        return self._remote is not None

    def keys(self, gm: torch.fx.GraphModule, inputs: tuple[Any, ...], grad_enabled: bool,
             wanted: list[Tier], num_threads: int | None = None) -> dict[str, str]:
        """Cache key per tier; opens the cache on first use. No cache, no keys."""
        with self._lock:
            if self._cache is None and not self._failed:
                devices = {m.device for m in inputs}
                try:
                    self._cache = open_local(self._cache_dir, environment_stamp(devices))
                except (OSError, ValueError) as e:
                    self._failed = True
                    self._notes["open"] = f"artifact cache disabled: {e}"
                    log.warning("hotswap: %s", self._notes["open"])
                if self._cache is not None and self._url is not None:
                    self._open_remote(self._cache.stamp)
        if self._cache is None or self._cache.stamp is None:
            return {}
        stamp = self._cache.stamp
        return {t.name: tier_key(gm, inputs, grad_enabled, t.load_config, stamp, num_threads)
                for t in wanted}

    def present(self, key: str | None) -> bool:
        """Whether ``key`` has an entry file here: a stat, nothing read or checked (``get``
        does that, and may refuse it)."""
        if self._cache is None or key is None:
            return False
        try:
            return self._cache.entry_path(key).exists()
        except Exception:  # in the user's call: get() says why, where it is asked
            return False

    def get(self, key: str | None) -> bytes | bytearray | None:
        """An entry to load here, if the cache has a valid one; a refused entry counts in
        cache_rejects. Its precompiled headers that are in place already are not read
        (``artifacts.headers_in_place``): what a benchmark of it loads elsewhere is ``ref``."""
        if self._cache is None or key is None:
            return None
        try:
            entry = self._cache.get(key, touch=False, have=artifacts.headers_in_place())
        except Exception as e:  # unreadable, a directory, ...: a miss, never the user's error
            self._warn_once("read", e)
            return None
        finally:
            self._count_rejects(self._cache)
        if entry is not None:  # the index notes the use off the user's path (best effort)
            threads.io.submit(self._cache.touch, key)
        return entry

    def _count_rejects(self, store: ArtifactCache | RemoteStore) -> None:
        """Count in cache_rejects the entries ``store`` refused since it was last looked at,
        each once, whichever thread looks. (Comparing its count before and after one's own
        read counted twice a refusal made by a read beside it, and never one made elsewhere.)"""
        with self._lock:
            now = store.rejected
            new = now - self._rejects_seen.get(id(store), 0)
            self._rejects_seen[id(store)] = now
        if new > 0:
            bump("cache_rejects", new)

    def _open_remote(self, stamp: dict[str, Any] | None) -> None:
        """The fleet store behind the local cache; without the fleet key, none (said once)."""
        assert self._url is not None
        try:
            self._remote = open_remote(self._url, stamp)
        except ValueError as e:
            self._notes["fleet"] = f"fleet store {self._url} not used: {e}"
            log.warning("hotswap: %s", self._notes["fleet"])

    def _fleet(self) -> RemoteStore | None:
        """The fleet store, unless it failed less than _REMOTE_RETRY_S ago."""
        if self._remote is None or time.monotonic() < self._remote_down_until:
            return None
        return self._remote

    def _fleet_failed(self, error: Exception) -> None:
        bump("fleet_store_errors")
        self._remote_down_until = time.monotonic() + _REMOTE_RETRY_S
        said = str(error) if isinstance(error, OSError) else f"{type(error).__name__}: {error}"
        note = (f"fleet store unreachable ({said}); serving from the local cache at "
                f"{self._cache.root if self._cache else self._cache_dir}, trying it again "
                f"every {_REMOTE_RETRY_S:g} s")
        with self._lock:
            first = "fleet-down" not in self._notes
            self._notes.setdefault("fleet-down", note)
        if first:
            log.warning("hotswap: %s", note)

    def fetch(self, key: str, tier: str = "") -> bytes | None:
        """The fleet store's entry for ``key`` (None: none, or the store is down), written to
        the local cache too (labelled ``tier``). Blocks on the network: never in the user's
        call."""
        remote = self._fleet()
        if remote is None:
            return None
        try:
            entry = remote.get(key)
        except Exception as e:  # unreachable, or an answer it could not read: down a while
            self._fleet_failed(e)
            return None
        finally:
            self._count_rejects(remote)
        if entry is not None:
            if tier != VERDICT_TIER:
                bump("remote_cache_hits")
            self._put(key, entry, tier, local_only=True)
        return entry

    def fleet_verdict(self, key: str) -> bytes | None:
        """The verdict stored under ``key`` (a tier key, or one with a suffix) in the fleet
        store itself: another replica's decision (off the user's thread)."""
        return self.fetch(verdict_key(key), VERDICT_TIER)

    def claim_decision(self, key: str) -> bool:
        """Take the fleet's claim on deciding ``key`` (one replica measures, the others take
        its verdict). True also where no fleet store is there to share a decision through."""
        remote = self._fleet()
        if remote is None:
            return True
        try:
            return remote.claim(verdict_key(key + "/deciding"))
        except Exception as e:  # a store that fails in any way is down a while
            self._fleet_failed(e)
            return True

    def release_decision(self, key: str) -> None:
        if self._remote is not None:
            self._remote.release(verdict_key(key + "/deciding"))

    def _warn_once(self, what: str, error: Exception) -> None:
        root = self._cache.root if self._cache is not None else self._cache_dir
        note = (f"could not {what} the artifact cache at {root} ({type(error).__name__}: "
                f"{error}); serving without it where it fails (check its permissions and free "
                "space, or set HOTSWAP_CACHE_DIR)")
        with self._lock:
            first = what not in self._notes
            self._notes.setdefault(what, note)
        if first:
            log.warning("hotswap: %s", note)

    def verdict(self, key: str) -> bytes | bytearray | None:
        """The gate's verdict on ``key``'s tier in an earlier run, if any."""
        if self._cache is None:
            return None
        try:
            return self._cache.get(verdict_key(key), touch=False)
        except Exception as e:
            self._warn_once("read", e)
            return None
        finally:
            self._count_rejects(self._cache)

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

    def _put(self, key: str, payload: bytes | memoryview, tier: str, origin: str = "", *,
             local_only: bool = False) -> bool:
        if self._cache is None:
            return False
        stored = True
        try:
            shared = artifacts.shared_spans(payload) if tier != VERDICT_TIER else []
        except ValueError:  # not an artifact entry: stored as it is
            shared = []
        cache = self._cache
        try:  # hashed and copied on a lowered thread, a MiB at a time with rests: the
            # caller's threads keep the cores (store.WRITE_PIECE)
            threads.run_lowered(lambda: cache.put(key, payload, tier=tier, origin=origin,
                                                  shared=shared, rest_s=_write_rest_s),
                                name="hotswap-cache-write")
        except OSError as e:  # a full disk must not cost the user the tier they already have
            self._warn_once("write", e)
            stored = False
        if self._remote is not None and not local_only:
            self._send(key, payload, tier, origin)
        return stored

    def _send(self, key: str, payload: bytes | memoryview, tier: str, origin: str) -> None:
        """Store in the fleet store too, with what it missed while it was down; what it
        misses now is sent with a later entry (by any coordinator of this process)."""
        assert self._url is not None and self._cache is not None
        remote = self._fleet()
        with _unsent_lock:
            late = _unsent.setdefault(self._url, {})
            late[key] = (tier, origin, str(self._cache.root))
            todo = dict(late)
        if remote is None:
            return
        try:
            for todo_key, (todo_tier, todo_origin, root) in todo.items():
                data = payload if todo_key == key else ArtifactCache(
                    root, read_only=True).get(todo_key, touch=False)
                if data is not None:
                    remote.put(todo_key, data, tier=todo_tier, origin=todo_origin)
                with _unsent_lock:
                    late.pop(todo_key, None)
        except Exception as e:
            self._fleet_failed(e)

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
            self._cache.write_claim_owner(key, os.getpid())
        except OSError:
            pass  # waiters then cannot tell if we stop; the time limit still bounds them
        remote = self._fleet()
        if remote is not None:
            try:
                if not remote.claim(key):  # another replica compiles it: wait for that one
                    self.release(key)
                    return False
            except Exception as e:  # compile, claimed on this machine only
                self._fleet_failed(e)
        return True

    def claimed_hit(self, key: str) -> bytes | bytearray | None:
        """After a claim: the entry if it appeared meanwhile (the claim is then released)."""
        cached = self.get(key)
        if cached is None:  # None without a fleet store
            cached = self.fetch(key)
        if cached is not None:
            self.release(key)
        return cached

    def release(self, key: str | None) -> None:
        with self._lock:
            lock = self._claims.pop(key, None) if key is not None else None
        if lock is not None:
            if self._remote is not None and key is not None:
                self._remote.release(key)
            if self._cache is not None and key is not None:
                with contextlib.suppress(OSError):
                    self._cache.remove_claim_owner(key)
            lock.release()

    @property
    def timeout_s(self) -> float | None:
        """How long a wait on another process's claim may take (None: as long as it takes)."""
        return self._timeout_s

    def holder_wait(self, key: str) -> HolderWait:
        """A look, one at a time, at the process holding ``key``'s compile claim."""
        return HolderWait(self, key)

    def wait_for_holder(self, key: str) -> bool:
        """Block until the process holding ``key``'s compile claim lets go (``HolderWait``)."""
        wait = self.holder_wait(key)
        while (outcome := wait.look()) is None:
            time.sleep(wait.next_look_s)
        return outcome

    def fleet_held(self, key: str) -> bool | None:
        """Whether another replica holds the fleet's claim on ``key`` (it expires if that
        replica dies: fleet/store.py); None without a fleet store, or with one that failed."""
        if (remote := self._fleet()) is None:
            return None
        try:
            return remote.held(key)
        except Exception as e:
            self._fleet_failed(e)
            return None

    def compile_lock(self, key: str) -> filelock.BaseFileLock | None:
        assert self._cache is not None
        try:
            return self._cache.compile_lock(key)
        except OSError as e:
            self._warn_once("lock", e)
            return None

    def warn_lock(self, error: OSError) -> None:
        self._warn_once("lock", error)

    def claim_holder(self, key: str) -> int | None:
        """The pid holding ``key``'s compile claim on this machine, if it said so."""
        assert self._cache is not None
        return self._cache.claim_owner(key)


class HolderWait:
    """Waiting for the process (then the replica) that holds a key's compile claim, one look
    at a time, so that no thread blocks on it: ``look()`` says True once the holder let go
    (read the cache again), False to compile here instead (the time limit passed, the lock
    failed, or the holder has been stopped, SIGSTOP or Ctrl-Z, for ``STOPPED_GRACE_S``: a
    suspended process must not stall every other process on the cache), None to look again
    in ``next_look_s``."""

    def __init__(self, access: CacheAccess, key: str) -> None:
        self._access, self._key = access, key
        self._lock = access.compile_lock(key)
        self._deadline = (None if access.timeout_s is None
                          else time.monotonic() + access.timeout_s)
        self._stopped_since: float | None = None
        self._local_done = False

    @property
    def next_look_s(self) -> float:
        return FLEET_POLL_S if self._local_done else POLL_S

    def look(self) -> bool | None:
        now = time.monotonic()
        if not self._local_done:
            if self._lock is None:
                return False
            try:
                self._lock.acquire(timeout=0)
            except filelock.Timeout:  # before OSError: filelock.Timeout is a TimeoutError
                return self._still_held(now)
            except OSError as e:
                self._access.warn_lock(e)
                return False
            self._lock.release()
            self._local_done = True
        held = self._access.fleet_held(self._key)
        if not held:
            return True
        return False if self._deadline is not None and now >= self._deadline else None

    def _still_held(self, now: float) -> bool | None:
        if self._deadline is not None and now >= self._deadline:
            return False
        holder = self._access.claim_holder(self._key)
        # A holder that is gone released its lock: the next look gets it.
        if holder is None or not proctree.is_stopped(holder):
            self._stopped_since = None
            return None
        self._stopped_since = self._stopped_since if self._stopped_since is not None else now
        if now - self._stopped_since >= STOPPED_GRACE_S:
            log.warning("hotswap: process %d holds the compile claim on %s… but is "
                        "stopped; compiling it here instead", holder, self._key[:16])
            return False
        return None
