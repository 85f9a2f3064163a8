"""hotswap's work in the serving process leaves the caller's threads their cores. While this
process's compile workers run, the graphs hotswap answers eagerly take at most the cores the
workers leave (hotswap.system.cores), on the calling thread alone; a cache write hashes and
writes a MiB at a time with rests, on a lowered thread."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import hotswap
from hotswap.engine import threads
from hotswap.engine.graph import GraphRunner
from hotswap.engine.served import CallClock
from hotswap.system import cores
from hotswap.workers import WorkerPool

CORES = len(os.sched_getaffinity(0))
# (thread, its intra-op threads, MKL's, eager_cap then) as the graph ran
seen: list[tuple[str, int, int | None, int | None]] = []


def _mkl_threads() -> int | None:
    """MKL's count on this thread, where torch has MKL (its C getter)."""
    import ctypes

    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        get = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY).MKL_Get_Max_Threads
    except (OSError, AttributeError):
        return None
    get.restype = ctypes.c_int
    return int(get())


@torch.fx.wrap
def _note_threads(x: torch.Tensor) -> torch.Tensor:
    seen.append((threading.current_thread().name, torch.get_num_threads(), _mkl_threads(),
                 cores.eager_cap()))
    # A thread started during the call takes torch's count at its first parallel op
    started = threading.Thread(
        target=lambda: seen.append(("new", torch.get_num_threads(), None, None)), name="new")
    started.start()
    started.join()
    if x.sum() < 0:
        raise ValueError("a bad input, as eager raises it")
    return x


def _runner() -> GraphRunner:
    return GraphRunner("g", torch.fx.symbolic_trace(lambda x: (_note_threads(x) * 2 + 1,)),
                       ["fast"])


def _mine() -> list[int]:
    return [n for name, n, _, _ in seen if name == "MainThread"]


def _expected() -> list[int]:
    """What each call on this thread should have run with: the cap as it was (other tests'
    process-wide pools may run meanwhile), or the caller's count."""
    return [CORES if cap is None else min(CORES, cap)
            for name, _, _, cap in seen if name == "MainThread"]


@pytest.fixture
def every_core() -> Iterator[None]:
    """The caller's intra-op threads fill every core (torch's default). Other tests' pools
    may run meanwhile (the process-wide ones outlive tests): what is expected is read from
    ``eager_cap`` once this test's owners are set."""
    if CORES < 2:
        pytest.skip("one intra-op thread leaves no core to lend")
    before = torch.get_num_threads()
    torch.set_num_threads(CORES)
    if not cores.can_set_threads():
        pytest.skip("this torch's parallel runtime has no per-thread count to set")
    seen.clear()
    yield
    torch.set_num_threads(before)


def test_eager_answers_leave_running_workers_their_cores_on_their_thread_alone(
        every_core: None) -> None:
    owner, other = object(), object()
    runner = _runner()
    x = torch.arange(4.0)
    try:
        with hotswap.counters_delta() as d:
            cores.set_running(owner, 1)
            assert torch.equal(runner(x)[0], x * 2 + 1)
            cores.add_running(other, CORES)  # more running than cores: one thread, not fewer
            runner(x)
            with pytest.raises(ValueError, match="bad input"):  # as eager raises it, ...
                runner(-x - 1)
            cores.add_running(other, -CORES)
    finally:
        cores.set_running(owner, 0)
        cores.set_running(other, 0)
    assert torch.get_num_threads() == CORES  # ... its count back all the same
    mkl = _mkl_threads()
    if mkl is not None:
        assert mkl == CORES
    caps = [cap for name, _, _, cap in seen if name == "MainThread"]
    assert caps[0] is not None and caps[0] <= CORES - 1 and caps[1:] == [1, 1]
    assert _mine() == _expected()
    assert all(n == CORES for name, n, _, _ in seen if name == "new")  # a thread started meanwhile
    if mkl is not None:  # MKL's own count follows (GPT-2's matmuls run on MKL's threads)
        assert [m for name, _, m, _ in seen if name == "MainThread"] == _expected()
    assert (d["eager_calls"], d["eager_fewer_threads"]) == (3, 3)


def test_eager_calls_weighed_against_a_tier_and_a_keep_setting_use_the_caller_s_threads(
        every_core: None, monkeypatch: pytest.MonkeyPatch) -> None:
    owner = object()
    runner = _runner()
    runner.clock = CallClock()
    x = torch.arange(4.0)
    cores.set_running(owner, 1)
    try:
        runner.time_eager()  # from the next call on, eager's calls are timed
        runner(x)
        runner(x)
        with monkeypatch.context() as env:
            env.setenv("HOTSWAP_EAGER_THREADS", "keep")
            cores.set_running(owner, 0)
            cores.set_running(owner, 1)  # read when what runs changes
            kept = cores.eager_cap()
            _runner()(x)
    finally:
        cores.set_running(owner, 0)  # what comes next reads "auto" again
    assert kept is None and _mine() == [_expected()[0], CORES, CORES]
    assert _expected()[0] < CORES


def test_a_graph_compiled_inside_a_lent_call_is_compiled_for_the_caller_s_threads(
        every_core: None) -> None:
    from hotswap.engine.shipping.request import cpu_threads

    inside: list[tuple[int | None, int, int]] = []

    def compile_here() -> None:
        with cores.at_own_threads():  # as an in-process compile runs
            compiling = torch.get_num_threads()
        inside.append((cpu_threads(()), compiling, torch.get_num_threads()))

    cores.with_threads(1, CORES, compile_here, ())
    assert inside == [(CORES, CORES, 1)] and cpu_threads(()) == CORES
    assert torch.get_num_threads() == CORES


def test_a_pool_counts_its_workers_while_they_start_and_run_jobs_and_not_once_idle() -> None:
    pool = WorkerPool(1, warm_modules=(), rss_limit_bytes=400 * 2**20)

    def counted() -> int:
        manager = pool._manager
        return 0 if manager is None else cores._running.get(id(manager), 0)

    try:
        future = pool.submit("hotswap.testing.faults:sleep", 2.0)
        deadline = time.monotonic() + 60
        while not future.running() and time.monotonic() < deadline:
            time.sleep(0.01)
        while counted() != 1 and time.monotonic() < deadline:  # published with the dispatch
            time.sleep(0.01)
        assert future.running() and counted() == 1
        future.result(timeout=60)
        deadline = time.monotonic() + 10
        while counted() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert counted() == 0 and pool.workers_info()[0].ready  # idle, not gone
        manager = pool._manager
    finally:
        pool.shutdown()
    assert id(manager) not in cores._running


def _niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.fixture
def lowers() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("a thread's own niceness is Linux's")
    probe: list[int] = []

    def lower() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), threads.LOWERED_NICENESS)
        except OSError:
            return
        probe.append(_niceness())

    started = threading.Thread(target=lower)
    started.start()
    started.join()
    if probe != [threads.LOWERED_NICENESS]:
        pytest.skip("this machine refuses to lower a thread")


def test_background_work_runs_on_a_lowered_thread_and_raises_as_it_would_here(
        lowers: None, monkeypatch: pytest.MonkeyPatch) -> None:
    mine = _niceness()
    ran: list[tuple[int, int]] = []
    assert threads.run_lowered(lambda: ran.append((threading.get_ident(), _niceness())) or 7,
                               name="t") == 7
    assert ran[0][0] != threading.get_ident() and ran[0][1] == threads.LOWERED_NICENESS
    assert _niceness() == mine

    def fail() -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        threads.run_lowered(fail, name="t")

    def no_thread(*_: object, **__: object) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threads, "start", no_thread)  # the interpreter exiting: run here
    assert threads.run_lowered(lambda: threading.get_ident(), name="t") == threading.get_ident()


def test_a_cache_write_of_a_tier_hashes_and_copies_on_a_lowered_thread(
        lowers: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hotswap.cache import ArtifactCache
    from hotswap.engine.sources.cache_access import WRITE_REST_S, CacheAccess

    mine = _niceness()
    writers: list[tuple[int, float]] = []
    real = ArtifactCache.put

    def put(self: ArtifactCache, *args: object, **kwargs: object) -> None:
        rest = kwargs["rest_s"]
        writers.append((_niceness(), rest() if callable(rest) else rest))  # type: ignore[arg-type]
        real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ArtifactCache, "put", put)
    access = CacheAccess(str(tmp_path / "cache"), None)
    access.keys(torch.fx.symbolic_trace(torch.nn.ReLU()), (), False, [])  # opens the cache
    assert access.store("ab" * 32, "default", b"an entry") is not None
    with threads.user_waiting():  # a thread of the user's waits: no rests
        assert access.store("cd" * 32, "default", b"another") is not None
    assert writers == [(threads.LOWERED_NICENESS, WRITE_REST_S),
                       (threads.LOWERED_NICENESS, 0.0)]
    assert _niceness() == mine


def test_a_paced_write_and_hash_rest_after_each_piece_and_keep_every_byte(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib

    from hotswap.cache import store

    rests: list[float] = []
    here, real_sleep = threading.get_ident(), time.sleep

    def sleep(seconds: float) -> None:  # this thread's rests counted; any other thread's kept
        if threading.get_ident() == here:
            rests.append(seconds)
        else:
            real_sleep(seconds)

    monkeypatch.setattr(store.time, "sleep", sleep)
    data = os.urandom(store.WRITE_PIECE * 2 + 12345)  # three pieces
    store.write_atomic(tmp_path / "f", b"head", data, rest_s=lambda: 0.001)
    assert (tmp_path / "f").read_bytes() == b"head" + data
    assert rests == [0.001] * 4  # the head's piece, then the data's three
    rests.clear()
    digest = store.hashed(hashlib.sha256(), data, 0.002).hexdigest()
    assert digest == hashlib.sha256(data).hexdigest() and rests == [0.002] * 3
    rests.clear()
    store.write_atomic(tmp_path / "g", data)  # no rest asked for: none
    assert (tmp_path / "g").read_bytes() == data and rests == []
