"""PyTorch's own async/progressive subprocess scenarios, through hotswap, on a CUDA device."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

import hotswap
from tests.engine.models import unseen_scale
from tests.gpu.scenarios import TIERS, matmul_relu, matmul_relu_inputs


def _serve_until_final(compiled: object, call: object, timeout_s: float = 400) -> Counter[str]:
    """Call in a loop as a service would; count the tier that served each call."""
    served: Counter[str] = Counter()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        before = {s.graph_id: s.tier for s in hotswap.status(compiled)}
        call()  # type: ignore[operator]
        torch.cuda.synchronize()
        for tier in before.values():
            served[tier] += 1
        statuses = hotswap.status(compiled)
        if statuses and all(s.final for s in statuses):
            return served
        time.sleep(0.02)
    raise AssertionError(f"not final after {timeout_s} s: {hotswap.status(compiled)}")


def _max_autotune_sources(cache_dir: str, tier: str) -> list[str]:
    """Kernel sources stored with ``tier``'s cache entry (what that artifact runs)."""

    from hotswap.cache import ArtifactCache
    from hotswap.engine.loading.artifacts import entry_parts

    cache = ArtifactCache(cache_dir)
    sources = []
    for entry in cache.entries():
        if entry.tier != tier:
            continue
        payload = cache.get(entry.key)
        assert payload is not None
        _, files = entry_parts(payload)
        sources += [bytes(data).decode(errors="replace") for name, data in files.items()
                    if name.endswith(".py")]
    return sources


def test_progressive_bf16_matmul_relu_climbs_and_keeps_the_faster_tier(tmp_path: Path) -> None:
    from triton.testing import do_bench

    torch._dynamo.reset()
    x, y = matmul_relu_inputs()
    salt = unseen_scale()

    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        # A graph no inductor cache has seen, so that its max-autotune compile writes kernel
        # sources for the entry (on a hit of an earlier run's, it wrote none: 2 runs in 3 of
        # this test in one machine failed the sources' check below).
        return matmul_relu(a, b) * salt

    top = TIERS[-1]
    compiled = hotswap.compile(f, mode="progressive", fullgraph=True, cache_dir=str(tmp_path),
                               tiers=TIERS)
    served = _serve_until_final(compiled, lambda: compiled(x, y))
    [status] = hotswap.status(compiled)
    assert not status.failures, status.failures
    assert served["eager"] >= 1  # the first call never waited for a compile
    # The ladder climbed: default served, then max-autotune either swapped in or was measured
    # and kept out by the gate (with the numbers that decided it); a tier measured slower
    # than eager gave way to eager (this graph is launch-bound: 13 µs).
    if status.tier == top:  # default may have given way to eager, or lost to the top tier
        assert [tier for tier, _ in status.kept] in ([], ["default"]), status.kept
    elif status.tier == "default":
        [(tier, why)] = status.kept
        assert tier == top and why.startswith("gate: "), status.kept
    else:
        assert status.tier == "eager" and status.kept, status
        assert any(why.startswith("slower than eager: ") for _, why in status.kept)
        assert all(why.startswith(("slower than eager: ", "gate: ")) for _, why in status.kept)
    assert any("'max_autotune': True" in src for src in _max_autotune_sources(str(tmp_path), top))
    torch.testing.assert_close(compiled(x, y), f(x, y), rtol=2e-2, atol=2e-2)
    # The gate's point: what hotswap serves is no slower than plain torch.compile's default,
    # per call as a caller calling back to back sees it (the gate's measure). This graph is
    # launch-bound: do_bench's device time alone had max-autotune's one template kernel slower
    # than default's two launches (0.0177 against 0.0143 ms on the H100) where a call's time,
    # launches included, had it 1.8x faster.
    plain = torch.compile(f, fullgraph=True)
    plain(x, y)
    ours_ms, plain_ms = _per_call_ms([lambda: compiled(x, y), lambda: plain(x, y)])
    print(f"per call: hotswap ({status.tier}) {ours_ms:.4f} ms, torch.compile default "
          f"{plain_ms:.4f} ms; do_bench: {do_bench(lambda: compiled(x, y)):.4f} ms against "
          f"{do_bench(lambda: plain(x, y)):.4f} ms")
    assert ours_ms <= plain_ms * 1.05, status


def _per_call_ms(fns: list[Any], calls: int = 200, rounds: int = 9) -> list[float]:
    """Each callable's time per call in blocks of back-to-back calls and one synchronize,
    interleaved over ``rounds`` (the median of each)."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, mine in zip(fns, times, strict=True):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            mine.append((time.perf_counter() - start) * 1e3 / calls)
    return [sorted(t)[len(t) // 2] for t in times]


def test_async_500_adds_forward_and_backward() -> None:
    torch._dynamo.reset()

    def model_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = x
        for _ in range(500):
            out = torch.add(out, y)
        return out

    compiled = hotswap.compile(model_add, mode="async", fullgraph=True)

    def step() -> None:
        x = torch.randn(100, 100, device="cuda", requires_grad=True)
        y = torch.randn(100, 100, device="cuda", requires_grad=True)
        out = compiled(x, y)
        out.sum().backward()
        torch.testing.assert_close(out, x + 500 * y, rtol=1e-4, atol=1e-3)
        assert x.grad is not None and y.grad is not None
        torch.testing.assert_close(x.grad, torch.ones_like(x))
        torch.testing.assert_close(y.grad, torch.full_like(y, 500.0))

    with hotswap.counters_delta() as d:
        served = _serve_until_final(compiled, step)
        for _ in range(3):
            step()  # compiled forward and compiled backward
    [status] = hotswap.status(compiled)
    assert status.tier == "default" and not status.failures, status
    assert served["eager"] >= 1 and d["swaps"] == 1 and d["worker_compiles"] == 1


def test_dynamic_batch_on_gpu() -> None:
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                                torch.nn.Linear(128, 8)).cuda()
    compiled = hotswap.compile(model, mode="async", dynamic=True)
    for n in (8, 17, 33):
        x = torch.randn(n, 64, device="cuda")
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-3, atol=1e-3)
    statuses = hotswap.wait(compiled, timeout_s=300)
    assert all(s.final and s.tier == "default" and not s.failures for s in statuses), statuses
    with hotswap.counters_delta() as d:
        for n in (5, 64):
            x = torch.randn(n, 64, device="cuda")
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-3, atol=1e-3)
    assert d["eager_calls"] == 0


def test_worker_killed_during_autotuning_is_retried_and_the_ladder_completes() -> None:
    import os
    import signal
    import threading

    torch._dynamo.reset()
    x, y = matmul_relu_inputs()
    salt = unseen_scale()

    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return matmul_relu(a, b) * salt  # a graph no cache has seen: it really autotunes

    top = TIERS[-1]
    pool = hotswap.runtime().pool(2)
    pool.wait_ready(300)
    killed: list[int] = []

    def on_stage(event: object) -> None:
        # graph_unpickle of the max-autotune job: that worker is about to autotune. Kill it
        # a moment in, while autotuning benchmarks its kernel choices.
        if (getattr(event, "name", "") == "graph_unpickle" and not killed
                and getattr(event, "attrs", {}).get("tier") == top):
            pid = event.pid  # type: ignore[attr-defined]
            killed.append(pid)
            threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()

    unsubscribe = pool.subscribe(on_stage)
    restarts = pool.restarts
    try:
        with hotswap.counters_delta() as d:
            compiled = hotswap.compile(f, mode="progressive", fullgraph=True, tiers=TIERS,
                                       workers=2)
            served = _serve_until_final(compiled, lambda: compiled(x, y))
    finally:
        unsubscribe()
    [status] = hotswap.status(compiled)
    assert killed and d["worker_crashes"] == 1 and pool.restarts == restarts + 1
    assert not status.failures, status  # the retry compiled it
    assert served["eager"] >= 1 and status.final
    # The ladder completed: a tier serves, or every tier was measured and kept out as slower
    # than eager (this graph is launch-bound: 13 µs; as in the progressive test above).
    if status.tier == "eager":
        assert status.kept and {tier for tier, _ in status.kept} <= set(TIERS), status.kept
        assert all(why.startswith(("slower than eager: ", "gate: ")) for _, why in status.kept)
    else:
        assert status.tier in TIERS, status
    torch.testing.assert_close(compiled(x, y), f(x, y), rtol=2e-2, atol=2e-2)


def test_a_fresh_process_loads_gpu_artifacts_without_running_a_compiler(tmp_path: Path) -> None:
    from tests.engine.test_load_guard import check_fresh_loads_run_no_compiler

    check_fresh_loads_run_no_compiler(tmp_path, "cuda")


def test_a_loaded_tier_runs_once_on_copies_before_it_serves() -> None:
    torch._dynamo.reset()
    x, w = matmul_relu_inputs()
    compiled = hotswap.compile(matmul_relu, mode="async", fullgraph=True)
    with torch.no_grad():
        expected = matmul_relu(x, w)
        _serve_until_final(compiled, lambda: compiled(x, w))
        [status] = hotswap.status(compiled)
        assert status.tier == "default" and status.timings_s["default/first_run"] > 0.0
        x.zero_()  # the run read copies: the user's tensors are the user's
        torch.testing.assert_close(compiled(x, w), torch.zeros_like(expected))


def test_a_serving_tiers_calls_are_timed_with_events_on_its_device() -> None:
    from hotswap.engine import served

    torch._dynamo.reset()
    x, w = matmul_relu_inputs()
    compiled = hotswap.compile(matmul_relu, mode="async", fullgraph=True)
    with torch.no_grad():
        _serve_until_final(compiled, lambda: compiled(x, w))
        for _ in range(served.WINDOW + 1):
            compiled(x, w)
    deadline = time.monotonic() + 60
    while "first" not in hotswap.status(compiled)[0].served_ms.get("default", {}):
        assert time.monotonic() < deadline, hotswap.status(compiled)
        time.sleep(0.05)
    served_ms = hotswap.status(compiled)[0].served_ms
    figures = served_ms["default"]
    # device time of a 1152x1024x1024 bf16 matmul and its relu: microseconds, not zero
    assert 0.002 < figures["first"] <= figures["first_max"] < 1000, figures
    if "eager" in served_ms:  # eager served MIN_CALLS calls or more before the swap
        assert 0.002 < served_ms["eager"]["first"] < 1000, served_ms


def test_async_sends_back_a_tier_whose_device_time_shows_it_slower(
        monkeypatch: Any) -> None:
    """Probation on the GPU: eager's calls and the tier's are timed with CUDA events on the
    user's stream. The fake tier's calls leave the device idle 10 ms before their kernels,
    which the events see; eager's take microseconds: the tier gives way after one window."""
    from hotswap.engine import served
    from hotswap.engine.coordinator import Coordinator
    from hotswap.engine.options import Options
    from hotswap.testing.fake import FakeCompiler

    monkeypatch.setattr(served, "WINDOW", 10)
    monkeypatch.setattr(served, "MIN_CALLS", 5)
    torch._dynamo.reset()
    x, w = matmul_relu_inputs()
    expected = matmul_relu(x, w)
    fake = FakeCompiler(hold=True, call_s={"default": 0.010})
    coordinator = Coordinator(Options.create(mode="async", tiers=["default"]), compiler=fake,
                              measure=fake.measure)
    compiled = torch.compile(matmul_relu, backend=coordinator, fullgraph=True)
    with torch.no_grad(), hotswap.counters_delta() as d:
        for _ in range(1 + served.WINDOW):  # eager: its first call, then its window
            torch.testing.assert_close(compiled(x, w), expected)
        fake.release()
        [status] = coordinator.wait(timeout_s=60)
        assert status.tier == "default"
        deadline = time.monotonic() + 60
        while status.tier != "eager":
            assert time.monotonic() < deadline, status
            torch.testing.assert_close(compiled(x, w), expected)
            [status] = coordinator.status()
    assert d["probation_reverts"] == 1 and status.final
    eager, tier = status.served_ms["eager"]["first"], status.served_ms["default"]["first"]
    assert 0.002 < eager < 5 and tier > 9, status.served_ms  # device times, idle gap seen
    assert "faster as served" in status.kept[0][1]


def test_the_first_run_goes_on_the_users_stream() -> None:
    # The caching allocator hands a freed block only to the stream that allocated it: a run on
    # a side stream left the user's stream to grow its own blocks in the first user call.
    from hotswap.engine.loading.first_run import FirstRun

    x, w = matmul_relu_inputs()
    gm = torch.fx.symbolic_trace(matmul_relu)
    user = torch.cuda.Stream()
    with torch.no_grad(), torch.cuda.stream(user):
        run = FirstRun.capture(gm, [x, w])
    assert run is not None
    streams: list[torch.cuda.Stream] = []

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        streams.append(torch.cuda.current_stream())
        return matmul_relu(a, b)

    run.run(fn)  # from this thread, whose current stream is the default one
    assert streams == [user] and torch.cuda.current_stream() != user


def test_the_warm_up_starts_triton_beside_the_imports() -> None:
    # Triton's driver start and its source hash run from the warm-up's start, on a thread
    # beside inductor's imports; a failure there only costs time later, so it is said nowhere
    # a user looks (the first version imported triton_key from where triton 3.6 has none).
    from hotswap.engine.loading import warmup

    assert warmup.wait_warmup(["cuda"], timeout_s=180)
    assert warmup._triton_early.done and warmup._triton_early.error is None

