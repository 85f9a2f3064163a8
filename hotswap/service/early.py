"""The compile service, found or started as hotswap is imported (HOTSWAP_SERVICE=on).

A process that compiles with the service asks for it when its first coordinator is made
(``hotswap.compile``, or dynamo's first graph for ``backend="hotswap"``): after the model is
built. In the first process ever the service then starts its workers, which import torch and
inductor (15 s on a GPU machine without bytecode) and warm CUDA, while the graph waits. Asked
for as hotswap is imported instead, the service warms while the model is built (importing
transformers, building GPT-2, moving it to the GPU: 10 s on the H100), and a first job finds a
worker that is ready, or nearly.

The import only starts a daemon thread; the thread finds or starts the service
(``control.ensure``, under its lock, as a job's link would) and nothing more. Whatever fails
there is said later by the link of the job that needs the service, which tries again.

Not in hotswap's own processes: its workers (``HOTSWAP_SCRATCH_DIR`` is set for them), the
service itself, and the command line (``hotswap service status`` must find no service where
none runs); nor in children of multiprocessing (a DataLoader's workers, a Dask cluster's),
whose parent asked already. The service's build is this environment's as hotswap is imported:
set ``CUDA_VISIBLE_DEVICES`` and ``TORCHINDUCTOR_*`` before; a service started early for
another build exits ``FIRST_JOB_WITHIN_S`` after its start if no job came.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import threading
from collections.abc import Sequence

from hotswap import settings

__all__ = ["FIRST_JOB_WITHIN_S", "own_program", "start"]

log = logging.getLogger("hotswap")

# A service started here exits this long after its start unless a job came (this process may
# set CUDA_VISIBLE_DEVICES or a TORCHINDUCTOR_* variable after importing hotswap, and then
# ask a service of another build; or compile with executor="local").
FIRST_JOB_WITHIN_S = 120.0
# ``python -m <module>`` programs of hotswap's that start no service as they import it.
_OWN_MODULES = ("hotswap", "hotswap.cli", "hotswap.service", "hotswap.workers")
_OWN_PACKAGES = ("hotswap.service.", "hotswap.workers.")


def start() -> threading.Thread | None:
    """Find or start the service on a daemon thread, where this process would use it."""
    if not _wanted():
        return None
    thread = threading.Thread(target=_ensure, daemon=True, name="hotswap-service-early")
    try:
        thread.start()
    except RuntimeError:  # imported first as the interpreter exits: no new threads
        return None
    return thread


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


def _wanted() -> bool:
    if os.environ.get("HOTSWAP_SCRATCH_DIR"):  # a worker of a pool (workers/scratch.py)
        return False
    if _multiprocessing_child():  # a DataLoader's worker, a Dask worker: its parent asked
        return False
    try:
        if not settings.service() or settings.executor() not in (None, "service://"):
            return False
    except ValueError:  # hotswap.compile says so, naming the variable
        return False
    return not own_program(sys.orig_argv)


def _multiprocessing_child() -> bool:
    """Whether this process is a child of ``multiprocessing``. A spawned or forkserver child
    imports hotswap again as it re-imports the parent's ``__main__``, before
    ``parent_process()`` says so: its command line (``--multiprocessing-fork``) or the
    process object it is being built as (``_inheriting``) tell it then."""
    if "--multiprocessing-fork" in sys.orig_argv:
        return True
    current = multiprocessing.current_process()
    return bool(getattr(current, "_inheriting", False)) or multiprocessing.parent_process() is not None


def _ensure() -> None:
    try:
        from hotswap.service import control
        from hotswap.service.place import find_place

        control.ensure(find_place(create=True), first_job_within_s=FIRST_JOB_WITHIN_S)
    except Exception as e:  # the link of the first job tries again and says why
        log.debug("hotswap: starting the compile service early failed: %s: %s",
                  type(e).__name__, e)
