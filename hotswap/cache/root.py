"""The directory an artifact cache lives in: where it is, whether hotswap may use it, its key.

A directory becomes a cache only if hotswap creates it, it is empty, or it is one already (its
``HOTSWAP_CACHE`` marker file; or, from before markers, nothing but a cache's own files): any
other is refused before it is touched. Only a directory hotswap creates is made private (0700).
Before anything in it is read or written, the directory must be this user's and writable by
no one else, and the key readable by no one else (trust.py): a cache another user could write
is not used at all.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from hotswap import settings
from hotswap.cache.trust import check_root, check_way, create_secret, read_private

__all__ = ["MARKER", "NotACache", "claim_root", "default_cache_dir", "load_secret", "open_root",
           "read_secret"]

# A directory is a hotswap cache when it holds this file (claim_root).
MARKER = "HOTSWAP_CACHE"
# What a cache holds besides the marker (a cache from before markers holds only these).
_CACHE_FILES = frozenset({"entries", "locks", "secret.key", "index.msgpack", "index.lock"})


def default_cache_dir() -> Path:
    """``HOTSWAP_CACHE_DIR``, else ``$XDG_CACHE_HOME/hotswap``, else ``~/.cache/hotswap``."""
    env = settings.cache_dir()
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hotswap"


class NotACache(ValueError):
    """A directory that is not a hotswap cache (no marker) where only an existing one will do."""


def _not_a_directory(root: Path) -> NotADirectoryError:
    return NotADirectoryError(f"the artifact cache {str(root)!r} is not a directory; point "
                              "cache_dir (--cache-dir, HOTSWAP_CACHE_DIR) at one")


def open_root(root: Path) -> Path:
    """Check that ``root`` is an existing hotswap cache this user may trust, writing nothing;
    its real path (``trust.check_root``). Else ``FileNotFoundError``, ``NotADirectoryError``,
    ``trust.UntrustedPath`` or ``NotACache``."""
    if not root.is_dir():
        raise _not_a_directory(root) if root.exists() else FileNotFoundError(
            f"no artifact cache at {str(root)!r}")
    root = check_root(root)
    if not (root / MARKER).is_file():
        raise NotACache(f"{str(root)!r} is not a hotswap artifact cache (it has no {MARKER} "
                        "marker); hotswap reads and removes files only in its own caches")
    return root


def claim_root(root: Path, format_version: int) -> Path:
    """Make ``root`` a hotswap cache, or refuse before touching it. A directory becomes one
    only when hotswap creates it, when it is empty, or when it is one already (its marker
    file; or, from before markers, nothing but a cache's own files). Only a directory
    hotswap creates is made private (0700): one you made keeps the mode you gave it, and is
    refused (``trust.UntrustedPath``) if it is another user's or others may write it. Returns
    its real path, which the cache uses from then on."""
    if root.exists() and not root.is_dir():
        raise _not_a_directory(root)
    if not root.exists():  # nothing is made where another user could swap it for theirs
        full = Path(os.path.abspath(root))
        check_way(next(p for p in full.parents if p.exists()))
        # Each missing folder made 0700 here: mkdir(parents=True) makes those above with the
        # umask's mode (0775 under umask 002), which check_way then refuses for good
        for part in [*reversed([p for p in full.parents if not p.exists()]), full]:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o700)
    root = check_root(root)
    marker = root / MARKER
    if marker.exists():
        return root
    foreign = sorted(n for n in os.listdir(root)
                     if n not in _CACHE_FILES and not n.startswith((".key-", ".tmp-")))
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise ValueError(f"refusing to use {str(root)!r} as the artifact cache: it holds "
                         f"files of its own ({shown}) and no {MARKER} marker; choose a new or "
                         "empty directory (cache_dir, --cache-dir, HOTSWAP_CACHE_DIR)")
    fd, tmp = tempfile.mkstemp(dir=root, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(f"hotswap artifact cache, format {format_version}\n")
        os.replace(tmp, marker)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return root


def load_secret(root: Path) -> bytes:
    """The cache's signing key, made on first use (32 random bytes, mode 0600)."""
    create_secret(root / "secret.key")
    secret = read_secret(root)
    assert secret is not None
    return secret


def read_secret(root: Path) -> bytes | None:
    """The cache's signing key as it is (None if it has none): ours, mode 0600, not a link,
    32 bytes; else ``trust.UntrustedPath`` or ``ValueError``."""
    path = root / "secret.key"
    try:
        secret = read_private(path, secret=True)
    except FileNotFoundError:
        return None
    if len(secret) != 32:
        raise ValueError(f"{path} is not a hotswap cache key (32 bytes); remove it or choose "
                         "another cache_dir")
    return secret
