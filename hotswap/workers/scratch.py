"""Each worker's own scratch directory for the programs it runs, removed with the worker.

A worker killed mid-compile (a timeout, a crash, a memory limit, a stopped worker) leaves
temporary files behind: the compiler's ``/tmp/cc*.s`` and object files, hotswap's
``hotswap-art-*`` folders. So each worker gets a directory of its own,
``<tmp>/hotswap-w<pool pid>-<slot>-<random>``, which the pool removes when the worker exits,
whatever the reason; directories of pools whose process died first (SIGKILL) are removed by
the next pool that starts.

The worker hands it to the programs it starts as ``TMPDIR`` (gcc writes its temporaries
there) and keeps the caller's temporary directory for its own Python code: inductor keys
caches on it (precompiled headers live in ``<tmp>/torchinductor_<user>`` whatever
``TORCHINDUCTOR_CACHE_DIR`` says), and those must outlive the worker.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile

import psutil

__all__ = ["ENV", "enter", "make", "remove", "sweep"]

ENV = "HOTSWAP_SCRATCH_DIR"
_PREFIX = "hotswap-w"
_NAME = re.compile(rf"{_PREFIX}(\d+)-\d+-")


def make(slot: int) -> str:
    """The pool: a new scratch directory for the worker in ``slot``."""
    return tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-{slot}-")


def enter() -> str | None:
    """The worker, before any import: its Python keeps the caller's temporary directory,
    the processes it starts get the scratch directory. Returns the scratch directory."""
    path = os.environ.get(ENV)
    if path:
        tempfile.tempdir = tempfile.gettempdir()  # fixed before TMPDIR changes below
        os.environ.update(TMPDIR=path, TMP=path, TEMP=path)
    return path


def remove(path: str | None) -> None:
    if path:
        shutil.rmtree(path, ignore_errors=True)


def sweep() -> int:
    """The pool: remove this user's scratch directories of pools whose process is gone;
    how many."""
    removed = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(tempfile.gettempdir()):
            match = _NAME.match(entry.name)
            if match is None or not entry.is_dir(follow_symlinks=False):
                continue
            if entry.stat(follow_symlinks=False).st_uid != os.geteuid():
                continue  # another user's, in a shared /tmp: not ours to remove
            if psutil.pid_exists(int(match.group(1))):
                continue
            shutil.rmtree(entry.path, ignore_errors=True)
            removed += 1
    return removed
