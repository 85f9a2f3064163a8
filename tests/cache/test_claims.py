"""Compile claims across processes: a waiter waits for a busy holder, not for a stopped one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hotswap.engine.sources.cache_access import STOPPED_GRACE_S, CacheAccess

KEY = "f" * 64

# Take the claim on KEY, say so, then hold it (release after argv[2] s; 0: never).
_HOLDER = r"""
import sys, time, torch
from hotswap.engine.sources.cache_access import CacheAccess
access = CacheAccess(sys.argv[1], None)
access.keys(torch.fx.symbolic_trace(torch.nn.ReLU()), (), False, [])
assert access.claim("f" * 64)
print("claimed", flush=True)
hold = float(sys.argv[2])
time.sleep(hold if hold else 3600)
access.release("f" * 64)
print("released", flush=True)
time.sleep(3600)
"""


def _holder(cache: Path, hold_s: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(cache), str(hold_s)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "claimed"
    return proc


def _waiter(cache: Path) -> CacheAccess:
    access = CacheAccess(str(cache), 120.0)
    access.keys(torch.fx.symbolic_trace(torch.nn.ReLU()), (), False, [])
    assert not access.claim(KEY)  # held by the other process
    return access


def test_a_busy_holder_is_waited_for(tmp_path: Path) -> None:
    holder = _holder(tmp_path, 1.5)
    try:
        assert _waiter(tmp_path).wait_for_holder(KEY) is True
    finally:
        holder.kill()
        holder.wait()


def test_a_stopped_holder_is_given_up_on(tmp_path: Path,
                                         caplog: pytest.LogCaptureFixture) -> None:
    holder = _holder(tmp_path, 0)
    try:
        access = _waiter(tmp_path)
        os.kill(holder.pid, signal.SIGSTOP)  # as a Ctrl-Z'd process holding the claim
        start = time.monotonic()
        assert access.wait_for_holder(KEY) is False
        waited = time.monotonic() - start
        assert STOPPED_GRACE_S <= waited < 30  # not the 120 s limit
        assert f"process {holder.pid} holds the compile claim" in caplog.text
    finally:
        os.kill(holder.pid, signal.SIGCONT)
        holder.kill()
        holder.wait()
