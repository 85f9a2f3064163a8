"""hotswap's own modules read as bytecode where Python would compile them at every start.

A process that writes no bytecode (PYTHONDONTWRITEBYTECODE=1 as uv-built containers often
set, or ``-B``) and finds none beside hotswap's sources (a source checkout, or an environment
installed without compiling) compiles every hotswap module it imports from source, at every
start: 95 of the 185 ms that ``import hotswap`` and ``hotswap.compile``'s imports took on a
2-core box. The modules imported later, on the load path's thread, hold the GIL for each
compile beside the user's calls.

Importing hotswap imports this module first, which then reads hotswap's modules, and only
hotswap's, from hotswap's bytecode cache (``bytecode.py``: the folder that the processes
hotswap starts use as PYTHONPYCACHEPREFIX, sources' paths mirrored below it). A module
without current bytecode there is compiled from source as before, and its bytecode written
there for the next process. The standard library's modules and torch's are left to Python:
a prefix for them would hide the ``__pycache__`` beside their sources.

Bytecode there is executed, so it is read only from a folder checked first: this user's,
writable by no one else, below folders no one else can swap (``hotswap.cache.trust``, as
the artifact cache it sits in), checked when this module is imported or, where it is not
made yet, made and checked by the first write (only inside an artifact cache that exists
already: importing hotswap makes no cache). Before each read or write it must still be that
folder (device and inode), ours and closed to others; one removed meanwhile is not made
again (the cache around it would come back with the umask's modes). Each file is checked as
Python checks bytecode (magic number, then the source's mtime and size, or its hash), and
named for the process's optimization level as Python names it (``.opt-1``, ``.opt-2``):
anything else is compiled from source, and written over under a temporary name.
HOTSWAP_PYCACHE=off turns it off.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import logging
import marshal
import os
import sys
import tempfile
import threading
import types
from collections.abc import Sequence
from pathlib import Path

from hotswap import settings
from hotswap.cache.root import default_cache_dir
from hotswap.cache.trust import check_private_dir, check_way

__all__ = ["bytecode_path", "cache_folder", "claim_folder", "counts", "current", "identity",
           "install", "still_ours"]

log = logging.getLogger("hotswap")

_PACKAGE = Path(__file__).resolve().parents[1]  # hotswap's sources


def cache_folder() -> Path | None:
    """Where this Python's bytecode cache lives (None: this Python caches no bytecode)."""
    tag = sys.implementation.cache_tag
    return default_cache_dir() / f"pycache-{tag}" if tag else None


def claim_folder(folder: Path) -> Path:
    """``folder``, made (0700) in the artifact cache and checked: its real path."""
    from hotswap.cache.root import claim_root
    from hotswap.cache.store import FORMAT_VERSION
    from hotswap.cache.trust import ensure_private_dir

    root = claim_root(folder.parent, FORMAT_VERSION)
    ensure_private_dir(root / folder.name)
    return root / folder.name


def bytecode_path(source: Path, prefix: str | None) -> Path:
    """Where a process reads ``source``'s bytecode: beside it, or mirrored under ``prefix`` (as
    ``importlib.util.cache_from_source`` does for ``sys.pycache_prefix``)."""
    name = f"{source.stem}.{sys.implementation.cache_tag}.pyc"
    folder = os.path.abspath(source.parent)
    if prefix:
        return Path(os.path.abspath(prefix), folder.lstrip(os.sep), name)
    return Path(folder, "__pycache__", name)


def current(source: Path, pyc: Path) -> bool:
    """Whether ``pyc`` is bytecode this Python would use for ``source`` as it is now."""
    try:
        with open(pyc, "rb") as f:
            head = f.read(16)
        return _fits(head, source, source.stat())
    except OSError:
        return False


def _fits(head: bytes, source: Path, st: os.stat_result) -> bool:
    """Whether a bytecode file's 16-byte header is this Python's for ``source`` as it is."""
    if len(head) < 16 or head[:4] != importlib.util.MAGIC_NUMBER:
        return False
    flags = int.from_bytes(head[4:8], "little")
    if flags & 0b01:  # hash-based: unchecked serves as it is, checked if the hash matches
        return not flags & 0b10 or head[8:16] == importlib.util.source_hash(source.read_bytes())
    return (int.from_bytes(head[8:12], "little") == int(st.st_mtime) & 0xFFFFFFFF
            and int.from_bytes(head[12:16], "little") == st.st_size & 0xFFFFFFFF)


def identity(folder: Path) -> tuple[int, int]:
    """``folder``'s (device, inode), links not followed."""
    st = os.lstat(folder)
    return st.st_dev, st.st_ino


def still_ours(folder: Path, made: tuple[int, int]) -> bool:
    """Whether ``folder`` is still the folder checked as ``made`` (``identity``), this user's
    and closed to others: not removed, replaced, given away or opened meanwhile."""
    try:
        if identity(folder) != made:
            return False
        check_private_dir(folder)
    except (OSError, ValueError):  # gone, or no longer ours alone
        return False
    return True


class _Loader(importlib.machinery.SourceFileLoader):
    """A hotswap module's loader: its code from the cache folder, else from its source (and
    then written to the folder)."""

    def get_code(self, fullname: str) -> types.CodeType:
        source = Path(self.get_filename(fullname))
        st = source.stat()  # before the source is read, as Python takes it
        folder = _state.checked()  # None: not made yet, gone, or no longer ours
        code = _read(_own_path(source, folder), source, st) if folder is not None else None
        if code is not None:
            _state.count("read")
            return code
        code = self.source_to_code(self.get_data(str(source)), str(source))
        _state.count("compiled")
        folder = folder or _state.claim()
        if folder is not None:
            _write(_own_path(source, folder), code, st)
        return code


def _own_path(source: Path, folder: Path) -> Path:
    """``source``'s bytecode in ``folder`` at this process's optimization level (``-O`` and
    ``-OO`` name theirs ``.opt-1`` and ``.opt-2``, as Python does: a plain name would serve
    docstring-less code to plain processes, and asserts to ``-O`` ones)."""
    return bytecode_path(source, str(folder)).with_name(
        os.path.basename(importlib.util.cache_from_source(str(source))))


def _read(pyc: Path, source: Path, st: os.stat_result) -> types.CodeType | None:
    try:
        data = pyc.read_bytes()
        if not _fits(data[:16], source, st):
            return None
        code = marshal.loads(memoryview(data)[16:])
    except (OSError, EOFError, ValueError, TypeError):  # missing, unreadable, cut short
        return None
    return code if isinstance(code, types.CodeType) else None


def _write(pyc: Path, code: types.CodeType, st: os.stat_result) -> None:
    """Writes ``code`` as timestamp-checked bytecode (Python's own format), whole or not at all.
    Folders are made only below the checked folder (mode 0700, unreachable to others)."""
    data = b"".join((importlib.util.MAGIC_NUMBER, bytes(4),
                     (int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little"),
                     (st.st_size & 0xFFFFFFFF).to_bytes(4, "little"), marshal.dumps(code)))
    part = None
    try:
        os.makedirs(pyc.parent, mode=0o700, exist_ok=True)
        fd, part = tempfile.mkstemp(prefix=f"{pyc.name}.", suffix=".tmp", dir=pyc.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(part, pyc)
    except OSError as e:  # a full disk, say: the next process compiles it again
        log.debug("hotswap: writing %s failed: %s", pyc, e)
        if part is not None:
            with contextlib.suppress(OSError):
                os.unlink(part)
    else:
        _state.count("written")


class _Finder:
    """Finds hotswap's submodules as Python's path finder does, with ``_Loader`` for sources."""

    @classmethod
    def find_spec(cls, name: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if path is None or not name.startswith("hotswap."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        loader = spec.loader if spec is not None else None
        if spec is not None and type(loader) is importlib.machinery.SourceFileLoader:
            spec.loader = _Loader(name, loader.path)
        return spec


class _State:
    """The folder and whether it is checked: read only once checked (at ``install``, or made
    and checked by the first write), and only while it is still the same folder, ours and
    closed to others (a folder removed meanwhile is not made again here: the cache it sits in
    would come back with the umask's modes)."""

    def __init__(self) -> None:
        self.folder: Path | None = None
        self.made: tuple[int, int] | None = None  # the checked folder's (device, inode)
        self.claiming = False  # making it imports the store, whose modules are not written
        self.lock = threading.Lock()
        self.counts = {"read": 0, "compiled": 0, "written": 0}

    def count(self, what: str) -> None:
        with self.lock:
            self.counts[what] += 1

    def checked(self) -> Path | None:
        folder, made = self.folder, self.made
        if folder is None or made is None:
            return None
        if not still_ours(folder, made):
            self.folder = self.made = None  # for good: this process compiles from here on
            return None
        return folder

    def mark(self, folder: Path) -> None:
        self.folder, self.made = folder, identity(folder)

    def claim(self) -> Path | None:
        """Makes the folder where the cache it sits in exists already (importing hotswap
        makes no cache), once per process; None where it is not made."""
        with self.lock:
            folder = self.folder
            if folder is None or self.made is not None or self.claiming:
                return self.checked() if self.made is not None else None
            self.claiming = True
        try:  # outside the lock: it imports the store
            made = claim_folder(folder) if folder.parent.is_dir() else None
            if made is not None:
                self.mark(made)
        except (OSError, ValueError) as e:  # trust.UntrustedPath is a PermissionError
            log.debug("hotswap's own bytecode is not written: %s", e)
            made = None
        if made is None:
            self.folder = None  # nothing to read or write in this process
        self.claiming = False
        return made


_state = _State()


def counts() -> dict[str, int]:
    """This process's hotswap modules read from the cache, compiled from source, and written
    there (all zero where ``install`` left Python alone)."""
    with _state.lock:
        return dict(_state.counts)


def install() -> Path | None:
    """Reads hotswap's modules from the cache from now on, where that changes nothing but
    speed (see the module's text). Returns the folder, or None where Python is left alone.
    Never raises."""
    if any(f is _Finder for f in sys.meta_path):
        return _state.folder
    if not sys.dont_write_bytecode or sys.pycache_prefix is not None:
        return None  # Python writes bytecode (beside the sources, or under the prefix)
    own = _PACKAGE / "__init__.py"
    if current(own, bytecode_path(own, None)):
        return None  # installed with bytecode
    try:
        if settings.pycache() == "off":
            return None
        folder = cache_folder()
        if folder is None:
            return None
        _state.folder = folder
        if folder.exists():
            check_private_dir(folder)
            check_way(folder.parent)
            _state.mark(folder)
    except (OSError, ValueError) as e:  # a bad HOTSWAP_PYCACHE is said at compile()
        log.debug("hotswap's own bytecode is not read: %s", e)
        _state.folder = _state.made = None
        return None
    sys.meta_path.insert(0, _Finder)
    return folder


install()
