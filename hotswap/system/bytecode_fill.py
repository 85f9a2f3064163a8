"""Hotswap's bytecode cache filled on many cores at once, for the first process ever.

Where the processes hotswap starts would compile torch's sources at every start
(``bytecode.py``), the first worker ever imports torch and inductor compiling each module from
source, one after another: about 10 s of its start on a GPU machine, while the user's first
graph waits for it (2.7-4.1 s of queue wait, H100), and its first compile imports more of
inductor the same way. Each file compiles on its own, so the first process that gives a child
the cache (``bytecode.child_env``: a worker, the compile service, a Dask cluster) on a machine
of ``bytecode.MIN_CPUS`` cores or more (``cores()``: its affinity within its cgroup's quota)
also starts this program.
It compiles into the folder what the worker is about to import, in ``processes(cores())``
processes at the lowest priority (a session of niceness 19, ``SCHED_IDLE``: ``priority.lower_priority``):

1. the sources of the modules the starting process has imported, in the order it imported
   them (torch's, which a worker imports first), where they are Python's or an installed
   package's (not a user's script, nor inductor's generated code);
2. then every source of the packages a compile imports (``bytecode.PACKAGES``), folder by
   folder.

The worker's own imports read what is there already and compile the rest themselves, as
before. Both write as Python does (``py_compile``: unoptimized, timestamp-checked, under a
temporary name, then renamed), so either may come first. One filler per folder at a time (a
lock in it); a file whose bytecode is current there is skipped. Before each file the folder
must still be the one given (device and inode), this user's and closed to others: one removed
meanwhile ends the fill (compiling into it would make it again, with the umask's modes). It
ignores ^C and outlives the process that started it: it ends on its own within seconds.

    python -m hotswap.system.bytecode_fill FOLDER < LIST

LIST: source files and folders, one per line.
"""

from __future__ import annotations

import contextlib
import functools
import os
import py_compile
import signal
import sys
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import filelock

from hotswap.system import cgroup, proctree
from hotswap.system.own_bytecode import bytecode_path, current, identity, still_ours
from hotswap.system.priority import lower_priority

__all__ = ["LOCK_NAME", "MAX_PROCESSES", "SPARED_CPUS", "compile_one", "cores", "main",
           "processes", "sources"]

SPARED_CPUS = 3  # the user's process, the first worker, the compile service
MAX_PROCESSES = 8
LOCK_NAME = ".filling.lock"
# Folders of a package that no compile imports.
_SKIPPED = frozenset(("tests", "test", "testing", "benchmarks", "_vendor"))


def cores() -> int:
    """The cores this process may use: its affinity, within its cgroup's quota."""
    usable = float(proctree.usable_cores())
    quota = cgroup.quota_cores()
    return int(min(usable, quota) if quota is not None else usable)


def processes(usable: int) -> int:
    """How many processes a filler compiles in on ``usable`` cores."""
    return max(1, min(MAX_PROCESSES, usable - SPARED_CPUS))


def sources(listed: Iterable[str]) -> Iterator[Path]:
    """The ``.py`` files named, and those below the folders named (sorted; each file once)."""
    seen: set[Path] = set()
    for line in listed:
        if not line.strip():
            continue
        path = Path(line.strip())
        found = [path] if path.suffix == ".py" else (
            sorted(p for p in path.rglob("*.py")
                   if not _SKIPPED.intersection(p.relative_to(path).parts[:-1])))
        for source in found:
            if source not in seen:
                seen.add(source)
                yield source


def compile_one(folder: str, made: tuple[int, int], source: Path) -> bool:
    """Writes ``source``'s bytecode into ``folder`` unless it is current there. False: it does
    not compile (a file Python would refuse as well), or the folder is no longer the one given
    (``still_ours``)."""
    pyc = bytecode_path(source, folder)
    if current(source, pyc):
        return True
    if not still_ours(Path(folder), made):
        return False
    try:
        py_compile.compile(str(source), cfile=str(pyc), doraise=True, optimize=0,
                           invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)
    except (py_compile.PyCompileError, OSError, ValueError):
        return False
    return True


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C for the user's process is not ours
    lower_priority(19, True)  # its pool's processes inherit it
    folder = argv[0]
    listed = sys.stdin.read().splitlines()
    try:
        made = identity(Path(folder))
        if not still_ours(Path(folder), made):
            print(f"not filled: {folder} is not this user's alone", file=sys.stderr)
            return 0
        with filelock.FileLock(os.path.join(folder, LOCK_NAME), timeout=0):
            todo = list(sources(listed))
            with ProcessPoolExecutor(max_workers=processes(cores())) as pool:
                done = sum(pool.map(functools.partial(compile_one, folder, made), todo,
                                    chunksize=8))
    except filelock.Timeout:
        return 0  # another process fills it now
    except OSError as e:
        print(f"not filled: {e}", file=sys.stderr)
        return 0
    print(f"{done} of {len(todo)} sources compiled or current", file=sys.stderr)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main(sys.argv[1:]))
