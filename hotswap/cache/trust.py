"""Whether a file or folder is ours to trust: owned by this user, writable by no one else.

An artifact cache holds pickles that its key signs, and the key sits beside them: whoever can
write the cache's folder can replace the key, sign an entry of their own and run code in every
process that loads from it. So, as OpenSSH's ``StrictModes`` and pip's cache-ownership check
do, hotswap uses a folder, key or lock only when

- it belongs to the effective uid of this process;
- neither group nor others may write it (a key: neither may read it either, mode 0600);
- every folder above it, every link on the way to it and the folder each link sits in, are
  ours or root's, and writable by others only with the sticky bit set (``/tmp``): otherwise
  someone could rename it away, or point a link elsewhere, and put their own in its place;
- below the cache's root, it is not a symbolic link (``lstat``; files opened ``O_NOFOLLOW``):
  a link would send reads, writes and removals outside the cache.

A check that fails raises ``UntrustedPath`` (a ``PermissionError``) naming the path, what is
wrong and the command that fixes it; callers then run without the cache.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path

__all__ = ["UntrustedPath", "check_private_dir", "check_root", "check_way", "create_secret",
           "ensure_private_dir", "open_private", "read_private"]

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class UntrustedPath(PermissionError):
    """A path another user could have written; hotswap does not use it. ``reason`` says why,
    ``fix`` how to make it usable."""

    def __init__(self, path: str | os.PathLike[str], reason: str, fix: str) -> None:
        super().__init__(f"{os.fspath(path)!r} {reason}; {fix}")
        self.path = os.fspath(path)
        self.reason = reason
        self.fix = fix


def _uid() -> int:
    return os.geteuid()


def _owner_problem(st: os.stat_result) -> str | None:
    if st.st_uid != _uid():
        return f"belongs to uid {st.st_uid}, not to this process's uid {_uid()}"
    return None


def _check(path: Path, st: os.stat_result, *, kind: str, open_bits: int, fix_mode: str) -> None:
    """``st`` (of ``path``) is a ``kind`` ("folder" or "file") that we own and that has none of
    ``open_bits``."""
    is_kind = stat.S_ISDIR(st.st_mode) if kind == "folder" else stat.S_ISREG(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        raise UntrustedPath(path, "is a symlink inside the cache",
                            f"remove it (rm {path}); hotswap makes its own")
    if not is_kind:
        raise UntrustedPath(path, f"is not a {kind}", f"remove it (rm -r {path})")
    owner = _owner_problem(st)
    if owner is not None:
        raise UntrustedPath(path, owner, "use a cache directory of your own (HOTSWAP_CACHE_DIR, "
                                         "cache_dir=, --cache-dir)")
    if st.st_mode & open_bits:
        raise UntrustedPath(path, f"is open to other users (mode {st.st_mode & 0o777:o})",
                            f"chmod {fix_mode} {path}")


def check_root(root: Path) -> Path:
    """The cache's root folder (links followed: ``~/.cache`` may point to another disk) and
    the folders above it; returns its real path, which the cache then uses, so that a link on
    the way cannot be pointed elsewhere later. Raises ``UntrustedPath``, or ``OSError`` if it
    cannot be read."""
    real = Path(os.path.realpath(root))
    _check(real, os.stat(real), kind="folder", open_bits=0o022, fix_mode="go-w")
    check_way(Path(os.path.abspath(root)).parent)
    return real


def check_way(folder: Path) -> None:
    """``folder`` and every folder above it, and every link on the way to it and the folder
    each link sits in: each must be this uid's or root's, and writable by others only with the
    sticky bit (``/tmp``). Whoever may rename an entry of one could swap what lies below for
    their own. Checked before a cache is made inside ``folder``, and for an existing one."""
    given = Path(os.path.abspath(folder))
    above = {Path(os.path.realpath(given)), *Path(os.path.realpath(given)).parents}
    for part in (given, *given.parents):
        if part.is_symlink():
            owner = os.lstat(part).st_uid
            if owner not in (0, _uid()):
                raise UntrustedPath(part, f"(a link on the way to the cache) belongs to uid "
                                          f"{owner}, who could point it elsewhere",
                                    "use a cache directory reached through folders of your own")
            holder = Path(os.path.realpath(part.parent))
            above.update((holder, *holder.parents))
    for path in sorted(above):
        st = os.stat(path)
        if st.st_uid not in (0, _uid()):
            raise UntrustedPath(path, f"(above the cache) belongs to uid {st.st_uid}, who "
                                      "could replace the cache inside it",
                                "use a cache directory under a folder of your own")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise UntrustedPath(path, f"(above the cache) is writable by other users "
                                      f"without the sticky bit (mode {st.st_mode & 0o7777:o})",
                                f"chmod go-w {path}, or choose a cache directory elsewhere")


def check_private_dir(path: Path) -> None:
    """A folder inside the cache: ours, not a link, writable by us alone."""
    _check(path, os.lstat(path), kind="folder", open_bits=0o022, fix_mode="go-w")


def ensure_private_dir(path: Path) -> None:
    """Make ``path`` (mode 0700) unless it exists, then check it as ``check_private_dir``."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    check_private_dir(path)


def open_private(path: Path, flags: int, *, secret: bool = False) -> int:
    """``os.open`` that never follows a link in the last component, and that refuses a file
    another user owns or may write (``secret``: or read). Creates files with mode 0600."""
    try:
        fd = os.open(path, flags | _O_NOFOLLOW | _O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UntrustedPath(path, "is a symlink inside the cache",
                                f"remove it (rm {path}); hotswap makes its own") from None
        raise
    try:
        _check(path, os.fstat(fd), kind="file", open_bits=0o077 if secret else 0o022,
               fix_mode="600")
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_secret(path: Path, size: int = 32) -> None:
    """Make ``path`` hold ``size`` random bytes (mode 0600) unless it exists: written whole
    under a temporary name, then linked into place, so that a process racing this one sees
    no file or a whole one, never an empty one (sixteen processes starting a compile service
    at once read a key file created and not yet written)."""
    if os.path.lexists(path):
        return
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".key-")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(size))
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        os.unlink(tmp)


def read_private(path: Path, *, secret: bool = False) -> bytes:
    """The bytes of a file inside the cache, checked as ``open_private``."""
    with os.fdopen(open_private(path, os.O_RDONLY, secret=secret), "rb") as f:
        return f.read()
