"""A CUDA-graph tier's outputs: lent while nothing outside holds an earlier loan, copied
otherwise (engine/loading/cudagraphs.py). The graphs here are stand-ins that write their
outputs on the CPU as a replay would; the capture itself runs in tests/gpu."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hotswap.engine.loading.cudagraphs import CudaGraphed, Outputs


class _Replays:
    """A captured graph's stand-in: each replay writes 2 * the static input into its output."""

    def __init__(self, static: torch.Tensor) -> None:
        self.static = static
        self.out = torch.empty_like(static)
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        torch.mul(self.static, 2, out=self.out)


def _graphed(monkeypatch: pytest.MonkeyPatch) -> tuple[CudaGraphed, list[_Replays]]:
    """A CudaGraphed past its capture, the input copied into a buffer on each call."""
    graphed = CudaGraphed(lambda x: x * 2, "g1")
    static = torch.zeros(4)
    graphs: list[_Replays] = []

    def record() -> tuple[Any, Outputs]:
        graph = _Replays(static)
        graphs.append(graph)
        return graph, Outputs(graph.out, [static])

    monkeypatch.setattr(graphed, "_record", record)
    monkeypatch.setattr("hotswap.engine.loading.cudagraphs._layout", lambda x: x.shape)
    graphed._static, graphed._moved = [static], [0]
    graphed._graphs.append(record())
    return graphed, graphs


def _lending(graphed: CudaGraphed) -> bool:
    return graphed.lending


def test_outputs_are_lent_only_while_nothing_outside_holds_them() -> None:
    buffer, argument = torch.zeros(4), torch.ones(3)
    outputs = Outputs((buffer, buffer[:2], argument, 7), [argument])
    assert outputs.free()
    lent = outputs.hand_out(lend=True)
    assert lent[0].data_ptr() == buffer.data_ptr() and lent[3] == 7
    assert lent[2].data_ptr() != argument.data_ptr()  # on an argument's memory: a copy
    assert not outputs.free()
    view = lent[1]
    del lent
    assert not outputs.free()  # a view of the graph's memory is still held
    del view
    assert outputs.free()
    copies = outputs.hand_out(lend=False)
    assert all(c.data_ptr() != buffer.data_ptr() for c in copies[:3])
    assert outputs.free()  # copies hold nothing of the graph's
    del copies


def test_outputs_dropped_at_once_are_lent_from_one_graph(
        monkeypatch: pytest.MonkeyPatch) -> None:
    graphed, graphs = _graphed(monkeypatch)
    addresses = set()
    for i in range(6):
        out = graphed(torch.full((4,), float(i)))
        torch.testing.assert_close(out, torch.full((4,), 2.0 * i))
        addresses.add(out.data_ptr())
        del out
    # Two calls return copies; from the third the graph's own output is lent.
    assert _lending(graphed) and len(graphs) == 1
    assert graphs[0].out.data_ptr() in addresses and len(addresses) <= 3


def test_the_last_output_kept_while_calling_again_gets_a_second_graph(
        monkeypatch: pytest.MonkeyPatch) -> None:
    graphed, graphs = _graphed(monkeypatch)
    out = graphed(torch.full((4,), -1.0))
    for i in range(8):
        previous, want = out, out.clone()
        out = graphed(torch.full((4,), float(i)))  # `previous` is held during the call
        torch.testing.assert_close(out, torch.full((4,), 2.0 * i))
        torch.testing.assert_close(previous, want)  # not overwritten
        del previous
    assert _lending(graphed) and len(graphs) == 2
    assert out.data_ptr() in {g.out.data_ptr() for g in graphs}
    assert graphs[0].replays + graphs[1].replays == 9


def test_outputs_kept_for_good_are_never_overwritten(monkeypatch: pytest.MonkeyPatch) -> None:
    graphed, graphs = _graphed(monkeypatch)
    for _ in range(4):  # lending from one graph
        graphed(torch.ones(4))
    assert _lending(graphed)
    kept = [graphed(torch.full((4,), float(i))) for i in range(10)]
    for i, out in enumerate(kept):
        torch.testing.assert_close(out, torch.full((4,), 2.0 * i))
    # Both graphs' outputs kept: they are let go, and a third graph returns copies.
    assert not _lending(graphed) and len(graphs) == 3 and len(graphed._graphs) == 1
    replays = graphs[2].replays
    more = [graphed(torch.full((4,), -float(i))) for i in range(3)]  # kept too: replayed
    assert graphs[2].replays == replays + 3
    for i, out in enumerate(more):
        torch.testing.assert_close(out, torch.full((4,), -2.0 * i))
    for i, out in enumerate(kept):
        torch.testing.assert_close(out, torch.full((4,), 2.0 * i))


def test_a_second_graph_that_fails_ends_lending(monkeypatch: pytest.MonkeyPatch) -> None:
    graphed, graphs = _graphed(monkeypatch)
    for _ in range(4):
        graphed(torch.ones(4))
    assert _lending(graphed)

    def fail() -> None:
        raise torch.OutOfMemoryError("no room for a second pool")

    monkeypatch.setattr(graphed, "_record", fail)
    kept = [graphed(torch.full((4,), float(i))) for i in range(6)]
    for i, out in enumerate(kept):
        torch.testing.assert_close(out, torch.full((4,), 2.0 * i))
    assert not _lending(graphed) and len(graphs) == 1
