"""What may travel to a worker: graphs that update their attribute tensors in place may not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hotswap
from hotswap.engine.shipping.transport import mutated_attributes


class _State(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("a", torch.zeros(4))
        self.register_buffer("b", torch.zeros(2, 2))
        for name in ("c", "d", "e", "w"):
            self.register_buffer(name, torch.ones(4))


class _Updates(_State):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.a.add_(x)                           # direct
        self.b.view(x.shape).mul_(x)             # through a view
        torch.add(x, 1, out=self.c)              # out=
        self.d[0] = x[0]                         # setitem
        torch._foreach_add_([self.e], [x])       # a foreach op, on a list
        y = self.w * x                           # a new tensor: updating it is fine
        y.add_(1)
        return x + y


class _Reads(_State):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.add_(self.w)                           # inputs: AOTAutograd carries the update back
        return x * self.a


def test_in_place_updates_of_attributes_are_found_through_views() -> None:
    assert mutated_attributes(torch.fx.symbolic_trace(_Updates())) == ["a", "b", "c", "d", "e"]


def test_reading_attributes_and_updating_inputs_is_not_flagged() -> None:
    assert mutated_attributes(torch.fx.symbolic_trace(_Reads())) == []


@pytest.mark.parametrize("mode", ["inprocess", "async"])
def test_optimizer_step_updates_the_users_parameters(mode: str, tmp_path: Path) -> None:
    """The step graph never goes to a worker (a stored artifact of it updated copies:
    parameters 0.048 off after 3 steps): it compiles in this process, unstored, and status
    names that path and why."""
    torch.manual_seed(0)

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        return net, torch.optim.SGD(net.parameters(), lr=0.1)

    net, opt = make()
    twin, twin_opt = make()
    twin.load_state_dict(net.state_dict())

    def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()

    compiled = hotswap.compile(lambda x: step(net, opt, x), mode=mode, workers=2,
                               cache_dir=str(tmp_path))
    xs = [torch.randn(4, 8) for _ in range(3)]
    for x in xs:
        compiled(x)
        step(twin, twin_opt, x)
    statuses = hotswap.wait(compiled, timeout_s=240)
    for x in xs:  # and again once every graph is final
        compiled(x)
        step(twin, twin_opt, x)
    for p, q in zip(net.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    assert all(s.tier == "default" and not s.failures for s in statuses), statuses
    held = [s for s in statuses if "holds as attributes" in s.path]
    if mode == "inprocess":
        assert not held and {s.path for s in statuses} == {"inprocess"}, statuses
    else:
        assert len(held) == 1 and held[0].path.startswith("inprocess: "), statuses
        assert any(s.path == "worker" for s in statuses)  # the forward graph travelled


def test_a_graph_says_where_it_came_from() -> None:
    from hotswap.engine.shipping.transport import origin_of

    seen: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> object:
        seen.append(gm)
        return gm.forward

    class Net(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x * 2).relu()

    torch.compile(Net(), backend=capture)(torch.randn(3))
    assert origin_of(seen[0]).startswith("forward (test_transport.py:")
    # torch's modules alone: dynamo keeps none of their frames; the module names it.
    torch.compile(torch.nn.Sequential(torch.nn.Linear(3, 3)), backend=capture)(torch.randn(3))
    assert origin_of(seen[1]) == "Sequential.forward"
    assert origin_of(torch.fx.symbolic_trace(Net())) == ""  # no stack recorded: no label
