from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hotswap.errors import (
    CompileFailed,
    JobTimeout,
    MemoryLimitExceeded,
    PoolClosed,
    RemoteTraceback,
    SerializationFailed,
    WorkerCrashed,
)
from hotswap.testing.faults import FailsToUnpickle
from hotswap.workers import JobFuture, StageEvent, WorkerPool
from tests.conftest import gone, wait_gone
from tests.workers import jobs

F = "hotswap.testing.faults:"
J = "tests.workers.jobs:"


@pytest.fixture
def pool() -> Iterator[WorkerPool]:
    # No torch pre-import: these tests exercise the pool, and restarts must stay cheap.
    p = WorkerPool(2, warm_modules=(), rss_limit_bytes=400 * 2**20)
    yield p
    p.shutdown()


def wait_running(future: JobFuture, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not future.running() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert future.running()


@dataclass(frozen=True)
class Crash:
    job: str
    payload: Any
    error: type[BaseException]
    fields: dict[str, Any]
    replaces_worker: bool
    timeout_s: float | None = None


CRASHES = {
    "payload-unpicklable-in-parent": Crash(
        F + "echo", lambda: None, SerializationFailed, {"what": "payload", "where": "parent"},
        replaces_worker=False),
    "payload-unpickling-fails-in-worker": Crash(
        F + "echo", FailsToUnpickle(), SerializationFailed, {"what": "payload", "where": "worker"},
        replaces_worker=False),
    "job-raises": Crash(
        F + "raise_error", "boom", CompileFailed,
        {"remote_type": "builtins.RuntimeError", "remote_message": "boom"},
        replaces_worker=False),
    "os-exit": Crash(
        F + "exit", 3, WorkerCrashed, {"exitcode": 3, "signal_name": None}, replaces_worker=True),
    "sigkill": Crash(
        F + "sigkill", None, WorkerCrashed, {"exitcode": -9, "signal_name": "SIGKILL"},
        replaces_worker=True),
    "segfault": Crash(
        F + "segfault", None, WorkerCrashed, {"exitcode": -11, "signal_name": "SIGSEGV"},
        replaces_worker=True),
    "hang-past-timeout": Crash(
        F + "hang", None, JobTimeout, {"timeout_s": 0.5}, replaces_worker=True, timeout_s=0.5),
    "memory-past-limit": Crash(
        F + "allocate", 1200 * 2**20, MemoryLimitExceeded, {"rss_limit_bytes": 400 * 2**20},
        replaces_worker=True, timeout_s=60),
    "result-unpicklable-in-worker": Crash(
        F + "unpicklable_result", None, SerializationFailed, {"what": "result", "where": "worker"},
        replaces_worker=False),
    "result-unpickling-fails-in-parent": Crash(
        J + "result_fails_to_unpickle", None, SerializationFailed,
        {"what": "result", "where": "parent"}, replaces_worker=False),
}


@pytest.mark.parametrize("case", CRASHES.values(), ids=CRASHES.keys())
def test_crash_matrix(pool: WorkerPool, case: Crash) -> None:
    pool.wait_ready(30)
    pids_before = set(pool.worker_pids())
    future = pool.submit(case.job, case.payload, timeout_s=case.timeout_s)
    with pytest.raises(case.error) as info:
        future.result(timeout=60)
    for name, value in case.fields.items():
        assert getattr(info.value, name) == value, name
    if isinstance(info.value, CompileFailed):
        assert isinstance(info.value.__cause__, RemoteTraceback)
        assert "raise_error" in info.value.__cause__.text
    if isinstance(info.value, MemoryLimitExceeded):
        assert info.value.rss_bytes > info.value.rss_limit_bytes
    if case.replaces_worker:
        assert future.worker_pid in pids_before
        assert wait_gone([future.worker_pid], 2.0) == []
        assert pool.restarts == 1
    # The pool is still usable, with its full complement of workers.
    assert pool.submit(F + "echo", 42).result(timeout=30) == 42
    assert pool.wait_ready(30)
    assert len(pool.worker_pids()) == 2


def test_crash_leaves_other_workers_jobs_alone(pool: WorkerPool) -> None:
    pool.wait_ready(30)
    slow = pool.submit(F + "sleep", 1.0)
    time.sleep(0.1)
    crash = pool.submit(F + "sigkill")
    with pytest.raises(WorkerCrashed):
        crash.result(timeout=30)
    assert slow.result(timeout=30) == 1.0
    assert slow.worker_pid != crash.worker_pid


def test_timeout_kills_grandchildren(pool: WorkerPool, tmp_path: Path) -> None:
    pid_file = tmp_path / "sleeper.pid"
    future = pool.submit(F + "spawn_sleeper", str(pid_file), timeout_s=1.5)
    with pytest.raises(JobTimeout):
        future.result(timeout=30)
    assert future.worker_pid is not None
    grandchild = int(pid_file.read_text())
    assert wait_gone([future.worker_pid, grandchild], 1.0) == []


def test_results_and_big_payloads_round_trip(pool: WorkerPool) -> None:
    big = bytes(range(256)) * (10 * 2**20 // 256)
    assert pool.submit(F + "echo", big).result(timeout=30) == big
    futures = [pool.submit(F + "echo", {"i": i}) for i in range(50)]
    assert [f.result(timeout=30) for f in futures] == [{"i": i} for i in range(50)]


def test_stage_events_stream_to_subscribers_and_future(pool: WorkerPool) -> None:
    seen: list[StageEvent] = []
    unsubscribe = pool.subscribe(seen.append)
    future = pool.submit(F + "staged", ["lower", "codegen", "save"])
    assert future.result(timeout=30) == ["lower", "codegen", "save"]
    names = [e.name for e in future.stage_events]
    assert names == ["worker_deserialize", "lower", "codegen", "save"]
    assert all(e.pid == future.worker_pid and e.job_id == future.job_id
               for e in future.stage_events)
    starts = [e.start_s for e in future.stage_events]
    assert starts == sorted(starts)
    assert all(e.end_s >= e.start_s for e in future.stage_events)
    assert future.stage_events[1].attrs == {"job": "staged"}
    assert [e.name for e in seen] == names
    unsubscribe()
    pool.submit(F + "staged", ["again"]).result(timeout=30)
    assert len(seen) == 4


def test_cancel_queued_job_never_runs() -> None:
    with WorkerPool(1, warm_modules=()) as pool:
        busy = pool.submit(F + "sleep", 0.5)
        queued = pool.submit(F + "echo", "never")
        assert queued.cancel()
        assert queued.cancelled()
        assert busy.result(timeout=30) == 0.5
        assert pool.restarts == 0  # cancelling a queued job kills nothing


def test_cancel_running_job_kills_and_replaces_its_worker(pool: WorkerPool) -> None:
    future = pool.submit(F + "hang")
    wait_running(future)
    assert future.cancel()
    with pytest.raises(CancelledError):
        future.result()
    assert future.worker_pid is not None
    assert wait_gone([future.worker_pid], 2.0) == []
    assert pool.submit(F + "echo", 1).result(timeout=30) == 1


def test_worker_env_hook_per_slot() -> None:
    with WorkerPool(2, warm_modules=(), worker_env=lambda slot: {"HS_SLOT": str(slot)}) as pool:
        pool.wait_ready(30)
        values = set()
        # Both workers are idle; two simultaneous slow-ish jobs land on both slots.
        futures = [pool.submit(J + "getenv", "HS_SLOT") for _ in range(8)]
        values = {f.result(timeout=30) for f in futures}
        assert values <= {"0", "1"} and values
    with WorkerPool(1, warm_modules=(), worker_env={"HS_FIXED": "yes"}) as pool:
        assert pool.submit(J + "getenv", "HS_FIXED").result(timeout=30) == "yes"


def test_nice_lowers_worker_priority() -> None:
    with WorkerPool(1, warm_modules=(), nice=5) as pool:
        assert pool.submit(J + "niceness").result(timeout=30) == os.nice(0) + 5
        # Workers lead their own session: with autogroup scheduling its niceness is what
        # decides the CPU share against the caller's session.
        if jobs.autogroup_nice() is not None:
            assert pool.submit(J + "autogroup_nice").result(timeout=30) == 5


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux-only")
def test_idle_workers_run_in_an_idle_cgroup_or_under_sched_idle_in_a_lowest_session() -> None:
    with WorkerPool(1, warm_modules=(), idle=True) as pool:
        assert jobs.is_idle(pool.submit(J + "lowered").result(timeout=30), os.getpid())
        if pool.priority_note().startswith("autogroup"):  # no cgroup: they lowered themselves
            assert pool.submit(J + "sched_policy").result(timeout=30) == os.SCHED_IDLE
            assert pool.submit(J + "autogroup_nice").result(timeout=30) == 19
    with WorkerPool(1, warm_modules=()) as pool:  # off unless asked for
        assert pool.submit(J + "sched_policy").result(timeout=30) == os.sched_getscheduler(0)


def test_workers_prewarm_torch_by_default() -> None:
    with WorkerPool(1) as pool:
        assert pool.wait_ready(120)
        loaded = pool.submit(J + "loaded", ["torch", "torch._inductor.compile_fx"]).result(60)
        assert loaded == {"torch": True, "torch._inductor.compile_fx": True}


def test_warm_steps_run_after_ready_and_a_waiting_job_goes_ahead_of_the_rest() -> None:
    steps = (J + "warm_slowly", J + "warm_quickly")
    with WorkerPool(1, warm_modules=steps) as pool:
        # Queued before the worker is ready: it runs first, and no warm-up step runs ahead.
        assert pool.submit(J + "warm_steps").result(timeout=60) == []
        # Once no job waits, the steps it went ahead of run, in order.
        _wait_for_steps(pool, ["slow", "quick"])
        [info] = pool.workers_info()  # what the pool was told (the service reads it)
        assert info.steps_done == steps and info.jobs_done >= 2 and not info.warming
    with WorkerPool(1, warm_modules=steps) as pool:
        assert pool.wait_ready(60)
        time.sleep(0.3)  # the slow step is under way: the job waits for it, then goes first
        assert pool.submit(J + "warm_steps").result(timeout=60) == ["slow"]
        _wait_for_steps(pool, ["slow", "quick"])


def test_a_warm_step_that_fails_is_not_counted_as_run() -> None:
    with WorkerPool(1, warm_modules=(J + "warm_failing", J + "warm_quickly")) as pool:
        assert pool.wait_ready(60)
        _wait_for_steps(pool, ["quick"])
        [info] = pool.workers_info()
        assert info.steps_done == (J + "warm_quickly",) and not info.warming


def _wait_for_steps(pool: WorkerPool, expected: list[str]) -> None:
    deadline = time.monotonic() + 30
    while (steps := pool.submit(J + "warm_steps").result(timeout=60)) != expected:
        assert time.monotonic() < deadline, steps
        time.sleep(2.0)  # each look is a job: the steps wait for the worker to idle after it


def test_a_job_sent_during_a_warm_step_is_timed_from_the_step_s_end() -> None:
    with WorkerPool(1, warm_modules=(J + "warm_slowly",)) as pool:
        assert pool.wait_ready(60)
        time.sleep(0.3)  # the 1 s step is under way: its rest would be past the job's limit
        assert pool.submit(F + "echo", 7, timeout_s=0.6).result(timeout=60) == 7
        assert pool.submit(J + "warm_steps").result(timeout=60) == ["slow"]


def test_a_job_goes_to_a_worker_not_in_a_warm_step(tmp_path: Path) -> None:
    gate = tmp_path / "go"

    def env(slot: int) -> dict[str, str]:  # the first worker stays in its step until the gate
        return {"WARM_BLOCK": str(gate)} if slot == 0 else {"SLOT": "1"}

    with WorkerPool(2, warm=2, warm_modules=(J + "warm_blocked",), worker_env=env) as pool:
        try:
            assert pool.wait_ready(60)
            time.sleep(0.5)  # past the round trip to READY: the first worker is in its step
            assert pool.submit(J + "getenv", "SLOT").result(timeout=30) == "1"
            assert [w.warming for w in pool.workers_info()] == [True, False]
        finally:
            gate.touch()


def test_a_warm_step_with_an_idle_time_waits_for_the_worker_to_idle_that_long() -> None:
    with WorkerPool(1, warm_modules=(J + "warm_quickly", J + "warm_when_idle")) as pool:
        assert pool.wait_ready(60)
        time.sleep(0.3)  # past the round trip to READY, well within the 1.5 s idle time
        assert pool.submit(J + "warm_steps").result(timeout=60) == ["quick"]
        _wait_for_steps(pool, ["quick", "idle"])


def test_a_warm_step_s_idle_time_counts_from_the_end_of_the_step_before() -> None:
    with WorkerPool(1, warm_modules=(J + "warm_slowly", J + "warm_when_idle")) as pool:
        assert pool.wait_ready(60)
        time.sleep(1.8)  # the slow step (1 s) is done; 1.5 s idle after it not yet
        assert pool.submit(J + "warm_steps").result(timeout=60) == ["slow"]
        _wait_for_steps(pool, ["slow", "idle"])


def test_warm_steps_a_job_went_ahead_of_wait_while_jobs_keep_coming() -> None:
    with WorkerPool(1, warm_modules=(J + "warm_quickly",)) as pool:
        assert pool.submit(J + "warm_steps").result(timeout=60) == []
        for _ in range(5):  # a burst, each job sent 0.2 s after the last ended
            time.sleep(0.2)
            assert pool.submit(J + "warm_steps").result(timeout=60) == []
        _wait_for_steps(pool, ["quick"])


@pytest.mark.parametrize(
    ("make", "error", "needle"),
    [
        (lambda: WorkerPool(0), ValueError, "workers"),
        (lambda: WorkerPool(-2), ValueError, "workers"),
        (lambda: WorkerPool(1.5), ValueError, "workers"),  # type: ignore[arg-type]
        (lambda: WorkerPool(1, rss_limit_bytes=0), ValueError, "rss_limit_bytes"),
        (lambda: WorkerPool(1, nice=-1), ValueError, "nice"),
        (lambda: WorkerPool(1, nice=20), ValueError, "nice"),
        (lambda: WorkerPool(1, idle=1), ValueError, "idle"),  # type: ignore[arg-type]
    ],
    ids=["zero", "negative", "float", "rss-limit-zero", "nice-negative", "nice-too-high",
         "idle-not-bool"],
)
def test_bad_pool_arguments(make: Callable[[], Any], error: type[Exception], needle: str) -> None:
    with pytest.raises(error, match=needle):
        make()


def test_bad_hotswap_workers_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOTSWAP_WORKERS", "lots")
    with pytest.raises(ValueError, match="HOTSWAP_WORKERS"):
        WorkerPool()
    monkeypatch.setenv("HOTSWAP_WORKERS", "3")
    assert WorkerPool().num_workers == 3


@pytest.mark.parametrize(
    ("job", "kwargs", "error", "needle"),
    [
        ("no_colon", {}, ValueError, "package.module:function"),
        ("no.such.module:fn", {}, LookupError, "cannot be imported"),
        (F + "no_such_job", {}, LookupError, "no callable"),
        (F + "echo", {"timeout_s": -1}, ValueError, "timeout_s"),
        (F + "echo", {"timeout_s": 0}, ValueError, "timeout_s"),
    ],
)
def test_bad_submit_arguments_fail_at_the_call(
    pool: WorkerPool, job: str, kwargs: dict[str, Any], error: type[Exception], needle: str
) -> None:
    with pytest.raises(error, match=needle):
        pool.submit(job, None, **kwargs)
    assert pool.worker_pids() == []  # nothing was started for a rejected call


def test_submit_after_shutdown_raises_pool_closed(pool: WorkerPool) -> None:
    pool.submit(F + "echo", 1).result(timeout=30)
    pool.shutdown()
    with pytest.raises(PoolClosed):
        pool.submit(F + "echo", 1)


def test_shutdown_waits_for_queued_jobs_unless_cancelled() -> None:
    pool = WorkerPool(1, warm_modules=())
    futures = [pool.submit(F + "sleep", 0.05) for _ in range(4)]
    pool.shutdown(wait=True)
    assert [f.result(timeout=0) for f in futures] == [0.05] * 4

    pool = WorkerPool(1, warm_modules=())
    running = pool.submit(F + "sleep", 0.3)
    queued = [pool.submit(F + "echo", i) for i in range(3)]
    wait_running(running)
    pool.shutdown(wait=True, cancel_futures=True)
    assert running.result(timeout=0) == 0.3
    assert all(f.cancelled() for f in queued)


def test_terminate_resolves_running_and_queued_with_pool_closed() -> None:
    pool = WorkerPool(1, warm_modules=())
    running = pool.submit(F + "hang")
    queued = pool.submit(F + "echo", 1)
    wait_running(running)
    pool.terminate()
    for future in (running, queued):
        with pytest.raises(PoolClosed):
            future.result(timeout=10)


def test_load_with_random_crashes_and_timeouts() -> None:
    """300 jobs over 4 workers, a third of them crashing or hanging: all resolve correctly."""
    rng = random.Random(1234)
    kinds = rng.choices(["echo", "exit", "sigkill", "hang"], weights=[66, 12, 11, 11], k=300)
    pool = WorkerPool(4, warm_modules=())
    futures = []
    for i, kind in enumerate(kinds):
        if kind == "echo":
            futures.append(pool.submit(F + "echo", i))
        elif kind == "exit":
            futures.append(pool.submit(F + "exit", 7))
        elif kind == "sigkill":
            futures.append(pool.submit(F + "sigkill"))
        else:
            futures.append(pool.submit(F + "hang", timeout_s=0.2))
    _, not_done = wait(futures, timeout=240)
    assert not not_done
    expected = {"exit": WorkerCrashed, "sigkill": WorkerCrashed, "hang": JobTimeout}
    for i, (kind, future) in enumerate(zip(kinds, futures, strict=True)):
        if kind == "echo":
            assert future.result() == i
        else:
            assert isinstance(future.exception(), expected[kind])
    crashes = sum(kind != "echo" for kind in kinds)
    assert pool.restarts == crashes
    pids = {f.worker_pid for f in futures if f.worker_pid is not None} | set(pool.worker_pids())
    pool.shutdown()
    assert [p for p in pids if not gone(p)] == []


def test_callbacks_may_submit_from_the_manager_thread(pool: WorkerPool) -> None:
    chained: list[Any] = []
    done = threading.Event()

    def on_done(f: Any) -> None:
        chained.append(pool.submit(F + "echo", f.result() + 1))
        done.set()

    pool.submit(F + "echo", 1).add_done_callback(on_done)
    assert done.wait(30)
    assert chained[0].result(timeout=30) == 2


def test_a_pool_grows_past_its_first_worker_only_for_a_queue_longer_than_a_start() -> None:
    """Short jobs run one after another on the first worker; a queue that would keep its
    last job waiting longer than a worker's start takes gets a second; wait_ready asks for
    every worker."""
    with WorkerPool(2, warm_modules=()) as pool:
        first = pool.submit(F + "echo", 0).result(timeout=60)  # the first worker, timed
        assert first == 0
        quick = [pool.submit(F + "echo", i) for i in range(6)]
        assert [f.result(timeout=60) for f in quick] == list(range(6))
        assert len(pool.workers_info()) == 1  # none waited long: nothing started
        slow = [pool.submit(F + "sleep", 5.0) for _ in range(2)]  # the second would wait 5 s
        assert [f.result(timeout=60) for f in slow] == [5.0, 5.0]
        infos = pool.workers_info()
        assert len(infos) == 2 and len({f.worker_pid for f in slow}) == 2
    with WorkerPool(2, warm_modules=()) as pool:
        assert pool.wait_ready(60)  # asked for: all of them
        assert [w.ready for w in pool.workers_info()] == [True, True]


def test_a_pool_keeps_its_warm_workers_started_with_no_job() -> None:
    """``warm=2`` (the compile service's): two workers start, one after the other, with no
    job queued; two jobs then run side by side at once, where one warm worker would take
    them in turn; a third worker starts only for a long queue."""
    with WorkerPool(3, warm=2, warm_modules=()) as pool:
        pool.start()
        deadline = time.monotonic() + 60
        while sum(w.ready for w in pool.workers_info()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [w.ready for w in pool.workers_info()] == [True, True]
        pair = [pool.submit(F + "sleep", 1.0) for _ in range(2)]
        assert [f.result(timeout=60) for f in pair] == [1.0, 1.0]
        assert len({f.worker_pid for f in pair}) == 2
        assert len(pool.workers_info()) == 2
    with pytest.raises(ValueError, match="warm must be an int >= 1"):
        WorkerPool(2, warm=0)


def test_a_warm_worker_that_cannot_start_fails_no_job_a_ready_worker_runs() -> None:
    """The second warm worker's interpreter cannot start: the first runs every job, those
    queued behind its running one included, and the warm start is not retried in a loop."""
    broken = {"PYTHONHOME": "/nonexistent"}
    with WorkerPool(2, warm=2, warm_modules=(),
                    worker_env=lambda slot: broken if slot == 1 else {}) as pool:
        busy = pool.submit(F + "sleep", 1.0)
        queued = [pool.submit(F + "echo", i) for i in range(3)]
        assert busy.result(timeout=60) == 1.0
        assert [f.result(timeout=60) for f in queued] == [0, 1, 2]
        assert len({f.worker_pid for f in [busy, *queued]}) == 1
        time.sleep(1.0)  # no job: the failed warm start is not tried again meanwhile
        assert len(pool.workers_info()) == 1


def test_a_workers_first_job_does_not_count_as_the_pools_job_time() -> None:
    """A worker's first job pays its process's one-time costs (a CUDA context, inductor's
    compile processes): a slow first job makes no later queue look long (on the GPU, four
    processes' quick jobs grew a shared service by a worker while its first job ran)."""
    with WorkerPool(2, warm_modules=()) as pool:
        assert pool.submit(F + "sleep", 3.0).result(timeout=60) == 3.0  # the worker's first
        quick = [pool.submit(F + "echo", i) for i in range(3)]  # 3 x 3 s, had it counted
        assert [f.result(timeout=60) for f in quick] == list(range(3))
        assert len(pool.workers_info()) == 1
