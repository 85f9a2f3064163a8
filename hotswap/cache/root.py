"""The directory an artifact cache lives in: where it is, whether hotswap may use it, its key.

A directory becomes a cache only if hotswap creates it, it is empty, or it is one already (its
``HOTSWAP_CACHE`` marker file; or, from before markers, nothing but a cache's own files): any
other is refused before it is touched. Only a directory hotswap creates is made private (0700).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

__all__ = ["MARKER", "claim_root", "default_cache_dir", "load_secret"]

# A directory is a hotswap cache when it holds this file (claim_root).
MARKER = "HOTSWAP_CACHE"
# What a cache holds besides the marker (a cache from before markers holds only these).
_CACHE_FILES = frozenset({"entries", "locks", "secret.key", "index.msgpack", "index.lock"})


def default_cache_dir() -> Path:
    """``HOTSWAP_CACHE_DIR``, else ``$XDG_CACHE_HOME/hotswap``, else ``~/.cache/hotswap``."""
    env = os.environ.get("HOTSWAP_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hotswap"


def claim_root(root: Path, format_version: int) -> None:
    """Make ``root`` a hotswap cache, or refuse before touching it. A directory becomes one
    only when hotswap creates it, when it is empty, or when it is one already (its marker
    file; or, from before markers, nothing but a cache's own files). Only a directory
    hotswap creates is made private (0700): one you made keeps the mode you gave it."""
    if root.exists() and not root.is_dir():
        raise NotADirectoryError(f"the artifact cache {str(root)!r} is not a directory; "
                                 "point cache_dir (--cache-dir, HOTSWAP_CACHE_DIR) at one")
    with contextlib.suppress(FileExistsError):
        root.mkdir(mode=0o700, parents=True)
    marker = root / MARKER
    if marker.exists():
        return
    foreign = sorted(n for n in os.listdir(root)
                     if n not in _CACHE_FILES and not n.startswith((".key-", ".tmp-")))
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise ValueError(f"refusing to use {str(root)!r} as the artifact cache: it holds "
                         f"files of its own ({shown}) and no {MARKER} marker; choose a new or "
                         "empty directory (cache_dir, --cache-dir, HOTSWAP_CACHE_DIR)")
    fd, tmp = tempfile.mkstemp(dir=root, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(f"hotswap artifact cache, format {format_version}\n")
    os.replace(tmp, marker)


def load_secret(root: Path) -> bytes:
    path = root / "secret.key"
    if not path.exists():
        # Write a complete key under a temporary name, then link it into place: a process
        # racing us sees either no key or a whole one, never an empty file.
        fd, tmp = tempfile.mkstemp(dir=root, prefix=".key-")
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(32))
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
        finally:
            os.unlink(tmp)
    secret = path.read_bytes()
    if len(secret) != 32:
        raise ValueError(f"{path} is not a hotswap cache key (32 bytes); remove it or choose "
                         "another cache_dir")
    return secret
