"""Many models of one class (one per tenant, or a model rebuilt to reload weights): every one
compiled, with threads and memory that stay bounded, and dynamo's recompile limit named in
``status`` wherever it is hit."""

from __future__ import annotations

import collections
import gc
import threading
import time
from typing import Any

import psutil
import pytest
import torch

import hotswap
from hotswap.engine import threads
from hotswap.engine.coordinator import Coordinator
from hotswap.engine.options import Options
from hotswap.testing.fake import FakeCompiler

COMPILES = 1000
# hotswap's own threads beside its pool's manager: the idle-pool reaper, the shared backend's
# loader, the warm-up, the cache stamp's lookups.
THREADS_BESIDES_THE_POOL = 4


def _rss_mib() -> float:
    gc.collect()
    return float(psutil.Process().memory_info().rss) / 2**20


def _hotswap_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("hotswap-"))


def test_a_thousand_models_of_one_class_are_all_compiled_with_bounded_threads_and_memory() -> None:
    """Each hotswap.compile made a backend of its own, so dynamo traced the same code again
    for each model, and from the 9th on (recompile_limit) served it plain eager; each backend
    kept a loader thread for good."""
    x = torch.randn(4, 16)
    baseline = threading.active_count()
    # Threads of earlier tests in this process (a fleet store's claim renewal) are theirs.
    earlier = collections.Counter(_hotswap_threads())
    measured: dict[int, tuple[int, float]] = {}
    with hotswap.counters_delta() as d:
        for i in range(COMPILES):
            model = torch.nn.Linear(16, 8)  # fresh weights each time
            compiled = hotswap.compile(model, mode="async", tiers=["default"], workers=1)
            out = compiled(x)
            if i == 0:
                hotswap.wait(compiled, timeout_s=240, raise_on_timeout=True)
            torch.testing.assert_close(out, model(x))
            [status] = hotswap.status(compiled)
            assert (status.tier, status.final, status.failures) == ("default", True, ()), status
            if i + 1 in (50, COMPILES):
                measured[i + 1] = (threading.active_count(), _rss_mib())
            del model, compiled
    (threads_50, rss_50), (threads_all, rss_all) = measured[50], measured[COMPILES]
    print(f"\nthreads: {baseline} before, {threads_50} after 50 compiles, {threads_all} after "
          f"{COMPILES}; RSS {rss_50:.1f} MiB after 50, {rss_all:.1f} MiB after {COMPILES}")
    # One graph, compiled once; only the first model's first call ran before its tier swapped in.
    assert (d["graphs"], d["worker_compiles"], d["swaps"], d["eager_calls"], d["fallbacks"],
            d["recompile_limits"]) == (1, 1, 1, 1, 0, 0)
    assert threads_all <= threads_50
    assert threads_all <= baseline + 1 + THREADS_BESIDES_THE_POOL  # 1: workers=1's manager
    assert rss_all <= rss_50 * 1.05
    hotswap.shutdown()
    assert threads.live() == [] and collections.Counter(_hotswap_threads()) - earlier == {}


def test_fresh_instances_serve_their_own_weights_from_the_shared_compiled_tier() -> None:
    """One backend, one graph: each model's parameters are the graph's inputs, so twelve
    models (more than dynamo's recompile_limit of 8) each compute with their own weights."""
    torch.manual_seed(1)
    models = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()) for _ in range(12)]
    x = torch.randn(2, 8)
    with hotswap.counters_delta() as d:
        compiled = [hotswap.compile(m, mode="subprocess", workers=1) for m in models]
        outputs = [c(x) for c in compiled]
    for model, out in zip(models, outputs, strict=True):
        torch.testing.assert_close(out, model(x))
    assert len({round(float(o.detach().sum()), 4) for o in outputs}) == len(models)  # not one model's
    assert [[s.tier for s in hotswap.status(c)] for c in compiled] == [["default"]] * 12
    assert (d["graphs"], d["worker_compiles"], d["eager_calls"], d["recompile_limits"]) == (
        1, 1, 0, 0)


def test_equal_options_share_a_backend_other_options_and_classes_do_not() -> None:
    from hotswap.engine.api import _coordinators

    def backend_of(compiled: Any) -> Coordinator:
        [coordinator] = _coordinators(compiled)
        return coordinator

    a = hotswap.compile(torch.nn.Linear(4, 4), mode="async", tiers=["default"], workers=1)
    b = hotswap.compile(torch.nn.Linear(4, 4), mode="async", tiers=["default"], workers=1)
    custom = [{"name": "t", "config": {"max_fusion_size": 1}}]
    c = hotswap.compile(torch.nn.Linear(4, 4), mode="async", tiers=custom, workers=1)
    c2 = hotswap.compile(torch.nn.Linear(4, 4), mode="async", tiers=custom, workers=1)
    other_class = hotswap.compile(torch.nn.Sequential(torch.nn.Linear(4, 4)), mode="async",
                                  tiers=["default"], workers=1)
    assert backend_of(a) is backend_of(b)
    assert backend_of(c) is backend_of(c2) is not backend_of(a)  # a tier's config: a dict
    assert backend_of(other_class) is not backend_of(a)
    torch._dynamo.reset()  # dynamo let go of every graph: later models get a new backend
    after_reset = hotswap.compile(torch.nn.Linear(4, 4), mode="async", tiers=["default"],
                                  workers=1)
    assert backend_of(after_reset) is not backend_of(a)


def _shapes_fn(x: torch.Tensor) -> torch.Tensor:
    return x.sin() + 1


def _fake_backend() -> Coordinator:
    fake = FakeCompiler()
    return Coordinator(Options.create(mode="async", tiers=["default"]), compiler=fake,
                       measure=fake.measure)


@pytest.mark.parametrize("cause", ["new shapes", "new backends"])
def test_a_recompile_limit_hit_is_named_in_status(cause: str) -> None:
    """Past the limit dynamo runs the frame itself, outside any backend: status said nothing
    (a backend that got no graph had no status at all)."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=2), hotswap.counters_delta() as d:
        if cause == "new shapes":  # one backend, a graph per shape (dynamic=False), then none
            backend = _fake_backend()
            compiled = torch.compile(_shapes_fn, backend=backend, dynamic=False)
            for n in (2, 3, 4, 5):
                torch.testing.assert_close(compiled(torch.ones(n)), _shapes_fn(torch.ones(n)))
            hit, graphs = backend, 2
        else:  # a backend per compile of one function: the third finds the limit reached
            backends = [_fake_backend() for _ in range(3)]
            for backend in backends:
                compiled = torch.compile(_shapes_fn, backend=backend, dynamic=False)
                torch.testing.assert_close(compiled(torch.ones(3)), _shapes_fn(torch.ones(3)))
            hit, graphs = backends[2], 0
        statuses = hotswap.status(hit)
    assert len(statuses) == graphs
    [note] = statuses.notes
    assert "torch._dynamo.config.recompile_limit (2)" in note and "_shapes_fn" in note, note
    assert ("BACKEND_MATCH" in note) == (cause == "new backends")
    assert "note: dynamo hit" in str(statuses)
    assert d["recompile_limits"] == 1
    if cause == "new backends":
        assert all(hotswap.status(b).notes == [] for b in backends[:2])


def test_a_loader_thread_ends_when_idle_and_the_next_task_starts_another() -> None:
    loader = threads.Lane("hotswap-load-test", idle_exit_s=0.05)
    seen: list[int] = []
    for i in range(3):
        loader.submit(seen.append, i)
    assert _wait_until(lambda: "hotswap-load-test" not in _hotswap_threads())
    assert seen == [0, 1, 2]
    done = threading.Event()
    loader.submit(seen.append, 3)
    loader.submit(done.set)
    assert done.wait(10) and seen == [0, 1, 2, 3]


def test_shutdown_ends_the_idle_load_thread_at_once_and_drops_its_timers() -> None:
    done = threading.Event()
    fired: list[int] = []
    threads.scheduler.submit(done.set)
    threads.scheduler.later(0.5, fired.append, 1)  # a gate retry due after the shutdown
    assert done.wait(10) and "hotswap-load" in _hotswap_threads()
    hotswap.shutdown()
    assert "hotswap-load" not in _hotswap_threads()
    again = threading.Event()
    threads.scheduler.submit(again.set)  # it works after a shutdown, on a new thread
    assert again.wait(10)
    threading.Event().wait(1.0)
    assert fired == []


def _wait_until(condition: Any, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
