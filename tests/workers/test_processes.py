"""The pool as a user's program meets it: scripts without guards, stdin, parent death, exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import wait_gone

REPO = Path(__file__).resolve().parents[2]

# Top-level code with no `if __name__ == "__main__":` guard, as torch.compile users write it.
UNGUARDED = textwrap.dedent(
    """
    import os, sys
    from hotswap.workers import WorkerPool

    with open(sys.argv[1] if len(sys.argv) > 1 else os.environ["MARKER"], "a") as f:
        f.write(f"ran in {os.getpid()}\\n")
    pool = WorkerPool(2, warm_modules=())
    print("result", pool.submit("hotswap.testing.faults:echo", 21 * 2).result(timeout=60))
    pool.shutdown()
    """
)


def _env(marker: Path) -> dict[str, str]:
    return {**os.environ, "MARKER": str(marker), "PYTHONPATH": str(REPO)}


@pytest.mark.parametrize("how", ["script", "stdin", "dash-c"])
def test_workers_never_rerun_the_users_main(tmp_path: Path, how: str) -> None:
    marker = tmp_path / "marker.txt"
    script = tmp_path / "user_script.py"
    script.write_text(UNGUARDED)
    if how == "script":
        cmd, stdin = [sys.executable, str(script)], None
    elif how == "stdin":
        cmd, stdin = [sys.executable, "-"], UNGUARDED
    else:
        cmd, stdin = [sys.executable, "-c", UNGUARDED], None
    out = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=120,
                         env=_env(marker), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "result 42" in out.stdout
    lines = marker.read_text().splitlines()
    assert len(lines) == 1, lines  # the user's code ran once, in the user's process only


def test_workers_exit_when_parent_is_sigkilled(tmp_path: Path) -> None:
    parent_code = textwrap.dedent(
        """
        import sys, time
        from hotswap.workers import WorkerPool
        pool = WorkerPool(2, warm_modules=())
        pool.wait_ready(60)
        busy = pool.submit("hotswap.testing.faults:hang")   # one busy worker, one idle
        while not busy.running():
            time.sleep(0.01)
        print(" ".join(map(str, pool.worker_pids())), flush=True)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE,
                              text=True, env=_env(tmp_path / "unused"))
    try:
        assert parent.stdout is not None
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert wait_gone(pids, 2.0) == [], "workers outlived their parent by more than 2 s"
    finally:
        parent.kill()


def test_interpreter_exit_with_jobs_pending_does_not_hang(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        from hotswap.workers import WorkerPool
        pool = WorkerPool(1, warm_modules=())
        pending = [pool.submit("hotswap.testing.faults:hang") for _ in range(3)]
        pool.wait_ready(60)
        print(" ".join(map(str, pool.worker_pids())), flush=True)
        # no shutdown(): the interpreter exits with a running job and two queued ones
        """
    )
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=_env(tmp_path / "unused"))
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - start < 30
    pids = [int(p) for p in out.stdout.split()]
    assert pids and wait_gone(pids, 2.0) == []
