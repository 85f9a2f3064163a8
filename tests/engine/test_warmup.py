"""Warming the process's load path: each step once, in order, and hotswap.prepare(); the heap
it leaves out of the collector's full passes."""

from __future__ import annotations

import contextlib
import gc
import importlib
import itertools
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hotswap
from hotswap import compat
from hotswap.engine import threads
from hotswap.engine.loading import warmup
from hotswap.system import heap


@pytest.fixture
def fresh_warmup(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A new warm-up whose steps only record that they ran (and on which thread)."""
    ran: list[str] = []
    steps = {name: (lambda name=name: ran.append(f"{name}@{threading.current_thread().name}"))
             for name in ("common", "cpu", "cuda")}
    monkeypatch.setattr(warmup, "_STEPS", steps)
    monkeypatch.setattr(warmup, "_warmup", warmup._Warmup())
    return ran


def test_steps_run_once_each_on_the_load_thread(fresh_warmup: list[str]) -> None:
    assert warmup.wait_warmup(["cpu"], timeout_s=30)
    assert warmup.wait_warmup(["cpu", "cuda:0"], timeout_s=30)
    assert warmup.wait_warmup(["cuda:1"], timeout_s=30)
    assert fresh_warmup == ["common@hotswap-load", "cpu@hotswap-load",
                            "cuda@hotswap-load"]


def test_a_failing_step_is_logged_and_counts_as_done(fresh_warmup: list[str],
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> None:
        raise RuntimeError("no compiler")

    monkeypatch.setitem(warmup._STEPS, "cpu", broken)
    with caplog.at_level("INFO", logger="hotswap"):
        assert warmup.wait_warmup(["cpu"], timeout_s=30)
    assert "no compiler" in caplog.text


def test_the_real_cpu_warmup_runs_no_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(warmup, "_warmup", warmup._Warmup())  # its steps run again
    with hotswap.counters_delta() as delta:
        assert warmup.wait_warmup(["cpu"], timeout_s=240)
    assert delta["load_compiler_runs"] == 0


def test_prepare_starts_the_pool_and_checks_its_arguments() -> None:
    assert hotswap.prepare(workers=1, devices=["cpu"], wait=True, timeout_s=240) is True
    with pytest.raises(ValueError, match="devices"):
        hotswap.prepare(devices=["tpu"])
    with pytest.raises(ValueError, match="workers"):
        hotswap.prepare(workers=0)


def test_intra_op_threads_are_set_for_the_block_only() -> None:
    from hotswap.compat import intra_op_threads

    before = torch.get_num_threads()
    with intra_op_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with intra_op_threads(None):
        assert torch.get_num_threads() == before


def _interpreter_work(seconds: float) -> tuple[float, float]:
    """Python calls for ``seconds`` of wall time: (wall, this thread's CPU) it took."""
    def f(i: int) -> int:
        return i + 1

    wall, cpu = time.perf_counter(), time.thread_time()
    while time.perf_counter() - wall < seconds:
        for i in range(200):
            f(i)
    return time.perf_counter() - wall, time.thread_time() - cpu


def test_yielding_gil_rests_between_short_runs_unless_wanted() -> None:
    earlier = sys.gettrace()  # a coverage tool's, or None
    assert not threads.yielding()
    with threads.yielding_gil():
        assert threads.yielding()
        wall, cpu = _interpreter_work(0.5)
    assert sys.gettrace() is earlier and not threads.yielding()  # the block's hook alone
    # 2 ms of work, then 4 ms asleep without the GIL: about a third of the time on the CPU
    # (compared with the same work unrested, as a busy machine slows both alike)
    assert cpu < 0.5 * wall, (cpu, wall)
    with threads.yielding_gil(unless=lambda: True):  # someone waits: 1 ms rests
        wall_wanted, cpu_wanted = _interpreter_work(0.5)
    assert 1.5 * cpu / wall < cpu_wanted / wall_wanted < 0.85, (cpu, wall, cpu_wanted,
                                                                wall_wanted)
    with threads.yielding_gil(unless=lambda: True, wanted_rest_s=0):  # no rests
        wall_full, cpu_full = _interpreter_work(0.5)
    assert cpu_full / wall_full > 1.2 * cpu_wanted / wall_wanted, (cpu_full, wall_full)


def _tick() -> float:
    return time.perf_counter()  # a Python function start: the block's check


@contextlib.contextmanager
def _stamped(**block: Any) -> Iterator[list[float]]:
    """A thread in a yielding block noting the time at every turn of a Python loop, for the
    length of the ``with``."""
    stamps: list[float] = []
    done = threading.Event()

    def run() -> None:
        with threads.yielding_gil(**block):
            while not done.is_set():
                stamps.append(_tick())

    worker = threading.Thread(target=run)
    worker.start()
    try:
        yield stamps
    finally:
        done.set()
        worker.join(30)


def _user_call(seconds: float) -> tuple[float, float]:
    """A user call on eager that waits without the GIL (as a torch op does): its span."""
    ident = threads.user_calls.enter()
    start = time.perf_counter()
    try:
        time.sleep(seconds)
    finally:
        threads.user_calls.exit(ident)
    return start, time.perf_counter()


def test_a_yielding_thread_stays_off_the_gil_while_a_user_call_runs() -> None:
    with _stamped(run_s=math.inf, rest_s=0.0) as stamps:
        time.sleep(0.05)
        calls = []
        for _ in range(20):  # each under the longest deferral, 2 ms apart
            calls.append(_user_call(0.004))
            time.sleep(0.002)
    assert not threads.user_calls.running()
    inside = [t for t in stamps for a, b in calls if a + 0.001 < t < b]
    # it ran between the calls and not within them, past the moment it looked
    assert not inside, (len(inside), len(stamps))
    between = [t for t in stamps for (_, b), (a, _) in itertools.pairwise(calls) if b < t < a]
    assert between and any(t < calls[0][0] for t in stamps)


def test_calls_back_to_back_still_let_a_deferring_thread_run() -> None:
    with _stamped(run_s=math.inf, rest_s=0.0) as stamps:
        time.sleep(0.02)
        start, end = _user_call(0.1)  # ten times the longest deferral
    during = [t for t in stamps if start + threads.YIELD_DEFER_S < t < end]
    assert during, "a call that never ends must not stop the work for good"
    # deferring YIELD_DEFER_S, then running YIELD_RUN_S: under half the call's time
    ran = {round(t, 3) for t in during}  # the milliseconds it ran in
    assert len(ran) < 0.5 * (end - start) * 1e3, sorted(ran)


def test_during_a_long_compile_a_deferring_thread_runs_a_little() -> None:
    """Dynamo's trace is one long stretch of the user's Python: a deferring thread runs
    YIELD_RUN_S in YIELD_DEFER_COMPILE_S (it ran 2 ms in 12 before, a sixth of the trace),
    and runs at all (a compile that never ends must not stop the work for good)."""
    with _stamped(run_s=math.inf, rest_s=0.0) as stamps:
        time.sleep(0.02)
        threads.dynamo_compiling(True)
        start = time.perf_counter()
        try:
            _interpreter_work(0.5)  # the trace: the user's thread holds the GIL throughout
        finally:
            threads.dynamo_compiling(False)
        end = time.perf_counter()
    ran = {round(t, 3) for t in stamps if start + threads.YIELD_DEFER_COMPILE_S < t < end}
    assert ran, "the work must go on"
    assert len(ran) < 0.1 * (end - start) * 1e3, sorted(ran)


def test_a_thread_the_user_waits_for_does_not_defer() -> None:
    with _stamped(run_s=math.inf, rest_s=0.0, unless=lambda: True,
                  full_speed=lambda: True) as stamps:
        time.sleep(0.02)
        start, _ = _user_call(0.03)
    assert any(start + 0.002 < t < start + threads.YIELD_DEFER_S for t in stamps)


def test_a_thread_that_only_defers_goes_full_speed_once_the_user_waits() -> None:
    user_waits = threading.Event()
    with threads.yielding_gil(unless=lambda: True, wanted_rest_s=0.0,
                              full_speed=user_waits.is_set):
        _interpreter_work(0.01)  # past its first run: from here it only defers
        assert threads.yielding()
        user_waits.set()
        _interpreter_work(0.01)
        assert not threads.yielding()


def test_a_lanes_deferring_block_never_rests_while_no_call_runs() -> None:
    with threads.deferring():
        assert threads.yielding()
        wall, cpu = _interpreter_work(0.3)
    # no sleep but the deferral's (a rest of 1 ms in 3 would leave about two thirds)
    assert cpu > 0.85 * wall, (cpu, wall)


def test_a_lane_defers_on_312_and_a_waiting_user_makes_it_run_at_full_speed() -> None:
    lane = threads.Lane("test-lane", busy=threads._lane_busy)
    seen: list[bool] = []
    ran = threading.Event()

    def task() -> None:
        seen.append(threads.yielding())
        _interpreter_work(0.01)  # a user waits (below): it stops looking
        seen.append(threads.yielding())
        ran.set()

    with threads.user_waiting():
        lane.submit(task)
        assert ran.wait(30)
    lane.stop()
    # 3.11's trace function would slow every lane task: there the lanes do not defer
    assert seen == ([True, False] if sys.version_info >= (3, 12) else [False, False])


def test_a_step_a_load_waits_for_still_defers(
        fresh_warmup: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bool] = []

    def step() -> None:
        _interpreter_work(0.01)  # past its first run, with a load waiting
        seen.append(threads.yielding())

    monkeypatch.setitem(warmup._STEPS, "common", step)
    warmup._warmup.wanted.set()  # as a load's wait does, from hotswap's own thread
    for event in warmup._warmup.start(["cpu"]):
        assert event.wait(30)
    # still deferring to the user's calls, 3.11 included (there its trace function makes
    # the imports take 1.6x as long; at full speed the calls beside them were 5x as slow)
    assert seen == [True]


def test_a_forked_child_forgets_the_calls_of_threads_it_does_not_have() -> None:
    entered, release = threading.Event(), threading.Event()

    def in_a_call() -> None:
        ident = threads.user_calls.enter()
        entered.set()
        release.wait(30)
        threads.user_calls.exit(ident)

    caller = threading.Thread(target=in_a_call)
    caller.start()
    assert entered.wait(30)
    try:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: no caller thread here
            os.write(write, b"1" if threads.user_calls.running() else b"0")
            os._exit(0)
        os.close(write)
        assert os.read(read, 1) == b"0" and threads.user_calls.running()
        os.waitpid(pid, 0)
    finally:
        release.set()
        caller.join(30)


def test_a_user_call_on_eager_is_marked_running() -> None:
    from hotswap.engine.graph import GraphRunner

    seen: list[bool] = []
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    traced = gm.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        seen.append(threads.user_calls.running())
        return traced(x)

    gm.forward = forward  # type: ignore[method-assign]
    runner = GraphRunner("g", gm, ["default"])
    assert runner(torch.zeros(1)).item() == 1
    with pytest.raises(TypeError):
        runner("not a tensor")  # eager raises: the mark goes all the same
    assert seen == [True, True] and not threads.user_calls.running()


def test_a_frame_dynamo_compiles_is_marked_running_unless_the_user_waits_in_it() -> None:
    """The user's call waits for dynamo's trace: hotswap's deferring threads stay off the GIL
    meanwhile (threads.dynamo_compiling), except where that call waits for their work."""
    seen: list[tuple[bool, bool]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        running = threads.user_calls.running()
        with threads.user_waiting():  # a waiting mode's first call
            seen.append((running, threads.user_calls.running()))
        return gm.forward

    compat.on_dynamo_compiles(threads.dynamo_compiling)
    compat.on_dynamo_compiles(threads.dynamo_compiling)  # once is enough
    try:
        for scale in (2, 3):  # the second after a reset, which drops the callbacks
            fn = torch.compile(lambda x, s=scale: x * s, backend=backend)
            assert not threads.user_calls.running()
            assert fn(torch.ones(2)).tolist() == [scale, scale]
            assert not threads.user_calls.running()  # ended with the compile
            assert seen == [(True, False)]
            seen.clear()
            torch._dynamo.reset()
            compat.on_dynamo_compiles(threads.dynamo_compiling)
        marks: list[bool] = []
        compat.on_dynamo_compiles(marks.append)
        fn = torch.compile(lambda x: x + 1, backend=backend)
        with pytest.raises(TypeError):
            fn("not a tensor")  # dynamo's own failure: the mark ends all the same
        assert marks == [True, False] and not threads.user_calls.running()
    finally:
        torch._dynamo.reset()


_SLOW_MODULE = """
def _step(i):
    return i + 1

for _ in range({rounds}):  # Python calls: a deferring thread ticks at their starts
    for _i in range(200):
        _step(_i)
"""


def _waiting_for_a_yielding_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   tracing: bool, *, ours: bool = False,
                                   **block: Any) -> tuple[float, float]:
    """How long the user's thread waits for a module a thread in a yielding block (``block``)
    is importing, against that import alone at full speed; ``tracing``: the user's thread
    is in a dynamo trace meanwhile; ``ours``: a thread of hotswap's waits instead."""
    for name in ("slow_a", "slow_b"):
        (tmp_path / f"{name}.py").write_text(_SLOW_MODULE.format(rounds=1500))
    monkeypatch.syspath_prepend(str(tmp_path))
    took: dict[str, float] = {}

    def importing(name: str, **block: Any) -> None:
        with threads.yielding_gil(**block):
            t = time.perf_counter()
            importlib.import_module(name)
            took[name] = time.perf_counter() - t

    alone = threading.Thread(target=importing, args=("slow_a",),
                             kwargs={"run_s": math.inf, "rest_s": 0.0})
    alone.start()
    alone.join(30)
    if tracing:
        threads.dynamo_compiling(True)  # the user's thread traces from here
    try:
        beside = threading.Thread(target=importing, args=("slow_b",), kwargs=block)
        beside.start()
        time.sleep(0.03)  # into the import, deferring or resting
        t = time.perf_counter()
        if ours:
            threads.start(importlib.import_module, name="hotswap-test", args=("slow_b",)).join(30)
        else:
            importlib.import_module("slow_b")  # the user's thread needs it: waits on its lock
        waited = time.perf_counter() - t
        beside.join(30)
    finally:
        if tracing:
            threads.dynamo_compiling(False)
        for name in ("slow_a", "slow_b"):
            sys.modules.pop(name, None)
    return waited, took["slow_a"]


def test_a_thread_another_waits_on_to_finish_an_import_does_not_defer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A yielding thread importing a module that the user's thread (inside a trace, or a
    call) then imports too: the user's thread waits for the import lock, so the importing
    thread runs on rather than deferring to it at 2 ms in 12."""
    waited, alone = _waiting_for_a_yielding_import(tmp_path, monkeypatch, True,
                                                   run_s=math.inf, rest_s=0.0)
    # the user's thread waited for the rest of the import at full speed (deferring all the
    # way, about six times as long as the import alone)
    assert waited < 2.0 * alone, (waited, alone)


def test_a_thread_another_waits_on_to_finish_an_import_does_not_rest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same with no call running (``hotswap.prepare()`` first thing: the warm-up imports
    while the user's thread builds its model, and imports what it imports): the importing
    thread runs on rather than resting 4 ms after every 2 ms of its own."""
    waited, alone = _waiting_for_a_yielding_import(tmp_path, monkeypatch, False)
    # resting all the way: about three times as long as the import alone
    assert waited < 2.0 * alone, (waited, alone)


def test_a_thread_of_hotswaps_waiting_on_an_import_changes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the thread that waits is hotswap's own (triton's warm-up beside the imports), the
    importing thread rests as before: the user's calls still come first."""
    waited, alone = _waiting_for_a_yielding_import(tmp_path, monkeypatch, False, ours=True)
    assert waited > 1.5 * alone, (waited, alone)  # 4 ms asleep after every 2 ms


@pytest.mark.skipif(sys.version_info < (3, 12), reason="sys.monitoring is Python 3.12+")
def test_on_312_a_user_call_is_seen_at_the_next_function_start() -> None:
    """The clock is looked at every 16th start, but a running call at each: work with a
    millisecond of C between its starts stops at the next one, not 16 ms into the call."""
    stamps: list[float] = []
    stop = [False]  # no function start to look at it: the loop's one start is _tick's

    def run() -> None:
        with threads.yielding_gil(run_s=math.inf, rest_s=0.0):
            while not stop[0]:
                stamps.append(_tick())
                time.sleep(0.001)  # C work between two function starts

    worker = threading.Thread(target=run)
    worker.start()
    try:
        time.sleep(0.02)
        state = threads._monitoring._active[worker.ident or 0]
        deadline = time.monotonic() + 5
        while state.skip != threads._Monitoring.TICK_EVERY - 1:  # it has just ticked
            assert time.monotonic() < deadline
            time.sleep(0.0001)
        start, end = _user_call(0.008)  # its next tick 15 ms away; under the longest deferral
    finally:
        stop[0] = True
        worker.join(30)
    inside = [round((t - start) * 1e3, 1) for t in stamps if start + 0.003 < t < end]
    assert not inside, inside


@pytest.mark.skipif(sys.version_info < (3, 12), reason="sys.monitoring is Python 3.12+")
def test_on_312_yielding_instruments_no_other_thread() -> None:
    """A trace function on one thread makes 3.12 instrument every line for every thread;
    sys.monitoring's PY_START alone does not, and a thread outside the block is told to
    disable the function it starts."""
    monitoring = sys.monitoring  # type: ignore[attr-defined,unused-ignore]
    other: list[Any] = []
    inside, done = threading.Event(), threading.Event()

    def block() -> None:
        with threads.yielding_gil(unless=lambda: True):
            other.append((sys.gettrace(), threads.yielding()))
            inside.set()
            while not done.is_set():
                _interpreter_work(0.01)

    worker = threading.Thread(target=block)
    worker.start()
    assert inside.wait(30)
    try:
        tool = threads._monitoring._tool
        assert tool is not None and monitoring.get_tool(tool) == "hotswap"
        assert monitoring.get_events(tool) == monitoring.events.PY_START
        assert not threads.yielding()  # this thread is not in the block
        assert threads._monitoring._on_start(None, 0) is monitoring.DISABLE
    finally:
        done.set()
        worker.join(30)
    assert other == [(None, True)]  # no trace function, yet it yields
    assert monitoring.get_events(tool) == 0  # off once no thread is in a block


def test_the_warmup_yields_until_a_load_waits_for_it(fresh_warmup: list[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, float, float]] = []

    def step(name: str) -> Callable[[], None]:
        def run() -> None:
            wall, cpu = _interpreter_work(0.4)
            seen.append((name, wall, cpu))
        return run

    monkeypatch.setitem(warmup._STEPS, "common", step("common"))
    monkeypatch.setitem(warmup._STEPS, "cpu", step("cpu"))
    warmup.start_warmup(["cpu"])  # nobody waits
    deadline = time.monotonic() + 30
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert warmup.wait_warmup(["cpu"], timeout_s=30)  # now a load waits
    (_, wall0, cpu0), (_, wall1, cpu1) = seen
    assert cpu0 < 0.5 * wall0 and cpu1 / wall1 > 1.5 * cpu0 / wall0, seen


def test_a_users_thread_waiting_runs_the_warmup_at_full_speed(
        fresh_warmup: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    hooked: list[bool] = []
    started = threading.Event()

    def common() -> None:
        _interpreter_work(0.05)
        hooked.append(threads.yielding())  # the hook is in place
        started.set()
        deadline = time.monotonic() + 30
        while not warmup._warmup.blocking.is_set() and time.monotonic() < deadline:
            _interpreter_work(0.01)
        _interpreter_work(0.05)  # the hook's next look at the clock removes it
        hooked.append(threads.yielding())

    monkeypatch.setitem(warmup._STEPS, "common", common)
    monkeypatch.setattr(warmup, "_warmup", warmup._Warmup())
    warmup.start_warmup([])
    assert started.wait(30)
    assert warmup.wait_warmup([], timeout_s=30)  # this thread is the user's: nothing to spare
    assert hooked == [True, False]


def test_the_warmup_stops_yielding_once_a_task_waits_behind_it(
        fresh_warmup: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[float, float]] = []
    queued = threading.Event()

    def common() -> None:
        wall, cpu = _interpreter_work(0.3)  # alone on the lane: yields
        seen.append((wall, cpu))
        threads.scheduler.submit(queued.set)  # a load arrives, queued behind this step
        seen.append(_interpreter_work(0.3))

    monkeypatch.setitem(warmup._STEPS, "common", common)
    warmup.start_warmup([])
    assert queued.wait(30)
    (wall0, cpu0), (wall1, cpu1) = seen
    assert cpu0 < 0.5 * wall0 and cpu1 / wall1 > 1.5 * cpu0 / wall0, seen


@pytest.fixture
def thawed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The collector as if nothing had frozen this process's heap yet."""
    gc.unfreeze()
    monkeypatch.setattr(heap, "_froze", False)
    monkeypatch.setattr(heap, "_program_froze", False)
    yield
    gc.unfreeze()


def _step_making(made: list[list[int]], before: object = None) -> Callable[[], None]:
    def run() -> None:  # as an import does: objects that stay
        if before is not None:  # frozen as the step starts: its imports' passes skip it
            made.append([int(_tracked(before))])
        made.extend([i] for i in range(1000))  # lists: always tracked
    return run


def _tracked(obj: object) -> bool:
    """Whether the collector's full passes see ``obj`` (frozen objects are in no generation)."""
    return any(o is obj for o in gc.get_objects())


def test_a_step_leaves_what_it_made_out_of_full_collections_until_a_reset(
        fresh_warmup: list[str], thawed: None, monkeypatch: pytest.MonkeyPatch) -> None:
    before = [1]  # the program's, alive when the warm-up starts
    made: list[list[int]] = []
    monkeypatch.setitem(warmup._STEPS, "cpu", _step_making(made, before))
    hotswap.backend(mode="async")  # registers hotswap's reset hook with dynamo
    assert warmup.wait_warmup(["cpu"], timeout_s=30)
    assert made[0] == [0]  # untracked inside the step already
    assert gc.get_freeze_count() >= len(made) == 1001
    assert not _tracked(made[1]) and not _tracked(before)
    torch.compiler.reset()  # a cycle among them could outlive its user: thawed
    assert gc.get_freeze_count() == 0 and _tracked(made[1]) and _tracked(before)


def test_a_heap_the_program_froze_first_stays_frozen_at_reset(
        fresh_warmup: list[str], thawed: None, monkeypatch: pytest.MonkeyPatch) -> None:
    mine = [[i] for i in range(1000)]
    gc.freeze()  # as a server does after its start
    made: list[list[int]] = []
    monkeypatch.setitem(warmup._STEPS, "cpu", _step_making(made))
    hotswap.backend(mode="async")
    assert warmup.wait_warmup(["cpu"], timeout_s=30)
    torch.compiler.reset()
    assert not _tracked(made[0]) and not _tracked(mine[0])


def test_gc_freeze_off_leaves_the_collector_alone(
        fresh_warmup: list[str], thawed: None, monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[list[int]] = []
    monkeypatch.setitem(warmup._STEPS, "cpu", _step_making(made))
    monkeypatch.setenv("HOTSWAP_GC_FREEZE", "off")
    assert warmup.wait_warmup(["cpu"], timeout_s=30)
    assert gc.get_freeze_count() == 0 and _tracked(made[0])
    monkeypatch.setenv("HOTSWAP_GC_FREEZE", "yes")  # malformed: nothing frozen, the step ends
    monkeypatch.setattr(warmup, "_warmup", warmup._Warmup())
    assert warmup.wait_warmup(["cpu"], timeout_s=30)
    assert gc.get_freeze_count() == 0
    with pytest.raises(ValueError, match="HOTSWAP_GC_FREEZE must be 'on' or 'off'"):
        hotswap.compile(torch.nn.ReLU())


_LOAD_IMPORTS = r"""
import json, sys, threading
import torch
import hotswap

hotswap.prepare(devices=["cpu"], wait=True, timeout_s=300)
imported = []
def hook(event, args):
    if (event == "import" and args[0] not in sys.modules
            and threading.current_thread().name == "hotswap-load"):
        imported.append(args[0])
sys.addaudithook(hook)
model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.LayerNorm(32), torch.nn.GELU())
fast = hotswap.compile(model, mode="async", workers=1)
x = torch.randn(4, 32)
with torch.no_grad():
    fast(x)
    [status] = hotswap.wait(fast, timeout_s=300)
print(json.dumps({"tier": status.tier, "imported": imported}))
"""


def test_after_the_warmup_a_load_imports_only_its_own_kernels(tmp_path: Path) -> None:
    """Every module a CPU load needs was imported by the warm-up (off the load, yielding):
    the load imports only the generated kernel modules it loads."""
    env = {**os.environ, "HOTSWAP_CACHE_DIR": str(tmp_path / "cache"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "HOTSWAP_SERVICE": "off"}
    done = subprocess.run([sys.executable, "-c", _LOAD_IMPORTS], env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["tier"] == "default"
    named = [m for m in result["imported"] if not m.endswith(".kernel")]
    assert named == [], named

