"""hotswap's work in the serving process leaves the caller's threads their cores. While this
process's compile workers run, the graphs hotswap answers eagerly take one intra-op thread
fewer per running worker where the caller's threads would fill every core
(hotswap.system.cores), on the calling thread alone; a cache write runs on a lowered thread."""

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
seen: list[tuple[str, int, int | None]] = []  # (thread, its intra-op threads, MKL's) as it ran


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
    seen.append((threading.current_thread().name, torch.get_num_threads(), _mkl_threads()))
    # A thread started during the call takes torch's count at its first parallel op
    started = threading.Thread(
        target=lambda: seen.append(("new", torch.get_num_threads(), None)), name="new")
    started.start()
    started.join()
    if x.sum() < 0:
        raise ValueError("a bad input, as eager raises it")
    return x


def _runner() -> GraphRunner:
    return GraphRunner("g", torch.fx.symbolic_trace(lambda x: (_note_threads(x) * 2 + 1,)),
                       ["fast"])


def _mine() -> list[int]:
    return [n for name, n, _ in seen if name == "MainThread"]


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
            cap = cores.eager_cap()
            assert cap is not None and cap <= CORES - 1
            assert torch.equal(runner(x)[0], x * 2 + 1)
            cores.add_running(other, CORES)  # more running than cores: one thread, not fewer
            assert cores.eager_cap() == 1
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
    assert _mine() == [cap, 1, 1]
    assert all(n == CORES for name, n, _ in seen if name == "new")  # a thread started meanwhile
    if mkl is not None:  # MKL's own count follows (GPT-2's matmuls run on MKL's threads)
        assert [m for name, _, m in seen if name == "MainThread"] == [cap, 1, 1]
    assert (d["eager_calls"], d["eager_fewer_threads"]) == (3, 3)


def test_eager_calls_weighed_against_a_tier_and_a_keep_setting_use_the_caller_s_threads(
        every_core: None, monkeypatch: pytest.MonkeyPatch) -> None:
    owner = object()
    runner = _runner()
    runner.clock = CallClock()
    x = torch.arange(4.0)
    cores.set_running(owner, 1)
    try:
        cap = cores.eager_cap()
        runner.time_eager()  # from the next call on, eager's calls are timed
        runner(x)
        runner(x)
        monkeypatch.setenv("HOTSWAP_EAGER_THREADS", "keep")
        cores.set_running(owner, 0)
        cores.set_running(owner, 1)  # read when what runs changes
        kept = cores.eager_cap()
        _runner()(x)
    finally:
        cores.set_running(owner, 0)
    assert kept is None and _mine() == [cap, CORES, CORES]


def test_a_graph_compiled_inside_a_lent_call_is_compiled_for_the_caller_s_threads(
        every_core: None) -> None:
    from hotswap.engine.shipping.request import cpu_threads

    inside: list[int | None] = []
    cores.with_threads(1, CORES, lambda: inside.append(cpu_threads(())), ())
    assert inside == [CORES] and cpu_threads(()) == CORES


def test_a_pool_counts_its_workers_while_they_start_and_run_jobs_and_not_once_idle() -> None:
    pool = WorkerPool(1, warm_modules=(), rss_limit_bytes=400 * 2**20)

    def counted() -> int:
        manager = pool._manager
        return 0 if manager is None else cores._running.get(id(manager), 0)

    try:
        future = pool.submit("hotswap.testing.faults:sleep", 1.0)
        deadline = time.monotonic() + 60
        while not future.running() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert counted() == 1  # published with the dispatch
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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own niceness")
def test_background_work_runs_on_a_lowered_thread_and_raises_as_it_would_here() -> None:
    mine = _niceness()
    ran: list[tuple[int, int]] = []
    assert threads.run_lowered(lambda: ran.append((threading.get_ident(), _niceness())) or 7,
                               name="t") == 7
    assert ran[0][0] != threading.get_ident() and ran[0][1] == 19 and _niceness() == mine

    def fail() -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        threads.run_lowered(fail, name="t")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own niceness")
def test_a_cache_write_of_a_tier_hashes_and_copies_on_a_lowered_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hotswap.cache import ArtifactCache
    from hotswap.engine.sources.cache_access import CacheAccess

    mine = _niceness()
    writers: list[int] = []
    real = ArtifactCache.put

    def put(self: ArtifactCache, *args: object, **kwargs: object) -> None:
        writers.append(_niceness())
        real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ArtifactCache, "put", put)
    access = CacheAccess(str(tmp_path / "cache"), None)
    access.keys(torch.fx.symbolic_trace(torch.nn.ReLU()), (), False, [])  # opens the cache
    key = "ab" * 32
    assert access.store(key, "default", b"an entry") is not None
    assert writers == [19] and _niceness() == mine
