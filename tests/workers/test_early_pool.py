"""The local pool started as hotswap is imported (service/early.py, LocalPools.start_early):
a user's program finds its worker warm at its first compile, and a pool no compile asks for
stops."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from hotswap.executors import local
from hotswap.service import early
from tests.conftest import gone

PROGRAM = r"""
import json, sys, time
t0 = time.monotonic()
import hotswap
from hotswap.executors.local import pools

time.sleep(1.0)
before_torch = len(pools.pools())  # none: a program without torch compiles nothing
import torch
from torch._inductor.runtime.cache_dir_utils import cache_dir

deadline = time.monotonic() + 30
while not any(p.worker_pids() for p in pools.pools()) and time.monotonic() < deadline:
    time.sleep(0.02)
early = [pid for p in pools.pools() for pid in p.worker_pids()]

model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
x = torch.randn(8, 16)
with torch.no_grad(), hotswap.counters_delta() as delta:
    fast = hotswap.compile(model, mode="async")
    fast(x)
    [status] = hotswap.wait(fast, timeout_s=240)
    torch.testing.assert_close(fast(x), model(x))
print(json.dumps({"early": early, "before_torch": before_torch, "tier": status.tier,
                  "compiled_by": [pid for p in pools.pools() for pid in p.worker_pids()],
                  "pools": len(pools.pools()), "delta": dict(delta),
                  "inductor_cache": cache_dir()}))
"""


def _program(tmp_path: Path, **env: str) -> dict[str, object]:
    full = {**os.environ, "HOTSWAP_CACHE_DIR": str(tmp_path / "cache"),
            "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "HOTSWAP_WORKERS": "1",
            **env}
    done = subprocess.run([sys.executable, "-c", PROGRAM], env=full, capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_a_users_program_starts_its_worker_as_it_imports_hotswap(tmp_path: Path) -> None:
    result = _program(tmp_path, HOTSWAP_START_EARLY="on")
    assert result["before_torch"] == 0
    assert len(result["early"]) == 1  # type: ignore[arg-type]
    assert result["tier"] == "default"
    assert result["compiled_by"] == result["early"]  # the compile went to that worker
    assert result["pools"] == 1
    assert result["delta"]["worker_compiles"] == 1  # type: ignore[index]
    assert result["inductor_cache"] == str(tmp_path / "inductor")
    # off: the first compile starts the worker
    off = _program(tmp_path / "off", HOTSWAP_START_EARLY="off")
    assert off["early"] == [] and off["tier"] == "default" and off["pools"] == 1


NO_TORCH = r"""
import sys
from hotswap.executors.local import key, pools
assert pools.start_early(key(1, ()), 60.0)
[pool] = pools.pools()
assert pool.wait_ready(120)  # its worker spawned and started
print("torch" in sys.modules)
pools.shutdown()
"""


def test_starting_a_pool_early_imports_no_torch(tmp_path: Path) -> None:
    """Started on a thread beside the user's own import of torch, it must not import torch:
    two threads importing one package can each get the other's module half made."""
    done = subprocess.run([sys.executable, "-c", NO_TORCH], capture_output=True, text=True,
                          timeout=120, check=False,
                          env={**os.environ, "HOTSWAP_CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False"]


HARNESS = r"""
import os, sys, time
import hotswap  # HOTSWAP_START_EARLY=on in the environment
from hotswap.executors.local import pools
os.environ["HOTSWAP_START_EARLY"] = "off"  # a harness that compiles nothing, before torch
import torch
time.sleep(1.0)
print(len(pools.pools()), any("hotswap-pool" in t.name for t in __import__("threading").enumerate()))
"""


def test_a_harness_turns_the_early_pool_off_before_it_imports_torch(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", HARNESS], capture_output=True, text=True,
                          timeout=120, check=False,
                          env={**os.environ, "HOTSWAP_START_EARLY": "on",
                               "HOTSWAP_CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["0", "False"]


def _worker_env(pool: object, name: str) -> str | None:
    [pid] = pool.worker_pids()  # type: ignore[attr-defined]
    return psutil.Process(pid).environ().get(name)


def test_an_early_pool_no_compile_asks_for_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOTSWAP_WORKER_IDLE_EXIT_S", "1")  # shorter than the window: the window
    pools = local.LocalPools()
    size = local.key(1, ())
    try:
        assert pools.start_early(size, 3.0) is True
        assert pools.start_early(size, 3.0) is False  # runs already
        [unused] = pools.pools()
        deadline = time.monotonic() + 20
        while not unused.worker_pids() and time.monotonic() < deadline:
            time.sleep(0.01)
        [pid] = unused.worker_pids()  # stopped whether it is ready or not
        deadline = time.monotonic() + 20
        while pools.pools() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pools.pools() == []
        deadline = time.monotonic() + 20
        while not gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(pid)
        # asked for within its window: kept past it (a pool that never ran a job is kept)
        assert pools.start_early(size, 1.0) is True
        [kept] = pools.pools()
        assert pools.pool(size) is kept
        time.sleep(2.5)
        assert pools.pools() == [kept]
        pools.shutdown()
        # HOTSWAP_WORKER_IDLE_EXIT_S=0 keeps idle workers for good: an early pool too
        monkeypatch.setenv("HOTSWAP_WORKER_IDLE_EXIT_S", "0")
        assert pools.start_early(size, 1.0) is True
        [never] = pools.pools()
        time.sleep(2.5)
        assert pools.pools() == [never]
    finally:
        pools.shutdown()


def test_a_forked_child_has_none_of_its_parents_pools() -> None:
    pools = local.LocalPools()
    try:
        assert pools.start_early(local.key(1, ()), 60.0)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: a pool of its own if it asks (none of its parent's)
            try:
                os.write(write, b"%d" % len(pools.pools()))
            finally:
                os._exit(0)
        os.close(write)
        assert os.read(read, 8) == b"0"
        os.waitpid(pid, 0)
        assert len(pools.pools()) == 1  # the parent's, untouched
    finally:
        pools.shutdown()


def test_an_early_pool_is_replaced_once_the_build_environment_changed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "first"))
    pools = local.LocalPools()
    size = local.key(1, ())
    try:
        assert pools.start_early(size, 60.0)
        [first] = pools.pools()
        assert first.wait_ready(120)
        assert _worker_env(first, "TORCHINDUCTOR_CACHE_DIR") == str(tmp_path / "first")
        [old] = first.worker_pids()
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "second"))
        second = pools.pool(size)
        assert second is not first and pools.pools() == [second]
        assert second.wait_ready(120)
        assert _worker_env(second, "TORCHINDUCTOR_CACHE_DIR") == str(tmp_path / "second")
        deadline = time.monotonic() + 20
        while not gone(old) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(old)
        assert pools.pool(size) is second  # asked for again: no window, nothing to compare
    finally:
        pools.shutdown()


def test_inductors_cache_folder_is_found_without_importing_torch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before torch is imported (a pool started early), by inductor's rule: the folder
    inductor itself then uses."""
    from torch._inductor.runtime import cache_dir_utils

    for name in ("torch._inductor.runtime.cache_dir_utils", "torch._inductor.runtime.runtime_utils"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    by_rule = local.inductor_cache_dir(import_torch=False)
    assert "torch._inductor.runtime.cache_dir_utils" not in sys.modules
    assert by_rule == os.path.abspath(cache_dir_utils.default_cache_dir())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "relative")
    assert local.inductor_cache_dir(import_torch=False) == str(tmp_path / "relative")


def test_who_starts_the_local_pool_early(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HOTSWAP_SERVICE", "HOTSWAP_EXECUTOR", "HOTSWAP_SCRATCH_DIR",
                 "HOTSWAP_WORKER_DEVICES", "HOTSWAP_MODE", "HOTSWAP_WORKERS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOTSWAP_START_EARLY", "on")
    monkeypatch.setattr(sys, "orig_argv", ["python", "train.py"])
    assert early._wanted() is early._pool_early
    for name, value, wanted in [
            ("HOTSWAP_EXECUTOR", "local", early._pool_early),
            ("HOTSWAP_MODE", "async", early._pool_early),
            ("HOTSWAP_WORKERS", "2", early._pool_early),
            ("HOTSWAP_SERVICE", "on", early._service_early),
            ("HOTSWAP_START_EARLY", "off", None),
            ("HOTSWAP_START_EARLY", "soon", None),
            ("HOTSWAP_EXECUTOR", "dask://scheduler:8786", None),
            ("HOTSWAP_WORKER_DEVICES", "cuda:1", None),
            ("HOTSWAP_MODE", "inprocess", None),
            ("HOTSWAP_WORKERS", "many", None),
            ("HOTSWAP_SCRATCH_DIR", "/tmp/w", None)]:
        with monkeypatch.context() as m:
            m.setenv(name, value)
            assert early._wanted() is wanted, (name, value)
    monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "hotswap.cli", "doctor"])
    assert early._wanted() is None
