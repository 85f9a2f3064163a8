"""The environment against the user's calls: each fault, each time, the calls return eager's
outputs, nothing waits past its limit, the reason shows in ``status`` (or the CLI's message),
and nothing outside the cache is touched.

    fault                          where                      what the user gets
    full disk (ENOSPC)             entry and index writes     compiled tier, uncached
    full disk, warm cache          index write at a hit       the hit
    a real full disk (tmpfs)       all of the above           the hit; compiled tier, uncached
    unreadable entry (EACCES)      entry read                 a miss: compiled again
    unreadable compile lock        locks/<key>.lock           compiled without the claim
    unreadable index               index.msgpack              the hit; compiled tier, unindexed
    entry path is a directory      entry read and write       a miss: compiled, uncached
    stopped worker (SIGSTOP)       the compile's worker       replaced, the job retried once
    claim held by a stopped process locks/<key>.lock          compiled here after 2 s
    hung compile                   the compile's worker       JobTimeout, no temporary files
    foreign directory              every cache command        exit 2, nothing touched
    symlinked shard                entries/<k[:2]>            a miss, nothing written through

Faults a root process would not see (permissions) are injected where the OS would raise them;
a full disk is both injected and real (a filled tmpfs, where this process may mount one).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hotswap
from hotswap import testing
from hotswap.cache import ArtifactCache, store
from hotswap.cli import main as cli
from hotswap.system.starvation import STOPPED_GRACE_S

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return model, torch.randn(8, 16)


def _serve(cache: Path, mode: str = "async", **options: Any
           ) -> tuple[hotswap.GraphStatus, dict[str, int], float]:
    """Compile the model, call it before and after its tier is in; (status, counter deltas,
    seconds the first call took). Every output must equal eager's."""
    model, x = _model()
    torch._dynamo.reset()
    with hotswap.counters_delta() as delta:
        compiled = hotswap.compile(model, mode=mode, workers=1, cache_dir=str(cache), **options)
        start = time.monotonic()
        torch.testing.assert_close(compiled(x), model(x))
        first_s = time.monotonic() - start
        [status] = hotswap.wait(compiled, timeout_s=180)
        torch.testing.assert_close(compiled(x), model(x))
    assert status.final, status
    return status, dict(delta), first_s


def _raise(code: int, what: str) -> Callable[..., Any]:
    def fail(*_: Any, **__: Any) -> Any:
        raise OSError(code, os.strerror(code), what)
    return fail


def _warm(cache: Path) -> None:
    status, delta, _ = _serve(cache)
    assert status.tier == "default" and delta["worker_compiles"] == 1


def _tree(path: Path) -> list[tuple[str, int, int]]:
    return sorted((str(p.relative_to(path)), p.stat().st_mode, p.stat().st_size)
                  for p in path.rglob("*"))


# --------------------------------------------------------------------- cache faults

def test_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store, "write_atomic", _raise(errno.ENOSPC, "entries"))
    status, delta, _ = _serve(tmp_path / "cache")
    assert status.tier == "default" and delta["worker_compiles"] == 1
    assert "could not write" in status.cache and "No space left on device" in status.cache
    assert not list((tmp_path / "cache" / "entries").rglob("*.hsa"))


def test_full_disk_under_a_warm_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _warm(tmp_path / "cache")
    monkeypatch.setattr(store, "write_atomic", _raise(errno.ENOSPC, "index.msgpack"))
    status, delta, _ = _serve(tmp_path / "cache")
    assert status.tier == "default" and status.path == "cache"
    assert delta["cache_hits"] == 1 and delta["worker_compiles"] == 0


@contextlib.contextmanager
def _small_disk(path: Path, size: str) -> Iterator[Path]:
    """A real full disk: a tmpfs of ``size`` at ``path`` (root only; else the injected
    ENOSPC tests above stand alone)."""
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}",
                                            "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root); ENOSPC is injected above")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(disk: Path) -> None:
    with open(disk / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC


def test_a_real_full_disk(tmp_path: Path) -> None:
    _warm(tmp_path / "cache")
    with _small_disk(tmp_path / "small", "8m") as disk:
        shutil.copytree(tmp_path / "cache", disk / "cache")
        _fill(disk)
        status, delta, _ = _serve(disk / "cache")  # the warm cache, on a full disk
        assert status.path == "cache" and delta["cache_hits"] == 1
        torch._dynamo.reset()
        (disk / "cache" / "index.msgpack").unlink()  # nothing for a cold run to rewrite in place
        shutil.rmtree(disk / "cache" / "entries")
        _fill(disk)
        status, delta, _ = _serve(disk / "cache")
        assert status.tier == "default" and delta["worker_compiles"] == 1
        assert "No space left on device" in status.cache


def test_unreadable_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _warm(tmp_path / "cache")
    monkeypatch.setattr(store, "_read_entry", _raise(errno.EACCES, "entry"))
    status, delta, _ = _serve(tmp_path / "cache")
    assert status.tier == "default" and delta["worker_compiles"] == 1
    assert "could not read" in status.cache and "PermissionError" in status.cache


def test_unreadable_compile_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Refused:
        def acquire(self, *_: Any, **__: Any) -> None:
            raise PermissionError(errno.EACCES, "Permission denied", "locks/k.lock")

        def release(self) -> None:
            raise AssertionError("never acquired")

    monkeypatch.setattr(ArtifactCache, "compile_lock", lambda self, key: Refused())
    status, delta, _ = _serve(tmp_path / "cache", mode="subprocess")
    assert status.tier == "default" and delta["worker_compiles"] == 1
    assert "could not lock" in status.cache
    assert len(ArtifactCache(tmp_path / "cache").entries()) == 1  # stored all the same


def test_unreadable_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _warm(tmp_path / "cache")
    monkeypatch.setattr(ArtifactCache, "_read_index", _raise(errno.EACCES, "index.msgpack"))
    status, delta, _ = _serve(tmp_path / "cache")
    assert status.path == "cache" and delta["cache_hits"] == 1  # a hit never needs the index
    torch._dynamo.reset()
    cold, delta, _ = _serve(tmp_path / "other")
    assert cold.tier == "default" and delta["worker_compiles"] == 1
    assert "could not write" in cold.cache and "index.msgpack" in cold.cache


def test_entry_path_is_a_directory(tmp_path: Path) -> None:
    _warm(tmp_path / "cache")
    [entry] = ArtifactCache(tmp_path / "cache").entries()
    path = ArtifactCache(tmp_path / "cache").entry_path(entry.key)
    path.unlink()
    path.mkdir()
    status, delta, _ = _serve(tmp_path / "cache")
    assert status.tier == "default" and delta["worker_compiles"] == 1
    assert "IsADirectoryError" in status.cache
    assert path.is_dir()  # not ours to remove


def test_symlinked_shard(tmp_path: Path) -> None:
    _warm(tmp_path / "cache")
    [entry] = ArtifactCache(tmp_path / "cache").entries()
    shard = ArtifactCache(tmp_path / "cache").entry_path(entry.key).parent
    outside = tmp_path / "outside"
    shard.rename(outside)
    shard.symlink_to(outside)
    before = _tree(outside)
    status, delta, _ = _serve(tmp_path / "cache")
    assert status.tier == "default" and delta["cache_hits"] == 0 and delta["worker_compiles"] == 1
    assert "symlink" in status.cache
    assert _tree(outside) == before


def test_foreign_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    home = tmp_path / "home"
    (home / "entries" / "ab").mkdir(parents=True)
    (home / "entries" / "ab" / ("ab" * 32 + ".hsa")).write_bytes(b"someone's file")
    (home / "notes.txt").write_text("mine")
    home.chmod(0o755)
    before = _tree(home)
    for action in ("ls", "stats", "verify", "clear"):
        assert cli(["cache", action, "--cache-dir", str(home)]) == 2, action
        assert "is not a hotswap artifact cache" in capsys.readouterr().err
    status, delta, _ = _serve(home)
    assert delta["cache_hits"] == 0 and delta["worker_compiles"] == 1
    assert status.tier == "default" and "refusing to use" in status.cache
    assert _tree(home) == before and home.stat().st_mode & 0o777 == 0o755


# --------------------------------------------------------------------- stopped and hung processes

def test_stopped_worker(tmp_path: Path) -> None:
    """Subprocess mode's first call waits for the compile: a stopped worker must not hold it."""
    pool = hotswap.runtime().pool(1)
    stopped: list[int] = []

    def stop_the_busy_worker() -> None:
        deadline = time.monotonic() + 60
        while not stopped and time.monotonic() < deadline:
            busy = [w.pid for w in pool.workers_info() if w.busy]
            if busy:  # its job sleeps first (testing's "slow" fault)
                os.kill(busy[0], signal.SIGSTOP)
                stopped.append(busy[0])
            time.sleep(0.01)

    stopper = threading.Thread(target=stop_the_busy_worker)
    stopper.start()
    with testing.inject(testing.FaultPlan({"slow": 1.0}, slow_s=3.0)):
        status, delta, first_s = _serve(tmp_path / "cache", mode="subprocess")
    stopper.join()
    assert stopped and stopped[0] not in pool.worker_pids()  # killed and replaced
    assert status.tier == "default" and delta["worker_crashes"] == 1
    assert STOPPED_GRACE_S < first_s < 60  # not the default limit of 600 s


_HOLDER = textwrap.dedent("""
    import sys, torch, hotswap
    from hotswap import testing
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)
    with testing.inject(testing.FaultPlan({"slow": 1.0}, slow_s=600)):
        hotswap.compile(model, mode="subprocess", workers=1, cache_dir=sys.argv[1])(x)
""")


def test_claim_held_by_a_stopped_process(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(cache)],
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 120
        while not list((cache / "locks").glob("*.owner")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert list((cache / "locks").glob("*.owner")), "the holder never claimed"
        os.kill(holder.pid, signal.SIGSTOP)  # Ctrl-Z while holding the claim
        status, delta, first_s = _serve(cache, mode="subprocess")
        assert status.tier == "default" and delta["worker_compiles"] == 1
        assert STOPPED_GRACE_S < first_s < 60
    finally:
        os.kill(holder.pid, signal.SIGCONT)
        holder.kill()
        holder.wait()


def test_hung_compile(tmp_path: Path) -> None:
    before = {p.name for p in Path(os.environ.get("TMPDIR", "/tmp")).glob("hotswap-w*")}
    with testing.inject(testing.FaultPlan({"hang": 1.0})):
        status, delta, first_s = _serve(tmp_path / "cache", timeout_s=3)
    assert status.tier == "eager" and delta["job_timeouts"] == 1
    assert [tier for tier, _ in status.failures] == ["default"]
    assert "timeout of 3 s" in status.failures[0][1]
    assert first_s < 3  # async: the first call never waited for it
    after = {p.name for p in Path(os.environ.get("TMPDIR", "/tmp")).glob("hotswap-w*")}
    assert len(after - before) <= 1  # the replacement worker's folder; the hung one's is gone
