from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator

import psutil
import pytest

# Importing hotswap starts no compile workers in the tests, nor in the processes they start,
# unless a test asks for them (service/early.py).
assert "hotswap" not in sys.modules, "imported before conftest: it may have started workers"
os.environ["HOTSWAP_START_EARLY"] = "off"


def worker_processes() -> list[psutil.Process]:
    """Live hotswap workers started by this test process (zombies do not count)."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if "hotswap.workers" in " ".join(proc.cmdline()) and proc.status() != "zombie":
                found.append(proc)
        except psutil.Error:
            pass
    return found


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def cache_readers(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """From now on, the name of each thread that reads an entry of the artifact cache
    (``CacheAccess.get``), in order."""
    import threading

    from hotswap.engine.sources.cache_access import CacheAccess

    readers: list[str] = []
    get = CacheAccess.get

    def spied(self: CacheAccess, key: str | None) -> bytes | bytearray | None:
        readers.append(threading.current_thread().name)
        return get(self, key)

    monkeypatch.setattr(CacheAccess, "get", spied)
    return readers


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Pids still alive after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if not gone(p)]
        if alive:
            time.sleep(0.02)
    return alive


def _shared_pool_pids() -> set[int]:
    if "hotswap.engine.runtime" not in sys.modules:
        return set()  # nothing has started hotswap's runtime
    import hotswap

    return set(hotswap.runtime().worker_pids())


@pytest.fixture(autouse=True)
def fresh_artifact_cache(tmp_path_factory: pytest.TempPathFactory,
                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test gets its own artifact cache: exact counter deltas must not see another test's
    entries (nor the user's ~/.cache)."""
    monkeypatch.setenv("HOTSWAP_CACHE_DIR", str(tmp_path_factory.mktemp("hotswap-cache")))


@pytest.fixture(autouse=True)
def no_bytecode_filler(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test's fresh cache starts a filler of torch's bytecode (system/bytecode_fill.py) on a
    machine of many cores, unless it asks for one: the filler would compile torch, sympy and
    triton beside the tests on every cache (the tests that ask set MIN_CPUS themselves)."""
    from hotswap.system import bytecode

    monkeypatch.setattr(bytecode, "MIN_CPUS", 1 << 20)


@pytest.fixture(autouse=True)
def no_leaked_workers() -> Iterator[None]:
    """Every test must leave no worker process behind once its pools are shut down."""
    before = {p.pid for p in worker_processes()}
    yield
    # The orchestrator's process-wide pools outlive tests on purpose, and one may be starting
    # a replacement right now (after a kill): a worker is leaked only if, for 5 s, it is
    # neither gone nor one of theirs.
    deadline = time.monotonic() + 5.0
    while True:
        shared = _shared_pool_pids()
        leaked = [p.pid for p in worker_processes()
                  if p.pid not in before and p.pid not in shared and not gone(p.pid)]
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert leaked == [], f"leaked worker processes: {leaked}"
