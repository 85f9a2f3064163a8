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

Bytecode there is executed, so it is read only from a folder that is this user's, writable
by no one else, below folders no one else can swap (``hotswap.cache.trust``, as the artifact
cache it sits in; where the folder is not made yet, the first write makes it as the cache
makes its own). Each file is checked as Python checks bytecode (magic number, then the
source's mtime and size, or its hash): anything else is compiled from source.
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
import threading
import types
from collections.abc import Sequence
from pathlib import Path

from hotswap import settings
from hotswap.cache.root import default_cache_dir
from hotswap.cache.trust import check_private_dir, check_way

__all__ = ["bytecode_path", "cache_folder", "claim_folder", "counts", "current", "install"]

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


class _Loader(importlib.machinery.SourceFileLoader):
    """A hotswap module's loader: its code from the cache folder, else from its source (and
    then written to the folder)."""

    def get_code(self, fullname: str) -> types.CodeType:
        source = Path(self.get_filename(fullname))
        st = source.stat()  # before the source is read, as Python takes it
        folder = _state.folder
        pyc = bytecode_path(source, str(folder)) if folder is not None else None
        code = _read(pyc, source, st) if pyc is not None else None
        if code is not None:
            _state.count("read")
            return code
        code = self.source_to_code(self.get_data(str(source)), str(source))
        _state.count("compiled")
        if pyc is not None:
            _write(pyc, code, st)
        return code


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
    """Writes ``code`` as timestamp-checked bytecode (Python's own format), whole or not at all."""
    if not _state.writable():
        return
    data = b"".join((importlib.util.MAGIC_NUMBER, bytes(4),
                     (int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little"),
                     (st.st_size & 0xFFFFFFFF).to_bytes(4, "little"), marshal.dumps(code)))
    part = pyc.with_name(f"{pyc.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        pyc.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(part, pyc)
    except OSError as e:  # a full disk, say: the next process compiles it again
        log.debug("hotswap: writing %s failed: %s", pyc, e)
        with contextlib.suppress(OSError):
            part.unlink()
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
    def __init__(self) -> None:
        self.folder: Path | None = None
        self.made = False  # whether the folder exists (else the first write makes it)
        self.claiming = False  # making it imports the store, whose modules are not written
        self.lock = threading.RLock()
        self.counts = {"read": 0, "compiled": 0, "written": 0}

    def count(self, what: str) -> None:
        with self.lock:
            self.counts[what] += 1

    def writable(self) -> bool:
        with self.lock:
            if self.made or self.folder is None or self.claiming:
                return self.made
            self.claiming = True
            try:
                self.folder = claim_folder(self.folder)
                self.made = True
            except (OSError, ValueError) as e:  # trust.UntrustedPath is a PermissionError
                log.debug("hotswap's own bytecode is not written: %s", e)
                self.folder = None  # nothing to read either: the finder's loads compile
            finally:
                self.claiming = False
            return self.made


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
        if folder.exists():
            check_private_dir(folder)
            check_way(folder.parent)
            _state.made = True
    except (OSError, ValueError) as e:  # a bad HOTSWAP_PYCACHE is said at compile()
        log.debug("hotswap's own bytecode is not read: %s", e)
        return None
    _state.folder = folder
    sys.meta_path.insert(0, _Finder)
    return folder


install()
