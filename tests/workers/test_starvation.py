"""A compile job never starves: workers below the caller's priority that get no CPU are raised
(or, where the OS refuses, their job starts over on a worker at normal priority)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from hotswap.system import proctree
from hotswap.system.starvation import STARVED_SHARE
from hotswap.workers import WorkerPool

J = "tests.workers.jobs:"


_STARVED = """
import time
from hotswap.workers.child import lower_priority
lower_priority(19, True)
start, cpu = time.monotonic(), time.process_time()
time.sleep(0)
while time.monotonic() - start < 1.0:
    pass
print(time.process_time() - cpu)
"""


@pytest.fixture
def busy_cores() -> Iterator[None]:
    """Every core kept busy at normal priority, as a caller's intra-op threads would. Skips
    where this kernel does not starve a worker at hotswap's priority against them (seen on
    Linux 6.18: a SCHED_IDLE process in its own session of niceness 19 got 0.5 s of CPU in
    0.68 s beside two spinners), since then there is no starvation to act on."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(os.cpu_count() or 1)]
    try:
        probe = subprocess.run([sys.executable, "-c", _STARVED], capture_output=True,
                               text=True, timeout=60, start_new_session=True)
        share = float(probe.stdout.strip() or 0.0)
        if share > STARVED_SHARE:
            pytest.skip(f"this kernel gave a worker at hotswap's priority {share:.0%} of a core "
                        "beside busy cores: no starvation to raise (workers/starvation.py)")
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def test_a_starved_job_is_raised_then_lowered_again(
        busy_cores: None, caplog: pytest.LogCaptureFixture) -> None:
    with WorkerPool(1, warm_modules=(), nice=19, idle=True) as pool:
        assert pool.wait_ready(60)
        future = pool.submit(J + "burn", 1.0)
        pid, policy = future.result(timeout=90)
        assert policy == os.SCHED_OTHER  # it finished raised
        assert pool.restarts == 0  # raised in place, not restarted
        # The hint, once: what starved the job and what was done about it.
        [hint] = [r.getMessage() for r in caplog.records if "every core busy" in r.getMessage()]
        assert "raised them to the caller's priority until their job ends" in hint
        # Lowered again once its job ended.
        assert pool.submit(J + "sched_policy").result(timeout=90) == os.SCHED_IDLE
        assert pool.submit(J + "pid").result(timeout=90) == pid


def test_where_the_os_refuses_the_job_restarts_at_normal_priority(
        busy_cores: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    real = proctree.set_tree_priority

    def refuse_raising(pid: int, *, nice: int, idle: bool) -> bool:
        if not idle and nice == 0:
            return False  # as for a user without CAP_SYS_NICE
        return real(pid, nice=nice, idle=idle)

    monkeypatch.setattr(proctree, "set_tree_priority", refuse_raising)
    with WorkerPool(1, warm_modules=(), nice=19, idle=True) as pool:
        assert pool.wait_ready(60)
        first = pool.submit(J + "pid").result(timeout=90)
        pid, policy = pool.submit(J + "burn", 1.0).result(timeout=120)
        assert pid != first and policy == os.SCHED_OTHER
    assert "the OS refused to raise their priority" in caplog.text


def test_an_idle_caller_leaves_the_workers_low() -> None:
    with WorkerPool(1, warm_modules=(), nice=19, idle=True) as pool:
        _, policy = pool.submit(J + "burn", 3.0).result(timeout=90)
        assert policy == os.SCHED_IDLE and pool.cpu_note() == ""
