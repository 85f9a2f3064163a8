"""Inputs as users pass them reach the worker: views, channels-last, plain Python values,
dynamic slices; and a graph that cannot travel still compiles, in this process."""

from __future__ import annotations

import copy
import operator
from typing import Any

import pytest
import torch

import hotswap

pytestmark = pytest.mark.slow


def _served_by_worker(compiled: Any) -> None:
    statuses = hotswap.status(compiled)
    assert statuses and all(s.tier != "eager" and s.path == "worker" for s in statuses), statuses


@pytest.mark.parametrize("layout", ["transposed", "channels_last", "sliced"])
def test_strided_inputs_compile_in_a_worker(layout: str) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x.sin() * 2).sum(dim=-1)

    base = torch.randn(2, 3, 8, 8)
    x = {"transposed": base.transpose(2, 3),
         "channels_last": base.contiguous(memory_format=torch.channels_last),
         "sliced": base[:, :, :, :5]}[layout]
    assert not x.is_contiguous()
    with hotswap.counters_delta() as d:
        compiled = hotswap.compile(f, mode="subprocess", workers=1)
        torch.testing.assert_close(compiled(x), f(x))
    assert d["worker_compiles"] == 1 and d["eager_calls"] == 0
    _served_by_worker(compiled)


def test_dynamic_slices_of_a_longer_batch_compile_in_a_worker() -> None:
    """``ids[:, :n]`` with a changing n: a dynamic graph whose input is a view (its row
    stride is the full length, not n)."""
    table = torch.randn(64, 16)

    def f(ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, table).relu().sum(dim=1)

    ids = torch.randint(0, 64, (3, 40))
    with hotswap.counters_delta() as d:
        compiled = hotswap.compile(f, mode="async", workers=1)
        for n in (8, 12, 16):
            compiled(ids[:, :n])
        hotswap.wait(compiled, timeout_s=240)
        for n in (8, 12, 16, 20, 33):
            torch.testing.assert_close(compiled(ids[:, :n]), f(ids[:, :n]))
    _served_by_worker(compiled)
    assert d["graphs"] == 2 and d["worker_compiles"] == 2  # static first, then dynamic: no more


def test_plain_python_inputs_travel_by_value() -> None:
    """A graph whose inputs include an int, a bool, None and a float (as dynamo passes
    specialized values to a backend). It compiles in the worker wherever inductor compiles it
    in-process; torch 2.11's inductor refuses a bool graph input itself ("Unsupported inductor
    graph input type: BooleanTrue"; torch.compile never hands it one, dynamo specializes
    bools), and then the tier fails with inductor's words and eager serves."""
    graph = torch.fx.Graph()
    x, n, flag, _nothing, scale = (graph.placeholder(name) for name in
                                   ("x", "n", "flag", "nothing", "scale"))
    y = graph.call_function(operator.mul, (x, n))
    y = graph.call_function(operator.add, (y, flag))
    graph.output((graph.call_function(operator.mul, (y, scale)),))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    inputs = [torch.randn(4, 8), 3, True, None, 0.5]
    backend = hotswap.backend(mode="subprocess", workers=1)
    runner = backend(gm, inputs)
    (out,) = runner(*inputs)
    torch.testing.assert_close(out, (inputs[0] * 3 + 1) * 0.5)
    [status] = hotswap.status(backend)
    if status.tier == "eager":  # refused by inductor itself, or a defect of ours
        from torch._inductor.compile_fx import compile_fx

        [(tier, why)] = status.failures
        assert tier == "default" and "Unsupported inductor graph input type" in why, why
        with pytest.raises(Exception, match="Unsupported inductor graph input type"):
            compile_fx(copy.deepcopy(gm), list(inputs))
        return
    assert status.tier == "default" and status.path == "worker", status


class _Offset(torch.nn.Module):
    """A linear layer and batch norm, and a parameter 4 bytes past an aligned address."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.shift = torch.nn.Parameter(torch.zeros(9)[1:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x)) + self.shift


@pytest.mark.parametrize("donation", [True, False], ids=["donated", "deep-copied"])
def test_the_worker_compiles_with_the_static_inputs_torch_compile_marks(
        monkeypatch: pytest.MonkeyPatch, donation: bool) -> None:
    """Parameters and buffers are static under torch.compile (no alignment check per call on
    the GPU); the graph landed in a worker marks the same ones, except one that is not
    aligned, which torch checks at each call and so must the worker's code. Where inductor
    takes no donated graph (torch 2.11: it deep-copies), its copy carries the marks too."""
    from torch._functorch import aot_autograd
    from torch._inductor import utils as inductor_utils

    from hotswap import compat
    from hotswap.engine.shipping.inputs import ALIGNMENT, describe_inputs
    from hotswap.engine.shipping.transport import ship_graph
    from hotswap.jobs.compile import landed

    if donation and not compat._takes_donation():
        pytest.skip("this torch's standalone_compile takes no donated graph (torch 2.11)")
    seen: list[tuple[torch.fx.GraphModule, list[Any]]] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        seen.append((gm, example_inputs))
        return gm.forward

    model = _Offset().eval()
    assert model.shift.data_ptr() % ALIGNMENT != 0
    torch.compile(model, backend=record)(torch.randn(4, 8))
    [(gm, example_inputs)] = seen
    metas = describe_inputs(gm, example_inputs)
    assert not isinstance(metas, str), metas
    aligned = [i for i, x in enumerate(example_inputs) if x.data_ptr() % ALIGNMENT == 0]
    torch_marks = compat.static_input_indices(gm, len(example_inputs))
    shift = next(i for i, x in enumerate(example_inputs) if x is model.shift)
    assert len(torch_marks) == 7 and shift in torch_marks  # two weights and biases, two running
    # statistics, shift
    assert [i for i, m in enumerate(metas) if m.static] == [
        i for i in torch_marks if i in aligned] == [i for i in torch_marks if i != shift]
    worker_gm, inputs, dynamic = landed(ship_graph(gm), metas)
    assert compat.static_input_indices(worker_gm, len(metas)) == [
        i for i in torch_marks if i != shift]
    assert ALIGNMENT == inductor_utils.ALIGNMENT
    # and as the worker's compile reads them (inductor's own copy of the graph would lose
    # the marks: the worker donates it)
    read = aot_autograd._try_get_metadata_from_dynamo
    seen_static: list[list[int]] = []

    def spy(*args: Any) -> Any:
        found = read(*args)
        seen_static.append(list(found[1]))
        return found

    monkeypatch.setattr(aot_autograd, "_try_get_metadata_from_dynamo", spy)
    monkeypatch.setattr(compat, "_takes_donation", lambda: donation)
    with torch.no_grad():
        compat.compile_saveable(worker_gm, inputs, {}, dynamic=dynamic)
    assert seen_static == [[i for i in torch_marks if i != shift]]


class _Stateful(torch.nn.Module):
    """Updates a buffer in place: an artifact made apart from it would update a copy."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add_(x.sum(0))
        return x * 2


@pytest.mark.parametrize("mode", ["async", "progressive", "subprocess"])
def test_a_graph_that_cannot_travel_compiles_in_this_process(mode: str) -> None:
    """cond's artifact cannot be saved: the worker's compile is redone here, and status
    says so; the ladder's other tiers are not compiled (they would need a benchmark here)."""

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.sum() > 0, lambda a: a.sin() * 2, lambda a: a.cos() - 1, (x,))

    x = torch.randn(16, 16)
    with hotswap.counters_delta() as d:
        compiled = hotswap.compile(f, mode=mode, workers=1,
                                   tiers=["default", "max-autotune"] if mode == "progressive"
                                   else None)
        compiled(x)
        (status,) = hotswap.wait(compiled, timeout_s=240)
        for sign in (1, -1):
            torch.testing.assert_close(compiled(sign * x.abs()), f(sign * x.abs()))
    assert status.tier == "default" and status.path.startswith("inprocess: inductor cannot save")
    assert d["inprocess_compiles"] == 1 and not status.failures, status
    if mode == "progressive":
        assert [t for t, _ in status.kept] == ["max-autotune"], status


@pytest.mark.parametrize("mode", ["async", "subprocess"])
def test_submodules_called_as_a_unit_compile_here_with_the_users_weights(mode: str) -> None:
    """A call_module graph (dynamo with nn.Module inlining off) never ships its weights, nor
    is it stored: it compiles in this process, and later changes to the weights show."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x).relu()

    net = Net()
    gm = torch.fx.symbolic_trace(net)
    assert any(n.op == "call_module" for n in gm.graph.nodes)
    x = torch.randn(4, 8)
    backend = hotswap.backend(mode=mode, workers=1)
    with hotswap.counters_delta() as d:
        runner = backend(gm, [x])
        runner(x)
        (status,) = hotswap.wait(backend, timeout_s=240)
    assert d["inprocess_compiles"] == 1 and d["worker_compiles"] == 0, d
    assert status.tier == "default" and status.path.startswith(
        "inprocess: the graph calls submodule 'linear'"), status
    with torch.no_grad():
        net.linear.weight.mul_(2)
    torch.testing.assert_close(runner(x), net(x))


def test_an_input_no_path_can_compile_fails_its_tier_with_both_reasons() -> None:
    """An input neither a worker nor this process can compile for: status names both
    reasons, on_failure="raise" raises TierFailed at the first call, later calls are eager."""

    class Opaque:
        scale = 2.0

    graph = torch.fx.Graph()
    x, opaque = graph.placeholder("x"), graph.placeholder("opaque")
    scale = graph.call_function(getattr, (opaque, "scale"))
    graph.output((graph.call_function(operator.mul, (x, scale)),))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    inputs = [torch.randn(4), Opaque()]
    backend = hotswap.backend(mode="async", workers=1, on_failure="raise")
    runner = backend(gm, inputs)
    (status,) = hotswap.wait(backend, timeout_s=240)
    assert status.tier == "eager" and len(status.failures) == 1, status
    reason = status.failures[0][1]
    assert "graph input opaque of type Opaque cannot travel" in reason
    assert "compiling it in this process failed too" in reason
    with pytest.raises(hotswap.TierFailed) as info:
        runner(*inputs)
    assert info.value.tier == "default"
    (out,) = runner(*inputs)  # raised once; served eagerly again
    torch.testing.assert_close(out, inputs[0] * 2)
