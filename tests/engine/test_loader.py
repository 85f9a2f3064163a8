"""The load thread's manners: the quick GIL handoff while it works, timers in order."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from hotswap.engine.threads import Lane, gil_handoff_s, quick_gil_handoff


@pytest.fixture(autouse=True)
def users_interval() -> Iterator[float]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield 0.005
    sys.setswitchinterval(before)


def test_handoff_lowers_the_interval_and_the_last_one_out_restores_it() -> None:
    with quick_gil_handoff:
        assert sys.getswitchinterval() == pytest.approx(gil_handoff_s())
        with quick_gil_handoff:  # a second loader at once
            assert sys.getswitchinterval() == pytest.approx(gil_handoff_s())
        assert sys.getswitchinterval() == pytest.approx(gil_handoff_s())
    assert sys.getswitchinterval() == pytest.approx(0.005)
    assert not quick_gil_handoff.active


def test_handoff_keeps_a_value_the_user_set_meanwhile() -> None:
    with quick_gil_handoff:
        sys.setswitchinterval(0.001)
    assert sys.getswitchinterval() == pytest.approx(0.001)


def test_handoff_never_raises_a_lower_user_value() -> None:
    sys.setswitchinterval(1e-5)
    with quick_gil_handoff:
        assert sys.getswitchinterval() == pytest.approx(1e-5)
    assert sys.getswitchinterval() == pytest.approx(1e-5)


def test_interval_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOTSWAP_SWITCH_INTERVAL_S", "0.001")
    assert gil_handoff_s() == 0.001
    for bad in ("0", "-1", "2", "fast"):
        monkeypatch.setenv("HOTSWAP_SWITCH_INTERVAL_S", bad)
        with pytest.raises(ValueError, match="HOTSWAP_SWITCH_INTERVAL_S"):
            gil_handoff_s()


def test_loader_runs_tasks_in_order_under_the_handoff_then_restores() -> None:
    seen: list[tuple[int, float]] = []
    done = threading.Event()
    loader = Lane("hotswap-load-test", busy=lambda: quick_gil_handoff)
    release = threading.Event()
    loader.submit(release.wait, 30)  # hold the loader so the next tasks queue up behind it
    for i in range(3):
        loader.submit(lambda i=i: seen.append((i, sys.getswitchinterval())))
    loader.submit(_fails)  # logged; the loader goes on
    loader.submit(done.set)
    release.set()
    assert done.wait(30)
    assert [i for i, _ in seen] == [0, 1, 2]
    assert all(v == pytest.approx(gil_handoff_s()) for _, v in seen)
    for _ in range(200):  # the loader leaves the handoff once its queue is empty
        if not quick_gil_handoff.active:
            break
        threading.Event().wait(0.01)
    assert sys.getswitchinterval() == pytest.approx(0.005)


def _fails() -> None:
    raise RuntimeError("a failing task")


def test_timers_run_on_the_lane_when_due_in_order_and_a_cancelled_one_never() -> None:
    lane = Lane("hotswap-load-test", idle_exit_s=0.05)
    seen: list[tuple[str, str]] = []
    done = threading.Event()

    def note(what: str) -> None:
        seen.append((what, threading.current_thread().name))

    lane.later(0.3, note, "late")
    lane.later(0.1, note, "early")
    lane.later(0.2, note, "cancelled").cancel()
    lane.submit(note, "now")
    lane.later(0.4, done.set)
    assert done.wait(10)
    assert seen == [("now", "hotswap-load-test"), ("early", "hotswap-load-test"),
                    ("late", "hotswap-load-test")]


def test_a_pending_timer_keeps_the_lane_past_its_idle_time_and_drain_waits_for_tasks() -> None:
    lane = Lane("hotswap-load-test", idle_exit_s=0.05)
    fired = threading.Event()
    lane.later(0.5, fired.set)  # ten times the idle time
    assert fired.wait(10)
    slow_done: list[bool] = []
    lane.submit(lambda: (threading.Event().wait(0.3), slow_done.append(True)))
    assert lane.drain(10) and slow_done == [True]



_EXIT_SCRIPT = """
import sys, time
import hotswap.engine.runtime
from hotswap.engine import threads

def task(seconds, marker):
    time.sleep(seconds)  # as a load inside one of torch's calls, the GIL let go
    open(marker, "w").write("done")

threads.scheduler.submit(task, float(sys.argv[1]), sys.argv[2])
time.sleep(0.2)  # the task is under way; the script ends
print(time.time(), flush=True)
"""


@pytest.mark.parametrize(("task_s", "finished"), [(0.5, True), (30.0, False)])
def test_exit_waits_briefly_for_the_task_in_hand(task_s: float, finished: bool,
                                                 tmp_path: Path) -> None:
    """Interpreter exit gives a task under way on hotswap's threads up to EXIT_JOIN_S (a
    daemon thread inside one of torch's calls at finalization can abort the process), and
    no longer: exit never waits for a long one."""
    import subprocess
    import time

    from hotswap.engine.runtime import EXIT_JOIN_S

    marker = tmp_path / "done"
    done = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(task_s), str(marker)],
                          capture_output=True, text=True, timeout=120)
    exit_s = time.time() - float(done.stdout.split()[-1])  # from the script's end
    assert done.returncode == 0, done.stderr
    assert marker.exists() is finished
    if not finished:  # it waited out EXIT_JOIN_S, not the 30 s task
        assert EXIT_JOIN_S - 0.5 <= exit_s < EXIT_JOIN_S + 5.0


def test_a_forked_child_starts_with_fresh_lanes() -> None:
    """A lock a lane held at the fork stays held in the child for good: its exit, which
    stops the lanes, would hang on it."""
    import os
    import time

    from hotswap.engine import threads

    held, release = threading.Event(), threading.Event()

    def hold() -> None:  # a lane thread inside the lane's lock
        with threads.scheduler._cond:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(30)
    pid = os.fork()
    if pid == 0:  # the child: what its exit does
        threads.stop_lanes()
        os._exit(0 if not threads.join_all(1.0) else 1)
    release.set()
    holder.join()
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG)) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the child hung stopping its lanes")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(done[1]) == 0
