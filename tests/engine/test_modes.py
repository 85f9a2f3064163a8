"""hotswap.compile in every mode, on real inductor compiles of tiny graphs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import hotswap
from hotswap.engine.options import Options
from tests.conftest import cache_readers, wait_gone
from tests.engine.models import MODELS, mlp, tier_failure
from tests.workers import jobs as worker_jobs

REPO = Path(__file__).resolve().parents[2]
BAD_TIER = {"name": "broken", "config": {"cpp.cxx": (None, "/nonexistent/g++")}}
MODES = ["inprocess", "subprocess", "async", "progressive"]
# Expected counter deltas for one graph whose every tier succeeds.
EXPECTED = {
    "inprocess": {"swaps": 0, "worker_compiles": 0, "inprocess_compiles": 1, "fallbacks": 0},
    "subprocess": {"swaps": 0, "worker_compiles": 1, "inprocess_compiles": 0, "fallbacks": 0},
    "async": {"swaps": 1, "worker_compiles": 1, "inprocess_compiles": 0, "fallbacks": 0},
    "progressive": {"swaps": 2, "worker_compiles": 2, "inprocess_compiles": 0, "fallbacks": 0},
}
LADDER = ["default", {"name": "no-fusion", "config": {"max_fusion_size": 1}}]


def _close(a: Any, b: Any) -> None:
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("model_name", list(MODELS))
def test_mode_matches_eager_with_exact_counters(mode: str, model_name: str) -> None:
    model, inputs = MODELS[model_name]()
    expected = model(*inputs)
    graphs = 2 if model_name == "graph-break" else 1
    with hotswap.counters_delta() as d:
        # The gate would keep the no-fusion tier out when it measures slower (tests/profiles
        # decide it deterministically); here every tier must swap in.
        compiled = hotswap.compile(model, mode=mode, tiers=LADDER if mode == "progressive"
                                   else None, workers=2, on_failure="stay", gate=False)
        _close(compiled(*inputs), expected)
        statuses = hotswap.wait(compiled, timeout_s=240)
        _close(compiled(*inputs), expected)
    assert len(statuses) == graphs
    final_tier = "no-fusion" if mode == "progressive" else "default"
    for status in statuses:
        assert status.final and not status.pending and not status.failures, status
        assert status.tier == final_tier
    assert d["graphs"] == graphs
    # Tiers compile in parallel: a lower tier that finishes after a higher one is kept on
    # file, not swapped in. Every tier is either swapped in or kept, exactly once.
    kept = sum(len(s.kept) for s in statuses)
    assert all(why.endswith("already serves") for s in statuses for _, why in s.kept)
    # A stack of blocks climbs the rung of its pieces first in progressive (regions="auto")
    rung = int(mode == "progressive" and model_name == "blocks")
    assert [name for name, _ in statuses[0].states][:rung] == ["default-regions"] * rung
    for name, per_graph in EXPECTED[mode].items():
        per_graph += rung if name in ("swaps", "worker_compiles") else 0
        expected_delta = per_graph * graphs - (kept if name == "swaps" else 0)
        assert d[name] == expected_delta, (name, dict(d))
    if mode in ("async", "progressive"):
        assert d["eager_calls"] == graphs  # the first call was eager, the last compiled
    else:
        assert d["eager_calls"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_training_step_matches_eager_before_and_after_swap(mode: str) -> None:
    model, (x,) = mlp()
    reference = [p.detach().clone() for p in model.parameters()]

    def grads(fn: Any) -> list[torch.Tensor]:
        model.zero_grad()
        fn(x).pow(2).sum().backward()
        return [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]

    eager_grads = grads(model)
    compiled = hotswap.compile(model, mode=mode, workers=2, gate=False)
    with hotswap.counters_delta() as d:
        first = grads(compiled)  # eager (async modes): autograd through the dynamo graph
        [status] = hotswap.wait(compiled, timeout_s=240)
        after = grads(compiled)  # compiled forward and backward
    assert status.tier == ("max-autotune" if mode == "progressive" else "default")
    assert not status.failures
    assert d["eager_calls"] == (1 if mode in ("async", "progressive") else 0)
    for g_eager, g_first, g_after in zip(eager_grads, first, after, strict=True):
        _close(g_first, g_eager)
        _close(g_after, g_eager)
    assert all(torch.equal(p, r) for p, r in zip(model.parameters(), reference, strict=True))


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_no_grad_and_inference_mode(context: Any) -> None:
    model, inputs = mlp()
    compiled = hotswap.compile(model, mode="async", workers=2)
    with context():
        expected = model(*inputs)
        _close(compiled(*inputs), expected)
        [status] = hotswap.wait(compiled, timeout_s=240)
        _close(compiled(*inputs), expected)
    assert status.tier == "default" and not status.failures


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dynamic", [True, None], ids=["dynamic=True", "automatic-dynamic"])
def test_dynamic_batch_loop(mode: str, dynamic: bool | None) -> None:
    """Symbolic graphs compile in workers too; one artifact serves every batch size."""
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    compiled = hotswap.compile(model, mode=mode, dynamic=dynamic, workers=2, tiers=LADDER
                               if mode == "progressive" else None)
    for n in (4, 7, 9):  # with dynamic=None the second size recompiles with a dynamic batch
        x = torch.randn(n, 5)
        _close(compiled(x), model(x))
    statuses = hotswap.wait(compiled, timeout_s=240)
    assert statuses and all(s.final and not s.failures for s in statuses), statuses
    with hotswap.counters_delta() as d:
        for n in (3, 11, 30):
            x = torch.randn(n, 5)
            _close(compiled(x), model(x))
    # Compiled, and no further recompiles. (A gated ladder stays on eager where the gate
    # measured no compiled tier faster than eager, as it may for a graph this small: each
    # tier was weighed against eager and kept out for it.)
    on_eager = [s for s in statuses if s.tier == "eager"]
    assert all(len(s.kept) == len(LADDER) and all(
        why.startswith(("slower than eager: ", "not faster than eager: ")) for _, why in s.kept)
        for s in on_eager), on_eager
    assert d["eager_calls"] == (3 if on_eager else 0) and d["graphs"] == 0


def test_failing_tier_stays_on_current_tier_and_pool_compiles_next_graph() -> None:
    model, inputs = mlp()
    with hotswap.counters_delta() as d:
        compiled = hotswap.compile(model, mode="progressive", tiers=["default", BAD_TIER],
                                   workers=2, gate=False)  # about failures, not the gate
        _close(compiled(*inputs), model(*inputs))
        [status] = hotswap.wait(compiled, timeout_s=240)
    assert status.final and status.tier == "default"
    assert [tier for tier, _ in status.failures] == ["broken"]
    assert "CompileFailed" in status.failures[0][1] and "C++ compiler" in status.failures[0][1]
    assert d["fallbacks"] == 1 and d["swaps"] == 1
    # The same pool goes on to compile another graph.
    other, other_inputs = mlp()
    again = hotswap.compile(other, mode="async", workers=2)
    again(*other_inputs)
    assert [s.tier for s in hotswap.wait(again, timeout_s=240)] == ["default"]


def test_worker_killed_mid_compile_twice_records_the_crash() -> None:
    pool = hotswap.runtime().pool(2)
    assert pool.wait_ready(120)
    model, inputs = mlp()
    # max_autotune on CPU benchmarks GEMM choices: long enough to be killed mid-compile.
    compiled = hotswap.compile(model, mode="async", workers=2,
                               tiers=[{"name": "slow", "config": {"max_autotune": True}}])
    compiled(*inputs)
    killed: set[int] = set()
    deadline = time.monotonic() + 120
    while len(killed) < 2 and time.monotonic() < deadline:  # the first crash is retried once
        for info in pool.workers_info():
            if info.busy and info.pid not in killed:
                os.kill(info.pid, signal.SIGKILL)
                killed.add(info.pid)
        time.sleep(0.02)
    [status] = hotswap.wait(compiled, timeout_s=240)
    assert status.tier == "eager" and status.final
    assert "WorkerCrashed" in status.failures[0][1]
    _close(compiled(*inputs), model(*inputs))
    assert pool.wait_ready(120)  # both killed workers were replaced


def test_on_failure_raise_surfaces_the_failure_in_the_next_call() -> None:
    model, inputs = mlp()
    compiled = hotswap.compile(model, mode="async", tiers=[BAD_TIER], workers=2,
                               on_failure="raise")
    compiled(*inputs)
    hotswap.wait(compiled, timeout_s=240)
    with pytest.raises(hotswap.TierFailed, match="broken"):
        compiled(*inputs)
    _close(compiled(*inputs), model(*inputs))  # raised once; the graph keeps serving eagerly


def test_verify_accepts_a_tier_that_agrees() -> None:
    model, inputs = mlp()
    compiled = hotswap.compile(model, mode="async", workers=2, verify=True)
    compiled(*inputs)
    hotswap.wait(compiled, timeout_s=240)
    _close(compiled(*inputs), model(*inputs))
    [status] = hotswap.status(compiled)
    assert status.tier == "default" and not status.failures


def test_backend_object_and_entry_point_name() -> None:
    model, inputs = mlp()
    backend = hotswap.backend(mode="async", workers=2)
    compiled = torch.compile(model, backend=backend)
    _close(compiled(*inputs), model(*inputs))
    assert [s.tier for s in hotswap.wait(backend, timeout_s=240)] == ["default"]
    torch._dynamo.reset()
    by_name = torch.compile(model, backend="hotswap", options={"mode": "subprocess",
                                                                "workers": 2})
    with hotswap.counters_delta() as d:
        _close(by_name(*inputs), model(*inputs))
    # Same graph, same tier as the async compile above: served from the artifact cache.
    assert (d["cache_hits"], d["worker_compiles"], d["eager_calls"]) == (1, 0, 0)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"mode": "fast"}, "valid modes"),
        ({"tiers": ["turbo"]}, "unknown tier"),
        ({"tiers": [{"name": "x", "config": {"no_such_knob": 1}}]}, "unknown inductor config"),
        ({"workers": 0}, "workers"),
        ({"timeout_s": -1}, "timeout_s"),
        ({"on_failure": "explode"}, "on_failure"),
        ({"verify": "yes"}, "verify"),
        ({"mode": ""}, "valid modes"),          # given is checked, not taken for unset
        ({"tiers": []}, "non-empty"),
        ({"timeout_s": float("nan")}, "finite"),
        ({"timeout_s": float("inf")}, "finite"),
        ({"tiers": [{"name": "x", "config": {"max_autotune": 1}}]}, "takes a bool"),
        ({"tiers": [{"name": "x", "config": {"compile_threads": True}}]}, "takes an int"),
        ({"tiers": [{"name": "x", "config": {"compile_threads": 2.5}}]}, "takes an int"),
        ({"tiers": [{"name": "x", "config": {"max_autotune_gemm_backends": 3}}]}, "takes a str"),
    ],
)
def test_invalid_options_raise_value_error_at_compile(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        hotswap.compile(torch.nn.Linear(2, 2), **kwargs)


@pytest.mark.parametrize(("name", "value"), [
    ("HOTSWAP_CACHE_MAX_BYTES", "-1"), ("HOTSWAP_WORKERS", "0"), ("HOTSWAP_WORKER_NICE", "25"),
    ("HOTSWAP_WORKER_IDLE", "yes"), ("HOTSWAP_WORKER_RSS_LIMIT_BYTES", "lots"),
    ("HOTSWAP_SWITCH_INTERVAL_S", "2"), ("HOTSWAP_LOG", "loud"),
    ("HOTSWAP_WORKER_IDLE_EXIT_S", "-1"), ("HOTSWAP_WORKER_YIELD", "nobody")])
def test_every_hotswap_variable_is_checked_at_compile(monkeypatch: pytest.MonkeyPatch,
                                                      name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        hotswap.compile(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("value", ["soon", "0", "-3", "inf"])
def test_bad_timeout_from_the_environment_names_the_variable(
        monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("HOTSWAP_TIMEOUT_S", value)
    with pytest.raises(ValueError, match="HOTSWAP_TIMEOUT_S must be a number of seconds > 0"):
        hotswap.compile(torch.nn.Linear(2, 2))
    monkeypatch.setenv("HOTSWAP_TIMEOUT_S", " ")  # blank: unset, like every HOTSWAP_* number
    assert Options.create().timeout_s is None
    monkeypatch.setenv("HOTSWAP_TIMEOUT_S", "2.5")
    assert Options.create().timeout_s == 2.5


def test_script_without_main_guard_from_stdin() -> None:
    code = textwrap.dedent(
        """
        import torch, hotswap
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
        x = torch.randn(4, 8)
        compiled = hotswap.compile(model, mode="async", workers=1)
        compiled(x)
        [s] = hotswap.wait(compiled, timeout_s=240)
        print("tier", s.tier, torch.allclose(compiled(x), model(x), atol=1e-5))
        """
    )
    out = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "tier default True" in out.stdout


def test_calls_from_many_threads_across_the_swap() -> None:
    model, _ = mlp()
    compiled = hotswap.compile(model, mode="async", workers=2)
    compiled(torch.randn(16, 32))  # trace once, before the threads start
    errors: list[BaseException] = []
    stop = threading.Event()

    def serve() -> None:
        try:
            while not stop.is_set():
                x = torch.randn(16, 32)
                _close(compiled(x), model(x))
        except BaseException as e:  # surfaced below
            errors.append(e)
            stop.set()

    threads = [threading.Thread(target=serve) for _ in range(4)]
    for t in threads:
        t.start()
    [status] = hotswap.wait(compiled, timeout_s=240)
    time.sleep(0.3)  # keep serving on the new tier for a while
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors, errors[0]
    assert status.tier == "default" and not status.failures


def test_several_models_share_one_pool() -> None:
    pool = hotswap.runtime().pool(2)
    assert pool.wait_ready(120)  # a pool this test starts has no worker to list before
    pids = set(pool.worker_pids())
    models = [mlp() for _ in range(3)]
    compiled = [hotswap.compile(m, mode="async", workers=2) for m, _ in models]
    for c, (m, inputs) in zip(compiled, models, strict=True):
        _close(c(*inputs), m(*inputs))
    for c in compiled:
        assert [s.tier for s in hotswap.wait(c, timeout_s=240)] == ["default"]
    assert set(pool.worker_pids()) == pids  # the same warm workers served all three


def test_shared_workers_yield_the_cpu_to_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = hotswap.runtime().pool(2)
    jobs = "tests.workers.jobs:"
    assert pool.submit(jobs + "niceness").result(timeout=60) == min(19, os.nice(0) + 19)
    if hasattr(os, "SCHED_IDLE"):  # in an idle cgroup of their own, or SCHED_IDLE
        assert worker_jobs.is_idle(pool.submit(jobs + "lowered").result(timeout=60),
                                   os.getpid())
    monkeypatch.setenv("HOTSWAP_WORKER_IDLE", "yes")
    with pytest.raises(ValueError, match="HOTSWAP_WORKER_IDLE must be 0 or 1"):
        hotswap.runtime().pool(3)


def test_interpreter_exit_with_compiles_pending() -> None:
    code = textwrap.dedent(
        """
        import torch, hotswap
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())
        compiled = hotswap.compile(model, mode="progressive", workers=2)
        compiled(torch.randn(8, 64))
        print(" ".join(map(str, hotswap.runtime().pool(2).worker_pids())), flush=True)
        # exit at once: both tiers are still compiling in the workers
        """
    )
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert time.monotonic() - start < 60
    pids = [int(p) for p in out.stdout.split()]
    assert pids and wait_gone(pids, 2.0) == []


def test_on_failure_raise_in_subprocess_mode_raises_at_the_first_call() -> None:
    model, inputs = mlp()
    compiled = hotswap.compile(model, mode="subprocess", tiers=[BAD_TIER], workers=2,
                               on_failure="raise")
    with pytest.raises(Exception) as info:
        compiled(*inputs)
    failed = tier_failure(info.value)
    assert failed is not None and failed.tier == "broken" and "C++ compiler" in failed.reason


def test_a_500_node_chain_travels_and_compiles_forward_and_backward() -> None:
    """PyTorch's async test graph: deep enough that pickling an fx.Graph (a linked list of
    nodes) overflows the stack guard; hotswap ships node records instead."""
    from hotswap.tools import zoo

    workload = zoo.make("adds500")
    compiled = hotswap.compile(workload.target, mode="async", workers=2)
    with hotswap.counters_delta() as d:
        for step in range(2):
            _close(workload.step(compiled, step), workload.reference(step))
        [status] = hotswap.wait(compiled, timeout_s=240)
        _close(workload.step(compiled, 2), workload.reference(2))
    assert status.tier == "default" and not status.failures, status
    assert d["worker_compiles"] == 1 and d["eager_calls"] == 2


def test_default_time_limits_per_tier_and_the_override() -> None:
    from hotswap.engine import options

    opts = Options.create(mode="progressive")
    default, autotune = opts.tiers
    assert opts.limit_s(default) == options.DEFAULT_LIMIT_S
    assert opts.limit_s(autotune) == options.DEFAULT_LIMIT_S * options.AUTOTUNE_FACTOR
    assert opts.limit_s() == options.DEFAULT_LIMIT_S * options.AUTOTUNE_FACTOR
    chosen = Options.create(mode="progressive", timeout_s=5)
    assert chosen.limit_s(default) == chosen.limit_s(autotune) == 5.0


def test_a_hung_compile_fails_its_tier_at_the_default_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from hotswap import testing
    from hotswap.engine import options

    monkeypatch.setattr(options, "DEFAULT_LIMIT_S", 3.0)  # instead of waiting ten minutes
    model, inputs = mlp()
    compiled = hotswap.compile(model, mode="subprocess", workers=1)
    with testing.inject(testing.FaultPlan({"hang": 1.0})), hotswap.counters_delta() as d:
        _close(compiled(*inputs), model(*inputs))  # the first call waited 3 s, then eager
    [status] = hotswap.status(compiled)
    assert status.tier == "eager" and "JobTimeout" in status.failures[0][1]
    assert d["job_timeouts"] == 1
    torch._dynamo.reset()
    later = hotswap.compile(torch.nn.Sequential(torch.nn.Linear(4, 4)), mode="subprocess",
                            workers=1)
    later(torch.randn(2, 4))
    assert hotswap.status(later)[0].tier == "default"  # the pool replaced the hung worker


def test_the_default_worker_count_shares_the_pool_of_that_many() -> None:
    from hotswap.workers.pool import default_workers

    runtime = hotswap.runtime()
    assert runtime.pool(None) is runtime.pool(default_workers())


def test_shutdown_stops_every_worker_and_a_later_compile_starts_again() -> None:
    model, inputs = mlp()
    compiled = hotswap.compile(model, mode="subprocess", workers=1)
    _close(compiled(*inputs), model(*inputs))
    pids = hotswap.runtime().worker_pids()
    assert pids
    hotswap.shutdown()
    assert hotswap.runtime().worker_pids() == []
    assert wait_gone(pids, 10.0) == []
    hotswap.shutdown()  # twice is fine
    torch._dynamo.reset()
    again = hotswap.compile(model, mode="subprocess", workers=1)
    _close(again(*inputs), model(*inputs))
    assert [s.tier for s in hotswap.status(again)] == ["default"]
    assert not set(hotswap.runtime().worker_pids()) & set(pids)


@pytest.mark.parametrize("mode", ["subprocess", "async", "progressive"])
def test_a_graph_whose_ladder_is_final_is_not_kept_shipped(mode: str) -> None:
    """Every shipped graph (its pickled code and constants) was kept for the life of the
    process; it goes once nothing is pending or measured for it."""
    import gc

    from hotswap.engine.shipping.request import GraphRequest

    def shipped() -> int:  # type(), not isinstance: gc lists weak proxies too
        return sum(type(o) is GraphRequest for o in gc.get_objects())

    before = shipped()  # graphs of earlier tests still in flight
    model, inputs = mlp()
    compiled = hotswap.compile(model, mode=mode, workers=1)
    _close(compiled(*inputs), model(*inputs))
    assert all(s.final for s in hotswap.wait(compiled, timeout_s=240))
    _close(compiled(*inputs), model(*inputs))
    deadline = time.monotonic() + 10  # the loader thread lets go just after wait() returns
    while shipped() > before:
        if time.monotonic() > deadline:
            raise AssertionError("a GraphRequest outlived its ladder")
        time.sleep(0.05)


def test_idle_workers_exit_and_the_next_compile_starts_them_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Once every job is done and none comes for HOTSWAP_WORKER_IDLE_EXIT_S, the pool's
    workers go (each holds torch and inductor); a later graph still compiles."""
    monkeypatch.setenv("HOTSWAP_WORKER_IDLE_EXIT_S", "2")
    before = set(hotswap.runtime().worker_pids())
    model, inputs = mlp()
    compiled = hotswap.compile(model, mode="async", workers=3)
    _close(compiled(*inputs), model(*inputs))
    assert [s.tier for s in hotswap.wait(compiled, timeout_s=240)] == ["default"]
    mine = set(hotswap.runtime().worker_pids()) - before  # within 2 s of the job's end
    assert mine and wait_gone(sorted(mine), 15) == []
    torch._dynamo.reset()
    again, more = mlp()
    compiled = hotswap.compile(torch.nn.Sequential(again, torch.nn.Tanh()), mode="async",
                               workers=3)
    with hotswap.counters_delta() as d:
        compiled(*more)
        assert [s.tier for s in hotswap.wait(compiled, timeout_s=240)] == ["default"]
    assert d["worker_compiles"] == 1
    assert not set(hotswap.runtime().worker_pids()) & mine


def test_a_cached_tier_is_read_and_checked_off_the_users_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm restart's entry (on the CPU it carries inductor's precompiled header: 156 MB) is
    read and its signature checked on hotswap's io thread, not in the call dynamo traces."""
    model, inputs = mlp()
    compiled = hotswap.compile(model, mode="async", workers=1)
    compiled(*inputs)
    assert [s.tier for s in hotswap.wait(compiled, timeout_s=240)] == ["default"]
    torch._dynamo.reset()
    readers = cache_readers(monkeypatch)
    with hotswap.counters_delta() as d:
        compiled = hotswap.compile(model, mode="async", workers=1)
        _close(compiled(*inputs), model(*inputs))
        assert [s.tier for s in hotswap.wait(compiled, timeout_s=240)] == ["default"]
    # (the first call is eager unless the load ended while dynamo finished its call)
    assert d["cache_hits"] == 1 and d["worker_compiles"] == 0 and d["eager_calls"] <= 1
    assert readers and threading.main_thread().name not in readers, readers


def test_a_pool_warmed_for_graphs_that_all_came_from_the_cache_exits_once_idle(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm restart: the backend warms its pool as it is made, then every tier comes from
    the cache and no job ever runs; the pool still stops after HOTSWAP_WORKER_IDLE_EXIT_S, as
    one whose jobs are done does (it held its workers for good)."""
    monkeypatch.setenv("HOTSWAP_WORKER_IDLE_EXIT_S", "2")
    model, inputs = mlp()
    compiled = hotswap.compile(model, mode="async", workers=3)
    compiled(*inputs)
    assert [s.tier for s in hotswap.wait(compiled, timeout_s=240)] == ["default"]
    assert wait_gone(hotswap.runtime().worker_pids(), 30) == []  # it ran a job: it goes
    torch._dynamo.reset()
    with hotswap.counters_delta() as d:
        compiled = hotswap.compile(model, mode="async", workers=3)  # warms a pool again
        deadline = time.monotonic() + 30
        while not (warmed := hotswap.runtime().worker_pids()) and time.monotonic() < deadline:
            time.sleep(0.01)  # its manager thread starts the worker
        _close(compiled(*inputs), model(*inputs))
        assert [s.tier for s in hotswap.wait(compiled, timeout_s=240)] == ["default"]
    assert d["cache_hits"] == 1 and d["worker_compiles"] == 0 and warmed
    assert wait_gone(warmed, 30) == []
    assert hotswap.runtime().worker_pids() == []


@pytest.mark.parametrize("mode", ["async", "progressive"])
def test_a_compiled_entry_is_stored_after_it_serves_unless_a_gate_reads_it(
        mode: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from hotswap.cache.store import ArtifactCache
    from hotswap.engine.sources.cache_access import CacheAccess

    serving_then: list[str] = []
    store = CacheAccess.store

    def watched(self: CacheAccess, key: str | None, tier: str, entry: Any,
                origin: str = "") -> Any:
        serving_then.append(hotswap.status(compiled)[0].tier)
        time.sleep(0.5)  # wait() still returns after it
        return store(self, key, tier, entry, origin)

    monkeypatch.setattr(CacheAccess, "store", watched)
    model, args = mlp()
    compiled = hotswap.compile(model, mode=mode, tiers=["default"], cache_dir=str(tmp_path))
    compiled(*args)
    [status] = hotswap.wait(compiled, timeout_s=240)  # returns once the entry is stored
    assert status.final and not status.failures
    # async: default served before its entry was written; progressive's gate benchmark reads
    # it from the cache, so it is stored first (the gate may then keep eager: a tiny graph)
    assert serving_then == (["default"] if mode == "async" else ["eager"])
    assert ("default/store" in status.timings_s) is (mode == "async")
    assert "default" in [e.tier for e in ArtifactCache(tmp_path).entries()]
    _close(compiled(*args), model(*args))


EXITS_AT_THE_SWAP = """
import sys, time
import torch
import hotswap
from hotswap.engine.sources.cache_access import CacheAccess

store = CacheAccess.store
def slow(self, *args, **kwargs):
    time.sleep(0.5)
    return store(self, *args, **kwargs)
CacheAccess.store = slow

model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
compiled = hotswap.compile(model, mode="async", cache_dir=sys.argv[1])
deadline = time.monotonic() + 240
while hotswap.status(compiled)[0:1] == [] or hotswap.status(compiled)[0].tier == "eager":
    assert time.monotonic() < deadline
    compiled(torch.ones(2, 8))
    time.sleep(0.01)
"""


def test_a_process_that_exits_at_the_swap_leaves_the_entry_stored(tmp_path: Path) -> None:
    from hotswap.cache.store import ArtifactCache

    done = subprocess.run([sys.executable, "-c", EXITS_AT_THE_SWAP, str(tmp_path)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert [e.tier for e in ArtifactCache(tmp_path).entries()] == ["default"]


def test_wait_raises_on_timeout_while_an_entry_is_still_being_written(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from hotswap.engine.sources.cache_access import CacheAccess

    writing, go_on = threading.Event(), threading.Event()
    store = CacheAccess.store

    def held(self: CacheAccess, *args: Any, **kwargs: Any) -> Any:
        writing.set()
        go_on.wait(60)
        return store(self, *args, **kwargs)

    monkeypatch.setattr(CacheAccess, "store", held)
    model, args = mlp()
    compiled = hotswap.compile(model, mode="async", cache_dir=str(tmp_path))
    compiled(*args)
    try:
        assert writing.wait(240)  # default serves; its entry is being written
        with pytest.raises(hotswap.WaitTimeout, match="cache entries still being written"):
            hotswap.wait(compiled, timeout_s=0.3, raise_on_timeout=True)
    finally:
        go_on.set()
    [status] = hotswap.wait(compiled, timeout_s=60, raise_on_timeout=True)
    assert status.tier == "default" and status.final
