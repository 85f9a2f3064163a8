"""Hotswap's bytecode cache filled on many cores at once, for the first process ever.

Where the processes hotswap starts would compile torch's sources at every start
(``bytecode.py``), the first worker ever imports torch and inductor compiling each module from
source, one after another: about 10 s of its start on a GPU machine, while the user's first
graph waits for it (2.7-4.1 s of queue wait, H100), and its first compile imports more of
inductor the same way. Each file compiles on its own, so the first process that gives a child
the cache (``bytecode.child_env``) on a machine of ``MIN_CPUS`` cores or more also starts this
program, which compiles into the folder what the worker is about to import, at the lowest
priority (niceness 19, ``SCHED_IDLE``) on all cores but ``SPARED_CPUS``:

1. the sources of the modules the starting process has imported, in the order it imported
   them (torch's, which a worker imports first; none in the compile service, which never
   imports torch);
2. then every source of the packages a compile imports (``PACKAGES``), folder by folder.

The worker's own imports read what is there already and compile the rest themselves, as
before. Both write as Python does (``py_compile``: timestamp-checked, under a temporary name,
then renamed), so either may come first. One filler per folder at a time (a lock in it);
a filler that finds a file's bytecode current there skips it.

    python -m hotswap.system.bytecode_fill FOLDER LIST

LIST: a file of source files and folders, one per line, removed once read.
"""

from __future__ import annotations

import contextlib
import functools
import os
import py_compile
import sys
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import filelock

from hotswap.system.own_bytecode import bytecode_path, current

__all__ = ["LOCK_NAME", "MIN_CPUS", "PACKAGES", "SPARED_CPUS", "compile_one", "main", "sources"]

MIN_CPUS = 8
SPARED_CPUS = 3  # the user's process, the first worker, the compile service
PACKAGES = ("torch", "triton", "sympy", "mpmath", "jinja2", "networkx")
LOCK_NAME = ".filling.lock"
# Folders of a package that no compile imports.
_SKIPPED = ("tests", "test", "testing", "benchmarks", "_vendor")


def sources(listed: Iterable[str]) -> Iterator[Path]:
    """The ``.py`` files named, and those below the folders named (sorted; each file once)."""
    seen: set[Path] = set()
    for line in listed:
        path = Path(line.strip())
        if not line.strip():
            continue
        found = [path] if path.suffix == ".py" else (
            sorted(p for p in path.rglob("*.py")
                   if not _SKIPPED_PARTS.intersection(p.relative_to(path).parts[:-1])))
        for source in found:
            if source not in seen:
                seen.add(source)
                yield source


_SKIPPED_PARTS = frozenset(_SKIPPED)


def compile_one(folder: str, source: Path) -> bool:
    """Writes ``source``'s bytecode into ``folder`` unless it is current there. False: it does
    not compile (a file Python would refuse as well)."""
    pyc = bytecode_path(source, folder)
    if current(source, pyc):
        return True
    try:
        py_compile.compile(str(source), cfile=str(pyc), doraise=True,
                           invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)
    except (py_compile.PyCompileError, OSError, ValueError):
        return False
    return True


def _lowest_priority() -> None:
    """Niceness 19 and ``SCHED_IDLE``: below the user's process, and no higher than the compile
    workers (``SCHED_IDLE`` too, where no cgroup holds them), whose imports it is for."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, 19)
    idle = getattr(os, "SCHED_IDLE", None)
    if idle is not None:
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, idle, os.sched_param(0))


def main(argv: list[str]) -> int:
    folder, listing = Path(argv[0]), Path(argv[1])
    _lowest_priority()  # its pool's processes inherit it
    try:
        listed = listing.read_text().splitlines()
    finally:
        with contextlib.suppress(OSError):
            listing.unlink()
    try:
        with filelock.FileLock(folder / LOCK_NAME, timeout=0):
            todo = list(sources(listed))
            cores = max(1, (os.cpu_count() or 1) - SPARED_CPUS)
            with ProcessPoolExecutor(max_workers=cores) as pool:
                done = sum(pool.map(functools.partial(compile_one, str(folder)), todo,
                                    chunksize=8))
    except filelock.Timeout:
        return 0  # another process fills it now
    print(f"{done} of {len(todo)} sources compiled or current", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
