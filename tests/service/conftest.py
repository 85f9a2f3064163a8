from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from hotswap.executors import registry
from tests.conftest import wait_gone


def services_of(folder: Path) -> list[psutil.Process]:
    """Compile services (and their workers) running with ``folder`` as their private folder."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "hotswap.service" in cmdline and str(folder) in cmdline:
            found.append(proc)
    return found


def kill_services(folder: Path) -> None:
    pids = []
    for proc in services_of(folder):
        pids += [proc.pid, *(c.pid for c in proc.children(recursive=True))]
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # the service leads its own session
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGCONT)
            proc.kill()
    assert wait_gone(pids, 10.0) == []


@pytest.fixture
def service_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private service folder of this test (short: a socket's path has at most 107 bytes),
    one worker, a short idle exit. Every service started in it is killed at the end, with
    its workers, and this process's executors are closed."""
    base = Path(tempfile.mkdtemp(prefix="hs-", dir="/tmp"))
    folder = base / "svc"
    monkeypatch.setenv("HOTSWAP_SERVICE_DIR", str(folder))
    monkeypatch.setenv("HOTSWAP_SERVICE_IDLE_EXIT_S", "120")
    monkeypatch.setenv("HOTSWAP_WORKERS", "1")
    try:
        yield folder
    finally:
        registry.shutdown(wait=True)
        kill_services(folder)
        shutil.rmtree(base, ignore_errors=True)


def wait_for(predicate: object, timeout_s: float = 30.0, step_s: float = 0.02) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(step_s)
