"""A loaded tier's first run before it serves (hotswap/engine/loading/first_run.py): which
graphs get one, what is copied, and that a loaded tier runs once on the copies before the
user's next call reaches it. CUDA alone gets runs in production; these tests count the CPU as
such a device (``LAZY_DEVICES``) to see the path without a GPU."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import hotswap
from hotswap.engine.coordinator import Coordinator
from hotswap.engine.loading import first_run
from hotswap.engine.loading.first_run import FirstRun
from hotswap.engine.options import Options
from hotswap.testing.fake import FakeCompiler


@pytest.fixture
def cpu_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(first_run, "LAZY_DEVICES", ("cuda", "cpu"))


def _graph(fn: object, *inputs: object) -> torch.fx.GraphModule:
    return torch.fx.symbolic_trace(fn)  # type: ignore[arg-type]


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w


def _in_place(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.add_(w.sum())


def test_a_cpu_graph_gets_no_run() -> None:
    with torch.no_grad():
        assert FirstRun.capture(_graph(_linear), [torch.randn(2, 3), torch.randn(3, 4)]) is None


def test_the_copies_keep_strides_and_parameters_are_not_copied(cpu_runs: None) -> None:
    x = torch.randn(4, 3).t()  # not contiguous
    w = torch.nn.Parameter(torch.randn(4, 5))
    with torch.no_grad():
        run = FirstRun.capture(_graph(_linear), [x, w])
    assert run is not None
    copy, param = run._inputs
    assert param is w and copy is not x and copy.stride() == x.stride()
    torch.testing.assert_close(copy, x)
    x.zero_()  # the user's tensor changes; the copy does not
    assert copy.abs().sum() > 0
    assert run.run(lambda a, b: a @ b) >= 0.0


@pytest.mark.parametrize("case", ["in place", "grad enabled, a parameter needs grad",
                                  "input needs grad", "too large", "symbolic"])
def test_no_run_where_it_would_not_be_safe(case: str, cpu_runs: None,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    x, w = torch.randn(3, 4), torch.randn(4, 4)
    gm = _graph(_in_place if case == "in place" else _linear)
    if case == "input needs grad":
        x.requires_grad_(True)
    if case.startswith("grad enabled"):
        w = torch.nn.Parameter(w)  # requires grad: the user's calls build autograd graphs
    if case == "too large":
        monkeypatch.setattr(first_run, "MAX_COPY_BYTES", 16)
    inputs: list[object] = [x, w] if case != "symbolic" else [x, object()]
    with torch.set_grad_enabled(case.startswith("grad enabled")):
        assert FirstRun.capture(gm, inputs) is None


@pytest.mark.parametrize("grad", [False, True])
def test_a_model_served_without_no_grad_still_gets_its_run(grad: bool, cpu_runs: None) -> None:
    """A model called with grad enabled whose parameters need no grad (served without
    ``torch.no_grad()``: the corpus's models in the bench) builds no autograd graph in its
    calls, and gets its run; a parameter that needs grad gets a run only with grad disabled,
    and the run records nothing for autograd even where the thread that runs it has grad on."""
    x = torch.randn(3, 4)
    frozen = torch.nn.Parameter(torch.randn(4, 4), requires_grad=False)
    trained = torch.nn.Parameter(torch.randn(4, 4))
    with torch.set_grad_enabled(grad):
        run = FirstRun.capture(_graph(_linear), [x, frozen])
        assert run is not None and run._inputs[1] is frozen
        trained_run = FirstRun.capture(_graph(_linear), [x, trained])
    assert (trained_run is None) == grad
    if trained_run is not None:
        out: list[torch.Tensor] = []
        with torch.enable_grad():
            trained_run.run(lambda a, b: out.append(a @ b))
        assert out[0].grad_fn is None


def test_a_loaded_tier_runs_once_on_the_copies_before_it_serves(cpu_runs: None) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(3, 8)
    fake = FakeCompiler(hold=True)
    coordinator = Coordinator(Options.create(mode="async"), compiler=fake)
    compiled = torch.compile(model, backend=coordinator)
    with torch.no_grad():
        expected = model(x)
        torch.testing.assert_close(compiled(x), expected)  # eager: the tier is held
        fake.release()
        [status] = coordinator.wait(timeout_s=30)
        assert status.tier == "default" and fake.calls["default"] == 1  # its first run
        assert status.timings_s["default/first_run"] >= 0.0
        for _ in range(3):
            torch.testing.assert_close(compiled(x), expected)
    assert fake.calls["default"] == 4  # the run, then the three calls
    [done] = coordinator.status()
    assert done.final


def _draws(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x @ w) + torch.randn_like(w)


def _dropout(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.dropout(x @ w, 0.1, True)


def _eval_dropout(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.dropout(x @ w, 0.1, False)


def _sets_item() -> torch.fx.GraphModule:
    """``w[0] = 1.0; return x @ w`` (symbolic tracing cannot assign items)."""
    import operator

    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    graph.call_function(operator.setitem, (w, 0, 1.0))
    graph.output(graph.call_function(operator.matmul, (x, w)))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize(("fn", "runs"), [(_draws, False), (_dropout, False),
                                          (_eval_dropout, True), (None, False)],
                         ids=["random", "dropout in training", "dropout in eval", "setitem"])
def test_graphs_that_draw_random_numbers_or_assign_items_get_no_run(
        fn: object, runs: bool, cpu_runs: None) -> None:
    gm = _sets_item() if fn is None else _graph(fn)
    with torch.no_grad():
        run = FirstRun.capture(gm, [torch.randn(3, 4), torch.randn(4, 4)])
    assert (run is not None) is runs


def _updates_its_own() -> torch.fx.GraphModule:
    """``y = x @ w; y += x; return relu(y).add_(1)``, as dynamo records ResNet's blocks adding
    their shortcut (symbolic tracing records ``+=`` as ``+``)."""
    import operator

    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    y = graph.call_function(operator.iadd, (graph.call_function(operator.matmul, (x, w)), x))
    graph.output(graph.call_method("add_", (graph.call_function(torch.relu, (y,)), 1)))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _updates_a_view(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    w.t()[0].add_(1)
    return x @ w


def _updates_through_the_identity(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = torch.nn.functional.dropout(w, 0.0, False)  # returns w itself
    return x @ y.add_(1)


def _steps_a_list(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    torch._foreach_add_([x, w], 1.0)  # as an optimizer's step updates its parameters
    return x @ w


def _writes_out(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    torch.add(x @ w, 1, out=w)
    return w


@pytest.mark.parametrize(("fn", "runs"), [
    (_updates_its_own, True), (_updates_a_view, False), (_updates_through_the_identity, False),
    (_writes_out, False), (_steps_a_list, False)],
    ids=["its own tensor", "a view of an input", "an input itself", "out= an input",
         "a list of inputs"])
def test_an_update_in_place_of_a_tensor_the_graph_made_still_gets_a_run(
        fn: object, runs: bool, cpu_runs: None) -> None:
    with torch.no_grad():
        gm = _updates_its_own() if fn is _updates_its_own else _graph(fn)
        run = FirstRun.capture(gm, [torch.randn(4, 4), torch.randn(4, 4)])
    assert (run is not None) is runs


def test_every_graphs_copies_together_stay_under_the_limit(
        cpu_runs: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(first_run, "_held_bytes", 0)
    monkeypatch.setattr(first_run, "MAX_COPY_BYTES", 3 * (3 * 4 + 4 * 4) * 4 - 1)  # 2 graphs
    with torch.no_grad():
        runs = [FirstRun.capture(_graph(_linear), [torch.randn(3, 4), torch.randn(4, 4)])
                for _ in range(3)]
        assert [r is not None for r in runs] == [True, True, False]
        del runs  # their copies go: room again
        assert FirstRun.capture(_graph(_linear), [torch.randn(3, 4), torch.randn(4, 4)])


def test_each_calling_thread_makes_the_tiers_cudnn_calls_before_the_tier_serves_it(
        cpu_runs: None) -> None:
    """cuDNN keeps its plans per thread (per_thread.py): the first run notes the tier's
    convolutions, and after the swap the calling thread makes each once, one per call, while
    eager still answers; then the tier serves. (On the CPU the same calls are noted and made:
    the path, not the plans.)"""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(),
                                torch.nn.Conv2d(4, 2, 1)).eval()
    x = torch.randn(2, 3, 8, 8)
    fake = FakeCompiler(hold=True)
    coordinator = Coordinator(Options.create(mode="async"), compiler=fake)
    compiled = torch.compile(model, backend=coordinator)
    with torch.no_grad(), hotswap.counters_delta() as d:
        expected = model(x)
        torch.testing.assert_close(compiled(x), expected)
        fake.release()
        [status] = coordinator.wait(timeout_s=30)
        assert status.tier == "default" and fake.calls["default"] == 1  # its first run
        served_by_tier = []
        for _ in range(4):
            torch.testing.assert_close(compiled(x), expected)
            served_by_tier.append(fake.calls["default"] - 1)
        # two convolutions: two calls answered eagerly while this thread made them
        assert served_by_tier == [0, 0, 1, 2]
        other: list[int] = []  # a thread calling later is served by the tier at once

        def call_from_another_thread() -> None:
            with torch.no_grad():  # grad mode is per thread: the same graph
                compiled(x)
            other.append(fake.calls["default"])

        thread = threading.Thread(target=call_from_another_thread)
        thread.start()
        thread.join()
        assert other == [4]
    assert (d["eager_calls"], d["swaps"], d["graphs"]) == (3, 1, 1)


def test_a_thread_makes_the_noted_calls_on_empty_tensors_of_their_layout() -> None:
    from hotswap.engine.loading.per_thread import PerThread, PlanRecorder

    weight = torch.randn(4, 3, 3, 3)
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    recorder = PlanRecorder()
    with recorder:
        torch.nn.functional.conv2d(x, weight)
        torch.relu(x)  # not an op with a per-thread plan
    [(func, args, _)] = recorder.calls
    assert func._schema.name == "aten::convolution"
    seen: list[tuple[Any, ...]] = []
    work = PerThread(lambda: None, recorder.calls)

    def spy(*a: Any, **k: Any) -> Any:
        seen.append(tuple((t.shape, t.stride(), t.dtype) for t in a[:2]))
        return func(*a, **k)

    work.calls = [(spy, args, {})]
    done = []
    thread = threading.Thread(target=lambda: done.extend([work.step(), work.step()]))
    thread.start()
    thread.join()
    assert done == [True, False]
    assert seen == [((x.shape, x.stride(), x.dtype), (weight.shape, weight.stride(),
                                                      weight.dtype))]
    assert work.step() and not work.step()  # this thread makes its own


def test_a_noted_call_that_fails_leaves_the_rest_to_the_tier() -> None:
    from hotswap.engine.loading.per_thread import PerThread

    def fails(*args: Any) -> Any:
        raise RuntimeError("no plan")

    work = PerThread(lambda: None, [(fails, (), {}), (fails, (), {})])
    assert work.step() and not work.step()
