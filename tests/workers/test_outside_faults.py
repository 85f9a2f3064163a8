"""Faults from outside the pool: a worker someone stops, compiles killed mid-build."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from hotswap.errors import JobTimeout, WorkerCrashed, WorkerStopped
from hotswap.workers import WorkerPool
from hotswap.workers.starvation import STOPPED_GRACE_S


def test_a_stopped_worker_is_replaced_and_its_job_fails_like_a_crash() -> None:
    pool = WorkerPool(1, warm_modules=())
    try:
        future = pool.submit("hotswap.workers.faults:sleep", 60.0, timeout_s=120)
        deadline = time.monotonic() + 60
        while future.worker_pid is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert future.worker_pid is not None
        os.kill(future.worker_pid, signal.SIGSTOP)  # as a Ctrl-Z'd or debugged worker
        start = time.monotonic()
        with pytest.raises(WorkerStopped, match="was stopped") as raised:
            future.result(timeout=60)
        assert STOPPED_GRACE_S <= time.monotonic() - start < 30  # not the job's 120 s limit
        assert isinstance(raised.value, WorkerCrashed)  # retried like a crash by its callers
        assert raised.value.stopped_pid == future.worker_pid
        assert pool.submit("hotswap.workers.faults:echo", 7).result(timeout=60) == 7
    finally:
        pool.shutdown()


def test_a_killed_compile_leaves_no_temporary_files(tmp_path: Path) -> None:
    marker = tmp_path / "temp-path"
    pool = WorkerPool(1, warm_modules=())
    try:
        python_tmp, child_tmp = pool.submit("tests.workers.jobs:temp_dirs").result(timeout=60)
        assert python_tmp == tempfile.gettempdir()  # inductor's caches keyed on it persist
        assert child_tmp is not None and Path(child_tmp).is_dir()
        assert Path(child_tmp).parent == Path(tempfile.gettempdir())
        future = pool.submit("tests.workers.jobs:leave_compiler_temp", str(marker), timeout_s=3)
        with pytest.raises(JobTimeout):
            future.result(timeout=60)
        left = Path(marker.read_text())
        assert left.parent != Path(tempfile.gettempdir())  # written in the worker's own folder
        assert not left.exists() and not left.parent.exists()
    finally:
        pool.shutdown()
    assert not Path(child_tmp).exists()  # removed at shutdown too


def test_scratch_folders_of_a_killed_pool_are_removed_by_the_next() -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid with no process behind it
    stale = Path(tempfile.mkdtemp(prefix=f"hotswap-w{gone.pid}-0-"))
    (stale / "ccLEFT.s").write_text("")
    alive = Path(tempfile.mkdtemp(prefix=f"hotswap-w{os.getpid()}-9-"))  # a live pool's
    pool = WorkerPool(1, warm_modules=())
    try:
        assert pool.submit("hotswap.workers.faults:echo", 1).result(timeout=60) == 1
        assert not stale.exists() and alive.exists()
    finally:
        pool.shutdown()
        alive.rmdir()
