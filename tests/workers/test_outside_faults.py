"""Faults from outside the pool: a worker someone stops, compiles killed mid-build."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from hotswap.errors import JobTimeout, WorkerCrashed, WorkerStopped
from hotswap.system import proctree
from hotswap.system.starvation import POLL_S, STOPPED_GRACE_S
from hotswap.workers import WorkerPool

# A stopped worker is seen at the first CPU poll after the stop (POLL_S at most later) and
# killed at the first poll STOPPED_GRACE_S after that (polls are never closer than POLL_S, so
# that one is at most a poll late): STOPPED_GRACE_S + 2 polls, plus slack for a manager thread
# scheduled late on a busy machine. Before, a stop was looked for only once the worker's whole
# tree had been starved for STARVED_AFTER_S: a compiler child still running held it off for as
# long as it ran (over 30 s in the second case; 7.8 s seen under a real compile).
STOP_TO_KILL_S = STOPPED_GRACE_S + 2 * POLL_S + 2.0


@pytest.mark.parametrize(("job", "long", "short"), [
    ("hotswap.testing.faults:sleep", 60.0, 0.0),  # a job that waits
    ("tests.workers.jobs:run_compiler", 30.0, 0.0),  # its child runs on while it is stopped
], ids=["waiting", "child-running"])
def test_a_stopped_worker_is_killed_after_its_grace_and_replaced(
        job: str, long: float, short: float) -> None:
    pool = WorkerPool(1, warm_modules=())
    try:
        future = pool.submit(job, long, timeout_s=120)
        deadline = time.monotonic() + 60
        while future.worker_pid is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert future.worker_pid is not None
        worker = future.worker_pid
        children: list[psutil.Process] = []
        while job.endswith("run_compiler") and not children and time.monotonic() < deadline:
            children = proctree.descendants(worker)
            time.sleep(0.01)
        os.kill(worker, signal.SIGSTOP)  # as a Ctrl-Z'd or debugged worker
        start = time.monotonic()
        with pytest.raises(WorkerStopped, match="was stopped") as raised:
            future.result(timeout=60)
        assert STOPPED_GRACE_S <= time.monotonic() - start < STOP_TO_KILL_S
        assert isinstance(raised.value, WorkerCrashed)  # retried like a crash by its callers
        assert raised.value.stopped_pid == worker
        assert worker not in pool.worker_pids()
        assert all(_dies(child) for child in children)  # killed with it
        assert pool.submit(job, short).result(timeout=60) == short  # the retry, on its replacement
    finally:
        pool.shutdown()


def _dies(proc: psutil.Process, timeout_s: float = 10.0) -> bool:
    """``proc`` exits within ``timeout_s`` (a zombie counts: an orphan is reaped by init)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.01)
    return False


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
        assert pool.submit("hotswap.testing.faults:echo", 1).result(timeout=60) == 1
        assert not stale.exists() and alive.exists()
    finally:
        pool.shutdown()
        alive.rmdir()
