"""Python bytecode for the processes hotswap starts: compiled once, read by every later start.

Python reads a module's bytecode from the ``__pycache__`` folder beside its source, and writes
it there after compiling the source. An environment installed without bytecode whose
processes may not write it (PYTHONDONTWRITEBYTECODE=1, as uv-built containers often set, or a
read-only site-packages) compiles every module it imports from source at every start: on a
GPU machine ~5 s for torch and ~10 s more for inductor, most of a fresh compile worker's
first 10 s (``scripts/bytecode_check.py`` measures it).

So the processes hotswap starts (compile workers, the compile service and its workers, a local
Dask cluster) get a bytecode cache of hotswap's own::

    <cache dir>/pycache-<implementation>-<version>/     mode 0700; PYTHONPYCACHEPREFIX of each
        <source folder, mirrored>/<module>.<tag>.pyc    written by the first process, read by
                                                        every later one

``child_env`` sets ``PYTHONPYCACHEPREFIX`` to it and drops ``PYTHONDONTWRITEBYTECODE``
(HOTSWAP_PYCACHE: ``auto``, the default, where a process started with that environment would
otherwise recompile torch's sources at every start and the environment names no
PYTHONPYCACHEPREFIX of its own; ``on``: always; ``off``: never). The caller's own process
writes nothing of torch's there, ``-B`` included (a flag, not passed on to the processes
hotswap starts; hotswap's own modules are ``own_bytecode.py``'s). But where it writes no
bytecode anyway (``sys.dont_write_bytecode``) and has none of torch's, ``read_for_imports``
points the load path's own imports at that folder (``sys.pycache_prefix``, for those imports
alone): inductor's modules, which the load path imports while the user's calls run, then
come as bytecode instead of being compiled from source holding the GIL (the
serving process's stalls of 400-750 ms on the GPU machine).

On a machine of many cores, the first process ever also fills that folder in parallel
(``bytecode_fill.py``) while its first worker starts.

Bytecode in that folder is executed: it is used only if the folder is this user's, writable
by no one else, below folders no one else can swap (``hotswap.cache.trust``, as the artifact
cache it sits in). Otherwise the processes start as before and hotswap says why, once.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hotswap import settings
from hotswap.cache.root import default_cache_dir
from hotswap.cache.trust import check_private_dir, check_way
from hotswap.system.own_bytecode import bytecode_path, cache_folder, claim_folder, current

__all__ = ["MIN_CPUS", "PACKAGES", "PREFIX_ENV", "SOURCE_BYTES_JOB", "Bytecode", "bytecode_path",
           "cache_folder", "child_env", "claim_folder", "clear_folder", "compile_rate", "current",
           "fill_list", "filler", "imported_source_bytes", "offer", "offer_templates",
           "offered_templates", "plan", "probe_sources", "read_for_imports", "recompile_reason",
           "side_folders", "templates_folder", "usage"]

log = logging.getLogger("hotswap")

PREFIX_ENV = "PYTHONPYCACHEPREFIX"
SOURCE_BYTES_JOB = "hotswap.system.bytecode:imported_source_bytes"
_NO_WRITE_ENV = "PYTHONDONTWRITEBYTECODE"
_noted: set[str] = set()  # refusals said once per process


@dataclass(frozen=True)
class Bytecode:
    """What ``plan`` decided for the processes started with one environment."""

    setting: str             # HOTSWAP_PYCACHE: auto, on or off
    recompiles: str | None   # why such a process compiles torch's sources at every start
    folder: Path | None      # hotswap's bytecode cache, when they use it
    note: str | None = None  # why they do not, when they do not


def templates_folder() -> Path | None:
    """Where this Python's compiled kernel templates live (engine/loading/templates.py),
    neither made nor checked (None: this Python keeps no bytecode, or HOTSWAP_PYCACHE is off).
    The compile service names its workers' folder in its status."""
    tag = sys.implementation.cache_tag
    try:
        return default_cache_dir() / f"templates-{tag}" if tag and \
            settings.pycache() != "off" else None
    except ValueError:  # a HOTSWAP_PYCACHE of no known value: the templates say why
        return None


def probe_sources() -> list[Path]:
    """The sources whose bytecode says whether a worker's start recompiles: torch's first
    module and inductor's compile_fx (found without importing torch)."""
    module = sys.modules.get("torch")
    origin = getattr(module, "__file__", None)
    if origin is None:
        spec = importlib.util.find_spec("torch")
        origin = spec.origin if spec is not None else None
    if not origin or not origin.endswith(".py"):
        return []
    torch_dir = Path(origin).parent
    return [p for p in (torch_dir / "__init__.py", torch_dir / "_inductor" / "compile_fx.py")
            if p.is_file()]


def _writable(pyc: Path) -> bool:
    """Whether a process may write ``pyc`` (Python makes the folders it lacks)."""
    folder = pyc.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return os.access(folder, os.W_OK)


def recompile_reason(env: Mapping[str, str]) -> str | None:
    """Why a Python process started with ``env`` compiles torch's sources at every start
    (None: it reads bytecode, or writes it for the next start)."""
    prefix = env.get(PREFIX_ENV) or None
    missing = [s for s in probe_sources() if not current(s, bytecode_path(s, prefix))]
    if not missing:
        return None
    where = f"in {PREFIX_ENV} ({prefix})" if prefix else "beside them"
    if env.get(_NO_WRITE_ENV):
        return f"{_NO_WRITE_ENV} is set and torch's modules have no bytecode {where}"
    if not all(_writable(bytecode_path(s, prefix)) for s in missing):
        return f"torch's modules have no bytecode {where}, and it cannot be written there"
    return None


def plan(env: Mapping[str, str]) -> Bytecode:
    """Whether the processes started with ``env`` use hotswap's bytecode cache (made here,
    and checked, when they do). Never raises: a cache that cannot be used is a note."""
    recompiles = recompile_reason(env)
    try:
        setting = settings.pycache()
    except ValueError as e:
        return Bytecode("auto", recompiles, None, _say_once(f"not used: {e}"))
    ours = cache_folder()
    prefix = env.get(PREFIX_ENV) or None
    mine = (ours is not None and prefix is not None  # the compile service's workers
            and os.path.realpath(prefix) == os.path.realpath(ours))
    if ours is None:
        return Bytecode(setting, recompiles, None, "not used: this Python keeps no bytecode")
    if setting == "off":
        return Bytecode(setting, recompiles, None, "not used: turned off")
    if setting == "auto" and not mine:
        if prefix is not None:
            return Bytecode(setting, recompiles, None, f"not used: {PREFIX_ENV} is set "
                                                       f"({prefix}), and hotswap keeps it")
        if recompiles is None:
            return Bytecode(setting, recompiles, None, "not needed: fresh processes read "
                                                       "bytecode")
    try:
        return Bytecode(setting, recompiles, claim_folder(ours))
    except (OSError, ValueError) as e:  # trust.UntrustedPath is a PermissionError
        return Bytecode(setting, recompiles, None, _say_once(
            f"not used: {e}; the processes hotswap starts compile Python sources as before"))


# How long a child compiling the load path's bytecode may take before this process goes on.
COMPILE_CHILD_S = 300.0


@contextlib.contextmanager
def read_for_imports(modules: Sequence[str] = ()) -> Iterator[Path | None]:
    """Inside the block, this process reads bytecode from hotswap's cache (``sys.pycache_prefix``,
    restored after), where that changes nothing but speed: it writes no bytecode
    (``sys.dont_write_bytecode``), names no prefix of its own, and would compile torch's
    modules from source (``plan``). Yields the folder, or None where nothing changed. Only
    the block's own imports are meant (a prefix also hides the ``__pycache__`` beside every
    source, the standard library's too), and nothing is written by this process.

    ``modules``: what the block imports. Where their bytecode is not in the cache yet (the
    first process ever), the compile service's folder serves if it has it (``offer``: its
    workers wrote it; waited for while they are still writing it); else a child process
    imports them first, writing it (``child_env``), and this thread waits for it: compiling a
    large module holds the GIL for its whole compile (inductor's imports from source stalled
    the serving process's calls by 400-750 ms on the GPU machine), a child holds none of this
    process's. A child still running at exit is killed."""
    global _readers
    with _readers_lock:  # blocks on several threads at once (the warm-up's and triton's)
        joined = Path(sys.pycache_prefix) if _readers and sys.pycache_prefix else None
        if joined is not None:  # the prefix another block set: read it too
            _readers += 1
        else:  # decided here, where no block of ours has set a prefix
            reading = _reading_folder()
    if joined is not None:
        folder = joined
    else:
        if reading is None:
            yield None
            return
        folder = _with_bytecode(reading, modules)
        with _readers_lock:
            if _readers == 0:
                sys.pycache_prefix = str(folder)
            _readers += 1
    try:
        if joined is not None:
            _with_bytecode(folder, modules)  # written for this block's imports too
        yield Path(sys.pycache_prefix or folder)
    finally:
        with _readers_lock:
            _readers -= 1
            if _readers == 0:
                sys.pycache_prefix = None


_readers_lock = threading.Lock()
_readers = 0  # blocks inside read_for_imports now: the last one out puts the prefix back
_compiling = threading.Lock()  # one child at a time writes the folder


def _with_bytecode(folder: Path, modules: Sequence[str]) -> Path:
    """The folder to read ``modules`` from: ``folder`` where it has torch's bytecode, else the
    compile service's where that has it, else ``folder`` once a child has written it there.
    Either is waited for while other processes are writing it (``_written_through``): this
    process's own is the one its workers write, and the compile service's too where this
    process started the service (it starts with this process's environment). Read as soon
    as compile_fx's bytecode was there, ir.py (351 KB) was compiled from source in the
    serving process beside the user's calls: a 54 ms stall (the first process ever, ViT and
    ResNet-18, H100)."""
    if not modules or _written_through(folder):
        return folder
    with _compiling:  # a block beside this one may have written it meanwhile
        if _written_through(folder, wait=False):  # waited for above already
            return folder
        served = next((f for f in list(_offered) if _trusted(f) and _written_through(f)),
                      None)
        if served is not None:
            return served  # the compile service's: already written, and checked
        _compile_in_a_child(modules)
    return folder


# Bytecode folders of this build's compile service (its status names the one it and its
# workers read): the load path reads one of them where this process's own has none yet.
_offered: list[Path] = []


def offer(folder: str | os.PathLike[str]) -> None:
    """A bytecode folder this process may read for its load path's imports instead of
    compiling them in a child (``read_for_imports``): the compile service's, which its
    workers filled. Checked when used, as the cache's own: this user's, writable by no one
    else, below folders no one else can swap."""
    path = Path(folder)
    if path not in _offered:
        _offered.append(path)


# Template folders of this build's compile service (its status names the one its workers
# write): engine/loading/templates.py reads a template this process's own folder lacks from
# one of them.
_offered_templates: list[Path] = []


def offer_templates(folder: str | os.PathLike[str]) -> None:
    """A template folder this process may read what its own lacks from (checked when used)."""
    path = Path(folder)
    if path not in _offered_templates:
        _offered_templates.append(path)


def offered_templates() -> list[Path]:
    return list(_offered_templates)


def _trusted(folder: Path) -> bool:
    try:
        check_private_dir(folder)
        check_way(folder.parent)
    except (OSError, ValueError) as e:  # UntrustedPath is a PermissionError
        _say_once(f"not read from the compile service: {e}")
        return False
    return True


# Inductor's modules that compile_fx imports as it starts (compile_fx -> graph -> ir,
# lowering; ir.py alone is 350-410 KB of source). A folder another process is filling (the
# compile service's workers, starting beside this process) holds compile_fx's bytecode before
# theirs: Python writes a module's bytecode before it runs the module's imports. Read that
# early, ir.py was compiled from source in the serving process, a 55 ms stall beside the
# user's calls (GPT-2, the first process ever, H100).
_LARGEST = ("graph.py", "ir.py", "lowering.py")


def _largest_sources(probed: list[Path]) -> list[Path]:
    """Those of ``_LARGEST`` this torch has, beside the probed compile_fx."""
    inductor = next((p.parent for p in probed if p.name == "compile_fx.py"), None)
    largest = [inductor / name for name in _LARGEST] if inductor is not None else []
    return [p for p in largest if p.is_file()]


# How long the load path waits for a folder that is still being written, at most, and without
# a module's bytecode appearing in it (then a child writes this process's own).
SERVED_WAIT_S = 30.0
SERVED_STALL_S = 5.0


def _written_through(folder: Path, *, wait: bool = True) -> bool:
    """Whether a bytecode folder has the probed modules' bytecode and that of
    ``_largest_sources``: where it has begun (the probed modules are there) but not all of
    it, workers are writing it now (the compile service's, or this process's own pool's),
    and this waits while they make progress (``wait=False``: it looks once)."""
    probed = probe_sources()
    sources = probed + _largest_sources(probed)
    start = since = time.monotonic()
    seen = -1
    while True:
        there = [current(s, bytecode_path(s, str(folder))) for s in sources]
        if all(there):
            return True
        now = time.monotonic()
        if not wait or not all(there[:len(probed)]) or now - start >= SERVED_WAIT_S:
            return False
        if (count := sum(there)) > seen:
            seen, since = count, now
        elif now - since >= SERVED_STALL_S:
            return False
        time.sleep(0.1)


def _reading_folder() -> Path | None:
    if not sys.dont_write_bytecode or sys.pycache_prefix is not None:
        return None
    found = plan(os.environ)
    return found.folder if found.recompiles is not None else None


_children: set[subprocess.Popen[bytes]] = set()


@atexit.register
def _kill_children() -> None:
    for child in list(_children):
        with contextlib.suppress(OSError):
            child.kill()


def _compile_in_a_child(modules: Sequence[str]) -> None:
    code = "".join(f"import {m}\n" for m in modules)
    try:
        child = subprocess.Popen([sys.executable, "-c", code], env=child_env(dict(os.environ)),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError as e:
        log.debug("hotswap: compiling the load path's bytecode in a child failed: %s", e)
        return
    _children.add(child)
    try:
        child.wait(timeout=COMPILE_CHILD_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    finally:
        _children.discard(child)


def _say_once(note: str) -> str:
    if note not in _noted:
        _noted.add(note)
        log.warning("hotswap's bytecode cache is %s", note)
    return note


def child_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a process hotswap starts, with its bytecode cache where ``plan`` says so
    (a new dict then; else ``env`` itself)."""
    folder = plan(env).folder
    if folder is None:
        return env
    own = {k: v for k, v in env.items() if k != _NO_WRITE_ENV}
    own[PREFIX_ENV] = str(folder)
    _start_filling(folder, own)
    return own


# A filler (bytecode_fill.py) only where this many cores are usable (affinity, the cgroup's
# quota): on fewer it would take them from the user's process.
MIN_CPUS = 8
# The packages a compile imports, whose sources a filler compiles after this process's own.
PACKAGES = ("torch", "triton", "sympy", "mpmath", "jinja2", "networkx")
# The filler this process started, if any: one per process at most.
filler: subprocess.Popen[bytes] | None = None
_filler_lock = threading.Lock()


def fill_list() -> list[str]:
    """What a filler compiles: the sources of this process's modules in import order, where
    they are Python's or an installed package's, then the folders of the packages a compile
    imports (bytecode_fill.py)."""
    folders = []
    for name in PACKAGES:
        with contextlib.suppress(ImportError, ValueError):  # found, not imported
            spec = importlib.util.find_spec(name)
            folders += list(spec.submodule_search_locations or []) if spec is not None else []
    roots = tuple(os.path.join(os.path.abspath(r), "") for r in
                  {sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path[1:], *folders} if r)
    files = [f for m in list(sys.modules.values())
             if isinstance(f := getattr(m, "__file__", None), str) and f.endswith(".py")
             and os.path.abspath(f).startswith(roots)]
    return files + folders


def _start_filling(folder: Path, env: dict[str, str]) -> None:
    """Starts a filler of ``folder`` where a many-core machine's first worker would compile
    torch's sources one after another (bytecode_fill.py). Never raises."""
    global filler
    try:
        from hotswap.system.bytecode_fill import cores  # its pool's imports: not at import

        with _filler_lock:
            if filler is not None or cores() < MIN_CPUS or _written_through(folder, wait=False):
                return
            listing = "\n".join(fill_list()).encode()
            filler = subprocess.Popen(
                [sys.executable, "-m", "hotswap.system.bytecode_fill", str(folder)],
                env=env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
        # Given its list and reaped on a thread; left to finish if this process ends first.
        threading.Thread(target=filler.communicate, args=(listing,), daemon=True,
                         name="hotswap-bytecode-fill").start()
    except Exception as e:  # never a reason for a worker not to start
        log.debug("hotswap: filling the bytecode cache in parallel failed: %s", e)


def usage(folder: Path) -> tuple[int, int]:
    """(files, bytes) in the bytecode cache ``folder`` (a link counts as a file: it is not
    followed)."""
    files = size = 0
    for parent, folders, names in os.walk(folder):
        links = [d for d in folders if os.path.islink(os.path.join(parent, d))]
        for name in names + links:
            try:
                size += os.lstat(os.path.join(parent, name)).st_size
            except OSError:
                continue
            files += 1
    return files, size


def side_folders(root: Path) -> list[Path]:
    """The folders of compiled Python in the cache folder ``root``: this module's bytecode
    caches (``pycache-<python>``) and inductor's compiled templates (``templates-<python>``,
    engine/loading/templates.py), one per Python that used the cache. Links are left out."""
    try:
        found = [Path(e.path) for e in os.scandir(root)
                 if e.name.startswith(_SIDE_PREFIXES) and e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(found)


_SIDE_PREFIXES = ("pycache-", "templates-")


def clear_folder(folder: Path) -> tuple[int, int]:
    """Remove what ``folder`` (one of ``side_folders``) holds, leaving the folder itself (a
    running process that reads it writes there again); (files, bytes) removed. A folder that
    is not this user's, or that others may write, is refused (``trust.UntrustedPath``):
    nothing in it is ours to remove. Never follows a link."""
    import shutil

    check_private_dir(folder)
    files = size = 0
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                n, b = usage(Path(entry.path))
                shutil.rmtree(entry.path, ignore_errors=True)
                if not os.path.lexists(entry.path):  # counted only once gone whole
                    files, size = files + n, size + b
                continue
            with contextlib.suppress(FileNotFoundError):
                b = entry.stat(follow_symlinks=False).st_size
                os.unlink(entry.path)
                files, size = files + 1, size + b
    return files, size


def _imported_sources() -> list[str]:
    return sorted({f for m in list(sys.modules.values())
                   if isinstance(f := getattr(m, "__file__", None), str) and f.endswith(".py")})


def imported_source_bytes(payload: object = None) -> int:
    """A worker job: the bytes of Python source behind the modules this process imported
    (a compile worker's: torch's and inductor's), all of which a start without bytecode
    compiles."""
    total = 0
    for path in _imported_sources():
        try:
            total += os.path.getsize(path)
        except OSError:
            continue
    return total


def compile_rate(sample_bytes: int = 2 << 20, repeat: int = 2) -> float:
    """Bytes of Python source this machine compiles a second: the best of ``repeat`` timings
    of about ``sample_bytes`` of the modules this process imported (every n-th, by path)."""
    paths = _imported_sources()
    sizes = {p: os.path.getsize(p) for p in paths if os.path.isfile(p)}
    stride = max(1, round(sum(sizes.values()) / sample_bytes))
    texts = []
    for path in list(sizes)[::stride]:
        try:
            texts.append((path, Path(path).read_bytes()))
        except OSError:
            continue
    best_s = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for path, text in texts:
            compile(text, path, "exec", dont_inherit=True)
        best_s = min(best_s, time.perf_counter() - start)
    return sum(len(t) for _, t in texts) / max(best_s, 1e-9)
