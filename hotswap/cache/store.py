"""The artifact cache on disk: one signed file per (graph, tier), an index, LRU eviction.

    <root>/                      mode 0700 when hotswap creates it (an existing one keeps its own)
      HOTSWAP_CACHE              marker: a directory without it is used only if empty (root.py)
      secret.key                 32 random bytes, mode 0600, made on first use
      index.msgpack              {key: {size, tier, origin, created_s, used_s}}; rebuilt from entries if lost
      index.lock                 filelock guarding the index
      entries/<k[:2]>/<k>.hsa    MAGIC | u32 header length | msgpack header | payload | HMAC-SHA256
      locks/<k>.lock             cross-process compile claims

Artifacts contain pickles: loading a foreign or tampered file runs its code. So an entry is
returned only if its magic, lengths, SHA-256, HMAC (this cache's secret) and stamp (torch build,
triton, device, format) all check out; otherwise it is reported, removed, and the caller
compiles again. Writes go to a temporary file renamed into place: a reader never sees half.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import logging
import os
import struct
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import filelock
import msgpack

from hotswap._env import env_number
from hotswap.cache.root import claim_root, default_cache_dir, load_secret

__all__ = ["FORMAT_VERSION", "VERDICT_TIER", "ArtifactCache", "EntryInfo", "EntryRejected", "is_key",
           "seal", "split_entry", "unseal"]

# The tier label of the benchmark gate's verdicts (a decision, not an artifact).
VERDICT_TIER = "gate-verdict"

log = logging.getLogger("hotswap")

# Part of every entry's stamp and key. 2: payloads are hotswap.orchestrator.artifacts entries
# laid out for reading in place (1 was a msgpack map); entries of 1 are simply not looked up.
FORMAT_VERSION = 2
MAGIC = b"HSWPA\x00\x01\x00"
# Longest wait for another process's hold on the index (a stopped one holds it for ever):
# then filelock.Timeout, an OSError, which every caller treats as "index unavailable".
INDEX_LOCK_WAIT_S = 10.0
_LEN = struct.Struct("!I")
_MAC_BYTES = 32


@dataclass(frozen=True)
class EntryInfo:
    key: str
    tier: str
    size_bytes: int
    created_s: float
    used_s: float
    origin: str = ""  # where the graph came from: "forward (model.py:12)"


class EntryRejected(Exception):
    """An entry failed a check; ``reason`` says which."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def env_max_bytes() -> int | None:
    """HOTSWAP_CACHE_MAX_BYTES (None: no limit); ValueError naming it when malformed."""
    return env_number("HOTSWAP_CACHE_MAX_BYTES", int, lambda v: v > 0,
                      "a whole number of bytes > 0")


class ArtifactCache:
    """Signed, size-bounded store of compiled artifacts shared by processes of one user.

    ``stamp`` is what an entry must have been written under to be loaded here (torch build,
    triton version, device...): an entry with another stamp is never loaded. Without a stamp
    (the CLI) entries are checked for integrity only, and nothing may be written.
    """

    def __init__(self, root: str | os.PathLike[str] | None = None, *,
                 max_bytes: int | None = None, stamp: dict[str, Any] | None = None) -> None:
        self.root = Path(root) if root is not None else default_cache_dir()
        if max_bytes is None:
            max_bytes = env_max_bytes()
        if max_bytes is not None and (isinstance(max_bytes, bool) or max_bytes <= 0):
            raise ValueError(f"max_bytes must be a positive int or None, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.stamp = dict(stamp) if stamp is not None else None
        claim_root(self.root, FORMAT_VERSION)
        (self.root / "entries").mkdir(mode=0o700, exist_ok=True)
        self._lock = filelock.FileLock(str(self.root / "index.lock"), timeout=INDEX_LOCK_WAIT_S)
        self._secret = load_secret(self.root)
        self._warned: set[str] = set()
        self.rejected = 0  # entries refused (and removed) by get() so far
        self._count_lock = threading.Lock()

    # ------------------------------------------------------------------ entries

    def get(self, key: str, *, touch: bool = True) -> bytes | None:
        """The payload stored under ``key``, or None (missing, or rejected and removed).
        ``touch=False`` leaves noting the use (for eviction) to a later ``touch(key)``: a
        caller on the user's path reads, and writes nothing."""
        path = self._path(key)
        try:
            parts = _read_entry(path)
        except FileNotFoundError:
            return None
        try:
            header, payload = self._verify(parts, key)
        except EntryRejected as e:
            with self._count_lock:
                self.rejected += 1
            self._reject(key, e.reason)
            return None
        if touch:
            self.touch(key, size=sum(map(len, parts)), header=header)
        return payload

    def touch(self, key: str, *, size: int | None = None,
              header: dict[str, Any] | None = None) -> None:
        """Note that ``key`` was used now, for LRU eviction. Best effort: an index that cannot
        be written (full disk, a lock held too long) leaves eviction slightly less exact."""
        try:
            with self._lock:
                index = self._read_index()
                record = index.get(key)
                if record is None:
                    if size is None:
                        size = self._path(key).stat().st_size
                    header = header or {}
                    record = index[key] = {"size": size, "tier": header.get("tier", ""),
                                           "origin": header.get("origin", ""),
                                           "created_s": header.get("created_s", 0.0)}
                record["used_s"] = time.time()
                self._write_index(index)
        except OSError as e:
            log.debug("hotswap cache: could not note the use of %s… (%s)", key[:16], e)

    def put(self, key: str, payload: bytes | memoryview, *, tier: str = "",
            origin: str = "") -> None:
        """Store ``payload`` atomically, then evict least-recently-used entries over max_bytes.
        ``tier`` and ``origin`` (where the graph came from) label it in ``entries()``."""
        if self.stamp is None:
            raise ValueError("this ArtifactCache was opened without a stamp; it cannot write")
        # Written and signed piece by piece, never joined: joining copies the payload (tens of
        # MB for a GPU tier) while holding the GIL, which stalls the user's calls; hashing and
        # writing a large buffer release it.
        head, mac = seal(self._secret, key, payload, tier=tier, origin=origin, stamp=self.stamp)
        path = self._path(key)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        _write_atomic(path, head, payload, mac)
        size = len(head) + len(payload) + _MAC_BYTES
        with self._lock:
            index = self._read_index()
            now = time.time()
            index[key] = {"size": size, "tier": tier, "origin": origin, "created_s": now,
                          "used_s": now}
            self._evict(index, keep=key)
            self._write_index(index)

    def entries(self) -> list[EntryInfo]:
        with self._lock:
            index = self._read_index()
        return sorted((EntryInfo(k, v.get("tier", ""), v["size"], v.get("created_s", 0.0),
                                 v.get("used_s", 0.0), v.get("origin", ""))
                       for k, v in index.items()),
                      key=lambda e: e.used_s, reverse=True)

    def verify(self) -> list[tuple[str, str]]:
        """Check every entry; remove the bad ones. Returns (key, reason) for each removed."""
        bad = []
        for path in self._entry_paths():
            key = path.stem
            try:
                self._verify(_read_entry(path), key)
            except EntryRejected as e:
                bad.append((key, e.reason))
                self._reject(key, e.reason, warn=False)
            except OSError as e:
                bad.append((key, f"unreadable: {e}"))
        return bad

    def clear(self, tier: str | None = None) -> int:
        """Remove every entry (``tier``: those with that tier label alone, e.g.
        ``VERDICT_TIER``); returns how many."""
        with self._lock:
            if tier is None:
                paths = list(self._entry_paths())
                index: dict[str, dict[str, Any]] = {}
            else:
                index = self._read_index()
                doomed = [k for k, v in index.items() if v.get("tier") == tier]
                paths = [self._path(k) for k in doomed]
                for key in doomed:
                    del index[key]
            for path in paths:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            self._write_index(index)
        return len(paths)

    def stats(self) -> dict[str, Any]:
        entries = self.entries()
        return {"root": str(self.root), "entries": len(entries),
                "bytes": sum(e.size_bytes for e in entries), "max_bytes": self.max_bytes}

    def compile_lock(self, key: str) -> filelock.FileLock:
        """A per-(graph, tier) lock: hold it while compiling so other processes wait, not repeat.

        Not thread-local: the call that takes it and the loader thread that releases it (after
        storing the artifact) differ. The OS drops it if the holding process dies.
        """
        self._path(key)  # validates the key
        locks = self.root / "locks"
        locks.mkdir(mode=0o700, exist_ok=True)
        return filelock.FileLock(str(locks / f"{key}.lock"), thread_local=False)

    def claim_owner_path(self, key: str) -> Path:
        """Where the process holding ``key``'s compile lock writes its pid (the lock file
        itself is truncated by every acquire attempt), so that waiters can tell a stopped
        holder from a busy one."""
        self._path(key)
        return self.root / "locks" / f"{key}.owner"

    # ------------------------------------------------------------------ helpers

    def entry_path(self, key: str) -> Path:
        """Where ``key``'s entry lives (whether or not it exists)."""
        return self._path(key)

    def _path(self, key: str) -> Path:
        """``key``'s entry path. Never through a symlink: a linked ``entries`` folder, shard or
        entry would send reads, rewrites and removals outside the cache (OSError ELOOP)."""
        if not _is_key(key):
            raise ValueError(f"cache keys are lowercase hex digests, got {key!r}")
        path = self.root / "entries" / key[:2] / f"{key}.hsa"
        for part in (path.parent.parent, path.parent, path):
            if part.is_symlink():
                raise OSError(errno.ELOOP, f"{part} is a symlink; hotswap does not follow "
                                           "links inside its cache (remove it)")
        return path

    def _entry_paths(self) -> Iterator[Path]:
        """Every entry file: named by its key, in its key's shard, not a link. Anything else
        under ``entries`` is not hotswap's, and listing, verifying and clearing leave it."""
        entries = self.root / "entries"
        if entries.is_symlink():
            return
        yield from (p for p in entries.glob("*/*.hsa")
                    if _is_key(p.stem) and p.parent.name == p.stem[:2]
                    and not p.parent.is_symlink() and not p.is_symlink())

    def _verify(self, parts: tuple[bytes, bytes, bytes], key: str
                ) -> tuple[dict[str, Any], bytes]:
        return unseal(self._secret, parts, key, self.stamp)

    def _reject(self, key: str, reason: str, *, warn: bool = True) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()
        try:  # the next rebuild or put drops a record left behind
            with self._lock:
                index = self._read_index()
                if index.pop(key, None) is not None:
                    self._write_index(index)
        except OSError as e:
            log.debug("hotswap cache: could not drop %s… from the index (%s)", key[:16], e)
        if warn and key not in self._warned:
            self._warned.add(key)
            log.warning("hotswap cache: entry %s… refused and removed (%s); compiling again",
                        key[:12], reason)

    def _read_index(self) -> dict[str, dict[str, Any]]:
        try:
            index = msgpack.unpackb((self.root / "index.msgpack").read_bytes(), raw=False)
            if isinstance(index, dict):
                return index
        except FileNotFoundError:
            pass
        except Exception:
            log.warning("hotswap cache: index unreadable; rebuilding it from the entries")
        return self._rebuild_index()

    def _rebuild_index(self) -> dict[str, dict[str, Any]]:
        index: dict[str, dict[str, Any]] = {}
        for path in self._entry_paths():
            with contextlib.suppress(OSError):
                st = path.stat()
                index[path.stem] = {"size": st.st_size, "tier": "", "created_s": st.st_mtime,
                                    "used_s": st.st_atime}
        return index

    def _write_index(self, index: dict[str, dict[str, Any]]) -> None:
        # Atomic but not fsynced: the index is rebuilt from the entries if a crash loses it, and
        # get() rewrites it on every hit, inside the caller's first call.
        _write_atomic(self.root / "index.msgpack", msgpack.packb(index, use_bin_type=True),
                      durable=False)

    def _evict(self, index: dict[str, dict[str, Any]], keep: str) -> None:
        if self.max_bytes is None:
            return
        total = sum(v["size"] for v in index.values())
        for key in sorted(index, key=lambda k: index[k].get("used_s", 0.0)):
            if total <= self.max_bytes:
                break
            if key == keep:
                continue
            total -= index.pop(key)["size"]
            with contextlib.suppress(FileNotFoundError):
                self._path(key).unlink()


def seal(secret: bytes, key: str, payload: bytes | memoryview, *, tier: str, origin: str,
         stamp: dict[str, Any]) -> tuple[bytes, bytes]:
    """An entry's (MAGIC + header length + header, HMAC-SHA256 of it and the payload): what
    goes before and after ``payload`` wherever an entry is stored (a file here; the fleet
    store's Redis values too)."""
    header = msgpack.packb({"format": FORMAT_VERSION, "key": key, "tier": tier,
                            "origin": origin, "stamp": stamp,
                            "sha256": hashlib.sha256(payload).hexdigest(),
                            "size": len(payload), "created_s": time.time()},
                           use_bin_type=True)
    head = MAGIC + _LEN.pack(len(header)) + header
    mac = hmac.new(secret, head, hashlib.sha256)
    mac.update(payload)
    return head, mac.digest()


def unseal(secret: bytes, parts: tuple[bytes, bytes, bytes], key: str,
           stamp: dict[str, Any] | None) -> tuple[dict[str, Any], bytes]:
    """An entry's header and payload, if its magic, lengths, HMAC (``secret``), format, key,
    SHA-256 and ``stamp`` (None: any) all check out; else ``EntryRejected`` saying which."""
    head, payload, mac = parts
    if len(head) < len(MAGIC) + _LEN.size or len(mac) != _MAC_BYTES \
            or not head.startswith(MAGIC):
        raise EntryRejected("truncated or not a hotswap artifact")
    signature = hmac.new(secret, head, hashlib.sha256)
    signature.update(payload)
    if not hmac.compare_digest(mac, signature.digest()):
        raise EntryRejected("signature does not match this cache's key (tampered, truncated "
                            "or written by another cache)")
    try:
        header = msgpack.unpackb(head[len(MAGIC) + _LEN.size:], raw=False)
    except Exception as e:
        raise EntryRejected(f"unreadable header: {e}") from e
    if header.get("format") != FORMAT_VERSION:
        raise EntryRejected(f"format {header.get('format')} is not {FORMAT_VERSION}")
    if header.get("key") != key:
        raise EntryRejected("stored under another key")
    if len(payload) != header.get("size") or \
            hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise EntryRejected("checksum mismatch")
    if stamp is not None and header.get("stamp") != stamp:
        raise EntryRejected(f"written by another build: {header.get('stamp')} != {stamp}")
    return header, payload


def split_entry(blob: bytes) -> tuple[bytes, bytes, bytes]:
    """A whole entry held in memory, as ``_read_entry`` reads one from a file."""
    prefix = blob[:len(MAGIC) + _LEN.size]
    if len(prefix) < len(MAGIC) + _LEN.size:
        return blob, b"", b""
    end_head = len(prefix) + _LEN.unpack_from(prefix, len(MAGIC))[0]
    end_payload = len(blob) - _MAC_BYTES
    if end_payload < end_head:
        return blob, b"", b""
    return blob[:end_head], blob[end_head:end_payload], blob[end_payload:]


def is_key(name: str) -> bool:
    """Whether ``name`` is a cache key (lowercase hex)."""
    return _is_key(name)


def _is_key(name: str) -> bool:
    return len(name) >= 2 and all(c in "0123456789abcdef" for c in name)


def _read_entry(path: Path) -> tuple[bytes, bytes, bytes]:
    """An entry's file as (MAGIC + header length + header, payload, signature), each read into
    a bytes object of its own: slicing one whole-file read would copy the payload holding the
    GIL. A file too short for its own header length reads as a truncated entry."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(len(MAGIC) + _LEN.size)
        complete = len(prefix) == len(MAGIC) + _LEN.size
        header_len = _LEN.unpack_from(prefix, len(MAGIC))[0] if complete else 0
        payload_len = size - len(prefix) - header_len - _MAC_BYTES
        if payload_len < 0:
            return prefix + f.read(), b"", b""
        head = prefix + f.read(header_len)
        return head, f.read(payload_len), f.read()


def _write_atomic(path: Path, *chunks: bytes | memoryview, durable: bool = True) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
