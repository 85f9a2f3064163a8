"""The fleet's artifact store: entries in Redis, signed with a key every replica shares, and
compile claims that expire unless their holder renews them.

    <prefix>e:<key>      an entry: exactly a cache file's bytes (store.py: MAGIC | header |
                         payload | HMAC-SHA256), checked by the same ``unseal`` as a local one
    <prefix>index        hash: key -> msgpack {tier, origin, size, created_s}
    <prefix>c:<key>      a compile claim: redis-py's ``Lock`` (SET NX PX, released by token),
                         renewed every ttl/3 while its compile runs; a holder that dies stops
                         renewing and the claim expires

The local cache directory stays in front of it (cache_access.py): a hit here is written there.
A replica without the fleet key (``HOTSWAP_CACHE_KEY_FILE``) neither reads nor writes: it could
not tell a foreign entry from the fleet's, and entries hold pickles. Redis errors surface as
``StoreUnavailable`` (an ``OSError``): the caller serves on from its local cache.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from hotswap import settings
from hotswap.cache.store import (
    EntryInfo,
    EntryRejected,
    has_unread,
    index_record,
    is_key,
    seal,
    split_entry,
    unseal,
)
from hotswap.cache.trust import UntrustedPath, check_way

__all__ = ["KEY_FILE_ENV", "URL_ENV", "FleetStore", "StoreUnavailable", "claim_ttl_s",
           "load_fleet_key", "open_store"]

log = logging.getLogger("hotswap")

URL_ENV = "HOTSWAP_CACHE_URL"
KEY_FILE_ENV = "HOTSWAP_CACHE_KEY_FILE"
_MIN_KEY_BYTES = 32


class StoreUnavailable(OSError):
    """The fleet store could not be reached (or answered with an error)."""


def claim_ttl_s() -> float:
    """HOTSWAP_CLAIM_TTL_S: how long a fleet compile claim outlives its holder's last renewal
    (default 30 s; renewed every third of it)."""
    return settings.claim_ttl_s()


def load_fleet_key(path: str | os.PathLike[str] | None = None) -> bytes:
    """The key the fleet signs entries with: ``path`` or HOTSWAP_CACHE_KEY_FILE, a file of at
    least 32 bytes that only its owner can read or write (mode 0600). ValueError saying what
    to do otherwise."""
    path = path or settings.cache_key_file()
    if path is None:
        raise ValueError(f"the fleet store signs entries with a key every replica shares, and "
                         f"{KEY_FILE_ENV} is not set: make one (head -c 32 /dev/urandom > "
                         f"fleet.key; chmod 600 fleet.key), copy it to each machine, and set "
                         f"{KEY_FILE_ENV} to its path")
    file = Path(path)
    try:
        # A link is followed (mounted secrets are links): what is checked is what is read,
        # through one descriptor, and the folders the key really sits in are checked too.
        check_way(Path(os.path.realpath(file)).parent)
        with open(file, "rb") as f:
            st = os.fstat(f.fileno())
            data = f.read()
    except UntrustedPath as e:
        raise ValueError(f"the fleet key {str(file)!r} ({KEY_FILE_ENV}) is not safe where it "
                         f"is: {e}") from e
    except OSError as e:
        raise ValueError(f"cannot read the fleet key {str(file)!r} ({KEY_FILE_ENV}): {e}") from e
    mode = st.st_mode
    if st.st_uid not in (0, os.geteuid()):
        raise ValueError(f"the fleet key {str(file)!r} belongs to uid {st.st_uid}, not to you "
                         f"(uid {os.geteuid()}) or root: whoever owns it can change it and sign "
                         "code the fleet loads; use a key of your own")
    if mode & 0o077:
        raise ValueError(f"the fleet key {str(file)!r} is open to other users (mode "
                         f"{mode & 0o777:o}); anyone who reads it can sign code the fleet "
                         f"loads: chmod 600 {file}")
    if len(data) < _MIN_KEY_BYTES:
        raise ValueError(f"the fleet key {str(file)!r} holds {len(data)} bytes; it needs at "
                         f"least {_MIN_KEY_BYTES} random ones (head -c 32 /dev/urandom)")
    return data


@dataclass
class _Claim:
    lock: Any          # redis.lock.Lock
    lost: bool = False


class FleetStore:
    """Signed entries and expiring compile claims in one Redis database, shared by a fleet.

    ``stamp`` is what an entry must have been written under to be returned (as
    ``ArtifactCache``); None (the CLI) checks integrity only and may not write."""

    def __init__(self, url: str, secret: bytes, stamp: dict[str, Any] | None, *,
                 prefix: str = "hotswap:", ttl_s: float | None = None,
                 timeout_s: float = 5.0) -> None:
        try:
            import redis
        except ImportError as e:
            raise ValueError("cache_url needs the redis client: pip install 'hotswap[fleet]'"
                             ) from e
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        try:
            self._redis = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                               socket_connect_timeout=min(timeout_s, 2.0))
        except ValueError as e:
            raise ValueError(f"cache_url {url!r} is not a Redis URL "
                             f"(redis://host:port/db): {e}") from e
        self.url = url
        self._secret, self.stamp, self._prefix = secret, stamp, prefix
        self.ttl_s = ttl_s if ttl_s is not None else claim_ttl_s()
        self.rejected = 0
        self._claims: dict[str, _Claim] = {}
        self._lock = threading.Lock()
        self._renewer: threading.Thread | None = None

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except self._errors as e:
            raise StoreUnavailable(f"fleet store {self.url}: {type(e).__name__}: {e}") from e

    def ping(self) -> None:
        self._call(self._redis.ping)

    # ------------------------------------------------------------------ entries

    def get(self, key: str) -> bytes | None:
        """The payload under ``key`` if it checks out (as a local entry would); a refused one
        is removed, counted in ``rejected`` and warned of."""
        _check(key)
        blob = self._call(self._redis.get, self._prefix + "e:" + key)
        if blob is None:
            return None
        try:
            _, payload = unseal(self._secret, split_entry(blob), key, self.stamp)
        except EntryRejected as e:
            self.rejected += 1
            self._drop(key)
            log.warning("hotswap fleet store: entry %s… refused and removed (%s); compiling "
                        "again", key[:12], e.reason)
            return None
        return payload

    def put(self, key: str, payload: bytes | bytearray | memoryview, *, tier: str = "",
            origin: str = "") -> None:
        if self.stamp is None:
            raise ValueError("this FleetStore was opened without a stamp; it cannot write")
        if has_unread(payload):
            raise ValueError("a payload read with spans left unread cannot be stored")
        _check(key)
        head, mac = seal(self._secret, key, payload, tier=tier, origin=origin, stamp=self.stamp)
        blob = b"".join((head, payload, mac))
        record = msgpack.packb({"tier": tier, "origin": origin, "size": len(blob),
                                "created_s": time.time()}, use_bin_type=True)
        pipe = self._redis.pipeline()
        pipe.set(self._prefix + "e:" + key, blob)
        pipe.hset(self._prefix + "index", key, record)
        self._call(pipe.execute)

    def _index(self) -> dict[str, dict[str, Any]]:
        """The fleet's index, its records checked as the local index's are (``index_record``):
        a record of another shape, or bytes that are not msgpack, are left out (logged)."""
        index = self._call(self._redis.hgetall, self._prefix + "index")
        out = {}
        for raw_key, raw in index.items():
            try:
                key = raw_key.decode()
                record = index_record(msgpack.unpackb(raw, raw=False))
            except Exception:  # whatever msgpack makes of bytes that are not a record
                record = None
            if record is None or not is_key(key):
                log.warning("hotswap fleet store: index record %r malformed; left out",
                            raw_key[:32])
                continue
            out[key] = record
        return out

    def entries(self) -> list[EntryInfo]:
        out = [EntryInfo(key, r["tier"], r["size"], r["created_s"], r["created_s"], r["origin"])
               for key, r in self._index().items()]
        return sorted(out, key=lambda e: e.created_s, reverse=True)

    def verify(self, *, remove: bool = False) -> list[tuple[str, str]]:
        """Check every entry; (key, reason) for each bad one. ``remove``: remove those too."""
        bad = []
        for name in self._call(lambda: list(self._redis.scan_iter(self._prefix + "e:*"))):
            key = name.decode()[len(self._prefix) + 2:]
            blob = self._call(self._redis.get, name)
            if blob is None or not is_key(key):
                continue
            try:
                unseal(self._secret, split_entry(blob), key, self.stamp)
            except EntryRejected as e:
                bad.append((key, e.reason))
                if remove:
                    self._drop(key)
        return bad

    def clear(self, tier: str | None = None) -> int:
        doomed = [k for k, r in self._index().items() if tier is None or r["tier"] == tier]
        if tier is None:  # entries the index lost too
            doomed += [n.decode()[len(self._prefix) + 2:] for n in
                       self._call(lambda: list(self._redis.scan_iter(self._prefix + "e:*")))]
        for key in set(doomed):
            self._drop(key)
        return len(set(doomed))

    @property
    def root(self) -> str:
        """Where the entries are (as ``ArtifactCache.root`` for the CLI)."""
        return self.url

    def stats(self) -> dict[str, Any]:
        entries = self.entries()
        return {"root": self.url, "entries": len(entries),
                "bytes": sum(e.size_bytes for e in entries), "max_bytes": None}

    def _drop(self, key: str) -> None:
        pipe = self._redis.pipeline()
        pipe.delete(self._prefix + "e:" + key)
        pipe.hdel(self._prefix + "index", key)
        with contextlib.suppress(StoreUnavailable):
            self._call(pipe.execute)

    # ------------------------------------------------------------------ claims

    def claim(self, key: str) -> bool:
        """Take the fleet's compile claim on ``key`` without waiting; False if another holds
        it. Held until ``release(key)``, renewed meanwhile."""
        _check(key)
        lock = self._redis.lock(self._prefix + "c:" + key, timeout=self.ttl_s, blocking=False,
                                thread_local=False)
        if not self._call(lock.acquire):
            return False
        with self._lock:
            self._claims[key] = _Claim(lock)
            if self._renewer is None:
                self._renewer = threading.Thread(target=self._renew, daemon=True,
                                                 name="hotswap-claim-renew")
                self._renewer.start()
        return True

    def held(self, key: str) -> bool:
        """Whether someone holds the claim on ``key`` now."""
        return bool(self._call(self._redis.exists, self._prefix + "c:" + key))

    def release(self, key: str) -> None:
        with self._lock:
            claim = self._claims.pop(key, None)
        if claim is not None and not claim.lost:
            with contextlib.suppress(*self._errors):
                claim.lock.release()  # only if still ours (a Lua check of its token)

    def claims(self) -> list[str]:
        """The keys this store holds claims on now."""
        with self._lock:
            return list(self._claims)

    def _renew(self) -> None:
        """Every third of the time-to-live: push each held claim's expiry out again. A claim
        that expired meanwhile (this process stalled longer than the ttl) is lost: another
        replica may compile the same key; both store the same entry. Ends once no claim is
        held (the next claim starts it again): a store per coordinator must not leave a thread
        per store behind."""
        while True:
            time.sleep(self.ttl_s / 3)
            with self._lock:
                if not self._claims:
                    self._renewer = None
                    return
                held = [(k, c) for k, c in self._claims.items() if not c.lost]
            for key, claim in held:
                try:
                    claim.lock.reacquire()
                except self._errors as e:
                    if type(e).__name__ == "LockNotOwnedError":
                        claim.lost = True
                        log.warning("hotswap fleet store: the compile claim on %s… expired "
                                    "before it was renewed; another replica may compile it too",
                                    key[:12])
                    # Redis down: renewed at the next round, if it is back by then


def _check(key: str) -> None:
    if not is_key(key):
        raise ValueError(f"cache keys are lowercase hex digests, got {key!r}")


def open_store(url: str, stamp: dict[str, Any] | None) -> FleetStore:
    """The fleet store at ``url`` with this machine's fleet key (``hotswap.cache.stores``
    opens redis://, rediss:// and unix:// URLs with it). ValueError without the key."""
    return FleetStore(url, load_fleet_key(), stamp)
