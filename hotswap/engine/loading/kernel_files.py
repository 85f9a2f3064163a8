"""The files a compile leaves in inductor's cache, and how they travel with its artifact.

Inductor bundles triton kernels into a saved artifact, not C++ ones: a C++ kernel is a library
in inductor's cache directory, looked up at load by a key of its source and compiler flags. A
worker's entry therefore carries the files its compile wrote there (``compile_outputs``), and
a process that lacks them restores them (``restore``) instead of running the compiler.

Inductor's precompiled C++ headers are the exception to "in its cache directory": they live
under its *default* one (``<temp>/torchinductor_<user>/precompiled_headers``) whatever
TORCHINDUCTOR_CACHE_DIR says, are shared by every kernel built with the same flags, and are
large (149 MiB on x86). An entry carries those its compile or its worker's warm-up built, as
``precompiled_headers/<name>``, and a load puts them back there.

Both folders are, by default, ``/tmp/torchinductor_<user>``, a name anyone can take first. The
cache signs what an entry carries, so nothing another user could have written rides in one: a
folder shipped from or restored into must be this user's and writable by no one else, with a
trusted way to it (``cache/trust.py``), and each file shipped must be a regular file this user
owns that no one else may write. What fails is left out, with one warning per folder; the
loading process then compiles what its entry lacks.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import logging
import os
import re
import stat
import sys
import tempfile
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path

from hotswap.cache.trust import UntrustedPath, check_root, check_way
from hotswap.compat import Buffer
from hotswap.executors.local import inductor_cache_dir

__all__ = [
    "HEADERS_DIR",
    "compile_outputs",
    "damaged_library",
    "files_written_since",
    "header_finished",
    "header_in_place",
    "headers_dir",
    "headers_written_since",
    "inductor_cache_dir",
    "libraries_built_from",
    "remove_cut_short_headers",
    "restore",
    "restore_files",
    "trusted_folder",
    "write_new",
]

log = logging.getLogger("hotswap")

# How an entry names the folder of inductor's precompiled headers (see headers_dir()).
HEADERS_DIR = "precompiled_headers"

# Inductor's own cache entries (FX graph and AOTAutograd): the artifact carries what they hold
# and writes them on load. Shipped as files too, a max-autotune tier on GPU sent the same 8 MiB
# twice, and another worker's entries written meanwhile rode along.
_CACHE_ENTRY_DIRS = ("fxgraph", "aotautograd")
# Triton's intermediate forms of a kernel, which its cache (inductor's ``triton/`` unless
# TRITON_CACHE_DIR says otherwise) keeps beside the binary: loading a kernel reads only the
# binary and its metadata, and a max-autotune tier on GPU shipped 13.9 MiB of these.
_TRITON_IR = (".ttir", ".ttgir", ".llir", ".ptx", ".source")


def files_written_since(root: str, since_s: float, max_bytes: int = 256 * 2**20
                        ) -> dict[str, bytes]:
    """Files under ``root`` modified at or after ``since_s`` (relative path -> bytes): what a
    compile added to inductor's cache (its kernels: C++ libraries, sources, triton binaries).
    Lock and temporary files, inductor's own cache entries, triton's intermediate forms and
    precompiled headers (``headers_written_since``) are skipped."""
    found: dict[str, bytes] = {}
    total = 0
    triton = os.path.join(root, "triton") + os.sep
    for dirpath, dirnames, names in os.walk(root):
        if dirpath == root:
            dirnames[:] = [d for d in dirnames if d not in (*_CACHE_ENTRY_DIRS, HEADERS_DIR)]
        in_triton = (dirpath + os.sep).startswith(triton)
        for name in names:
            if (name.endswith((".lock", ".tmp")) or name.startswith(".")
                    or (in_triton and name.endswith(_TRITON_IR))):
                continue
            path = os.path.join(dirpath, name)
            try:
                if os.stat(path).st_mtime < since_s:
                    continue
            except OSError:
                continue
            data = _read_ours(path)
            if data is None:
                continue
            total += len(data)
            if total > max_bytes:
                return found  # ship what fits; the loader compiles what is missing
            found[os.path.relpath(path, root)] = data
    return found


def libraries_built_from(root: str, sources: Iterable[str]) -> dict[str, bytes]:
    """The libraries built from C++ ``sources`` under ``root`` (``<key>*.so`` beside each
    ``<key>*.cpp``), relative path -> bytes, whenever they were built."""
    found: dict[str, bytes] = {}
    for source in set(sources):
        folder, name = os.path.split(source)
        key = name.split(".", 1)[0]
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for other in names:
            if other.startswith(key + ".") and other.endswith(".so"):
                path = os.path.join(folder, other)
                rel = os.path.relpath(path, root)
                data = None if rel.startswith("..") else _read_ours(path)
                if data is not None:
                    found[rel] = data
    return found


def headers_dir() -> str:
    """Where inductor keeps its precompiled C++ headers: under its default cache directory,
    whatever TORCHINDUCTOR_CACHE_DIR says."""
    from torch._inductor import codecache

    found = getattr(codecache, "_HEADER_DIR", None)
    if isinstance(found, str):
        return found
    for name in ("torch._inductor.runtime.cache_dir_utils",
                 "torch._inductor.runtime.runtime_utils"):
        with contextlib.suppress(ImportError, AttributeError):
            return os.path.join(importlib.import_module(name).default_cache_dir(), HEADERS_DIR)
    raise RuntimeError("cannot find inductor's precompiled headers in this torch version")


# How a precompiled header gcc finished begins ("gpch" and its flavour and version). gcc writes
# "gpcWrite" there first and the real mark once it is done: a build killed halfway leaves that.
_GCC_PCH_MARK = b"gpch"


def _cut_short(path: str) -> bool:
    """Whether ``path`` is a precompiled header gcc did not finish (a .gch without its mark)."""
    if not path.endswith(".gch"):
        return False
    try:
        with open(path, "rb") as f:
            return f.read(len(_GCC_PCH_MARK)) != _GCC_PCH_MARK
    except OSError:
        return False


def header_finished(path: str) -> bool:
    """Whether the precompiled header at ``path`` is there, whole (not one a build left cut
    short, which gcc takes for no header)."""
    return os.path.isfile(path) and not _cut_short(path)


def remove_cut_short_headers() -> list[str]:
    """Remove the precompiled headers whose build was killed halfway (a process's exit, a
    kill of its compiler); returns them. Inductor builds a header only where none is there, and
    gcc takes one it did not finish for no header at all: every later C++ kernel on the machine
    (any process's, torch.compile's too) would parse inductor's headers in full, about twice
    its compile time on the 2-core box. A header is looked at under inductor's lock for it, so
    none being built is touched; nothing in a folder another user could write."""
    from filelock import FileLock, Timeout

    folder = headers_dir()
    removed: list[str] = []
    try:
        names = [name for name in os.listdir(folder) if name.endswith(".gch")]
    except OSError:
        return removed
    if not names or not trusted_folder(folder):
        return removed
    for name in names:
        path = os.path.join(folder, name)
        if not _cut_short(path):
            continue
        lock = os.path.join(folder, "locks", name.split(".", 1)[0] + ".lock")  # inductor's
        try:
            with FileLock(lock, timeout=0):
                if _cut_short(path):
                    os.unlink(path)
                    removed.append(path)
        except (Timeout, OSError):
            continue  # being built now, or gone
    if removed:
        log.warning("hotswap: removed %d precompiled header(s) whose build was cut short, to "
                    "be built again: %s", len(removed), ", ".join(removed))
    return removed


def headers_written_since(since_s: float, max_bytes: int = 512 * 2**20) -> dict[str, bytes]:
    """Inductor's precompiled headers (and the headers they were built from) written at or
    after ``since_s``, as ``precompiled_headers/<name>`` -> bytes."""
    found: dict[str, bytes] = {}
    total = 0
    folder = headers_dir()
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return found
    for name in names:
        path = os.path.join(folder, name)
        if name.endswith((".lock", ".tmp")) or name.startswith(".") or _cut_short(path):
            continue
        try:
            st = os.stat(path)
            if st.st_mtime < since_s or not stat.S_ISREG(st.st_mode):
                continue
            if total + st.st_size > max_bytes:
                break
        except OSError:
            continue
        data = _read_ours(path)
        if data is not None:
            found[f"{HEADERS_DIR}/{name}"] = data
            total += len(data)
    return found


def compile_outputs(sources: Iterable[str], since_s: float,
                    headers_since_s: float | None = None) -> dict[str, bytes]:
    """What a compile's entry ships from inductor's cache: the libraries built from its C++
    ``sources`` (whenever they were built), every file it added since ``since_s``, and the
    precompiled headers built since then or since ``headers_since_s`` (a worker's warm-up,
    whose headers a load needs and whose own kernels it does not)."""
    root = inductor_cache_dir()
    headers_s = since_s if headers_since_s is None else min(since_s, headers_since_s)
    files: dict[str, bytes] = {}
    if trusted_folder(root):
        files.update({**libraries_built_from(root, sources), **files_written_since(root, since_s)})
    if trusted_folder(headers_dir()):
        files.update(headers_written_since(headers_s))
    return files


def restore(files: Mapping[str, Buffer]) -> int:
    """``restore_files`` of an entry's files: its kernels into inductor's cache directory, its
    precompiled headers where inductor looks for them (``headers_dir``)."""
    prefix = HEADERS_DIR + "/"
    headers = {k: v for k, v in files.items() if k.startswith(prefix)}
    kernels = {k: v for k, v in files.items() if not k.startswith(prefix)}
    written = 0
    if kernels and trusted_folder(root := inductor_cache_dir(), to_make=True):
        written += restore_files(root, kernels)
    if headers and trusted_folder(os.path.dirname(folder := headers_dir()), to_make=True):
        written += restore_files(os.path.dirname(folder), headers)
    return written


_warned: set[str] = set()


def trusted_folder(folder: str, *, to_make: bool = False) -> bool:
    """Whether inductor's ``folder`` may be shipped from or restored into: this user's, no one
    else may write it or rename it away (``trust.check_root``). One warning per folder that is
    not. A folder that is not there has nothing to ship; with ``to_make`` (a restore, which
    makes it with this user's umask) the way to it is checked instead (``trust.check_way``:
    the folders above are this user's or root's, and writable by others only with the sticky
    bit, as ``/tmp`` is)."""
    path = Path(folder)
    try:
        if to_make and not os.path.lexists(path):
            while not os.path.lexists(path) and path != path.parent:
                path = path.parent
            check_way(path)
        else:
            check_root(path)
        return True
    except FileNotFoundError:
        return False
    except (UntrustedPath, OSError) as e:
        if folder not in _warned:
            _warned.add(folder)
            log.warning("hotswap: inductor's folder %s is not trusted (%s): entries neither "
                        "carry its files nor restore into it, and loads compile their C++ "
                        "kernels again", folder, e)
        return False


def _read_ours(path: str) -> bytes | None:
    """The bytes of ``path`` where it is a regular file (not a link) of this user that no one
    else may write; None otherwise (one warning per process for a file of another user or one
    open to others: a umask of 002 makes inductor's files group-writable)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            if "file" not in _warned:
                _warned.add("file")
                log.warning("hotswap: %s is not shipped in a cache entry: it belongs to uid %d "
                            "or others may write it (mode %o); loads compile what it held "
                            "again",
                            path, st.st_uid, st.st_mode & 0o777)
            return None
        try:
            return f.read()
        except OSError:
            return None


def restore_files(root: str, files: Mapping[str, Buffer]) -> int:
    """Write shipped cache files that ``root`` lacks; returns how many. A file that is there
    whole is never written again (a warm load on a full disk writes nothing); one of another
    size (named for its content: cut short, as a library a killed compile was linking) is
    replaced. A write that fails or is cut off leaves no partial or temporary file behind."""
    written = 0
    real_root = os.path.realpath(root)
    for rel, data in files.items():
        path = os.path.realpath(os.path.join(root, rel))
        if not path.startswith(real_root + os.sep) or _whole(path, data):
            continue  # never outside the cache dir; never over an existing whole file
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_new(path, data, 0o755 if path.endswith(".so") else 0o644)
        written += 1
    return written


def _whole(path: str, data: Buffer) -> bool:
    return _of_size(path, memoryview(data).nbytes)


def _of_size(path: str, size: int) -> bool:
    try:
        return os.path.getsize(path) == size
    except OSError:
        return False


def header_in_place(rel: str, size: int) -> bool:
    """Whether the precompiled header an entry ships as ``rel`` is where inductor looks for
    it, whole (``restore`` would leave it as it is): its bytes need not be read. False where
    that cannot be told without importing inductor (its ``codecache``, which a dynamo trace
    imports, not imported yet: an import on the reading thread would hold the GIL)."""
    if not rel.startswith(HEADERS_DIR + "/") or "torch._inductor.codecache" not in sys.modules:
        return False
    try:
        root = os.path.dirname(headers_dir())
    except Exception:  # a torch that keeps them elsewhere: read them
        return False
    path = os.path.realpath(os.path.join(root, rel))
    return path.startswith(os.path.realpath(root) + os.sep) and _of_size(path, size)


# A library the dynamic loader refuses as cut short or garbled (glibc's messages).
_DAMAGED = re.compile(r"(/\S+\.so): (?:file too short|invalid ELF header|ELF load command "
                      r"(?:past end of file|address/offset not (?:properly aligned|page-aligned))"
                      r"|cannot read file data)")


def damaged_library(error: BaseException) -> str | None:
    """The path of a kernel library in inductor's cache that ``error`` (or an error it was
    raised from) says the loader refused as damaged, or None. Only a file inside inductor's
    cache directory, that is there, is named."""
    root = os.path.realpath(inductor_cache_dir())
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for match in _DAMAGED.finditer(str(current)):
            path = os.path.realpath(match.group(1))
            if path.startswith(root + os.sep) and os.path.isfile(path):
                return path
        current = current.__cause__ or current.__context__
    return None


# Temporary files being written now: the loader is a daemon thread, which interpreter exit
# stops wherever it is, and a file it was writing then stayed for good. Removed at exit.
_pending: set[str] = set()
_pending_lock = threading.Lock()


@atexit.register
def _remove_pending() -> None:
    with _pending_lock:
        for tmp in list(_pending):
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def write_new(path: str, data: Buffer, mode: int) -> None:
    """Create ``path`` holding ``data`` whole (a temporary file renamed into place); a write
    that fails (a full disk) or is cut off at exit leaves no temporary file behind."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".hotswap-")
    with _pending_lock:
        _pending.add(tmp)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    finally:
        with _pending_lock:
            _pending.discard(tmp)
