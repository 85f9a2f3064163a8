"""The artifact cache on disk: one signed file per (graph, tier), an index, LRU eviction.

    <root>/                      mode 0700 when hotswap creates it (an existing one keeps its own)
      HOTSWAP_CACHE              marker: a directory without it is used only if empty (root.py)
      secret.key                 32 random bytes, mode 0600, made on first use
      index.msgpack              {key: {size, tier, origin, created_s, used_s}}; rebuilt from entries if lost
      index.lock                 filelock guarding the index
      entries/<k[:2]>/<k>.hsa    MAGIC | u32 header length | msgpack header | payload | HMAC-SHA256
      shared/<s[:2]>/<s>.blob    content that entries share, stored once, named by its SHA-256
      locks/<k>.lock             cross-process compile claims
      locks/<k>.owner            the pid holding that claim

Artifacts contain pickles: loading a foreign or tampered file runs its code. So an entry is
returned only if its magic, lengths, SHA-256, HMAC (this cache's secret) and stamp (torch build,
triton, device, format) all check out; otherwise it is reported, removed, and the caller
compiles again. The secret is only as good as the folder it sits in: the root, its folders and
its key are used only if this user owns them and no one else may write them (or read the key),
and no link inside the cache is followed (trust.py). Writes go to a temporary file renamed
into place: a reader never sees half. A cache opened ``read_only`` writes nothing at all.

Shared content: the first CPU compile in a fresh inductor cache ships inductor's precompiled
header (a 149 MiB file, the same for every kernel built with the same flags) inside its
entry. ``put(shared=...)`` names such spans of a payload; each is stored once under
``shared/``, and the entry keeps its own bytes and, in its signed header, the SHA-256, place
and length of each span. ``get`` puts the payload back together, reading each span straight
into place and checking its SHA-256 against the signed one (so a blob needs no signature of
its own). A blob goes when the last entry naming it does (eviction, rejection, ``clear``),
and its bytes count once toward ``max_bytes``.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import filelock
import msgpack

from hotswap import settings
from hotswap.cache.root import claim_root, default_cache_dir, load_secret, open_root, read_secret
from hotswap.cache.trust import (
    UntrustedPath,
    check_private_dir,
    ensure_private_dir,
    open_private,
    read_private,
)

__all__ = ["FORMAT_VERSION", "VERDICT_TIER", "WRITE_PIECE", "ArtifactCache", "EntryInfo",
           "EntryRejected", "Unread", "has_unread", "hashed", "index_record", "is_key", "seal",
           "split_entry", "unseal", "write_atomic"]

# The tier label of the benchmark gate's verdicts (a decision, not an artifact).
VERDICT_TIER = "gate-verdict"

log = logging.getLogger("hotswap")

# Part of every entry's stamp and key. 2: payloads are hotswap.engine.loading.artifacts entries
# laid out for reading in place (1 was a msgpack map); 3: what a worker's probes found is plain
# msgpack (2 pickled the vector ISAs). Entries of another format are simply not looked up.
# 4: a header may name shared spans of the payload stored apart from it.
FORMAT_VERSION = 4
MAGIC = b"HSWPA\x00\x01\x00"
# How old a blob no entry names must be before a put removes it (a put in another process
# writes its blobs before it records them, but never takes this long).
SHARED_GRACE_S = 3600.0
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
    shared_bytes: int = 0  # content stored once under shared/ that this entry refers to


class Unread(bytearray):
    """A payload some of whose shared spans were left unread, as zeros (``get(have=...)``: its
    reader holds their content already, where it will use it): ``unread`` names them, as
    (offset, length). Only for that reader: ``put`` refuses one."""

    unread: tuple[tuple[int, int], ...] = ()


def has_unread(payload: object) -> bool:
    """Whether ``payload`` (or the buffer a memoryview shows) has spans left unread."""
    return bool(getattr(getattr(payload, "obj", payload), "unread", ()))


class EntryRejected(Exception):
    """An entry failed a check; ``reason`` says which."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def env_max_bytes() -> int | None:
    """HOTSWAP_CACHE_MAX_BYTES (None: no limit); ValueError naming it when malformed."""
    return settings.cache_max_bytes()


class ArtifactCache:
    """Signed, size-bounded store of compiled artifacts shared by processes of one user.

    ``stamp`` is what an entry must have been written under to be loaded here (torch build,
    triton version, device...): an entry with another stamp is never loaded. Without a stamp
    (the CLI) entries are checked for integrity only, and nothing may be written.
    ``create=False``: only an existing cache (its marker) is opened, never a new one made;
    ``read_only``: that, and nothing is written (no index, lock, key or removal).
    """

    def __init__(self, root: str | os.PathLike[str] | None = None, *,
                 max_bytes: int | None = None, stamp: dict[str, Any] | None = None,
                 create: bool = True, read_only: bool = False) -> None:
        self.root = Path(root) if root is not None else default_cache_dir()
        if max_bytes is None:
            max_bytes = env_max_bytes()
        if max_bytes is not None and (isinstance(max_bytes, bool) or max_bytes <= 0):
            raise ValueError(f"max_bytes must be a positive int or None, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.stamp = dict(stamp) if stamp is not None else None
        self.read_only = read_only
        # From here on the real path: a link on the way, checked now, is not followed again.
        if read_only or not create:
            self.root = open_root(self.root)
        else:
            self.root = claim_root(self.root, FORMAT_VERSION)
        self._lock: filelock.FileLock | contextlib.nullcontext[None]
        if read_only:
            # Without a key nothing can be verified (verify() says so); nothing is made.
            self._secret = read_secret(self.root)
            self._lock = contextlib.nullcontext()  # the index is replaced whole: reads see one
        else:
            ensure_private_dir(self.root / "entries")
            _no_link(self.root / "index.lock")
            self._lock = filelock.FileLock(str(self.root / "index.lock"),
                                           timeout=INDEX_LOCK_WAIT_S)
            self._secret = load_secret(self.root)
        self._warned: set[str] = set()
        self.rejected = 0  # entries refused (and removed) by get() so far
        self.index_rebuilds = 0  # indexes found malformed (or missing) and rebuilt
        self._count_lock = threading.Lock()

    # ------------------------------------------------------------------ entries

    def get(self, key: str, *, touch: bool = True,
            have: Callable[[memoryview, int, int], bool] | None = None
            ) -> bytes | bytearray | None:
        """The payload stored under ``key``, or None (missing, or rejected and removed).
        ``touch=False`` leaves noting the use (for eviction) to a later ``touch(key)``: a
        caller on the user's path reads, and writes nothing. ``have(payload, offset, length)``
        (the payload as far as it is filled: everything before that shared span): whether the
        caller already holds that span's content where it will use it; such a span is not
        read or hashed (its blob must still be there, trusted and of its length), and the
        payload is an ``Unread`` naming it."""
        try:
            parts = _read_entry(self._path(key))
        except FileNotFoundError:  # no entry, or (read-only) no entries folder yet
            return None
        payload: bytes | bytearray
        try:
            header, payload = self._verify(parts, key)
            if header.get("shared"):
                payload = self._assemble(payload, header["shared"], remove_bad=True, have=have)
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
                    # the blobs it names must be known, or an eviction could take them
                    header = header or _read_header(self._path(key)) or {}
                    record = index[key] = {"size": size, "tier": header.get("tier", ""),
                                           "origin": header.get("origin", ""),
                                           "created_s": header.get("created_s", 0.0),
                                           "shared": _shared_record(header)}
                record["used_s"] = time.time()
                self._write_index(index)
        except OSError as e:
            log.debug("hotswap cache: could not note the use of %s… (%s)", key[:16], e)

    def put(self, key: str, payload: bytes | bytearray | memoryview, *, tier: str = "",
            origin: str = "", shared: Sequence[tuple[int, int]] = (),
            rest_s: Rest = 0.0) -> None:
        """Store ``payload`` atomically, then evict least-recently-used entries over max_bytes.
        ``tier`` and ``origin`` (where the graph came from) label it in ``entries()``.
        ``shared``: (offset, length) spans of ``payload`` that other entries may hold too,
        each stored once in this cache (``get`` returns the payload whole all the same).
        ``rest_s``: rest this long (or what it returns, asked each time) after each MiB
        hashed or written (``hashed``, ``write_atomic``), for a write beside calls that want
        every core."""
        if has_unread(payload):
            raise ValueError("a payload read with spans left unread cannot be stored")
        if self.stamp is None or self.read_only:
            raise ValueError("this ArtifactCache was opened read-only or without a stamp; it "
                             "cannot write")
        # Written and signed piece by piece, never joined: joining copies the payload (tens of
        # MB for a GPU tier) while holding the GIL, which stalls the user's calls; hashing and
        # writing a large buffer release it. (An entry with shared spans joins only its own
        # bytes, the small part.)
        assert self._secret is not None  # made by load_secret() when not read_only
        view = memoryview(payload).cast("B")
        spans = [(hashed(hashlib.sha256(), view[o:o + n], rest_s).hexdigest(), o, n)
                 for o, n in _checked_spans(shared, len(view))]
        own = _without(view, spans) if spans else payload
        head, mac = seal(self._secret, key, own, tier=tier, origin=origin, stamp=self.stamp,
                         shared=[[sha, o, n] for sha, o, n in spans], rest_s=rest_s)
        for sha, o, n in spans:
            self._write_shared(sha, view[o:o + n], rest_s)
        path = self._path(key, make=True)
        write_atomic(path, head, own, mac, rest_s=rest_s)
        size = len(head) + len(own) + _MAC_BYTES
        with self._lock:
            index = self._read_index()
            now = time.time()
            replaced = index.pop(key, None)  # an entry stored again: its old blobs may go
            index[key] = {"size": size, "tier": tier, "origin": origin, "created_s": now,
                          "used_s": now, "shared": [[sha, n] for sha, _, n in spans]}
            if replaced is not None:
                self._remove_unnamed(index, replaced["shared"])
            self._evict(index, keep=key)
            self._sweep_shared(index)
            self._write_index(index)
            # Blobs go only under this lock, once no record names them: one that another
            # process's eviction removed between our write and our record is written again.
            for sha, o, n in spans:
                self._write_shared(sha, view[o:o + n])

    def entries(self) -> list[EntryInfo]:
        with self._lock:
            index = self._read_index()
        return sorted((EntryInfo(k, v["tier"], v["size"], v["created_s"], v["used_s"],
                                 v["origin"], sum(n for _, n in v["shared"]))
                       for k, v in index.items()),
                      key=lambda e: e.used_s, reverse=True)

    def verify(self, *, remove: bool = False) -> list[tuple[str, str]]:
        """Check every entry; (key, reason) for each bad one. ``remove``: remove those too
        (a cache opened ``read_only`` cannot)."""
        if remove and self.read_only:
            raise ValueError("this ArtifactCache was opened read-only; it cannot remove")
        bad = []
        for path in self._entry_paths():
            key = path.stem
            try:
                header, payload = self._verify(_read_entry(path), key)
                if header.get("shared"):
                    self._assemble(payload, header["shared"], remove_bad=remove)
            except EntryRejected as e:
                bad.append((key, e.reason))
                if remove:
                    self._reject(key, e.reason, warn=False)
            except OSError as e:
                bad.append((key, f"unreadable: {e}"))
        return bad

    def clear(self, tier: str | None = None) -> int:
        """Remove every entry (``tier``: those with that tier label alone, e.g.
        ``VERDICT_TIER``) and the shared content no entry left names; returns how many
        entries. Only entry files (named by their key, in their shard) and blobs (named by
        their digest) go: anything else in the folder is left as it is."""
        if self.read_only:
            raise ValueError("this ArtifactCache was opened read-only; it cannot clear")
        with self._lock:
            if tier is None:
                paths = list(self._entry_paths())
                index: dict[str, dict[str, Any]] = {}
                for blob in self._shared_paths():
                    with contextlib.suppress(FileNotFoundError):
                        blob.unlink()
            else:
                index = self._read_index()
                doomed = [k for k, v in index.items() if v.get("tier") == tier]
                paths = [self._path(k) for k in doomed]
                for key in doomed:
                    self._drop(index, key)
            for path in paths:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            self._write_index(index)
        return len(paths)

    def stats(self) -> dict[str, Any]:
        """Entries and bytes on disk: ``bytes`` is ``entry_bytes`` (each entry's own) plus
        ``shared_bytes`` (``shared_files`` blobs, each stored once whatever names it)."""
        with self._lock:
            index = self._read_index()
        own = sum(v["size"] for v in index.values())
        shared = _shared_sizes(index)
        return {"root": str(self.root), "entries": len(index),
                "bytes": own + sum(shared.values()), "entry_bytes": own,
                "shared_bytes": sum(shared.values()), "shared_files": len(shared),
                "max_bytes": self.max_bytes}

    def compile_lock(self, key: str) -> filelock.FileLock:
        """A per-(graph, tier) lock: hold it while compiling so other processes wait, not repeat.

        Not thread-local: the call that takes it and the loader thread that releases it (after
        storing the artifact) differ. The OS drops it if the holding process dies.
        """
        path = self._lock_path(key, ".lock")
        _no_link(path)
        return filelock.FileLock(str(path), thread_local=False)

    def write_claim_owner(self, key: str, pid: int) -> None:
        """Note ``pid`` as the holder of ``key``'s compile lock (the lock file itself is
        truncated by every acquire attempt), so that waiters can tell a stopped holder from
        a busy one."""
        fd = open_private(self._lock_path(key, ".owner"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        with os.fdopen(fd, "w") as f:
            f.write(str(pid))

    def claim_owner(self, key: str) -> int | None:
        """The pid ``write_claim_owner`` noted for ``key`` (None: none, or unreadable)."""
        try:
            return int(read_private(self._lock_path(key, ".owner")))
        except (OSError, ValueError):
            return None

    def remove_claim_owner(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._lock_path(key, ".owner"))  # unlink never follows a link

    def _lock_path(self, key: str, suffix: str) -> Path:
        if not _is_key(key):
            raise ValueError(f"cache keys are lowercase hex digests, got {key!r}")
        locks = self.root / "locks"
        ensure_private_dir(locks)
        return locks / f"{key}{suffix}"

    # ------------------------------------------------------------------ helpers

    def entry_path(self, key: str) -> Path:
        """Where ``key``'s entry lives (whether or not it exists)."""
        return self._path(key)

    def _path(self, key: str, *, make: bool = False) -> Path:
        """``key``'s entry path (``make``: its shard folder made if missing). Never through a
        symlink: a linked ``entries`` folder, shard or entry would send reads, rewrites and
        removals outside the cache (``trust.UntrustedPath``, an OSError)."""
        if not _is_key(key):
            raise ValueError(f"cache keys are lowercase hex digests, got {key!r}")
        path = self.root / "entries" / key[:2] / f"{key}.hsa"
        check_private_dir(path.parent.parent)
        try:
            (ensure_private_dir if make else check_private_dir)(path.parent)
        except FileNotFoundError:
            pass  # no shard, no entry: the read finds nothing
        _no_link(path)
        return path

    def _entry_paths(self) -> Iterator[Path]:
        """Every entry file: named by its key, in its key's shard, not a link. Anything else
        under ``entries`` is not hotswap's, and listing, verifying and clearing leave it."""
        return self._sharded("entries", ".hsa", _is_key)

    def _sharded(self, folder: str, suffix: str, named: Callable[[str], bool]) -> Iterator[Path]:
        """The files ``<folder>/<name[:2]>/<name><suffix>`` whose name is ``named``, not
        links, in a folder of this user's."""
        top = self.root / folder
        try:
            check_private_dir(top)
        except FileNotFoundError:
            return
        yield from (p for p in top.glob(f"*/*{suffix}")
                    if named(p.stem) and p.parent.name == p.stem[:2]
                    and not p.parent.is_symlink() and not p.is_symlink())

    def _shared_path(self, sha: str, *, make: bool = False) -> Path:
        """Where the shared content of digest ``sha`` lives (``make``: its folders made)."""
        shared = self.root / "shared"
        path = shared / sha[:2] / f"{sha}.blob"
        check = ensure_private_dir if make else check_private_dir
        check(shared)
        check(path.parent)
        _no_link(path)
        return path

    def _shared_paths(self) -> Iterator[Path]:
        """Every blob: named by its digest, in its shard, not a link."""
        return self._sharded("shared", ".blob", _is_digest)

    def _write_shared(self, sha: str, data: memoryview, rest_s: Rest = 0.0) -> None:
        """Store shared content unless a blob of its digest and length is there."""
        path = self._shared_path(sha, make=True)
        with contextlib.suppress(FileNotFoundError):
            if path.lstat().st_size == len(data):
                return
        write_atomic(path, data, rest_s=rest_s)

    def _assemble(self, own: bytes, spans: list[list[Any]], *, remove_bad: bool,
                  have: Callable[[memoryview, int, int], bool] | None = None) -> bytearray:
        """An entry's payload whole: its own bytes with each shared span read into place
        (no copy of a span, and the reads and hashes release the GIL), but those ``have``
        says the caller holds (``get``). A blob that is missing, of another length or
        another digest rejects the entry; ``remove_bad``: a blob of the wrong content is
        removed too, so the next ``put`` writes it anew."""
        size = len(own) + sum(n for _, _, n in spans)
        out = Unread(size) if have is not None else bytearray(size)
        view = memoryview(out)
        done = used = 0  # bytes of out filled, bytes of own used
        unread = []
        for sha, offset, n in spans:
            view[done:offset] = own[used:used + offset - done]
            used += offset - done
            if have is not None and have(view, offset, n):
                unread.append((offset, n))  # still there, trusted, whole in length
                self._read_shared(sha, None, n, remove_bad=remove_bad)
            else:
                self._read_shared(sha, view[offset:offset + n], n, remove_bad=remove_bad)
            done = offset + n
        view[done:] = own[used:]
        if unread:
            assert isinstance(out, Unread)
            out.unread = tuple(unread)
        return out

    def _read_shared(self, sha: str, into: memoryview | None, n: int, *,
                     remove_bad: bool) -> None:
        """Read blob ``sha`` (``n`` bytes) into ``into`` and check its digest; ``into`` None:
        only that it is there, trusted and of its length (a span the reader holds already)."""
        path = self.root / "shared" / sha[:2] / f"{sha}.blob"
        try:
            fd = open_private(self._shared_path(sha), os.O_RDONLY)
        except FileNotFoundError:
            raise EntryRejected(f"shared content {sha[:12]}… is missing") from None
        except UntrustedPath as e:  # a link, or a file another user may write
            raise EntryRejected(f"shared content {sha[:12]}… is not trusted: {e}") from None
        with os.fdopen(fd, "rb", buffering=0) as f:
            whole = os.fstat(f.fileno()).st_size == n
            got = 0
            while into is not None and whole and got < n:
                read = f.readinto(into[got:])
                if not read:
                    break
                got += read
        if not whole or (into is not None and (
                got != n or hashlib.sha256(into).hexdigest() != sha)):
            if remove_bad and not self.read_only:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            raise EntryRejected(f"shared content {sha[:12]}… was altered or truncated")

    def _drop(self, index: dict[str, dict[str, Any]], key: str) -> int:
        """Remove ``key``'s record, and the blobs no other record names; bytes freed (the
        entry file itself is the caller's to remove)."""
        record = index.pop(key, None)
        if record is None:
            return 0
        freed: int = record["size"]
        return freed + self._remove_unnamed(index, record["shared"])

    def _remove_unnamed(self, index: dict[str, dict[str, Any]], shared: list[list[Any]]) -> int:
        """Remove the blobs of ``shared`` that no record of ``index`` names; bytes freed."""
        freed = 0
        still = _shared_sizes(index)
        for sha, n in shared:
            if sha not in still:
                freed += n
                with contextlib.suppress(FileNotFoundError, UntrustedPath):
                    self._shared_path(sha).unlink()
        return freed

    def _sweep_shared(self, index: dict[str, dict[str, Any]]) -> None:
        """Remove blobs no record names that are older than SHARED_GRACE_S: left by a put cut
        short (a full disk, a kill) between its blob and its record. A younger one may be a
        put's under way in another process (it writes its blobs before taking the lock)."""
        named = _shared_sizes(index)
        old = time.time() - SHARED_GRACE_S
        for blob in self._shared_paths():
            with contextlib.suppress(OSError):
                if blob.stem not in named and blob.lstat().st_mtime < old:
                    blob.unlink()

    def _verify(self, parts: tuple[bytes, bytes, bytes], key: str
                ) -> tuple[dict[str, Any], bytes]:
        if self._secret is None:
            raise EntryRejected("the cache has no key (secret.key): no entry can be verified")
        return unseal(self._secret, parts, key, self.stamp, shared=True)

    def _reject(self, key: str, reason: str, *, warn: bool = True) -> None:
        if self.read_only:
            return
        with contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()
        try:  # the next rebuild or put drops a record left behind
            with self._lock:
                index = self._read_index()
                if key in index:
                    self._drop(index, key)
                    self._write_index(index)
        except OSError as e:
            log.debug("hotswap cache: could not drop %s… from the index (%s)", key[:16], e)
        if warn and key not in self._warned:
            self._warned.add(key)
            log.warning("hotswap cache: entry %s… refused and removed (%s); compiling again",
                        key[:12], reason)

    def _read_index(self) -> dict[str, dict[str, Any]]:
        """The index, if it is one; else one rebuilt from the entries. One of the wrong shape
        (records of the wrong types, say) counts in ``index_rebuilds`` and is rebuilt, never a
        TypeError later."""
        try:
            index = _valid_index(msgpack.unpackb(read_private(self.root / "index.msgpack"),
                                                 raw=False))
        except FileNotFoundError:
            return self._rebuild_index()
        except UntrustedPath:
            raise
        except Exception:  # whatever msgpack makes of bytes that are not an index
            index = None
        if index is None:
            log.warning("hotswap cache: index malformed; rebuilding it from the entries")
            with self._count_lock:
                self.index_rebuilds += 1
            return self._rebuild_index()
        return index

    def _rebuild_index(self) -> dict[str, dict[str, Any]]:
        index: dict[str, dict[str, Any]] = {}
        for path in self._entry_paths():
            with contextlib.suppress(OSError):
                st = path.lstat()
                header = _read_header(path) or {}
                record = {"size": st.st_size, "tier": header.get("tier", ""),
                          "origin": header.get("origin", ""),
                          "created_s": header.get("created_s", st.st_mtime),
                          "used_s": st.st_atime, "shared": _shared_record(header)}
                # Labels from a header as written (unverified): kept only if well formed.
                index[path.stem] = index_record(record) or {
                    **record, "tier": "", "origin": "", "created_s": st.st_mtime, "shared": []}
        return index

    def _write_index(self, index: dict[str, dict[str, Any]]) -> None:
        # Atomic but not fsynced: the index is rebuilt from the entries if a crash loses it, and
        # get() rewrites it on every hit, inside the caller's first call.
        if self.read_only:
            return
        write_atomic(self.root / "index.msgpack", msgpack.packb(index, use_bin_type=True),
                      durable=False)

    def _evict(self, index: dict[str, dict[str, Any]], keep: str) -> None:
        if self.max_bytes is None:
            return
        total = sum(v["size"] for v in index.values()) + sum(_shared_sizes(index).values())
        for key in sorted(index, key=lambda k: index[k].get("used_s", 0.0)):
            if total <= self.max_bytes:
                break
            if key == keep:
                continue
            total -= self._drop(index, key)
            with contextlib.suppress(FileNotFoundError):
                self._path(key).unlink()


def seal(secret: bytes, key: str, payload: bytes | bytearray | memoryview, *, tier: str,
         origin: str, stamp: dict[str, Any], shared: list[list[Any]] | None = None,
         rest_s: Rest = 0.0) -> tuple[bytes, bytes]:
    """An entry's (MAGIC + header length + header, HMAC-SHA256 of it and the payload): what
    goes before and after ``payload`` wherever an entry is stored (a file here; the fleet
    store's Redis values too). ``shared``: [digest, offset, length] of each span of the
    whole payload stored apart (``payload`` is then the rest). ``rest_s``: as ``hashed``."""
    fields = {"format": FORMAT_VERSION, "key": key, "tier": tier, "origin": origin,
              "stamp": stamp, "sha256": hashed(hashlib.sha256(), payload, rest_s).hexdigest(),
              "size": len(payload), "created_s": time.time()}
    if shared:
        fields["shared"] = shared
    header = msgpack.packb(fields, use_bin_type=True)
    head = MAGIC + _LEN.pack(len(header)) + header
    mac = hashed(hmac.new(secret, head, hashlib.sha256), payload, rest_s)
    return head, mac.digest()


class _Hasher(Protocol):
    def update(self, data: memoryview, /) -> None: ...


H = TypeVar("H", bound=_Hasher)


def hashed(hasher: H, data: bytes | bytearray | memoryview, rest_s: Rest = 0.0) -> H:
    """``hasher`` updated with ``data`` a piece (``WRITE_PIECE``) at a time, resting
    ``rest_s`` after each: over 148 MiB, one call is a third of a second of a core's time
    without a pause."""
    view = memoryview(data).cast("B")
    for offset in range(0, len(view), WRITE_PIECE):
        hasher.update(view[offset:offset + WRITE_PIECE])
        _rest(rest_s)
    return hasher


def _rest(rest_s: Rest) -> None:
    seconds = rest_s() if callable(rest_s) else rest_s
    if seconds > 0:
        time.sleep(seconds)


def unseal(secret: bytes, parts: tuple[bytes, bytes, bytes], key: str,
           stamp: dict[str, Any] | None, *, shared: bool = False
           ) -> tuple[dict[str, Any], bytes]:
    """An entry's header and payload, if its magic, lengths, HMAC (``secret``), format, key,
    SHA-256 and ``stamp`` (None: any) all check out; else ``EntryRejected`` saying which.
    ``shared``: the header may name spans stored apart (``header["shared"]``, checked well
    formed: in order, not overlapping); the payload returned is then the entry's own part."""
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
    if not isinstance(header, dict):
        raise EntryRejected("unreadable header: not a map")
    if header.get("format") != FORMAT_VERSION:
        raise EntryRejected(f"format {header.get('format')} is not {FORMAT_VERSION}")
    if header.get("key") != key:
        raise EntryRejected("stored under another key")
    if len(payload) != header.get("size") or \
            hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise EntryRejected("checksum mismatch")
    if stamp is not None and header.get("stamp") != stamp:
        raise EntryRejected(f"written by another build: {header.get('stamp')} != {stamp}")
    if "shared" in header and not (shared and _valid_spans(header["shared"], len(payload))):
        raise EntryRejected("names shared content this store cannot hold" if not shared
                            else "malformed list of shared content")
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


def _checked_spans(spans: Sequence[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """``spans`` of a payload of ``size`` bytes, in order; ValueError unless each is a
    non-empty (offset, length) inside it and none overlaps another."""
    ordered = sorted((int(o), int(n)) for o, n in spans)
    end = 0
    for offset, n in ordered:
        if offset < end or n <= 0 or offset + n > size:
            raise ValueError(f"shared spans must be non-empty, inside the payload and apart; "
                             f"got {list(spans)} for {size} bytes")
        end = offset + n
    return ordered


def _without(view: memoryview, spans: list[tuple[str, int, int]]) -> bytes:
    """The bytes of ``view`` outside ``spans`` (in order), joined."""
    pieces, done = [], 0
    for _, offset, n in spans:
        pieces.append(view[done:offset])
        done = offset + n
    pieces.append(view[done:])
    return b"".join(pieces)


def _valid_spans(spans: Any, own: int) -> bool:
    """Whether a header's ``shared`` is [digest, offset, length] lists, in order and apart,
    around ``own`` bytes of the entry's own."""
    if not isinstance(spans, list) or not spans:
        return False
    done = used = 0
    for span in spans:
        if not (isinstance(span, list) and len(span) == 3 and _is_digest(span[0])
                and all(isinstance(x, int) and not isinstance(x, bool) for x in span[1:])):
            return False
        _, offset, n = span
        if offset < done or n <= 0 or used + offset - done > own:
            return False
        used += offset - done
        done = offset + n
    return True


def _shared_record(header: dict[str, Any] | None) -> list[list[Any]]:
    """An index record's ``shared`` ([digest, length] each) from an entry's header."""
    spans = (header or {}).get("shared")
    if not isinstance(spans, list):
        return []
    return [[s[0], s[2]] for s in spans
            if isinstance(s, list) and len(s) == 3 and _is_digest(s[0])
            and isinstance(s[2], int) and not isinstance(s[2], bool) and 0 < s[2] < 2**40]


def _shared_sizes(index: dict[str, dict[str, Any]]) -> dict[str, int]:
    """Digest -> length of every blob some record of ``index`` names."""
    return {sha: n for record in index.values() for sha, n in record["shared"]}


def _is_digest(name: Any) -> bool:
    return isinstance(name, str) and len(name) == 64 and _is_key(name)


def is_key(name: str) -> bool:
    """Whether ``name`` is a cache key (lowercase hex)."""
    return _is_key(name)


def _is_key(name: str) -> bool:
    return len(name) >= 2 and all(c in "0123456789abcdef" for c in name)


def _valid_index(index: Any) -> dict[str, dict[str, Any]] | None:
    """``index`` if every record under a key is one (``index_record``); else None."""
    if not isinstance(index, dict):
        return None
    valid = {k: index_record(r) for k, r in index.items() if isinstance(k, str) and _is_key(k)}
    if len(valid) != len(index) or any(r is None for r in valid.values()):
        return None
    return valid  # type: ignore[return-value]


def index_record(record: Any) -> dict[str, Any] | None:
    """An index record as {size: int, tier: str, origin: str, created_s and used_s: numbers}
    (missing labels and times filled in), or None if ``record`` is not one: whatever another
    program left in an index reads as a malformed index, never a TypeError later."""
    if not isinstance(record, dict):
        return None
    out = {"tier": "", "origin": "", "created_s": 0.0, "shared": [], **record}
    out.setdefault("used_s", out["created_s"])
    size, times = out.get("size"), (out["created_s"], out["used_s"])
    if not (isinstance(size, int) and not isinstance(size, bool) and size >= 0
            and all(isinstance(t, int | float) and not isinstance(t, bool)
                    and -_TIME_LIMIT_S <= t <= _TIME_LIMIT_S for t in times)
            and isinstance(out["tier"], str) and isinstance(out["origin"], str)
            and isinstance(out["shared"], list)
            and all(isinstance(s, list) and len(s) == 2 and _is_digest(s[0])
                    and isinstance(s[1], int) and not isinstance(s[1], bool) and s[1] > 0
                    for s in out["shared"])):
        return None
    return out


# Times an index may hold: any a clock shows (about 3,000 years either side of 1970); NaN,
# infinities and times past that are no time, and would break printing them.
_TIME_LIMIT_S = 1e11


def _no_link(path: Path) -> None:
    """Refuse a file of the cache that is a symbolic link (before a library opens it)."""
    if path.is_symlink():
        raise UntrustedPath(path, "is a symlink inside the cache",
                            f"remove it (rm {path}); hotswap makes its own")


def _read_entry(path: Path) -> tuple[bytes, bytes, bytes]:
    """An entry's file as (MAGIC + header length + header, payload, signature), each read into
    a bytes object of its own: slicing one whole-file read would copy the payload holding the
    GIL. A file too short for its own header length reads as a truncated entry."""
    with os.fdopen(open_private(path, os.O_RDONLY), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(len(MAGIC) + _LEN.size)
        complete = len(prefix) == len(MAGIC) + _LEN.size
        header_len = _LEN.unpack_from(prefix, len(MAGIC))[0] if complete else 0
        payload_len = size - len(prefix) - header_len - _MAC_BYTES
        if payload_len < 0:
            return prefix + f.read(), b"", b""
        head = prefix + f.read(header_len)
        return head, f.read(payload_len), f.read()


def _read_header(path: Path) -> dict[str, Any] | None:
    """An entry file's header as written (unverified: for the index's accounting alone), or
    None where it cannot be read."""
    try:
        with os.fdopen(open_private(path, os.O_RDONLY), "rb") as f:
            prefix = f.read(len(MAGIC) + _LEN.size)
            if len(prefix) < len(MAGIC) + _LEN.size or not prefix.startswith(MAGIC):
                return None
            header = msgpack.unpackb(f.read(_LEN.unpack_from(prefix, len(MAGIC))[0]),
                                     raw=False)
    except Exception:
        return None
    return header if isinstance(header, dict) else None


# Seconds to rest after each piece hashed or written, or a function that says (asked each time).
Rest = float | Callable[[], float]

# The most one write call copies or one hash update reads. The kernel copies a write's bytes
# in one go, on a core the caller's threads may want: a put of 148 MiB beside a loop of
# 2-thread matmuls on the 2-core box made the loop's p90 call 27.7-30.2 ms with no rests
# (alone: 4.1-8.3 ms); a MiB at a time with a 1 ms rest after each, 7.7-9.9 ms (three rounds
# of scripts/write_pacing.py).
WRITE_PIECE = 1 << 20


def write_atomic(path: Path, *chunks: bytes | bytearray | memoryview,
                 durable: bool = True, rest_s: Rest = 0.0) -> None:
    """``chunks`` into ``path`` under a temporary name in its folder, then renamed: a reader
    sees the old file or the whole new one (``durable``: synced to disk first). Written a
    piece (``WRITE_PIECE``) at a time, resting ``rest_s`` after each."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                for offset in range(0, len(view), WRITE_PIECE):
                    f.write(view[offset:offset + WRITE_PIECE])
                    _rest(rest_s)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
