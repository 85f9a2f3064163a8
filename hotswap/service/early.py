"""The compile workers, started as hotswap is imported: the compile service
(HOTSWAP_SERVICE=on), else the process's own pool of the default size (HOTSWAP_START_EARLY=off:
neither).

A process asks for its workers when its first coordinator is made (``hotswap.compile``, or
dynamo's first graph for ``backend="hotswap"``): after the model is built. In the first process
ever a worker then imports torch and inductor (15 s on a GPU machine without bytecode) and warms
CUDA while the graph waits. Started as hotswap is imported instead, the workers warm while the
model is built (importing transformers, building GPT-2, moving it to the GPU: 10 s on the
H100), and a first job finds a worker that is ready, or nearly.

The import only starts a daemon thread; the thread finds or starts the service
(``control.ensure``, under its lock, as a job's link would), or, once the process begins to
import torch, starts the local pool (``LocalPools.start_early``: it imports no torch itself),
and nothing more. Whatever fails there is said later by the job that needs the workers, which
tries again.

Not in hotswap's own processes: its workers (``HOTSWAP_SCRATCH_DIR`` is set for them), the
service itself, and the command line (``hotswap service status`` must find no service where
none runs); nor in children of multiprocessing (a DataLoader's workers, a Dask cluster's),
whose parent asked already; nor where the pool's jobs would not come from a default
``hotswap.compile``: another executor (HOTSWAP_EXECUTOR), workers on other GPUs
(HOTSWAP_WORKER_DEVICES), compiles in this process (HOTSWAP_MODE=inprocess). The workers' build
is this environment's as hotswap is imported: set ``CUDA_VISIBLE_DEVICES`` and
``TORCHINDUCTOR_*`` before. Workers started early for another build, or whose pool no compile
asks for (``hotswap.compile(workers=2)`` where the default is 1), stop ``FIRST_JOB_WITHIN_S``
after their start if no job came (a pool: HOTSWAP_WORKER_IDLE_EXIT_S after it, if longer; 0:
kept); a local pool asked for once this process has changed such a variable is replaced at
once (``LocalPools.start_early``).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from hotswap import settings

__all__ = ["FIRST_JOB_WITHIN_S", "own_program", "start"]

log = logging.getLogger("hotswap")

# Workers started here stop this long after their start unless a job came (this process may
# set CUDA_VISIBLE_DEVICES or a TORCHINDUCTOR_* variable after importing hotswap, and then
# ask a service of another build; compile with executor="local", or with other workers=).
FIRST_JOB_WITHIN_S = 120.0
# ``python -m <module>`` programs of hotswap's that start no service as they import it.
_OWN_MODULES = ("hotswap", "hotswap.cli", "hotswap.service", "hotswap.workers")
_OWN_PACKAGES = ("hotswap.service.", "hotswap.workers.", "hotswap.system.")


def start() -> threading.Thread | None:
    """Find or start the service, or start the local pool, on a daemon thread, where this
    process would use it: the pool once the process begins to import torch (``_OnTorch``;
    a program that imports hotswap for its ``WorkerPool`` alone compiles nothing)."""
    target = _wanted()
    if target is _pool_early and "torch" not in sys.modules:
        _OnTorch.install()
        return None
    return _start_thread(target)


def _start_thread(target: Callable[[], None] | None) -> threading.Thread | None:
    if target is None:
        return None
    name = "hotswap-service-early" if target is _service_early else "hotswap-pool-early"
    thread = threading.Thread(target=target, daemon=True, name=name)
    try:
        thread.start()
    except RuntimeError:  # imported first as the interpreter exits: no new threads
        return None
    return thread


class _OnTorch:
    """A finder first on ``sys.meta_path`` that finds nothing: as the process begins to
    import torch, it takes itself off and starts the local pool's thread, if the
    environment still asks for it then (a harness that compiles nothing itself sets
    HOTSWAP_START_EARLY=off before it imports torch). No thread waits meanwhile."""

    @classmethod
    def install(cls) -> None:
        if not any(isinstance(f, cls) for f in sys.meta_path):
            sys.meta_path.insert(0, cls())

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "torch":
            with contextlib.suppress(ValueError):  # another thread's import took it off
                sys.meta_path.remove(self)
                _start_thread(_pool_early if _wanted() is _pool_early else None)
        return None


def own_program(argv: Sequence[str]) -> bool:
    """Whether the command line ``argv`` (``sys.orig_argv``: the interpreter, its options,
    then the program) runs one of hotswap's own programs: ``python -m hotswap.cli ...``,
    ``python -m hotswap.service ...``, the ``hotswap`` command."""
    args = list(argv[1:])
    while args:
        arg = args.pop(0)
        if arg == "-" or not arg.startswith("-"):  # the script: the console entry point?
            return os.path.basename(arg) == "hotswap"
        if arg.startswith("--"):
            if arg == "--check-hash-based-pycs":
                args = args[1:]
            continue
        letters = arg[1:]
        for i, letter in enumerate(letters):  # flags, as -uB; -c, -m, -X, -W end them
            if letter == "c":
                return False  # a command string: the user's code
            if letter == "m":
                module = letters[i + 1:] or (args[0] if args else "")
                return module in _OWN_MODULES or module.startswith(_OWN_PACKAGES)
            if letter in "XW":  # -uX importtime, -uXimporttime: the value follows
                if i == len(letters) - 1:
                    args = args[1:]
                break
    return False


def _wanted() -> Callable[[], None] | None:
    """What to start here: the service (``_service_early``), the local pool (``_pool_early``),
    or nothing (None)."""
    if os.environ.get("HOTSWAP_SCRATCH_DIR"):  # a worker of a pool (workers/scratch.py)
        return None
    if _multiprocessing_child():  # a DataLoader's worker, a Dask worker: its parent asked
        return None
    try:
        if not settings.start_early() or own_program(sys.orig_argv):
            return None
        executor = settings.executor()
        if settings.service():
            return _service_early if executor in (None, "service://") else None
        if executor not in (None, "local") or settings.worker_devices() is not None:
            return None
        if (settings.mode() or "").strip().lower() == "inprocess":
            return None
        settings.workers()  # a malformed count: hotswap.compile says so, naming it
    except ValueError:  # hotswap.compile says so, naming the variable
        return None
    return _pool_early


def _multiprocessing_child() -> bool:
    """Whether this process is a child of ``multiprocessing``. A spawned or forkserver child
    imports hotswap again as it re-imports the parent's ``__main__``, before
    ``parent_process()`` says so: its command line (``--multiprocessing-fork``) or the
    process object it is being built as (``_inheriting``) tell it then."""
    if "--multiprocessing-fork" in sys.orig_argv:
        return True
    current = multiprocessing.current_process()
    return bool(getattr(current, "_inheriting", False)) or multiprocessing.parent_process() is not None


def _service_early() -> None:
    try:
        from hotswap.service import control
        from hotswap.service.place import find_place

        control.ensure(find_place(create=True), first_job_within_s=FIRST_JOB_WITHIN_S)
    except Exception as e:  # the link of the first job tries again and says why
        log.debug("hotswap: starting the compile service early failed: %s: %s",
                  type(e).__name__, e)


def _pool_early() -> None:
    try:
        from hotswap.executors.local import key, pools

        pools.start_early(key(None, ()), FIRST_JOB_WITHIN_S)
    except Exception as e:  # the first compile starts it, and says why it cannot
        log.debug("hotswap: starting the compile workers early failed: %s: %s",
                  type(e).__name__, e)
